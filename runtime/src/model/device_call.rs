//! Passes over device memory the caller owns ([`Model::forward_into`] and
//! [`Model::backward_from`] given a [`DeviceCall`]): a framework's CUDA
//! tensors read and written where they lie, the pass's work queued on the
//! caller's stream after the framework's own and before what it queues
//! next, with no host wait. The same checks as [`crate::model::call`]'s host
//! passes (every buffer's length against its shape, named) and the same
//! driver; the device must have memory of its own
//! ([`crate::pass::Memory::Device`]: the CUDA device).
//!
//! A training forward keeps what the backward reads in a reserve of the
//! caller's device memory, laid out as a host pass's
//! ([`Model::reserve_floats_per_row`] floats per layout row), which the
//! framework's autograd holds between the two passes.

use crate::backend::Device;
use crate::error::{Result, RuntimeError};
use crate::input::BatchShape;
use crate::model::call::CallerMemory;
use crate::model::driver::{BackwardSpans, ForwardSpans, Run};
use crate::model::Model;
use crate::options::{CallOptions, Settled};
use crate::pass::{Memory, PassWeights, Span};
use crate::sequence::Floats;
use crate::sequence::LaidOutBatch;

/// Floats in device memory: the address of the first, and how many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceFloats {
    /// The device address of the first float.
    pub addr: u64,
    /// Floats in the buffer.
    pub len: usize,
}

impl DeviceFloats {
    /// A host slice as the emulated device's memory (which is the host's), to read.
    pub fn emulated(data: &[f32]) -> DeviceFloats {
        DeviceFloats { addr: data.as_ptr() as u64, len: data.len() }
    }

    /// A host slice as the emulated device's memory, to write (its address
    /// taken from the mutable borrow).
    pub fn emulated_mut(data: &mut [f32]) -> DeviceFloats {
        DeviceFloats { addr: data.as_mut_ptr() as u64, len: data.len() }
    }
}

impl Floats for DeviceFloats {
    fn floats(&self) -> usize {
        self.len
    }
}

/// The inputs of a pass on device memory.
#[derive(Clone, Copy, Debug)]
pub struct DeviceCall<'a> {
    /// The batch's shape and lengths (or a packed batch's sizes and
    /// permutations), on the host as PyTorch keeps them.
    pub shape: BatchShape<'a>,
    /// The batch's data, laid out as `shape` says.
    pub input: DeviceFloats,
    /// `[layer * directions + direction][param]`, in the cell's order and
    /// the model's shapes ([`Model::weight_names`]).
    pub weights: &'a [Vec<DeviceFloats>],
    /// Initial states, `[layers * directions, B, size]` each; `None`: zeros.
    pub h0: Option<&'a [DeviceFloats]>,
    /// The stream the pass is queued on (a `CUstream` handle; 0 is the
    /// legacy default stream). Ignored by a device without streams.
    pub stream: u64,
    /// How it runs, as [`crate::Call::options`] (its resets on the host).
    pub options: CallOptions<'a>,
}

/// Where a forward pass on the device writes: laid out as
/// [`crate::ForwardOut`]'s buffers (padding rows set to zero).
#[derive(Clone, Debug)]
pub struct DeviceForwardOut {
    /// Laid out like the input, `output_size` features per row.
    pub output: DeviceFloats,
    /// One buffer per state, `[layers * directions, B, size]`.
    pub final_states: Vec<DeviceFloats>,
}

/// Where a backward pass on the device writes: laid out as
/// [`crate::BackwardOut`]'s buffers, every one overwritten.
#[derive(Clone, Debug)]
pub struct DeviceBackwardOut {
    /// The input's gradient, laid out like the input.
    pub d_input: DeviceFloats,
    /// One buffer per state, or none: the initial states' gradients are not wanted.
    pub d_h0: Vec<DeviceFloats>,
    /// The parameters' gradients, `[layer * directions + direction][param]`,
    /// each shaped as its parameter.
    pub d_params: Vec<Vec<DeviceFloats>>,
}

impl crate::model::call::sealed::Sealed for DeviceCall<'_> {}

/// A device call's batch, weights and device ([`DeviceCall::on_device`]).
type OnDevice<'m> = (Option<Box<dyn Device + 'm>>, (LaidOutBatch, Settled), PassWeights<'m>);

impl DeviceCall<'_> {
    /// The call's batch laid out, its weights checked (the driver checks
    /// the other buffers), and the model's device on the call's stream
    /// (where it has streams) with its scratch memory ordered there.
    fn on_device<'m>(&self, model: &'m Model, training: bool) -> Result<OnDevice<'m>> {
        if model.device.memory() != Memory::Device {
            return Err(RuntimeError::Backend {
                backend: model.device.name().into(),
                message: "this device runs on host memory: device memory needs the cuda device".into(),
            });
        }
        let p = model.lay_out(&self.shape, self.input.len)?.with_resets(self.options.resets)?;
        model.ensure_pass_fits(&p, training)?;
        model.check_weights(self.weights)?;
        let weights = PassWeights::caller(
            self.weights.iter().map(|ps| ps.iter().copied().map(span).collect()).collect(),
        );
        let settled = model.settle(&self.options)?;
        Ok((model.device.on_stream(self.stream)?, (p, settled), weights))
    }
}

fn span(f: DeviceFloats) -> Span {
    Span { addr: f.addr, len: f.len }
}

impl CallerMemory for DeviceCall<'_> {
    type Floats<'f> = DeviceFloats;
    type Reserve<'r> = DeviceFloats;
    type ReserveMut<'r> = DeviceFloats;
    type ForwardOut<'o> = &'o DeviceForwardOut;
    type BackwardOut<'o> = &'o DeviceBackwardOut;

    fn forward(&self, model: &Model, out: &DeviceForwardOut, reserve: Option<DeviceFloats>) -> Result<()> {
        let (on_stream, (p, settled), weights) = self.on_device(model, reserve.is_some())?;
        let finals = &out.final_states;
        let spans = ForwardSpans {
            input: span(self.input),
            h0: self.h0.map(|h| h.iter().copied().map(span).collect()),
            output: span(out.output),
            finals: finals.iter().copied().map(span).collect(),
            reserve: reserve.map(span),
        };
        let device = on_stream.as_deref().unwrap_or(model.device.as_ref());
        Run::new(model, device, (&p, &settled), &weights).forward(spans)
    }

    fn backward(
        &self,
        model: &Model,
        reserve: DeviceFloats,
        d_output: DeviceFloats,
        d_final: Option<&[DeviceFloats]>,
        out: &DeviceBackwardOut,
    ) -> Result<()> {
        let (on_stream, (p, settled), weights) = self.on_device(model, true)?;
        let spans = BackwardSpans {
            input: span(self.input),
            reserve: span(reserve),
            d_output: span(d_output),
            h0: self.h0.map(|h| h.iter().copied().map(span).collect()),
            d_final: d_final.map(|d| d.iter().copied().map(span).collect()),
            d_input: span(out.d_input),
            d_h0: (!out.d_h0.is_empty()).then(|| out.d_h0.iter().copied().map(span).collect()),
            d_params: out.d_params.iter().map(|ps| ps.iter().copied().map(span).collect()).collect(),
        };
        let device = on_stream.as_deref().unwrap_or(model.device.as_ref());
        Run::new(model, device, (&p, &settled), &weights).backward(spans)
    }
}
