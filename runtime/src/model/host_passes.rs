//! Passes over host memory (the model's own buffers, a caller's slices):
//! on a host device they run where the memory lies; on a device with
//! memory of its own (CUDA) they are staged there. What the pass reads is
//! uploaded once, every layer and direction runs in device memory through
//! the driver, as a caller's device-memory pass does, and what it writes is
//! downloaded into the caller's buffers. A model's own training forward may
//! keep its reserve (the tapes, and the outputs between layers) on the
//! device instead, held by its [`crate::Trace`] until the backward: none of
//! it then crosses to the host (an LSTM's tapes at B=64, T=100, H=256 are
//! about 50 MB, each way, per training step).

use crate::backend::cpu::host::{floats, floats_mut};
use crate::backend::Device;
use crate::error::{Result, RuntimeError};
use crate::model::driver::{BackwardSpans, ForwardSpans, Run};
use crate::model::Model;
use crate::options::Settled;
use crate::pass::{Buf, Memory, PassWeights, Span};
use crate::sequence::LaidOutBatch;
use cellc::precision::Precision;
use std::sync::{Arc, Mutex};

/// The weights of a pass over host memory: the model's own, or the caller's.
/// The caller's are checked ([`Model::check_weights`]) before the pass.
pub(crate) type HostWeights<'w> = Option<&'w [Vec<&'w [f32]>]>;

/// What a model's own training forward on a device keeps there for its
/// backward: the input it read, and its reserve.
#[derive(Debug)]
pub(crate) struct DeviceReserve {
    input: Buf,
    reserve: Buf,
}

/// A layer-direction's parameters on the device, uploaded by the first
/// pass that reads them and kept in the model's prepared weights (which
/// the model empties whenever its parameters may change), so a model's
/// weights cross to the device once, not on every pass.
#[derive(Default)]
struct Uploaded(Mutex<Option<Arc<Vec<Buf>>>>);

/// The weights of a pass over host memory as the model's device reads
/// them (the caller's checked by the caller): read in place on a host
/// device; on another, the model's own uploaded once (until they change)
/// or the caller's uploaded for this pass (`held` keeps them).
fn device_weights<'m>(
    model: &'m Model,
    given: HostWeights,
    held: &mut Vec<Arc<Vec<Buf>>>,
) -> Result<PassWeights<'m>> {
    let on_host = model.device.memory() == Memory::Host;
    if let Some(given) = given {
        if on_host {
            return Ok(PassWeights::caller(
                given.iter().map(|ps| ps.iter().map(|p| Span::of(p)).collect()).collect(),
            ));
        }
        held.extend(
            given.iter().map(|ps| upload_all(model.device.as_ref(), ps)).collect::<Result<Vec<_>>>()?,
        );
        return Ok(PassWeights::caller(spans(held)));
    }
    if on_host {
        return model.own_host_weights();
    }
    model.ensure_owns_weights()?;
    for (params, prepared) in model.params.iter().zip(&model.prepared) {
        let slot = prepared
            // Uploaded as they are, whatever the products' precision.
            .get_or_init(Precision::F32, Uploaded::default)
            .ok_or_else(|| RuntimeError::Internal("another device's form of a model's weights".into()))?;
        let mut kept =
            slot.0.lock().map_err(|_| RuntimeError::Internal("uploaded weights poisoned".into()))?;
        let params = match kept.as_ref() {
            Some(p) => p.clone(),
            None => {
                let slices: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
                kept.insert(upload_all(model.device.as_ref(), &slices)?).clone()
            }
        };
        held.push(params);
    }
    Ok(PassWeights::model(spans(held), &model.prepared))
}

/// A forward pass over host memory (`spans`, checked by the driver): in
/// place on a host device, else staged on the model's device, the
/// output, the final states and a reserve given in `spans` downloaded into
/// them. With `keep` (a training forward of the model's own, without a
/// reserve in `spans`), the reserve it keeps on the device, returned.
///
/// # Safety
/// Every span of `spans` is host memory that lives while this runs; those
/// it writes (output, final states, reserve) are the caller's alone.
pub(crate) unsafe fn forward(
    model: &Model,
    (p, settled): (&LaidOutBatch, &Settled),
    spans: ForwardSpans,
    weights: HostWeights,
    keep: bool,
) -> Result<Option<DeviceReserve>> {
    let device = model.device.as_ref();
    let mut held = Vec::new();
    let weights = device_weights(model, weights, &mut held)?;
    let mut run = Run::new(model, device, (p, settled), &weights);
    if device.memory() == Memory::Host {
        run.forward(spans)?;
        return Ok(None);
    }
    // SAFETY (block): the spans are host memory that lives, per the contract.
    let (input, h0) = unsafe {
        let h0 = spans.h0.as_ref().map(|h| h.iter().map(|&s| device.upload(floats(s))).collect());
        (device.upload(floats(spans.input))?, h0.transpose()?)
    };
    let output = run.buffer(spans.output.len)?;
    let finals: Vec<Buf> = spans.finals.iter().map(|s| run.buffer(s.len)).collect::<Result<_>>()?;
    let reserve = match (spans.reserve, keep) {
        (Some(r), _) => Some(run.buffer(r.len)?),
        (None, true) => Some(run.buffer(p.rows * model.reserve_floats_per_row())?),
        (None, false) => None,
    };
    let on_device = ForwardSpans {
        input: input.span(),
        h0: h0.as_ref().map(|h: &Vec<Buf>| h.iter().map(Buf::span).collect()),
        output: output.span(),
        finals: finals.iter().map(Buf::span).collect(),
        reserve: reserve.as_ref().map(Buf::span),
    };
    run.forward(on_device)?;
    // SAFETY (block): the written spans are the caller's alone, per the contract.
    unsafe {
        run.download(&output, floats_mut(spans.output))?;
        for (buf, &to) in finals.iter().zip(&spans.finals) {
            run.download(buf, floats_mut(to))?;
        }
        if let (Some(to), Some(buf)) = (spans.reserve, &reserve) {
            run.download(buf, floats_mut(to))?;
        }
    }
    Ok(match (keep, reserve) {
        (true, Some(reserve)) => Some(DeviceReserve { input, reserve }),
        _ => None,
    })
}

/// The backward of a [`forward`], over host memory (`spans`, checked by
/// the driver): in place on a host device, else staged on the model's
/// device, every gradient downloaded into `spans`. `kept`: the input and
/// reserve a model's own training forward kept on the device, read instead
/// of `spans`' input and reserve.
///
/// # Safety
/// As [`forward`]; the written spans are the gradients.
pub(crate) unsafe fn backward(
    model: &Model,
    (p, settled): (&LaidOutBatch, &Settled),
    spans: BackwardSpans,
    weights: HostWeights,
    kept: Option<&DeviceReserve>,
) -> Result<()> {
    let device = model.device.as_ref();
    let mut held = Vec::new();
    let weights = device_weights(model, weights, &mut held)?;
    let mut run = Run::new(model, device, (p, settled), &weights);
    if device.memory() == Memory::Host {
        return run.backward(spans);
    }
    let uploaded;
    let kept = match kept {
        Some(kept) => kept,
        None => {
            // SAFETY: host memory that lives, per the contract.
            let (input, reserve) = unsafe { (floats(spans.input), floats(spans.reserve)) };
            uploaded = DeviceReserve { input: device.upload(input)?, reserve: device.upload(reserve)? };
            &uploaded
        }
    };
    // SAFETY (block): the spans are host memory that lives, per the contract.
    let (d_output, d_final, h0) = unsafe {
        let upload = |spans: &Option<Vec<Span>>| {
            spans.as_ref().map(|d| d.iter().map(|&s| device.upload(floats(s))).collect()).transpose()
        };
        (device.upload(floats(spans.d_output))?, upload(&spans.d_final)?, upload(&spans.h0)?)
    };
    let d_input = run.buffer(spans.d_input.len)?;
    let d_h0: Option<Vec<Buf>> =
        spans.d_h0.as_ref().map(|d| d.iter().map(|s| run.buffer(s.len)).collect()).transpose()?;
    let d_params: Vec<Vec<Buf>> = spans
        .d_params
        .iter()
        .map(|ps| ps.iter().map(|s| run.buffer(s.len)).collect())
        .collect::<Result<_>>()?;
    run.backward(BackwardSpans {
        input: kept.input.span(),
        reserve: kept.reserve.span(),
        d_output: d_output.span(),
        h0: h0.as_ref().map(|d: &Vec<Buf>| d.iter().map(Buf::span).collect()),
        d_final: d_final.as_ref().map(|d: &Vec<Buf>| d.iter().map(Buf::span).collect()),
        d_input: d_input.span(),
        d_h0: d_h0.as_ref().map(|d| d.iter().map(Buf::span).collect()),
        d_params: d_params.iter().map(|ps| ps.iter().map(Buf::span).collect()).collect(),
    })?;
    // SAFETY (block): the written spans are the caller's alone, per the contract.
    unsafe {
        run.download(&d_input, floats_mut(spans.d_input))?;
        for (bufs, to) in d_h0.iter().zip(&spans.d_h0) {
            for (buf, &to) in bufs.iter().zip(to) {
                run.download(buf, floats_mut(to))?;
            }
        }
        for (buf, &to) in d_params.iter().flatten().zip(spans.d_params.iter().flatten()) {
            run.download(buf, floats_mut(to))?;
        }
    }
    Ok(())
}

/// Each of `data` uploaded.
fn upload_all(device: &dyn Device, data: &[&[f32]]) -> Result<Arc<Vec<Buf>>> {
    data.iter().map(|d| device.upload(d)).collect::<Result<Vec<_>>>().map(Arc::new)
}

/// Each layer-direction's buffers as spans.
fn spans(held: &[Arc<Vec<Buf>>]) -> Vec<Vec<Span>> {
    held.iter().map(|ps| ps.iter().map(Buf::span).collect()).collect()
}
