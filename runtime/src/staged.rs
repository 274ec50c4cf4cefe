//! The model's own passes ([`Model::forward`], [`Model::forward_traced`],
//! [`Model::backward`]) on a back end with a device (CUDA): the host data
//! is uploaded once, every layer and direction runs in device memory
//! through the driver, as a caller's device-memory pass does, and only the
//! results come back. A training forward's reserve (the tapes, and the
//! outputs between layers) stays on the device, held by its
//! [`crate::Trace`] until the backward: none of it crosses to the host
//! (an LSTM's tapes at B=64, T=100, H=256 are about 50 MB, each way, per
//! training step).

use crate::backend::cuda::device::Buf;
use crate::backend::DevicePasses;
use crate::driver::{BackwardSpans, ForwardSpans};
use crate::dropout::BetweenLayers;
use crate::error::Result;
use crate::exec::{DeviceReserve, Gradients, Output};
use crate::masks::CellMasking;
use crate::model::Model;
use crate::pass::Span;
use crate::sequence::LaidOutBatch;
use std::sync::Arc;

fn span(buf: &Buf) -> Span {
    Span { addr: buf.addr, len: buf.len }
}

/// Uploads each of `data`.
fn upload_each(passes: &dyn DevicePasses, data: &[Vec<f32>]) -> Result<Vec<Buf>> {
    data.iter().map(|d| passes.upload(d)).collect()
}

/// Zeroed device buffers of `lens` floats.
fn zeros_each(passes: &dyn DevicePasses, lens: impl IntoIterator<Item = usize>) -> Result<Vec<Buf>> {
    lens.into_iter().map(|n| passes.zeros(n)).collect()
}

fn download_each(passes: &dyn DevicePasses, bufs: &[Buf]) -> Result<Vec<Vec<f32>>> {
    bufs.iter().map(|b| passes.download(b)).collect()
}

impl Model {
    /// The model's own parameters on the device (uploaded once, until
    /// they change), by layer and direction.
    fn device_params(&self, passes: &dyn DevicePasses) -> Result<Vec<Arc<Vec<Buf>>>> {
        let own = self.own_params()?;
        (0..self.params.len())
            .map(|slot| {
                let (params, prepared) = own.slot(slot);
                passes.params(params, prepared)
            })
            .collect()
    }

    /// The device's target for a staged pass over `p`, on the device's own
    /// stream, reading the parameters at `params`.
    fn staged_target<'a>(
        &'a self,
        passes: &'a dyn DevicePasses,
        p: &'a LaidOutBatch,
        params: &[Arc<Vec<Buf>>],
    ) -> Result<Box<dyn crate::pass::PassTarget + 'a>> {
        let weights = params.iter().map(|ps| ps.iter().map(span).collect()).collect();
        passes.target(&self.compiled, &self.layers, p, weights, None)
    }

    /// A forward pass over host data in `passes`' device memory; with
    /// `training`, the reserve it keeps there for [`Model::backward_staged`].
    pub(crate) fn forward_staged(
        &self,
        passes: &dyn DevicePasses,
        p: &LaidOutBatch,
        (input, h0): (&[f32], Option<&[Vec<f32>]>),
        (dropout, masking): (Option<BetweenLayers>, CellMasking),
        training: bool,
    ) -> Result<(Output, Option<DeviceReserve>)> {
        let batch = p.order.batch();
        let params = self.device_params(passes)?;
        let input = passes.upload(input)?;
        let h0 = h0.map(|h| upload_each(passes, h)).transpose()?;
        let output = passes.zeros(p.rows * self.output_size())?;
        let finals = zeros_each(passes, self.state_shapes(batch).iter().map(|s| s.iter().product()))?;
        let reserve = match training {
            true => Some(passes.zeros(p.rows * self.reserve_floats_per_row())?),
            false => None,
        };
        let spans = ForwardSpans {
            input: span(&input),
            h0: h0.as_ref().map(|h| h.iter().map(span).collect()),
            output: span(&output),
            finals: finals.iter().map(span).collect(),
            reserve: reserve.as_ref().map(span),
            dropout,
            masking,
        };
        let mut target = self.staged_target(passes, p, &params)?;
        self.drive_forward(p, spans, target.as_mut())?;
        drop(target);
        let out = Output { data: passes.download(&output)?, final_states: download_each(passes, &finals)? };
        Ok((out, reserve.map(|reserve| DeviceReserve { input, reserve })))
    }

    /// The backward of a [`Model::forward_staged`] in training mode, from
    /// the reserve it kept on the device.
    pub(crate) fn backward_staged(
        &self,
        passes: &dyn DevicePasses,
        p: &LaidOutBatch,
        kept: &DeviceReserve,
        (d_output, d_final): (&[f32], Option<&[Vec<f32>]>),
        (dropout, masking): (Option<BetweenLayers>, CellMasking),
    ) -> Result<Gradients> {
        let batch = p.order.batch();
        let params = self.device_params(passes)?;
        let d_output = passes.upload(d_output)?;
        let d_final = d_final.map(|d| upload_each(passes, d)).transpose()?;
        let d_input = passes.zeros(p.rows * self.input_size())?;
        let d_h0 = zeros_each(passes, self.state_shapes(batch).iter().map(|s| s.iter().product()))?;
        let d_params: Vec<Vec<Buf>> = self
            .param_lens()
            .iter()
            .map(|lens| zeros_each(passes, lens.iter().copied()))
            .collect::<Result<_>>()?;
        let spans = BackwardSpans {
            input: span(&kept.input),
            reserve: span(&kept.reserve),
            d_output: span(&d_output),
            d_final: d_final.as_ref().map(|d| d.iter().map(span).collect()),
            d_input: span(&d_input),
            d_h0: Some(d_h0.iter().map(span).collect()),
            d_params: d_params.iter().map(|ps| ps.iter().map(span).collect()).collect(),
            dropout,
            masking,
        };
        let mut target = self.staged_target(passes, p, &params)?;
        self.drive_backward(p, spans, target.as_mut())?;
        drop(target);
        Ok(Gradients {
            d_input: passes.download(&d_input)?,
            d_h0: download_each(passes, &d_h0)?,
            d_params: d_params.iter().map(|ps| download_each(passes, ps)).collect::<Result<_>>()?,
        })
    }
}
