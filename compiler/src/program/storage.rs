//! Where each value of a program's two steps lives while a back end runs a
//! batch, decided once for every back end. Rows are found through the
//! batch's order: a sequence's *rank* is its place among the sequences
//! sorted longest first, so the sequences still running at a step are a
//! prefix of the ranks and a per-step product is one call.
//!
//! The classes, for values a stage computes:
//! - [`Storage::Layout`]: one row per row of the caller's layout (values
//!   computed before the loop, vectors computed after it);
//! - [`Storage::Rank`]: one row per sequence in rank order, rewritten every
//!   step;
//! - [`Storage::Steps`]: one row per `(step, rank)`, written every step and
//!   read later: by the backward (forward values it saves, when training),
//!   or by the work after the loop (backward values);
//! - [`Storage::Fixed`]: one for the whole batch (a weight-gradient matrix).
//!
//! and, for values the caller or the forward's tape provides, what they are
//! (leaves, constants, the output, the next states, the saved values). How a
//! class is laid out in memory (a rank buffer and a copy per row on the CPU,
//! a step-major history on the GPU) is each back end's own business.

use super::Side;
use crate::autodiff::Gradient;
use crate::ir::{Cell, Graph, Op, Type, ValueId};
use crate::schedule::{Placement, Schedule, StageKind};
use crate::shapes::Shapes;
use std::collections::HashSet;

/// Where a value lives (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Storage {
    /// Input `i`'s features of the layer input's row (the caller's layout).
    Input(usize),
    /// State `i` before the step.
    State(usize),
    /// State `i` after the step: written by the step, read by the next.
    NextState(usize),
    /// Parameter `i`: the same for every row.
    Param(usize),
    /// Mask `i`'s values of the row, which the runtime fills (see
    /// [`crate::ir::masks`]).
    Mask(usize),
    /// The cell's output; `rank_order` when a per-step product reads or
    /// writes it, so its rows must be a step's contiguous ranks.
    Output {
        /// Whether the output's rows must be in rank order (see above).
        rank_order: bool,
    },
    /// The output's adjoint (the caller's layout).
    OutputAdjoint,
    /// The adjoint of next state `i`, carried from the step after.
    CarriedAdjoint(usize),
    /// The adjoint of state `i`, which the step before reads as its carry.
    StateAdjoint(usize),
    /// A forward value the backward reads from the forward's tape.
    Saved,
    /// A value of constants only: the same for every row.
    Constant,
    /// One row per row of the caller's layout: a value computed before the
    /// loop, or a vector computed after it.
    Layout,
    /// One row per sequence in rank order, rewritten every step.
    Rank,
    /// One row per `(step, rank)`, written every step and read later (by the
    /// backward, or by the work after the loop).
    Steps,
    /// One for the whole batch (e.g. a weight-gradient matrix).
    Fixed,
}

/// Every value's [`Storage`] in both steps, and the backward values read
/// after the loop.
#[derive(Clone, Debug, Default)]
pub struct Storages {
    forward: Vec<Option<Storage>>,
    backward: Vec<Option<Storage>>,
    after_loop: HashSet<ValueId>,
}

impl Storages {
    pub fn new(forward: &Cell, grad: &Gradient, schedule: &Schedule, shapes: (&Shapes, &Shapes)) -> Storages {
        let mut fwd = Classes::new(forward, shapes.0);
        for (i, &v) in forward.next_states.iter().enumerate() {
            fwd.set(v, Storage::NextState(i));
        }
        fwd.set(forward.output, Storage::Output { rank_order: rank_order(schedule, forward.output) });
        let saved: HashSet<ValueId> = schedule.saved.saved.iter().copied().collect();
        fwd.stage_outputs(schedule, Side::Forward, |v| saved.contains(&v));

        let g = &grad.graph;
        let mut bwd = Classes::new(g, shapes.1);
        for (i, v) in grad.primal_next_states.iter().enumerate() {
            if let Some(v) = v {
                bwd.set(*v, Storage::NextState(i));
            }
        }
        if let Some(v) = grad.primal_output {
            bwd.set(v, Storage::Output { rank_order: rank_order(schedule, forward.output) });
        }
        for &v in schedule.saved.saved.iter().filter(|v| g.contains(**v)) {
            bwd.set(v, Storage::Saved);
        }
        for (i, d) in grad.d_states.iter().enumerate() {
            if let Some(v) = d {
                bwd.set(*v, Storage::StateAdjoint(i));
            }
        }
        let mut after_loop: HashSet<ValueId> = grad.results().into_iter().collect();
        for st in schedule.backward.iter().filter(|s| s.placement == Placement::AfterLoop) {
            after_loop.extend(st.inputs.iter().copied());
            if st.kind == StageKind::SumOverSteps {
                after_loop.extend(st.outputs.iter().copied());
            }
        }
        bwd.stage_outputs(schedule, Side::Backward, |v| after_loop.contains(&v));
        Storages { forward: fwd.classes, backward: bwd.classes, after_loop }
    }

    /// Where `v` of `side` lives; in a forward run that does not train,
    /// nothing is kept for later and [`Storage::Steps`] is [`Storage::Rank`].
    pub fn get(&self, side: Side, v: ValueId, training: bool) -> Option<Storage> {
        let classes = match side {
            Side::Forward => &self.forward,
            Side::Backward => &self.backward,
        };
        let class = classes.get(v.index()).copied().flatten()?;
        Some(match (side, class, training) {
            (Side::Forward, Storage::Steps, false) => Storage::Rank,
            (_, class, _) => class,
        })
    }

    /// Whether the backward's work after the loop reads `v` (so a per-step
    /// value, or a carried adjoint, must be kept for every step).
    pub fn read_after_loop(&self, v: ValueId) -> bool {
        self.after_loop.contains(&v)
    }
}

/// Whether a per-step product reads or writes `v`.
fn rank_order(schedule: &Schedule, v: ValueId) -> bool {
    schedule.forward.iter().any(|st| {
        st.placement == Placement::EachStep
            && st.kind == StageKind::Gemm
            && (st.values.contains(&v) || st.inputs.contains(&v))
    })
}

/// The classes of one step, first decision wins.
struct Classes<'a> {
    graph: &'a Graph,
    classes: Vec<Option<Storage>>,
}

impl<'a> Classes<'a> {
    /// Leaves and constants.
    fn new(graph: &'a Graph, shapes: &Shapes) -> Classes<'a> {
        let mut c = Classes { graph, classes: vec![None; graph.value_bound()] };
        for v in graph.values() {
            let class = match graph.node(v).op {
                Op::Input(i) => Storage::Input(i),
                Op::State(i) => Storage::State(i),
                Op::Param(i) => Storage::Param(i),
                Op::Mask(i) => Storage::Mask(i),
                Op::Seed(0) => Storage::OutputAdjoint,
                Op::Seed(k) => Storage::CarriedAdjoint(k - 1),
                _ => continue,
            };
            c.set(v, class);
        }
        for (v, _) in shapes.constant_values::<f32>(graph) {
            c.set(v, Storage::Constant);
        }
        c
    }

    fn set(&mut self, v: ValueId, class: Storage) {
        if let Some(slot) = self.classes.get_mut(v.index()) {
            slot.get_or_insert(class);
        }
    }

    /// What each stage writes: per row of the layout before the loop, per
    /// rank each step (per step when `kept`), and after the loop per row of
    /// the layout, or once for a matrix.
    fn stage_outputs(&mut self, schedule: &Schedule, side: Side, kept: impl Fn(ValueId) -> bool) {
        let stages = match side {
            Side::Forward => &schedule.forward,
            Side::Backward => &schedule.backward,
        };
        for st in stages {
            for &v in &st.outputs {
                let class = match st.placement {
                    Placement::BeforeLoop => Storage::Layout,
                    Placement::EachStep if kept(v) => Storage::Steps,
                    Placement::EachStep => Storage::Rank,
                    Placement::AfterLoop if matches!(self.graph.ty(v), Type::Matrix(..)) => Storage::Fixed,
                    Placement::AfterLoop => Storage::Layout,
                };
                self.set(v, class);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{Program, Steps};
    use crate::schedule::Placement;

    fn lstm() -> (Steps, Program) {
        crate::program::shipped("lstm", |s| if s == "I" { 3 } else { 4 })
    }

    #[test]
    fn an_lstm_keeps_its_gates_per_step_only_when_training() {
        let (steps, p) = lstm();
        let cell = &steps.forward;
        // h' is both the output and next state 0: the next state decides.
        assert_eq!(p.storage(Side::Forward, cell.output, true), Some(Storage::NextState(0)));
        assert_eq!(p.storage(Side::Forward, cell.next_states[1], true), Some(Storage::NextState(1)));
        let per_step_saved: Vec<ValueId> = p
            .schedule
            .forward
            .iter()
            .filter(|st| st.placement == Placement::EachStep)
            .flat_map(|st| st.outputs.iter().copied())
            .filter(|v| p.saved().contains(v))
            .collect();
        assert!(!per_step_saved.is_empty());
        for v in per_step_saved {
            assert_eq!(p.storage(Side::Forward, v, true), Some(Storage::Steps), "{v}");
            assert_eq!(p.storage(Side::Forward, v, false), Some(Storage::Rank), "{v}");
        }
        // The hoisted input product: one row per row of the layout.
        let hoisted =
            p.schedule.forward.iter().find(|st| st.placement == Placement::BeforeLoop).expect("hoisted");
        assert_eq!(p.storage(Side::Forward, hoisted.outputs[0], false), Some(Storage::Layout));
    }

    #[test]
    fn an_lstm_backward_keeps_what_the_weight_gradients_read() {
        let (steps, p) = lstm();
        let grad = &steps.backward;
        for (i, d) in grad.d_states.iter().enumerate() {
            let d = d.expect("a state adjoint");
            assert_eq!(p.storage(Side::Backward, d, true), Some(Storage::StateAdjoint(i)));
        }
        // weight_hh's gradient: one matrix after the loop, from the per-step gate adjoints.
        let d_w = grad.d_params[1].expect("d weight_hh");
        assert_eq!(p.storage(Side::Backward, d_w, true), Some(Storage::Fixed));
        let kept: Vec<ValueId> = p
            .schedule
            .backward
            .iter()
            .filter(|st| st.placement == Placement::EachStep)
            .flat_map(|st| st.outputs.iter().copied())
            .filter(|&v| p.storage(Side::Backward, v, true) == Some(Storage::Steps))
            .collect();
        assert!(!kept.is_empty(), "the gate adjoints are read after the loop");
        assert!(kept.iter().all(|&v| p.read_after_loop(v)));
        for &v in p.saved() {
            if steps.backward.graph.contains(v) {
                assert_eq!(p.storage(Side::Backward, v, true), Some(Storage::Saved), "{v}");
            }
        }
    }
}
