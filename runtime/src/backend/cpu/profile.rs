//! Where a CPU pass's time goes, phase by phase, when asked
//! (`cellc bench --profile`): placing values and preparing weights, the
//! stages before the loop, in the loop its products, its pointwise
//! kernels, its waits at the team's barrier and each step's bookkeeping
//! (outputs, tape rows, next states), a whole-sequence kernel, and what
//! runs after the loop. The loop's threads each add their share, so every
//! phase adds up to wall time; off (the default), a phase costs one
//! relaxed load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The phases of a pass, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Buffers placed, states ordered, weights packed.
    Setup,
    /// The stages over every row before the loop.
    BeforeLoop,
    /// The loop's per-step products.
    Products,
    /// The loop's pointwise kernels.
    Pointwise,
    /// Waiting at the team's barrier inside the loop.
    Wait,
    /// Each step's outputs, tape rows and next states.
    Bookkeeping,
    /// A whole-sequence kernel (the loop in one call).
    WholeSequence,
    /// The stages and gradients after the loop.
    AfterLoop,
}

impl Phase {
    /// Every phase, in order.
    pub const ALL: [Phase; 8] = [
        Phase::Setup,
        Phase::BeforeLoop,
        Phase::Products,
        Phase::Pointwise,
        Phase::Wait,
        Phase::Bookkeeping,
        Phase::WholeSequence,
        Phase::AfterLoop,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::BeforeLoop => "before the loop",
            Phase::Products => "loop: products",
            Phase::Pointwise => "loop: pointwise",
            Phase::Wait => "loop: barrier waits",
            Phase::Bookkeeping => "loop: bookkeeping",
            Phase::WholeSequence => "loop: whole-sequence kernel",
            Phase::AfterLoop => "after the loop",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];

/// Turns profiling on or off for the whole process.
pub fn enable(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Whether passes are profiled.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The thread-seconds each phase took since the last call, and zero again.
pub fn take() -> Vec<(Phase, f64)> {
    Phase::ALL.iter().map(|&p| (p, NANOS[p as usize].swap(0, Ordering::Relaxed) as f64 * 1e-9)).collect()
}

/// Adds `nanos` nanoseconds to `phase`.
pub fn add(phase: Phase, nanos: u64) {
    NANOS[phase as usize].fetch_add(nanos, Ordering::Relaxed);
}

/// A clock for one phase: started if profiling is on, adding its time when stopped.
#[derive(Debug)]
pub struct Clock(Option<Instant>);

impl Clock {
    /// Starts timing (a no-op when profiling is off).
    pub fn start() -> Clock {
        Clock(enabled().then(Instant::now))
    }

    /// Adds the time since the start to `phase`, and starts again.
    pub fn lap(&mut self, phase: Phase) {
        self.lap_of(phase, 1);
    }

    /// As [`Clock::lap`], for one of `threads` threads timing the same
    /// phase at once: its share, so that the phase adds up to its wall time.
    pub fn lap_of(&mut self, phase: Phase, threads: usize) {
        if let Some(t) = self.0 {
            let now = Instant::now();
            add(phase, (now - t).as_nanos() as u64 / threads.max(1) as u64);
            self.0 = Some(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_add_up_only_while_profiling_is_on() {
        // The only test of this module: the switch is the process's.
        enable(false);
        let mut off = Clock::start();
        off.lap(Phase::Setup);
        assert!(take().iter().all(|&(_, s)| s == 0.0));
        enable(true);
        let mut on = Clock::start();
        std::thread::sleep(std::time::Duration::from_millis(2));
        on.lap(Phase::Products);
        enable(false);
        let taken = take();
        let products = taken.iter().find(|(p, _)| *p == Phase::Products).expect("a phase").1;
        assert!(products >= 0.002, "{taken:?}");
    }
}
