//! A model's own passes over a batch (inference, training forward,
//! backward), into buffers the runtime makes, and the types every pass
//! shares: the batch in the caller's layout, checked and laid out; the
//! pass's parameters; its results. The work of every pass, these and the
//! caller's ([`crate::call`], [`crate::device_call`]), is decided by
//! the crate's one driver.

use crate::driver::{BackwardSpans, ForwardSpans};
use crate::dropout::{BetweenLayers, MaskSeed};
use crate::error::{Result, RuntimeError};
use crate::host_passes::{self, DeviceReserve};
pub use crate::input::{BatchShape, Input};
use crate::masks::CellMasking;
use crate::model::Model;
use crate::pass::{Memory, Span};
use crate::sequence::{check_len, BatchOrder, Floats, LaidOutBatch, RowLayout};

/// A forward pass's results.
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    /// Laid out like the input, `output_size` features per row, zeros at padding.
    pub data: Vec<f32>,
    /// One buffer per state, `[layers * directions, B, size]`, in PyTorch's order.
    pub final_states: Vec<Vec<f32>>,
}

/// Gradients of a backward pass.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients {
    /// Laid out like the input, zeros at padding.
    pub d_input: Vec<f32>,
    /// One buffer per state, `[layers * directions, B, size]`.
    pub d_h0: Vec<Vec<f32>>,
    /// Same structure as the model's parameters: `[layer * directions + direction][param]`.
    pub d_params: Vec<Vec<Vec<f32>>>,
}

/// What a training forward keeps for [`Model::backward`]: the input it
/// read, and its reserve ([`Model::reserve_floats_per_row`]).
#[derive(Debug)]
pub struct Trace<'a> {
    input: Input<'a>,
    batch: LaidOutBatch,
    reserve: KeptReserve,
    /// The forward's dropout between layers, drawn again by the backward.
    dropout: Option<BetweenLayers>,
    /// The forward's cell masks, drawn again by the backward.
    masking: CellMasking,
}

/// Where a training forward keeps its reserve: in host memory, or in the
/// device memory its pass ran in ([`crate::host_passes`]).
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

/// Where a forward pass writes, laid out as [`Output`]'s fields.
#[derive(Debug)]
pub struct ForwardOut<'o> {
    /// Laid out like the input, `output_size` features per row; the
    /// padding rows are set to zero.
    pub output: &'o mut [f32],
    /// One buffer per state, `[layers * directions, B, size]`.
    pub final_states: Vec<&'o mut [f32]>,
}

/// Where a backward pass writes, laid out as [`Gradients`]' fields; every
/// buffer is overwritten (zeros at padding).
#[derive(Debug)]
pub struct BackwardOut<'o> {
    /// The input's gradient, laid out like the input.
    pub d_input: &'o mut [f32],
    /// One buffer per state, or none: the initial states' gradients are not wanted.
    pub d_h0: Vec<&'o mut [f32]>,
    /// The parameters' gradients, `[layer * directions + direction][param]`,
    /// each shaped as its parameter.
    pub d_params: Vec<Vec<&'o mut [f32]>>,
}

impl Model {
    pub(crate) fn prepare(&self, input: &Input) -> Result<LaidOutBatch> {
        let (shape, data) = input.split();
        self.lay_out(&shape, data.len())
    }

    /// A batch of `shape` with `data_len` floats of data, checked and laid out.
    pub(crate) fn lay_out(&self, shape: &BatchShape, data_len: usize) -> Result<LaidOutBatch> {
        match *shape {
            BatchShape::Padded { batch, steps, major, align, lengths } => {
                if lengths.len() != batch {
                    return Err(RuntimeError::Shape {
                        tensor: "lengths".into(),
                        expected: format!("[{batch}]"),
                        found: format!("[{}]", lengths.len()),
                    });
                }
                check_len("input", data_len, &[batch, steps, self.input_size()])?;
                let order = BatchOrder::new(lengths, steps)?;
                let layout = RowLayout::padded(&order, steps, major, align);
                Ok(LaidOutBatch {
                    order,
                    layout,
                    rows: batch * steps,
                    data_features: self.input_size(),
                    segments: None,
                })
            }
            BatchShape::Packed(p) => {
                if p.features != self.input_size() {
                    return Err(RuntimeError::Shape {
                        tensor: "input".into(),
                        expected: format!("{} features", self.input_size()),
                        found: format!("{} features", p.features),
                    });
                }
                let order = p.order(data_len)?;
                let layout = RowLayout::packed(&order);
                Ok(LaidOutBatch {
                    rows: order.rows(),
                    order,
                    layout,
                    data_features: p.features,
                    segments: None,
                })
            }
        }
    }

    /// Refuses a pass whose buffers cannot fit in memory, before allocating
    /// them. A lower bound of what the pass holds at once: every layer's
    /// output rows; each state four times per sequence (initial, final, and
    /// the back end's current and next); training, one copy of the states
    /// per row for the backward.
    pub(crate) fn ensure_pass_fits(&self, p: &LaidOutBatch, training: bool) -> Result<()> {
        let (rows, batch) = (p.rows as u128, p.order.batch() as u128);
        let dirs = self.directions() as u128;
        let mut elements = 0u128;
        for layer in &self.layers {
            let states: u128 = layer.state_sizes.iter().map(|&n| n as u128).sum::<u128>() * dirs;
            elements += rows * layer.output_size as u128 * dirs + 4 * batch * states;
            if training {
                elements += p.order.rows() as u128 * states;
            }
        }
        crate::memory::ensure_fits(
            || {
                let pass = if training { "a training pass" } else { "a forward pass" };
                let (b, r) = (p.order.batch(), p.order.rows());
                let seqs = if b == 1 { "sequence" } else { "sequences" };
                format!("{pass} of cell `{}` over {b} {seqs} ({r} steps in all)", self.compiled.forward.name)
            },
            crate::memory::f32_bytes(elements),
        )
    }

    fn input_data<'a>(input: &Input<'a>) -> &'a [f32] {
        match input {
            Input::Padded { data, .. } => data,
            Input::Packed(p) => p.data,
        }
    }

    /// The shape of each state tensor (initial or final) of a batch of
    /// `batch` sequences: `[layers * directions, B, size]`, as nn.LSTM's `(h, c)`.
    pub fn state_shapes(&self, batch: usize) -> Vec<[usize; 3]> {
        let ld = self.layers.len() * self.directions();
        self.layers.first().map_or(&[][..], |l| &l.state_sizes[..]).iter().map(|&n| [ld, batch, n]).collect()
    }

    /// Checks that `count` state buffers of `len(i)` floats are `[L*D, B, size]` each.
    pub(crate) fn check_states(
        &self,
        count: usize,
        len: impl Fn(usize) -> usize,
        batch: usize,
        what: &str,
    ) -> Result<()> {
        let shapes = self.state_shapes(batch);
        if count != shapes.len() {
            return Err(RuntimeError::Shape {
                tensor: what.into(),
                expected: format!("{} state tensors", shapes.len()),
                found: format!("{count}"),
            });
        }
        for (i, (shape, decl)) in shapes.iter().zip(&self.compiled.forward.states).enumerate() {
            check_len(&format!("{what}.{}", decl.name), len(i), shape)?;
        }
        Ok(())
    }

    /// Refuses a pass that would read the weights of a model that keeps none.
    pub(crate) fn ensure_owns_weights(&self) -> Result<()> {
        if self.owns_weights {
            return Ok(());
        }
        Err(RuntimeError::NoOwnWeights)
    }

    /// Zeroed buffers shaped like the model's parameters.
    pub(crate) fn zeroed_params(&self) -> Vec<Vec<Vec<f32>>> {
        self.param_lens().iter().map(|ps| ps.iter().map(|&n| vec![0.0; n]).collect()).collect()
    }

    /// Checks that `given` has the model's parameters: a list per layer and
    /// direction, in the cell's order, of the model's shapes.
    pub(crate) fn check_weights<D: Floats>(&self, given: &[Vec<D>]) -> Result<()> {
        let names = self.weight_names();
        let per = self.compiled.forward.params.len();
        if given.len() != self.params.len() || given.iter().any(|ps| ps.len() != per) {
            return Err(RuntimeError::Shape {
                tensor: "weights".into(),
                expected: format!("{} layers and directions of {per} parameters", self.params.len()),
                found: format!("{:?} parameters", given.iter().map(Vec::len).collect::<Vec<_>>()),
            });
        }
        for ((name, shape), p) in names.iter().zip(given.iter().flatten()) {
            check_len(name, p.floats(), shape)?;
        }
        Ok(())
    }

    /// Inference: runs every layer and direction over the batch.
    pub fn forward(&self, input: Input, h0: Option<&[Vec<f32>]>) -> Result<Output> {
        self.forward_with_resets(input, h0, None)
    }

    /// Inference with per-step resets ([`crate::Call::resets`]: one flag
    /// per row of the input's layout; `None`: none).
    pub fn forward_with_resets(
        &self,
        input: Input,
        h0: Option<&[Vec<f32>]>,
        resets: Option<&[bool]>,
    ) -> Result<Output> {
        let evaluation = self.caller_masking(None, None)?;
        let (out, ..) = self.forward_owned((input, resets), h0, (None, evaluation), false)?;
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
        self.forward_traced(input, h0, Some(self.next_mask_seed()))
    }

    /// A forward pass that keeps what [`Model::backward`] needs, in
    /// training mode drawing its masks from `masks`, or with `None` in
    /// evaluation mode (no masks: the gradients of the function inference
    /// computes, as a gradient check needs).
    pub fn forward_traced<'a>(
        &self,
        input: Input<'a>,
        h0: Option<&[Vec<f32>]>,
        masks: Option<MaskSeed>,
    ) -> Result<(Output, Trace<'a>)> {
        self.forward_traced_with_resets(input, h0, None, masks)
    }

    /// [`Model::forward_traced`] with per-step resets
    /// ([`crate::Call::resets`]); its [`Model::backward`] follows them.
    pub fn forward_traced_with_resets<'a>(
        &self,
        input: Input<'a>,
        h0: Option<&[Vec<f32>]>,
        resets: Option<&[bool]>,
        masks: Option<MaskSeed>,
    ) -> Result<(Output, Trace<'a>)> {
        let dropout = masks.and_then(|seed| BetweenLayers::of(self.dropout, seed));
        let masking = self.caller_masking(masks, None)?;
        let (out, reserve, batch) =
            self.forward_owned((input, resets), h0, (dropout, masking.clone()), true)?;
        Ok((out, Trace { input, batch, reserve, dropout, masking }))
    }

    /// A forward pass into buffers of its own (with `training`, a reserve
    /// too), with the dropout between layers and the cell's masks given.
    fn forward_owned(
        &self,
        (input, resets): (Input, Option<&[bool]>),
        h0: Option<&[Vec<f32>]>,
        (dropout, masking): (Option<BetweenLayers>, CellMasking),
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
            dropout,
            masking,
        };
        // SAFETY: every span is a buffer of this function's or the caller's,
        // borrowed until the pass ends; those written are distinct buffers.
        let kept = unsafe { host_passes::forward(self, &p, spans, None, training) }?;
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
            d_final: d_final.map(|d| d.iter().map(|s| Span::of(s)).collect()),
            d_input: Span::of_mut(&mut d_input),
            d_h0: Some(d_h0.iter_mut().map(|s| Span::of_mut(s)).collect()),
            d_params: d_params
                .iter_mut()
                .map(|ps| ps.iter_mut().map(|s| Span::of_mut(s)).collect())
                .collect(),
            dropout: trace.dropout,
            masking: trace.masking.clone(),
        };
        // SAFETY: as in `forward_owned`.
        unsafe { host_passes::backward(self, p, spans, None, kept) }?;
        Ok(Gradients { d_input, d_h0, d_params })
    }
}

impl Model {
    /// Zeroed parameter gradients shaped like this model's (input and
    /// initial-state gradients empty), to accumulate into ([`Gradients::accumulate_into`]).
    pub fn zero_gradients(&self) -> Gradients {
        Gradients { d_input: Vec::new(), d_h0: Vec::new(), d_params: self.zeroed_params() }
    }
}

impl Gradients {
    /// Adds these gradients into `acc` (same structure), for accumulation over batches.
    pub fn accumulate_into(&self, acc: &mut Gradients) -> Result<()> {
        let same = acc.d_params.len() == self.d_params.len()
            && acc
                .d_params
                .iter()
                .zip(&self.d_params)
                .all(|(a, b)| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.len() == y.len()));
        if !same {
            return Err(RuntimeError::Shape {
                tensor: "gradient accumulator".into(),
                expected: "the model's parameter shapes".into(),
                found: "other shapes".into(),
            });
        }
        for (a, b) in acc.d_params.iter_mut().flatten().zip(self.d_params.iter().flatten()) {
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
        // Input and state gradients belong to one batch: added when the
        // shapes match (the same batch again), else replaced.
        if acc.d_h0.len() == self.d_h0.len()
            && acc.d_h0.iter().zip(&self.d_h0).all(|(a, b)| a.len() == b.len())
        {
            for (a, b) in acc.d_h0.iter_mut().zip(&self.d_h0) {
                a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
            }
        } else {
            acc.d_h0 = self.d_h0.clone();
        }
        if acc.d_input.len() == self.d_input.len() {
            acc.d_input.iter_mut().zip(&self.d_input).for_each(|(x, y)| *x += y);
        } else {
            acc.d_input = self.d_input.clone();
        }
        Ok(())
    }
}
