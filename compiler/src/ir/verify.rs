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
    pub value: Option<ValueId>,
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
pub struct Leaves<'a> {
    pub inputs: &'a [Type],
    pub states: &'a [Type],
    pub params: &'a [Type],
    pub seeds: &'a [Type],
}

/// Checks a forward step: the generic invariants plus the cell's own.
pub fn verify(cell: &Cell) -> Result<(), Vec<VerifyError>> {
    let inputs: Vec<Type> = cell.inputs.iter().map(|d| Type::Vector(d.dim.clone())).collect();
    let states: Vec<Type> = cell.states.iter().map(|d| Type::Vector(d.dim.clone())).collect();
    let params: Vec<Type> = cell.params.iter().map(|p| p.ty.clone()).collect();
    let mut errors =
        verify_graph(cell, Leaves { inputs: &inputs, states: &states, params: &params, seeds: &[] });
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
pub fn verify_graph(graph: &Graph, leaves: Leaves) -> Vec<VerifyError> {
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
            Op::Const(c) => {
                (!c.is_finite() || node.ty != Type::Scalar).then(|| format!("bad constant {c}: {}", node.ty))
            }
            Op::DimValue(_) => (node.ty != Type::Scalar).then(|| format!("dimvalue of type {}", node.ty)),
            Op::Unary(_) => {
                (ty(0) != &node.ty || is_matrix).then(|| format!("unary op on {} gives {}", ty(0), node.ty))
            }
            Op::Binary(op) => (ty(0) != &node.ty || ty(1) != &node.ty || (is_matrix && *op != BinaryOp::Add))
                .then(|| format!("{} on {} and {} gives {}", op.name(), ty(0), ty(1), node.ty)),
            Op::Broadcast => (ty(0) != &Type::Scalar || !matches!(node.ty, Type::Vector(_)))
                .then(|| format!("broadcast of {} to {}", ty(0), node.ty)),
            Op::MatVec => match (ty(0), ty(1), &node.ty) {
                (Type::Matrix(m, n), Type::Vector(k), Type::Vector(r)) if n == k && m == r => None,
                (a, b, r) => Some(format!("matvec of {a} and {b} gives {r}")),
            },
            Op::MatVecT => match (ty(0), ty(1), &node.ty) {
                (Type::Matrix(m, n), Type::Vector(k), Type::Vector(r)) if m == k && n == r => None,
                (a, b, r) => Some(format!("matvect of {a} and {b} gives {r}")),
            },
            Op::Outer => match (ty(0), ty(1), &node.ty) {
                (Type::Vector(a), Type::Vector(b), Type::Matrix(m, n)) if a == m && b == n => None,
                (a, b, r) => Some(format!("outer of {a} and {b} gives {r}")),
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
