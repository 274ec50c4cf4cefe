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
use super::device::{Buf, Device, Module};
use super::storage::{error, tape_homes, Home, LayerRun};
use crate::backend::{check_tape, ForwardJob, PreparedWeights, RowsMut};
use crate::cell::{CompiledCell, Layer};
use crate::error::Result;
use crate::plan::{Home as PlanHome, TapeSource};
use cellc::cuda::Kernel;
use cellc::ir::Graph;
use cellc::program::{Kept, Side};
use std::sync::{Arc, Mutex};

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

/// A layer-direction's parameters on the device, uploaded by the first
/// pass that reads them and kept in the model's prepared weights (which
/// the model empties whenever its parameters may change), so a model's
/// weights cross to the device once, not on every pass.
#[derive(Default)]
struct DeviceParams(Mutex<Option<Arc<Vec<Buf>>>>);

/// A job's `params` on `device`: kept from an earlier pass in `prepared`,
/// or uploaded (and kept, unless they come with this pass only).
pub(super) fn params_on_device(
    device: &dyn Device,
    params: &[&[f32]],
    prepared: &PreparedWeights,
) -> Result<Arc<Vec<Buf>>> {
    let upload = || params.iter().map(|p| device.upload(p)).collect::<Result<Vec<_>>>().map(Arc::new);
    let slot = match prepared.is_for_one_pass() {
        true => None,
        false => prepared.get_or_init(DeviceParams::default),
    };
    let Some(slot) = slot else { return upload() };
    let mut held = slot.0.lock().map_err(|_| error("the device parameters' lock is poisoned"))?;
    if let Some(params) = held.as_ref() {
        return Ok(params.clone());
    }
    let params = upload()?;
    *held = Some(params.clone());
    Ok(params)
}

/// Runs the forward of `job` on `device` with `module` (holding
/// `kernels`), for host memory: uploads what the pass reads, downloads
/// what it writes.
pub fn forward(
    device: &dyn Device,
    module: &Module,
    kernels: &[(usize, Kernel)],
    job: &ForwardJob,
    output: &mut RowsMut,
    tape: Option<&mut [f32]>,
    (graph_capture, precision): (bool, cellc::precision::Precision),
) -> Result<Vec<Vec<f32>>> {
    let layer = job.layer;
    let layout_rows = job.layout_rows();
    if let Some(t) = tape.as_deref() {
        check_tape(layer, layout_rows, t.len())?;
    }
    let mut pass =
        LayerRun::new(device, job.input.layout, layout_rows, job.order, job.reverse).in_precision(precision);
    let batch = pass.batch();
    let o = layer.output_size;
    let io = ForwardIo {
        input: Home::Layout { base: pass.upload(job.input.data)?, width: job.input.width },
        masks: job.masks.map(|m| upload_rows(&mut pass, m)).transpose()?,
        params: pass.hold(params_on_device(device, job.params, job.prepared)?),
        h0: job.h0.iter().map(|h| pass.upload(h)).collect::<Result<_>>()?,
        output: Home::Layout { base: pass.zeros(layout_rows * o)?, width: o },
        finals: layer.state_sizes.iter().map(|&m| pass.zeros(batch * m)).collect::<Result<_>>()?,
        tape: tape.as_deref().map(|t| pass.zeros(t.len())).transpose()?,
    };
    forward_on(&mut pass, module, kernels, (job.cell, layer), &io, graph_capture)?;

    let host = pass.fetch(io.output, o)?;
    for row in &pass.valid_rows() {
        let at = output.layout.row(row.b, row.t) * output.width + output.offset;
        output.data[at..at + o].copy_from_slice(host.row(*row, &pass));
    }
    if let (Some(t), Some(at)) = (tape, io.tape) {
        t.copy_from_slice(&pass.download(at, t.len())?);
    }
    io.finals.iter().zip(&layer.state_sizes).map(|(&at, &m)| pass.download(at, batch * m)).collect()
}

/// Runs the forward of `cell`'s `layer` in `pass` over the device memory
/// of `io`, with `module` (holding `kernels`); with a tape in `io`
/// (training), it copies there what the backward reads.
pub fn forward_on(
    pass: &mut LayerRun,
    module: &Module,
    kernels: &[(usize, Kernel)],
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
    calls.all_rows_stages(pass, (g, shapes), kernels, stages, &plan.before_loop)?;
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

/// Host rows (every row of the layout) uploaded for the pass: a `Layout` home.
pub(super) fn upload_rows(pass: &mut LayerRun, rows: crate::backend::Rows) -> Result<Home> {
    Ok(Home::Layout { base: pass.upload(rows.data)? + 4 * rows.offset as u64, width: rows.width })
}
