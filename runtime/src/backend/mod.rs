//! The devices that run a model's layers ([`cpu::Cpu`], [`cuda::Cuda`],
//! [`reference::Reference`]), and the one trait they implement,
//! [`Device`]: the memory of a pass, the masks, and one layer in one
//! direction over [`Span`]s of that memory, forwards and backwards.
//!
//! The crate's driver decides every pass's work once for every device; a
//! device only executes it. Devices in host memory (the CPU and the
//! reference) share the host's memory half ([`cpu::host`]); the CUDA device
//! implements it on its own memory.

pub mod cpu;
pub mod cuda;
pub(crate) mod mapped;
pub mod reference;

use crate::cell::{CompiledCell, Layer};
use crate::error::Result;
use crate::masks::{CellMasking, MaskRows};
use crate::pass::{
    Buf, Dropping, LayerBackward, LayerForward, Memory, Pass, PreparedWeights, RowPairs, RowSpan, Span,
};
use cellc::precision::Precision;

/// What runs a model's layers. A [`crate::Model`] owns one and the
/// crate's driver calls it for each pass: memory first (scratch, zeros,
/// rows copied or added), then the masks each layer and direction reads,
/// then the layer itself. Every operation of a pass gets the pass's
/// [`Pass`]; the driver keeps the scratch [`Buf`]s until the pass ends.
///
/// Spans are addresses in the device's memory ([`Device::memory`]): host
/// addresses for a host device, device addresses for a GPU. Every
/// operation on spans takes the [`Pass`] they belong to, which only the
/// crate's driver makes, and it guarantees that every span it hands over
/// lives, and that nothing else reads or writes it, while the operation
/// runs; two spans of one operation never overlap unless the same span is
/// named twice to read.
pub trait Device: Send + Sync {
    /// A short name for messages and errors (`"cpu"`, `"cuda"`, `"reference"`).
    fn name(&self) -> &'static str;

    /// Where its passes' memory lies.
    fn memory(&self) -> Memory;

    /// The precision its products compute in for a call that asks for
    /// `asked` (see [`cellc::precision`]), or why it cannot: the one place
    /// that decides what a device computes. Every pass's
    /// [`Pass::precision`] is an answer of this.
    fn precision(&self, asked: Precision) -> Result<Precision>;

    /// `floats` floats of the device's memory for one pass, zeroed if
    /// `zeroed`, else holding anything.
    fn scratch(&self, pass: &Pass, floats: usize, zeroed: bool) -> Result<Buf>;

    /// Sets `span` to zero; with `rows` (floats per row, and layout rows),
    /// only those rows of it (a device may zero all of it: the others are
    /// written after).
    fn zero(&self, pass: &Pass, span: Span, rows: Option<(usize, &[usize])>) -> Result<()>;

    /// Copies or adds rows ([`RowPairs`]).
    fn move_rows(&self, pass: &Pass, rows: RowPairs) -> Result<()>;

    /// `data` in new memory of the device (a host device's copy).
    fn upload(&self, data: &[f32]) -> Result<Buf>;

    /// `from`'s floats into `to` (as long), once the work queued before is done.
    fn download(&self, pass: &Pass, from: Span, to: &mut [f32]) -> Result<()>;

    /// Fills every valid row of `rows` with the masks a layer and
    /// direction's steps read (see [`crate::masks`]); rows 0 floats apart
    /// (`rows.width == 0`, evaluation: the same masks for every row) are
    /// one row, filled once.
    fn fill_masks(&self, pass: &Pass, rows: RowSpan, masks: &MaskRows) -> Result<()>;

    /// Multiplies `rows` by masks ([`Dropping`]).
    fn drop_out(&self, pass: &Pass, rows: RowSpan, masks: Dropping) -> Result<()>;

    /// Runs one layer and direction forwards.
    fn forward(&self, pass: &Pass, job: LayerForward) -> Result<()>;

    /// Runs one layer and direction backwards, reading the tape its
    /// training forward wrote.
    fn backward(&self, pass: &Pass, job: LayerBackward) -> Result<()>;

    /// This device working on a caller's stream (a `CUstream` handle; 0
    /// is the legacy default stream), for a pass over the caller's device
    /// memory; `None`: it has no streams and works on its own.
    fn on_stream(&self, stream: u64) -> Result<Option<Box<dyn Device + '_>>> {
        let _ = stream;
        Ok(None)
    }

    /// A workspace that runs the model step by step, or `None` where this
    /// device has no such path (the model then runs each call as a batch).
    fn stream<'a>(&'a self, job: StreamJob<'a>) -> Result<Option<Box<dyn StepRunner + 'a>>> {
        let _ = job;
        Ok(None)
    }
}

/// A device shared by several models (one device, its compiled kernels
/// and its memory pools serving them all).
impl<D: Device + ?Sized> Device for std::sync::Arc<D> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn memory(&self) -> Memory {
        (**self).memory()
    }

    fn precision(&self, asked: Precision) -> Result<Precision> {
        (**self).precision(asked)
    }

    fn scratch(&self, pass: &Pass, floats: usize, zeroed: bool) -> Result<Buf> {
        (**self).scratch(pass, floats, zeroed)
    }

    fn zero(&self, pass: &Pass, span: Span, rows: Option<(usize, &[usize])>) -> Result<()> {
        (**self).zero(pass, span, rows)
    }

    fn move_rows(&self, pass: &Pass, rows: RowPairs) -> Result<()> {
        (**self).move_rows(pass, rows)
    }

    fn upload(&self, data: &[f32]) -> Result<Buf> {
        (**self).upload(data)
    }

    fn download(&self, pass: &Pass, from: Span, to: &mut [f32]) -> Result<()> {
        (**self).download(pass, from, to)
    }

    fn fill_masks(&self, pass: &Pass, rows: RowSpan, masks: &MaskRows) -> Result<()> {
        (**self).fill_masks(pass, rows, masks)
    }

    fn drop_out(&self, pass: &Pass, rows: RowSpan, masks: Dropping) -> Result<()> {
        (**self).drop_out(pass, rows, masks)
    }

    fn forward(&self, pass: &Pass, job: LayerForward) -> Result<()> {
        (**self).forward(pass, job)
    }

    fn backward(&self, pass: &Pass, job: LayerBackward) -> Result<()> {
        (**self).backward(pass, job)
    }

    fn on_stream(&self, stream: u64) -> Result<Option<Box<dyn Device + '_>>> {
        (**self).on_stream(stream)
    }

    fn stream<'a>(&'a self, job: StreamJob<'a>) -> Result<Option<Box<dyn StepRunner + 'a>>> {
        (**self).stream(job)
    }
}

/// Every layer of a one-directional model, for a stream of steps over a
/// batch of `batch` sequences (see [`crate::model::stream`]).
#[derive(Clone, Debug)]
pub struct StreamJob<'a> {
    /// The cell every layer runs.
    pub cell: &'a CompiledCell,
    /// The model's layers, first to last.
    pub layers: &'a [Layer],
    /// Each layer's parameters, in the cell's order.
    pub params: Vec<Vec<&'a [f32]>>,
    /// Each layer's slot for the back end's prepared form of its parameters.
    pub prepared: Vec<&'a PreparedWeights>,
    /// Sequences in the stream's batch, `B`.
    pub batch: usize,
    /// The cell's masks, in evaluation (a stream never trains), at the model's rates.
    pub masking: CellMasking,
    /// The precision of the products ([`Device::precision`] chose it).
    pub precision: Precision,
}

/// A back end's workspace for a stream: made once, then each call runs a
/// few steps of every layer with no allocation, on the caller's thread.
/// It holds the carried states.
pub trait StepRunner: Send + Sync {
    /// Runs `input` (`[steps, B, I]`) through every layer, writing `output`
    /// (`[steps, B, O]`); the caller has checked both lengths.
    fn run(&mut self, input: &[f32], steps: usize, output: &mut [f32]) -> Result<()>;

    /// State `i` of layer `layer`, `[B * size]`.
    fn state(&self, layer: usize, i: usize) -> &[f32];

    /// State `i` of layer `layer`, `[B * size]`, writable: the caller sets
    /// or resets the carried state through it.
    fn state_mut(&mut self, layer: usize, i: usize) -> &mut [f32];
}

/// Checks that a tape has the floats the layer's program lays out for `rows` layout rows.
pub fn check_tape(layer: &Layer, rows: usize, len: usize) -> Result<()> {
    let need = rows * layer.tape().floats_per_row();
    if need == len {
        return Ok(());
    }
    Err(crate::error::RuntimeError::Shape {
        tensor: "reserve".into(),
        expected: format!("{need} floats for layer {}'s tape", layer.index),
        found: format!("{len}"),
    })
}
