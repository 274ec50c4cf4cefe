//! Which GEMM stages hoisted before the loop may run in the step instead.
//!
//! The forward hoists every product that does not depend on a state (an
//! input projection `W @ x`) before the loop: one product over every row
//! and step, whose result, a row per sequence and step, the per-step
//! stages read back. Where a thread owns whole sequences, the same product
//! may instead run in each step on that thread's rows: the step's stages
//! then read its result from the core's cache rather than from a buffer
//! of every row and step that outgrows the caches, and the product runs
//! at the rate of the per-step products, whose weights stay near the core.
//! Whether a pass does is the runtime's choice (it pays where each thread
//! has rows enough to reuse the weight); the schedule records which stages
//! may.
//!
//! A stage may run in the step when each of its products multiplies a
//! parameter and is read by per-step stages only: no stage before or
//! after the loop, and nothing outside the step (the output, a next state,
//! a value saved for the backward), needs its rows of every step at once.
//! Its results are the same numbers wherever it runs: a product's row is
//! the same sum whichever rows are multiplied with it.

use super::{Placement, Stage, StageKind};
use crate::ir::{Graph, Op, ValueId};
use std::collections::{HashMap, HashSet};

/// The forward's GEMM stages before the loop that may run in the step
/// instead (see the module's doc), by index; none where the step has no
/// product (its loop may run as one whole-sequence kernel). `roots` are
/// the values read from outside the step.
pub fn sinkable(g: &Graph, stages: &[Stage], roots: &HashSet<ValueId>) -> Vec<usize> {
    if !stages.iter().any(|s| s.placement == Placement::EachStep && s.kind == StageKind::Gemm) {
        return Vec::new();
    }
    let placed: HashMap<ValueId, Placement> =
        stages.iter().flat_map(|s| s.values.iter().map(move |&v| (v, s.placement))).collect();
    let read_in_step = |v: ValueId| g.users(v).iter().all(|u| placed.get(u) == Some(&Placement::EachStep));
    let of_parameter = |v: ValueId| {
        g.node(v).op == Op::MatVec
            && g.operands(v).first().is_some_and(|&w| matches!(g.node(w).op, Op::Param(_)))
    };
    (stages.iter().enumerate())
        .filter(|(_, s)| s.placement == Placement::BeforeLoop && s.kind == StageKind::Gemm)
        .filter(|(_, s)| {
            !s.values.is_empty()
                && s.values.iter().all(|&v| of_parameter(v) && !roots.contains(&v) && read_in_step(v))
        })
        .map(|(k, _)| k)
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::dims::Bindings;

    fn sinkable(src: &str) -> Vec<usize> {
        let module = crate::compile("t.cell", src).into_result().expect("compiles");
        let steps = crate::program::Steps::compile(&module.cells[0]).expect("verifies");
        steps.schedule(&Bindings::new()).sinkable
    }

    #[test]
    fn an_input_projection_read_in_the_step_may_sink() {
        let src = "cell t { input x[I] state h[H] param W[H, I], U[H, H]
            let a = W @ x
            h' = tanh(a + U @ h - mean(a))
            output h' }";
        assert_eq!(sinkable(src), vec![0]);
    }

    #[test]
    fn a_step_without_products_sinks_nothing() {
        // An elementwise recurrence: the loop may be one whole-sequence kernel.
        let src = "cell t { input x[H] state h[H] param W[H, H], u[H]
            h' = relu(W @ x + u * h)
            output h' }";
        assert!(sinkable(src).is_empty());
    }

    #[test]
    fn a_projection_the_output_or_a_hoisted_stage_reads_stays_before_the_loop() {
        // It is the output: every row and step of it is kept.
        let out = "cell t { input x[H] state h[H] param W[H, H], U[H, H]
            let a = W @ x
            h' = tanh(a + U @ h)
            output a }";
        assert!(sinkable(out).is_empty());
        // A product of a product: the second is hoisted and reads the first.
        let chain = "cell t { input x[H] state h[H] param W[H, H], V[H, H], U[H, H]
            h' = tanh(V @ tanh(W @ x) + U @ h)
            output h' }";
        assert_eq!(sinkable(chain).len(), 1, "only the last product of the chain");
    }
}
