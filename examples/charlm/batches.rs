//! Padded batches of variable-length sequences, and the order training
//! visits them in.
//!
//! A [`Batch`] is `[B, T]` token ids, batch-first, each row padded at its
//! end to the longest sequence, with the real lengths beside: the layout the
//! runtime's `Input::Padded` reads as it is. Rows are in no particular
//! order; the runtime sorts only the lengths.
//!
//! Training batches are bucketed ([`Epochs`]): each epoch shuffles the
//! sequences, sorts windows of [`BUCKET`] batches' worth by length and cuts
//! them into batches, so that a batch holds sequences of similar lengths
//! (little padding, and few steps where only a handful of rows still run),
//! then shuffles the batches, and the rows within each.

use crate::text::Sequence;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// Batches sorted together in one window of a training epoch.
pub const BUCKET: usize = 16;

/// Sequences padded to a common number of steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// `[B, T]` input ids (0 at padding).
    pub inputs: Vec<u32>,
    /// `[B, T]` target ids (0 at padding).
    pub targets: Vec<u32>,
    /// Each row's real length, in `1..=steps`.
    pub lengths: Vec<usize>,
    /// `T`: the longest length.
    pub steps: usize,
    /// Each row's index in the sequences the batch was drawn from.
    pub ids: Vec<usize>,
}

impl Batch {
    /// The batch of `all[ids[0]], all[ids[1]], ...`.
    pub fn of(all: &[Sequence], ids: &[usize]) -> Batch {
        let rows: Vec<&Sequence> = ids.iter().map(|&i| &all[i]).collect();
        Batch { ids: ids.to_vec(), ..Batch::new(&rows) }
    }

    /// Rows `sequences` (their ids: `0..B`).
    pub fn new(sequences: &[&Sequence]) -> Batch {
        let steps = sequences.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut inputs = vec![0; sequences.len() * steps];
        let mut targets = vec![0; sequences.len() * steps];
        for (b, s) in sequences.iter().enumerate() {
            inputs[b * steps..b * steps + s.len()].copy_from_slice(s.inputs());
            targets[b * steps..b * steps + s.len()].copy_from_slice(s.targets());
        }
        let lengths = sequences.iter().map(|s| s.len()).collect();
        Batch { inputs, targets, lengths, steps, ids: (0..sequences.len()).collect() }
    }

    /// `B`: the number of sequences.
    pub fn size(&self) -> usize {
        self.lengths.len()
    }

    /// Characters to predict: the sum of the lengths.
    pub fn tokens(&self) -> usize {
        self.lengths.iter().sum()
    }

    /// Indices `b * T + t` of the real positions (`t < lengths[b]`), row by row.
    pub fn real_rows(&self) -> Vec<usize> {
        let mut rows = Vec::with_capacity(self.tokens());
        for (b, &n) in self.lengths.iter().enumerate() {
            rows.extend(b * self.steps..b * self.steps + n);
        }
        rows
    }
}

/// Fixed batches for evaluation: sorted by length (little padding), in order.
pub fn in_order(sequences: &[Sequence], batch_size: usize) -> Vec<Batch> {
    let mut sorted: Vec<usize> = (0..sequences.len()).collect();
    sorted.sort_by_key(|&i| std::cmp::Reverse(sequences[i].len()));
    sorted.chunks(batch_size.max(1)).map(|ids| Batch::of(sequences, ids)).collect()
}

/// An endless stream of bucketed training batches, epoch after epoch.
#[derive(Debug)]
pub struct Epochs<'a> {
    sequences: &'a [Sequence],
    batch_size: usize,
    rng: ChaCha8Rng,
    pending: Vec<Batch>,
    /// Epochs started so far.
    pub epoch: usize,
}

impl<'a> Epochs<'a> {
    pub fn new(sequences: &'a [Sequence], batch_size: usize, rng: ChaCha8Rng) -> Epochs<'a> {
        Epochs { sequences, batch_size: batch_size.max(1), rng, pending: Vec::new(), epoch: 0 }
    }

    fn refill(&mut self) {
        let mut order: Vec<usize> = (0..self.sequences.len()).collect();
        order.shuffle(&mut self.rng);
        let mut batches = Vec::new();
        for window in order.chunks_mut(self.batch_size * BUCKET) {
            window.sort_by_key(|&i| self.sequences[i].len());
            for rows in window.chunks_mut(self.batch_size) {
                rows.shuffle(&mut self.rng);
                batches.push(Batch::of(self.sequences, rows));
            }
        }
        batches.shuffle(&mut self.rng);
        // Popped from the end.
        batches.reverse();
        self.pending = batches;
        self.epoch += 1;
    }
}

impl Iterator for Epochs<'_> {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        if self.pending.is_empty() {
            if self.sequences.is_empty() {
                return None;
            }
            self.refill();
        }
        self.pending.pop()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::Corpus;
    use rand::SeedableRng;

    #[test]
    fn padded_batch_keeps_each_length() {
        let corpus = Corpus::from_text("abc\nx\nab\ny\n", None, 2).expect("corpus");
        let rows: Vec<&Sequence> = corpus.train.iter().collect();
        let batch = Batch::new(&rows);
        assert_eq!(batch.lengths, [4, 3]);
        assert_eq!(batch.steps, 4);
        assert_eq!(batch.tokens(), 7);
        assert_eq!(batch.real_rows(), [0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(corpus.vocab.decode(&batch.inputs[4..7]), "\nab");
        assert_eq!(batch.inputs[7], 0);
    }

    #[test]
    fn an_epoch_visits_every_sequence_once() {
        let text: String = (0..100).map(|i| "a".repeat(1 + i % 17) + "\n").collect();
        let corpus = Corpus::from_text(&text, None, 10).expect("corpus");
        let mut epochs = Epochs::new(&corpus.train, 8, ChaCha8Rng::seed_from_u64(1));
        let first: Vec<Batch> = epochs.by_ref().take(12).collect();
        assert_eq!(epochs.epoch, 1);
        assert_eq!(first.iter().map(Batch::size).sum::<usize>(), 90);
        assert_eq!(first.iter().map(Batch::tokens).sum::<usize>(), corpus.train_steps());
        assert!(epochs.next().is_some());
        assert_eq!(epochs.epoch, 2);
    }
}
