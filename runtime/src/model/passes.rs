//! A model's passes: over buffers the runtime makes ([`Model::forward`],
//! [`Model::forward_train`], [`Model::backward`]), over the caller's
//! memory ([`Model::forward_into`], [`Model::backward_from`]), and a few
//! steps at a time ([`Model::stream`]). Each takes the call's options in
//! one [`CallOptions`] where it has any; every pass goes through the
//! crate's one driver.

use crate::error::Result;
use crate::input::{BatchShape, Input};
use crate::model::call::CallerMemory;
use crate::model::driver::{BackwardSpans, ForwardSpans};
use crate::model::host_passes::{self, DeviceReserve};
use crate::model::stream::Stream;
use crate::model::Model;
use crate::options::{CallOptions, Settled};
use crate::pass::{Memory, Span};
use crate::results::{Gradients, Output};
use crate::sequence::LaidOutBatch;

/// What a training forward keeps for [`Model::backward`]: the input it
/// read, and its reserve ([`Model::reserve_floats_per_row`]).
#[derive(Debug)]
pub struct Trace<'a> {
    input: Input<'a>,
    batch: LaidOutBatch,
    reserve: KeptReserve,
    /// The initial states the forward read (`None`: zeros), which the
    /// backward reads where the tape keeps a state only after each step.
    h0: Option<Vec<Vec<f32>>>,
    /// The forward's options, as it ran them: its masks (the cell's, and
    /// dropout between layers) are drawn again by the backward.
    settled: Settled,
}

/// Where a training forward keeps its reserve: in host memory, or in the
/// device memory its pass ran in ([`crate::model::host_passes`]).
#[derive(Debug)]
enum KeptReserve {
    Host(Vec<f32>),
    Device(DeviceReserve),
}

impl Drop for Trace<'_> {
    fn drop(&mut self) {
        if let KeptReserve::Host(reserve) = &mut self.reserve {
            crate::pool::give(std::mem::take(reserve));
        }
    }
}

impl Model {
    /// Inference: runs every layer and direction over the batch, with
    /// the model's settings.
    pub fn forward(&self, input: Input, h0: Option<&[Vec<f32>]>) -> Result<Output> {
        self.forward_with(input, h0, &CallOptions::default())
    }

    /// A forward pass with the call's `options` (resets, precision, rates;
    /// with `options.masks`, in training mode) that keeps nothing for a backward.
    pub fn forward_with(
        &self,
        input: Input,
        h0: Option<&[Vec<f32>]>,
        options: &CallOptions,
    ) -> Result<Output> {
        let settled = self.settle(options)?;
        let (out, ..) = self.forward_owned((input, options.resets), h0, &settled, false)?;
        Ok(out)
    }

    /// A forward pass in training mode that keeps what [`Model::backward`]
    /// needs: its masks (the cell's, and dropout between layers) are drawn
    /// from the model's next seed ([`Model::next_mask_seed`]).
    pub fn forward_train<'a>(
        &self,
        input: Input<'a>,
        h0: Option<&[Vec<f32>]>,
    ) -> Result<(Output, Trace<'a>)> {
        let options = CallOptions { masks: Some(self.next_mask_seed()), ..Default::default() };
        self.forward_traced(input, h0, &options)
    }

    /// A forward pass with the call's `options` that keeps what
    /// [`Model::backward`] needs (which follows the same options): in
    /// training mode drawing its masks from `options.masks`, or without
    /// them in evaluation mode (no masks: the gradients of the function
    /// inference computes, as a gradient check needs).
    pub fn forward_traced<'a>(
        &self,
        input: Input<'a>,
        h0: Option<&[Vec<f32>]>,
        options: &CallOptions,
    ) -> Result<(Output, Trace<'a>)> {
        let settled = self.settle(options)?;
        let (out, reserve, batch) = self.forward_owned((input, options.resets), h0, &settled, true)?;
        Ok((out, Trace { input, batch, reserve, h0: h0.map(<[Vec<f32>]>::to_vec), settled }))
    }

    /// A forward pass into buffers of its own (with `training`, a reserve
    /// too), as its options were `settled`.
    fn forward_owned(
        &self,
        (input, resets): (Input, Option<&[bool]>),
        h0: Option<&[Vec<f32>]>,
        settled: &Settled,
        training: bool,
    ) -> Result<(Output, KeptReserve, LaidOutBatch)> {
        let p = self.prepare(&input)?.with_resets(resets)?;
        self.ensure_pass_fits(&p, training)?;
        let batch = p.order.batch();
        let mut data = vec![0.0f32; p.rows * self.output_size()];
        let mut final_states: Vec<Vec<f32>> =
            self.state_shapes(batch).iter().map(|s| vec![0.0; s.iter().product()]).collect();
        // A device with memory of its own keeps a training forward's reserve
        // there; on the host it is recycled memory (the pass writes every float).
        let on_host = self.device.memory() == Memory::Host;
        let mut reserve = match training && on_host {
            true => crate::pool::take(p.rows * self.reserve_floats_per_row()),
            false => Vec::new(),
        };
        let spans = ForwardSpans {
            input: Span::of(Self::input_data(&input)),
            h0: h0.map(|h| h.iter().map(|s| Span::of(s)).collect()),
            output: Span::of_mut(&mut data),
            finals: final_states.iter_mut().map(|s| Span::of_mut(s)).collect(),
            reserve: (training && on_host).then(|| Span::of_mut(&mut reserve)),
        };
        // SAFETY: every span is a buffer of this function's or the caller's,
        // borrowed until the pass ends; those written are distinct buffers.
        let kept = unsafe { host_passes::forward(self, (&p, settled), spans, None, training) }?;
        let kept = kept.map_or(KeptReserve::Host(reserve), KeptReserve::Device);
        Ok((Output { data, final_states }, kept, p))
    }

    /// Backpropagation through the whole model: `d_output` is laid out like
    /// the output; `d_final` (optional) like the final states.
    pub fn backward(
        &self,
        trace: &Trace,
        d_output: &[f32],
        d_final: Option<&[Vec<f32>]>,
    ) -> Result<Gradients> {
        let p = &trace.batch;
        let (reserve, kept) = match &trace.reserve {
            KeptReserve::Host(reserve) => (Span::of(reserve), None),
            KeptReserve::Device(kept) => (Span::of(&[]), Some(kept)),
        };
        let batch = p.order.batch();
        let mut d_input = vec![0.0f32; p.rows * self.input_size()];
        let mut d_h0: Vec<Vec<f32>> =
            self.state_shapes(batch).iter().map(|s| vec![0.0; s.iter().product()]).collect();
        let mut d_params = self.zeroed_params();
        let spans = BackwardSpans {
            input: Span::of(Self::input_data(&trace.input)),
            reserve,
            d_output: Span::of(d_output),
            h0: trace.h0.as_ref().map(|h| h.iter().map(|s| Span::of(s)).collect()),
            d_final: d_final.map(|d| d.iter().map(|s| Span::of(s)).collect()),
            d_input: Span::of_mut(&mut d_input),
            d_h0: Some(d_h0.iter_mut().map(|s| Span::of_mut(s)).collect()),
            d_params: d_params
                .iter_mut()
                .map(|ps| ps.iter_mut().map(|s| Span::of_mut(s)).collect())
                .collect(),
        };
        // SAFETY: as in `forward_owned`.
        unsafe { host_passes::backward(self, (p, &trace.settled), spans, None, kept) }?;
        Ok(Gradients { d_input, d_h0, d_params })
    }

    /// Zeroed parameter gradients shaped like this model's (input and
    /// initial-state gradients empty), to accumulate into ([`Gradients::accumulate_into`]).
    pub fn zero_gradients(&self) -> Gradients {
        Gradients { d_input: Vec::new(), d_h0: Vec::new(), d_params: self.zeroed_params() }
    }

    /// Checks a batch of `shape` with `data_len` floats of input, and its
    /// per-step resets if any ([`crate::CallOptions::resets`]), against the model
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

    /// A workspace that runs this model a few steps at a time over `batch`
    /// sequences, starting from zero states. Only a one-directional model
    /// streams: a reverse direction reads each sequence from its end.
    /// [`Stream`] has an example.
    pub fn stream(&self, batch: usize) -> Result<Stream<'_>> {
        Stream::new(self, batch)
    }

    /// Floats per layout row (each of a padded batch's `B * T` rows, or a
    /// packed batch's `N`) of the reserve in which a training forward keeps
    /// what its backward reads ([`Model::forward_into`]): every layer's
    /// tapes, laid out as its program says ([`cellc::program::TapeLayout`]),
    /// and the outputs the next layers read (the driver's layout).
    pub fn reserve_floats_per_row(&self) -> usize {
        crate::model::driver::reserve_layout(self, 1).last().map_or(0, |l| l.output.end)
    }
}
