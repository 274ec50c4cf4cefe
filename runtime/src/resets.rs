//! Per-step resets: at a flagged step a sequence's state restarts from its
//! initial state before the step is computed (an episode that ends inside
//! a sequence, TorchRL's `is_init`).
//!
//! A batch with resets runs as its *segments*: each stretch of a sequence
//! from one reset to the next is a sequence of its own, read and written
//! where its steps lie in the caller's buffers
//! ([`RowLayout::Segments`]). So every back end, layout and direction
//! computes resets without knowing of them, and the reverse direction of a
//! bidirectional layer runs each segment from its own last step. The
//! driver maps the states:
//!
//! - each segment starts from its sequence's initial state;
//! - a sequence's final state is its last segment's;
//! - the adjoint of a sequence's initial state is the **sum** of its
//!   segments' initial-state adjoints: the first segment's, and one for
//!   each reset, since each restarts from that same state. The adjoint
//!   that would flow from a reset step back into the step before it is
//!   cut there, as the forward cuts the state.
//!
//! Masks and the dropout between layers are drawn by the caller's
//! sequence and step (they are filled over the caller's layout), so
//! resets change none of them. A reset at a sequence's first step, or at
//! padding, changes nothing.

use crate::error::Result;
use crate::sequence::{check_len, BatchOrder, LaidOutBatch, Major, RowLayout, Segments};

impl LaidOutBatch {
    /// The batch with per-step resets: one flag per layout row (a padded
    /// batch's `[B, T]` or `[T, B]`, as its input; a packed batch's `[N]`
    /// rows), `true` where the state restarts before that step.
    pub(crate) fn with_resets(mut self, resets: Option<&[bool]>) -> Result<LaidOutBatch> {
        let Some(resets) = resets else { return Ok(self) };
        let shape = match &self.layout {
            RowLayout::Padded { batch, steps, major: Major::BatchFirst, .. } => vec![*batch, *steps],
            RowLayout::Padded { batch, steps, major: Major::TimeFirst, .. } => vec![*steps, *batch],
            _ => vec![self.rows],
        };
        check_len("resets", resets.len(), &shape)?;
        let (mut start, mut lengths, mut sequence) = (Vec::new(), Vec::new(), Vec::new());
        let mut rounds: Vec<Vec<(usize, usize)>> = Vec::new();
        let mut last = Vec::with_capacity(self.order.batch());
        for (b, &len) in self.order.lengths().iter().enumerate() {
            let (mut first, mut k) = (0, 0);
            for t in 1..=len {
                if t == len || resets[self.layout.row(b, t)] {
                    if rounds.len() == k {
                        rounds.push(Vec::new());
                    }
                    rounds[k].push((b, start.len()));
                    k += 1;
                    start.push((b, first));
                    lengths.push(t - first);
                    sequence.push(b);
                    first = t;
                }
            }
            last.push(start.len() - 1);
        }
        if start.len() == self.order.batch() {
            return Ok(self);
        }
        let order = BatchOrder::new(&lengths, self.order.steps())?;
        let layout = RowLayout::Segments { start, within: Box::new(self.layout.clone()) };
        let batch = LaidOutBatch {
            order,
            layout,
            rows: self.rows,
            data_features: self.data_features,
            segments: None,
        };
        self.segments = Some(Box::new(Segments { batch, sequence, last, rounds }));
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sequence::Align;

    fn batch(lengths: &[usize], steps: usize, major: Major, align: Align) -> LaidOutBatch {
        let order = BatchOrder::new(lengths, steps).unwrap();
        let layout = RowLayout::padded(&order, steps, major, align);
        LaidOutBatch { order, layout, rows: lengths.len() * steps, data_features: 1, segments: None }
    }

    #[test]
    fn segments_lie_where_their_steps_do() {
        // Sequence 0 (length 4) resets at steps 2 and 3; sequence 1 (length
        // 2) at step 0 (no effect); the flag at sequence 1's padding is ignored.
        for (major, align) in [(Major::BatchFirst, Align::Left), (Major::TimeFirst, Align::Right)] {
            let p = batch(&[4, 2], 4, major, align);
            let mut resets = vec![false; 8];
            for (b, t) in [(0, 2), (0, 3), (1, 0)] {
                resets[p.layout.row(b, t)] = true;
            }
            let pad = (0..8).find(|&r| {
                (0..2).all(|t| p.layout.row(1, t) != r) && (0..4).all(|t| p.layout.row(0, t) != r)
            });
            resets[pad.unwrap()] = true;
            let within = p.layout.clone();
            let p = p.with_resets(Some(&resets)).unwrap();
            let s = p.segments.as_deref().unwrap();
            assert_eq!(s.batch.order.lengths(), &[2, 1, 1, 2]);
            assert_eq!((s.sequence.as_slice(), s.last.as_slice()), (&[0, 0, 0, 1][..], &[2, 3][..]));
            assert_eq!(s.rounds, vec![vec![(0, 0), (1, 3)], vec![(0, 1)], vec![(0, 2)]]);
            assert_eq!(s.batch.layout.row(1, 0), within.row(0, 2));
            assert_eq!(s.batch.layout.row(3, 1), within.row(1, 1));
        }
    }

    #[test]
    fn no_reset_inside_a_sequence_keeps_the_batch() {
        let p = batch(&[3, 1], 3, Major::BatchFirst, Align::Left);
        let mut resets = vec![false; 6];
        resets[0] = true; // step 0 of sequence 0
        assert!(p.with_resets(Some(&resets)).unwrap().segments.is_none());
    }

    #[test]
    fn resets_of_the_wrong_shape_are_named() {
        let p = batch(&[3, 1], 3, Major::TimeFirst, Align::Left);
        let e = p.with_resets(Some(&[false; 5])).unwrap_err().to_string();
        assert!(e.contains("resets") && e.contains("[3, 2]"), "{e}");
    }
}
