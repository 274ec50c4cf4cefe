//! The work of a pass as a device sees it: one layer and direction at a
//! time ([`LayerForward`], [`LayerBackward`]) over [`Span`]s of the pass's
//! memory (addresses and lengths, host or device), in a [`Pass`]. The
//! crate's driver decides the work; a device ([`crate::backend::Device`])
//! only executes it.

use crate::cell::{CompiledCell, Layer};
use crate::dropout::LayerMasks;
use crate::masks::MaskFill;
use crate::sequence::LaidOutBatch;
use cellc::precision::Precision;
use std::any::Any;
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

/// Memory a device owns: its address, its length in elements, and what
/// keeps it alive (freed, or given back to a pool, when dropped).
pub struct Buf {
    /// The address of its first element.
    pub addr: u64,
    /// Its elements.
    pub len: usize,
    _owner: Box<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buf({:#x}, {})", self.addr, self.len)
    }
}

impl Buf {
    /// Memory at `addr` of `len` elements, kept alive by `owner`.
    pub fn new(addr: u64, len: usize, owner: Box<dyn Any + Send + Sync>) -> Buf {
        Buf { addr, len, _owner: owner }
    }

    /// The address of float `i`.
    pub fn at(&self, i: usize) -> u64 {
        self.addr + 4 * i as u64
    }

    /// Its floats as a span.
    pub fn span(&self) -> Span {
        Span { addr: self.addr, len: self.len }
    }
}

/// Where a device's passes read and write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// The host's: a pass reads and writes the caller's buffers where they lie.
    Host,
    /// The device's own: the model's own passes upload what they read and
    /// download what they write; a caller's device memory
    /// ([`crate::DeviceCall`]) is read and written where it lies.
    Device,
}

/// Where a device keeps its own form of one layer-direction's weights
/// (transposed, packed into panels, uploaded): made on the first call that
/// needs it and reused by every later one. The model empties the slot
/// whenever it hands its parameters out mutably, so a changed weight is
/// never read in an old form.
#[derive(Default)]
pub struct PreparedWeights {
    /// One form per precision of the products that read it
    /// ([`Precision`]'s variants in order): a model whose calls ask for
    /// several keeps each.
    forms: [std::sync::OnceLock<std::sync::Arc<dyn Any + Send + Sync>>; 4],
    for_one_pass: bool,
}

impl PreparedWeights {
    /// A slot for weights that come with one pass and are gone after it
    /// (the caller's, or a pass's DropConnect-masked copies): a device may
    /// then read them in place rather than prepare a form no later pass
    /// will use.
    pub fn for_one_pass() -> PreparedWeights {
        PreparedWeights { for_one_pass: true, ..Default::default() }
    }

    /// Whether the slot serves one pass only ([`PreparedWeights::for_one_pass`]).
    pub fn is_for_one_pass(&self) -> bool {
        self.for_one_pass
    }

    /// The form prepared for products in `precision`, made by `make` if
    /// there is none yet; `None` if the slot holds some other type
    /// (another device's form).
    pub fn get_or_init<T: Any + Send + Sync>(
        &self,
        precision: Precision,
        make: impl FnOnce() -> T,
    ) -> Option<&T> {
        let slot = match precision {
            Precision::F32 => 0,
            Precision::Bf16 => 1,
            Precision::F16 => 2,
            Precision::Tf32 => 3,
        };
        self.forms[slot].get_or_init(|| std::sync::Arc::new(make())).downcast_ref::<T>()
    }
}

impl std::fmt::Debug for PreparedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.forms.iter().any(|f| f.get().is_some()) {
            "PreparedWeights(made)"
        } else {
            "PreparedWeights(empty)"
        })
    }
}

/// A model's parameters for one pass, `[layer * directions + direction]`:
/// spans of the device's memory, and the device's prepared form of each
/// (the model's own, kept across calls, or made for this pass only).
pub(crate) struct PassWeights<'a> {
    spans: Vec<Vec<Span>>,
    prepared: Prepared<'a>,
}

enum Prepared<'a> {
    Model(&'a [PreparedWeights]),
    Pass(Vec<PreparedWeights>),
}

impl<'a> PassWeights<'a> {
    /// The model's own parameters at `spans`, prepared in the model's slots.
    pub(crate) fn model(spans: Vec<Vec<Span>>, prepared: &'a [PreparedWeights]) -> PassWeights<'a> {
        PassWeights { spans, prepared: Prepared::Model(prepared) }
    }

    /// A caller's parameters at `spans`, prepared for this pass only.
    pub(crate) fn caller(spans: Vec<Vec<Span>>) -> PassWeights<'a> {
        let prepared = spans.iter().map(|_| PreparedWeights::for_one_pass()).collect();
        PassWeights { spans, prepared: Prepared::Pass(prepared) }
    }

    pub(crate) fn slot(&self, slot: usize) -> (&[Span], &PreparedWeights) {
        let prepared = match &self.prepared {
            Prepared::Model(p) => &p[slot],
            Prepared::Pass(p) => &p[slot],
        };
        (&self.spans[slot], prepared)
    }
}

/// What every operation of one pass shares: the cell, the model's layers,
/// the batch and the precision of its products.
///
/// Only the crate's driver makes a pass (it is non-exhaustive): its spans
/// are then memory that lives, as [`crate::backend::Device`]'s contract says.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Pass<'a> {
    /// The cell every layer runs.
    pub cell: &'a CompiledCell,
    /// The model's layers, first to last.
    pub layers: &'a [Layer],
    /// The caller's batch; the layers run its segments where it has
    /// resets ([`crate::resets`]), and masks are filled over the
    /// caller's own rows.
    pub batch: &'a LaidOutBatch,
    /// The precision of the products of matrix parameters, one the device
    /// computes ([`crate::backend::Device::precision`] chose it).
    pub precision: Precision,
}

/// Rows to copy or add: for each `(i, j)` of `pairs`, row `j` of `from`
/// into row `i` of `to`, `width` floats each; no two pairs write one row.
#[derive(Clone, Copy, Debug)]
pub struct RowPairs<'p> {
    /// Where the rows go.
    pub to: Span,
    /// Where they come from (never overlapping `to`).
    pub from: Span,
    /// Floats per row.
    pub width: usize,
    /// `(row of to, row of from)`.
    pub pairs: &'p [(usize, usize)],
    /// Adds the rows into `to` instead of copying them over it.
    pub add: bool,
}

/// What a device multiplies memory by ([`crate::backend::Device::drop_out`]).
#[derive(Clone, Copy, Debug)]
pub enum Dropping<'m> {
    /// Dropout between layers: every valid row of the batch (direction
    /// `d`'s `units` features from the rows' offset plus `d * units`),
    /// drawn for each row's sequence and step.
    Rows(&'m LayerMasks),
    /// DropConnect: a whole parameter (or its gradient) by its mask, drawn
    /// once per call.
    Parameter(&'m MaskFill),
}

/// One layer and direction forwards: where it reads and writes.
#[derive(Clone, Debug)]
pub struct LayerForward<'a> {
    /// The cell's program at the layer's sizes.
    pub layer: &'a Layer,
    /// The reverse direction: each sequence from its last step to its first.
    pub reverse: bool,
    /// Its parameters, in the cell's order (DropConnect's already masked).
    pub params: Vec<Span>,
    /// The device's prepared form of `params`, kept across calls (or for
    /// this pass only).
    pub prepared: &'a PreparedWeights,
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
    /// The masks its steps read, filled
    /// ([`crate::backend::Device::fill_masks`]); `None` for a cell without.
    pub masks: Option<RowSpan>,
}

/// One layer and direction backwards: where it reads and writes.
#[derive(Clone, Debug)]
pub struct LayerBackward<'a> {
    /// The cell's program at the layer's sizes.
    pub layer: &'a Layer,
    /// The reverse direction: each sequence from its last step to its first.
    pub reverse: bool,
    /// Its parameters as its forward read them.
    pub params: Vec<Span>,
    /// The device's prepared form of `params`.
    pub prepared: &'a PreparedWeights,
    /// The layer's input rows, as the forward read them.
    pub input: RowSpan,
    /// The tape its training forward wrote.
    pub tape: Span,
    /// The adjoint of this direction's output rows.
    pub d_output: RowSpan,
    /// The final states' adjoints, `[B, size]` each.
    pub d_final: Vec<Span>,
    /// The initial states its forward read, `[B, size]` each.
    pub h0: Vec<Span>,
    /// The input's adjoint: valid rows are added into.
    pub d_input: RowSpan,
    /// The initial states' adjoints, `[B, size]` each, written.
    pub d_h0: Vec<Span>,
    /// The parameters' gradients (of the parameters as read), in the cell's order, written.
    pub d_params: Vec<Span>,
    /// The masks its forward's steps read, filled again; `None` for a cell without.
    pub masks: Option<RowSpan>,
}
