//! The custom op behind [`crate::Rnn`]: one candle `CustomOp3` whose
//! three operands are the input, every weight in one flat buffer, and
//! every initial state in one flat buffer (empty: zeros), and whose one
//! result is the output, followed by the final states when they are asked
//! for. The batch's lengths and layout are the op's own fields (they are
//! not differentiated). A training forward keeps the back end's tapes in
//! a reserve owned by the op, which candle's graph holds until the
//! backward (cuDNN's reserve space); an inference forward keeps none.

use crate::batch::Padded;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use cellc_runtime::{BackwardOut, Call, CallOptions, ForwardOut, MaskSeed, Model, RuntimeError};
use std::sync::{Arc, Mutex};

/// One forward pass of a model over one padded batch.
pub(crate) struct RnnOp {
    pub model: Arc<Model>,
    pub batch: Padded,
    /// The result holds the final states after the output.
    pub with_finals: bool,
    /// Keep what the backward reads (a training pass).
    pub keep: bool,
    /// Training mode: where the model's dropout masks are drawn (the same
    /// in the backward); `None`: evaluation mode.
    pub masks: Option<MaskSeed>,
    /// The cell's rates for this pass (`None`: the model's).
    pub rates: Option<Vec<f32>>,
    /// What a training forward kept for its backward.
    pub reserve: Mutex<Vec<f32>>,
}

impl Drop for RnnOp {
    fn drop(&mut self) {
        if let Ok(reserve) = self.reserve.get_mut() {
            cellc_runtime::pool::give(std::mem::take(reserve));
        }
    }
}

/// A runtime error as candle's, kept whole (`Error::Wrapped`, downcastable).
fn wrap(e: RuntimeError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

fn poisoned() -> candle_core::Error {
    wrap(RuntimeError::Internal("a panic while a cellc_rnn pass held its reserve".into()))
}

/// The floats of a contiguous f32 tensor on the CPU.
fn floats<'a>(storage: &'a CpuStorage, layout: &Layout, name: &str) -> candle_core::Result<&'a [f32]> {
    let all = storage.as_slice::<f32>().map_err(|_| {
        wrap(RuntimeError::Shape {
            tensor: name.into(),
            expected: "f32 values".into(),
            found: format!("{:?}", storage.dtype()),
        })
    })?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&all[start..end]),
        None => Err(candle_core::Error::RequiresContiguous { op: "cellc_rnn" }),
    }
}

/// Runs `f` on the CPU floats of `tensors`.
fn with_floats<R>(
    tensors: [(&Tensor, &str); 3],
    f: impl FnOnce([&[f32]; 3]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let guards = tensors.map(|(t, _)| t.storage_and_layout());
    let mut read = [&[][..]; 3];
    for (i, (storage, layout)) in guards.iter().enumerate() {
        let candle_core::Storage::Cpu(cpu) = &**storage else {
            return Err(wrap(RuntimeError::Shape {
                tensor: tensors[i].1.into(),
                expected: "a tensor on the CPU".into(),
                found: format!("{:?}", tensors[i].0.device().location()),
            }));
        };
        read[i] = floats(cpu, layout, tensors[i].1)?;
    }
    f(read)
}

/// Splits `data` into consecutive pieces of `lens`.
fn split<'a>(mut data: &'a [f32], lens: &[usize]) -> Vec<&'a [f32]> {
    lens.iter()
        .map(|&n| {
            let (head, rest) = data.split_at(n.min(data.len()));
            data = rest;
            head
        })
        .collect()
}

/// Splits `data` into consecutive mutable pieces of `lens`.
fn split_mut<'a>(mut data: &'a mut [f32], lens: &[usize]) -> Vec<&'a mut [f32]> {
    lens.iter()
        .map(|&n| {
            let all = std::mem::take(&mut data);
            let (head, rest) = all.split_at_mut(n.min(all.len()));
            data = rest;
            head
        })
        .collect()
}

impl RnnOp {
    /// Floats of each weight, in [`Model::weight_names`]' order.
    fn weight_lens(&self) -> Vec<usize> {
        self.model.weight_names().iter().map(|(_, shape)| shape.iter().product()).collect()
    }

    /// Floats of each state, `[layers * directions, B, size]`.
    pub fn state_lens(&self) -> Vec<usize> {
        self.model.state_shapes(self.batch.batch).iter().map(|shape| shape.iter().product()).collect()
    }

    /// Floats of the output, `B * T * output_size`.
    pub fn output_len(&self) -> usize {
        self.batch.batch * self.batch.steps * self.model.output_size()
    }

    /// The result's shape: the output's, or flat with the final states after it.
    fn result_shape(&self) -> Shape {
        if self.with_finals {
            Shape::from(self.output_len() + self.state_lens().iter().sum::<usize>())
        } else {
            Shape::from(self.batch.output_dims(self.model.output_size()).to_vec())
        }
    }

    /// Floats of the reserve a training forward keeps.
    fn reserve_len(&self) -> candle_core::Result<usize> {
        let per_row = self.model.reserve_floats_per_row();
        Ok(per_row * self.batch.batch * self.batch.steps)
    }

    /// The three operands' floats, checked against the weights' and states' sizes.
    fn operands<'a>(&self, [x, w, h0]: [&'a [f32]; 3]) -> candle_core::Result<Operands<'a>> {
        let lens = self.weight_lens();
        let total: usize = lens.iter().sum();
        if w.len() != total {
            return Err(wrap(RuntimeError::Shape {
                tensor: "weights".into(),
                expected: format!("{total} floats (every weight of the model, flat)"),
                found: format!("{} floats", w.len()),
            }));
        }
        let weights = self.model.group_by_slot(split(w, &lens)).map_err(wrap)?;
        let state_lens = self.state_lens();
        let total: usize = state_lens.iter().sum();
        if !h0.is_empty() && h0.len() != total {
            return Err(wrap(RuntimeError::Shape {
                tensor: "h0".into(),
                expected: format!("{total} floats (every initial state, flat)"),
                found: format!("{} floats", h0.len()),
            }));
        }
        let h0 = if h0.is_empty() { Vec::new() } else { split(h0, &state_lens) };
        Ok(Operands { x, weights, h0 })
    }
}

/// The operands of a pass, read.
struct Operands<'a> {
    x: &'a [f32],
    weights: Vec<Vec<&'a [f32]>>,
    h0: Vec<&'a [f32]>,
}

impl Operands<'_> {
    /// The call over these operands of `batch`, drawing `masks` at `rates` (training).
    fn call<'c>(
        &'c self,
        batch: &'c Padded,
        (masks, rates): (Option<MaskSeed>, Option<&'c [f32]>),
    ) -> Call<'c> {
        Call {
            input: batch.input(self.x),
            weights: Some(&self.weights),
            h0: (!self.h0.is_empty()).then_some(&self.h0[..]),
            options: CallOptions { masks, rates, resets: batch.resets.as_deref(), ..Default::default() },
        }
    }
}

impl CustomOp3 for RnnOp {
    fn name(&self) -> &'static str {
        "cellc_rnn"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let read = [floats(s1, l1, "input")?, floats(s2, l2, "weights")?, floats(s3, l3, "h0")?];
        let operands = self.operands(read)?;
        let shape = self.result_shape();
        let state_lens = self.state_lens();
        // Candle keeps the result and frees it itself: a pooled buffer
        // would never come back, and the pool would make a fresh one for
        // its next taker. Fresh zeroed memory is mapped lazily instead.
        let mut result = vec![0.0f32; shape.elem_count()];
        // Final states nobody asked for still go somewhere.
        let mut unwanted: Vec<Vec<f32>> =
            if self.with_finals { Vec::new() } else { state_lens.iter().map(|&n| vec![0.0; n]).collect() };
        let (output, finals) = result.split_at_mut(self.output_len());
        let final_states = if self.with_finals {
            split_mut(finals, &state_lens)
        } else {
            unwanted.iter_mut().map(Vec::as_mut_slice).collect()
        };
        let mut reserve = if self.keep { cellc_runtime::pool::take(self.reserve_len()?) } else { Vec::new() };
        let keep = self.keep.then_some(&mut reserve[..]);
        self.model
            .forward_into(
                &operands.call(&self.batch, (self.masks, self.rates.as_deref())),
                ForwardOut { output, final_states },
                keep,
            )
            .map_err(wrap)?;
        if self.keep {
            *self.reserve.lock().map_err(|_| poisoned())? = reserve;
        }
        Ok((CpuStorage::F32(result), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        h0: &Tensor,
        _result: &Tensor,
        grad_result: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad_result = grad_result.contiguous()?;
        let reserve = self.reserve.lock().map_err(|_| poisoned())?;
        let (d_x, d_w, d_h0) = with_floats([(x, "input"), (w, "weights"), (h0, "h0")], |read| {
            let operands = self.operands(read)?;
            let (grad_storage, grad_layout) = grad_result.storage_and_layout();
            let candle_core::Storage::Cpu(grad_cpu) = &*grad_storage else {
                return Err(candle_core::Error::Msg("cellc_rnn: the gradient is not on the CPU".into()));
            };
            let grad = floats(grad_cpu, grad_layout, "grad_output")?;
            let (d_output, d_final) = grad.split_at(self.output_len().min(grad.len()));
            let d_final = self.with_finals.then(|| split(d_final, &self.state_lens()));
            let mut d_x = vec![0.0f32; read[0].len()];
            let mut d_w = vec![0.0f32; read[1].len()];
            let mut d_h0 = vec![0.0f32; read[2].len()];
            let out = BackwardOut {
                d_input: &mut d_x,
                d_h0: if d_h0.is_empty() { Vec::new() } else { split_mut(&mut d_h0, &self.state_lens()) },
                d_params: self.model.group_by_slot(split_mut(&mut d_w, &self.weight_lens())).map_err(wrap)?,
            };
            self.model
                .backward_from(
                    &operands.call(&self.batch, (self.masks, self.rates.as_deref())),
                    &reserve,
                    d_output,
                    d_final.as_deref(),
                    out,
                )
                .map_err(wrap)?;
            Ok((d_x, d_w, d_h0))
        })?;
        let d_h0 = (!d_h0.is_empty()).then(|| Tensor::from_vec(d_h0, h0.shape(), h0.device())).transpose()?;
        Ok((
            Some(Tensor::from_vec(d_x, x.shape(), x.device())?),
            Some(Tensor::from_vec(d_w, w.shape(), w.device())?),
            d_h0,
        ))
    }
}
