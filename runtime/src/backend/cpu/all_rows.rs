//! The stages that run over every valid row of a batch: the plan's
//! before the loop and after it (products as GEMMs over all rows, kernels
//! over every row).

use super::buffers::{Buffers, Frame};
use super::stages::{gemm_all_rows, run_pointwise, ReadyStage};
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

/// Every valid `(sequence, step, 0)` of a batch, sequence by sequence: the
/// rows a stage before or after the loop runs on.
pub(super) fn valid_rows(order: &crate::sequence::BatchOrder) -> Vec<(usize, usize, usize)> {
    order.lengths().iter().enumerate().flat_map(|(b, &len)| (0..len).map(move |t| (b, t, 0))).collect()
}
