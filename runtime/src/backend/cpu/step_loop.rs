//! One layer-direction's time loop, run by every thread of the team at
//! once (see [`super::team`]): each step's stages in schedule order, then
//! the caller's per-row bookkeeping (outputs, tape, next states) for the
//! rows the thread owns.

use super::buffers::{locate, Buffers, Frame};
use super::profile::{Clock, Phase};
use super::sink::Sunk;
use super::stages::{product_rows, Columns, ReadyStage};
use super::team::{Barrier, Split, Team};
use super::threads;
use super::tiles::{PassTiles, TileScratch};
use super::unit_split::{PassUnits, UnitScratch};
use crate::error::{Result, RuntimeError};
use crate::sequence::BatchOrder;
use std::ops::Range;

/// What the per-row bookkeeping after a step is: `(step, ranks, units)`,
/// `units` a fused step's share of every row (`None`: whole rows).
pub type AfterStep<'a> = dyn Fn(usize, Range<usize>, Option<Range<usize>>) -> Result<()> + Sync + 'a;

/// A loop's frames: one, or two whose states are two buffers taken in
/// turn. A fused step has no barrier between its products, which read
/// every unit of the states, and each thread's move of its units of the
/// next states: those go to the other buffer (the odd steps' frame),
/// read the step after.
#[derive(Clone, Copy)]
pub struct Frames<'a> {
    pub even: &'a Frame<'a>,
    pub odd: Option<&'a Frame<'a>>,
}

impl<'a> Frames<'a> {
    /// One frame for every step: the states are updated in place.
    pub fn one(frame: &'a Frame<'a>) -> Frames<'a> {
        Frames { even: frame, odd: None }
    }

    /// The frame whose states step `s` reads (and step `s - 1` wrote).
    pub fn at(&self, s: usize) -> &'a Frame<'a> {
        match self.odd {
            Some(odd) if s % 2 == 1 => odd,
            _ => self.even,
        }
    }
}

/// Everything the threads share.
pub struct StepLoop<'a> {
    pub team: &'a Team,
    /// The layer's stages.
    pub stages: &'a [ReadyStage],
    /// The stages the loop runs each step, in order (the pass's plan's).
    pub each_step: &'a [usize],
    pub bufs: &'a Buffers,
    pub frames: Frames<'a>,
    pub shapes: &'a cellc::shapes::Shapes,
    pub order: &'a BatchOrder,
    pub reverse: bool,
    /// The pass's fused step ([`super::tiles`]).
    pub tiles: Option<&'a PassTiles<'a>>,
    /// The pass's step split by units ([`super::unit_split`]).
    pub units: Option<&'a PassUnits<'a>>,
    /// Products hoisted before the loop that each thread runs on its
    /// sequences at each step's start ([`super::sink`]).
    pub sunk: &'a Sunk,
}

impl StepLoop<'_> {
    /// Runs the steps in the order given (forwards or backwards in time),
    /// on `team.threads` threads of the current call ([`threads::broadcast`]).
    pub fn run(&self, steps: &[usize], after: &AfterStep) -> Result<()> {
        let barrier = Barrier::new(self.team.threads);
        if self.team.threads == 1 {
            return self.thread(0, steps, after, &barrier);
        }
        if threads::current_threads() < self.team.threads {
            return Err(RuntimeError::Internal(format!(
                "a team of {} threads in a call of {}",
                self.team.threads,
                threads::current_threads()
            )));
        }
        let results: Vec<std::sync::Mutex<Result<()>>> =
            (0..self.team.threads).map(|_| std::sync::Mutex::new(Ok(()))).collect();
        threads::broadcast(self.team.threads, &|i| {
            let r = self.thread(i, steps, after, &barrier);
            *results[i].lock().unwrap_or_else(|e| e.into_inner()) = r;
        });
        results.into_iter().try_for_each(|r| r.into_inner().unwrap_or_else(|e| e.into_inner()))
    }

    fn thread(&self, i: usize, steps: &[usize], after: &AfterStep, barrier: &Barrier) -> Result<()> {
        let units = self.team.split == Split::Units;
        // Leaves the loop with an error, releasing the other threads.
        let fail = |e| {
            if units {
                barrier.abort();
                barrier.wait();
            }
            Err(e)
        };
        let parts = if units { (i, self.team.threads) } else { (0, 1) };
        let mut scratch = TileScratch::default();
        let mut unit_scratch = UnitScratch::default();
        let mut clock = Clock::start();
        for &s in steps {
            let went_on = match self.units {
                Some(split) => self.on_units(split, (i, s), barrier, &mut clock, &mut unit_scratch),
                None => self.on_rows_or_tiles((i, s), parts, barrier, &mut clock, &mut scratch),
            };
            match went_on {
                Ok(true) => {}
                Ok(false) => return Ok(()),
                Err(e) => return fail(e),
            }
            let share = match (self.units, self.tiles) {
                (Some(split), _) => (self.team.product_rows(i, s), Some(split.units_of(i))),
                (None, Some(t)) => (self.team.product_rows(i, s), Some(t.units_of(i))),
                (None, None) => (self.team.rows(i, s), None),
            };
            if let Err(e) = after(s, share.0, share.1) {
                return fail(e);
            }
            clock.lap_of(Phase::Bookkeeping, self.team.threads);
            let meets = units && self.units.is_none_or(|split| split.meets_at_step_end());
            if meets && !barrier.wait() {
                return Ok(());
            }
            clock.lap_of(Phase::Wait, self.team.threads);
        }
        Ok(())
    }

    /// Thread `i`'s share of every stage of step `s` on whole rows, or
    /// the fused step's tiles: the products in `parts` of their columns
    /// (the whole product with one part). `false` when another thread
    /// aborted the loop.
    fn on_rows_or_tiles(
        &self,
        (i, s): (usize, usize),
        parts: (usize, usize),
        barrier: &Barrier,
        clock: &mut Clock,
        scratch: &mut TileScratch,
    ) -> Result<bool> {
        let units = self.team.split == Split::Units;
        if !self.sunk.products.is_empty() {
            self.sunk_products(i, s, &mut scratch.gathered)?;
            clock.lap_of(Phase::Products, self.team.threads);
        }
        for (at, &k) in self.each_step.iter().enumerate() {
            // A fused step: the products and the stage that reads them
            // on this thread's tiles, with no barrier until the step's end.
            if let Some(tiles) =
                self.tiles.filter(|t| [t.step.fusion.gemm, t.step.fusion.pointwise].contains(&k))
            {
                if tiles.step.fusion.gemm == k {
                    self.fused(tiles, k, (i, s), scratch)?;
                    clock.lap_of(Phase::Products, self.team.threads);
                }
                continue;
            }
            let phase = match &self.stages[k] {
                ReadyStage::Gemm { products, .. } => {
                    let rows = self.team.product_rows(i, s);
                    let ranked = self.rank_row(s);
                    for p in products {
                        let at = (self.bufs, self.frames.at(s));
                        product_rows(p, at, (rows.clone(), &ranked), Columns::Share(parts), self.shapes)?;
                    }
                    Phase::Products
                }
                ReadyStage::Pointwise { exec, .. } => {
                    self.pointwise(exec.as_ref(), s, self.team.rows(i, s), &mut scratch.table)?;
                    Phase::Pointwise
                }
                ReadyStage::Sum | ReadyStage::AddMatrices { .. } => Phase::Bookkeeping,
            };
            clock.lap_of(phase, self.team.threads);
            if units && self.meets_after(at) && !barrier.wait() {
                return Ok(false);
            }
            clock.lap_of(Phase::Wait, self.team.threads);
        }
        Ok(true)
    }

    /// Whether the threads of a team that splits units meet after the
    /// step's `at`-th stage. A product splits its columns, so the threads
    /// meet after one (the next stage reads whole rows of it) and before
    /// one (it reads every row); a kernel runs on the thread's own rows,
    /// as do the next kernel and the bookkeeping after the step, so
    /// between those the threads need not meet. The step ends with a
    /// meeting in any case (the next step's products read every row).
    fn meets_after(&self, at: usize) -> bool {
        let is_product = |k: &usize| matches!(self.stages[*k], ReadyStage::Gemm { .. });
        is_product(&self.each_step[at]) || self.each_step.get(at + 1).is_some_and(is_product)
    }

    /// Thread `i`'s units of every stage of step `s` ([`super::unit_split`]):
    /// the threads meet before each product that reads what the step
    /// computed. `false` when another thread aborted the loop.
    fn on_units(
        &self,
        split: &PassUnits,
        (i, s): (usize, usize),
        barrier: &Barrier,
        clock: &mut Clock,
        scratch: &mut UnitScratch,
    ) -> Result<bool> {
        let (rows, ranked, mine) = (self.team.product_rows(i, s), self.rank_row(s), split.units_of(i));
        let at = (self.bufs, self.frames.at(s));
        for (n, &k) in self.each_step.iter().enumerate() {
            match &self.stages[k] {
                ReadyStage::Gemm { products } => {
                    if n > 0 && !barrier.wait() {
                        return Ok(false);
                    }
                    clock.lap_of(Phase::Wait, self.team.threads);
                    for p in products {
                        let columns = Columns::Units(mine.clone());
                        product_rows(p, at, (rows.clone(), &ranked), columns, self.shapes)?;
                    }
                    clock.lap_of(Phase::Products, self.team.threads);
                }
                ReadyStage::Pointwise { .. } => {
                    // SAFETY: this thread alone writes its units of the stage's outputs.
                    unsafe { split.pointwise(k, at, (rows.clone(), &ranked), mine.clone(), scratch)? };
                    clock.lap_of(Phase::Pointwise, self.team.threads);
                }
                ReadyStage::Sum | ReadyStage::AddMatrices { .. } => {}
            }
        }
        Ok(true)
    }

    /// Thread `i`'s share of fused stage `k`'s products and the pointwise
    /// stage after them, at step `s` ([`PassTiles::run`]).
    fn fused(
        &self,
        tiles: &PassTiles,
        k: usize,
        (i, s): (usize, usize),
        scratch: &mut TileScratch,
    ) -> Result<()> {
        let ReadyStage::Gemm { products } = &self.stages[k] else {
            return Err(RuntimeError::Internal(format!("fused stage {k} is not a product")));
        };
        let ranked = self.rank_row(s);
        let rows = (i, self.team.product_rows(i, s), &ranked as &super::sink::RankRow);
        // SAFETY: every thread of the team runs its own tiles, which no other writes.
        unsafe { tiles.run((self.bufs, self.frames.at(s), self.shapes), products, rows, scratch) }
    }

    /// Thread `i`'s rows of the products run in step `s` instead of
    /// before the loop: its threads own their sequences
    /// ([`super::sink::stages_to_sink`]).
    fn sunk_products(&self, i: usize, s: usize, gathered: &mut Vec<Vec<f32>>) -> Result<()> {
        let ranked = self.rank_row(s);
        let rows = self.team.rows(i, s);
        if rows.is_empty() {
            return Ok(());
        }
        let at = (self.bufs, self.frames.at(s), self.shapes);
        for (call, _) in self.sunk.locate(at, rows, &ranked, gathered)? {
            // SAFETY: the thread's own rows of the product's rank buffer.
            unsafe { call.run((0, 1)) };
        }
        Ok(())
    }

    /// Step `s`'s sequence and time of each rank.
    fn rank_row(&self, s: usize) -> impl Fn(usize) -> (usize, usize) + '_ {
        move |r| {
            let b = self.team.order()[r];
            (b, self.order.time(b, s, self.reverse))
        }
    }

    /// A pointwise stage on ranks `rows` of step `s`.
    fn pointwise(
        &self,
        exec: &dyn super::stage::StageExec,
        s: usize,
        rows: Range<usize>,
        table: &mut Vec<*mut f32>,
    ) -> Result<()> {
        table.clear();
        let ranked = self.rank_row(s);
        for r in rows.clone() {
            let (b, t) = ranked(r);
            for &v in exec.inputs().iter().chain(exec.outputs()) {
                table.push(locate(self.bufs, self.frames.at(s), v, b, t, r)?);
            }
        }
        // SAFETY: every pointer comes from `locate`, valid for its value's
        // length; this thread alone writes these ranks' outputs.
        unsafe { exec.run(rows.len(), table) };
        Ok(())
    }
}
