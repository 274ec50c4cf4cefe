//! One layer-direction's time loop, run by every thread of the team at
//! once (see [`super::team`]): each step's stages in schedule order, then
//! the caller's per-row bookkeeping (outputs, tape, next states) for the
//! rows the thread owns.

use super::buffers::{locate, Buffers, Frame};
use super::profile::{Clock, Phase};
use super::stages::{product_rows, ReadyStage};
use super::team::{Barrier, Split, Team};
use super::threads;
use crate::error::{Result, RuntimeError};
use crate::sequence::BatchOrder;
use std::ops::Range;

/// What the per-row bookkeeping after a step is: `(step, ranks)`.
pub type AfterStep<'a> = dyn Fn(usize, Range<usize>) -> Result<()> + Sync + 'a;

/// Everything the threads share.
pub struct StepLoop<'a> {
    pub team: &'a Team,
    /// The layer's stages.
    pub stages: &'a [ReadyStage],
    /// The stages the loop runs each step, in order (the pass's plan's).
    pub each_step: &'a [usize],
    pub bufs: &'a Buffers,
    pub frame: &'a Frame<'a>,
    pub shapes: &'a cellc::shapes::Shapes,
    pub order: &'a BatchOrder,
    pub reverse: bool,
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
        let mut table: Vec<*mut f32> = Vec::new();
        let mut clock = Clock::start();
        for &s in steps {
            for &k in self.each_step {
                let (done, phase) = match &self.stages[k] {
                    ReadyStage::Gemm { products, .. } => {
                        let rows = self.team.product_rows(i, s);
                        let done = products.iter().try_for_each(|p| {
                            product_rows(p, self.bufs, self.frame, rows.clone(), parts, self.shapes)
                        });
                        (done, Phase::Products)
                    }
                    ReadyStage::Pointwise { exec, .. } => {
                        let done = self.pointwise(exec.as_ref(), s, self.team.rows(i, s), &mut table);
                        (done, Phase::Pointwise)
                    }
                    ReadyStage::Sum | ReadyStage::AddMatrices { .. } => (Ok(()), Phase::Bookkeeping),
                };
                clock.lap_of(phase, self.team.threads);
                if let Err(e) = done {
                    return fail(e);
                }
                if units && !barrier.wait() {
                    return Ok(());
                }
                clock.lap_of(Phase::Wait, self.team.threads);
            }
            if let Err(e) = after(s, self.team.rows(i, s)) {
                return fail(e);
            }
            clock.lap_of(Phase::Bookkeeping, self.team.threads);
            if units && !barrier.wait() {
                return Ok(());
            }
            clock.lap_of(Phase::Wait, self.team.threads);
        }
        Ok(())
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
        for r in rows.clone() {
            let b = self.team.order()[r];
            let t = self.order.time(b, s, self.reverse);
            for &v in exec.inputs().iter().chain(exec.outputs()) {
                table.push(locate(self.bufs, self.frame, v, b, t, r)?);
            }
        }
        // SAFETY: every pointer comes from `locate`, valid for its value's
        // length; this thread alone writes these ranks' outputs.
        unsafe { exec.run(rows.len(), table) };
        Ok(())
    }
}
