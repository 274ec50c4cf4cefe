//! The backward step on the CPU split by units: each thread runs every
//! per-step stage on its own range of units, for every row
//! ([`cellc::schedule::tiles::UnitSplit`] decides which steps may).
//!
//! When the threads split a step's units (a batch too small for each to
//! own whole sequences), the whole-row step meets after each kernel,
//! whose rows it shares out (one sequence: one thread works), and after
//! each product, whose columns it shares out. Split by units, a thread
//! runs a kernel on its units of every row, computes its own columns of
//! the products (the state's adjoint: one block of the unit), and moves
//! its units of the carried adjoints, of the rows kept for after the loop
//! and of the parameters' row sums. The threads meet only before a
//! product that reads what the step computed (it reads every unit): once
//! a step for an LSTM or a GRU, against three. They also meet at
//! the step's end where a product's operand is held in a row that the
//! next step overwrites (while another thread may still read it); where
//! it is held at the layout's rows, each step's row is its own.
//!
//! A kernel planned at the unit's size `w` runs on `w` units: its vectors
//! of one block are read and written in place, `from` floats into each
//! row; those of `k` blocks are gathered into a scratch row (block `g`'s
//! units from `g * units + from`) and written back from it. Every number
//! is the whole-row step's: the kernels' operations are elementwise, a
//! product's column is the same sum whoever computes it, and sums over
//! rows add the same rows in the same order, element by element.

use super::buffers::{locate, Buffers, Frame};
use super::prepared::PreparedParams;
use super::stage::{BuiltKernels, StageExec};
use super::stages::ReadyStage;
use super::team::{Split, Team};
use super::tiles::FUSE_BELOW_ROWS_PER_THREAD;
use crate::error::{Result, RuntimeError};
use cellc::schedule::UnitSplit;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// Builds a pointwise stage's kernel for `(stage, width)`: `width` units.
pub type UnitsBuilder = dyn Fn(usize, usize) -> Result<Arc<dyn StageExec>> + Send + Sync;

/// A layer's backward step split by units: the compiler's [`UnitSplit`]
/// and its kernels, built on first use for each stage and width.
pub struct UnitKernels {
    pub split: UnitSplit,
    /// The unit variable's value.
    pub units: usize,
    build: Box<UnitsBuilder>,
    kernels: BuiltKernels<(usize, usize)>,
}

impl UnitKernels {
    pub fn new(split: UnitSplit, units: usize, build: Box<UnitsBuilder>) -> UnitKernels {
        UnitKernels { split, units, build, kernels: BuiltKernels::default() }
    }

    /// Stage `stage`'s kernel on `width` units.
    fn kernel(&self, stage: usize, width: usize) -> Result<Arc<dyn StageExec>> {
        self.kernels.get_or_build((stage, width), || (self.build)(stage, width))
    }
}

/// A pointwise stage's kernels on a thread's units: of the full width, and
/// of the narrower last thread's if there is one; and each of their
/// inputs' then outputs' blocks of the unit (0: not a vector of it).
struct StageOnUnits {
    full: Arc<dyn StageExec>,
    last: Option<Arc<dyn StageExec>>,
    blocks: Vec<usize>,
}

/// One pass's split: each thread's units and each kernel's form on them.
pub struct PassUnits<'a> {
    kernels: &'a UnitKernels,
    /// Units a thread (the last one's may be fewer).
    width: usize,
    stages: HashMap<usize, StageOnUnits>,
    /// Whether the threads meet at each step's end (see the module's doc).
    meets_at_step_end: bool,
}

/// What a thread reuses from kernel to kernel: the pointer table, the
/// gathered rows, and where each gathered output goes back.
#[derive(Default)]
pub struct UnitScratch {
    table: Vec<*mut f32>,
    rows: Vec<f32>,
    back: Vec<(*mut f32, usize, usize)>,
}

impl<'a> PassUnits<'a> {
    /// The split of a backward pass run by `team`, if it runs split: its
    /// threads split units and have fewer than
    /// [`FUSE_BELOW_ROWS_PER_THREAD`] sequences each, its per-step stages
    /// are the split's, its weights are packed (a thread's columns are
    /// whole panels of them), every thread has units, and each kernel
    /// can be planned at a thread's width. `None` runs whole rows.
    pub fn new(
        kernels: &'a UnitKernels,
        (stages, each_step): (&[ReadyStage], &[usize]),
        team: &Team,
        weights: &PreparedParams,
    ) -> Option<PassUnits<'a>> {
        let (units, threads) = (kernels.units, team.threads);
        let worth = team.split == Split::Units
            && threads > 1
            && team.order().len() < FUSE_BELOW_ROWS_PER_THREAD * threads
            && each_step == kernels.split.stages
            && !weights.reads_in_place();
        if !worth {
            return None;
        }
        let panel = super::panels::PANEL;
        let width = units.div_ceil(threads).div_ceil(panel) * panel;
        if units.div_ceil(width) < threads {
            return None;
        }
        let mut on_units = HashMap::new();
        for &k in each_step {
            if !matches!(stages[k], ReadyStage::Pointwise { .. }) {
                continue;
            }
            let full = kernels.kernel(k, width).ok()?;
            let last = match units % width {
                0 => None,
                rest => Some(kernels.kernel(k, rest).ok()?),
            };
            let blocks =
                (full.inputs().iter().chain(full.outputs())).map(|&v| kernels.split.blocks_of(v)).collect();
            on_units.insert(k, StageOnUnits { full, last, blocks });
        }
        Some(PassUnits { kernels, width, stages: on_units, meets_at_step_end: true })
    }

    /// This split, its threads meeting at each step's end or not (where
    /// each step's products read operands no later step overwrites).
    pub fn meeting_at_step_end(self, meets: bool) -> PassUnits<'a> {
        PassUnits { meets_at_step_end: meets, ..self }
    }

    /// Whether the threads meet at each step's end.
    pub fn meets_at_step_end(&self) -> bool {
        self.meets_at_step_end
    }

    /// Thread `i`'s units.
    pub fn units_of(&self, i: usize) -> Range<usize> {
        let units = self.kernels.units;
        (i * self.width).min(units)..((i + 1) * self.width).min(units)
    }

    /// Pointwise stage `k` on units `mine` of ranks `rows` (`ranked` gives
    /// each rank's sequence and time).
    ///
    /// # Safety
    /// The frame's and buffers' rows are valid, and no other thread
    /// writes units `mine` of the stage's outputs at these rows meanwhile.
    pub unsafe fn pointwise(
        &self,
        k: usize,
        (bufs, frame): (&Buffers, &Frame),
        (rows, ranked): (Range<usize>, &dyn Fn(usize) -> (usize, usize)),
        mine: Range<usize>,
        scratch: &mut UnitScratch,
    ) -> Result<()> {
        let st = self.stages.get(&k).ok_or_else(|| RuntimeError::Internal(format!("stage {k} on units")))?;
        if rows.is_empty() || mine.is_empty() {
            return Ok(());
        }
        let (units, from, w) = (self.kernels.units, mine.start, mine.len());
        let exec = if w == self.width { &st.full } else { st.last.as_ref().unwrap_or(&st.full) };
        let inputs = exec.inputs().len();
        let gathered: usize = st.blocks.iter().filter(|&&b| b > 1).map(|&b| b * w).sum();
        let UnitScratch { table, rows: data, back } = scratch;
        table.clear();
        back.clear();
        data.resize(rows.len() * gathered, 0.0);
        let mut at = 0;
        for r in rows.clone() {
            let (b, t) = ranked(r);
            let values = exec.inputs().iter().chain(exec.outputs());
            for (slot, (&v, &blocks)) in values.zip(&st.blocks).enumerate() {
                let row = locate(bufs, frame, v, b, t, r)?;
                let pointer = match blocks {
                    0 => row,
                    1 => row.wrapping_add(from),
                    _ => {
                        let rows_at = data[at..].as_mut_ptr();
                        for g in 0..blocks {
                            let (src, dst) =
                                (row.wrapping_add(g * units + from), rows_at.wrapping_add(g * w));
                            match slot < inputs {
                                // SAFETY: a located row holds `blocks * units` floats, the scratch `blocks * w` here.
                                true => unsafe { std::ptr::copy_nonoverlapping(src, dst, w) },
                                false => back.push((src, at + g * w, w)),
                            }
                        }
                        at += blocks * w;
                        rows_at
                    }
                };
                table.push(pointer);
            }
        }
        // SAFETY: each pointer is its value's row at these units, valid for
        // the kernel's sizes (`w` units); this thread alone writes them.
        unsafe { exec.run(rows.len(), table) };
        for &(dst, at, n) in back.iter() {
            // SAFETY: as gathered above, the other way.
            unsafe { std::ptr::copy_nonoverlapping(data[at..].as_ptr(), dst, n) };
        }
        Ok(())
    }
}

/// The pieces of a row of `len` floats (blocks of `units`) that are units
/// `mine`: one range a block, or the whole row without `mine`.
pub fn pieces(len: usize, units: usize, mine: &Option<Range<usize>>) -> impl Iterator<Item = Range<usize>> {
    let (blocks, m) = match mine {
        None => (1, 0..len),
        Some(m) => (len / units.max(1), m.clone()),
    };
    (0..blocks).map(move |g| g * units + m.start..g * units + m.end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_threads_pieces_are_its_units_of_each_block() {
        assert_eq!(pieces(12, 4, &Some(1..3)).collect::<Vec<_>>(), vec![1..3, 5..7, 9..11]);
        assert_eq!(pieces(12, 4, &None).collect::<Vec<_>>(), vec![0..12]);
    }
}
