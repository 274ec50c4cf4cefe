//! Whole-model passes over the caller's device memory
//! ([`crate::device_call`]): every layer and direction run by
//! [`forward_on`] / [`backward_on`] on the device as it works on the
//! caller's stream ([`Device::on_stream`]), with nothing copied to or from
//! the host but pointer tables.
//!
//! As in [`crate::exec`], layer `k` reads layer `k-1`'s output, and a
//! bidirectional layer writes its directions' outputs side by side (here
//! straight into the caller's output, or into device buffers for the
//! layers between). The backward runs the forward again, keeping each
//! layer's tapes on the device, then goes down the layers, each layer's
//! input adjoint becoming the adjoint of the output below.

use super::backward::{backward_on, BackwardIo};
use super::device::{Buf, Call, Device};
use super::forward::{forward_on, tape, CudaTape, ForwardIo};
use super::storage::{Home, LayerRun};
use super::Cuda;
use crate::backend::DevicePasses;
use crate::device_call::{DeviceBackwardOut, DeviceCall, DeviceFloats, DeviceForwardOut};
use crate::error::Result;
use crate::exec::LaidOutBatch;
use crate::model::{Layer, Model};

/// What a forward over the layers leaves: the buffers between layers
/// (layer `k`'s output, read by layer `k + 1`) and, training, each layer
/// and direction's tape.
struct Forwarded {
    between: Vec<Buf>,
    tapes: Vec<CudaTape>,
}

/// A model's pass on one device (the caller's stream, or the device itself).
struct ModelRun<'a> {
    cuda: &'a Cuda,
    device: &'a dyn Device,
    model: &'a Model,
    batch: &'a LaidOutBatch,
    call: &'a DeviceCall<'a>,
}

impl ModelRun<'_> {
    fn sequences(&self) -> usize {
        self.batch.order.batch()
    }

    /// Sets `floats` floats from `addr` to zero, on the device.
    fn zero(&self, addr: u64, floats: usize) -> Result<()> {
        let Some(layer) = self.model.layers.first() else { return Ok(()) };
        let kernels = self.cuda.kernels(&self.model.compiled, layer)?;
        self.device.run(&kernels.module, &[Call::Zero { addr, floats }], false)
    }

    /// State buffers `[layers * directions, B, size]` given, or zeros made for the pass (kept in `scratch`).
    fn states_or_zeros(&self, given: Option<&[DeviceFloats]>, scratch: &mut Vec<Buf>) -> Result<Vec<u64>> {
        if let Some(g) = given {
            return Ok(g.iter().map(|s| s.addr).collect());
        }
        let ld = self.model.layers.len() * self.model.directions();
        let sizes = &self.model.layers[0].state_sizes;
        sizes
            .iter()
            .map(|&n| {
                let buf = self.device.zeros(ld * self.sequences() * n)?;
                let addr = buf.addr;
                scratch.push(buf);
                Ok(addr)
            })
            .collect()
    }

    /// The addresses of `slot`'s `[B, n]` rows in each `[layers * directions, B, n]`
    /// state buffer at `states` (the states of `layer`).
    fn slot_rows(&self, layer: &Layer, states: &[u64], slot: usize) -> Vec<u64> {
        let batch = self.sequences();
        states.iter().zip(&layer.state_sizes).map(|(&at, &n)| at + 4 * (slot * batch * n) as u64).collect()
    }

    /// Layer `k`'s input: the call's input, or the buffer below.
    fn layer_input(&self, k: usize, between: &[Buf]) -> Home {
        let base = match k {
            0 => self.call.input.addr,
            _ => between[k - 1].addr,
        };
        Home::Layout { base, width: self.model.layers[k].input_size }
    }

    /// Every layer and direction forwards, the last layer's output into
    /// `output` (zeroed first: padding rows stay zero) and the final
    /// states into `finals`; with `training`, each pass's tape is kept.
    fn forward(&self, h0: &[u64], output: u64, finals: &[u64], training: bool) -> Result<Forwarded> {
        let model = self.model;
        let (dirs, rows) = (model.directions(), self.batch.rows);
        let mut run = Forwarded { between: Vec::new(), tapes: Vec::new() };
        for (k, layer) in model.layers.iter().enumerate() {
            let kernels = self.cuda.kernels(&model.compiled, layer)?;
            let width = layer.output_size * dirs;
            let out = if k + 1 == model.layers.len() {
                self.zero(output, rows * width)?;
                output
            } else {
                let buf = self.device.zeros(rows * width)?;
                let addr = buf.addr;
                run.between.push(buf);
                addr
            };
            let input = self.layer_input(k, &run.between);
            for d in 0..dirs {
                let slot = k * dirs + d;
                let mut pass =
                    LayerRun::new(self.device, &self.batch.layout, rows, &self.batch.order, d == 1);
                let io = ForwardIo {
                    input,
                    params: self.call.weights[slot].iter().map(|w| w.addr).collect(),
                    h0: self.slot_rows(layer, h0, slot),
                    output: Home::Layout { base: out + 4 * (d * layer.output_size) as u64, width },
                    finals: self.slot_rows(layer, finals, slot),
                };
                let cell = (model.compiled.as_ref(), layer);
                let ran = forward_on(
                    &mut pass,
                    &kernels.module,
                    &kernels.forward,
                    cell,
                    training,
                    &io,
                    self.cuda.graphs,
                )?;
                if training {
                    run.tapes.push(tape(pass, &model.compiled, layer, &io, ran)?);
                }
            }
        }
        Ok(run)
    }
}

impl Cuda {
    /// The device a pass over the caller's memory runs on: this one on the
    /// call's stream, or this one as it is if it has no streams.
    fn run_on<'a>(&'a self, view: &'a Option<Box<dyn Device + 'a>>) -> &'a dyn Device {
        view.as_deref().unwrap_or(self.device.as_ref())
    }
}

impl DevicePasses for Cuda {
    fn forward_on_device(
        &self,
        model: &Model,
        batch: &LaidOutBatch,
        call: &DeviceCall,
        out: &DeviceForwardOut,
    ) -> Result<()> {
        let view = self.device.on_stream(call.stream)?;
        let run = ModelRun { cuda: self, device: self.run_on(&view), model, batch, call };
        let finals: Vec<u64> = out.final_states.iter().map(|f| f.addr).collect();
        let mut scratch = Vec::new();
        let h0 = run.states_or_zeros(call.h0, &mut scratch)?;
        if run.sequences() == 0 {
            return Ok(());
        }
        run.forward(&h0, out.output.addr, &finals, false)?;
        Ok(())
    }

    fn backward_on_device(
        &self,
        model: &Model,
        batch: &LaidOutBatch,
        call: &DeviceCall,
        d_output: DeviceFloats,
        d_final: Option<&[DeviceFloats]>,
        out: &DeviceBackwardOut,
    ) -> Result<()> {
        let view = self.device.on_stream(call.stream)?;
        let run = ModelRun { cuda: self, device: self.run_on(&view), model, batch, call };
        let (dirs, rows) = (model.directions(), batch.rows);
        if run.sequences() == 0 {
            for d in out.d_params.iter().flatten().chain(&out.d_h0).chain([&out.d_input]) {
                run.zero(d.addr, d.len)?;
            }
            return Ok(());
        }
        // The forward again, into scratch, keeping its tapes.
        let mut scratch = Vec::new();
        let h0 = run.states_or_zeros(call.h0, &mut scratch)?;
        let d_final = run.states_or_zeros(d_final, &mut scratch)?;
        let output = run.device.zeros(rows * model.output_size())?;
        let finals = run.states_or_zeros(None, &mut scratch)?;
        let forwarded = run.forward(&h0, output.addr, &finals, true)?;
        // Initial-state gradients the caller does not want go to scratch.
        let d_h0 = match &out.d_h0[..] {
            [] => run.states_or_zeros(None, &mut scratch)?,
            given => given.iter().map(|d| d.addr).collect(),
        };

        // Down the layers: each layer's input adjoint is the output adjoint below.
        let mut d_above = d_output.addr;
        for (k, layer) in model.layers.iter().enumerate().rev() {
            let kernels = self.kernels(&model.compiled, layer)?;
            let d_in = if k == 0 {
                run.zero(out.d_input.addr, out.d_input.len)?;
                out.d_input.addr
            } else {
                let buf = run.device.zeros(rows * layer.input_size)?;
                let addr = buf.addr;
                scratch.push(buf);
                addr
            };
            let width = layer.output_size * dirs;
            for d in 0..dirs {
                let slot = k * dirs + d;
                let mut pass = LayerRun::new(run.device, &batch.layout, rows, &batch.order, d == 1);
                let io = BackwardIo {
                    d_output: Home::Layout { base: d_above + 4 * (d * layer.output_size) as u64, width },
                    d_final: run.slot_rows(layer, &d_final, slot),
                    d_input: Home::Layout { base: d_in, width: layer.input_size },
                    d_params: out.d_params[slot].iter().map(|p| p.addr).collect(),
                    d_h0: run.slot_rows(layer, &d_h0, slot),
                };
                let cell = (model.compiled.as_ref(), layer);
                backward_on(
                    &mut pass,
                    &kernels.module,
                    &kernels.backward,
                    cell,
                    &forwarded.tapes[slot],
                    &io,
                    self.graphs,
                )?;
            }
            d_above = d_in;
        }
        Ok(())
    }
}
