//! Simplification passes over a step graph, run as a flat pipeline until
//! nothing changes: [`fold_constants`], [`simplify_algebra`],
//! [`eliminate_common_subexpressions`], then dead values are removed.
//!
//! A pass rewrites the graph in place. When it replaces a value by another
//! it redirects the value's users and records the replacement in a
//! [`Remap`], which the caller applies to the values it holds from outside
//! the graph (a cell's output and next states, a gradient's results).

mod cse;
mod fold_constants;
mod materialize;
mod simplify_algebra;

pub use cse::eliminate_common_subexpressions;
pub use fold_constants::fold_constants;
pub use materialize::materialize_recurrent;
pub use simplify_algebra::simplify_algebra;

use crate::autodiff::Gradient;
use crate::ir::{Cell, Graph, Op, Type, ValueId};
use std::collections::HashMap;

/// Values replaced by others: `from -> to`.
#[derive(Clone, Debug, Default)]
pub struct Remap(HashMap<ValueId, ValueId>);

impl Remap {
    /// Redirects `from`'s users to `to` and records it.
    pub(crate) fn replace(&mut self, graph: &mut Graph, from: ValueId, to: ValueId) {
        if from != to {
            graph.replace_uses(from, to);
            self.0.insert(from, to);
        }
    }

    /// Where `v` ended up, following chains of replacements.
    pub fn resolve(&self, mut v: ValueId) -> ValueId {
        let mut hops = 0;
        while let Some(&n) = self.0.get(&v) {
            v = n;
            hops += 1;
            if hops > self.0.len() {
                break;
            }
        }
        v
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }
}

/// What a pipeline run changed, per pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub folded: usize,
    pub simplified: usize,
    pub merged: usize,
    pub removed: usize,
}

/// Runs every pass on `graph` until a fixed point; `roots` are updated in
/// place, and so are `weak` values (followed through replacements but not
/// kept alive).
fn run(graph: &mut Graph, roots: &mut [&mut ValueId], weak: &mut [&mut Option<ValueId>]) -> Stats {
    let mut stats = Stats::default();
    for _ in 0..16 {
        let mut remap = Remap::default();
        let folded = fold_constants(graph, &mut remap);
        let simplified = simplify_algebra(graph, &mut remap);
        let merged = eliminate_common_subexpressions(graph, &mut remap);
        for r in roots.iter_mut() {
            **r = remap.resolve(**r);
        }
        for w in weak.iter_mut() {
            **w = w.map(|v| remap.resolve(v));
        }
        let live: Vec<ValueId> = roots.iter().map(|r| **r).collect();
        let removed = graph.remove_dead_values(&live);
        // A weak reference to a removed value must not survive into the next
        // round, where a new value may take its index.
        for w in weak.iter_mut() {
            if w.is_some_and(|v| !graph.contains(v)) {
                **w = None;
            }
        }
        stats.folded += folded;
        stats.simplified += simplified;
        stats.merged += merged;
        stats.removed += removed;
        if folded + simplified + merged + removed == 0 {
            break;
        }
    }
    stats
}

/// Simplifies a forward step, then gives each next state a computation
/// of its own in the step ([`materialize_recurrent`]).
pub fn optimize_cell(cell: &mut Cell) -> Stats {
    let mut output = cell.output;
    let mut next = cell.next_states.clone();
    let mut roots: Vec<&mut ValueId> = next.iter_mut().collect();
    roots.push(&mut output);
    let stats = run(cell, &mut roots, &mut []);
    let mut next: Vec<Option<ValueId>> = next.into_iter().map(Some).collect();
    materialize_recurrent(cell, &mut next, &|op| matches!(op, Op::State(_)), None);
    cell.output = output;
    cell.next_states = next.into_iter().flatten().collect();
    stats
}

/// Simplifies a backward step.
pub fn optimize_gradient(grad: &mut Gradient) -> Stats {
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
    let stats = run(&mut grad.graph, &mut results, &mut weak);
    grad.forget_removed_primals();
    stats
}

/// The constant `c` if `v` is `const c` or `broadcast(const c)`.
pub(crate) fn constant_value(graph: &Graph, v: ValueId) -> Option<f64> {
    match graph.node(v).op {
        Op::Const(c) => Some(c),
        Op::Broadcast => match graph.node(*graph.operands(v).first()?).op {
            Op::Const(c) => Some(c),
            _ => None,
        },
        _ => None,
    }
}

/// Adds `const c` with type `ty` (broadcast for a vector), next to `near` for its span.
pub(crate) fn make_constant(graph: &mut Graph, c: f64, ty: &Type, near: ValueId) -> ValueId {
    let span = graph.span(near);
    let k = graph.add(Op::Const(c), Type::Scalar, &[], span);
    match ty {
        Type::Vector(_) => graph.add(Op::Broadcast, ty.clone(), &[k], span),
        _ => k,
    }
}
