//! Gives every value a step hands to the next one its own computation in
//! the step: each next state (forward) and each state adjoint (backward)
//! becomes a `copy` where it would otherwise be
//!
//! - a leaf (`c' = c`, a delay line `c' = h`, `c' = x`; or, backward, an
//!   adjoint that is a seed itself, `d_c = d_c'`),
//! - the same value as an earlier one (`c' = h'`), or
//! - a value that does not depend on the recurrence (`c' = W @ x`), which
//!   the schedule would compute before the loop for all steps at once.
//!
//! Back ends can then write each recurrent value where the next step reads
//! it (a state history slot, a carried adjoint) from the stage that
//! computes it. A state adjoint is also made a value of its own when
//! anything else reads it or it is another result too (`h' = tanh(h + b)`
//! gives `d_h = d_b`): its storage holds the final states' adjoints as
//! well, which nothing else may see. Run last: the simplification passes
//! would fold the copies away.

use crate::ir::{Graph, Op, UnaryOp, ValueId};
use std::collections::HashSet;

/// Inserts copies for `results` (in place) as the module documentation
/// says; `recurrent` tells the leaves the recurrence flows from. With
/// `exclusive`, a result that other values read, or that is one of
/// `others`, gets a copy too. Returns how many copies were added.
pub fn materialize_recurrent(
    graph: &mut Graph,
    results: &mut [Option<ValueId>],
    recurrent: &dyn Fn(&Op) -> bool,
    exclusive: Option<&[ValueId]>,
) -> usize {
    let order = graph.topo_order().unwrap_or_default();
    let mut dynamic: HashSet<ValueId> = HashSet::new();
    for &v in &order {
        if recurrent(&graph.node(v).op) || graph.operands(v).iter().any(|o| dynamic.contains(o)) {
            dynamic.insert(v);
        }
    }
    let mut seen: HashSet<ValueId> = HashSet::new();
    let mut added = 0;
    for slot in results.iter_mut() {
        let Some(v) = *slot else { continue };
        let is_copy = graph.node(v).op == Op::Unary(UnaryOp::Copy);
        let leaf = graph.operands(v).is_empty();
        let shared = exclusive.is_some_and(|others| !graph.users(v).is_empty() || others.contains(&v));
        let needs_copy = leaf || shared || seen.contains(&v) || (!dynamic.contains(&v) && !is_copy);
        let v = if needs_copy {
            added += 1;
            let ty = graph.ty(v).clone();
            let span = graph.span(v);
            graph.add(Op::Unary(UnaryOp::Copy), ty, &[v], span)
        } else {
            v
        };
        seen.insert(v);
        *slot = Some(v);
    }
    added
}

#[cfg(test)]
mod tests {
    use crate::ir::{Op, UnaryOp};

    fn cell(source: &str) -> crate::ir::Cell {
        let mut cell = crate::compile("t.cell", source).into_result().expect("compiles").cells.remove(0);
        crate::passes::optimize_cell(&mut cell).expect("verifies");
        cell
    }

    #[test]
    fn leaves_shared_and_static_next_states_get_copies() {
        let c = cell(
            "cell t { input x[H] state h[H], c[H], m[H], k[H] param w[H, H]
               h' = tanh(h + x)
               c' = h
               m' = h'
               k' = w @ x
               output h' }",
        );
        let ops: Vec<Op> = c.next_states.iter().map(|&v| c.node(v).op.clone()).collect();
        assert_eq!(ops[0], Op::Unary(UnaryOp::Tanh));
        assert!(ops[1..].iter().all(|op| *op == Op::Unary(UnaryOp::Copy)), "{ops:?}");
        // Idempotent: optimising again adds no copy.
        let copies =
            |c: &crate::ir::Cell| c.values().filter(|&v| c.node(v).op == Op::Unary(UnaryOp::Copy)).count();
        let mut again = c.clone();
        crate::passes::optimize_cell(&mut again).expect("verifies");
        assert_eq!(copies(&again), copies(&c));
    }
}
