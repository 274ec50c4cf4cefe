//! The work of a pass as a device sees it: one layer and direction at a
//! time ([`LayerForward`], [`LayerBackward`]) over [`Span`]s of the pass's
//! memory (addresses and lengths, host or device), run by a
//! [`PassTarget`]. The crate's driver decides the work; a target only
//! executes it.

use crate::cell::Layer;
use crate::dropout::LayerMasks;
use crate::error::Result;
use crate::masks::{DropConnect, MaskRows};
use std::ops::Range;

/// Floats of a pass's memory, host or device: the address of the first
/// (in bytes) and how many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// The address of the first float.
    pub addr: u64,
    /// Floats in the span.
    pub len: usize,
}

impl Span {
    /// A host slice's span, to read.
    pub fn of(data: &[f32]) -> Span {
        Span { addr: data.as_ptr() as u64, len: data.len() }
    }

    /// A host slice's span, to write (its address taken from the mutable borrow).
    pub fn of_mut(data: &mut [f32]) -> Span {
        Span { addr: data.as_mut_ptr() as u64, len: data.len() }
    }

    /// Floats `range` of this span.
    pub fn part(self, range: Range<usize>) -> Span {
        debug_assert!(range.end <= self.len, "{range:?} of a span of {}", self.len);
        Span { addr: self.addr + 4 * range.start as u64, len: range.len() }
    }

    /// Slot `slot`'s `[B, n]` rows of a `[layers * directions, B, n]` state tensor.
    pub(crate) fn slot(self, slot: usize, batch: usize, n: usize) -> Span {
        self.part(slot * batch * n..(slot + 1) * batch * n)
    }
}

impl crate::sequence::Floats for Span {
    fn floats(&self) -> usize {
        self.len
    }
}

/// Rows laid out as the batch: layout row `r`'s features are `width`
/// floats apart, from float `offset` of the row on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowSpan {
    /// The whole buffer, every layout row.
    pub span: Span,
    /// Floats per layout row.
    pub width: usize,
    /// Where in a row these features start.
    pub offset: usize,
}

/// One layer and direction forwards: where it reads and writes.
#[derive(Clone, Debug)]
pub struct LayerForward<'a> {
    /// The cell's program at the layer's sizes.
    pub layer: &'a Layer,
    /// `layer * directions + direction`: which parameters it reads.
    pub slot: usize,
    /// The reverse direction: each sequence from its last step to its first.
    pub reverse: bool,
    /// The layer's input rows (the batch's input, or the previous layer's output).
    pub input: RowSpan,
    /// This direction's features of the output rows (valid rows are written).
    pub output: RowSpan,
    /// Initial states, `[B, size]` each.
    pub h0: Vec<Span>,
    /// Final states, `[B, size]` each, written.
    pub finals: Vec<Span>,
    /// Training: the tape (the layout's rows times the layer's tape floats per row), written.
    pub tape: Option<Span>,
    /// The masks its steps read, filled ([`PassTarget::fill_masks`]); `None` for a cell without.
    pub masks: Option<RowSpan>,
    /// Its DropConnect masks, by parameter: the parameter is multiplied by its mask for the pass.
    pub drop_connect: DropConnect,
}

/// One layer and direction backwards: where it reads and writes.
#[derive(Clone, Debug)]
pub struct LayerBackward<'a> {
    /// The cell's program at the layer's sizes.
    pub layer: &'a Layer,
    /// `layer * directions + direction`: which parameters it reads and
    /// whose gradients it writes.
    pub slot: usize,
    /// The reverse direction: each sequence from its last step to its first.
    pub reverse: bool,
    /// The layer's input rows, as the forward read them.
    pub input: RowSpan,
    /// The tape its training forward wrote.
    pub tape: Span,
    /// The adjoint of this direction's output rows.
    pub d_output: RowSpan,
    /// The final states' adjoints, `[B, size]` each.
    pub d_final: Vec<Span>,
    /// The input's adjoint: valid rows are added into.
    pub d_input: RowSpan,
    /// The initial states' adjoints, `[B, size]` each, written.
    pub d_h0: Vec<Span>,
    /// The parameters' gradients, in the cell's order, written.
    pub d_params: Vec<Span>,
    /// The masks its forward's steps read, filled again; `None` for a cell without.
    pub masks: Option<RowSpan>,
    /// Its forward's DropConnect masks, by parameter: the gradient of each
    /// such parameter is the masked parameter's times its mask.
    pub drop_connect: DropConnect,
}

/// Where a pass runs: the memory its spans lie in, and the device that
/// executes each layer and direction.
pub trait PassTarget {
    /// `floats` floats of scratch memory that live until the pass ends;
    /// zeroed if `zeroed`, else holding anything.
    fn scratch(&mut self, floats: usize, zeroed: bool) -> Result<Span>;

    /// Sets the padding rows (`padding`, layout rows) of `rows` to zero;
    /// a target may zero every row, as valid ones are written after.
    fn zero_padding(&mut self, rows: RowSpan, padding: &[usize]) -> Result<()>;

    /// Sets every float of `span` to zero.
    fn zero(&mut self, span: Span) -> Result<()>;

    /// Copies `from` to `to` (the same length).
    fn copy(&mut self, to: Span, from: Span) -> Result<()>;

    /// Copies rows of `width` floats: for each `(i, j)` of `pairs`, row
    /// `j` of `from` to row `i` of `to` (no two pairs write one row).
    fn copy_rows(&mut self, to: Span, from: Span, width: usize, pairs: &[(usize, usize)]) -> Result<()>;

    /// Adds rows of `width` floats: for each `(i, j)` of `pairs`, row `j`
    /// of `from` into row `i` of `to` (no two pairs write one row).
    fn add_rows(&mut self, to: Span, from: Span, width: usize, pairs: &[(usize, usize)]) -> Result<()>;

    /// Multiplies every valid row of `rows` by its dropout masks
    /// (direction `d`'s `masks.units` features from `rows.offset + d *
    /// masks.units`), drawn for each row's sequence and step.
    fn drop_out(&mut self, rows: RowSpan, masks: &LayerMasks) -> Result<()>;

    /// Fills every valid row of `rows` with the masks a layer and
    /// direction's steps read (see [`crate::masks`]); rows 0 floats apart
    /// (`rows.width == 0`, evaluation: the same masks for every row) are
    /// one row, filled once.
    fn fill_masks(&mut self, rows: RowSpan, masks: &MaskRows) -> Result<()>;

    /// Runs one layer and direction forwards.
    fn forward(&mut self, job: LayerForward) -> Result<()>;

    /// Runs one layer and direction backwards, reading the tape its
    /// training forward wrote.
    fn backward(&mut self, job: LayerBackward) -> Result<()>;
}
