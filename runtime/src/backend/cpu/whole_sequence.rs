//! The plan's whole-sequence loop (`TimeLoop::WholeSequence`): one kernel
//! call that walks every sequence through time, forwards or backwards,
//! threads taking whole sequences.

use super::buffers::{copy_row, locate, Buffers, Frame};
use super::host::{HostBackward, HostForward, RowsMut};
use super::prepared::PreparedParams;
use super::stage::StageExec;
use super::stages::SendTable;
use super::tape::CpuTape;
use super::threads;
use crate::error::Result;
use crate::plan::{Home, PassPlan, TapeSource};
use crate::pool;
use cellc::ir::ValueId;
use cellc::precision::Precision;

/// A whole-sequence kernel over a job's sequences, shared out between
/// `threads` threads.
pub(super) struct Walk<'a, J> {
    pub(super) job: &'a J,
    pub(super) exec: &'a dyn StageExec,
    pub(super) threads: usize,
}

/// The plan's whole-sequence loop: one kernel call that walks every
/// sequence through time. Each row's state pointers point at the previous
/// step's next state, so the rows of one sequence run in order, and
/// threads take whole sequences. Returns the final states.
pub(super) fn forward_whole_sequence(
    walk: &Walk<HostForward>,
    (output_value, next_states): (ValueId, &[ValueId]),
    output: &mut RowsMut,
    bufs: &mut Buffers,
    weights: &PreparedParams,
    pass: &PassPlan,
    mut tape: Option<&mut CpuTape>,
) -> Result<Vec<Vec<f32>>> {
    let (job, exec) = (walk.job, walk.exec);
    let layer = job.layer;
    let layout_rows = job.layout_rows();
    for &v in exec.outputs() {
        // Values written straight into the tape stay there.
        if !matches!(pass.home(v), Some(Home::Tape(_))) {
            bufs.row_buf(v, layer.forward_shapes.elements(v), layout_rows);
        }
    }
    let frame = Frame::new((job.input, job.masks), layer, job.params, weights);
    let k = exec.inputs().len() + exec.outputs().len();
    let order = job.order.order();
    let chunks = walk.threads.clamp(1, order.len().max(1));
    let mut tables: Vec<Vec<*mut f32>> = vec![Vec::new(); chunks];
    // State `i` before step `s` of sequence `b`: the initial state, or the
    // next state of the step before (no row holds a state here).
    let state_before = |i: usize, b: usize, s: usize| -> Result<*mut f32> {
        match s {
            0 => Ok(job.h0[i][b * layer.state_sizes[i]..].as_ptr() as *mut f32),
            _ => locate(bufs, &frame, next_states[i], b, job.order.time(b, s - 1, job.reverse), 0),
        }
    };
    // Value `v`'s row at step `s` of sequence `b`.
    let row_of = |v: ValueId, b: usize, s: usize| -> Result<*mut f32> {
        match pass.home(v) {
            Some(Home::State(i)) => state_before(i, b, s),
            _ => locate(bufs, &frame, v, b, job.order.time(b, s, job.reverse), 0),
        }
    };
    let copy = |src: *mut f32, dst: &mut [f32]| {
        // SAFETY: `src` is a row (from `row_of` or `state_before`) of the
        // value `dst` has a row of: as many floats.
        dst.copy_from_slice(unsafe { std::slice::from_raw_parts(src, dst.len()) })
    };
    for s in 0..job.order.steps() {
        for (r, &b) in job.order.active(s).iter().enumerate() {
            let table = &mut tables[r % chunks];
            for &v in exec.inputs().iter().chain(exec.outputs()) {
                table.push(row_of(v, b, s)?);
            }
        }
    }
    run_tables(exec, tables, k);

    let o = layer.output_size;
    let mut finals: Vec<Vec<f32>> =
        layer.state_sizes.iter().map(|&m| vec![0.0; job.order.batch() * m]).collect();
    for b in 0..job.order.batch() {
        let len = job.order.lengths()[b];
        for s in 0..len {
            let t = job.order.time(b, s, job.reverse);
            let out_row = output.layout.row(b, t) * output.width + output.offset;
            copy(row_of(output_value, b, s)?, &mut output.data[out_row..out_row + o]);
            if let Some(tape) = tape.as_deref_mut() {
                let row = job.input.layout.row(b, t);
                for (write, (part, data)) in pass.tape.iter().zip(&mut tape.parts) {
                    let width = part.floats;
                    let dst = &mut data[row * width..(row + 1) * width];
                    match write.source {
                        _ if write.direct => {}
                        TapeSource::StateBefore(i) => copy(state_before(i, b, s)?, dst),
                        TapeSource::Value(v) => copy(row_of(v, b, s)?, dst),
                    }
                }
            }
            if s + 1 == len {
                for (i, &m) in layer.state_sizes.iter().enumerate() {
                    copy(row_of(next_states[i], b, s)?, &mut finals[i][b * m..(b + 1) * m]);
                }
            }
        }
    }
    Ok(finals)
}

/// The backward's whole-sequence loop: one call walking each sequence
/// backwards through time, the carried adjoints chained like the forward's
/// states (a state with no adjoint carries zeros). Everything the stage
/// computes is kept per row for after the loop.
pub(super) fn backward_whole_sequence(
    walk: &Walk<HostBackward>,
    bufs: &mut Buffers,
    weights: &PreparedParams,
    pass: &PassPlan,
    rank_order: &[usize],
    carry: &mut [Vec<f32>],
) -> Result<()> {
    let (job, exec) = (walk.job, walk.exec);
    let layer = job.layer;
    let layout_rows = job.layout_rows();
    for &v in exec.outputs() {
        bufs.row_buf(v, layer.backward_shapes.elements(v), layout_rows);
    }
    let frame = Frame {
        d_output: Some((job.d_output, layer.output_size)),
        backward: Some(job),
        ..Frame::new((job.input, job.masks), layer, job.params, weights)
    };
    let zeros = vec![0.0f32; layer.state_sizes.iter().copied().max().unwrap_or(0)];
    let k = exec.inputs().len() + exec.outputs().len();
    let order = job.order.order();
    let chunks = walk.threads.clamp(1, order.len().max(1));
    let mut tables: Vec<Vec<*mut f32>> = vec![Vec::new(); chunks];
    for s in (0..job.order.steps()).rev() {
        for (r, &b) in job.order.active(s).iter().enumerate() {
            let t = job.order.time(b, s, job.reverse);
            let last = s + 1 == job.order.lengths()[b];
            let table = &mut tables[r % chunks];
            for &v in exec.inputs() {
                let p = match (pass.home(v), last) {
                    (Some(Home::Carry(i)), true) => {
                        let m = layer.state_sizes[i];
                        job.d_final[i][b * m..].as_ptr() as *mut f32
                    }
                    (Some(Home::Carry(i)), false) => match pass.carried[i] {
                        Some(d) => locate(bufs, &frame, d, b, job.order.time(b, s + 1, job.reverse), 0)?,
                        // Read only: the kernel's inputs are never written.
                        None => zeros.as_ptr() as *mut f32,
                    },
                    _ => locate(bufs, &frame, v, b, t, 0)?,
                };
                table.push(p);
            }
            for &v in exec.outputs() {
                table.push(locate(bufs, &frame, v, b, t, 0)?);
            }
        }
    }
    run_tables(exec, tables, k);
    // The adjoints of the initial states: the carry out of each sequence's first step.
    for (r, &b) in rank_order.iter().enumerate() {
        let t = job.order.time(b, 0, job.reverse);
        for (i, &m) in layer.state_sizes.iter().enumerate() {
            let dst = &mut carry[i][r * m..(r + 1) * m];
            match pass.carried[i] {
                Some(d) => copy_row(bufs, &frame, d, (b, t, 0), dst)?,
                None => dst.fill(0.0),
            }
        }
    }
    Ok(())
}

/// Carried adjoint `i` as each row of a whole-sequence backward saw it:
/// the state adjoint its next step computed, or the final state's adjoint
/// at a sequence's last step.
pub(super) fn seeds_per_row(
    job: &HostBackward,
    pass: &PassPlan,
    bufs: &Buffers,
    i: usize,
    layout_rows: usize,
) -> Result<Vec<f32>> {
    let layer = job.layer;
    let m = layer.state_sizes[i];
    let mut data = pool::take_zeroed(layout_rows * m);
    let no_weights = PreparedParams::new(0, Precision::F32);
    let frame = Frame::new((job.input, job.masks), layer, job.params, &no_weights);
    for b in 0..job.order.batch() {
        let len = job.order.lengths()[b];
        for s in 0..len {
            let row = job.input.layout.row(b, job.order.time(b, s, job.reverse));
            let dst = &mut data[row * m..(row + 1) * m];
            if s + 1 == len {
                dst.copy_from_slice(&job.d_final[i][b * m..(b + 1) * m]);
            } else if let Some(d) = pass.carried[i] {
                copy_row(bufs, &frame, d, (b, job.order.time(b, s + 1, job.reverse), 0), dst)?;
            }
        }
    }
    Ok(data)
}

/// Runs one pointer table per thread (each holding whole sequences in time
/// order, so each row's chained inputs were written by an earlier row).
fn run_tables(exec: &dyn StageExec, tables: Vec<Vec<*mut f32>>, k: usize) {
    let tables: Vec<SendTable> = tables.into_iter().map(SendTable).collect();
    threads::for_each(tables.len(), &|i| {
        let table = tables[i].get();
        // SAFETY: pointers from `locate` (or the caller's h0 / final
        // adjoints, or a row of zeros), valid for their values; tables
        // write disjoint sequences.
        unsafe { exec.run(table.len() / k.max(1), table) }
    });
}
