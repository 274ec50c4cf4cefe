//! The time loop on persistent threads: one parallel region per layer and
//! direction, not a fork and join per stage.
//!
//! Every thread of the back end's pool walks the time loop itself. How the
//! work of a step is shared out is decided once per call ([`Split`]):
//!
//! - **Rows** (enough sequences): each thread owns whole sequences and runs
//!   every stage of every step on them alone. Rows of an RNN step depend
//!   only on the same rows of the previous step, so the threads never meet:
//!   no barrier in the whole loop. Sequences are dealt to threads so that
//!   their total lengths balance, and each thread's sequences sit longest
//!   first in a segment of the rank-ordered buffers, so a step's active
//!   rows are a prefix of each segment and a product is one call.
//! - **Units** (few sequences, batch 1; or weights too large to stay in a
//!   core's L2 for the few rows each thread would own): each product's
//!   output columns are split between threads, always the same panels to
//!   the same thread (so each core keeps its share of the weight in its own
//!   L2), and the threads meet at a spinning barrier after each stage.
//!
//! Results do not depend on the split: every product adds its terms in the
//! same order whatever rows or columns a thread takes.

use crate::sequence::BatchOrder;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

/// Sequences per thread from which threads own rows rather than units.
const ROWS_PER_THREAD: usize = 4;

/// Bytes of the step's weights per sequence of a thread from which
/// threads split units rather than own rows, where those weights do not
/// stay in a core's L2: owning rows, every thread streams every weight
/// from L3 at every step for its few rows of work; splitting units, each
/// streams its share (its own panels, which may stay in its L2). Measured
/// on an Intel Xeon (2 MiB of L2), 2 threads, T=100, first quartile of
/// per-round minima, units against rows, by weight bytes a sequence of a
/// thread: LSTM H=1024 B=16 (2 MiB) 1.36x, B=64 (512 KiB) 1.29x; LSTM
/// H=512 B=8 (1 MiB) 1.48x, B=16 (512 KiB) 1.36x, B=32 (256 KiB) 1.14x
/// (training alike), B=64 (128 KiB) 1.06x, training 0.94x; GRU H=512 B=16
/// 1.21x; LayerNorm-LSTM H=512 B=16 1.22x; bf16 LSTM H=512 B=16 (256 KiB)
/// 1.49x. Where the weights stay in the L2 (LSTM H=256, 1 MiB), rows:
/// units 0.95x at B=32.
const UNITS_FROM_WEIGHT_BYTES_PER_ROW: usize = 256 << 10;

/// How a step's work is shared out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Rows,
    Units,
}

impl Split {
    /// Rows where each of `threads` gets [`ROWS_PER_THREAD`] of the `batch`'s
    /// sequences or more, unless the step's weights (`step_bytes`) do not
    /// stay in a core's L2 (of `l2` bytes, [`super::cache::stays_in_l2`])
    /// and come to [`UNITS_FROM_WEIGHT_BYTES_PER_ROW`] or more for each
    /// sequence a thread would own; units otherwise.
    pub fn choose(batch: usize, threads: usize, (step_bytes, l2): (usize, Option<usize>)) -> Split {
        let rows_per_thread = (batch / threads.max(1)).max(1);
        let streamed = super::cache::stays_in_l2(step_bytes, l2) == Some(false)
            && step_bytes / rows_per_thread >= UNITS_FROM_WEIGHT_BYTES_PER_ROW;
        if threads > 1 && batch >= ROWS_PER_THREAD * threads && !streamed {
            Split::Rows
        } else {
            Split::Units
        }
    }
}

/// The threads' shares of a batch.
#[derive(Debug)]
pub struct Team {
    pub threads: usize,
    pub split: Split,
    /// Rank → sequence: thread-major segments (rows), or the batch order (units).
    order: Vec<usize>,
    /// Each rank's sequence length.
    lengths: Vec<usize>,
    /// Each thread's segment of ranks (rows); one segment of every rank (units).
    segments: Vec<Range<usize>>,
}

impl Team {
    /// The team of `threads` for `batch`, whose step reads `step_bytes` of
    /// weights ([`Split::choose`], with this processor's L2).
    pub fn new(batch: &BatchOrder, threads: usize, step_bytes: usize) -> Team {
        let threads = threads.max(1);
        let split = Split::choose(batch.batch(), threads, (step_bytes, super::cache::l2_bytes()));
        Team::with_split(batch, threads, split)
    }

    pub fn with_split(batch: &BatchOrder, threads: usize, split: Split) -> Team {
        let threads = threads.max(1);
        let ranked = batch.order();
        let (order, segments) = match split {
            Split::Units => (ranked.to_vec(), std::iter::once(0..ranked.len()).collect()),
            Split::Rows => {
                // Longest first to the thread with the least work so far.
                let mut dealt: Vec<Vec<usize>> = vec![Vec::new(); threads];
                let mut work = vec![0usize; threads];
                for &b in ranked {
                    let t = (0..threads).min_by_key(|&t| (work[t], t)).unwrap_or(0);
                    work[t] += batch.lengths()[b].max(1);
                    dealt[t].push(b);
                }
                let mut order = Vec::with_capacity(ranked.len());
                let mut segments = Vec::with_capacity(threads);
                for d in dealt {
                    segments.push(order.len()..order.len() + d.len());
                    order.extend(d);
                }
                (order, segments)
            }
        };
        let lengths = order.iter().map(|&b| batch.lengths()[b]).collect();
        Team { threads, split, order, lengths, segments }
    }

    /// Whether each thread owns whole sequences for the whole loop, and so
    /// never meets the others. One thread owns every sequence.
    pub fn owns_rows(&self) -> bool {
        self.split == Split::Rows || self.threads == 1
    }

    /// Rank → sequence.
    pub fn order(&self) -> &[usize] {
        &self.order
    }

    /// Whether, at every step, the ranks each thread's products run on lie
    /// evenly spaced at the layout's rows (`row(rank, step)`): then a
    /// product may read a value kept at the layout's rows in place, one
    /// row stride apart. A batch of equal lengths is so at every layout;
    /// one of unsorted lengths, padded, is not.
    pub fn products_read_evenly(&self, steps: usize, row: impl Fn(usize, usize) -> usize) -> bool {
        (0..steps).all(|s| {
            (0..self.threads).all(|i| {
                let rows: Vec<usize> = self.product_rows(i, s).map(|r| row(r, s)).collect();
                rows.windows(2).all(|w| w[1] > w[0] && w[1] - w[0] == rows[1] - rows[0])
            })
        })
    }

    /// Per-sequence rows (`[B, size]` each, sequence `b`'s at row `b`) in
    /// rank order: the states a loop carries, or their adjoints.
    pub fn by_rank(&self, rows: &[&[f32]], sizes: &[usize]) -> Vec<Vec<f32>> {
        let ranked = |(i, &n): (usize, &usize)| {
            self.order.iter().flat_map(|&b| rows[i][b * n..(b + 1) * n].iter().copied()).collect()
        };
        sizes.iter().enumerate().map(ranked).collect()
    }

    /// The ranks active at step `s` (a sequence of length `l` runs steps `0..l`).
    fn active(&self, segment: &Range<usize>, s: usize) -> Range<usize> {
        let n = self.lengths[segment.clone()].partition_point(|&l| l > s);
        segment.start..segment.start + n
    }

    /// The rows thread `i` runs a row-wise stage on at step `s`.
    pub fn rows(&self, i: usize, s: usize) -> Range<usize> {
        match self.split {
            Split::Rows => self.segments.get(i).map_or(0..0, |seg| self.active(seg, s)),
            Split::Units => {
                let all = self.active(&self.segments[0], s);
                let n = all.len();
                n * i / self.threads..n * (i + 1) / self.threads
            }
        }
    }

    /// The rows a product runs on at step `s` for thread `i`: its own rows
    /// (rows), or every active row (units, which splits columns instead).
    pub fn product_rows(&self, i: usize, s: usize) -> Range<usize> {
        match self.split {
            Split::Rows => self.rows(i, s),
            Split::Units => self.active(&self.segments[0], s),
        }
    }
}

/// A barrier for a region's threads. A waiting thread spins while the
/// wait is short (a fraction of a microsecond when every thread has a
/// core), then yields its core for up to a few time slices (the thread it
/// waits for may be the one that needs it: measured with a busy loop on the
/// other core, sleeping instead made a B=1 LSTM 3x slower), then sleeps in
/// the kernel until the last thread arrives, so that threads waiting for
/// one that is stopped burn no core. Once a thread calls
/// [`Barrier::abort`], every wait returns `false` and the threads leave
/// the loop together.
pub struct Barrier {
    threads: usize,
    arrived: AtomicUsize,
    /// Bumped when a round is released; sleepers wait on it.
    generation: AtomicU32,
    /// Threads asleep (or about to be) on `generation`.
    sleepers: AtomicUsize,
    aborted: AtomicBool,
    /// Whether the loop was aborted when round `g` was released, at `g % 2`:
    /// a thread released late must not see an abort of the next round.
    released_aborted: [AtomicBool; 2],
}

/// Spins before a waiting thread yields its core: about 20 µs.
const SPINS: u32 = 2000;
/// How long it yields before it sleeps: longer than a time slice of the
/// scheduler (waits of 2-20 ms were seen with a busy loop beside).
const YIELD_FOR: std::time::Duration = std::time::Duration::from_millis(20);

impl Barrier {
    pub fn new(threads: usize) -> Barrier {
        Barrier {
            threads,
            arrived: AtomicUsize::new(0),
            generation: AtomicU32::new(0),
            sleepers: AtomicUsize::new(0),
            aborted: AtomicBool::new(false),
            released_aborted: [AtomicBool::new(false), AtomicBool::new(false)],
        }
    }

    /// Waits for every thread; `false` once the loop was aborted.
    pub fn wait(&self) -> bool {
        if self.threads == 1 {
            return !self.aborted.load(Ordering::Acquire);
        }
        let generation = self.generation.load(Ordering::Acquire);
        let verdict = &self.released_aborted[generation as usize % 2];
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.threads {
            verdict.store(self.aborted.load(Ordering::Acquire), Ordering::Relaxed);
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::SeqCst);
            if self.sleepers.load(Ordering::SeqCst) > 0 {
                wake_all(&self.generation);
            }
        } else {
            self.wait_for_release(generation);
        }
        !verdict.load(Ordering::Relaxed)
    }

    fn wait_for_release(&self, generation: u32) {
        for _ in 0..SPINS {
            if self.generation.load(Ordering::Acquire) != generation {
                return;
            }
            std::hint::spin_loop();
        }
        // Then hand the core to whatever else wants it, still runnable: a
        // thread woken from sleep has to win a core back from whatever took it.
        let yielding = std::time::Instant::now();
        while yielding.elapsed() < YIELD_FOR {
            if self.generation.load(Ordering::Acquire) != generation {
                return;
            }
            std::thread::yield_now();
        }
        while self.generation.load(Ordering::Acquire) == generation {
            // Counted before the last look, so the releaser either sees a
            // sleeper or this thread sees the new generation.
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            if self.generation.load(Ordering::SeqCst) == generation {
                sleep_while(&self.generation, generation);
            }
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }

    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
    }
}

/// Sleeps while `word` holds `value` (or until a wake-up; callers look again).
#[cfg(target_os = "linux")]
fn sleep_while(word: &AtomicU32, value: u32) {
    // SAFETY: FUTEX_WAIT on a live, aligned 32-bit word; it returns at
    // once if the word no longer holds `value`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            value,
            std::ptr::null::<libc::timespec>(),
        )
    };
}

/// Wakes every thread sleeping on `word`.
#[cfg(target_os = "linux")]
fn wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live, aligned 32-bit word.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, i32::MAX)
    };
}

#[cfg(not(target_os = "linux"))]
fn sleep_while(word: &AtomicU32, value: u32) {
    if word.load(Ordering::Acquire) == value {
        std::thread::yield_now();
    }
}

#[cfg(not(target_os = "linux"))]
fn wake_all(_: &AtomicU32) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_dealt_to_balance_lengths_and_stay_longest_first() {
        let order = BatchOrder::new(&[5, 9, 2, 7, 7, 3, 8, 1], 9).unwrap();
        let team = Team::with_split(&order, 2, Split::Rows);
        let mut seen: Vec<usize> = team.order().to_vec();
        seen.sort();
        assert_eq!(seen, (0..8).collect::<Vec<_>>(), "every sequence once");
        let work: Vec<usize> =
            team.segments.iter().map(|s| team.lengths[s.clone()].iter().sum::<usize>()).collect();
        assert!(work[0].abs_diff(work[1]) <= 2, "{work:?}");
        for seg in &team.segments {
            assert!(team.lengths[seg.clone()].windows(2).all(|w| w[0] >= w[1]));
        }
        // Step 6: sequences of length 7, 7, 8, 9 are active.
        let active: usize = (0..2).map(|i| team.rows(i, 6).len()).sum();
        assert_eq!(active, 4);
    }

    #[test]
    fn threads_split_units_where_the_weights_would_be_streamed_for_few_rows() {
        const MIB: usize = 1 << 20;
        let xeon = Some(2 * MIB);
        let lstm = |h: usize| 4 * h * h * 4; // the recurrent weight, f32
        assert_eq!(Split::choose(16, 2, (lstm(256), xeon)), Split::Rows, "1 MiB stays in 2 MiB of L2");
        assert_eq!(Split::choose(16, 2, (lstm(512), None)), Split::Rows, "an unknown L2 keeps the default");
        assert_eq!(Split::choose(16, 2, (lstm(512), xeon)), Split::Units);
        assert_eq!(Split::choose(32, 2, (lstm(512), xeon)), Split::Units);
        assert_eq!(Split::choose(64, 2, (lstm(512), xeon)), Split::Rows, "rows enough to reuse the weight");
        assert_eq!(Split::choose(64, 2, (lstm(1024), xeon)), Split::Units);
        assert_eq!(Split::choose(7, 2, (lstm(64), xeon)), Split::Units, "too few sequences to share out");
        assert_eq!(
            Split::choose(64, 1, (lstm(64), xeon)),
            Split::Units,
            "one thread: its rows and units are all"
        );
    }

    #[test]
    fn units_share_rows_and_products_see_all() {
        let order = BatchOrder::new(&[3, 1, 2], 3).unwrap();
        let team = Team::with_split(&order, 2, Split::Units);
        assert_eq!(team.product_rows(1, 1), 0..2);
        assert_eq!((team.rows(0, 1), team.rows(1, 1)), (0..1, 1..2));
        assert_eq!((team.rows(0, 2), team.rows(1, 2)), (0..0, 0..1));
    }

    #[test]
    fn the_barrier_releases_every_round_and_aborts_together() {
        let b = Barrier::new(3);
        let rounds = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..3 {
                let (b, rounds) = (&b, &rounds);
                s.spawn(move || {
                    for r in 0..100 {
                        if t == 0 && r == 50 {
                            b.abort();
                        }
                        if !b.wait() {
                            break;
                        }
                        rounds.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        });
        assert_eq!(rounds.load(Ordering::Relaxed), 150, "every thread stops at the aborted round");
    }

    #[test]
    fn the_barrier_makes_progress_with_more_threads_than_cores() {
        // Four times as many threads as cores, each meeting the others
        // 2000 times: spinning threads would starve the ones they wait for.
        let threads = 4 * std::thread::available_parallelism().map_or(1, |n| n.get());
        let b = Barrier::new(threads);
        let start = std::time::Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                let b = &b;
                s.spawn(move || (0..2000).all(|_| b.wait()));
            }
        });
        let took = start.elapsed();
        assert!(took < std::time::Duration::from_secs(10), "{took:?} for 2000 rounds of {threads} threads");
    }
}
