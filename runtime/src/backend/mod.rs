//! The interface every back end implements: run one layer in one direction
//! over a batch, forwards (optionally keeping what the backward needs) and
//! backwards.
//!
//! Rows are read and written through [`RowLayout`]s, so a back end gathers
//! and scatters the caller's own buffers — padded or packed, either
//! alignment — and never sees padding.

pub mod cpu;
pub mod cuda;
pub(crate) mod mapped;
pub mod reference;

use crate::cell::{CompiledCell, Layer};
use crate::error::Result;
use crate::pass::{PassTarget, Span};
use crate::sequence::{BatchOrder, LaidOutBatch, RowLayout};

/// Rows of a flat buffer: row `r`'s features are `data[r*width + offset ..]`.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    /// The whole buffer, every row of the layout.
    pub data: &'a [f32],
    /// Which row each `(b, t)` is.
    pub layout: &'a RowLayout,
    /// Floats per row of `data`.
    pub width: usize,
    /// Where in a row these features start.
    pub offset: usize,
}

impl<'a> Rows<'a> {
    /// The `len` features of `(b, t)`.
    pub fn get(&self, b: usize, t: usize, len: usize) -> &'a [f32] {
        let start = self.layout.row(b, t) * self.width + self.offset;
        &self.data[start..start + len]
    }
}

/// Writable rows, laid out as [`Rows`].
#[derive(Debug)]
pub struct RowsMut<'a> {
    /// The whole buffer, every row of the layout.
    pub data: &'a mut [f32],
    /// Which row each `(b, t)` is.
    pub layout: &'a RowLayout,
    /// Floats per row of `data`.
    pub width: usize,
    /// Where in a row these features start.
    pub offset: usize,
}

impl RowsMut<'_> {
    /// The `len` features of `(b, t)`, writable.
    pub fn get_mut(&mut self, b: usize, t: usize, len: usize) -> &mut [f32] {
        let start = self.layout.row(b, t) * self.width + self.offset;
        &mut self.data[start..start + len]
    }
}

/// Where a back end keeps its own form of one layer-direction's weights
/// (transposed, packed into panels): made on the first call that needs it
/// and reused by every later one. The model empties the slot whenever it
/// hands its parameters out mutably, so a changed weight is never read in
/// an old form.
#[derive(Default)]
pub struct PreparedWeights {
    form: std::sync::OnceLock<std::sync::Arc<dyn std::any::Any + Send + Sync>>,
    for_one_pass: bool,
}

impl PreparedWeights {
    /// A slot for weights that come with one pass and are gone after it
    /// (the caller's): a back end may then read them in place rather than
    /// prepare a form no later pass will use.
    pub fn for_one_pass() -> PreparedWeights {
        PreparedWeights { for_one_pass: true, ..Default::default() }
    }

    /// Whether the slot serves one pass only ([`PreparedWeights::for_one_pass`]).
    pub fn is_for_one_pass(&self) -> bool {
        self.for_one_pass
    }

    /// The prepared form, made by `make` if the slot is empty; `None` if
    /// the slot holds some other type (another back end's form).
    pub fn get_or_init<T: std::any::Any + Send + Sync>(&self, make: impl FnOnce() -> T) -> Option<&T> {
        self.form.get_or_init(|| std::sync::Arc::new(make())).downcast_ref::<T>()
    }
}

impl std::fmt::Debug for PreparedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.form.get().is_some() {
            "PreparedWeights(made)"
        } else {
            "PreparedWeights(empty)"
        })
    }
}

/// One layer, one direction, forwards.
#[derive(Clone, Copy, Debug)]
pub struct ForwardJob<'a> {
    /// The cell the layer runs.
    pub cell: &'a CompiledCell,
    /// The cell's program at this layer's sizes.
    pub layer: &'a Layer,
    /// This layer-direction's parameters, in the cell's order, each row-major.
    pub params: &'a [&'a [f32]],
    /// The batch's sequences by decreasing length, and how many run at each step.
    pub order: &'a BatchOrder,
    /// Runs each sequence from its last step to its first (a bidirectional layer's second direction).
    pub reverse: bool,
    /// The layer's input rows (the batch's input, or the previous layer's output).
    pub input: Rows<'a>,
    /// Initial states, one `[B * size]` buffer per state.
    pub h0: &'a [&'a [f32]],
    /// The back end's own form of `params`, kept across calls.
    pub prepared: &'a PreparedWeights,
    /// The masks the steps read, mask `i` at the layer's `mask_slices[i]`;
    /// `None` for a cell without.
    pub masks: Option<Rows<'a>>,
}

/// One layer, one direction, backwards.
#[derive(Clone, Copy, Debug)]
pub struct BackwardJob<'a> {
    /// The cell the layer runs.
    pub cell: &'a CompiledCell,
    /// The cell's program at this layer's sizes.
    pub layer: &'a Layer,
    /// This layer-direction's parameters, in the cell's order, each row-major.
    pub params: &'a [&'a [f32]],
    /// The batch's sequences by decreasing length, and how many run at each step.
    pub order: &'a BatchOrder,
    /// Runs each sequence from its last step to its first (a bidirectional layer's second direction).
    pub reverse: bool,
    /// The layer's input rows (the batch's input, or the previous layer's output).
    pub input: Rows<'a>,
    /// The adjoint of this direction's output rows.
    pub d_output: Rows<'a>,
    /// The adjoints of the final states, one `[B * size]` buffer per state.
    pub d_final: &'a [&'a [f32]],
    /// The back end's own form of `params`, kept across calls.
    pub prepared: &'a PreparedWeights,
    /// The masks the forward's steps read, as in [`ForwardJob::masks`].
    pub masks: Option<Rows<'a>>,
}

impl ForwardJob<'_> {
    /// Rows of the batch's layout (a padded batch's `B * T`, a packed one's `N`).
    pub fn layout_rows(&self) -> usize {
        self.input.data.len() / self.input.width.max(1)
    }
}

impl BackwardJob<'_> {
    /// Rows of the batch's layout, as [`ForwardJob::layout_rows`].
    pub fn layout_rows(&self) -> usize {
        self.input.data.len() / self.input.width.max(1)
    }
}

/// What a layer-direction's backward returns (the input's adjoint is
/// added into the caller's rows instead).
#[derive(Debug)]
pub struct BackwardResult {
    /// Adjoints of the initial states, one `[B * size]` buffer per state.
    pub d_h0: Vec<Vec<f32>>,
    /// Adjoints of the parameters, in the cell's order.
    pub d_params: Vec<Vec<f32>>,
}

/// Every layer of a one-directional model, for a stream of steps over a
/// batch of `batch` sequences (see [`crate::stream`]).
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
    pub masking: crate::masks::CellMasking,
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

/// What runs a model's layers: one layer in one direction over a batch,
/// forwards and backwards ([`cpu::Cpu`], [`cuda::Cuda`],
/// [`reference::Reference`]). A [`crate::Model`] owns one and calls it for
/// each layer and direction in turn.
pub trait Backend: Send + Sync {
    /// A short name for messages and errors (`"cpu"`, `"cuda"`, `"reference"`).
    fn name(&self) -> &'static str;

    /// Passes over device memory the caller owns, where this back end runs
    /// on a device ([`crate::device_call`]).
    fn device_passes(&self) -> Option<&dyn DevicePasses> {
        None
    }

    /// A workspace that runs the model step by step, or `None` where this
    /// back end has no such path (the model then runs each call as a batch).
    fn stream<'a>(&'a self, job: StreamJob<'a>) -> Result<Option<Box<dyn StepRunner + 'a>>> {
        let _ = job;
        Ok(None)
    }

    /// Writes the output rows (this direction's features of `output`) and
    /// returns the final states. A training forward is given a `tape`: the
    /// layout's rows times the program's tape floats per row, which it
    /// fills as the layer's program lays it out
    /// ([`cellc::program::TapeLayout`]), padding rows zeroed.
    fn forward(
        &self,
        job: &ForwardJob,
        output: &mut RowsMut,
        tape: Option<&mut [f32]>,
    ) -> Result<Vec<Vec<f32>>>;

    /// Adds the adjoint of the input rows into `d_input` and returns the
    /// rest, reading the `tape` a training forward of the same job filled.
    fn backward(&self, job: &BackwardJob, tape: &[f32], d_input: &mut RowsMut) -> Result<BackwardResult>;
}

/// A back end shared by several models (one device, its compiled kernels
/// and its memory pools serving them all).
impl<B: Backend + ?Sized> Backend for std::sync::Arc<B> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn device_passes(&self) -> Option<&dyn DevicePasses> {
        (**self).device_passes()
    }

    fn stream<'a>(&'a self, job: StreamJob<'a>) -> Result<Option<Box<dyn StepRunner + 'a>>> {
        (**self).stream(job)
    }

    fn forward(
        &self,
        job: &ForwardJob,
        output: &mut RowsMut,
        tape: Option<&mut [f32]>,
    ) -> Result<Vec<Vec<f32>>> {
        (**self).forward(job, output, tape)
    }

    fn backward(&self, job: &BackwardJob, tape: &[f32], d_input: &mut RowsMut) -> Result<BackwardResult> {
        (**self).backward(job, tape, d_input)
    }
}

/// Passes in a device's memory: the caller's ([`crate::device_call`]), or
/// the model's own passes over host data, staged there.
pub trait DevicePasses {
    /// The target a pass of `cell` (at its `layers`' sizes) over `batch`
    /// runs on: this device, its work queued on `stream` (`None`: the
    /// device's own), reading `weights` (`[layer * directions +
    /// direction][param]`, checked).
    fn target<'a>(
        &'a self,
        cell: &'a CompiledCell,
        layers: &'a [Layer],
        batch: &'a LaidOutBatch,
        weights: Vec<Vec<Span>>,
        stream: Option<u64>,
    ) -> Result<Box<dyn PassTarget + 'a>>;

    /// `data` copied into new device memory, queued on the device's own stream.
    fn upload(&self, data: &[f32]) -> Result<cuda::device::Buf>;

    /// New device memory of `len` floats, zeroed.
    fn zeros(&self, len: usize) -> Result<cuda::device::Buf>;

    /// A buffer's floats, once the work queued on the device's own stream is done.
    fn download(&self, buf: &cuda::device::Buf) -> Result<Vec<f32>>;

    /// A layer-direction's parameters on the device: uploaded once and
    /// kept in `prepared` (for the model's own), or for this pass only.
    fn params(
        &self,
        params: &[&[f32]],
        prepared: &PreparedWeights,
    ) -> Result<std::sync::Arc<Vec<cuda::device::Buf>>>;
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
