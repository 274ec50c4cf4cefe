//! Passes over device memory the caller owns: a framework's CUDA tensors
//! read and written where they lie, the pass's work queued on the caller's
//! stream after the framework's own and before what it queues next, with
//! no host wait. The same checks as [`crate::call`]'s host passes (every
//! buffer's length against its shape, named); the back end must run on a
//! device ([`crate::backend::DevicePasses`]: the CUDA back end).
//!
//! The back end keeps no tape in the caller's memory here: the backward
//! runs the forward again on the device, keeping its values until the
//! backward is done (no reserve).

use crate::backend::DevicePasses;
use crate::error::{Result, RuntimeError};
use crate::exec::{BatchShape, LaidOutBatch};
use crate::model::Model;
use crate::sequence::{check_len, Floats};

/// Floats in device memory: the address of the first, and how many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceFloats {
    pub addr: u64,
    pub len: usize,
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
}

/// Where a forward pass on the device writes: laid out as
/// [`crate::ForwardOut`]'s buffers (padding rows set to zero).
#[derive(Clone, Debug)]
pub struct DeviceForwardOut {
    pub output: DeviceFloats,
    pub final_states: Vec<DeviceFloats>,
}

/// Where a backward pass on the device writes: laid out as
/// [`crate::BackwardOut`]'s buffers, every one overwritten.
#[derive(Clone, Debug)]
pub struct DeviceBackwardOut {
    pub d_input: DeviceFloats,
    /// One buffer per state, or none: the initial states' gradients are not wanted.
    pub d_h0: Vec<DeviceFloats>,
    pub d_params: Vec<Vec<DeviceFloats>>,
}

impl Model {
    /// The back end's device passes, and the call's batch laid out with
    /// every buffer of the call checked.
    fn on_device(&self, call: &DeviceCall, training: bool) -> Result<(&dyn DevicePasses, LaidOutBatch)> {
        let passes = self.backend.device_passes().ok_or_else(|| RuntimeError::Backend {
            backend: self.backend.name().into(),
            message: "this back end runs on host memory: device memory needs the cuda back end".into(),
        })?;
        let p = self.lay_out(&call.shape, call.input.len)?;
        self.ensure_pass_fits(&p, training)?;
        self.check_weights(call.weights)?;
        if let Some(h0) = call.h0 {
            self.check_states(h0.len(), |i| h0[i].len, p.order.batch(), "h0")?;
        }
        Ok((passes, p))
    }

    /// A forward pass over device memory writing `out` (inference: what
    /// a backward reads is not kept; [`Model::backward_on_device`] runs the
    /// forward again).
    pub fn forward_on_device(&self, call: &DeviceCall, out: &DeviceForwardOut) -> Result<()> {
        let (passes, p) = self.on_device(call, false)?;
        check_len("output", out.output.len, &[p.rows, self.output_size()])?;
        let finals = &out.final_states;
        self.check_states(finals.len(), |i| finals[i].len, p.order.batch(), "final_states")?;
        passes.forward_on_device(self, &p, call, out)
    }

    /// The backward of a forward with the same `call`: `d_output` is laid
    /// out like the output, `d_final` (optional; `None`: zeros) like the
    /// final states.
    pub fn backward_on_device(
        &self,
        call: &DeviceCall,
        d_output: DeviceFloats,
        d_final: Option<&[DeviceFloats]>,
        out: &DeviceBackwardOut,
    ) -> Result<()> {
        let (passes, p) = self.on_device(call, true)?;
        let batch = p.order.batch();
        check_len("grad_output", d_output.len, &[p.rows, self.output_size()])?;
        check_len("grad_input", out.d_input.len, &[p.rows, self.input_size()])?;
        if let Some(d) = d_final {
            self.check_states(d.len(), |i| d[i].len, batch, "grad_final")?;
        }
        if !out.d_h0.is_empty() {
            self.check_states(out.d_h0.len(), |i| out.d_h0[i].len, batch, "grad_h0")?;
        }
        self.check_weights(&out.d_params).map_err(|e| match e {
            RuntimeError::Shape { tensor, expected, found } => {
                RuntimeError::Shape { tensor: format!("gradient of {tensor}"), expected, found }
            }
            other => other,
        })?;
        passes.backward_on_device(self, &p, call, d_output, d_final, out)
    }
}
