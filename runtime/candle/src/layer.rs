//! [`Rnn`]: a cellc model as a candle layer. Its weights are candle
//! tensors taken from a `VarBuilder` under PyTorch's `state_dict` names
//! (`weight_ih_l0`, ..., `_reverse` for the second direction), so a
//! `VarMap` trains, saves and loads them like any candle-nn layer's.

use crate::batch::Padded;
use crate::error::Result;
use crate::op::RnnOp;
use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, VarBuilder};
use cellc_runtime::{Align, Major, Model, RuntimeError};
use std::sync::{Arc, Mutex};

/// Where a padded batch's sequences sit: which axis is the batch's, and
/// at which end of the time axis each sequence's real steps are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Padding {
    /// Batch-first (`[B, T, F]`) or time-first (`[T, B, F]`).
    pub major: Major,
    /// A sequence's steps at the start of the time axis (left) or at its end (right).
    pub align: Align,
}

impl Default for Padding {
    /// `[B, T, features]`, each sequence from step 0 (padding at the end).
    fn default() -> Padding {
        Padding { major: Major::BatchFirst, align: Align::Left }
    }
}

/// A cellc RNN (any `.cell`, any layers and directions) as a candle layer:
/// made from a [`Model`] and a `VarBuilder` ([`Rnn::new`]), run on a padded
/// batch and its lengths ([`Rnn::forward`], [`Rnn::forward_with_states`]),
/// differentiated by candle's autograd. The crate's documentation has an
/// example.
#[derive(Clone)]
pub struct Rnn {
    model: Arc<Model>,
    /// Every weight, in [`Model::weight_names`]' order, with its name.
    weights: Vec<(String, Tensor)>,
    /// The cell's rates ([`Rnn::with_rates`]); `None`: the model's.
    rates: Option<Vec<f32>>,
}

impl std::fmt::Debug for Rnn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rnn")
            .field("cell", &self.model.compiled().forward.name)
            .field("layers", &self.model.layers().len())
            .field("directions", &self.model.directions())
            .field("weights", &self.weights.iter().map(|(n, t)| (n, t.dims())).collect::<Vec<_>>())
            .finish()
    }
}

impl Rnn {
    /// The RNN of `model` (its cell, sizes, layers, directions and back
    /// end), with every weight from `vb` under its PyTorch name. A weight
    /// `vb` does not hold yet (a fresh `VarMap`) is made there with the
    /// model's own initial values: the cell's init clauses, from the seed
    /// the model was made with, so runs are reproducible.
    pub fn new(model: Model, vb: VarBuilder) -> Result<Rnn> {
        if vb.dtype() != DType::F32 {
            return Err(RuntimeError::Shape {
                tensor: "weights".into(),
                expected: "f32 (cellc's kernels are float32)".into(),
                found: format!("{:?}", vb.dtype()),
            }
            .into());
        }
        let initial = model.weights();
        let mut weights = Vec::new();
        for (name, shape) in model.weight_names() {
            let fresh = !vb.contains_tensor(&name);
            let t = vb.get_with_hints(shape.clone(), &name, Init::Const(0.0))?;
            if fresh {
                if let Some(init) = initial.get(&name) {
                    t.slice_set(&Tensor::from_slice(&init.data, shape, vb.device())?, 0, 0)?;
                }
            }
            weights.push((name, t));
        }
        Ok(Rnn { model: Arc::new(model), weights, rates: None })
    }

    /// The runtime's model: its sizes, layers and back end (its own
    /// weights are not used; the layer's tensors are).
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Every weight with its PyTorch name, in the model's order.
    pub fn weights(&self) -> &[(String, Tensor)] {
        &self.weights
    }

    /// The same layer over detached weights: no gradient is tracked, and
    /// a forward keeps nothing for a backward (evaluation, sampling).
    pub fn detach(&self) -> Rnn {
        Rnn {
            model: self.model.clone(),
            weights: self.weights.iter().map(|(n, t)| (n.clone(), t.detach())).collect(),
            rates: self.rates.clone(),
        }
    }

    /// The output (`[B, T, output]` or `[T, B, output]`, as the input;
    /// zero at padding) of `x` (`[B, T, input]` or `[T, B, input]`),
    /// whose sequence `b` has `lengths[b]` real steps; states start at zero.
    /// The layer with the cell's rates named in `rates` set (the others
    /// keep theirs): each a `rate` of the cell, in `[0, 1)`
    /// ([`Model::rates_with`]). Training passes ([`Rnn::forward_t`]) draw
    /// the cell's masks at these rates; evaluation uses them too (zoneout's
    /// expectation).
    pub fn with_rates(mut self, rates: &[(&str, f32)]) -> Result<Rnn> {
        self.rates = Some(self.model.change_rates(self.rates(), rates)?);
        Ok(self)
    }

    /// The cell's rates this layer runs at, in [`Model::rate_names`]' order.
    pub fn rates(&self) -> &[f32] {
        self.rates.as_deref().unwrap_or(self.model.rates())
    }

    /// Evaluation mode: the model's dropout ([`Model::with_dropout`]) drops nothing.
    pub fn forward(&self, x: &Tensor, lengths: &[usize], padding: Padding) -> Result<Tensor> {
        self.run((x, None), lengths, padding, None, false, false).map(|(out, _)| out)
    }

    /// As [`Rnn::forward`], in training mode where `train` (candle's
    /// `ModuleT::forward_t`): the model's dropout between layers drops,
    /// each call drawing new masks ([`Model::next_mask_seed`]: the model's
    /// seed, so a run is reproducible).
    pub fn forward_t(&self, x: &Tensor, lengths: &[usize], padding: Padding, train: bool) -> Result<Tensor> {
        self.run((x, None), lengths, padding, None, false, train).map(|(out, _)| out)
    }

    /// As [`Rnn::forward`], from the initial states `h0` (one tensor per
    /// state of the cell, `[layers * directions, B, size]`, as nn.LSTM's
    /// `(h0, c0)`; `None`: zeros), and with the final states after each
    /// sequence's last real step (the same shapes). Gradients reach `h0`.
    pub fn forward_with_states(
        &self,
        x: &Tensor,
        lengths: &[usize],
        padding: Padding,
        h0: Option<&[Tensor]>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        self.run((x, None), lengths, padding, h0, true, false)
    }

    /// As [`Rnn::forward_with_states`], in training mode where `train` (see [`Rnn::forward_t`]).
    pub fn forward_with_states_t(
        &self,
        x: &Tensor,
        lengths: &[usize],
        padding: Padding,
        h0: Option<&[Tensor]>,
        train: bool,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        self.run((x, None), lengths, padding, h0, true, train)
    }

    /// As [`Rnn::forward_with_states_t`], with per-step resets: one flag
    /// per row of `x` (`[B, T]` batch-first, `[T, B]` time-first,
    /// row-major), `true` where a sequence's state restarts from `h0`
    /// before that step (an episode's first step). The gradient of `h0`
    /// sums every stretch's that starts from it
    /// ([`cellc_runtime::CallOptions::resets`]).
    pub fn forward_with_resets_t(
        &self,
        x: &Tensor,
        lengths: &[usize],
        padding: Padding,
        h0: Option<&[Tensor]>,
        resets: &[bool],
        train: bool,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        self.run((x, Some(resets)), lengths, padding, h0, true, train)
    }

    /// The weights as one flat operand (the op takes three tensors).
    fn flat_weights(&self, device: &Device) -> Result<Tensor> {
        if self.weights.is_empty() {
            return Ok(Tensor::zeros(0, DType::F32, device)?);
        }
        let flat =
            self.weights.iter().map(|(_, t)| t.flatten_all()).collect::<candle_core::Result<Vec<_>>>()?;
        // Half-precision weights are read in f32 (their gradients come back in their dtype).
        Ok(Tensor::cat(&flat, 0)?.to_dtype(DType::F32)?)
    }

    fn run(
        &self,
        (x, resets): (&Tensor, Option<&[bool]>),
        lengths: &[usize],
        padding: Padding,
        h0: Option<&[Tensor]>,
        with_finals: bool,
        train: bool,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        if !x.device().is_cpu() {
            return Err(RuntimeError::Shape {
                tensor: "input".into(),
                expected: "a tensor on candle's CPU device (see the crate's docs on CUDA)".into(),
                found: format!("{:?}", x.device().location()),
            }
            .into());
        }
        if matches!(x.dtype(), DType::BF16 | DType::F16) {
            // Half precision: computed from f32 copies (differentiable casts, so gradients
            // reach x and h0 in their dtype), returned in x's dtype. The products are the
            // model's back end's: bf16 operands with f32 sums where it was made with
            // `Model::with_precision(Precision::Bf16)`, f32 otherwise.
            let dtype = x.dtype();
            let x32 = x.to_dtype(DType::F32)?;
            let h32 =
                h0.map(|h| h.iter().map(|t| t.to_dtype(DType::F32)).collect::<candle_core::Result<Vec<_>>>());
            let h32 = h32.transpose()?;
            let (out, finals) =
                self.run((&x32, resets), lengths, padding, h32.as_deref(), with_finals, train)?;
            let finals = finals.iter().map(|f| f.to_dtype(dtype)).collect::<candle_core::Result<_>>()?;
            return Ok((out.to_dtype(dtype)?, finals));
        }
        if x.dtype() != DType::F32 {
            return Err(RuntimeError::Shape {
                tensor: "input".into(),
                expected: "f32, bf16 or f16 values".into(),
                found: format!("{:?}", x.dtype()),
            }
            .into());
        }
        let mut batch = Padded::of(x.dims(), padding.major, padding.align, lengths)?;
        // The errors of bad input, typed, before candle wraps the op's.
        self.model.check_batch(&batch.shape(), x.elem_count(), resets)?;
        batch.resets = resets.map(<[bool]>::to_vec);
        let device = x.device();
        let states = match h0 {
            Some(h) => self.flat_states(h, batch.batch)?,
            None => Tensor::zeros(0, DType::F32, device)?,
        };
        let w = self.flat_weights(device)?;
        let x = x.contiguous()?;
        let keep = x.track_op() || w.track_op() || states.track_op();
        let masks = (train && self.model.draws_masks()).then(|| self.model.next_mask_seed());
        let (model, reserve, rates) = (self.model.clone(), Mutex::new(Vec::new()), self.rates.clone());
        let op = RnnOp { model, batch, with_finals, keep, masks, rates, reserve };
        let output_len = op.output_len();
        let dims = op.batch.output_dims(self.model.output_size());
        let state_shapes = self.model.state_shapes(op.batch.batch);
        let result = if keep { x.apply_op3(&w, &states, op)? } else { x.apply_op3_no_bwd(&w, &states, &op)? };
        if !with_finals {
            return Ok((result, Vec::new()));
        }
        let output = result.narrow(0, 0, output_len)?.reshape(dims.to_vec())?;
        let mut finals = Vec::with_capacity(state_shapes.len());
        let mut at = output_len;
        for shape in state_shapes {
            let len = shape.iter().product();
            finals.push(result.narrow(0, at, len)?.reshape(shape.to_vec())?);
            at += len;
        }
        Ok((output, finals))
    }

    /// `h0` checked (one `[layers * directions, B, size]` per state) and flattened into one operand.
    fn flat_states(&self, h0: &[Tensor], batch: usize) -> Result<Tensor> {
        let shapes = self.model.state_shapes(batch);
        if h0.len() != shapes.len() {
            return Err(RuntimeError::Shape {
                tensor: "h0".into(),
                expected: format!("{} tensors (one per state of the cell)", shapes.len()),
                found: format!("{} tensors", h0.len()),
            }
            .into());
        }
        for (i, (t, shape)) in h0.iter().zip(&shapes).enumerate() {
            if t.dims() != shape {
                return Err(RuntimeError::Shape {
                    tensor: format!("h0[{i}]"),
                    expected: format!("{shape:?}"),
                    found: format!("{:?}", t.dims()),
                }
                .into());
            }
        }
        let flat = h0.iter().map(|t| t.flatten_all()).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&flat, 0)?)
    }
}
