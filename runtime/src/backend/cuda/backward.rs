//! One layer and direction backwards on a [`Device`], reading what the
//! training forward left on it ([`CudaTape`]).
//!
//! The carried adjoints mirror the forward's state histories: carry `i`
//! is a `Steps` home with `steps + 1` slots, slot `s + 1` holding the
//! adjoint of the state after step `s` (each sequence's final-state
//! adjoint starts in the slot after its last step), and step `s` writes the
//! adjoint of the state before it into slot `s`, which step `s - 1` reads;
//! slot 0 ends as the initial states' adjoints. Per-step values that the
//! work after the loop reads are kept in `Steps` homes, so weight
//! gradients are one GEMM over all steps, vector parameters' gradients one
//! column sum (a GEMM with ones, in a fixed order: no atomics), and input
//! gradients one GEMM whose rows are added into the caller's rows.

use super::calls::Calls;
use super::device::{Device, Module};
use super::forward::{fetch_rows, kernel_of, place_inputs_and_constants, step_by_step, CudaTape};
use super::storage::{error, Home, Pass, Row};
use crate::backend::{BackwardJob, BackwardResult, RowsMut};
use crate::error::Result;
use cellc::cuda::Kernel;
use cellc::ir::{Graph, Op, Type, ValueId};
use cellc::schedule::{Placement, StageKind};
use std::collections::HashSet;

/// Runs the backward of `job` on `device` with `module` (holding `kernels`).
pub fn backward(
    device: &dyn Device,
    module: &Module,
    kernels: &[(usize, Kernel)],
    job: &BackwardJob,
    tape: &CudaTape,
    d_input: &mut RowsMut,
    graph_capture: bool,
) -> Result<BackwardResult> {
    if tape.device != device.name() {
        return Err(error(format!("a tape from {} used on {}", tape.device, device.name())));
    }
    let g: &Graph = &job.cell.grad.graph;
    let grad = &job.cell.grad;
    let layer = job.layer;
    let plan = &layer.backward_plan;
    let stages = &layer.schedule.backward;
    let layout_rows = job.input.data.len() / job.input.width.max(1);
    let mut pass = Pass::new(device, job.input.layout, job.plan, job.reverse, layout_rows);
    let (batch, steps) = (pass.batch(), pass.steps());

    // What the forward left: the input, parameters, states, output and saved values.
    place_inputs_and_constants(&mut pass, g, plan, tape.input, &layer.input_slices)?;
    for (&v, &home) in &tape.kept.homes {
        pass.place(v, home);
    }
    for v in g.values() {
        match g.node(v).op {
            Op::Param(i) => {
                pass.place(v, Home::Fixed(*tape.params.get(i).ok_or_else(|| error("no parameter"))?))
            }
            Op::State(i) => pass.place(v, tape.states[i]),
            _ => {}
        }
    }
    for (i, next) in grad.primal_next_states.iter().enumerate() {
        if let (Some(v), Home::Steps { base, len }) = (next, tape.states[i]) {
            pass.place(*v, Home::Steps { base: base + 4 * (batch * len) as u64, len });
        }
    }
    if let Some(v) = grad.primal_output {
        pass.place(v, tape.output);
    }
    // The output's adjoint, and the carried adjoints of the states.
    let d_output = pass.upload(job.d_output.data)?;
    let d_output =
        Home::Layout { base: d_output + 4 * job.d_output.offset as u64, width: job.d_output.width };
    let order = job.plan.order();
    let mut carries = Vec::new();
    for (i, &m) in layer.state_sizes.iter().enumerate() {
        let mut carry = vec![0.0f32; (steps + 1) * batch * m];
        for (r, &b) in order.iter().enumerate() {
            let at = (job.plan.lengths()[b] * batch + r) * m;
            carry[at..at + m].copy_from_slice(&job.d_final[i][b * m..(b + 1) * m]);
        }
        let base = pass.upload(&carry)?;
        carries.push(Home::Steps { base, len: m });
        if let Some(v) = grad.d_states[i] {
            if pass.has_home(v) {
                return Err(error(format!("the adjoint of state {i} is not computed by a stage of its own")));
            }
            pass.place(v, Home::Steps { base, len: m });
        }
    }
    for v in g.values() {
        match g.node(v).op {
            Op::Seed(0) => pass.place(v, d_output),
            Op::Seed(k) => {
                if let Home::Steps { base, len } = carries[k - 1] {
                    pass.place(v, Home::Steps { base: base + 4 * (batch * len) as u64, len });
                }
            }
            _ => {}
        }
    }
    // Per-step values read after the loop are kept for every step.
    let mut after_reads: HashSet<ValueId> = grad.results().into_iter().collect();
    for st in stages.iter().filter(|s| s.placement == Placement::AfterLoop) {
        after_reads.extend(st.inputs.iter().copied());
        if st.kind == StageKind::SumOverSteps {
            after_reads.extend(st.outputs.iter().copied());
        }
    }
    for st in stages.iter().filter(|s| s.placement == Placement::EachStep) {
        for &v in &st.outputs {
            if !pass.has_home(v) {
                let len = plan.elements(v);
                if after_reads.contains(&v) {
                    pass.place_steps(v, len)?;
                } else {
                    pass.place_rank(v, len)?;
                }
            }
        }
    }

    let mut calls = Calls::new(device.block_size());
    // The loop, in reverse time.
    let each_step: Vec<(usize, &cellc::schedule::Stage)> =
        stages.iter().enumerate().filter(|(_, s)| s.placement == Placement::EachStep).collect();
    match each_step[..] {
        [(i, st)] if matches!(st.kind, StageKind::WholeSequence { .. }) => {
            let sequences: Vec<Vec<Row>> = (0..batch)
                .map(|r| {
                    let mut rows = pass.sequence(r);
                    rows.reverse();
                    rows
                })
                .collect();
            calls.sequences(&mut pass, kernel_of(kernels, i)?, &sequences)?;
        }
        _ => step_by_step(&mut pass, &mut calls, g, plan, kernels, &each_step, (0..steps).rev().collect())?,
    }
    // After the loop: products over all steps, then what is computed from them.
    let valid = pass.valid_rows();
    for (i, st) in stages.iter().enumerate().filter(|(_, s)| s.placement == Placement::AfterLoop) {
        match st.kind {
            StageKind::Gemm => {
                for &v in &st.values {
                    calls.all_rows_product(&mut pass, g, plan, v)?;
                }
            }
            StageKind::SumOverSteps => {}
            _ => {
                for &v in &st.outputs {
                    if !pass.has_home(v) {
                        pass.place_steps(v, plan.elements(v))?;
                    }
                }
                calls.over(&mut pass, kernel_of(kernels, i)?, &valid)?;
            }
        }
    }
    // Parameter gradients: weight products are matrices already; vectors are summed over rows.
    let mut param_grads = Vec::with_capacity(job.params.len());
    for (i, d) in grad.d_params.iter().enumerate() {
        let len = job.params[i].len();
        param_grads.push(match d {
            None => None,
            Some(v) => match (g.ty(*v), pass.home(*v)?) {
                (Type::Matrix(..), Home::Fixed(at)) => Some((at, len)),
                (Type::Matrix(..), other) => {
                    return Err(error(format!("the gradient of a matrix parameter is held as {other:?}")))
                }
                _ => Some((calls.column_sum(&mut pass, plan, *v)?, len)),
            },
        });
    }

    device.run(module, &calls.list, graph_capture)?;

    let d_params = param_grads
        .into_iter()
        .zip(job.params)
        .map(|(d, p)| match d {
            Some((at, len)) => pass.download(at, len),
            None => Ok(vec![0.0; p.len()]),
        })
        .collect::<Result<_>>()?;
    for (d, &(offset, len)) in grad.d_inputs.iter().zip(&layer.input_slices) {
        let Some(v) = d else { continue };
        let rows = fetch_rows(&pass, pass.home(*v)?, len)?;
        for row in &valid {
            let dst = d_input.get_mut(row.b, row.t, layer.input_size);
            dst[offset..offset + len].iter_mut().zip(rows.row(*row, &pass)).for_each(|(a, x)| *a += x);
        }
    }
    let mut d_h0 = Vec::with_capacity(carries.len());
    for (carry, &m) in carries.iter().zip(&layer.state_sizes) {
        let Home::Steps { base, .. } = *carry else { continue };
        let slot0 = pass.download(base, batch * m)?;
        let mut out = vec![0.0; batch * m];
        for (r, &b) in order.iter().enumerate() {
            out[b * m..(b + 1) * m].copy_from_slice(&slot0[r * m..(r + 1) * m]);
        }
        d_h0.push(out);
    }
    Ok(BackwardResult { d_h0, d_params })
}
