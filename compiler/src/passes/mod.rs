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

use crate::ir::verify::{verify_graph, LeafTypes, VerifyError};
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

    /// Whether no value was replaced.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Number of values replaced.
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

/// What a pipeline run changed, per pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Values replaced by a constant ([`fold_constants`]).
    pub folded: usize,
    /// Values rewritten by an algebraic identity ([`simplify_algebra`]).
    pub simplified: usize,
    /// Values merged with an identical earlier one ([`eliminate_common_subexpressions`]).
    pub merged: usize,
    /// Dead values removed.
    pub removed: usize,
}

/// The graph's invariants after pass `pass`: an error names the pass.
fn verify_after(graph: &Graph, leaves: &LeafTypes, pass: &str) -> Result<(), Vec<VerifyError>> {
    let errors = verify_graph(graph, leaves.leaves());
    if errors.is_empty() {
        return Ok(());
    }
    Err(errors
        .into_iter()
        .map(|e| VerifyError { message: format!("after {pass}: {}", e.message), ..e })
        .collect())
}

/// Runs every pass on `graph` until a fixed point, verifying the graph
/// after each; `roots` are updated in place, and so are `weak` values
/// (followed through replacements but not kept alive).
pub(crate) fn run(
    graph: &mut Graph,
    roots: &mut [&mut ValueId],
    weak: &mut [&mut Option<ValueId>],
) -> Result<Stats, Vec<VerifyError>> {
    let leaves = LeafTypes::of(graph);
    let mut stats = Stats::default();
    for _ in 0..16 {
        let mut remap = Remap::default();
        let folded = fold_constants(graph, &mut remap);
        verify_after(graph, &leaves, "constant folding")?;
        let simplified = simplify_algebra(graph, &mut remap);
        verify_after(graph, &leaves, "algebraic simplification")?;
        let merged = eliminate_common_subexpressions(graph, &mut remap);
        verify_after(graph, &leaves, "common subexpression elimination")?;
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
    verify_after(graph, &leaves, "dead value removal")?;
    Ok(stats)
}

/// Simplifies a forward step, then gives each next state a computation
/// of its own in the step ([`materialize_recurrent`]). The graph is
/// verified after every pass; an error is a compiler bug naming the pass.
pub fn optimize_cell(cell: &mut Cell) -> Result<Stats, Vec<VerifyError>> {
    let mut output = cell.output;
    let mut next = cell.next_states.clone();
    let mut roots: Vec<&mut ValueId> = next.iter_mut().collect();
    roots.push(&mut output);
    let stats = run(cell, &mut roots, &mut [])?;
    let mut next: Vec<Option<ValueId>> = next.into_iter().map(Some).collect();
    materialize_recurrent(cell, &mut next, &|op| matches!(op, Op::State(_)), None);
    cell.output = output;
    cell.next_states = next.into_iter().flatten().collect();
    verify_after(cell, &LeafTypes::of(cell), "materialising next states")?;
    Ok(stats)
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

/// Each pass alone on a small cell: what it rewrites, that the graph still
/// verifies, and that the step computes the same function.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::verify::verify;
    use crate::ir::{BinaryOp, UnaryOp};

    /// A cell `t` over `x`, `h` and `w` (all `[H]`) with `body` as its statements.
    fn cell(body: &str) -> Cell {
        let src = format!("cell t {{\n input x[H]\n state h[H]\n param w[H]\n {body}\n}}\n");
        crate::compile("t.cell", &src).into_result().expect("compiles").cells.remove(0)
    }

    /// The step's output and next state at H=3 on fixed data.
    fn evaluate(cell: &Cell) -> Vec<f64> {
        let bound = cell.bind(&[("H".to_string(), 3)].into()).expect("binds");
        let step =
            bound.step(&[0.3, -0.7, 1.1], &[vec![0.2, 0.5, -0.4]], &[vec![0.9, -1.3, 0.6]]).expect("runs");
        step.output.into_iter().chain(step.next_states.into_iter().flatten()).collect()
    }

    /// Runs one pass, follows its replacements, drops dead values, and checks
    /// the result verifies and computes what the cell did before.
    fn run_one(body: &str, pass: fn(&mut Graph, &mut Remap) -> usize) -> (Cell, usize) {
        let mut cell = cell(body);
        let before = evaluate(&cell);
        let mut remap = Remap::default();
        let changed = pass(&mut cell, &mut remap);
        cell.output = remap.resolve(cell.output);
        cell.next_states = cell.next_states.iter().map(|&v| remap.resolve(v)).collect();
        cell.remove_dead_values();
        assert_eq!(verify(&cell), Ok(()), "{body}");
        let after = evaluate(&cell);
        for (a, b) in before.iter().zip(&after) {
            assert!((a - b).abs() <= 1e-12 * a.abs().max(1.0), "{body}: {before:?} became {after:?}");
        }
        (cell, changed)
    }

    fn count(cell: &Cell, op: &Op) -> usize {
        cell.values().filter(|&v| &cell.node(v).op == op).count()
    }

    #[test]
    fn constant_folding_folds_constants_but_not_non_finite_ones() {
        let (c, n) = run_one("h' = tanh(x + h) * (2 * 3)\n output h'", fold_constants);
        assert_eq!(n, 1);
        assert_eq!(count(&c, &Op::Const(6.0)), 1);
        // log(0) is -inf: kept as an op, so the IR never holds a non-finite constant.
        let (c, _) = run_one("h' = h + exp(log(0))\n output h'", fold_constants);
        assert_eq!(count(&c, &Op::Unary(UnaryOp::Log)), 1);
    }

    #[test]
    fn algebraic_identities_disappear() {
        let (c, n) = run_one("h' = (x * 1 + 0) / 1 - 0 + -(-h)\n output h'", simplify_algebra);
        assert!(n >= 5, "{n}");
        assert_eq!(count(&c, &Op::Unary(UnaryOp::Neg)), 0);
        assert_eq!(count(&c, &Op::Binary(BinaryOp::Mul)) + count(&c, &Op::Binary(BinaryOp::Div)), 0);
        // x + (-y) is x - y, and x - (-y) is x + y.
        let (c, _) = run_one("h' = x + -h - -w\n output h'", simplify_algebra);
        assert_eq!(count(&c, &Op::Unary(UnaryOp::Neg)), 0);
        assert_eq!(count(&c, &Op::Binary(BinaryOp::Sub)), 1);
        // sum(-x) is -sum(x): the negation is of one scalar, not of a vector.
        let (c, n) = run_one("h' = h * sum(-(x * h)) + mean(-w)\n output h'", simplify_algebra);
        assert_eq!(n, 2);
        let negated: Vec<_> = c.values().filter(|&v| c.node(v).op == Op::Unary(UnaryOp::Neg)).collect();
        assert_eq!(negated.len(), 2);
        assert!(negated.iter().all(|&v| c.ty(v) == &Type::Scalar), "{c:?}");
    }

    #[test]
    fn common_subexpressions_merge_commutative_operands_too() {
        let (c, n) = run_one("h' = tanh(x * h) + tanh(h * x)\n output h'", eliminate_common_subexpressions);
        assert_eq!(n, 2, "the product, then the tanh");
        assert_eq!(count(&c, &Op::Unary(UnaryOp::Tanh)), 1);
        assert_eq!(count(&c, &Op::Binary(BinaryOp::Mul)), 1);
        // Not commutative: x - h and h - x stay apart.
        let (c, n) = run_one("h' = (x - h) * (h - x)\n output h'", eliminate_common_subexpressions);
        assert_eq!((n, count(&c, &Op::Binary(BinaryOp::Sub))), (0, 2));
    }

    #[test]
    fn the_pipeline_removes_dead_values_and_reaches_a_fixed_point() {
        let mut c = cell("let unused = exp(x)\n h' = tanh(x * 1 + h) * (2 * 3)\n output h'");
        let before = evaluate(&c);
        let stats = optimize_cell(&mut c).expect("verifies");
        assert!(stats.removed >= 1 && stats.folded >= 1 && stats.simplified >= 1, "{stats:?}");
        assert_eq!(count(&c, &Op::Unary(UnaryOp::Exp)), 0);
        assert_eq!(evaluate(&c), before);
        // A second run changes nothing.
        let again = optimize_cell(&mut c).expect("verifies");
        assert_eq!(again, Stats::default());
    }
}
