//! Parameter gradients that are sums over a backward's rows (a bias's, a
//! LayerNorm gain's), added up as the loop goes.
//!
//! Each sequence's rows are added in the order the backward visits them
//! (its steps backwards), from zero, into the sequence's own sum; the
//! gradient is then the sequences' sums added in sequence order, from
//! zero. A sequence's row at a step is added by the thread that owns it,
//! so no two threads touch one sum at once, and the result depends on
//! neither the thread count nor the split. A value that only these sums
//! read need not be kept for every row after the loop: a LayerNorm-LSTM's
//! five such rows (14 `H` floats a row) are neither copied out at each
//! step nor read back from memory after the loop.
//!
//! A loop run as one whole-sequence kernel keeps its rows; their sums are
//! taken after it, in the same order ([`RowSums::add_kept_rows`]), so the
//! bits are those of the step loop.

use super::buffers::{locate, Buffers, Frame};
use super::host::SharedRows;
use super::threads;
use super::unit_split::pieces;
use crate::error::{Result, RuntimeError};
use crate::pool;
use crate::sequence::BatchOrder;
use cellc::ir::ValueId;
use cellc::shapes::Shapes;
use std::ops::Range;

/// Each summed value's per-sequence sums: `batch` rows of its length.
pub(super) struct RowSums {
    sums: Vec<Summed>,
}

struct Summed {
    value: ValueId,
    len: usize,
    data: Vec<f32>,
    rows: SharedRows,
}

impl RowSums {
    /// Zeroed sums of `values` for each of `batch` sequences.
    pub(super) fn new(values: &[ValueId], shapes: &Shapes, batch: usize) -> RowSums {
        let sums = values
            .iter()
            .map(|&value| {
                let len = shapes.elements(value);
                let mut data = pool::take_zeroed(batch * len);
                let rows = SharedRows::of(&mut data);
                Summed { value, len, data, rows }
            })
            .collect();
        RowSums { sums }
    }

    /// Whether `v`'s rows are summed here.
    pub(super) fn has(&self, v: ValueId) -> bool {
        self.sums.iter().any(|s| s.value == v)
    }

    /// Adds row `(b, t)` (rank `r`) of every summed value into sequence
    /// `b`'s sums: the whole row, or units `mine` of each block of `units`
    /// (each element's sum adds the same rows in the same order either way).
    ///
    /// # Safety
    /// The calling thread alone touches sequence `b`'s sums (or these
    /// units of them) until the threads next meet.
    pub(super) unsafe fn add(
        &self,
        (bufs, frame): (&Buffers, &Frame),
        (b, t, r): (usize, usize, usize),
        (units, mine): (usize, &Option<Range<usize>>),
    ) -> Result<()> {
        for s in &self.sums {
            let row = locate(bufs, frame, s.value, b, t, r)?;
            for piece in pieces(s.len, units, mine) {
                // SAFETY: a located row has the value's length; sequence b's
                // sum is this thread's (the contract) and lies in the buffer.
                unsafe { add_row(s.rows.at(b * s.len + piece.start), row.add(piece.start), piece.len()) };
            }
        }
        Ok(())
    }

    /// Adds every row the loop visited, kept at the layout's rows, into the
    /// sums, each sequence's in the order the backward visits its steps:
    /// the sums the step loop would have made. Sequences are shared out
    /// between `threads`.
    pub(super) fn add_kept_rows(
        &self,
        (bufs, frame): (&Buffers, &Frame),
        order: &BatchOrder,
        reverse: bool,
        threads: usize,
    ) -> Result<()> {
        let failed = std::sync::Mutex::new(None);
        let batch = order.batch();
        let per = batch.div_ceil(threads.max(1)).max(1);
        threads::for_each(batch.div_ceil(per), &|part| {
            for b in part * per..((part + 1) * per).min(batch) {
                for s in (0..order.lengths()[b]).rev() {
                    // SAFETY: this task alone holds sequences part*per.. of the sums.
                    let row = (b, order.time(b, s, reverse), 0);
                    if let Err(e) = unsafe { self.add((bufs, frame), row, (0, &None)) } {
                        *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                        return;
                    }
                }
            }
        });
        failed.into_inner().unwrap_or_else(|e| e.into_inner()).map_or(Ok(()), Err)
    }

    /// `v`'s gradient: its sequences' sums added in order.
    pub(super) fn total(&self, v: ValueId) -> Result<Vec<f32>> {
        let s = self
            .sums
            .iter()
            .find(|s| s.value == v)
            .ok_or_else(|| RuntimeError::Internal(format!("{v} is not summed over rows")))?;
        let mut total = vec![0.0f32; s.len];
        for sequence in s.data.chunks_exact(s.len) {
            total.iter_mut().zip(sequence).for_each(|(a, x)| *a += x);
        }
        Ok(total)
    }
}

impl Drop for RowSums {
    fn drop(&mut self) {
        for s in &mut self.sums {
            pool::give(std::mem::take(&mut s.data));
        }
    }
}

/// `sum[i] += row[i]` for `i < len`.
///
/// # Safety
/// Both hold `len` floats; no one else writes `sum` meanwhile.
unsafe fn add_row(sum: *mut f32, row: *const f32, len: usize) {
    // SAFETY: per the contract.
    let (sum, row) =
        unsafe { (std::slice::from_raw_parts_mut(sum, len), std::slice::from_raw_parts(row, len)) };
    sum.iter_mut().zip(row).for_each(|(a, x)| *a += x);
}
