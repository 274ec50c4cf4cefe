//! Passes over host data on a device with memory of its own (CUDA): the
//! model's own ([`Model::forward`], [`Model::forward_traced`],
//! [`Model::backward`]) and a caller's host memory ([`crate::Call`]). The
//! host data is uploaded once, every layer and direction runs in device
//! memory through the driver, as a caller's device-memory pass does, and
//! only the results come back. A training forward's reserve (the tapes,
//! and the outputs between layers) stays on the device, held by its
//! [`crate::Trace`] until the backward: none of it crosses to the host (an
//! LSTM's tapes at B=64, T=100, H=256 are about 50 MB, each way, per
//! training step).

use crate::driver::{BackwardSpans, ForwardSpans, Run};
use crate::dropout::BetweenLayers;
use crate::error::{Result, RuntimeError};
use crate::exec::{DeviceReserve, Gradients, Keep, Kept, Output};
use crate::masks::CellMasking;
use crate::model::Model;
use crate::pass::{Buf, PassWeights};
use crate::sequence::LaidOutBatch;
use std::sync::{Arc, Mutex};

/// A layer-direction's parameters on the device, uploaded by the first
/// pass that reads them and kept in the model's prepared weights (which
/// the model empties whenever its parameters may change), so a model's
/// weights cross to the device once, not on every pass.
#[derive(Default)]
struct Uploaded(Mutex<Option<Arc<Vec<Buf>>>>);

/// The weights of a staged pass: the model's own, or the caller's host slices.
pub(crate) type HostWeights<'w> = Option<&'w [Vec<&'w [f32]>]>;

/// How a staged pass draws its masks: the dropout between layers and the cell's masks.
pub(crate) type Masking = (Option<BetweenLayers>, CellMasking);

impl Model {
    /// The weights of a staged pass on the device: the model's own
    /// (uploaded once, until they change), or the caller's, uploaded for
    /// this pass (`held` keeps them).
    fn staged_weights(&self, given: HostWeights, held: &mut Vec<Arc<Vec<Buf>>>) -> Result<PassWeights<'_>> {
        let upload = |params: &[&[f32]]| -> Result<Arc<Vec<Buf>>> {
            params.iter().map(|p| self.device.upload(p)).collect::<Result<Vec<_>>>().map(Arc::new)
        };
        if let Some(given) = given {
            self.check_weights(given)?;
            held.extend(given.iter().map(|ps| upload(ps)).collect::<Result<Vec<_>>>()?);
            return Ok(PassWeights::caller(spans(held)));
        }
        self.ensure_owns_weights()?;
        for (params, prepared) in self.params.iter().zip(&self.prepared) {
            let slot = prepared
                .get_or_init(Uploaded::default)
                .ok_or_else(|| RuntimeError::Internal("another device's form of a model's weights".into()))?;
            let mut kept =
                slot.0.lock().map_err(|_| RuntimeError::Internal("uploaded weights poisoned".into()))?;
            let params = match kept.as_ref() {
                Some(p) => p.clone(),
                None => kept.insert(upload(&params.iter().map(Vec::as_slice).collect::<Vec<_>>())?).clone(),
            };
            held.push(params);
        }
        Ok(PassWeights::model(spans(held), &self.prepared))
    }

    /// A forward pass over host data in the device's memory; with
    /// `training`, the reserve it keeps there for [`Model::backward_staged`].
    pub(crate) fn forward_staged(
        &self,
        p: &LaidOutBatch,
        (input, h0, weights): (&[f32], Option<&[&[f32]]>, HostWeights),
        masking: Masking,
        keep: Keep,
    ) -> Result<(Output, Option<DeviceReserve>)> {
        let device = self.device.as_ref();
        let batch = p.order.batch();
        let mut held = Vec::new();
        let weights = self.staged_weights(weights, &mut held)?;
        let mut run = Run::new(self, device, p, &weights);
        let input = device.upload(input)?;
        let h0 = h0.map(|h| h.iter().map(|s| device.upload(s)).collect::<Result<Vec<_>>>()).transpose()?;
        let output = run.buffer(p.rows * self.output_size())?;
        let finals = self
            .state_shapes(batch)
            .iter()
            .map(|s| run.buffer(s.iter().product()))
            .collect::<Result<Vec<_>>>()?;
        let training = !matches!(keep, Keep::Nothing);
        let reserve = training.then(|| run.buffer(p.rows * self.reserve_floats_per_row())).transpose()?;
        run.forward(ForwardSpans {
            input: input.span(),
            h0: h0.as_ref().map(|h| h.iter().map(Buf::span).collect()),
            output: output.span(),
            finals: finals.iter().map(Buf::span).collect(),
            reserve: reserve.as_ref().map(Buf::span),
            dropout: masking.0,
            masking: masking.1,
        })?;
        let out = Output {
            data: run.download(&output)?,
            final_states: finals.iter().map(|b| run.download(b)).collect::<Result<_>>()?,
        };
        if let (Keep::OnHost(to), Some(reserve)) = (keep, &reserve) {
            crate::sequence::check_len("reserve", to.len(), &[reserve.len])?;
            to.copy_from_slice(&run.download(reserve)?);
        }
        Ok((out, reserve.map(|reserve| DeviceReserve { input, reserve })))
    }

    /// The backward of a [`Model::forward_staged`] in training mode, from
    /// the reserve it kept on the device.
    pub(crate) fn backward_staged(
        &self,
        p: &LaidOutBatch,
        (kept, weights): (Kept, HostWeights),
        (d_output, d_final): (&[f32], Option<&[&[f32]]>),
        masking: Masking,
    ) -> Result<Gradients> {
        let device = self.device.as_ref();
        let batch = p.order.batch();
        let mut held = Vec::new();
        let weights = self.staged_weights(weights, &mut held)?;
        let mut run = Run::new(self, device, p, &weights);
        let uploaded;
        let kept = match kept {
            Kept::OnDevice(kept) => kept,
            Kept::OnHost(input, reserve) => {
                uploaded = DeviceReserve { input: device.upload(input)?, reserve: device.upload(reserve)? };
                &uploaded
            }
        };
        let d_output = device.upload(d_output)?;
        let d_final =
            d_final.map(|d| d.iter().map(|s| device.upload(s)).collect::<Result<Vec<_>>>()).transpose()?;
        let d_input = run.buffer(p.rows * self.input_size())?;
        let d_h0 = self
            .state_shapes(batch)
            .iter()
            .map(|s| run.buffer(s.iter().product()))
            .collect::<Result<Vec<_>>>()?;
        let d_params: Vec<Vec<Buf>> = self
            .param_lens()
            .iter()
            .map(|lens| lens.iter().map(|&n| run.buffer(n)).collect())
            .collect::<Result<_>>()?;
        run.backward(BackwardSpans {
            input: kept.input.span(),
            reserve: kept.reserve.span(),
            d_output: d_output.span(),
            d_final: d_final.as_ref().map(|d| d.iter().map(Buf::span).collect()),
            d_input: d_input.span(),
            d_h0: Some(d_h0.iter().map(Buf::span).collect()),
            d_params: d_params.iter().map(|ps| ps.iter().map(Buf::span).collect()).collect(),
            dropout: masking.0,
            masking: masking.1,
        })?;
        Ok(Gradients {
            d_input: run.download(&d_input)?,
            d_h0: d_h0.iter().map(|b| run.download(b)).collect::<Result<_>>()?,
            d_params: d_params
                .iter()
                .map(|ps| ps.iter().map(|b| run.download(b)).collect())
                .collect::<Result<_>>()?,
        })
    }
}

/// Each layer-direction's buffers as spans.
fn spans(held: &[Arc<Vec<Buf>>]) -> Vec<Vec<crate::pass::Span>> {
    held.iter().map(|ps| ps.iter().map(Buf::span).collect()).collect()
}
