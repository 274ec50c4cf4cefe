//! Host memory as a pass's memory: the masks of a pass filled into host
//! rows, and host rows multiplied by masks (dropout between layers,
//! DropConnect), for the devices that run on the host (the CPU and the
//! reference). Masks are drawn with the CPU's generator ([`super::masks`]);
//! a pass's sequences are shared out between the process's threads where
//! the masks are large enough to pay for waking them.

use super::driver::SharedRows;
use super::masks::{fill, MaskRow};
use super::threads;
use crate::dropout::LayerMasks;
use crate::masks::{MaskFill, MaskRows};
use crate::sequence::LaidOutBatch;
use cellc::ir::MaskPeriod;

/// Units `0..out.len()` of mask `m` of the sequence at index `sequence`
/// of the caller's batch at its step `step` (either ignored where the
/// mask is shared over it).
pub fn mask_row(m: &MaskFill, sequence: usize, step: usize, out: &mut [f32]) {
    let Some(d) = m.drawn else { return out.fill(m.evaluation) };
    let (sequence, step) = m.coordinates(sequence, step);
    fill(MaskRow { key: d.key, sequence, step, threshold: d.threshold, scale: d.kept }, 0, out);
}

/// Fills `row` (`rows.width` floats) with the masks of every row where
/// they are the same for every row (evaluation).
pub(crate) fn fill_shared_row(row: &mut [f32], rows: &MaskRows) {
    for m in &rows.fills {
        mask_row(m, 0, 0, &mut row[m.offset..m.offset + m.units]);
    }
}

/// Fills every valid row of `batch` in host rows at `base` (`rows.width`
/// floats a row) with its masks. Sequences are shared out between the
/// process's threads where the masks are large enough to pay for waking them.
///
/// # Safety
/// `base` holds the batch's layout rows of `rows.width` floats, which
/// nothing else reads or writes meanwhile.
pub(crate) unsafe fn fill_on_host(base: *mut f32, batch: &LaidOutBatch, rows: &MaskRows) {
    let (order, layout, width) = (&batch.order, &batch.layout, rows.width);
    let base = SharedRows(base);
    let sequence = |b: usize| {
        for t in 0..order.lengths()[b] {
            let row = layout.row(b, t) * width;
            for m in &rows.fills {
                // SAFETY: per the contract; each sequence's rows are its own, written by one task.
                let out = unsafe { std::slice::from_raw_parts_mut(base.at(row + m.offset), m.units) };
                match (m.period, t) {
                    // A mask shared over the sequence's steps is drawn once.
                    (MaskPeriod::Sequence, 1..) => {
                        // SAFETY: as above; row 0 of the sequence was written at t = 0.
                        let first = unsafe { base.at(layout.row(b, 0) * width + m.offset) };
                        // SAFETY: distinct rows of the buffer.
                        out.copy_from_slice(unsafe { std::slice::from_raw_parts(first, m.units) });
                    }
                    _ => mask_row(m, b, t, out),
                }
            }
        }
    };
    let floats = order.rows() * width;
    let threads = if floats >= 1 << 16 { threads::usable_cores() } else { 1 };
    threads::run_call(threads, |_| threads::for_each(order.batch(), &sequence));
}

/// Multiplies a parameter (`weights`) by its DropConnect mask `fill`, or
/// a gradient of the masked parameter by the same mask (the chain rule:
/// the masked parameter is `W * m`, so `dW = dW_masked * m`).
pub(crate) fn drop_connect(weights: &mut [f32], fill: &MaskFill) {
    let mut mask = vec![0.0f32; weights.len()];
    mask_row(fill, 0, 0, &mut mask);
    weights.iter_mut().zip(&mask).for_each(|(w, m)| *w *= m);
}

/// Multiplies every valid row of `batch` in host rows at `base` (`width`
/// floats a row, the masked features from `offset`) by its masks.
/// Sequences are shared out between the process's threads where the masks
/// are large enough to pay for waking them.
///
/// # Safety
/// `base` holds the batch's layout rows of `width` floats, which nothing
/// else reads or writes meanwhile.
pub(crate) unsafe fn apply_on_host(
    base: *mut f32,
    (width, offset): (usize, usize),
    batch: &LaidOutBatch,
    masks: &LayerMasks,
) {
    let (order, layout, units) = (&batch.order, &batch.layout, masks.units);
    let (threshold, scale) = (masks.threshold, masks.scale);
    let base = SharedRows(base);
    let sequence = |b: usize| {
        let mut mask = vec![0.0f32; units];
        for t in 0..order.lengths()[b] {
            let row = layout.row(b, t) * width + offset;
            for (d, &key) in masks.keys.iter().enumerate() {
                fill(MaskRow { key, sequence: b as u32, step: t as u32, threshold, scale }, 0, &mut mask);
                // SAFETY: per the contract; each sequence's rows are its own, written by one task.
                let at = unsafe { std::slice::from_raw_parts_mut(base.at(row + d * units), units) };
                at.iter_mut().zip(&mask).for_each(|(x, m)| *x *= m);
            }
        }
    };
    let features = order.rows() * units * masks.keys.len();
    let threads = if features >= 1 << 16 { threads::usable_cores() } else { 1 };
    threads::run_call(threads, |_| threads::for_each(order.batch(), &sequence));
}
