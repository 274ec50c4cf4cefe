//! How a padded batch is laid out: which axis is the batch's, where each
//! sequence sits on the time axis, and its real length.

use cellc_runtime::{Align, BatchShape, Input, Major, RuntimeError};

/// A padded batch's layout and lengths, read against its input tensor's
/// shape (`[B, T, I]` batch-first, `[T, B, I]` time-first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Padded {
    pub batch: usize,
    pub steps: usize,
    pub major: Major,
    pub align: Align,
    pub lengths: Vec<usize>,
    /// Per-step resets, one flag per row of the input (`CallOptions::resets`).
    pub resets: Option<Vec<bool>>,
}

impl Padded {
    /// The layout of an input of `dims`; the runtime checks the lengths.
    pub(crate) fn of(
        dims: &[usize],
        major: Major,
        align: Align,
        lengths: &[usize],
    ) -> Result<Padded, RuntimeError> {
        let &[a, b, _] = dims else {
            return Err(RuntimeError::Shape {
                tensor: "input".into(),
                expected: match major {
                    Major::BatchFirst => "[B, T, features]".into(),
                    Major::TimeFirst => "[T, B, features]".into(),
                },
                found: format!("{dims:?}"),
            });
        };
        let (batch, steps) = match major {
            Major::BatchFirst => (a, b),
            Major::TimeFirst => (b, a),
        };
        Ok(Padded { batch, steps, major, align, lengths: lengths.to_vec(), resets: None })
    }

    /// The runtime's description of the batch.
    pub(crate) fn shape(&self) -> BatchShape<'_> {
        BatchShape::Padded {
            batch: self.batch,
            steps: self.steps,
            major: self.major,
            align: self.align,
            lengths: &self.lengths,
        }
    }

    /// The runtime's view of `data` laid out so.
    pub(crate) fn input<'a>(&'a self, data: &'a [f32]) -> Input<'a> {
        self.shape().with_data(data)
    }

    /// The output's dimensions: the input's, `features` per row.
    pub(crate) fn output_dims(&self, features: usize) -> [usize; 3] {
        match self.major {
            Major::BatchFirst => [self.batch, self.steps, features],
            Major::TimeFirst => [self.steps, self.batch, features],
        }
    }
}
