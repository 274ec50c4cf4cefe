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
use super::forward::CudaTape;
use super::storage::{error, Home, LayerRun};
use crate::backend::{BackwardJob, BackwardResult, RowsMut};
use crate::error::Result;
use cellc::cuda::Kernel;
use cellc::ir::{Graph, Type, ValueId};
use cellc::program::{Side, Storage};
use cellc::schedule::Placement;

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
    let g: &Graph = &job.cell.backward.graph;
    let grad = &job.cell.backward;
    let layer = job.layer;
    let plan = &layer.backward_shapes;
    let stages = &layer.schedule.backward;
    let mut pass = LayerRun::new(device, &job.input, job.order, job.reverse);
    let batch = pass.batch();

    // What the forward left: the input, parameters, states, output and saved values.
    pass.place_input_and_constants(g, plan, tape.input, &layer.input_slices)?;
    for (&v, &home) in &tape.kept.homes {
        pass.place(v, home);
    }
    let storage = |v: ValueId| layer.storage(Side::Backward, v, true);
    for v in g.values() {
        match storage(v) {
            Some(Storage::Param(i)) => {
                pass.place(v, Home::Fixed(*tape.params.get(i).ok_or_else(|| error("no parameter"))?))
            }
            Some(Storage::State(i)) => pass.place(v, tape.states[i]),
            Some(Storage::NextState(i)) => pass.place(v, tape.states[i].next_slot(batch)),
            Some(Storage::Output { .. }) => pass.place(v, tape.output),
            _ => {}
        }
    }
    // The output's adjoint, and the carried adjoints of the states (each
    // sequence's final-state adjoint in the slot after its last step).
    let d_output = pass.upload(job.d_output.data)?;
    let d_output =
        Home::Layout { base: d_output + 4 * job.d_output.offset as u64, width: job.d_output.width };
    let lengths = job.order.lengths();
    let mut carries = Vec::new();
    for (i, &m) in layer.state_sizes.iter().enumerate() {
        let carry = pass.history(job.d_final[i], m, |b| lengths[b])?;
        carries.push(carry);
        if let Some(v) = grad.d_states[i] {
            if storage(v) != Some(Storage::StateAdjoint(i)) {
                return Err(error(format!("the adjoint of state {i} is not computed by a stage of its own")));
            }
            pass.place(v, carry);
        }
    }
    for v in g.values() {
        match storage(v) {
            Some(Storage::OutputAdjoint) => pass.place(v, d_output),
            Some(Storage::CarriedAdjoint(k)) => pass.place(v, carries[k].next_slot(batch)),
            _ => {}
        }
    }
    // Per-step values read after the loop are kept for every step.
    for st in stages.iter().filter(|s| s.placement == Placement::EachStep) {
        for &v in &st.outputs {
            if !pass.has_home(v) {
                let len = plan.elements(v);
                match storage(v) {
                    Some(Storage::Steps) => pass.place_steps(v, len)?,
                    _ => pass.place_rank(v, len)?,
                };
            }
        }
    }

    let mut calls = Calls::new(device.block_size());
    // Before the loop: products that read no carried adjoint, over all rows.
    calls.all_rows_stages(&mut pass, (g, plan), kernels, stages, Placement::BeforeLoop)?;
    calls.time_loop(&mut pass, (g, plan), kernels, stages, true)?;
    // After the loop: products over all steps, then what is computed from them.
    calls.all_rows_stages(&mut pass, (g, plan), kernels, stages, Placement::AfterLoop)?;
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

    // The initial states' adjoints: slot 0 of the carries.
    let d_h0_at: Vec<u64> =
        carries.iter().map(|&c| calls.gather_sequences(&mut pass, c, |_| 0)).collect::<Result<_>>()?;

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
        let rows = pass.fetch(pass.home(*v)?, len)?;
        for row in &pass.valid_rows() {
            let dst = d_input.get_mut(row.b, row.t, layer.input_size);
            dst[offset..offset + len].iter_mut().zip(rows.row(*row, &pass)).for_each(|(a, x)| *a += x);
        }
    }
    let d_h0 = d_h0_at
        .iter()
        .zip(&layer.state_sizes)
        .map(|(&at, &m)| pass.download(at, batch * m))
        .collect::<Result<_>>()?;
    Ok(BackwardResult { d_h0, d_params })
}
