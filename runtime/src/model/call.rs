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

use crate::error::Result;
use crate::input::Input;
use crate::model::driver::{BackwardSpans, ForwardSpans};
use crate::model::host_passes;
use crate::model::Model;
use crate::options::{CallOptions, Settled};
use crate::pass::Span;
use crate::results::{BackwardOut, ForwardOut};
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
    /// How it runs (training mode, rates, dropout, resets, precision);
    /// give its backward the same.
    pub options: CallOptions<'a>,
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

impl<'a> Call<'a> {
    /// A call on `input` with the model's own weights, zero initial states
    /// and the model's settings ([`CallOptions::default`]: evaluation
    /// mode, no resets); the other fields are set with struct update
    /// syntax (`Call { h0: Some(&h0), ..Call::new(input) }`).
    pub fn new(input: Input<'a>) -> Call<'a> {
        Call { input, weights: None, h0: None, options: CallOptions::default() }
    }

    /// The call's batch laid out and checked to fit in memory, and its
    /// weights checked (before its rates and masks, whose errors come after).
    fn laid_out(&self, model: &Model, training: bool) -> Result<(LaidOutBatch, Settled)> {
        let p = model.prepare(&self.input)?.with_resets(self.options.resets)?;
        model.ensure_pass_fits(&p, training)?;
        match self.weights {
            Some(weights) => model.check_weights(weights)?,
            None => model.ensure_owns_weights()?,
        }
        Ok((p, model.settle(&self.options)?))
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
        let (p, settled) = self.laid_out(model, reserve.is_some())?;
        let spans = ForwardSpans {
            input: Span::of(self.input.split().1),
            h0: self.h0_spans(),
            output: Span::of_mut(out.output),
            finals: out.final_states.into_iter().map(Span::of_mut).collect(),
            reserve: reserve.map(Span::of_mut),
        };
        // SAFETY: every span is borrowed from the call, `out` or `reserve`
        // until the pass ends; the ones written are mutable borrows, so
        // distinct from every other.
        unsafe { host_passes::forward(model, (&p, &settled), spans, self.weights, false) }.map(|_| ())
    }

    fn backward(
        &self,
        model: &Model,
        reserve: &[f32],
        d_output: &[f32],
        d_final: Option<&[&[f32]]>,
        out: BackwardOut,
    ) -> Result<()> {
        let (p, settled) = self.laid_out(model, true)?;
        let BackwardOut { d_input, d_h0, d_params } = out;
        let spans = BackwardSpans {
            input: Span::of(self.input.split().1),
            reserve: Span::of(reserve),
            d_output: Span::of(d_output),
            h0: self.h0_spans(),
            d_final: d_final.map(|d| d.iter().map(|s| Span::of(s)).collect()),
            d_input: Span::of_mut(d_input),
            d_h0: (!d_h0.is_empty()).then(|| d_h0.into_iter().map(Span::of_mut).collect()),
            d_params: d_params.into_iter().map(|ps| ps.into_iter().map(Span::of_mut).collect()).collect(),
        };
        // SAFETY: as in `forward`.
        unsafe { host_passes::backward(model, (&p, &settled), spans, self.weights, None) }
    }
}
