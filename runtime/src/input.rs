//! A batch as the caller holds it: padded (`[B, T, F]` or `[T, B, F]`,
//! either alignment) with each sequence's length, or packed as PyTorch
//! packs it; its shape without its data, for a batch on a device.

use crate::sequence::{Align, Major, PackedIndex, PackedView};

/// A batch in the caller's own layout.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    /// `[B, T, F]` or `[T, B, F]`, padded, with each sequence's length.
    Padded {
        /// `B * T * F` floats, row-major in the order `major` says.
        data: &'a [f32],
        /// Sequences, `B`.
        batch: usize,
        /// Padded steps, `T`.
        steps: usize,
        /// Whether the batch axis or the time axis comes first.
        major: Major,
        /// Whether the padding is at the end or at the start of each sequence.
        align: Align,
        /// Each sequence's length, `[B]`, each in `1..=T`.
        lengths: &'a [usize],
    },
    /// A PyTorch packed sequence ([`crate::PackedSequence::view`]).
    Packed(PackedView<'a>),
}

/// A batch's shape and layout without its data (which may lie on a
/// device): an [`Input`]'s other fields.
#[derive(Clone, Copy, Debug)]
pub enum BatchShape<'a> {
    /// A padded batch ([`Input::Padded`]).
    Padded {
        /// Sequences, `B`.
        batch: usize,
        /// Padded steps, `T`.
        steps: usize,
        /// Whether the batch axis or the time axis comes first.
        major: Major,
        /// Whether the padding is at the end or at the start of each sequence.
        align: Align,
        /// Each sequence's length, `[B]`, each in `1..=T`.
        lengths: &'a [usize],
    },
    /// A packed batch ([`Input::Packed`]): its sizes and permutations.
    Packed(PackedIndex<'a>),
}

impl<'a> BatchShape<'a> {
    /// The batch with its data on the host.
    pub fn with_data(self, data: &'a [f32]) -> Input<'a> {
        match self {
            BatchShape::Padded { batch, steps, major, align, lengths } => {
                Input::Padded { data, batch, steps, major, align, lengths }
            }
            BatchShape::Packed(p) => Input::Packed(PackedView {
                data,
                features: p.features,
                batch_sizes: p.batch_sizes,
                sorted_indices: p.sorted_indices,
                unsorted_indices: p.unsorted_indices,
            }),
        }
    }
}

impl<'a> Input<'a> {
    /// Its shape and layout, and its data.
    pub fn split(&self) -> (BatchShape<'a>, &'a [f32]) {
        match *self {
            Input::Padded { data, batch, steps, major, align, lengths } => {
                (BatchShape::Padded { batch, steps, major, align, lengths }, data)
            }
            Input::Packed(p) => (BatchShape::Packed(p.index()), p.data),
        }
    }
}
