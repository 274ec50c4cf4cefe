//! One layer and direction forwards on a [`Device`]: the schedule's GEMMs
//! and its pointwise stages as one list of [`Call`]s over pointer tables
//! uploaded beforehand, so no row is gathered or copied:
//!
//! - hoisted products run over every row of the caller's layout (padding
//!   rows included: a GPU does them for free and nothing reads them);
//! - states live in a history (a `Steps` home, slot `s` before step `s`),
//!   so a step's GEMM reads a contiguous prefix and a step's kernel writes
//!   the next slot directly: no copy between steps;
//! - for training, values the backward reads are kept in `Steps` homes and
//!   the pass's buffers become the tape ([`CudaTape`]).
//!
//! [`Call`]: super::device::Call

use super::calls::Calls;
use super::device::{Device, Module};
use super::storage::{error, Home, Kept, LayerRun};
use crate::backend::{ForwardJob, ForwardResult, RowsMut, Tape};
use crate::error::Result;
use cellc::cuda::Kernel;
use cellc::ir::{Graph, ValueId};
use cellc::program::{Side, Storage};
use cellc::schedule::Placement;

/// What a training forward leaves on the device for the backward.
#[derive(Debug)]
pub struct CudaTape {
    /// The device it lives on ([`Device::name`]).
    pub device: String,
    /// The layer input (a `Layout` home of the input's width).
    pub input: Home,
    pub params: Vec<u64>,
    /// State `i`'s history: slot `s` before step `s`.
    pub states: Vec<Home>,
    /// This direction's output.
    pub output: Home,
    /// The buffers, and the homes of the values the backward reads.
    pub kept: Kept,
}

/// Runs the forward of `job` on `device` with `module` (holding `kernels`).
pub fn forward(
    device: &dyn Device,
    module: &Module,
    kernels: &[(usize, Kernel)],
    job: &ForwardJob,
    output: &mut RowsMut,
    graph_capture: bool,
) -> Result<ForwardResult> {
    let g: &Graph = &job.cell.forward;
    let cell = &job.cell.forward;
    let layer = job.layer;
    let plan = &layer.forward_shapes;
    let stages = &layer.schedule.forward;
    let mut pass = LayerRun::new(device, &job.input, job.order, job.reverse);
    let batch = pass.batch();

    // Leaves, constants and the state histories (slot 0: the initial states).
    let input = Home::Layout { base: pass.upload(job.input.data)?, width: job.input.width };
    pass.place_input_and_constants(g, plan, input, &layer.input_slices)?;
    let params: Vec<u64> = job.params.iter().map(|p| pass.upload(p)).collect::<Result<_>>()?;
    let storage = |v: ValueId| layer.storage(Side::Forward, v, job.training);
    let mut states = Vec::new();
    for (i, &m) in layer.state_sizes.iter().enumerate() {
        let history = pass.history(job.h0[i], m, |_| 0)?;
        states.push(history);
        if storage(cell.next_states[i]) != Some(Storage::NextState(i)) {
            return Err(error(format!(
                "next state {i} of `{}` is not computed by a stage of its own",
                cell.name
            )));
        }
        pass.place(cell.next_states[i], history.next_slot(batch));
    }
    for v in g.values() {
        match storage(v) {
            Some(Storage::Param(i)) => pass.place(v, Home::Fixed(params[i])),
            Some(Storage::State(i)) => pass.place(v, states[i]),
            _ => {}
        }
    }
    // A per-step product reads and writes a step's rows contiguously (rank
    // order); otherwise the kernels write the caller's layout directly.
    match storage(cell.output) {
        Some(Storage::Output { rank_order: true }) => {
            pass.place_steps(cell.output, layer.output_size)?;
        }
        Some(Storage::Output { rank_order: false }) => {
            pass.place_layout(cell.output, layer.output_size)?;
        }
        _ => {}
    }
    for st in stages {
        for &v in &st.outputs {
            if pass.has_home(v) {
                continue;
            }
            let len = plan.elements(v);
            match storage(v) {
                Some(Storage::Layout) => pass.place_layout(v, len)?,
                Some(Storage::Steps) => pass.place_steps(v, len)?,
                Some(Storage::Rank) => pass.place_rank(v, len)?,
                other => return Err(error(format!("stage output {v} stored as {other:?}"))),
            };
        }
    }

    let mut calls = Calls::new(device.block_size());
    // Before the loop: hoisted products over every layout row, pointwise stages over valid rows.
    calls.all_rows_stages(&mut pass, (g, plan), kernels, stages, Placement::BeforeLoop)?;
    calls.time_loop(&mut pass, (g, plan), kernels, stages, false)?;
    // Final states: each sequence's history at its own last step.
    let lengths = job.order.lengths();
    let finals: Vec<u64> = states
        .iter()
        .map(|&h| calls.gather_sequences(&mut pass, h, |b| lengths[b]))
        .collect::<Result<_>>()?;

    device.run(module, &calls.list, graph_capture)?;

    // The output rows, from wherever the output lives.
    let o = layer.output_size;
    let out_home = pass.home(cell.output)?;
    let host = pass.fetch(out_home, o)?;
    for row in &pass.valid_rows() {
        let at = output.layout.row(row.b, row.t) * output.width + output.offset;
        output.data[at..at + o].copy_from_slice(host.row(*row, &pass));
    }
    let final_states = finals
        .iter()
        .zip(&layer.state_sizes)
        .map(|(&at, &m)| pass.download(at, batch * m))
        .collect::<Result<_>>()?;
    let tape = if job.training {
        let keep: Vec<ValueId> =
            layer.saved().iter().copied().filter(|v| g.contains(*v) && pass.has_home(*v)).collect();
        let kept = pass.keep(keep)?;
        Some(Tape(Box::new(CudaTape {
            device: device.name(),
            input,
            params,
            states,
            output: out_home,
            kept,
        })))
    } else {
        None
    };
    Ok(ForwardResult { final_states, tape })
}
