//! Reverse-mode automatic differentiation of one step.
//!
//! Given a forward [`Cell`], [`differentiate`] builds its backward step: a
//! graph that starts as a copy of the forward graph (so forward values keep
//! their ids and the backward can read them) and adds one adjoint value per
//! contribution, walking the forward graph in reverse topological order.
//! The adjoints flowing in from outside — of the step's output and of each
//! next state — are the graph's `seed` leaves; its results are the adjoints
//! of every input, incoming state and parameter.
//!
//! As in tinygrad's `gradient.py`, there is one rule per op (`rules.rs`) and
//! one generic walk; the rules `match` the closed op enum exhaustively, so a
//! new op without a rule does not compile. Matmul adjoints stay matmuls:
//! `dx += Wᵀ dy` (`matvect`) and `dW += dy ⊗ x` (`outer`).

mod rules;

use crate::dims::Dim;
use crate::ir::verify::{verify_graph, Leaves, VerifyError};
use crate::ir::{BinaryOp, Cell, Graph, Node, Op, Type, ValueId};
use std::collections::HashMap;

/// A seed: an adjoint given to the backward step from outside.
#[derive(Clone, Debug, PartialEq)]
pub struct Seed {
    /// `d_output`, or `d_NAME'` for a next state.
    pub name: String,
    /// The adjoint's type: the same as the output's or the state's.
    pub ty: Type,
}

/// The backward step of a cell.
#[derive(Clone, Debug)]
pub struct Gradient {
    /// The forward values (same ids as in the cell) and the adjoints.
    pub graph: Graph,
    /// `seeds[0]` is the output's adjoint, `seeds[1 + i]` state `i`'s next value's.
    pub seeds: Vec<Seed>,
    /// Adjoint of each input, in declaration order; `None` where the step
    /// does not depend on it (a zero gradient).
    pub d_inputs: Vec<Option<ValueId>>,
    /// Adjoint of each incoming state, in declaration order; `None` for a
    /// zero gradient.
    pub d_states: Vec<Option<ValueId>>,
    /// Adjoint of each parameter, in declaration order; `None` for a zero
    /// gradient.
    pub d_params: Vec<Option<ValueId>>,
    /// Where the forward step's next states are in this graph, if the
    /// backward reads them (they are kept per step anyway, as the state
    /// history, so reading them costs no extra memory).
    pub primal_next_states: Vec<Option<ValueId>>,
    /// Likewise for the forward step's output (kept as the output sequence).
    pub primal_output: Option<ValueId>,
    /// The forward step's own values still in this graph (the rest of the
    /// seed-independent values are derived ones, like `1 - y`, that only the
    /// backward computes). Only these can be saved by the forward pass.
    pub primal_values: Vec<Option<ValueId>>,
}

impl Gradient {
    /// Every value the backward step returns.
    pub fn results(&self) -> Vec<ValueId> {
        self.d_inputs.iter().chain(&self.d_states).chain(&self.d_params).flatten().copied().collect()
    }

    /// Removes values no result depends on.
    pub fn remove_dead_values(&mut self) -> usize {
        let roots = self.results();
        self.graph.remove_dead_values(&roots)
    }

    /// Clears the primal markers of forward values the graph no longer has.
    pub(crate) fn forget_removed_primals(&mut self) {
        let graph = &self.graph;
        let keep = |v: &mut Option<ValueId>| {
            if v.is_some_and(|x| !graph.contains(x)) {
                *v = None;
            }
        };
        self.primal_next_states.iter_mut().for_each(keep);
        keep(&mut self.primal_output);
        self.primal_values.iter_mut().for_each(keep);
        self.primal_values.retain(Option::is_some);
    }

    /// Whether `v` is one of the forward step's own values.
    pub fn is_primal(&self, v: ValueId) -> bool {
        self.primal_values.contains(&Some(v))
    }

    /// Checks the graph's invariants and that each result has its leaf's type.
    pub fn verify(&self, cell: &Cell) -> Result<(), Vec<VerifyError>> {
        let inputs: Vec<Type> = cell.inputs.iter().map(|d| Type::Vector(d.dim.clone())).collect();
        let states: Vec<Type> = cell.states.iter().map(|d| Type::Vector(d.dim.clone())).collect();
        let params: Vec<Type> = cell.params.iter().map(|p| p.ty.clone()).collect();
        let seeds: Vec<Type> = self.seeds.iter().map(|s| s.ty.clone()).collect();
        let masks = cell.mask_types();
        let mut errors = verify_graph(
            &self.graph,
            Leaves { inputs: &inputs, states: &states, params: &params, seeds: &seeds, masks: &masks },
        );
        for (results, types, what) in [
            (&self.d_inputs, &inputs, "input"),
            (&self.d_states, &states, "state"),
            (&self.d_params, &params, "param"),
        ] {
            if results.len() != types.len() {
                errors.push(VerifyError {
                    value: None,
                    message: format!("{} {what} adjoints for {}", results.len(), types.len()),
                });
            }
            for (r, t) in results.iter().zip(types) {
                match r {
                    Some(v) if !self.graph.contains(*v) => errors.push(VerifyError {
                        value: Some(*v),
                        message: format!("{what} adjoint is not in the graph"),
                    }),
                    Some(v) if self.graph.ty(*v) != t => errors.push(VerifyError {
                        value: Some(*v),
                        message: format!("{what} adjoint has type {}, not {t}", self.graph.ty(*v)),
                    }),
                    _ => {}
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// The backward step as the pipeline uses it: differentiated, simplified
/// (constant folding, algebra, CSE, dead values) and verified.
pub fn backward_step(cell: &Cell) -> Result<Gradient, Vec<VerifyError>> {
    let mut grad = differentiate(cell);
    optimize_gradient(&mut grad)?;
    // Each state adjoint computed in the step, as the carry to the step
    // before, and read by nothing else.
    let others: Vec<ValueId> = grad.d_inputs.iter().chain(&grad.d_params).flatten().copied().collect();
    crate::passes::materialize_recurrent(
        &mut grad.graph,
        &mut grad.d_states,
        &|op| matches!(op, Op::Seed(k) if *k > 0),
        Some(&others),
    );
    grad.verify(cell)?;
    Ok(grad)
}

/// Simplifies a backward step, verifying it after every pass.
pub fn optimize_gradient(grad: &mut Gradient) -> Result<crate::passes::Stats, Vec<VerifyError>> {
    let mut results: Vec<&mut ValueId> = grad
        .d_inputs
        .iter_mut()
        .chain(grad.d_states.iter_mut())
        .chain(grad.d_params.iter_mut())
        .flatten()
        .collect();
    let mut weak: Vec<&mut Option<ValueId>> = grad
        .primal_next_states
        .iter_mut()
        .chain(std::iter::once(&mut grad.primal_output))
        .chain(grad.primal_values.iter_mut())
        .collect();
    let stats = crate::passes::run(&mut grad.graph, &mut results, &mut weak)?;
    grad.forget_removed_primals();
    Ok(stats)
}

/// Builds the backward step of `cell`, unsimplified.
pub fn differentiate(cell: &Cell) -> Gradient {
    let mut b = Builder { g: (**cell).clone(), contributions: HashMap::new() };
    let mut seeds = vec![Seed { name: "d_output".into(), ty: cell.ty(cell.output).clone() }];
    let d_out = b.g.add(Op::Seed(0), seeds[0].ty.clone(), &[], None);
    b.contribute(cell.output, d_out);
    for (i, (s, &v)) in cell.states.iter().zip(&cell.next_states).enumerate() {
        let ty = Type::Vector(s.dim.clone());
        seeds.push(Seed { name: format!("d_{}'", s.name), ty: ty.clone() });
        let d = b.g.add(Op::Seed(1 + i), ty, &[], None);
        b.contribute(v, d);
    }

    let order = cell.topo_order().unwrap_or_default();
    let mut adjoint: HashMap<ValueId, ValueId> = HashMap::new();
    for &v in order.iter().rev() {
        let Some(parts) = b.contributions.remove(&v) else { continue };
        let dv = b.sum(parts);
        adjoint.insert(v, dv);
        rules::backprop(&mut b, v, dv);
    }

    let leaf = |op: &dyn Fn(&Op) -> bool| {
        cell.values().find(|&v| op(&cell.node(v).op)).and_then(|v| adjoint.get(&v).copied())
    };
    let d_inputs = (0..cell.inputs.len()).map(|i| leaf(&|op| *op == Op::Input(i))).collect();
    let d_states = (0..cell.states.len()).map(|i| leaf(&|op| *op == Op::State(i))).collect();
    let d_params = (0..cell.params.len()).map(|i| leaf(&|op| *op == Op::Param(i))).collect();
    let mut grad = Gradient {
        graph: b.g,
        seeds,
        d_inputs,
        d_states,
        d_params,
        primal_next_states: cell.next_states.iter().map(|&v| Some(v)).collect(),
        primal_output: Some(cell.output),
        primal_values: cell.values().map(Some).collect(),
    };
    grad.remove_dead_values();
    grad.forget_removed_primals();
    grad
}

/// The graph under construction and the adjoint contributions not yet summed.
pub(crate) struct Builder {
    pub(crate) g: Graph,
    contributions: HashMap<ValueId, Vec<ValueId>>,
}

impl Builder {
    pub(crate) fn contribute(&mut self, to: ValueId, adjoint: ValueId) {
        self.contributions.entry(to).or_default().push(adjoint);
    }

    pub(crate) fn ty(&self, v: ValueId) -> Type {
        self.g.ty(v).clone()
    }

    pub(crate) fn add(&mut self, op: Op, ty: Type, operands: &[ValueId]) -> ValueId {
        self.g.add(op, ty, operands, None)
    }

    /// A constant with `like`'s type (broadcast for a vector).
    pub(crate) fn constant_like(&mut self, c: f64, like: &Type) -> ValueId {
        let k = self.add(Op::Const(c), Type::Scalar, &[]);
        match like {
            Type::Vector(_) => self.add(Op::Broadcast, like.clone(), &[k]),
            _ => k,
        }
    }

    pub(crate) fn binary(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
        let ty = self.ty(a);
        self.add(Op::Binary(op), ty, &[a, b])
    }

    pub(crate) fn unary(&mut self, op: crate::ir::UnaryOp, a: ValueId) -> ValueId {
        let ty = self.ty(a);
        self.add(Op::Unary(op), ty, &[a])
    }

    /// Sums adjoint contributions. Pads that tile a vector exactly (the
    /// adjoints of a `chunk`) become one `concat` instead of a chain of adds.
    fn sum(&mut self, parts: Vec<ValueId>) -> ValueId {
        if let Some(joined) = self.join_tiling_pads(&parts) {
            return joined;
        }
        let mut it = parts.into_iter();
        let first = it.next().expect("a value with contributions has at least one");
        it.fold(first, |acc, p| self.binary(BinaryOp::Add, acc, p))
    }

    fn join_tiling_pads(&mut self, parts: &[ValueId]) -> Option<ValueId> {
        if parts.len() < 2 {
            return None;
        }
        let Type::Vector(total) = self.ty(parts[0]) else { return None };
        let mut pieces: Vec<(Dim, Dim, ValueId)> = Vec::new();
        for &p in parts {
            let Op::Pad { offset } = &self.g.node(p).op else { return None };
            let inner = *self.g.operands(p).first()?;
            let len = self.g.ty(inner).vector_dim()?.clone();
            pieces.push((offset.clone(), len, inner));
        }
        // Order by offset: each piece must start where the previous ended.
        let mut ordered = Vec::with_capacity(pieces.len());
        let mut at = Dim::default();
        while !pieces.is_empty() {
            let k = pieces.iter().position(|(o, _, _)| *o == at)?;
            let (_, len, v) = pieces.swap_remove(k);
            at = at.checked_add(&len)?;
            ordered.push(v);
        }
        (at == total).then(|| self.add(Op::Concat, Type::Vector(total), &ordered))
    }
}

impl Node {
    /// Whether the op is elementwise (the result's element `i` depends on
    /// element `i` of each operand only).
    pub fn is_elementwise(&self) -> bool {
        self.op.is_elementwise() || self.op == Op::Broadcast
    }
}
