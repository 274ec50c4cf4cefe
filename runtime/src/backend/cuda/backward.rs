//! One layer and direction backwards on a [`Device`], reading the tape
//! the training forward filled ([`super::storage::tape_homes`]).
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
use super::device::Module;
use super::forward::tape_part;
use super::storage::{error, tape_homes, Home, LayerRun};
use super::SideKernels;
use crate::cell::{CompiledCell, Layer};
use crate::error::Result;
use crate::plan::{Home as PlanHome, ParamGradient};
use cellc::ir::Graph;
use cellc::program::{Kept, Side};
use cellc::schedule::Placement;

/// The memory of a layer's backward that is not the pass's own, on the
/// device: what it reads besides the tape, and where it writes.
#[derive(Clone, Debug)]
pub struct BackwardIo {
    /// The layer input (a `Layout` home), as the forward read it.
    pub input: Home,
    /// The masks the forward's steps read (a `Layout` home), if the cell has any.
    pub masks: Option<Home>,
    pub params: Vec<u64>,
    /// The tape the training forward filled ([`tape_homes`]).
    pub tape: u64,
    /// The adjoint of this direction's output rows: a `Layout` home based
    /// at the direction's first feature.
    pub d_output: Home,
    /// The final states' adjoints: `[batch, m]` rows each, in batch order.
    pub d_final: Vec<u64>,
    /// The initial states the forward read: `[batch, m]` rows each, in batch order.
    pub h0: Vec<u64>,
    /// The layer input's adjoint (a `Layout` home): valid rows are added into.
    pub d_input: Home,
    /// The parameters' gradients, overwritten.
    pub d_params: Vec<u64>,
    /// The initial states' adjoints, `[batch, m]` rows each, overwritten.
    pub d_h0: Vec<u64>,
}

/// Runs the backward of `cell`'s `layer` in `pass`, reading the training
/// forward's tape, over the device memory of `io`, with `module` (holding
/// `kernels`).
pub fn backward_on(
    pass: &mut LayerRun,
    module: &Module,
    kernels: &SideKernels,
    (cell, layer): (&CompiledCell, &Layer),
    io: &BackwardIo,
    graph_capture: bool,
) -> Result<()> {
    let device = pass.device;
    let g: &Graph = &cell.backward.graph;
    let plan = layer.pass(Side::Backward, true);
    let shapes = &layer.backward_shapes;
    let stages = &layer.schedule.backward;
    let batch = pass.batch();
    let mut calls = Calls::new(device.block_size(), pass.precision);

    // The input, the parameters, and what the tape keeps: states before
    // and after the step, the output and the saved values.
    pass.place_leaves((g, shapes), plan, (io.input, io.masks), layer)?;
    let tape = tape_homes(layer, pass.layout_rows, io.tape);
    // The output's adjoint, and the carried adjoints of the states (each
    // sequence's final-state adjoint in the slot after its last step).
    let lengths = pass.order.lengths();
    let mut carries = Vec::new();
    for (i, &m) in layer.state_sizes.iter().enumerate() {
        let carry = calls.scatter_sequences(pass, io.d_final[i], m, |b| lengths[b])?;
        carries.push(carry);
        if let Some(v) = plan.carried[i] {
            if plan.home(v) != Some(PlanHome::StateAdjoint(i)) {
                return Err(error(format!("the adjoint of state {i} is not computed by a stage of its own")));
            }
            pass.place(v, carry);
        }
    }
    for (v, home) in plan.homes() {
        match home {
            PlanHome::Param(i) => {
                pass.place(v, Home::Fixed(*io.params.get(i).ok_or_else(|| error("no parameter"))?))
            }
            PlanHome::Tape(kept) => pass.place(v, tape_part(&tape, kept)?),
            PlanHome::StateBeforeFromTape(i) => {
                let Home::Layout { base: after, width } = tape_part(&tape, Kept::StateAfter(i))? else {
                    return Err(error("a tape part that is not laid out by rows"));
                };
                let initial = *io.h0.get(i).ok_or_else(|| error("no initial state"))?;
                pass.place(v, Home::StateBefore { after, initial, width, reverse: pass.reverse })
            }
            PlanHome::OutputAdjoint => pass.place(v, io.d_output),
            PlanHome::Carry(k) => pass.place(v, carries[k].next_slot(batch)),
            _ => {}
        }
    }
    // Per-step values read after the loop are kept for every step.
    for &k in plan.stages_at(Placement::EachStep) {
        for &v in &stages[k].outputs {
            if !pass.has_home(v) {
                let len = shapes.elements(v);
                match plan.home(v) {
                    Some(PlanHome::Steps) => pass.place_steps(v, len)?,
                    _ => pass.place_rank(v, len)?,
                };
            }
        }
    }

    // Before the loop: products that read no carried adjoint, over all rows.
    calls.all_rows_stages(pass, (g, shapes), &kernels.stages, stages, &plan.before_loop)?;
    calls.time_loop(pass, (g, shapes), kernels, (stages, &plan.time_loop), true)?;
    // After the loop: products over all steps, then what is computed from them.
    calls.all_rows_stages(pass, (g, shapes), &kernels.stages, stages, &plan.after_loop)?;
    // Parameter gradients: weight products are matrices already; vectors are summed over rows.
    for ((d, &(rows, cols)), &dst) in plan.d_params.iter().zip(&layer.param_shapes).zip(&io.d_params) {
        let len = rows * cols;
        let at = match *d {
            None => {
                calls.zero(dst, len);
                continue;
            }
            Some(ParamGradient::Matrix(v)) => match pass.home(v)? {
                Home::Fixed(at) => at,
                other => {
                    return Err(error(format!("the gradient of a matrix parameter is held as {other:?}")))
                }
            },
            Some(ParamGradient::SumOfRows(v)) => calls.column_sum(pass, shapes, v)?,
        };
        calls.copy_floats(pass, dst, at, len)?;
    }
    // The input's adjoint: each input's rows added into its features.
    let (layout, valid) = (pass.layout, pass.valid_rows());
    for (d, &(offset, len)) in plan.d_inputs.iter().zip(&layer.input_slices) {
        let Some(v) = d else { continue };
        let home = pass.home(*v)?;
        let pairs: Vec<(u64, u64)> = valid
            .iter()
            .map(|&row| {
                (io.d_input.addr(row, layout, batch) + 4 * offset as u64, home.addr(row, layout, batch))
            })
            .collect();
        calls.add_rows(pass, &pairs, len)?;
    }
    // The initial states' adjoints: slot 0 of the carries.
    for (&c, &at) in carries.iter().zip(&io.d_h0) {
        calls.gather_sequences(pass, c, |_| 0, at)?;
    }
    device.run(module, &calls.list, graph_capture)
}
