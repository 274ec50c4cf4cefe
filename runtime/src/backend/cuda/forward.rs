//! One layer and direction forwards on a [`Device`]: the schedule's GEMMs
//! as `gemm_nt` calls, its pointwise stages as the generated kernels over
//! pointer tables built once per call, so no row is gathered or copied:
//!
//! - hoisted products run over every row of the caller's layout (padding
//!   rows included: a GPU does them for free and nothing reads them);
//! - states live in a history on the device, slot `s` holding every
//!   sequence's state before step `s` in rank order (longest first), so a
//!   step's GEMM reads a contiguous prefix and a step's kernel writes the
//!   next slot directly: no copy between steps;
//! - the output is written by the kernels straight into the output rows,
//!   or copied there from the history when it is also a next state.

use super::device::{Arg, Buf, Device, GemmNt, Module};
use crate::backend::{ForwardJob, ForwardResult, RowsMut};
use crate::error::{Result, RuntimeError};
use cellc::cuda::Kernel;
use cellc::ir::{Graph, Op, ValueId};
use cellc::schedule::{Placement, StageKind};
use std::collections::HashMap;

fn unsupported(what: impl Into<String>) -> RuntimeError {
    RuntimeError::Backend { backend: "cuda".into(), message: what.into() }
}

/// Where a value lives on the device.
#[derive(Clone, Copy, Debug)]
enum Home {
    /// Features `[offset, ..)` of the input's row.
    Input(usize),
    Param(usize),
    /// A vector constant (its own buffer).
    Const(usize),
    /// State `i`'s history: slot `s` (before the step), rank `r`.
    State(usize),
    /// Next state `i`: history slot `s + 1`.
    NextState(usize),
    /// One row per layout row.
    Rows(usize),
    /// One row per rank, overwritten each step.
    Rank(usize),
    /// This direction's output rows.
    Output,
}

/// The kernels of a layer's forward stages, in stage order.
pub fn kernels(job: &ForwardJob) -> Result<Vec<(usize, Kernel)>> {
    let graph: &Graph = &job.cell.cell;
    let layer = job.layer;
    // States chained through a sequence stay in registers in whole-sequence kernels.
    let (chains, _) = cellc::cuda::chains(&job.cell.cell, &job.cell.grad);
    let cx = cellc::cuda::Context { chains: &chains, ..Default::default() };
    let mut out = Vec::new();
    for (i, st) in layer.schedule.forward.iter().enumerate() {
        if matches!(st.kind, StageKind::Pointwise { .. } | StageKind::WholeSequence { .. }) {
            let name = format!("{}_fwd_s{i}", job.cell.cell.name);
            let k = cellc::cuda::emit_stage(graph, &layer.forward_plan, st, &name, cx)
                .map_err(|e| unsupported(e.to_string()))?;
            out.push((i, k));
        }
    }
    Ok(out)
}

/// Runs the forward of `job` on `device` with `module` (the [`kernels`], loaded).
pub fn forward(
    device: &dyn Device,
    module: &Module,
    kernels: &[(usize, Kernel)],
    job: &ForwardJob,
    output: &mut RowsMut,
) -> Result<ForwardResult> {
    if job.training {
        return Err(unsupported(
            "training on the CUDA back end is not built yet (issue 6); infer, or use --backend cpu",
        ));
    }
    let g: &Graph = &job.cell.cell;
    let cell = &job.cell.cell;
    let layer = job.layer;
    let plan = &layer.forward_plan;
    let stages = &layer.schedule.forward;
    let batch = job.plan.batch();
    let steps = job.plan.steps();
    let order = job.plan.order();
    let mut rank = vec![0usize; batch];
    for (r, &b) in order.iter().enumerate() {
        rank[b] = r;
    }
    let layout = job.input.layout;
    let layout_rows = job.input.data.len() / job.input.width.max(1);
    let out_rows = output.data.len() / output.width.max(1);

    // Device memory.
    let x = device.upload(job.input.data)?;
    let params: Vec<Buf> = job.params.iter().map(|p| device.upload(p)).collect::<Result<_>>()?;
    let mut consts: Vec<Buf> = Vec::new();
    let mut home: HashMap<ValueId, Home> = HashMap::new();
    for v in g.values() {
        match g.node(v).op {
            Op::Input(i) => {
                home.insert(v, Home::Input(i));
            }
            Op::State(i) => {
                home.insert(v, Home::State(i));
            }
            Op::Param(i) => {
                home.insert(v, Home::Param(i));
            }
            _ => {}
        }
    }
    for (v, value) in plan.constant_values::<f32>(g) {
        home.insert(v, Home::Const(consts.len()));
        consts.push(device.upload(&value)?);
    }
    for (i, v) in cell.next_states.iter().enumerate() {
        // A next state that is a leaf, or the next state of two states, needs a copy step
        // this back end does not have yet.
        if home.insert(*v, Home::NextState(i)).is_some() {
            return Err(unsupported(format!(
                "next state {i} of `{}` is not computed by a stage of its own",
                cell.name
            )));
        }
    }
    let mut rows_bufs: Vec<Buf> = Vec::new();
    let mut rank_bufs: Vec<Buf> = Vec::new();
    for st in stages {
        for &v in &st.outputs {
            if home.contains_key(&v) {
                continue;
            }
            let h = if v == cell.output {
                Home::Output
            } else if st.placement == Placement::BeforeLoop {
                rows_bufs.push(device.zeros(layout_rows * plan.elements(v))?);
                Home::Rows(rows_bufs.len() - 1)
            } else {
                rank_bufs.push(device.zeros(batch * plan.elements(v))?);
                Home::Rank(rank_bufs.len() - 1)
            };
            home.insert(v, h);
        }
    }
    // State history, slot 0 = h0 in rank order.
    let hist: Vec<Buf> = layer
        .state_sizes
        .iter()
        .enumerate()
        .map(|(i, &m)| {
            let mut h = vec![0.0f32; (steps + 1) * batch * m];
            for (r, &b) in order.iter().enumerate() {
                h[r * m..(r + 1) * m].copy_from_slice(&job.h0[i][b * m..(b + 1) * m]);
            }
            device.upload(&h)
        })
        .collect::<Result<_>>()?;
    let out_dev = device.upload(output.data)?;

    // The address of value `v` for row (b, t) at step s, rank r.
    let addr = |v: ValueId, b: usize, t: usize, s: usize, r: usize| -> Result<u64> {
        let len = plan.elements(v);
        Ok(match *home.get(&v).ok_or_else(|| unsupported(format!("no storage for {v}")))? {
            Home::Input(i) => x.at(layout.row(b, t) * job.input.width + layer.input_slices[i].0),
            Home::Param(i) => params[i].addr,
            Home::Const(i) => consts[i].addr,
            Home::State(i) => hist[i].at((s * batch + r) * layer.state_sizes[i]),
            Home::NextState(i) => hist[i].at(((s + 1) * batch + r) * layer.state_sizes[i]),
            Home::Rows(i) => rows_bufs[i].at(layout.row(b, t) * len),
            Home::Rank(i) => rank_bufs[i].at(r * len),
            Home::Output => out_dev.at(output.layout.row(b, t) * output.width + output.offset),
        })
    };
    let kernel_of = |i: usize| kernels.iter().find(|(k, _)| *k == i).map(|(_, k)| k);
    let scratch = device.zeros(kernels.iter().map(|(_, k)| k.scratch).max().unwrap_or(0).max(1) * 1024)?;
    // Address tables stay alive until the end: launches are asynchronous on a GPU.
    let mut keep: Vec<Buf> = Vec::new();
    let launch_rows = |k: &Kernel, rows: &[(usize, usize, usize, usize)]| -> Result<Option<Buf>> {
        if rows.is_empty() {
            return Ok(None);
        }
        let mut table = Vec::with_capacity(rows.len() * (k.inputs.len() + k.outputs.len()));
        for &(b, t, s, r) in rows {
            for &v in k.inputs.iter().chain(&k.outputs) {
                table.push(addr(v, b, t, s, r)?);
            }
        }
        let table = device.upload_addresses(&table)?;
        let grid = grid_for(k, rows.len(), device.block_size());
        let args = [Arg::Ptr(table.addr), Arg::I32(rows.len() as i32), Arg::Ptr(scratch.addr)];
        device.launch(module, &k.name, grid, device.block_size(), &args)?;
        Ok(Some(table))
    };

    // Before the loop: hoisted products over every layout row, pointwise over valid rows.
    let valid: Vec<(usize, usize, usize, usize)> =
        (0..batch).flat_map(|b| (0..job.plan.lengths()[b]).map(move |t| (b, t, 0, 0))).collect();
    for (i, st) in stages.iter().enumerate().filter(|(_, s)| s.placement == Placement::BeforeLoop) {
        match st.kind {
            StageKind::Gemm => {
                for &v in &st.values {
                    let [w, xin] = g.operands(v)[..] else {
                        return Err(unsupported("a product needs two operands"));
                    };
                    let (m, k) = plan.shape(w);
                    let (Some(Home::Param(_)), Some(&Home::Input(input)), Some(&Home::Rows(out))) =
                        (home.get(&w), home.get(&xin), home.get(&v))
                    else {
                        return Err(unsupported(format!("hoisted product {v}: only W @ input is built yet")));
                    };
                    // Every layout row, from row 0 of the input's slice.
                    let a = x.at(layer.input_slices[input].0);
                    let c = rows_bufs[out].addr;
                    device.gemm_nt(GemmNt {
                        m: layout_rows,
                        n: m,
                        k,
                        a,
                        lda: job.input.width,
                        b: addr(w, 0, 0, 0, 0)?,
                        ldb: k,
                        c,
                        ldc: m,
                    })?;
                }
            }
            _ => {
                let k = kernel_of(i).ok_or_else(|| unsupported(format!("no kernel for stage {i}")))?;
                keep.extend(launch_rows(k, &valid)?);
            }
        }
    }

    // The time loop.
    let whole = stages.iter().filter(|s| s.placement == Placement::EachStep).count() == 1
        && stages
            .iter()
            .any(|s| s.placement == Placement::EachStep && matches!(s.kind, StageKind::WholeSequence { .. }));
    if whole {
        let (i, _) = stages
            .iter()
            .enumerate()
            .find(|(_, s)| s.placement == Placement::EachStep)
            .ok_or_else(|| unsupported("no per-step stage"))?;
        let k = kernel_of(i).ok_or_else(|| unsupported(format!("no kernel for stage {i}")))?;
        // Sequences in rank order, each sequence's rows in time order.
        let mut table = Vec::new();
        let (mut starts, mut counts) = (Vec::new(), Vec::new());
        let mut at = 0i32;
        for (r, &b) in order.iter().enumerate() {
            let len = job.plan.lengths()[b];
            starts.push(at);
            counts.push(len as i32);
            at += len as i32;
            for s in 0..len {
                let t = job.plan.time(b, s, job.reverse);
                for &v in k.inputs.iter().chain(&k.outputs) {
                    table.push(addr(v, b, t, s, r)?);
                }
            }
        }
        let table = device.upload_addresses(&table)?;
        let (starts, counts) = (device.upload_i32(&starts)?, device.upload_i32(&counts)?);
        let grid = grid_for(k, batch, device.block_size());
        let args = [
            Arg::Ptr(table.addr),
            Arg::Ptr(starts.addr),
            Arg::Ptr(counts.addr),
            Arg::I32(batch as i32),
            Arg::Ptr(scratch.addr),
        ];
        device.launch(module, &k.name, grid, device.block_size(), &args)?;
        keep.extend([table, starts, counts]);
    } else {
        for s in 0..steps {
            let n = job.plan.batch_sizes()[s];
            let rows: Vec<(usize, usize, usize, usize)> =
                (0..n).map(|r| (order[r], job.plan.time(order[r], s, job.reverse), s, r)).collect();
            for (i, st) in stages.iter().enumerate().filter(|(_, s)| s.placement == Placement::EachStep) {
                match st.kind {
                    StageKind::Gemm => {
                        for &v in &st.values {
                            let [w, xin] = g.operands(v)[..] else {
                                return Err(unsupported("a product needs two operands"));
                            };
                            if g.node(v).op != Op::MatVec {
                                return Err(unsupported(format!(
                                    "per-step {:?} is not built yet",
                                    g.node(v).op
                                )));
                            }
                            let (m, k) = plan.shape(w);
                            // The first active rank's row; ranks are contiguous with stride = length.
                            let a = addr(xin, order[0], job.plan.time(order[0], s, job.reverse), s, 0)?;
                            let c = addr(v, order[0], job.plan.time(order[0], s, job.reverse), s, 0)?;
                            let contiguous = |h: Option<&Home>| {
                                matches!(h, Some(Home::State(_) | Home::NextState(_) | Home::Rank(_)))
                            };
                            if !contiguous(home.get(&xin)) || !contiguous(home.get(&v)) {
                                return Err(unsupported(format!(
                                    "per-step product {v} on rows of the layout"
                                )));
                            }
                            device.gemm_nt(GemmNt {
                                m: n,
                                n: m,
                                k,
                                a,
                                lda: k,
                                b: addr(w, 0, 0, 0, 0)?,
                                ldb: k,
                                c,
                                ldc: m,
                            })?;
                        }
                    }
                    _ => {
                        let k =
                            kernel_of(i).ok_or_else(|| unsupported(format!("no kernel for stage {i}")))?;
                        launch_rows(k, &rows)?;
                    }
                }
            }
        }
    }

    // The output, where it is a next state: copied from the history into its rows.
    if let Some(Home::NextState(i)) = home.get(&cell.output).copied() {
        let m = layer.state_sizes[i];
        let mut pairs = Vec::new();
        for &b in order {
            for s in 0..job.plan.lengths()[b] {
                let t = job.plan.time(b, s, job.reverse);
                pairs.push(out_dev.at(output.layout.row(b, t) * output.width + output.offset));
                pairs.push(hist[i].at(((s + 1) * batch + rank[b]) * m));
            }
        }
        let table = device.upload_addresses(&pairs)?;
        let rows = pairs.len() / 2;
        let args = [Arg::Ptr(table.addr), Arg::I32(rows as i32), Arg::I32(m as i32)];
        device.launch(module, "cellc_copy_rows", rows.clamp(1, 1024) as u32, device.block_size(), &args)?;
        keep.push(table);
    }
    let out_host = device.download(&out_dev)?; // waits for every launch above
    drop(keep);
    debug_assert_eq!(out_host.len(), out_rows * output.width);
    output.data.copy_from_slice(&out_host);
    // Final states: each sequence's history at its own last step.
    let mut finals = Vec::with_capacity(hist.len());
    for (i, h) in hist.iter().enumerate() {
        let m = layer.state_sizes[i];
        let all = device.download(h)?;
        let mut f = vec![0.0f32; batch * m];
        for b in 0..batch {
            let at = (job.plan.lengths()[b] * batch + rank[b]) * m;
            f[b * m..(b + 1) * m].copy_from_slice(&all[at..at + m]);
        }
        finals.push(f);
    }
    Ok(ForwardResult { final_states: finals, tape: None })
}

/// Blocks for `items` rows or sequences: a lane-form kernel gives every
/// (item, chunk of a block's worth of units) its own block; a block-form
/// kernel one block per item. Both loop over whatever the grid leaves out.
fn grid_for(k: &Kernel, items: usize, block: u32) -> u32 {
    let per_item = if k.units > 0 { k.units.div_ceil(block.max(1) as usize) } else { 1 };
    (items * per_item).clamp(1, 65_535) as u32
}
