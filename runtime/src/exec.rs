//! Running a model over a batch: layers, directions, initial and final
//! states, training forward and backward.
//!
//! Layer `k` reads layer `k-1`'s output; a bidirectional layer writes its
//! forward direction's output in features `[0, O)` and the reverse one's in
//! `[O, 2O)`. Intermediate layers' outputs live in buffers laid out like
//! the caller's input (same row layout, wider rows), so the caller's input
//! and output are never copied or reordered.

use crate::backend::{BackwardJob, ForwardJob, PreparedWeights, Rows, RowsMut, Tape};
use crate::error::{Result, RuntimeError};
use crate::model::Model;
use crate::sequence::{
    check_len, padding_rows, zero_rows, Align, BatchOrder, Floats, Major, PackedIndex, PackedView, RowLayout,
};
use std::borrow::Cow;

/// A batch in the caller's own layout.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    /// `[B, T, F]` or `[T, B, F]`, padded, with each sequence's length.
    Padded { data: &'a [f32], batch: usize, steps: usize, major: Major, align: Align, lengths: &'a [usize] },
    /// A PyTorch packed sequence ([`crate::PackedSequence::view`]).
    Packed(PackedView<'a>),
}

/// A batch's shape and layout without its data (which may lie on a
/// device): an [`Input`]'s other fields.
#[derive(Clone, Copy, Debug)]
pub enum BatchShape<'a> {
    Padded { batch: usize, steps: usize, major: Major, align: Align, lengths: &'a [usize] },
    Packed(PackedIndex<'a>),
}

impl<'a> BatchShape<'a> {
    /// The batch with its data on the host.
    pub fn with_data(self, data: &'a [f32]) -> Input<'a> {
        match self {
            BatchShape::Padded { batch, steps, major, align, lengths } => {
                Input::Padded { data, batch, steps, major, align, lengths }
            }
            BatchShape::Packed(p) => Input::Packed(PackedView {
                data,
                features: p.features,
                batch_sizes: p.batch_sizes,
                sorted_indices: p.sorted_indices,
                unsorted_indices: p.unsorted_indices,
            }),
        }
    }
}

impl<'a> Input<'a> {
    /// Its shape and layout, and its data.
    pub fn split(&self) -> (BatchShape<'a>, &'a [f32]) {
        match *self {
            Input::Padded { data, batch, steps, major, align, lengths } => {
                (BatchShape::Padded { batch, steps, major, align, lengths }, data)
            }
            Input::Packed(p) => (BatchShape::Packed(p.index()), p.data),
        }
    }
}

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

/// What a training forward keeps for [`Model::backward`].
#[derive(Debug)]
pub struct Trace<'a> {
    input: Input<'a>,
    batch: LaidOutBatch,
    kept: Kept<'static>,
}

/// What the backward reads of a training forward.
#[derive(Debug)]
pub(crate) enum Kept<'r> {
    /// Kept by the back end, one tape per layer and direction.
    Tapes {
        /// The input of each layer after the first.
        layer_inputs: Vec<Vec<f32>>,
        tapes: Vec<Tape>,
    },
    /// Laid out in the caller's reserve ([`Model::reserve_floats_per_row`]).
    Reserve(&'r [f32]),
}

/// Where a forward keeps what the backward reads.
pub(crate) enum Keep<'r> {
    Nothing,
    /// Tapes the back end keeps ([`Kept::Tapes`]).
    Tapes,
    /// The caller's reserve ([`Kept::Reserve`]).
    Reserve(&'r mut [f32]),
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
    pub d_input: &'o mut [f32],
    /// One buffer per state, or none: the initial states' gradients are not wanted.
    pub d_h0: Vec<&'o mut [f32]>,
    pub d_params: Vec<Vec<&'o mut [f32]>>,
}

/// A model's parameters for one pass: its own (with the back end's forms
/// kept across calls), or the caller's (prepared afresh for the pass).
pub(crate) struct PassParams<'a> {
    /// `[layer * directions + direction][param]`.
    params: Vec<Vec<&'a [f32]>>,
    prepared: Prepared<'a>,
}

enum Prepared<'a> {
    Model(&'a [PreparedWeights]),
    Pass(Vec<PreparedWeights>),
}

impl PassParams<'_> {
    fn slot(&self, slot: usize) -> (&[&[f32]], &PreparedWeights) {
        let prepared = match &self.prepared {
            Prepared::Model(p) => &p[slot],
            Prepared::Pass(p) => &p[slot],
        };
        (&self.params[slot], prepared)
    }
}

/// One layer's part of a reserve: each direction's tape, then (but for the
/// last layer) the layer's output, which the next layer reads.
#[derive(Clone, Debug)]
struct ReserveLayer {
    tapes: std::ops::Range<usize>,
    /// Floats of one direction's tape.
    tape_len: usize,
    output: std::ops::Range<usize>,
}

/// A call's batch, checked and laid out: its order by length and where
/// each row lies.
#[derive(Debug)]
pub struct LaidOutBatch {
    pub(crate) order: BatchOrder,
    pub(crate) layout: RowLayout,
    /// Layout rows: a padded batch's `B * T`, a packed batch's `N`.
    pub(crate) rows: usize,
    data_features: usize,
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
                Ok(LaidOutBatch { order, layout, rows: batch * steps, data_features: self.input_size() })
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
                Ok(LaidOutBatch { rows: order.rows(), order, layout, data_features: p.features })
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

    /// Checks `[L*D, B, size]` state buffers, or makes zeros.
    pub(crate) fn states_or_zeros<'s>(
        &self,
        given: Option<&[&'s [f32]]>,
        batch: usize,
        what: &str,
    ) -> Result<Vec<Cow<'s, [f32]>>> {
        match given {
            None => Ok(self
                .state_shapes(batch)
                .iter()
                .map(|shape| Cow::Owned(vec![0.0; shape.iter().product()]))
                .collect()),
            Some(g) => {
                self.check_states(g.len(), |i| g[i].len(), batch, what)?;
                Ok(g.iter().map(|&s| Cow::Borrowed(s)).collect())
            }
        }
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

    /// The model's own parameters, as a pass reads them.
    pub(crate) fn own_params(&self) -> Result<PassParams<'_>> {
        self.ensure_owns_weights()?;
        Ok(PassParams {
            params: self.params.iter().map(|ps| ps.iter().map(Vec::as_slice).collect()).collect(),
            prepared: Prepared::Model(&self.prepared),
        })
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

    /// The caller's parameters (`[layer * directions + direction][param]`,
    /// the model's shapes), checked.
    pub(crate) fn caller_params<'a>(&self, given: &[Vec<&'a [f32]>]) -> Result<PassParams<'a>> {
        self.check_weights(given)?;
        Ok(PassParams {
            params: given.to_vec(),
            prepared: Prepared::Pass(given.iter().map(|_| PreparedWeights::for_one_pass()).collect()),
        })
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

    /// Where each layer's tapes and output lie in a reserve of `rows`
    /// layout rows, or `None` where the back end keeps its tapes itself.
    fn reserve_layout(&self, rows: usize) -> Option<Vec<ReserveLayer>> {
        if !self.backend.keeps_tape_in_caller_memory() {
            return None;
        }
        let dirs = self.directions();
        let mut at = 0;
        let mut out = Vec::with_capacity(self.layers.len());
        for (k, layer) in self.layers.iter().enumerate() {
            let tape_len = rows * layer.tape().floats_per_row();
            let tapes = at..at + dirs * tape_len;
            let out_len = if k + 1 < self.layers.len() { rows * layer.output_size * dirs } else { 0 };
            let output = tapes.end..tapes.end + out_len;
            at = output.end;
            out.push(ReserveLayer { tapes, tape_len, output });
        }
        Some(out)
    }

    /// Floats per layout row (each of a padded batch's `B * T` rows, or a
    /// packed batch's `N`) of the reserve in which a training forward keeps
    /// what its backward reads ([`Model::forward_into`]): every layer's
    /// tapes, and the outputs the next layers read. `None` where the back
    /// end keeps its tapes itself.
    pub fn reserve_floats_per_row(&self) -> Option<usize> {
        self.reserve_layout(1).and_then(|l| l.last().map(|l| l.output.end))
    }

    /// Inference: runs every layer and direction over the batch.
    pub fn forward(&self, input: Input, h0: Option<&[Vec<f32>]>) -> Result<Output> {
        let (out, ..) = self.forward_owned(input, h0, Keep::Nothing)?;
        Ok(out)
    }

    /// A forward pass that keeps what [`Model::backward`] needs.
    pub fn forward_train<'a>(
        &self,
        input: Input<'a>,
        h0: Option<&[Vec<f32>]>,
    ) -> Result<(Output, Trace<'a>)> {
        let (out, kept, batch) = self.forward_owned(input, h0, Keep::Tapes)?;
        let kept = kept.ok_or_else(|| RuntimeError::Internal("training forward kept no tapes".into()))?;
        Ok((out, Trace { input, batch, kept }))
    }

    /// A forward pass into buffers of its own.
    fn forward_owned(
        &self,
        input: Input,
        h0: Option<&[Vec<f32>]>,
        keep: Keep<'static>,
    ) -> Result<(Output, Option<Kept<'static>>, LaidOutBatch)> {
        let p = self.prepare(&input)?;
        let training = !matches!(keep, Keep::Nothing);
        self.ensure_pass_fits(&p, training)?;
        let h0: Option<Vec<&[f32]>> = h0.map(|h| h.iter().map(Vec::as_slice).collect());
        let h0 = self.states_or_zeros(h0.as_deref(), p.order.batch(), "h0")?;
        let mut data = vec![0.0f32; p.rows * self.output_size()];
        let mut final_states: Vec<Vec<f32>> = h0.iter().map(|b| vec![0.0; b.len()]).collect();
        let out = ForwardOut {
            output: &mut data,
            final_states: final_states.iter_mut().map(Vec::as_mut_slice).collect(),
        };
        let kept = self.run_forward(&input, &p, &self.own_params()?, &h0, out, keep)?;
        Ok((Output { data, final_states }, kept, p))
    }

    /// Runs every layer and direction, writing `out` (padding rows included).
    pub(crate) fn run_forward<'r>(
        &self,
        input: &Input,
        p: &LaidOutBatch,
        params: &PassParams,
        h0: &[Cow<[f32]>],
        out: ForwardOut,
        keep: Keep<'r>,
    ) -> Result<Option<Kept<'r>>> {
        let batch = p.order.batch();
        check_len("output", out.output.len(), &[p.rows, self.output_size()])?;
        let padding = padding_rows(&p.order, &p.layout, p.rows);
        zero_rows(out.output, self.output_size(), &padding);
        let ForwardOut { output, mut final_states } = out;
        if batch == 0 {
            // An empty batch: nothing to run, and no back end sees one.
            for (dst, src) in final_states.iter_mut().zip(h0) {
                dst.copy_from_slice(src);
            }
            return Ok(match keep {
                Keep::Nothing => None,
                Keep::Tapes => Some(Kept::Tapes { layer_inputs: Vec::new(), tapes: Vec::new() }),
                Keep::Reserve(r) => Some(Kept::Reserve(r)),
            });
        }
        let (training, keep_tapes) = (!matches!(keep, Keep::Nothing), matches!(keep, Keep::Tapes));
        let mut reserve = match keep {
            Keep::Reserve(r) => Some((self.checked_reserve_layout(p.rows, r.len())?, r)),
            _ => None,
        };
        let dirs = self.directions();
        let mut layer_inputs: Vec<Vec<f32>> = Vec::new();
        let mut tapes = Vec::new();
        // The previous layer's output, when it is not in the reserve.
        let mut previous: Option<Vec<f32>> = None;
        let mut output = Some(output);
        for (k, layer) in self.layers.iter().enumerate() {
            let width = layer.output_size * dirs;
            let last = k + 1 == self.layers.len();
            // This layer's part of the reserve: the previous layer's output
            // (before the part), this layer's tapes, and its output.
            let (reserved_input, mut tape_part, mut reserved_out) = match &mut reserve {
                Some((l, r)) => {
                    let (before, rest) = r.split_at_mut(l[k].tapes.start);
                    let (tapes, rest) = rest.split_at_mut(l[k].tapes.len());
                    let input = k.checked_sub(1).map(|j| &before[l[j].output.clone()]);
                    (input, Some((tapes, l[k].tape_len)), Some(&mut rest[..l[k].output.len()]))
                }
                None => (None, None, None),
            };
            let in_data: &[f32] = match (k, &previous, reserved_input) {
                (0, ..) => Self::input_data(input),
                (_, Some(v), _) => v,
                (_, None, Some(v)) => v,
                _ => return Err(RuntimeError::Internal(format!("no input for layer {k}"))),
            };
            let in_width = if k == 0 { p.data_features } else { layer.input_size };
            let mut owned = Vec::new();
            let dst: &mut [f32] = match (last, reserved_out.as_deref_mut()) {
                (true, _) => output.take().ok_or_else(|| RuntimeError::Internal("output taken".into()))?,
                (false, Some(r)) => {
                    // Rows nothing writes are zeroed: a reserve holds no stale memory.
                    zero_rows(r, width, &padding);
                    r
                }
                (false, None) => {
                    // Recycled: only valid rows are written, and only they are read.
                    owned = crate::pool::take(p.rows * width);
                    &mut owned
                }
            };
            for d in 0..dirs {
                let slot = k * dirs + d;
                let h0_slices: Vec<&[f32]> = layer
                    .state_sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| &h0[i][slot * batch * n..(slot + 1) * batch * n])
                    .collect();
                let (params, prepared) = params.slot(slot);
                let job = ForwardJob {
                    cell: &self.compiled,
                    layer,
                    params,
                    order: &p.order,
                    reverse: d == 1,
                    input: Rows { data: in_data, layout: &p.layout, width: in_width, offset: 0 },
                    h0: &h0_slices,
                    training,
                    prepared,
                };
                let mut rows = RowsMut { data: dst, layout: &p.layout, width, offset: d * layer.output_size };
                let finals = match tape_part.as_mut() {
                    Some((tapes, len)) => {
                        let mine = &mut tapes[d * *len..(d + 1) * *len];
                        self.backend.forward_into_tape(&job, &mut rows, mine)?
                    }
                    None => {
                        let r = self.backend.forward(&job, &mut rows)?;
                        tapes.extend(r.tape);
                        r.final_states
                    }
                };
                for (i, &n) in layer.state_sizes.iter().enumerate() {
                    final_states[i][slot * batch * n..(slot + 1) * batch * n].copy_from_slice(&finals[i]);
                }
            }
            let input_of_this = std::mem::take(&mut previous);
            match input_of_this {
                Some(v) if keep_tapes => layer_inputs.push(v),
                Some(v) => crate::pool::give(v),
                None => {}
            }
            if !last && reserved_out.is_none() {
                previous = Some(owned);
            }
        }
        Ok(match (keep_tapes, reserve) {
            (true, _) => Some(Kept::Tapes { layer_inputs, tapes }),
            (false, Some((_, r))) => Some(Kept::Reserve(r)),
            (false, None) => None,
        })
    }

    /// The reserve's layout for `rows` layout rows, checked against its length.
    fn checked_reserve_layout(&self, rows: usize, len: usize) -> Result<Vec<ReserveLayer>> {
        let layout = self.reserve_layout(rows).ok_or_else(|| RuntimeError::Backend {
            backend: self.backend.name().into(),
            message: "this back end keeps its tapes itself: it takes no reserve".into(),
        })?;
        let need = layout.last().map_or(0, |l| l.output.end);
        if need != len {
            return Err(RuntimeError::Shape {
                tensor: "reserve".into(),
                expected: format!("{need} floats ({rows} rows of {})", need / rows.max(1)),
                found: format!("{len} floats"),
            });
        }
        Ok(layout)
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
        let d_final: Option<Vec<&[f32]>> = d_final.map(|h| h.iter().map(Vec::as_slice).collect());
        let d_final = self.states_or_zeros(d_final.as_deref(), p.order.batch(), "grad_final")?;
        let mut d_input = vec![0.0f32; if p.order.batch() == 0 { 0 } else { p.rows * self.input_size() }];
        let mut d_h0: Vec<Vec<f32>> = d_final.iter().map(|b| vec![0.0; b.len()]).collect();
        let mut d_params = self.zeroed_params();
        let out = BackwardOut {
            d_input: &mut d_input,
            d_h0: d_h0.iter_mut().map(Vec::as_mut_slice).collect(),
            d_params: d_params.iter_mut().map(|ps| ps.iter_mut().map(Vec::as_mut_slice).collect()).collect(),
        };
        self.run_backward(&trace.input, p, &self.own_params()?, &trace.kept, d_output, &d_final, out)?;
        Ok(Gradients { d_input, d_h0, d_params })
    }

    /// Runs every layer and direction backwards, writing `out`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_backward(
        &self,
        input: &Input,
        p: &LaidOutBatch,
        params: &PassParams,
        kept: &Kept,
        d_output: &[f32],
        d_final: &[Cow<[f32]>],
        out: BackwardOut,
    ) -> Result<()> {
        let batch = p.order.batch();
        let dirs = self.directions();
        let BackwardOut { d_input, mut d_h0, mut d_params } = out;
        if batch == 0 {
            d_h0.iter_mut().for_each(|b| b.fill(0.0));
            d_params.iter_mut().flatten().for_each(|b| b.fill(0.0));
            return Ok(());
        }
        check_len("grad_output", d_output.len(), &[p.rows, self.output_size()])?;
        check_len("grad_input", d_input.len(), &[p.rows, self.input_size()])?;
        d_input.fill(0.0);
        // The reserve's layout, when the tapes are there.
        let layout = match kept {
            Kept::Reserve(r) => self.checked_reserve_layout(p.rows, r.len())?,
            Kept::Tapes { .. } => Vec::new(),
        };
        let mut d_above: Cow<[f32]> = Cow::Borrowed(d_output);
        let mut d_input = Some(d_input);
        for (k, layer) in self.layers.iter().enumerate().rev() {
            let in_data: &[f32] = match (k, kept) {
                (0, _) => Self::input_data(input),
                (_, Kept::Tapes { layer_inputs, .. }) => &layer_inputs[k - 1],
                (_, Kept::Reserve(r)) => &r[layout[k - 1].output.clone()],
            };
            let in_width = layer.input_size;
            let mut owned = Vec::new();
            let d_in: &mut [f32] = if k == 0 {
                d_input.take().ok_or_else(|| RuntimeError::Internal("grad_input taken".into()))?
            } else {
                owned = crate::pool::take_zeroed(p.rows * in_width);
                &mut owned
            };
            for d in 0..dirs {
                let slot = k * dirs + d;
                let d_final_slices: Vec<&[f32]> = layer
                    .state_sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| &d_final[i][slot * batch * n..(slot + 1) * batch * n])
                    .collect();
                let (params, prepared) = params.slot(slot);
                let job = BackwardJob {
                    cell: &self.compiled,
                    layer,
                    params,
                    prepared,
                    order: &p.order,
                    reverse: d == 1,
                    input: Rows { data: in_data, layout: &p.layout, width: in_width, offset: 0 },
                    d_output: Rows {
                        data: &d_above,
                        layout: &p.layout,
                        width: layer.output_size * dirs,
                        offset: d * layer.output_size,
                    },
                    d_final: &d_final_slices,
                };
                let mut rows_mut = RowsMut { data: d_in, layout: &p.layout, width: in_width, offset: 0 };
                let r = match kept {
                    Kept::Tapes { tapes, .. } => {
                        let tape = tapes
                            .get(slot)
                            .ok_or_else(|| RuntimeError::Internal(format!("no tape for layer {k}")))?;
                        self.backend.backward(&job, tape, &mut rows_mut)?
                    }
                    Kept::Reserve(reserve) => {
                        let (start, len) =
                            (layout[k].tapes.start + d * layout[k].tape_len, layout[k].tape_len);
                        self.backend.backward_from_tape(&job, &reserve[start..start + len], &mut rows_mut)?
                    }
                };
                for ((dst, src), &n) in d_h0.iter_mut().zip(&r.d_h0).zip(&layer.state_sizes) {
                    dst[slot * batch * n..(slot + 1) * batch * n].copy_from_slice(src);
                }
                for (dst, src) in d_params[slot].iter_mut().zip(&r.d_params) {
                    check_len("parameter gradient", dst.len(), &[src.len()])?;
                    dst.copy_from_slice(src);
                }
            }
            if k > 0 {
                if let Cow::Owned(done) = std::mem::replace(&mut d_above, Cow::Owned(owned)) {
                    crate::pool::give(done);
                }
            }
        }
        Ok(())
    }
}

impl Model {
    /// Zeroed parameter gradients shaped like this model's (input and
    /// initial-state gradients empty), for [`Model::backward_into`].
    pub fn zero_gradients(&self) -> Gradients {
        Gradients { d_input: Vec::new(), d_h0: Vec::new(), d_params: self.zeroed_params() }
    }

    /// Like [`Model::backward`], but adds into `acc` (e.g. to accumulate
    /// over several batches) instead of returning new buffers.
    pub fn backward_into(
        &self,
        trace: &Trace,
        d_output: &[f32],
        d_final: Option<&[Vec<f32>]>,
        acc: &mut Gradients,
    ) -> Result<()> {
        let g = self.backward(trace, d_output, d_final)?;
        g.accumulate_into(acc)
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
