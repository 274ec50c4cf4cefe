//! Variable-length batches: PyTorch's packed sequences, and padded batches
//! run directly, without sorting or copying the data.
//!
//! Only the *lengths* are sorted: a [`BatchOrder`] holds the sequences in
//! order of decreasing length, so at step `s` the active sequences are a
//! prefix of that order (`batch_sizes[s]` of them). Where a sequence's
//! step lives in the caller's buffer is a [`RowLayout`]: padded batch-first
//! or time-first, padding at the end (left-aligned) or at the start
//! (right-aligned), or packed. Kernels gather and scatter rows through it,
//! so padded positions are never read, written or computed.

use crate::error::{Result, RuntimeError};

/// Where the padding of a padded batch is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Align {
    /// Each sequence starts at step 0; padding at the end (PyTorch's convention).
    #[default]
    Left,
    /// Each sequence ends at the last step; padding at the start.
    Right,
}

/// The axis order of a padded batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Major {
    /// `[B, T, F]`
    #[default]
    BatchFirst,
    /// `[T, B, F]`
    TimeFirst,
}

/// The order in which sequences are processed, and how many are active per step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchOrder {
    lengths: Vec<usize>,
    /// Sequence indices by decreasing length (stable: ties keep their order).
    order: Vec<usize>,
    /// `rank[b]`: position of sequence `b` in `order`.
    rank: Vec<usize>,
    /// Active sequences at each step.
    batch_sizes: Vec<usize>,
}

/// The time of the step before time `t` in a pass's direction, for a step
/// that is not its sequence's first: `t - 1`, or `t + 1` in reverse.
pub fn time_before(t: usize, reverse: bool) -> usize {
    if reverse {
        t + 1
    } else {
        t - 1
    }
}

/// A padded batch's lengths as a framework gives them, signed (`None`:
/// every one of the `batch` sequences runs all `steps` steps); a negative
/// one is the runtime's length error. The range `1..=steps` is checked
/// where the batch is laid out.
pub fn lengths_from_i64(values: Option<&[i64]>, batch: usize, steps: usize) -> crate::Result<Vec<usize>> {
    match values {
        None => Ok(vec![steps; batch]),
        Some(values) => values
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                usize::try_from(v).map_err(|_| crate::RuntimeError::Length { sequence: i, length: v, steps })
            })
            .collect(),
    }
}

impl BatchOrder {
    /// Plans a batch; `steps` is the padded length (every length must be in `1..=steps`).
    pub fn new(lengths: &[usize], steps: usize) -> Result<BatchOrder> {
        for (b, &l) in lengths.iter().enumerate() {
            if l == 0 || l > steps {
                return Err(RuntimeError::Length { sequence: b, length: l as i64, steps });
            }
        }
        let mut order: Vec<usize> = (0..lengths.len()).collect();
        order.sort_by_key(|&b| std::cmp::Reverse(lengths[b]));
        let mut rank = vec![0; lengths.len()];
        for (r, &b) in order.iter().enumerate() {
            rank[b] = r;
        }
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let batch_sizes = (0..longest).map(|s| lengths.iter().filter(|&&l| l > s).count()).collect();
        Ok(BatchOrder { lengths: lengths.to_vec(), order, rank, batch_sizes })
    }

    /// Sequences in the batch, `B`.
    pub fn batch(&self) -> usize {
        self.lengths.len()
    }

    /// Each sequence's length, in the caller's order.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// Steps of the longest sequence.
    pub fn steps(&self) -> usize {
        self.batch_sizes.len()
    }

    /// Active sequences at each step, non-increasing (PyTorch's `batch_sizes`).
    pub fn batch_sizes(&self) -> &[usize] {
        &self.batch_sizes
    }

    /// Sequences by decreasing length.
    pub fn order(&self) -> &[usize] {
        &self.order
    }

    /// The sequences active at step `s`.
    pub fn active(&self, s: usize) -> &[usize] {
        &self.order[..self.batch_sizes.get(s).copied().unwrap_or(0)]
    }

    /// The time index sequence `b` is at on step `s` of a direction: `s`
    /// forwards, `len - 1 - s` in reverse (each sequence starts at its own end).
    pub fn time(&self, b: usize, s: usize, reverse: bool) -> usize {
        if reverse {
            self.lengths[b] - 1 - s
        } else {
            s
        }
    }

    /// The time of the step before time `t` of sequence `b` in the pass's
    /// direction (`t + 1` in reverse), or `None` at the sequence's first
    /// step, which reads the initial state.
    pub fn previous(&self, b: usize, t: usize, reverse: bool) -> Option<usize> {
        let first = if reverse { t + 1 == self.lengths[b] } else { t == 0 };
        (!first).then(|| time_before(t, reverse))
    }

    /// Total rows (sum of lengths).
    pub fn rows(&self) -> usize {
        self.lengths.iter().sum()
    }
}

/// Where row `(sequence b, time t)` is in a flat buffer of rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowLayout {
    /// A padded `[B, T]` or `[T, B]` grid; `shift[b]` is where sequence `b` starts on the time axis.
    Padded {
        /// Sequences, `B`.
        batch: usize,
        /// Padded steps, `T`.
        steps: usize,
        /// Which axis comes first.
        major: Major,
        /// Per sequence: its first step's index on the time axis (0 unless right-aligned).
        shift: Vec<usize>,
    },
    /// PyTorch packing: step `t`'s rows start at `step_offsets[t]`, in the plan's order.
    Packed {
        /// Per step: the row its active sequences start at.
        step_offsets: Vec<usize>,
        /// Per sequence: its position among each step's rows (its rank by decreasing length).
        rank: Vec<usize>,
    },
    /// The segments of another layout's sequences, each a sequence of its
    /// own (a batch with per-step resets, [`crate::resets`]): segment `j`'s
    /// step `t` is step `start[j].1 + t` of sequence `start[j].0` below.
    Segments {
        /// Per segment: its sequence and its first step, in `within`.
        start: Vec<(usize, usize)>,
        /// The caller's layout.
        within: Box<RowLayout>,
    },
}

impl RowLayout {
    /// The layout of a padded batch with these lengths.
    pub fn padded(order: &BatchOrder, steps: usize, major: Major, align: Align) -> RowLayout {
        let shift =
            order.lengths.iter().map(|&l| if align == Align::Right { steps - l } else { 0 }).collect();
        RowLayout::Padded { batch: order.batch(), steps, major, shift }
    }

    /// The layout of a packed sequence in this order.
    pub fn packed(order: &BatchOrder) -> RowLayout {
        let mut step_offsets = Vec::with_capacity(order.steps());
        let mut at = 0;
        for &n in &order.batch_sizes {
            step_offsets.push(at);
            at += n;
        }
        RowLayout::Packed { step_offsets, rank: order.rank.clone() }
    }

    /// Row index of `(b, t)`.
    pub fn row(&self, b: usize, t: usize) -> usize {
        match self {
            RowLayout::Padded { steps, major: Major::BatchFirst, shift, .. } => b * steps + t + shift[b],
            RowLayout::Padded { batch, major: Major::TimeFirst, shift, .. } => (t + shift[b]) * batch + b,
            RowLayout::Packed { step_offsets, rank } => step_offsets[t] + rank[b],
            RowLayout::Segments { start, within } => {
                let (sequence, first) = start[b];
                within.row(sequence, first + t)
            }
        }
    }
}

/// A call's batch, checked and laid out: its order by length and where
/// each row lies.
#[derive(Debug)]
pub struct LaidOutBatch {
    pub(crate) order: BatchOrder,
    pub(crate) layout: RowLayout,
    /// Layout rows: a padded batch's `B * T`, a packed batch's `N`.
    pub(crate) rows: usize,
    /// Features of the batch's input rows.
    pub(crate) data_features: usize,
    /// With per-step resets: the batch's segments, which the layers run.
    pub(crate) segments: Option<Box<Segments>>,
}

impl LaidOutBatch {
    /// The batch the layers run: its segments where it has resets, else itself.
    pub(crate) fn running(&self) -> &LaidOutBatch {
        self.segments.as_ref().map_or(self, |s| &s.batch)
    }
}

/// A batch's segments (with per-step resets, see [`crate::resets`]), and
/// how their states map to its sequences'.
#[derive(Debug)]
pub(crate) struct Segments {
    /// The segments as a batch: every layout row where it was.
    pub(crate) batch: LaidOutBatch,
    /// Each segment's sequence.
    pub(crate) sequence: Vec<usize>,
    /// Each sequence's last segment.
    pub(crate) last: Vec<usize>,
    /// Round `k`: each sequence's `k`-th segment, as `(sequence, segment)`
    /// (the initial-state adjoints are summed a round at a time).
    pub(crate) rounds: Vec<Vec<(usize, usize)>>,
}

/// A packed batch exactly as PyTorch's `PackedSequence`: rows time-major,
/// at each step the active sequences in order of decreasing length.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedSequence {
    /// `[N, features]`, row-major; `N` is the sum of lengths.
    pub data: Vec<f32>,
    /// Floats per row.
    pub features: usize,
    /// Active sequences per step, non-increasing.
    pub batch_sizes: Vec<usize>,
    /// `sorted_indices[i]`: the original index of the `i`-th longest sequence.
    pub sorted_indices: Vec<usize>,
    /// The inverse permutation.
    pub unsorted_indices: Vec<usize>,
}

impl PackedSequence {
    /// Packs a padded batch (this copies, as `pack_padded_sequence` does;
    /// the runtime itself runs padded batches without packing them).
    pub fn from_padded(
        data: &[f32],
        lengths: &[usize],
        steps: usize,
        features: usize,
        major: Major,
        align: Align,
    ) -> Result<PackedSequence> {
        let plan = BatchOrder::new(lengths, steps)?;
        check_len("padded data", data.len(), &[lengths.len(), steps, features])?;
        let src = RowLayout::padded(&plan, steps, major, align);
        let mut out = Vec::with_capacity(plan.rows() * features);
        for s in 0..plan.steps() {
            for &b in plan.active(s) {
                let r = src.row(b, s);
                out.extend_from_slice(&data[r * features..(r + 1) * features]);
            }
        }
        let sorted_indices = plan.order.clone();
        let unsorted_indices = plan.rank.clone();
        Ok(PackedSequence {
            data: out,
            features,
            batch_sizes: plan.batch_sizes,
            sorted_indices,
            unsorted_indices,
        })
    }

    /// The packing borrowed, as [`crate::Input::Packed`] takes it.
    pub fn view(&self) -> PackedView<'_> {
        PackedView {
            data: &self.data,
            features: self.features,
            batch_sizes: &self.batch_sizes,
            sorted_indices: &self.sorted_indices,
            unsorted_indices: &self.unsorted_indices,
        }
    }

    /// Checks the PyTorch invariants and returns the plan this packing follows.
    pub fn order(&self) -> Result<BatchOrder> {
        self.view().order()
    }

    /// Each sequence's length.
    pub fn lengths(&self) -> Vec<usize> {
        self.view().lengths()
    }

    /// Unpacks into a padded batch of `steps` steps (zeros at padding).
    pub fn to_padded(&self, steps: usize, major: Major, align: Align) -> Result<Vec<f32>> {
        let plan = self.order()?;
        if steps < plan.steps() {
            return Err(RuntimeError::Shape {
                tensor: "padded output".into(),
                expected: format!("at least {} steps", plan.steps()),
                found: format!("{steps} steps"),
            });
        }
        let src = RowLayout::packed(&plan);
        let dst = RowLayout::padded(&plan, steps, major, align);
        let f = self.features;
        let mut out = vec![0.0; plan.batch() * steps * f];
        for b in 0..plan.batch() {
            for t in 0..plan.lengths()[b] {
                let (r, w) = (src.row(b, t), dst.row(b, t));
                out[w * f..(w + 1) * f].copy_from_slice(&self.data[r * f..(r + 1) * f]);
            }
        }
        Ok(out)
    }
}

fn check_permutation(tensor: &str, p: &[usize], n: usize) -> Result<()> {
    if p.len() != n {
        return Err(RuntimeError::Shape {
            tensor: tensor.into(),
            expected: format!("[{n}]"),
            found: format!("[{}]", p.len()),
        });
    }
    let mut seen = vec![false; n];
    for &i in p {
        if i >= n || std::mem::replace(&mut seen[i], true) {
            return Err(RuntimeError::Permutation {
                tensor: tensor.into(),
                message: format!("{i} is out of range or repeated"),
            });
        }
    }
    Ok(())
}

/// A buffer of floats a pass reads or writes: host memory (`&[f32]`), or
/// device memory the caller owns ([`crate::DeviceFloats`]).
pub trait Floats: Copy {
    /// How many floats it holds.
    fn floats(&self) -> usize;
}

impl<T: Copy> Floats for &[T] {
    fn floats(&self) -> usize {
        self.len()
    }
}

/// A packed batch borrowed from the caller (a [`PackedSequence`]'s fields,
/// or a framework's tensors), read where it lies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PackedView<'a> {
    /// `[N, features]`, row-major; `N` is the sum of lengths.
    pub data: &'a [f32],
    /// Floats per row.
    pub features: usize,
    /// Active sequences per step, non-increasing.
    pub batch_sizes: &'a [usize],
    /// `sorted_indices[i]`: the original index of the `i`-th longest sequence.
    pub sorted_indices: &'a [usize],
    /// The inverse permutation.
    pub unsorted_indices: &'a [usize],
}

impl<'a> PackedView<'a> {
    /// Checks the PyTorch invariants and returns the plan this packing follows.
    pub fn order(&self) -> Result<BatchOrder> {
        self.index().order(self.data.len())
    }

    /// Its sizes and permutations, without the data.
    pub fn index(&self) -> PackedIndex<'a> {
        PackedIndex {
            features: self.features,
            batch_sizes: self.batch_sizes,
            sorted_indices: self.sorted_indices,
            unsorted_indices: self.unsorted_indices,
        }
    }

    /// Each sequence's length.
    pub fn lengths(&self) -> Vec<usize> {
        self.index().lengths()
    }
}

/// A packed batch's sizes and permutations ([`PackedView`] without its
/// data, which may lie on a device).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PackedIndex<'a> {
    /// Floats per row of the data.
    pub features: usize,
    /// Active sequences per step, non-increasing.
    pub batch_sizes: &'a [usize],
    /// `sorted_indices[i]`: the original index of the `i`-th longest sequence.
    pub sorted_indices: &'a [usize],
    /// The inverse permutation.
    pub unsorted_indices: &'a [usize],
}

impl PackedIndex<'_> {
    /// Checks the PyTorch invariants, and `data_len` floats of data,
    /// and returns the plan this packing follows.
    pub fn order(&self, data_len: usize) -> Result<BatchOrder> {
        let batch = self.batch_sizes.first().copied().unwrap_or(0);
        for (s, w) in self.batch_sizes.windows(2).enumerate() {
            if w[1] > w[0] {
                return Err(RuntimeError::BatchSizes {
                    step: s + 1,
                    message: format!("{} after {}: batch sizes must not increase", w[1], w[0]),
                });
            }
        }
        if let Some(s) = self.batch_sizes.iter().position(|&n| n == 0) {
            return Err(RuntimeError::BatchSizes {
                step: s,
                message: "0 sequences: drop empty trailing steps".into(),
            });
        }
        check_permutation("sorted_indices", self.sorted_indices, batch)?;
        check_permutation("unsorted_indices", self.unsorted_indices, batch)?;
        for (i, &b) in self.sorted_indices.iter().enumerate() {
            if self.unsorted_indices[b] != i {
                return Err(RuntimeError::Permutation {
                    tensor: "unsorted_indices".into(),
                    message: "it is not the inverse of sorted_indices".into(),
                });
            }
        }
        let rows: usize = self.batch_sizes.iter().sum();
        check_len("data", data_len, &[rows, self.features])?;
        let lengths = self.lengths();
        let plan = BatchOrder::new(&lengths, self.batch_sizes.len())?;
        // A stable sort of the lengths must give back sorted_indices' length order.
        for (i, &b) in self.sorted_indices.iter().enumerate() {
            if lengths[b] != lengths[plan.order[i]] {
                return Err(RuntimeError::Permutation {
                    tensor: "sorted_indices".into(),
                    message: "sequences are not in order of decreasing length".into(),
                });
            }
        }
        Ok(BatchOrder { order: self.sorted_indices.to_vec(), rank: self.unsorted_indices.to_vec(), ..plan })
    }

    /// Each sequence's length.
    pub fn lengths(&self) -> Vec<usize> {
        let batch = self.batch_sizes.first().copied().unwrap_or(0);
        let mut lengths = vec![0; batch];
        for &n in self.batch_sizes {
            for &b in self.sorted_indices.iter().take(n) {
                if let Some(l) = lengths.get_mut(b) {
                    *l += 1;
                }
            }
        }
        lengths
    }
}

/// The rows of a layout's `rows` that hold no step of any sequence (a
/// padded batch's padding), in increasing order.
pub(crate) fn padding_rows(order: &BatchOrder, layout: &RowLayout, rows: usize) -> Vec<usize> {
    if order.rows() == rows {
        return Vec::new();
    }
    let mut valid = vec![false; rows];
    for (b, &len) in order.lengths().iter().enumerate() {
        for t in 0..len {
            if let Some(v) = valid.get_mut(layout.row(b, t)) {
                *v = true;
            }
        }
    }
    (0..rows).filter(|&r| !valid[r]).collect()
}

/// Zeros rows `padding` of `data`, rows of `width` floats.
pub(crate) fn zero_rows(data: &mut [f32], width: usize, padding: &[usize]) {
    for &r in padding {
        if let Some(row) = data.get_mut(r * width..(r + 1) * width) {
            row.fill(0.0);
        }
    }
}

/// Checks a flat buffer's length against a shape.
pub(crate) fn check_len(tensor: &str, len: usize, shape: &[usize]) -> Result<()> {
    let want: usize = shape.iter().product();
    if len != want {
        return Err(RuntimeError::Shape {
            tensor: tensor.into(),
            expected: format!("{} ({want} elements)", crate::error::shape_text(shape)),
            found: format!("{len} elements"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_sorts_lengths_only() {
        let p = BatchOrder::new(&[2, 5, 1, 5], 6).unwrap();
        assert_eq!(p.order(), &[1, 3, 0, 2]);
        assert_eq!(p.batch_sizes(), &[4, 3, 2, 2, 2]);
        assert_eq!(p.active(2), &[1, 3]);
        assert_eq!(p.time(0, 1, true), 0);
    }

    #[test]
    fn pack_and_unpack_round_trip_in_every_layout() {
        let (lengths, steps, f) = ([2usize, 3, 1], 4usize, 2usize);
        for major in [Major::BatchFirst, Major::TimeFirst] {
            for align in [Align::Left, Align::Right] {
                let plan = BatchOrder::new(&lengths, steps).unwrap();
                let layout = RowLayout::padded(&plan, steps, major, align);
                let mut data = vec![0.0f32; 3 * steps * f];
                for (b, &len) in lengths.iter().enumerate() {
                    for t in 0..len {
                        let r = layout.row(b, t);
                        data[r * f] = (10 * b + t) as f32;
                        data[r * f + 1] = -1.0;
                    }
                }
                let packed = PackedSequence::from_padded(&data, &lengths, steps, f, major, align).unwrap();
                assert_eq!(packed.batch_sizes, vec![3, 2, 1]);
                assert_eq!(packed.sorted_indices, vec![1, 0, 2]);
                // Step 0: sequences 1, 0, 2; step 1: 1, 0; step 2: 1.
                let firsts: Vec<f32> = packed.data.chunks(f).map(|r| r[0]).collect();
                assert_eq!(firsts, vec![10.0, 0.0, 20.0, 11.0, 1.0, 12.0]);
                assert_eq!(packed.lengths(), lengths.to_vec());
                assert_eq!(packed.to_padded(steps, major, align).unwrap(), data);
            }
        }
    }

    #[test]
    fn bad_batches_are_typed_errors() {
        assert!(matches!(BatchOrder::new(&[3, 0], 4), Err(RuntimeError::Length { length: 0, .. })));
        assert!(matches!(BatchOrder::new(&[5], 4), Err(RuntimeError::Length { length: 5, .. })));
        let p = PackedSequence {
            data: vec![0.0; 4],
            features: 1,
            batch_sizes: vec![1, 2, 1],
            sorted_indices: vec![0, 1],
            unsorted_indices: vec![0, 1],
        };
        assert!(matches!(p.order(), Err(RuntimeError::BatchSizes { step: 1, .. })));
        let p = PackedSequence { batch_sizes: vec![2, 1], sorted_indices: vec![0, 0], ..p };
        assert!(matches!(p.order(), Err(RuntimeError::Permutation { .. })));
    }
}
