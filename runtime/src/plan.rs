//! What one pass of a layer does, decided once for every device.
//!
//! A [`PassPlan`] is made per layer for each of its three passes (the
//! forward for inference, the forward for training, the backward) from the
//! layer's [`Program`] and the cell's steps. It says:
//!
//! - where every value of the pass lives ([`Home`]): a leaf the caller
//!   provides (an input's features, a state, a parameter, the output's
//!   adjoint, a carried adjoint), a row of the forward's tape, or one of
//!   the program's storage classes for what a stage computes;
//! - which stages run before the time loop, in it (step by step, or as
//!   one whole-sequence kernel: [`TimeLoop`]) and after it;
//! - what each step hands on (the next states, or the state adjoints), what
//!   a training forward keeps in each part of its tape and whether a stage
//!   writes that part directly, what the backward's work after the loop
//!   reads from every step, and where the pass's results are.
//!
//! Devices only execute a plan: the reference device row by row, the CPU
//! through its panels, kernels and team of threads, the CUDA device as a
//! list of calls. How a home is laid out in memory (a rank buffer and a
//! per-row copy on the CPU, a step-major history on the GPU) is each
//! device's own business.

use crate::error::{Result, RuntimeError};
use cellc::ir::{Graph, ValueId};
use cellc::program::{Kept, Program, Side, Steps, Storage};
use cellc::schedule::{Placement, StageKind};

/// Where one value of a pass lives (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Home {
    /// Input `i`'s features of the layer input's row (the caller's layout).
    Input(usize),
    /// State `i` before the step, as the forward carries it.
    State(usize),
    /// State `i` after the step: written by the step, carried to the next.
    NextState(usize),
    /// Parameter `i`: the same for every row.
    Param(usize),
    /// Mask `i`'s units of the row (the caller's layout), filled for the
    /// pass ([`crate::masks::MaskRows`]).
    Mask(usize),
    /// A value of constants only: the same for every row.
    Constant,
    /// The forward's output; `rank_order` when a per-step product reads or
    /// writes it, so that a step's rows must be contiguous ranks.
    Output {
        /// Whether a step's rows must be contiguous ranks (see above).
        rank_order: bool,
    },
    /// The adjoint of the output (the caller's layout).
    OutputAdjoint,
    /// The adjoint of next state `i`, carried from the step after.
    Carry(usize),
    /// The adjoint of state `i`: written by the step, carried to the one before.
    StateAdjoint(usize),
    /// A row of the forward's tape, by layout row: read by the backward;
    /// in a training forward, written there directly by its stage.
    Tape(Kept),
    /// State `i` as the step read it, which the tape keeps only as the
    /// state after a step ([`cellc::program::TapeLayout::before_from_after`]):
    /// the tape's [`Kept::StateAfter`] row of the sequence's previous step
    /// in the pass's direction, or the sequence's initial state at its
    /// first step. Read by the backward's kernels, row by row.
    StateBeforeFromTape(usize),
    /// One row per row of the caller's layout.
    Layout,
    /// One row per sequence in rank order, rewritten every step.
    Rank,
    /// One row per `(step, rank)`, kept for later in the pass.
    Steps,
    /// One for the whole batch (a weight-gradient matrix).
    Fixed,
}

/// How the time loop runs a side's per-step stages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TimeLoop {
    /// Step by step (in reverse time for the backward), each stage over the
    /// step's active rows: these stages, in schedule order.
    Steps(Vec<usize>),
    /// One kernel (this stage) walking each sequence through time, its
    /// carried inputs chained to the row before.
    WholeSequence(usize),
}

/// Where a part of a training forward's tape takes each row from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TapeSource {
    /// State `i` as the step read it.
    StateBefore(usize),
    /// A value of the step (a next state, the output, a saved value).
    Value(ValueId),
}

/// One part of a training forward's tape: what it keeps, where that comes
/// from, and whether the stage computing it writes the tape directly (so
/// nothing is copied).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TapeWrite {
    /// The part.
    pub kept: Kept,
    /// What each row of it holds.
    pub source: TapeSource,
    /// The source's home is the part itself ([`Home::Tape`]).
    pub direct: bool,
}

/// Where a parameter's gradient is, once the backward's loop is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamGradient {
    /// A matrix computed once for the batch ([`Home::Fixed`]).
    Matrix(ValueId),
    /// A value of every valid row, summed over the rows.
    SumOfRows(ValueId),
}

impl ParamGradient {
    /// The value holding the gradient (or each row's part of it).
    pub fn value(self) -> ValueId {
        match self {
            ParamGradient::Matrix(v) | ParamGradient::SumOfRows(v) => v,
        }
    }
}

/// One pass of one layer, as every device runs it (see the module documentation).
#[derive(Clone, Debug)]
pub struct PassPlan {
    /// The step this pass runs.
    pub side: Side,
    /// Every value's home, by value index.
    homes: Vec<Option<Home>>,
    /// The values with a home, in the graph's order.
    placed: Vec<ValueId>,
    /// The stages run once over every row before the loop, in schedule order.
    pub before_loop: Vec<usize>,
    /// The stages of the time loop, and how it runs them.
    pub time_loop: TimeLoop,
    /// The stages run once over every row after the loop, in schedule order.
    pub after_loop: Vec<usize>,
    /// What each step hands on, by state: the forward's next state `i`; the
    /// backward's adjoint of state `i` (`None`: zero).
    pub carried: Vec<Option<ValueId>>,
    /// The forward's output (`None` in a backward).
    pub output: Option<ValueId>,
    /// A training forward's tape, part by part in the reserve's order.
    pub tape: Vec<TapeWrite>,
    /// The backward's per-step values that its work after the loop reads,
    /// kept for every row (in schedule order).
    pub kept_for_after_loop: Vec<ValueId>,
    /// The backward's carried adjoints that its work after the loop reads
    /// (a weight gradient `d_h' ⊗ h`), with their state: kept for every row.
    pub carries_for_after_loop: Vec<(ValueId, usize)>,
    /// The backward's parameter gradients (`None`: zero).
    pub d_params: Vec<Option<ParamGradient>>,
    /// The backward's input adjoints, added into the input's features (`None`: zero).
    pub d_inputs: Vec<Option<ValueId>>,
}

impl PassPlan {
    /// Where `v` lives in this pass, if it is one of its values.
    pub fn home(&self, v: ValueId) -> Option<Home> {
        self.homes.get(v.index()).copied().flatten()
    }

    /// Every value with a home, and that home.
    pub fn homes(&self) -> impl Iterator<Item = (ValueId, Home)> + '_ {
        self.placed.iter().filter_map(|&v| Some((v, self.home(v)?)))
    }

    /// The stages at `placement`: those before the loop, in it, or after it.
    pub fn stages_at(&self, placement: Placement) -> &[usize] {
        match (placement, &self.time_loop) {
            (Placement::BeforeLoop, _) => &self.before_loop,
            (Placement::EachStep, TimeLoop::Steps(stages)) => stages,
            (Placement::EachStep, TimeLoop::WholeSequence(stage)) => std::slice::from_ref(stage),
            (Placement::AfterLoop, _) => &self.after_loop,
        }
    }

    /// The forward of `program` (training: it fills the tape).
    pub fn forward(steps: &Steps, program: &Program, training: bool) -> Result<PassPlan> {
        let cell = &steps.forward;
        let g: &Graph = cell;
        let stages = &program.schedule.forward;
        // A saved value that only per-step kernels write, and no per-step
        // product reads, is written straight into its part of the tape.
        let direct = |v: ValueId| {
            training
                && program.saved().contains(&v)
                && program.storage(Side::Forward, v, true) == Some(Storage::Steps)
                && stages.iter().any(|st| {
                    st.placement == Placement::EachStep && st.kind.is_kernel() && st.outputs.contains(&v)
                })
                && !stages.iter().any(|st| {
                    st.placement == Placement::EachStep
                        && st.kind == StageKind::Gemm
                        && st.inputs.contains(&v)
                })
        };
        let (mut homes, mut placed) = (vec![None; g.value_bound()], Vec::new());
        for v in g.values() {
            let home = match program.storage(Side::Forward, v, training) {
                _ if direct(v) => Home::Tape(Kept::Saved(v)),
                Some(storage) => common_home(storage).ok_or_else(|| misplaced(Side::Forward, v, storage))?,
                None => continue,
            };
            homes[v.index()] = Some(home);
            placed.push(v);
        }
        let tape = match training {
            false => Vec::new(),
            true => program
                .tape()
                .parts()
                .iter()
                .map(|part| {
                    let source = match part.kept {
                        Kept::StateBefore(i) => TapeSource::StateBefore(i),
                        Kept::StateAfter(i) => TapeSource::Value(cell.next_states[i]),
                        Kept::Output => TapeSource::Value(cell.output),
                        Kept::Saved(v) => TapeSource::Value(v),
                    };
                    let direct = matches!(source, TapeSource::Value(v) if homes[v.index()] == Some(Home::Tape(part.kept)));
                    TapeWrite { kept: part.kept, source, direct }
                })
                .collect(),
        };
        let (before_loop, time_loop, after_loop) = phases(program, Side::Forward);
        Ok(PassPlan {
            side: Side::Forward,
            homes,
            placed,
            before_loop,
            time_loop,
            after_loop,
            carried: cell.next_states.iter().map(|&v| Some(v)).collect(),
            output: Some(cell.output),
            tape,
            kept_for_after_loop: Vec::new(),
            carries_for_after_loop: Vec::new(),
            d_params: Vec::new(),
            d_inputs: Vec::new(),
        })
    }

    /// The backward of `program`, reading the training forward's tape.
    pub fn backward(steps: &Steps, program: &Program) -> Result<PassPlan> {
        let grad = &steps.backward;
        let g = &grad.graph;
        let kept_parts: Vec<Kept> = program.tape().parts().iter().map(|p| p.kept).collect();
        let (mut homes, mut placed) = (vec![None; g.value_bound()], Vec::new());
        for v in g.values() {
            let Some(storage) = program.storage(Side::Backward, v, true) else { continue };
            let home = match storage {
                Storage::State(i) if program.tape().before_from_after(i) => Home::StateBeforeFromTape(i),
                Storage::State(i) => Home::Tape(Kept::StateBefore(i)),
                Storage::NextState(i) => Home::Tape(Kept::StateAfter(i)),
                Storage::Output { .. } => Home::Tape(Kept::Output),
                Storage::Saved => Home::Tape(Kept::Saved(v)),
                Storage::OutputAdjoint => Home::OutputAdjoint,
                Storage::CarriedAdjoint(k) => Home::Carry(k),
                Storage::StateAdjoint(i) => Home::StateAdjoint(i),
                other => common_home(other).ok_or_else(|| misplaced(Side::Backward, v, other))?,
            };
            let read = match home {
                Home::Tape(kept) => Some(kept),
                Home::StateBeforeFromTape(i) => Some(Kept::StateAfter(i)),
                _ => None,
            };
            if let Some(kept) = read {
                if !kept_parts.contains(&kept) {
                    return Err(RuntimeError::Internal(format!(
                        "the backward reads {v} as {kept:?}, which the tape does not keep"
                    )));
                }
            }
            homes[v.index()] = Some(home);
            placed.push(v);
        }
        let (before_loop, time_loop, after_loop) = phases(program, Side::Backward);
        let each_step =
            program.stages(Side::Backward).iter().filter(|st| st.placement == Placement::EachStep);
        let kept_for_after_loop = each_step
            .flat_map(|st| st.outputs.iter().copied())
            .filter(|&v| homes[v.index()] != Some(Home::Fixed) && program.read_after_loop(v))
            .collect();
        let carries_for_after_loop = g
            .values()
            .filter_map(|v| match homes[v.index()] {
                Some(Home::Carry(i)) if program.read_after_loop(v) => Some((v, i)),
                _ => None,
            })
            .collect();
        let d_params = grad
            .d_params
            .iter()
            .map(|d| {
                d.map(|v| match homes[v.index()] {
                    Some(Home::Fixed) => ParamGradient::Matrix(v),
                    _ => ParamGradient::SumOfRows(v),
                })
            })
            .collect();
        Ok(PassPlan {
            side: Side::Backward,
            homes,
            placed,
            before_loop,
            time_loop,
            after_loop,
            carried: grad.d_states.clone(),
            output: None,
            tape: Vec::new(),
            kept_for_after_loop,
            carries_for_after_loop,
            d_params,
            d_inputs: grad.d_inputs.clone(),
        })
    }
}

/// The home of a storage class that means the same in both steps.
fn common_home(storage: Storage) -> Option<Home> {
    Some(match storage {
        Storage::Input(i) => Home::Input(i),
        Storage::State(i) => Home::State(i),
        Storage::NextState(i) => Home::NextState(i),
        Storage::Param(i) => Home::Param(i),
        Storage::Mask(i) => Home::Mask(i),
        Storage::Constant => Home::Constant,
        Storage::Output { rank_order } => Home::Output { rank_order },
        Storage::Layout => Home::Layout,
        Storage::Rank => Home::Rank,
        Storage::Steps => Home::Steps,
        Storage::Fixed => Home::Fixed,
        Storage::OutputAdjoint | Storage::CarriedAdjoint(_) | Storage::StateAdjoint(_) | Storage::Saved => {
            return None
        }
    })
}

fn misplaced(side: Side, v: ValueId, storage: Storage) -> RuntimeError {
    RuntimeError::Internal(format!(
        "{side:?} value {v} is stored as {storage:?}, which that step has no place for"
    ))
}

/// A side's stages before, in and after the loop. The loop is one
/// whole-sequence kernel where the schedule made its only per-step stage one.
fn phases(program: &Program, side: Side) -> (Vec<usize>, TimeLoop, Vec<usize>) {
    let stages = program.stages(side);
    let at = |placement: Placement| -> Vec<usize> {
        stages.iter().enumerate().filter(|(_, st)| st.placement == placement).map(|(i, _)| i).collect()
    };
    let each_step = at(Placement::EachStep);
    let time_loop = match each_step[..] {
        [i] if matches!(stages[i].kind, StageKind::WholeSequence { .. }) => TimeLoop::WholeSequence(i),
        _ => TimeLoop::Steps(each_step),
    };
    (at(Placement::BeforeLoop), time_loop, at(Placement::AfterLoop))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cell::CompiledCell;

    fn lstm() -> (CompiledCell, Program) {
        let src =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../cells/lstm.cell")).unwrap();
        let cell = CompiledCell::from_source("lstm.cell", &src, None).expect("compiles");
        let sizes = [("I".to_string(), 3), ("H".to_string(), 4)].into_iter().collect();
        let program = cell.program(&sizes).expect("sizes");
        (cell, program)
    }

    #[test]
    fn a_training_lstm_writes_its_gates_into_the_tape_and_copies_its_states() {
        let (cell, program) = lstm();
        let plan = PassPlan::forward(&cell, &program, true).expect("plan");
        assert_eq!(plan.tape.len(), program.tape().parts().len());
        for write in &plan.tape {
            match write.kept {
                Kept::Saved(v) => {
                    assert!(write.direct, "{v}: gates are written by the pointwise kernel only");
                    assert_eq!(plan.home(v), Some(Home::Tape(write.kept)));
                }
                _ => assert!(!write.direct, "{:?} is copied", write.kept),
            }
        }
        let inference = PassPlan::forward(&cell, &program, false).expect("plan");
        assert!(inference.tape.is_empty());
        assert!(!inference.homes().any(|(_, h)| matches!(h, Home::Tape(_) | Home::Steps)));
        assert!(matches!(plan.time_loop, TimeLoop::Steps(ref s) if s.len() == 2), "{:?}", plan.time_loop);
    }

    #[test]
    fn an_lstm_backward_reads_the_tape_and_sums_its_bias_gradient() {
        let (cell, program) = lstm();
        let plan = PassPlan::backward(&cell, &program).expect("plan");
        let tape_reads: Vec<Kept> = plan
            .homes()
            .filter_map(|(_, h)| match h {
                Home::Tape(k) => Some(k),
                _ => None,
            })
            .collect();
        for part in program.tape().parts() {
            assert!(tape_reads.contains(&part.kept), "{:?} is kept but never read", part.kept);
        }
        assert!(matches!(plan.d_params[1], Some(ParamGradient::Matrix(_))));
        assert!(plan.d_params.iter().any(|d| matches!(d, Some(ParamGradient::SumOfRows(_)))));
        assert!(!plan.kept_for_after_loop.is_empty());
    }
}
