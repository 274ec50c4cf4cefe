//! The IR verifier: checks a graph's invariants after lowering and after
//! every pass (as Cranelift's `verifier`).
//!
//! Invariants of every graph (forward step or backward step):
//! 1. The graph is acyclic.
//! 2. Every value has exactly its op's number of operands, in slots `0..n`
//!    (`concat` at least one).
//! 3. Types agree with the op: unary ops keep the operand's type; binary ops
//!    take two operands of the result's type; `broadcast` takes a scalar and
//!    gives a vector; `matvec` takes `[m, n]` and `[n]` and gives `[m]`;
//!    `matvect` takes `[m, n]` and `[m]` and gives `[n]`; `outer` takes `[m]`
//!    and `[n]` and gives `[m, n]`; reductions take a vector and give a
//!    scalar; `slice` gives a vector no longer than its operand, `pad` one
//!    no shorter; `concat` gives a vector whose dimension is the sum of its
//!    operands'.
//! 4. Matrices are parameters, outer products, or sums of matrices, and are
//!    read only as operand 0 of `matvec`/`matvect` or by `add`.
//! 5. Leaves (`input`, `state`, `param`, `seed`) have indices in range and
//!    the declared type.
//!
//! And of a forward [`Cell`]: no `seed`s; `output` and every next state
//! exist, next states have their state's type, and the output is a vector.

use super::{BinaryOp, Cell, Graph, Op, Type, ValueId};
use crate::dims::Dim;
use std::fmt;

/// An invariant the IR breaks: always a compiler bug, never a user error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    /// The value that breaks it; `None` when no single value does (e.g. there are not as many next states as states).
    pub value: Option<ValueId>,
    /// Which invariant is broken, and how.
    pub message: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.value {
            Some(v) => write!(f, "IR verifier: {v}: {}", self.message),
            None => write!(f, "IR verifier: {}", self.message),
        }
    }
}

impl std::error::Error for VerifyError {}

/// The declared types of a graph's leaves.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Leaves<'a> {
    pub(crate) inputs: &'a [Type],
    pub(crate) states: &'a [Type],
    pub(crate) params: &'a [Type],
    pub(crate) seeds: &'a [Type],
    pub(crate) masks: &'a [Type],
}

/// The types a graph's leaves have, by kind and index: what a pass must keep
/// (it may remove a leaf, never change one). Lets a pass be verified
/// without the cell it came from.
#[derive(Clone, Debug, Default)]
pub(crate) struct LeafTypes {
    inputs: Vec<Type>,
    states: Vec<Type>,
    params: Vec<Type>,
    seeds: Vec<Type>,
    masks: Vec<Type>,
}

impl LeafTypes {
    /// The leaves `graph` has now. An index no leaf has gets a placeholder
    /// type, which no value can be checked against.
    pub(crate) fn of(graph: &Graph) -> LeafTypes {
        let mut t = LeafTypes::default();
        for v in graph.values() {
            let node = graph.node(v);
            let (list, i) = match node.op {
                Op::Input(i) => (&mut t.inputs, i),
                Op::State(i) => (&mut t.states, i),
                Op::Param(i) => (&mut t.params, i),
                Op::Seed(i) => (&mut t.seeds, i),
                Op::Mask(i) => (&mut t.masks, i),
                _ => continue,
            };
            if list.len() <= i {
                list.resize(i + 1, Type::Scalar);
            }
            list[i] = node.ty.clone();
        }
        t
    }

    pub(crate) fn leaves(&self) -> Leaves<'_> {
        Leaves {
            inputs: &self.inputs,
            states: &self.states,
            params: &self.params,
            seeds: &self.seeds,
            masks: &self.masks,
        }
    }
}

/// Checks a forward step: the generic invariants plus the cell's own.
pub fn verify(cell: &Cell) -> Result<(), Vec<VerifyError>> {
    let inputs: Vec<Type> = cell.inputs.iter().map(|d| Type::Vector(d.dim.clone())).collect();
    let states: Vec<Type> = cell.states.iter().map(|d| Type::Vector(d.dim.clone())).collect();
    let params: Vec<Type> = cell.params.iter().map(|p| p.ty.clone()).collect();
    let masks = cell.mask_types();
    let leaves = Leaves { inputs: &inputs, states: &states, params: &params, seeds: &[], masks: &masks };
    let mut errors = verify_graph(cell, leaves);
    let mut err = |value: Option<ValueId>, message: String| errors.push(VerifyError { value, message });
    if cell.next_states.len() != cell.states.len() {
        err(None, format!("{} states but {} next states", cell.states.len(), cell.next_states.len()));
    }
    for (s, v) in cell.states.iter().zip(&cell.next_states) {
        if !cell.contains(*v) {
            err(Some(*v), format!("next state `{}` is not in the graph", s.name));
        } else if cell.ty(*v) != &Type::Vector(s.dim.clone()) {
            err(Some(*v), format!("next state `{}` has type {}, not [{}]", s.name, cell.ty(*v), s.dim));
        }
    }
    if !cell.contains(cell.output) {
        err(Some(cell.output), "output is not in the graph".into());
    } else if !matches!(cell.ty(cell.output), Type::Vector(_)) {
        err(Some(cell.output), format!("output has type {}", cell.ty(cell.output)));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// Checks the invariants every graph has; returns all violations found.
pub(crate) fn verify_graph(graph: &Graph, leaves: Leaves) -> Vec<VerifyError> {
    let mut errors = Vec::new();
    let mut err = |value: Option<ValueId>, message: String| errors.push(VerifyError { value, message });

    if let Err(v) = graph.topo_order() {
        err(Some(v), "value is on a cycle".into());
    }

    for v in graph.values() {
        let node = graph.node(v);
        let operands = graph.operands(v);
        let slots = graph.operand_slots(v);
        if slots.iter().enumerate().any(|(i, s)| *s as usize != i) {
            err(Some(v), format!("operand slots {slots:?} are not 0..{}", slots.len()));
        }
        match node.op.arity() {
            Some(n) if operands.len() != n => {
                err(Some(v), format!("`{}` takes {n} operands, has {}", node.op, operands.len()));
                continue;
            }
            None if operands.is_empty() => {
                err(Some(v), format!("`{}` needs at least one operand", node.op));
                continue;
            }
            _ => {}
        }
        let ty = |i: usize| graph.ty(operands[i]);
        for (slot, o) in operands.iter().enumerate() {
            let reads_matrix = matches!(graph.ty(*o), Type::Matrix(..));
            let allowed = matches!(node.op, Op::MatVec | Op::MatVecT) && slot == 0
                || node.op == Op::Binary(BinaryOp::Add);
            if reads_matrix && !allowed {
                err(Some(v), format!("reads matrix {o} outside `matvec`/`matvect` operand 0 or `add`"));
            }
        }
        let leaf = |what: &str, i: usize, decls: &[Type]| match decls.get(i) {
            None => Some(format!("{what} index {i} out of range")),
            Some(t) if &node.ty != t => Some(format!("{what} type {} is not {t}", node.ty)),
            _ => None,
        };
        let is_matrix = matches!(node.ty, Type::Matrix(..));
        let problem: Option<String> = match &node.op {
            Op::Input(i) => leaf("input", *i, leaves.inputs),
            Op::State(i) => leaf("state", *i, leaves.states),
            Op::Param(i) => leaf("param", *i, leaves.params),
            Op::Seed(i) => leaf("seed", *i, leaves.seeds),
            Op::Mask(i) => leaf("mask", *i, leaves.masks),
            Op::Const(c) => {
                (!c.is_finite() || node.ty != Type::Scalar).then(|| format!("bad constant {c}: {}", node.ty))
            }
            Op::DimValue(_) => (node.ty != Type::Scalar).then(|| format!("dimvalue of type {}", node.ty)),
            Op::Unary(_) => {
                (ty(0) != &node.ty || is_matrix).then(|| format!("unary op on {} gives {}", ty(0), node.ty))
            }
            Op::Binary(op) => (ty(0) != &node.ty || ty(1) != &node.ty || (is_matrix && *op != BinaryOp::Add))
                .then(|| format!("{} on {} and {} gives {}", op.name(), ty(0), ty(1), node.ty)),
            Op::Select => (ty(0) != &node.ty || ty(1) != &node.ty || ty(2) != &node.ty || is_matrix)
                .then(|| format!("select on {}, {} and {} gives {}", ty(0), ty(1), ty(2), node.ty)),
            Op::Broadcast => (ty(0) != &Type::Scalar || !matches!(node.ty, Type::Vector(_)))
                .then(|| format!("broadcast of {} to {}", ty(0), node.ty)),
            Op::MatVec => match (ty(0).product_dims(), ty(1), &node.ty) {
                (Some((m, n)), Type::Vector(k), Type::Vector(r)) if &n == k && &m == r => None,
                _ => Some(format!("matvec of {} and {} gives {}", ty(0), ty(1), node.ty)),
            },
            Op::MatVecT => match (ty(0).product_dims(), ty(1), &node.ty) {
                (Some((m, n)), Type::Vector(k), Type::Vector(r)) if &m == k && &n == r => None,
                _ => Some(format!("matvect of {} and {} gives {}", ty(0), ty(1), node.ty)),
            },
            Op::Outer => match (ty(0), ty(1), node.ty.product_dims()) {
                (Type::Vector(a), Type::Vector(b), Some((m, n))) if a == &m && b == &n => None,
                (a, b, _) => Some(format!("outer of {a} and {b} gives {}", node.ty)),
            },
            Op::Reduce(_) => (!matches!(ty(0), Type::Vector(_)) || node.ty != Type::Scalar)
                .then(|| format!("reduction of {} gives {}", ty(0), node.ty)),
            Op::Slice { offset } => fits("slice", ty(0), &node.ty, offset),
            Op::Pad { offset } => fits("pad", &node.ty, ty(0), offset),
            Op::Concat => {
                let mut total = Some(Dim::default());
                for i in 0..operands.len() {
                    total = match (total, ty(i)) {
                        (Some(t), Type::Vector(d)) => t.checked_add(d),
                        _ => None,
                    };
                }
                match (total, &node.ty) {
                    (Some(t), Type::Vector(d)) if &t == d => None,
                    _ => Some(format!("concat operands do not add up to {}", node.ty)),
                }
            }
        };
        if let Some(p) = problem {
            err(Some(v), p);
        }
    }
    errors
}

/// `part` at `offset` must fit in `whole` (checked where the slack is a constant).
fn fits(what: &str, whole: &Type, part: &Type, offset: &Dim) -> Option<String> {
    match (whole, part) {
        (Type::Vector(full), Type::Vector(len)) => {
            let rest = full.checked_sub(offset).and_then(|r| r.checked_sub(len));
            match rest.and_then(|r| r.as_constant()) {
                Some(c) if c < 0 => Some(format!("{what} [{offset} +{len}] runs past [{full}]")),
                _ => None,
            }
        }
        (a, r) => Some(format!("{what} between {a} and {r}")),
    }
}

/// Broken IR, one invariant at a time (as Cranelift's verifier filetests):
/// each case starts from a valid cell, breaks one thing, and expects the
/// verifier to name it.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Node;
    use crate::ir::UnaryOp;

    const RNN: &str = "cell rnn {\n input x[I]\n state h[H]\n param w[H, I], u[H, H], b[H]\n \
                       let a = w @ x + u @ h + b\n h' = tanh(a)\n output h'\n}\n";

    fn cell() -> Cell {
        let module = crate::compile("rnn.cell", RNN).into_result().expect("compiles");
        let cell = module.cells[0].clone();
        assert_eq!(verify(&cell), Ok(()), "the starting cell is valid");
        cell
    }

    /// The value computed by the first node with `op`.
    fn find(cell: &Cell, op: &Op) -> ValueId {
        cell.values().find(|&v| &cell.node(v).op == op).unwrap_or_else(|| panic!("no {op:?} in the cell"))
    }

    fn vector(name: &str) -> Type {
        Type::Vector(Dim::var(name))
    }

    /// Applies `break_it` to a valid cell; the verifier must report `expected`.
    fn expect_error(what: &str, expected: &str, break_it: impl FnOnce(&mut Cell)) {
        let mut cell = cell();
        break_it(&mut cell);
        let errors = verify(&cell).expect_err(what);
        assert!(
            errors.iter().any(|e| e.to_string().contains(expected)),
            "{what}: expected `{expected}`, got {errors:?}"
        );
    }

    #[test]
    fn a_cycle() {
        expect_error("cycle", "is on a cycle", |c| {
            let t = find(c, &Op::Unary(UnaryOp::Tanh));
            c.set_operands(t, &[t]);
        });
    }

    #[test]
    fn the_wrong_number_of_operands() {
        expect_error("arity", "`tanh` takes 1 operands, has 2", |c| {
            let t = find(c, &Op::Unary(UnaryOp::Tanh));
            let a = c.operands(t)[0];
            c.set_operands(t, &[a, a]);
        });
        expect_error("empty concat", "needs at least one operand", |c| {
            c.add(Op::Concat, vector("H"), &[], None);
        });
    }

    #[test]
    fn types_that_do_not_match_the_op() {
        expect_error("unary", "unary op on [H] gives [I]", |c| {
            let t = find(c, &Op::Unary(UnaryOp::Tanh));
            c.set_node(t, Node { op: Op::Unary(UnaryOp::Tanh), ty: vector("I") });
        });
        expect_error("binary", "add on", |c| {
            let x = find(c, &Op::Input(0));
            let h = find(c, &Op::State(0));
            c.add(Op::Binary(BinaryOp::Add), vector("H"), &[x, h], None);
        });
        expect_error("matvec", "matvec of [H, I] and [H] gives [H]", |c| {
            let w = find(c, &Op::Param(0));
            let h = find(c, &Op::State(0));
            c.add(Op::MatVec, vector("H"), &[w, h], None);
        });
        expect_error("broadcast", "broadcast of [H] to [H]", |c| {
            let h = find(c, &Op::State(0));
            c.add(Op::Broadcast, vector("H"), &[h], None);
        });
        expect_error("reduction", "reduction of [H] gives [H]", |c| {
            let h = find(c, &Op::State(0));
            c.add(Op::Reduce(crate::ir::ReduceOp::Sum), vector("H"), &[h], None);
        });
        expect_error("concat", "concat operands do not add up to [H]", |c| {
            let x = find(c, &Op::Input(0));
            let h = find(c, &Op::State(0));
            c.add(Op::Concat, vector("H"), &[x, h], None);
        });
        expect_error("slice", "slice [H +2] runs past [H]", |c| {
            let h = find(c, &Op::State(0));
            c.add(Op::Slice { offset: Dim::var("H") }, Type::Vector(Dim::constant(2)), &[h], None);
        });
    }

    #[test]
    fn a_matrix_read_elementwise() {
        expect_error("matrix", "reads matrix", |c| {
            let u = find(c, &Op::Param(1));
            let ty = c.ty(u).clone();
            c.add(Op::Unary(UnaryOp::Neg), ty, &[u], None);
        });
    }

    #[test]
    fn leaves_out_of_range_or_of_the_wrong_type() {
        expect_error("input index", "input index 3 out of range", |c| {
            c.add(Op::Input(3), vector("I"), &[], None);
        });
        expect_error("param type", "param type [I] is not [H]", |c| {
            c.add(Op::Param(2), vector("I"), &[], None);
        });
        expect_error("seed in a forward step", "seed index 0 out of range", |c| {
            c.add(Op::Seed(0), vector("H"), &[], None);
        });
        expect_error("constant", "bad constant inf", |c| {
            c.add(Op::Const(f64::INFINITY), Type::Scalar, &[], None);
        });
    }

    #[test]
    fn the_cell_s_own_invariants() {
        expect_error("next state type", "next state `h` has type [I], not [H]", |c| {
            c.next_states[0] = find(c, &Op::Input(0));
        });
        expect_error("missing next state", "1 states but 0 next states", |c| {
            c.next_states.clear();
        });
        expect_error("scalar output", "output has type scalar", |c| {
            c.output = c.add(Op::Const(1.0), Type::Scalar, &[], None);
        });
    }

    #[test]
    fn a_gradient_whose_adjoint_has_the_wrong_type() {
        let cell = cell();
        let mut grad = crate::autodiff::backward_step(&cell).expect("valid");
        let x = find(&cell, &Op::Input(0));
        grad.d_states[0] = Some(x);
        let errors = grad.verify(&cell).expect_err("a state adjoint of the input's type");
        assert!(
            errors.iter().any(|e| e.message.contains("state adjoint has type [I], not [H]")),
            "{errors:?}"
        );
    }
}
