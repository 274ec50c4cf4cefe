//! One layer and direction forwards on a [`Device`]: the pass's plan
//! ([`crate::plan::PassPlan`]) executed as one list of [`Call`]s (GEMMs,
//! and kernels over pointer tables uploaded beforehand), so no row is
//! gathered or copied:
//!
//! - hoisted products run over every row of the caller's layout (padding
//!   rows included: a GPU does them for free and nothing reads them);
//! - states live in a history (a `Steps` home, slot `s` before step `s`),
//!   so a step's GEMM reads a contiguous prefix and a step's kernel writes
//!   the next slot directly: no copy between steps;
//! - for training, the values the backward reads go to the tape the pass
//!   is given (the caller's memory, laid out by layout row as the layer's
//!   program says: [`tape_homes`]): written there by their kernels where
//!   the plan says so, else copied there after the loop.
//!
//! [`Call`]: super::device::Call

use super::calls::Calls;
use super::device::Module;
use super::storage::{error, tape_homes, Home, LayerRun};
use super::SideKernels;
use crate::cell::{CompiledCell, Layer};
use crate::error::Result;
use crate::plan::{Home as PlanHome, TapeSource};
use cellc::ir::Graph;
use cellc::program::{Kept, Side};

/// The memory of a layer's forward that is not the pass's own, on the
/// device: what it reads, and where it writes.
#[derive(Clone, Debug)]
pub struct ForwardIo {
    /// The layer input (a `Layout` home).
    pub input: Home,
    /// The masks the steps read (a `Layout` home), if the cell has any.
    pub masks: Option<Home>,
    pub params: Vec<u64>,
    /// The initial states: `[batch, m]` rows each, in batch order.
    pub h0: Vec<u64>,
    /// Where this direction's output rows go: a `Layout` home based at
    /// the direction's first feature. Only valid rows are written.
    pub output: Home,
    /// The final states: `[batch, m]` rows each, in batch order.
    pub finals: Vec<u64>,
    /// Training: where the tape goes (the layout's rows times the
    /// program's tape floats per row), as [`tape_homes`] lays it out.
    pub tape: Option<u64>,
}

/// Runs the forward of `cell`'s `layer` in `pass` over the device memory
/// of `io`, with `module` (holding `kernels`); with a tape in `io`
/// (training), it copies there what the backward reads.
pub fn forward_on(
    pass: &mut LayerRun,
    module: &Module,
    kernels: &SideKernels,
    (compiled, layer): (&CompiledCell, &Layer),
    io: &ForwardIo,
    graph_capture: bool,
) -> Result<()> {
    let plan = layer.pass(Side::Forward, io.tape.is_some());
    let g: &Graph = &compiled.forward;
    let shapes = &layer.forward_shapes;
    let stages = &layer.schedule.forward;
    let batch = pass.batch();
    let mut calls = Calls::new(pass.device.block_size(), pass.precision);
    // The tape: padding rows zero, each part's valid rows written during
    // the pass (straight by the stage the plan says, else copied after).
    let tape = match io.tape {
        Some(base) => {
            calls.zero(base, pass.layout_rows * layer.tape().floats_per_row());
            tape_homes(layer, pass.layout_rows, base)
        }
        None => Vec::new(),
    };

    // Leaves, constants and the state histories (slot 0: the initial states).
    pass.place_leaves((g, shapes), plan, (io.input, io.masks), layer)?;
    let mut states = Vec::new();
    for (i, &m) in layer.state_sizes.iter().enumerate() {
        let history = calls.scatter_sequences(pass, io.h0[i], m, |_| 0)?;
        states.push(history);
        match plan.carried[i] {
            Some(next) if plan.home(next) == Some(PlanHome::NextState(i)) => {
                pass.place(next, history.next_slot(batch))
            }
            _ => {
                return Err(error(format!(
                    "next state {i} of `{}` is not computed by a stage of its own",
                    compiled.forward.name
                )))
            }
        }
    }
    for (v, home) in plan.homes() {
        match home {
            PlanHome::Param(i) => pass.place(v, Home::Fixed(io.params[i])),
            PlanHome::State(i) => pass.place(v, states[i]),
            PlanHome::Tape(kept) => pass.place(v, tape_part(&tape, kept)?),
            // A per-step product reads and writes a step's rows contiguously
            // (rank order); otherwise the kernels write in the batch's layout.
            PlanHome::Output { rank_order: true } => {
                pass.place_steps(v, layer.output_size)?;
            }
            PlanHome::Output { rank_order: false } => {
                pass.place_layout(v, layer.output_size)?;
            }
            _ => {}
        }
    }
    for st in stages {
        for &v in &st.outputs {
            if pass.has_home(v) {
                continue;
            }
            let len = shapes.elements(v);
            match plan.home(v) {
                Some(PlanHome::Layout) => pass.place_layout(v, len)?,
                Some(PlanHome::Steps) => pass.place_steps(v, len)?,
                Some(PlanHome::Rank) => pass.place_rank(v, len)?,
                other => return Err(error(format!("stage output {v} homed at {other:?}"))),
            };
        }
    }

    // Before the loop: hoisted products over every layout row, pointwise stages over valid rows.
    calls.all_rows_stages(pass, (g, shapes), &kernels.stages, stages, &plan.before_loop)?;
    calls.time_loop(pass, (g, shapes), kernels, (stages, &plan.time_loop), false)?;
    // Final states: each sequence's history at its own last step.
    let lengths = pass.order.lengths();
    for (&h, &at) in states.iter().zip(&io.finals) {
        calls.gather_sequences(pass, h, |b| lengths[b], at)?;
    }
    // The output's valid rows, from wherever the output lives.
    let output_value = plan.output.ok_or_else(|| error("a forward without an output"))?;
    let output = pass.home(output_value)?;
    let (layout, rows) = (pass.layout, pass.valid_rows());
    let pairs: Vec<(u64, u64)> = rows
        .iter()
        .map(|&row| (io.output.addr(row, layout, batch), output.addr(row, layout, batch)))
        .collect();
    calls.copy_rows(pass, &pairs, layer.output_size)?;
    // The tape's parts that no stage wrote directly: their valid rows,
    // from their sources' homes.
    for write in plan.tape.iter().filter(|w| !w.direct) {
        let to = tape_part(&tape, write.kept)?;
        let from = match write.source {
            TapeSource::StateBefore(i) => states[i],
            TapeSource::Value(v) => pass.home(v)?,
        };
        let pairs: Vec<(u64, u64)> =
            rows.iter().map(|&row| (to.addr(row, layout, batch), from.addr(row, layout, batch))).collect();
        calls.copy_rows(pass, &pairs, to.width())?;
    }
    pass.device.run(module, &calls.list, graph_capture)
}

/// The home of the tape's part keeping `kept`.
pub(super) fn tape_part(tape: &[(Kept, Home)], kept: Kept) -> Result<Home> {
    let home = tape.iter().find(|(k, _)| *k == kept).map(|&(_, h)| h);
    home.ok_or_else(|| error(format!("the pass reads or writes {kept:?}, which the tape does not keep")))
}
