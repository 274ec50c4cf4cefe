//! Passes over memory the caller owns. A framework (PyTorch, candle) hands
//! its own tensors: the input, the weights (each call, so that weight swaps
//! such as FSDP's or weight-drop's are seen), the outputs, and the reserve
//! in which a training forward keeps what the backward reads, which the
//! framework's autograd holds between the two as one of its tensors
//! (cuDNN's "reserve space"). Nothing is copied but what the layout needs.
//!
//! One pair of entry points, [`Model::forward_into`] and
//! [`Model::backward_from`], serves host memory ([`Call`], slices) and
//! device memory ([`crate::DeviceCall`], addresses) alike: the call's type
//! says which ([`CallerMemory`]), and both run through the one driver.

use crate::driver::{BackwardSpans, ForwardSpans};
use crate::dropout::MaskSeed;
use crate::error::Result;
use crate::exec::{BackwardOut, ForwardOut};
use crate::host_passes;
use crate::input::{BatchShape, Input};
use crate::model::Model;
use crate::pass::Span;
use crate::sequence::LaidOutBatch;

/// The inputs of a pass on the caller's host memory.
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    /// The batch, in the caller's layout.
    pub input: Input<'a>,
    /// `[layer * directions + direction][param]`, in the cell's order and
    /// the model's shapes ([`Model::weight_names`]); `None`: the model's own.
    pub weights: Option<&'a [Vec<&'a [f32]>]>,
    /// Initial states, `[layers * directions, B, size]` each; `None`: zeros.
    pub h0: Option<&'a [&'a [f32]]>,
    /// Training mode: where the call draws the masks of the model's
    /// dropout ([`Model::with_dropout`]); give its backward the same.
    /// `None`: evaluation mode, nothing dropped (as PyTorch's
    /// `module.eval()`, with or without a reserve).
    pub masks: Option<MaskSeed>,
    /// The rate of each of the cell's `rate`s for this call, in the order
    /// of [`Model::rate_names`] ([`Model::rates_with`] makes one by name);
    /// `None`: the model's ([`Model::rates`]). Give its backward the same.
    pub rates: Option<&'a [f32]>,
    /// The rate of dropout between layers for this call (in training
    /// mode, as `masks` says); `None`: the model's ([`Model::with_dropout`]).
    /// Give its backward the same.
    pub dropout: Option<f32>,
    /// Per-step resets: one flag per row of the input's layout (a padded
    /// batch's `[B, T]` or `[T, B]`, as its input; a packed batch's `[N]`),
    /// `true` where the state restarts from the initial state before that
    /// step is computed; flags at padding and at a sequence's first step
    /// change nothing. Give its backward the same. The initial states'
    /// gradients sum every segment's (see [`crate::resets`]).
    pub resets: Option<&'a [bool]>,
}

pub(crate) mod sealed {
    /// Only this crate's call types name caller memory.
    pub trait Sealed {}
    impl Sealed for super::Call<'_> {}
}

/// The memory a caller's pass runs over, named by its call's type: host
/// memory ([`Call`]: slices) or device memory ([`crate::DeviceCall`]:
/// addresses and lengths, the work queued on the call's stream).
pub trait CallerMemory: sealed::Sealed {
    /// Floats the pass reads.
    type Floats<'f>: Copy;
    /// The reserve, as the backward reads it.
    type Reserve<'r>: Copy;
    /// The reserve, as the training forward writes it.
    type ReserveMut<'r>;
    /// Where the forward writes.
    type ForwardOut<'o>;
    /// Where the backward writes.
    type BackwardOut<'o>;

    #[doc(hidden)]
    fn forward(
        &self,
        model: &Model,
        out: Self::ForwardOut<'_>,
        reserve: Option<Self::ReserveMut<'_>>,
    ) -> Result<()>;

    #[doc(hidden)]
    fn backward(
        &self,
        model: &Model,
        reserve: Self::Reserve<'_>,
        d_output: Self::Floats<'_>,
        d_final: Option<&[Self::Floats<'_>]>,
        out: Self::BackwardOut<'_>,
    ) -> Result<()>;
}

impl Model {
    /// Checks a batch of `shape` with `data_len` floats of input, and its
    /// per-step resets if any ([`Call::resets`]), against the model
    /// without running it: the errors a pass would give.
    pub fn check_batch(&self, shape: &BatchShape, data_len: usize, resets: Option<&[bool]>) -> Result<()> {
        self.lay_out(shape, data_len)?.with_resets(resets).map(|_| ())
    }

    /// A forward pass over the caller's memory, writing `out`. With a
    /// `reserve` of [`Model::reserve_floats_per_row`] floats per layout
    /// row, it keeps there what [`Model::backward_from`] reads.
    pub fn forward_into<C: CallerMemory>(
        &self,
        call: &C,
        out: C::ForwardOut<'_>,
        reserve: Option<C::ReserveMut<'_>>,
    ) -> Result<()> {
        call.forward(self, out, reserve)
    }

    /// The backward of a [`Model::forward_into`] with the same `call` and
    /// its `reserve`: `d_output` is laid out like the output, `d_final`
    /// (optional; `None`: zeros) like the final states.
    pub fn backward_from<C: CallerMemory>(
        &self,
        call: &C,
        reserve: C::Reserve<'_>,
        d_output: C::Floats<'_>,
        d_final: Option<&[C::Floats<'_>]>,
        out: C::BackwardOut<'_>,
    ) -> Result<()> {
        call.backward(self, reserve, d_output, d_final, out)
    }
}

impl<'a> Call<'a> {
    /// A call on `input` with the model's own weights, zero initial states,
    /// in evaluation mode, at the model's rates and dropout, without resets;
    /// the other fields are set with struct update syntax
    /// (`Call { masks: Some(seed), ..Call::new(input) }`).
    pub fn new(input: Input<'a>) -> Call<'a> {
        Call { input, weights: None, h0: None, masks: None, rates: None, dropout: None, resets: None }
    }

    /// The call's batch laid out and checked to fit in memory, and its
    /// weights checked (before its rates and masks, whose errors come after).
    fn laid_out(&self, model: &Model, training: bool) -> Result<LaidOutBatch> {
        let p = model.prepare(&self.input)?.with_resets(self.resets)?;
        model.ensure_pass_fits(&p, training)?;
        match self.weights {
            Some(weights) => model.check_weights(weights)?,
            None => model.ensure_owns_weights()?,
        }
        Ok(p)
    }

    fn h0_spans(&self) -> Option<Vec<Span>> {
        self.h0.map(|h| h.iter().map(|s| Span::of(s)).collect())
    }
}

impl CallerMemory for Call<'_> {
    type Floats<'f> = &'f [f32];
    type Reserve<'r> = &'r [f32];
    type ReserveMut<'r> = &'r mut [f32];
    type ForwardOut<'o> = ForwardOut<'o>;
    type BackwardOut<'o> = BackwardOut<'o>;

    fn forward(&self, model: &Model, out: ForwardOut, reserve: Option<&mut [f32]>) -> Result<()> {
        let p = self.laid_out(model, reserve.is_some())?;
        let spans = ForwardSpans {
            input: Span::of(self.input.split().1),
            h0: self.h0_spans(),
            output: Span::of_mut(out.output),
            finals: out.final_states.into_iter().map(Span::of_mut).collect(),
            dropout: model.caller_dropout(self.masks, self.dropout)?,
            masking: model.caller_masking(self.masks, self.rates)?,
            reserve: reserve.map(Span::of_mut),
        };
        // SAFETY: every span is borrowed from the call, `out` or `reserve`
        // until the pass ends; the ones written are mutable borrows, so
        // distinct from every other.
        unsafe { host_passes::forward(model, &p, spans, self.weights, false) }.map(|_| ())
    }

    fn backward(
        &self,
        model: &Model,
        reserve: &[f32],
        d_output: &[f32],
        d_final: Option<&[&[f32]]>,
        out: BackwardOut,
    ) -> Result<()> {
        let p = self.laid_out(model, true)?;
        let BackwardOut { d_input, d_h0, d_params } = out;
        let spans = BackwardSpans {
            input: Span::of(self.input.split().1),
            reserve: Span::of(reserve),
            d_output: Span::of(d_output),
            d_final: d_final.map(|d| d.iter().map(|s| Span::of(s)).collect()),
            d_input: Span::of_mut(d_input),
            d_h0: (!d_h0.is_empty()).then(|| d_h0.into_iter().map(Span::of_mut).collect()),
            d_params: d_params.into_iter().map(|ps| ps.into_iter().map(Span::of_mut).collect()).collect(),
            dropout: model.caller_dropout(self.masks, self.dropout)?,
            masking: model.caller_masking(self.masks, self.rates)?,
        };
        // SAFETY: as in `forward`.
        unsafe { host_passes::backward(model, &p, spans, self.weights, None) }
    }
}
