//! The CPU back end's threads: one team per process, shared by every
//! model, sized to the cores the process may use, safe across `fork`.
//!
//! A call runs through [`run_call`], which holds the team for the call
//! (a time loop's threads wait for each other, so two calls must not share
//! them) and makes it the calling thread's *current* team; the driver's
//! parallel work then goes through [`broadcast`] and [`for_each`], which
//! run on the current team (or on the calling thread alone when there is
//! none). The team is one of:
//!
//! - **cellc's own pool** (rayon): the default. Made on first use with one
//!   thread per usable core, and made anew in a process forked from the
//!   one that made it (a forked child has none of its parent's threads);
//! - **the process's OpenMP team** (the CPU back end's `openmp` module), chosen by
//!   [`use_openmp`]: inside PyTorch, cellc's regions then run on the very
//!   threads PyTorch's operators use, instead of beside them. Never in a
//!   forked child: GNU OpenMP's team does not survive `fork` (PyTorch's own
//!   operators hang there), so the child falls back to cellc's pool.
//!
//! The thread count of a call is capped by [`usable_cores`], the cores the
//! affinity mask and the cgroup's CPU quota grant: more threads than cores
//! only makes threads that wait for each other wait for a core too.

use super::openmp::{self, OpenMp};
use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// The cores this process may run on at once: the affinity mask, capped
/// by a cgroup CPU quota (what `std::thread::available_parallelism` reads),
/// read once per process: reading the quota opens cgroup files, which cost
/// a one-step call from Python a tenth of its time.
pub fn usable_cores() -> usize {
    static READ: Mutex<Option<(u32, usize)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut read = READ.lock().unwrap_or_else(|e| e.into_inner());
    match *read {
        Some((in_pid, cores)) if in_pid == pid => cores,
        _ => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            *read = Some((pid, cores));
            cores
        }
    }
}

/// Where the team's regions run.
#[derive(Clone)]
enum Runner {
    Pool(Arc<rayon::ThreadPool>),
    OpenMp(&'static OpenMp),
    /// No thread could be started: calls run on the caller's thread.
    Inline,
}

/// Which team calls run on, for this process (see [`use_openmp`]).
static OPENMP_FOR_PID: AtomicU32 = AtomicU32::new(0);

/// Runs this process's calls on the OpenMP runtime already loaded in it
/// (PyTorch's), if there is one; returns its library's path. A process
/// forked from this one goes back to cellc's own pool.
pub fn use_openmp() -> Option<&'static str> {
    let found = openmp::loaded()?;
    OPENMP_FOR_PID.store(std::process::id(), Ordering::Relaxed);
    Some(&found.library)
}

/// Runs calls on cellc's own pool again (undoes [`use_openmp`]).
pub fn use_own_pool() {
    OPENMP_FOR_PID.store(0, Ordering::Relaxed);
}

/// The name of the team this process's calls run on now: `"openmp"` or `"cellc"`.
pub fn team_name() -> &'static str {
    match runner() {
        Runner::OpenMp(_) => "openmp",
        Runner::Pool(_) | Runner::Inline => "cellc",
    }
}

fn runner() -> Runner {
    let pid = std::process::id();
    if OPENMP_FOR_PID.load(Ordering::Relaxed) == pid {
        if let Some(omp) = openmp::loaded() {
            return Runner::OpenMp(omp);
        }
    }
    own_pool().map_or(Runner::Inline, Runner::Pool)
}

/// cellc's pool for this process: made on first use, and again after a fork.
fn own_pool() -> Option<Arc<rayon::ThreadPool>> {
    static POOL: Mutex<Option<(u32, Arc<rayon::ThreadPool>)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut slot = POOL.lock().unwrap_or_else(|e| e.into_inner());
    match slot.as_ref() {
        Some((made_in, pool)) if *made_in == pid => return Some(pool.clone()),
        // The parent's pool: its threads do not exist here. Dropping it
        // would signal them; it is left alone instead.
        Some(_) => std::mem::forget(slot.take()),
        None => {}
    }
    let threads = usable_cores();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("cellc-cpu-{i}"))
        .build()
        .ok()
        .map(Arc::new)?;
    *slot = Some((pid, pool.clone()));
    Some(pool)
}

/// The lock that keeps calls from sharing the team.
static TEAM: Mutex<()> = Mutex::new(());

thread_local! {
    /// The most threads a call made on this thread uses ([`with_limit`]).
    static LIMIT: Cell<usize> = const { Cell::new(usize::MAX) };
    /// The team the calling thread's call runs on, and its thread count
    /// (for one thread, the runner is null: it is never used).
    static CURRENT: Cell<Option<(*const Runner, usize)>> = const { Cell::new(None) };
}

/// Resets [`CURRENT`] when a call ends, however it ends.
struct Current(Option<(*const Runner, usize)>);

impl Current {
    fn set(runner: &Runner, threads: usize) -> Current {
        Current(CURRENT.with(|c| c.replace(Some((runner as *const Runner, threads)))))
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
    }
}

/// Runs one call's `op(threads)` with the process's team as the current
/// team, no other call beside it, on at most `threads` threads (capped by
/// the team's size and [`usable_cores`]). A call made while the calling
/// thread is already inside one (a framework's operator run inside
/// [`install`], say) runs alone on that thread: the team may be waiting
/// for this very thread. Results do not depend on the thread count.
pub fn run_call<R: Send>(threads: usize, op: impl FnOnce(usize) -> R + Send) -> R {
    if CURRENT.with(Cell::get).is_some() {
        return inline(op);
    }
    let threads = threads.min(LIMIT.with(Cell::get)).clamp(1, usable_cores());
    if threads == 1 {
        // No team needed: no hand-off to another thread (7-10 µs, more if it sleeps).
        return inline(op);
    }
    let runner = runner();
    let on_own_pool = match &runner {
        Runner::OpenMp(omp) if omp.in_parallel() => return inline(op),
        Runner::OpenMp(_) => false,
        Runner::Pool(pool) => pool.current_thread_index().is_some(),
        Runner::Inline => return inline(op),
    };
    let _team = match TEAM.try_lock() {
        Ok(guard) => guard,
        Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        // The running call may be waiting for this very thread.
        Err(std::sync::TryLockError::WouldBlock) if on_own_pool => return inline(op),
        Err(std::sync::TryLockError::WouldBlock) => TEAM.lock().unwrap_or_else(|e| e.into_inner()),
    };
    match &runner {
        Runner::Pool(pool) => {
            let threads = threads.min(pool.current_num_threads());
            pool.install(|| {
                let _current = Current::set(&runner, threads);
                op(threads)
            })
        }
        _ => {
            let _current = Current::set(&runner, threads);
            op(threads)
        }
    }
}

/// Runs `op` with every call it makes on this thread using at most
/// `threads` threads (a framework's per-call thread setting, as
/// `torch.get_num_threads()`).
pub fn with_limit<R>(threads: usize, op: impl FnOnce() -> R) -> R {
    struct Reset(usize);
    impl Drop for Reset {
        fn drop(&mut self) {
            LIMIT.with(|l| l.set(self.0));
        }
    }
    let _reset = Reset(LIMIT.with(|l| l.replace(threads.max(1))));
    op()
}

/// A call run alone on the calling thread.
fn inline<R>(op: impl FnOnce(usize) -> R) -> R {
    let _current = Current(CURRENT.with(|c| c.replace(Some((std::ptr::null(), 1)))));
    op(1)
}

/// Runs `op` on cellc's own pool's threads (see `Cpu::install`).
pub fn install<R: Send>(op: impl FnOnce() -> R + Send) -> R {
    match own_pool() {
        Some(pool) => pool.install(op),
        None => op(),
    }
}

/// The current call's thread count (1 outside a call).
pub fn current_threads() -> usize {
    CURRENT.with(Cell::get).map_or(1, |(_, n)| n)
}

/// Runs `f(i)` for every `i < threads` at once, each on its own thread of
/// the current team (`threads` at most [`current_threads`]): the threads
/// may wait for each other. Outside a call, or for one thread, runs
/// `f(0)` on the calling thread.
pub fn broadcast(threads: usize, f: &(dyn Fn(usize) + Sync)) {
    let Some((runner, available)) = CURRENT.with(Cell::get) else { return f(0) };
    let threads = threads.min(available);
    if threads <= 1 {
        return f(0);
    }
    // SAFETY: the runner lives on the stack of `run_call`, which set it
    // and resets it before returning; this thread is inside that call.
    match unsafe { &*runner } {
        Runner::OpenMp(omp) => {
            if !omp.broadcast(threads, f) {
                // The runtime gave another team size: cellc's own pool, this once.
                match own_pool() {
                    Some(pool) => {
                        pool.broadcast(|ctx| region_share(ctx.index(), threads, f));
                    }
                    None => scoped_threads(threads, f),
                }
            }
        }
        Runner::Pool(pool) => {
            pool.broadcast(|ctx| region_share(ctx.index(), threads, f));
        }
        Runner::Inline => scoped_threads(threads, f),
    }
}

/// `f(i)` on `threads` threads started for the region: the last resort
/// when no team can run it (a region's threads may wait for each other,
/// so they cannot take turns on one thread).
fn scoped_threads(threads: usize, f: &(dyn Fn(usize) + Sync)) {
    std::thread::scope(|s| {
        for i in 1..threads {
            s.spawn(move || f(i));
        }
        f(0);
    });
}

/// Thread `index`'s part of a region of `threads`: `f(index)`, or nothing
/// for a thread of a larger pool.
fn region_share(index: usize, threads: usize, f: &(dyn Fn(usize) + Sync)) {
    if index < threads {
        f(index)
    }
}

/// Runs `f(task)` for every `task < tasks`, shared out between the
/// current call's threads as they come free: a thread that lost its core
/// for a while (a busy machine) leaves its share to the others instead of
/// holding them up.
pub fn for_each(tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    let Some((runner, available)) = CURRENT.with(Cell::get) else { return (0..tasks).for_each(f) };
    if available.min(tasks) <= 1 {
        return (0..tasks).for_each(f);
    }
    // SAFETY: as in `broadcast`.
    match unsafe { &*runner } {
        // Work stealing, from inside the pool (`run_call` installed it).
        Runner::Pool(pool) => pool.scope(|s| (0..tasks).for_each(|t| s.spawn(move |_| f(t)))),
        _ => {
            let next = std::sync::atomic::AtomicUsize::new(0);
            broadcast(available.min(tasks), &|_| loop {
                let t = next.fetch_add(1, Ordering::Relaxed);
                if t >= tasks {
                    break;
                }
                f(t);
            });
        }
    }
}

/// Runs `f(c, chunk)` for each `size`-float chunk `c` of `data` (the last
/// may be shorter), shared out as [`for_each`] shares tasks: the chunks
/// are disjoint, so each task writes its own.
pub fn for_each_chunk_mut(data: &mut [f32], size: usize, f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
    /// `data`'s address, read by every task.
    struct Base(*mut f32);
    // SAFETY: the tasks write disjoint chunks of the memory behind it.
    unsafe impl Sync for Base {}
    impl Base {
        fn get(&self) -> *mut f32 {
            self.0
        }
    }
    let (len, size) = (data.len(), size.max(1));
    let base = Base(data.as_mut_ptr());
    for_each(len.div_ceil(size), &|c| {
        let start = c * size;
        // SAFETY: chunk c is data[start..start + n], which no other task
        // touches; `data` stays borrowed mutably until every task is done.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), size.min(len - start)) };
        f(c, chunk)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn a_call_shares_its_tasks_between_its_threads() {
        let seen: Vec<AtomicUsize> = (0..10).map(|_| AtomicUsize::new(0)).collect();
        let threads = run_call(2, |threads| {
            for_each(10, &|t| {
                seen[t].fetch_add(1, Ordering::Relaxed);
            });
            threads
        });
        assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1), "every task once");
        assert_eq!(threads, 2.min(usable_cores()));
    }

    #[test]
    fn threads_are_capped_by_the_usable_cores() {
        let asked = usable_cores() * 4;
        let got = run_call(asked, |threads| threads);
        assert_eq!(got, usable_cores());
        let ran = AtomicUsize::new(0);
        run_call(asked, |threads| {
            broadcast(threads, &|_| {
                ran.fetch_add(1, Ordering::Relaxed);
            })
        });
        assert_eq!(ran.load(Ordering::Relaxed), usable_cores());
    }

    #[test]
    fn a_limit_caps_the_calls_made_under_it() {
        assert_eq!(with_limit(1, || run_call(8, |threads| threads)), 1);
        assert_eq!(run_call(8, |threads| threads), usable_cores(), "the limit ends with its scope");
    }

    #[test]
    fn a_call_inside_a_call_runs_on_its_own_thread() {
        let inner = run_call(2, |_| run_call(2, |threads| threads));
        assert_eq!(inner, 1);
        assert_eq!(current_threads(), 1, "the current team is reset after a call");
    }

    #[test]
    fn outside_a_call_work_runs_on_the_calling_thread() {
        let me = std::thread::current().id();
        broadcast(4, &|i| {
            assert_eq!(i, 0);
            assert_eq!(std::thread::current().id(), me);
        });
    }
}
