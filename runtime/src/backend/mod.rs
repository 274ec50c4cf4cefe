//! The interface every back end implements: run one layer in one direction
//! over a batch, forwards (optionally keeping what the backward needs) and
//! backwards.
//!
//! Rows are read and written through [`RowLayout`]s, so a back end gathers
//! and scatters the caller's own buffers — padded or packed, either
//! alignment — and never sees padding.

pub mod cpu;
pub mod cuda;
pub mod mapped;
pub mod reference;

use crate::error::Result;
use crate::model::{CompiledCell, Layer};
use crate::sequence::{BatchOrder, RowLayout};

/// Rows of a flat buffer: row `r`'s features are `data[r*width + offset ..]`.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    pub data: &'a [f32],
    pub layout: &'a RowLayout,
    pub width: usize,
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
    pub data: &'a mut [f32],
    pub layout: &'a RowLayout,
    pub width: usize,
    pub offset: usize,
}

impl RowsMut<'_> {
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
    pub cell: &'a CompiledCell,
    pub layer: &'a Layer,
    pub params: &'a [&'a [f32]],
    pub order: &'a BatchOrder,
    pub reverse: bool,
    pub input: Rows<'a>,
    /// Initial states, one `[B * size]` buffer per state.
    pub h0: &'a [&'a [f32]],
    /// Keep what the backward step needs.
    pub training: bool,
    /// The back end's own form of `params`, kept across calls.
    pub prepared: &'a PreparedWeights,
}

/// One layer, one direction, backwards.
#[derive(Clone, Copy, Debug)]
pub struct BackwardJob<'a> {
    pub cell: &'a CompiledCell,
    pub layer: &'a Layer,
    pub params: &'a [&'a [f32]],
    pub order: &'a BatchOrder,
    pub reverse: bool,
    pub input: Rows<'a>,
    /// The adjoint of this direction's output rows.
    pub d_output: Rows<'a>,
    /// The adjoints of the final states, one `[B * size]` buffer per state.
    pub d_final: &'a [&'a [f32]],
    /// The back end's own form of `params`, kept across calls.
    pub prepared: &'a PreparedWeights,
}

/// What a training forward keeps for the backward (back-end specific).
pub struct Tape(pub Box<dyn std::any::Any + Send + Sync>);

impl std::fmt::Debug for Tape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tape")
    }
}

#[derive(Debug)]
pub struct ForwardResult {
    /// Final states, one `[B * size]` buffer per state.
    pub final_states: Vec<Vec<f32>>,
    pub tape: Option<Tape>,
}

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
    pub cell: &'a CompiledCell,
    pub layers: &'a [Layer],
    /// Each layer's parameters, and the back end's prepared form of them.
    pub params: Vec<Vec<&'a [f32]>>,
    pub prepared: Vec<&'a PreparedWeights>,
    pub batch: usize,
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

    fn state_mut(&mut self, layer: usize, i: usize) -> &mut [f32];
}

pub trait Backend: Send + Sync {
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

    /// Writes the output rows (this direction's features of `output`) and returns the final states.
    fn forward(&self, job: &ForwardJob, output: &mut RowsMut) -> Result<ForwardResult>;

    /// Adds the adjoint of the input rows into `d_input` and returns the rest.
    fn backward(&self, job: &BackwardJob, tape: &Tape, d_input: &mut RowsMut) -> Result<BackwardResult>;

    /// Whether a training forward can keep its tape in memory the caller
    /// provides ([`Backend::forward_into_tape`]), laid out as the layer's
    /// program says ([`cellc::program::TapeLayout`]); `false` where this back
    /// end keeps its tape itself. A framework's autograd then holds the tape
    /// as one of its own tensors (cuDNN's "reserve space").
    fn keeps_tape_in_caller_memory(&self) -> bool {
        false
    }

    /// A training forward that keeps its tape in `tape` (the layout's rows
    /// times the program's tape floats per row); returns the final states.
    fn forward_into_tape(
        &self,
        job: &ForwardJob,
        output: &mut RowsMut,
        tape: &mut [f32],
    ) -> Result<Vec<Vec<f32>>> {
        let _ = (job, output, tape);
        Err(no_caller_tape(self.name()))
    }

    /// The backward of a [`Backend::forward_into_tape`], reading its tape.
    fn backward_from_tape(
        &self,
        job: &BackwardJob,
        tape: &[f32],
        d_input: &mut RowsMut,
    ) -> Result<BackwardResult> {
        let _ = (job, tape, d_input);
        Err(no_caller_tape(self.name()))
    }
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

    fn forward(&self, job: &ForwardJob, output: &mut RowsMut) -> Result<ForwardResult> {
        (**self).forward(job, output)
    }

    fn backward(&self, job: &BackwardJob, tape: &Tape, d_input: &mut RowsMut) -> Result<BackwardResult> {
        (**self).backward(job, tape, d_input)
    }

    fn keeps_tape_in_caller_memory(&self) -> bool {
        (**self).keeps_tape_in_caller_memory()
    }

    fn forward_into_tape(
        &self,
        job: &ForwardJob,
        output: &mut RowsMut,
        tape: &mut [f32],
    ) -> Result<Vec<Vec<f32>>> {
        (**self).forward_into_tape(job, output, tape)
    }

    fn backward_from_tape(
        &self,
        job: &BackwardJob,
        tape: &[f32],
        d_input: &mut RowsMut,
    ) -> Result<BackwardResult> {
        (**self).backward_from_tape(job, tape, d_input)
    }
}

/// Whole-model passes over device memory the caller owns, queued on the
/// caller's stream; the model has checked every buffer of the call.
pub trait DevicePasses {
    fn forward_on_device(
        &self,
        model: &crate::Model,
        batch: &crate::exec::LaidOutBatch,
        call: &crate::device_call::DeviceCall,
        out: &crate::device_call::DeviceForwardOut,
    ) -> Result<()>;

    fn backward_on_device(
        &self,
        model: &crate::Model,
        batch: &crate::exec::LaidOutBatch,
        call: &crate::device_call::DeviceCall,
        d_output: crate::device_call::DeviceFloats,
        d_final: Option<&[crate::device_call::DeviceFloats]>,
        out: &crate::device_call::DeviceBackwardOut,
    ) -> Result<()>;
}

fn no_caller_tape(backend: &str) -> crate::RuntimeError {
    crate::RuntimeError::Backend {
        backend: backend.into(),
        message: "this back end keeps its tape itself: it cannot keep one in the caller's memory".into(),
    }
}
