//! The stages that run over every valid row of a batch: the plan's
//! before the loop and after it (products as GEMMs over all rows, kernels
//! over every row), and parameter gradients summed over rows.

use super::buffers::{Buffers, Frame};
use super::stages::{gemm_all_rows, run_pointwise, ReadyStage, SendTable};
use super::threads;
use crate::error::{Result, RuntimeError};
use cellc::ir::ValueId;
use cellc::shapes::Shapes;
use std::collections::HashMap;

/// Every valid row of a batch, for the stages run before or after the loop.
pub(super) struct AllRows<'a> {
    pub(super) order: &'a crate::sequence::BatchOrder,
    /// `(b, t, 0)` for every valid row.
    pub(super) rows: &'a [(usize, usize, usize)],
    pub(super) shapes: &'a Shapes,
    pub(super) threads: usize,
}

/// Runs the stages `which` (the plan's before or after the loop) over
/// every valid row: products as GEMMs over all rows (weight gradients
/// summed into `matrices`), kernels over every row.
pub(super) fn run_all_rows(
    steps: &[ReadyStage],
    which: &[usize],
    bufs: &mut Buffers,
    frame: &Frame,
    all: &AllRows,
    matrices: &mut HashMap<ValueId, Vec<f32>>,
) -> Result<()> {
    for st in which.iter().map(|&k| &steps[k]) {
        match st {
            ReadyStage::Gemm { products, .. } => {
                gemm_all_rows(products, bufs, frame, all.order, matrices, all.shapes, all.threads)?
            }
            ReadyStage::Pointwise { exec, .. } => {
                run_pointwise(exec.as_ref(), bufs, frame, all.rows, all.threads)?
            }
            ReadyStage::Sum => {}
            ReadyStage::AddMatrices { sums } => {
                for &(out, a, b) in sums {
                    let missing = |v: ValueId| RuntimeError::Internal(format!("matrix {v} is not computed"));
                    let (x, y) = (
                        matrices.get(&a).ok_or_else(|| missing(a))?,
                        matrices.get(&b).ok_or_else(|| missing(b))?,
                    );
                    let sum = x.iter().zip(y).map(|(x, y)| x + y).collect();
                    matrices.insert(out, sum);
                }
            }
        }
    }
    Ok(())
}

/// `out[j] = Σ_rows row[j]`, rows added in order; the columns are shared
/// out between up to `threads` threads, so the result does not depend on
/// the thread count.
///
/// # Safety
/// Every pointer is valid for `out.len()` floats.
pub(super) unsafe fn sum_rows(rows: &[*const f32], out: &mut [f32], threads: usize) {
    let len = out.len();
    let parts = if rows.len() * len >= 1 << 16 { threads.clamp(1, len.div_ceil(16)) } else { 1 };
    let per = len.div_ceil(parts).next_multiple_of(16).max(16);
    let rows = SendTable(rows.iter().map(|&p| p as *mut f32).collect());
    threads::for_each_chunk_mut(out, per, &|c, chunk| {
        for &p in rows.get() {
            // SAFETY: per the contract, p has `len` floats; this chunk's columns lie within.
            let row = unsafe { std::slice::from_raw_parts(p.add(c * per), chunk.len()) };
            chunk.iter_mut().zip(row).for_each(|(a, x)| *a += x);
        }
    });
}

/// Every valid `(sequence, step, 0)` of a batch, sequence by sequence: the
/// rows a stage before or after the loop runs on.
pub(super) fn valid_rows(order: &crate::sequence::BatchOrder) -> Vec<(usize, usize, usize)> {
    order.lengths().iter().enumerate().flat_map(|(b, &len)| (0..len).map(move |t| (b, t, 0))).collect()
}
