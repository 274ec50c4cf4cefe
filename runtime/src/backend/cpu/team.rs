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
//! - **Units** (few sequences, batch 1): each product's output columns are
//!   split between threads, always the same panels to the same thread (so
//!   each core keeps its share of the weight in its own L2), and the
//!   threads meet at a spinning barrier after each stage.
//!
//! Results do not depend on the split: every product adds its terms in the
//! same order whatever rows or columns a thread takes.

use crate::sequence::BatchOrder;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Sequences per thread from which threads own rows rather than units.
const ROWS_PER_THREAD: usize = 4;

/// How a step's work is shared out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Rows,
    Units,
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
    pub fn new(batch: &BatchOrder, threads: usize) -> Team {
        let threads = threads.max(1);
        let split = if threads > 1 && batch.batch() >= ROWS_PER_THREAD * threads {
            Split::Rows
        } else {
            Split::Units
        };
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

    /// Rank → sequence.
    pub fn order(&self) -> &[usize] {
        &self.order
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

/// A barrier for the pool's threads: spins (the wait is a fraction of a
/// microsecond when both cores are ours), then yields, so that an
/// oversubscribed machine still makes progress. Once a thread calls
/// [`Barrier::abort`], every wait returns `false` and the threads leave
/// the loop together.
pub struct Barrier {
    threads: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
    aborted: AtomicBool,
    /// Whether the loop was aborted when round `g` was released, at `g % 2`:
    /// a thread released late must not see an abort of the next round.
    released_aborted: [AtomicBool; 2],
}

impl Barrier {
    pub fn new(threads: usize) -> Barrier {
        Barrier {
            threads,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
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
        let verdict = &self.released_aborted[generation % 2];
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.threads {
            verdict.store(self.aborted.load(Ordering::Acquire), Ordering::Relaxed);
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
        } else {
            let mut spins = 0u32;
            while self.generation.load(Ordering::Acquire) == generation {
                if spins < 4000 {
                    std::hint::spin_loop();
                    spins += 1;
                } else {
                    std::thread::yield_now();
                }
            }
        }
        !verdict.load(Ordering::Relaxed)
    }

    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
    }
}

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
}
