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
use super::storage::{error, Home, Kept, Pass, Row};
use crate::backend::{ForwardJob, ForwardResult, RowsMut, Tape};
use crate::error::Result;
use cellc::cuda::Kernel;
use cellc::ir::{Graph, Op, ValueId};
use cellc::schedule::{Placement, StageKind};

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

/// The kernels of a layer's forward or backward stages, by stage index.
pub fn kernel_of(kernels: &[(usize, Kernel)], stage: usize) -> Result<&Kernel> {
    kernels
        .iter()
        .find(|(i, _)| *i == stage)
        .map(|(_, k)| k)
        .ok_or_else(|| error(format!("no kernel for stage {stage}")))
}

/// The homes every pass shares: the layer input's features and the
/// graph's constants.
pub fn place_inputs_and_constants(
    pass: &mut Pass,
    graph: &Graph,
    plan: &cellc::interp::Plan,
    input: Home,
    input_slices: &[(usize, usize)],
) -> Result<()> {
    let Home::Layout { base, width } = input else {
        return Err(error("the layer input is not in the caller's layout"));
    };
    for v in graph.values() {
        if let Op::Input(i) = graph.node(v).op {
            pass.place(v, Home::Layout { base: base + 4 * input_slices[i].0 as u64, width });
        }
    }
    for (v, value) in plan.constant_values::<f32>(graph) {
        let at = pass.upload(&value)?;
        pass.place(v, Home::Fixed(at));
    }
    Ok(())
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
    let g: &Graph = &job.cell.cell;
    let cell = &job.cell.cell;
    let layer = job.layer;
    let plan = &layer.forward_plan;
    let stages = &layer.schedule.forward;
    let layout_rows = job.input.data.len() / job.input.width.max(1);
    let mut pass = Pass::new(device, job.input.layout, job.plan, job.reverse, layout_rows);
    let (batch, steps) = (pass.batch(), pass.steps());

    // Leaves, constants and the state histories.
    let input = Home::Layout { base: pass.upload(job.input.data)?, width: job.input.width };
    place_inputs_and_constants(&mut pass, g, plan, input, &layer.input_slices)?;
    let params: Vec<u64> = job.params.iter().map(|p| pass.upload(p)).collect::<Result<_>>()?;
    let order = job.plan.order();
    let mut states = Vec::new();
    for (i, &m) in layer.state_sizes.iter().enumerate() {
        let mut history = vec![0.0f32; (steps + 1) * batch * m];
        for (r, &b) in order.iter().enumerate() {
            history[r * m..(r + 1) * m].copy_from_slice(&job.h0[i][b * m..(b + 1) * m]);
        }
        let base = pass.upload(&history)?;
        states.push(Home::Steps { base, len: m });
        let next = Home::Steps { base: base + 4 * (batch * m) as u64, len: m };
        if pass.has_home(cell.next_states[i]) {
            return Err(error(format!(
                "next state {i} of `{}` is not computed by a stage of its own",
                cell.name
            )));
        }
        pass.place(cell.next_states[i], next);
    }
    for v in g.values() {
        match g.node(v).op {
            Op::Param(i) => pass.place(v, Home::Fixed(params[i])),
            Op::State(i) => pass.place(v, states[i]),
            _ => {}
        }
    }
    if !pass.has_home(cell.output) {
        pass.place_layout(cell.output, layer.output_size)?;
    }
    let saved = &layer.schedule.saved.saved;
    for st in stages {
        for &v in &st.outputs {
            if pass.has_home(v) {
                continue;
            }
            let len = plan.elements(v);
            match st.placement {
                Placement::BeforeLoop => pass.place_layout(v, len)?,
                _ if job.training && saved.contains(&v) => pass.place_steps(v, len)?,
                _ => pass.place_rank(v, len)?,
            };
        }
    }

    let mut calls = Calls::new(device.block_size());
    // Before the loop: hoisted products over every layout row, pointwise stages over valid rows.
    let valid = pass.valid_rows();
    for (i, st) in stages.iter().enumerate().filter(|(_, s)| s.placement == Placement::BeforeLoop) {
        match st.kind {
            StageKind::Gemm => {
                for &v in &st.values {
                    calls.all_rows_product(&mut pass, g, plan, v)?;
                }
            }
            _ => calls.over(&mut pass, kernel_of(kernels, i)?, &valid)?,
        }
    }
    // The time loop: one whole-sequence kernel, or the stages step by step.
    let each_step: Vec<(usize, &cellc::schedule::Stage)> =
        stages.iter().enumerate().filter(|(_, s)| s.placement == Placement::EachStep).collect();
    match each_step[..] {
        [(i, st)] if matches!(st.kind, StageKind::WholeSequence { .. }) => {
            let sequences: Vec<Vec<Row>> = (0..batch).map(|r| pass.sequence(r)).collect();
            calls.sequences(&mut pass, kernel_of(kernels, i)?, &sequences)?;
        }
        _ => step_by_step(&mut pass, &mut calls, g, plan, kernels, &each_step, (0..steps).collect())?,
    }
    // Final states: each sequence's history at its own last step, gathered in batch order.
    let mut finals = Vec::new();
    for (i, &m) in layer.state_sizes.iter().enumerate() {
        let out = pass.zeros(batch * m)?;
        let pairs: Vec<(u64, u64)> = (0..batch)
            .map(|r| {
                let b = order[r];
                let last = Row { b, t: 0, s: job.plan.lengths()[b], r };
                (out + 4 * (b * m) as u64, states[i].addr(last, pass.layout, batch))
            })
            .collect();
        calls.copy_rows(&mut pass, &pairs, m)?;
        finals.push(out);
    }

    device.run(module, &calls.list, graph_capture)?;

    // The output rows, from wherever the output lives.
    let o = layer.output_size;
    let out_home = pass.home(cell.output)?;
    let host = fetch_rows(&pass, out_home, o)?;
    for row in &valid {
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
            saved.iter().copied().filter(|v| g.contains(*v) && pass.has_home(*v)).collect();
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

/// The per-step stages for each step in `steps` (in that order): GEMMs
/// on the active ranks' contiguous rows, kernels over a slice of one
/// pointer table per kernel uploaded for all steps.
pub fn step_by_step(
    pass: &mut Pass,
    calls: &mut Calls,
    g: &Graph,
    plan: &cellc::interp::Plan,
    kernels: &[(usize, Kernel)],
    stages: &[(usize, &cellc::schedule::Stage)],
    steps: Vec<usize>,
) -> Result<()> {
    // One table per kernel: every step's rows, in the order the steps run.
    let mut tables = Vec::new();
    for &(i, st) in stages {
        if st.kind == StageKind::Gemm {
            tables.push(None);
            continue;
        }
        let k = kernel_of(kernels, i)?;
        let rows: Vec<Row> = steps.iter().flat_map(|&s| pass.rows_at(s)).collect();
        tables.push(Some((k, Calls::table(pass, k, &rows)?)));
    }
    let mut done = 0usize;
    for &s in &steps {
        let n = pass.plan.batch_sizes()[s];
        for (&(_, st), table) in stages.iter().zip(&tables) {
            match table {
                None => {
                    for &v in &st.values {
                        calls.step_product(pass, g, plan, v, s, n)?;
                    }
                }
                Some((k, base)) => {
                    let per_row = 8 * (k.inputs.len() + k.outputs.len()) as u64;
                    calls.rows(pass, k, base + per_row * done as u64, n)?;
                }
            }
        }
        done += n;
    }
    Ok(())
}

/// A value's rows downloaded from its home.
#[derive(Debug)]
pub struct HostRows {
    home: Home,
    data: Vec<f32>,
    len: usize,
}

impl HostRows {
    /// Row `row`'s `len` floats.
    pub fn row(&self, row: Row, pass: &Pass) -> &[f32] {
        let at = match self.home {
            Home::Layout { width, .. } => pass.layout.row(row.b, row.t) * width,
            Home::Steps { len, .. } => (row.s * pass.batch() + row.r) * len,
            Home::Rank { len, .. } => row.r * len,
            Home::Fixed(_) => 0,
        };
        &self.data[at..at + self.len]
    }
}

/// Downloads every row of a value of `len` floats held at `home`.
pub fn fetch_rows(pass: &Pass, home: Home, len: usize) -> Result<HostRows> {
    let (base, floats) = match home {
        Home::Layout { base, width } => (base, pass.layout_rows.saturating_sub(1) * width + len),
        Home::Steps { base, len: l } => (base, pass.step_major_rows().saturating_sub(1) * l + len),
        Home::Rank { base, len: l } => (base, pass.batch().saturating_sub(1) * l + len),
        Home::Fixed(base) => (base, len),
    };
    Ok(HostRows { home, data: pass.download(base, floats)?, len })
}
