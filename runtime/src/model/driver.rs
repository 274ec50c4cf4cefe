//! The one driver of every pass over a whole model: it turns the model's
//! layers, the laid-out batch and the memory of a pass into the work of
//! each layer and direction, which a [`Device`] executes.
//!
//! The memory of a pass is given as [`Span`]s, addresses and lengths: the
//! runtime's own buffers and a caller's host memory (a framework's CPU
//! tensors) on the host, a caller's device memory (CUDA tensors) on a
//! device. The driver decides, once for every entry point:
//!
//! - where each layer reads and writes: layer `k` reads layer `k - 1`'s
//!   output; a bidirectional layer writes its forward direction's output
//!   in features `[0, O)` and the reverse one's in `[O, 2O)`; the outputs
//!   between layers live in the reserve (training) or in scratch memory,
//!   laid out like the caller's input, so the input and the output are
//!   never copied or reordered;
//! - where a training forward keeps what the backward reads: each layer
//!   and direction's tape in the reserve, as the layer's program lays it
//!   out ([`cellc::program::TapeLayout`]), then the output the next layer
//!   reads ([`Model::reserve_floats_per_row`]);
//! - which rows of padding are zeroed, and which state rows (of the
//!   `[layers * directions, B, size]` state tensors) each direction reads
//!   and writes;
//! - the backward's walk down the layers, each layer's input adjoint
//!   becoming the adjoint of the output below;
//! - with per-step resets, the layers run the batch's segments, and the
//!   states map between segments and sequences ([`crate::resets`]);
//! - DropConnect: the masked copies of a layer's parameters that it reads,
//!   and its gradients times the same masks.

use crate::backend::Device;
use crate::error::{Result, RuntimeError};
use crate::masks::DropConnect;
use crate::model::Model;
use crate::options::Settled;
use crate::pass::{
    Buf, Dropping, LayerBackward, LayerForward, Pass, PassWeights, PreparedWeights, RowPairs, RowSpan, Span,
};
use crate::sequence::{check_len, LaidOutBatch, Segments};
use std::ops::Range;

/// The memory of a forward pass.
#[derive(Clone, Debug)]
pub struct ForwardSpans {
    pub input: Span,
    /// `[layers * directions, B, size]` each; `None`: zeros.
    pub h0: Option<Vec<Span>>,
    pub output: Span,
    pub finals: Vec<Span>,
    /// Training: [`Model::reserve_floats_per_row`] floats per layout row.
    pub reserve: Option<Span>,
}

/// The memory of a backward pass.
#[derive(Clone, Debug)]
pub struct BackwardSpans {
    pub input: Span,
    pub reserve: Span,
    pub d_output: Span,
    /// The initial states the forward read, as [`ForwardSpans::h0`]; `None`: zeros.
    pub h0: Option<Vec<Span>>,
    /// `None`: zeros.
    pub d_final: Option<Vec<Span>>,
    pub d_input: Span,
    /// `None`: not wanted.
    pub d_h0: Option<Vec<Span>>,
    /// `[layer * directions + direction][param]`.
    pub d_params: Vec<Vec<Span>>,
}

/// One layer's part of a reserve: each direction's tape, then (but for the
/// last layer) the layer's output, which the next layer reads.
#[derive(Clone, Debug)]
pub(crate) struct ReserveLayer {
    pub(crate) tapes: Range<usize>,
    /// Floats of one direction's tape.
    pub(crate) tape_len: usize,
    pub(crate) output: Range<usize>,
}

impl ReserveLayer {
    fn tape(&self, direction: usize) -> Range<usize> {
        let start = self.tapes.start + direction * self.tape_len;
        start..start + self.tape_len
    }
}

/// Where each layer's tapes and output lie in a reserve of `rows` layout rows.
pub(crate) fn reserve_layout(model: &Model, rows: usize) -> Vec<ReserveLayer> {
    let dirs = model.directions();
    let mut at = 0;
    let mut out = Vec::with_capacity(model.layers.len());
    for (k, layer) in model.layers.iter().enumerate() {
        let tape_len = rows * layer.tape().floats_per_row();
        let tapes = at..at + dirs * tape_len;
        let out_len = if k + 1 < model.layers.len() { rows * layer.output_size * dirs } else { 0 };
        let output = tapes.end..tapes.end + out_len;
        at = output.end;
        out.push(ReserveLayer { tapes, tape_len, output });
    }
    out
}

/// The reserve's layout for `rows` layout rows, checked against its length.
fn checked_reserve_layout(model: &Model, rows: usize, len: usize) -> Result<Vec<ReserveLayer>> {
    let layout = reserve_layout(model, rows);
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

/// Checks every buffer of a forward pass against its shape, naming it:
/// the same checks for the model's own buffers and a caller's, on the
/// host or a device.
fn check_forward_spans(model: &Model, p: &LaidOutBatch, spans: &ForwardSpans) -> Result<()> {
    let batch = p.order.batch();
    if let Some(h0) = &spans.h0 {
        model.check_states(h0.len(), |i| h0[i].len, batch, "h0")?;
    }
    check_len("output", spans.output.len, &[p.rows, model.output_size()])?;
    model.check_states(spans.finals.len(), |i| spans.finals[i].len, batch, "final_states")
}

/// Checks every buffer of a backward pass but the reserve (checked
/// where it is laid out) against its shape, naming it.
fn check_backward_spans(model: &Model, p: &LaidOutBatch, spans: &BackwardSpans) -> Result<()> {
    let batch = p.order.batch();
    check_len("grad_output", spans.d_output.len, &[p.rows, model.output_size()])?;
    check_len("grad_input", spans.d_input.len, &[p.rows, model.input_size()])?;
    if let Some(h0) = &spans.h0 {
        model.check_states(h0.len(), |i| h0[i].len, batch, "h0")?;
    }
    if let Some(d) = &spans.d_final {
        model.check_states(d.len(), |i| d[i].len, batch, "grad_final")?;
    }
    if let Some(d) = &spans.d_h0 {
        model.check_states(d.len(), |i| d[i].len, batch, "grad_h0")?;
    }
    model.check_weights(&spans.d_params).map_err(RuntimeError::named_as_gradient)
}

/// Slot `slot`'s `[B, size]` rows of each `[layers * directions, B, size]`
/// state tensor (or its adjoint), `sizes` the cell's state sizes.
fn slot_states(tensors: &[Span], sizes: &[usize], (slot, batch): (usize, usize)) -> Vec<Span> {
    tensors.iter().zip(sizes).map(|(s, &n)| s.slot(slot, batch, n)).collect()
}

/// One pass of a model on a device: what every operation shares, and the
/// scratch memory it holds until it ends.
pub(crate) struct Run<'a> {
    model: &'a Model,
    device: &'a dyn Device,
    pass: Pass<'a>,
    weights: &'a PassWeights<'a>,
    settled: &'a Settled,
    held: Vec<Buf>,
}

/// A layer and direction's parameters as its pass reads them: with
/// DropConnect, masked copies prepared for the pass.
struct LayerParams<'w> {
    spans: Vec<Span>,
    masked: Option<PreparedWeights>,
    prepared: &'w PreparedWeights,
}

impl LayerParams<'_> {
    fn prepared(&self) -> &PreparedWeights {
        self.masked.as_ref().unwrap_or(self.prepared)
    }
}

impl<'a> Run<'a> {
    /// A pass of `model` on `device` over `batch`, reading `weights`, as
    /// its call's options were `settled`.
    pub(crate) fn new(
        model: &'a Model,
        device: &'a dyn Device,
        (batch, settled): (&'a LaidOutBatch, &'a Settled),
        weights: &'a PassWeights<'a>,
    ) -> Run<'a> {
        let pass = Pass { cell: &model.compiled, layers: &model.layers, batch, precision: settled.precision };
        Run { model, device, pass, weights, settled, held: Vec::new() }
    }

    /// `floats` floats of the device's memory, held until the pass ends.
    fn scratch(&mut self, floats: usize, zeroed: bool) -> Result<Span> {
        let buf = self.device.scratch(&self.pass, floats, zeroed)?;
        let span = buf.span();
        self.held.push(buf);
        Ok(span)
    }

    /// `floats` zeroed floats of the device's memory that outlive the
    /// pass (a staged pass's inputs and results).
    pub(crate) fn buffer(&self, floats: usize) -> Result<Buf> {
        self.device.scratch(&self.pass, floats, true)
    }

    /// A buffer's floats into host memory `to` (as long), once the pass's work is done.
    pub(crate) fn download(&self, buf: &Buf, to: &mut [f32]) -> Result<()> {
        self.device.download(&self.pass, buf.span(), to)
    }

    fn move_rows(
        &mut self,
        to: Span,
        from: Span,
        width: usize,
        (pairs, add): (&[(usize, usize)], bool),
    ) -> Result<()> {
        self.device.move_rows(&self.pass, RowPairs { to, from, width, pairs, add })
    }

    fn copy(&mut self, to: Span, from: Span) -> Result<()> {
        self.move_rows(to, from, to.len.min(from.len), (&[(0, 0)], false))
    }

    fn zero(&mut self, span: Span) -> Result<()> {
        self.device.zero(&self.pass, span, None)
    }

    /// State tensors given, or zeros made in scratch memory.
    fn states_or_scratch(&mut self, given: Option<Vec<Span>>, batch: usize) -> Result<Vec<Span>> {
        match given {
            Some(g) => Ok(g),
            None => {
                let shapes = self.model.state_shapes(batch);
                shapes.iter().map(|shape| self.scratch(shape.iter().product(), true)).collect()
            }
        }
    }

    /// Slot `slot`'s parameters, those with a DropConnect mask copied into
    /// scratch memory and multiplied by it.
    fn layer_params(&mut self, slot: usize, drop_connect: &DropConnect) -> Result<LayerParams<'a>> {
        let weights: &'a PassWeights<'a> = self.weights;
        let (spans, prepared) = weights.slot(slot);
        let mut spans = spans.to_vec();
        for (param, fill) in drop_connect {
            let from = spans[*param];
            let masked = self.scratch(from.len, false)?;
            self.copy(masked, from)?;
            let rows = RowSpan { span: masked, width: from.len, offset: 0 };
            self.device.drop_out(&self.pass, rows, Dropping::Parameter(fill))?;
            spans[*param] = masked;
        }
        let masked = (!drop_connect.is_empty()).then(PreparedWeights::for_one_pass);
        Ok(LayerParams { spans, masked, prepared })
    }

    /// The masks of layer `k` in direction `d` (see [`crate::masks`]):
    /// those its steps read, filled in `rows` (scratch memory of the pass,
    /// made the first time and reused by every layer and direction), and
    /// its DropConnect masks.
    fn fill_masks(
        &mut self,
        (k, d): (usize, usize),
        rows: &mut Option<Span>,
    ) -> Result<(Option<RowSpan>, DropConnect)> {
        let (model, masking) = (self.model, &self.settled.masking);
        let layer = &model.layers[k];
        let (step_masks, drop_connect) = masking.of_layer(&model.compiled.forward, layer, k, d);
        let Some(step_masks) = step_masks else { return Ok((None, drop_connect)) };
        let width = step_masks.width;
        // In evaluation every row's masks are the same: one row, read by
        // every row of the layout (rows 0 floats apart).
        let (filled_rows, stride) = match masking.seed {
            Some(_) => (self.pass.batch.rows, width),
            None => (1, 0),
        };
        let span = match *rows {
            Some(span) => span,
            None => {
                let widest = model.layers.iter().map(|l| l.mask_width).max().unwrap_or(0);
                *rows.insert(self.scratch(filled_rows * widest, false)?)
            }
        };
        let masks = RowSpan { span: span.part(0..filled_rows * width), width: stride, offset: 0 };
        self.device.fill_masks(&self.pass, masks, &step_masks)?;
        Ok((Some(masks), drop_connect))
    }

    /// Runs every layer and direction forwards over `spans`, writing the
    /// output (padding rows zero), the final states and, training, the reserve.
    pub(crate) fn forward(&mut self, spans: ForwardSpans) -> Result<()> {
        let (model, p) = (self.model, self.pass.batch);
        let batch = p.order.batch();
        check_forward_spans(model, p, &spans)?;
        let reserve = match spans.reserve {
            Some(r) => Some((r, checked_reserve_layout(model, p.rows, r.len)?)),
            None => None,
        };
        let h0 = self.states_or_scratch(spans.h0, batch)?;
        if batch == 0 {
            // An empty batch: nothing to run, and no device sees one.
            for (&to, &from) in spans.finals.iter().zip(&h0) {
                self.copy(to, from)?;
            }
            return Ok(());
        }
        let padding = crate::sequence::padding_rows(&p.order, &p.layout, p.rows);
        let segments = p.segments.as_deref();
        let dirs = model.directions();
        let mut mask_rows = None;
        let mut input = RowSpan { span: spans.input, width: p.data_features, offset: 0 };
        for (k, layer) in model.layers.iter().enumerate() {
            let width = layer.output_size * dirs;
            // The caller's output and the reserve hold zeros at padding;
            // scratch between layers needs none: only valid rows are
            // written, and only they are read.
            let (output, read_whole) = match (k + 1 == model.layers.len(), &reserve) {
                (true, _) => (spans.output, true),
                (false, Some((r, parts))) => (r.part(parts[k].output.clone()), true),
                (false, None) => (self.scratch(p.rows * width, false)?, false),
            };
            if read_whole {
                self.device.zero(&self.pass, output, Some((width, &padding)))?;
            }
            let output = RowSpan { span: output, width, offset: 0 };
            for d in 0..dirs {
                let slot = k * dirs + d;
                let states = |tensors: &[Span]| slot_states(tensors, &layer.state_sizes, (slot, batch));
                let (masks, drop_connect) = self.fill_masks((k, d), &mut mask_rows)?;
                let params = self.layer_params(slot, &drop_connect)?;
                // With resets, the layer runs the batch's segments (see crate::resets).
                let sizes = &layer.state_sizes;
                let (job_h0, job_finals) = match segments {
                    None => (states(&h0), states(&spans.finals)),
                    Some(s) => (s.initial(self, &states(&h0), sizes)?, s.scratch(self, sizes)?),
                };
                self.device.forward(
                    &self.pass,
                    LayerForward {
                        layer,
                        reverse: d == 1,
                        params: params.spans.clone(),
                        prepared: params.prepared(),
                        input,
                        output: RowSpan { offset: d * layer.output_size, ..output },
                        h0: job_h0,
                        finals: job_finals.clone(),
                        tape: reserve.as_ref().map(|(r, parts)| r.part(parts[k].tape(d))),
                        masks,
                    },
                )?;
                if let Some(s) = segments {
                    s.finals(self, &job_finals, &states(&spans.finals), sizes)?;
                }
            }
            // In training mode, what the next layer reads (and what a
            // reserve keeps for its backward) is dropped out.
            if let (Some(dropout), false) = (&self.settled.dropout, k + 1 == model.layers.len()) {
                let masks = dropout.after(k, dirs, layer.output_size);
                self.device.drop_out(&self.pass, output, Dropping::Rows(&masks))?;
            }
            input = output;
        }
        Ok(())
    }

    /// Runs every layer and direction backwards over `spans`, reading the
    /// reserve a training forward of the same call filled; writes every
    /// gradient (zeros at padding).
    pub(crate) fn backward(&mut self, spans: BackwardSpans) -> Result<()> {
        let (model, p) = (self.model, self.pass.batch);
        let batch = p.order.batch();
        check_backward_spans(model, p, &spans)?;
        let d_h0 = self.states_or_scratch(spans.d_h0, batch)?;
        if batch == 0 {
            for &s in d_h0.iter().chain(spans.d_params.iter().flatten()).chain([&spans.d_input]) {
                self.zero(s)?;
            }
            return Ok(());
        }
        let parts = checked_reserve_layout(model, p.rows, spans.reserve.len)?;
        let d_final = self.states_or_scratch(spans.d_final, batch)?;
        let h0 = self.states_or_scratch(spans.h0, batch)?;
        let segments = p.segments.as_deref();
        let dirs = model.directions();
        let mut mask_rows = None;
        let mut d_above = spans.d_output;
        for (k, layer) in model.layers.iter().enumerate().rev() {
            let input = match k {
                0 => RowSpan { span: spans.input, width: p.data_features, offset: 0 },
                _ => RowSpan {
                    span: spans.reserve.part(parts[k - 1].output.clone()),
                    width: layer.input_size,
                    offset: 0,
                },
            };
            // Backward passes add into the input's adjoint.
            let d_input = match k {
                0 => {
                    self.zero(spans.d_input)?;
                    spans.d_input
                }
                _ => self.scratch(p.rows * layer.input_size, true)?,
            };
            let width = layer.output_size * dirs;
            for d in 0..dirs {
                let slot = k * dirs + d;
                let states = |tensors: &[Span]| slot_states(tensors, &layer.state_sizes, (slot, batch));
                let (masks, drop_connect) = self.fill_masks((k, d), &mut mask_rows)?;
                let params = self.layer_params(slot, &drop_connect)?;
                let sizes = &layer.state_sizes;
                let (job_h0, job_d_final, job_d_h0) = match segments {
                    None => (states(&h0), states(&d_final), states(&d_h0)),
                    Some(s) => (
                        s.initial(self, &states(&h0), sizes)?,
                        s.final_adjoints(self, &states(&d_final), sizes)?,
                        s.scratch(self, sizes)?,
                    ),
                };
                self.device.backward(
                    &self.pass,
                    LayerBackward {
                        layer,
                        reverse: d == 1,
                        params: params.spans.clone(),
                        prepared: params.prepared(),
                        input,
                        tape: spans.reserve.part(parts[k].tape(d)),
                        d_output: RowSpan { span: d_above, width, offset: d * layer.output_size },
                        d_final: job_d_final,
                        h0: job_h0,
                        d_input: RowSpan { span: d_input, width: layer.input_size, offset: 0 },
                        d_h0: job_d_h0.clone(),
                        d_params: spans.d_params[slot].clone(),
                        masks,
                    },
                )?;
                // The masked parameter's gradient, times the mask: the parameter's.
                for (param, fill) in &drop_connect {
                    let grad = spans.d_params[slot][*param];
                    let rows = RowSpan { span: grad, width: grad.len, offset: 0 };
                    self.device.drop_out(&self.pass, rows, Dropping::Parameter(fill))?;
                }
                if let Some(s) = segments {
                    s.initial_adjoints(self, &job_d_h0, &states(&d_h0), sizes)?;
                }
            }
            // The adjoint of the layer below's output, through the forward's dropout (drawn again).
            if let (Some(dropout), Some(below)) = (&self.settled.dropout, k.checked_sub(1)) {
                let rows = RowSpan { span: d_input, width: layer.input_size, offset: 0 };
                let masks = dropout.after(below, dirs, model.layers[below].output_size);
                self.device.drop_out(&self.pass, rows, Dropping::Rows(&masks))?;
            }
            d_above = d_input;
        }
        Ok(())
    }
}

/// The states of a batch with resets: the layers run its segments, and
/// the driver maps their states to the sequences' ([`crate::resets`]).
impl Segments {
    /// Segments in the batch.
    fn count(&self) -> usize {
        self.sequence.len()
    }

    /// Each segment's initial states, `[segments, size]` each in scratch
    /// memory of the pass: its sequence's, from `[B, size]` `states`.
    pub(crate) fn initial(&self, run: &mut Run, states: &[Span], sizes: &[usize]) -> Result<Vec<Span>> {
        let pairs: Vec<(usize, usize)> = self.sequence.iter().copied().enumerate().collect();
        self.per_segment(run, states, sizes, (&pairs, false))
    }

    /// `[segments, size]` rows in scratch memory (zeroed where `zeroed`)
    /// for each of `from`'s `[B, size]`, row `j` of `from`'s copied to
    /// row `i` for each `(i, j)` of `pairs`.
    fn per_segment(
        &self,
        run: &mut Run,
        from: &[Span],
        sizes: &[usize],
        (pairs, zeroed): (&[(usize, usize)], bool),
    ) -> Result<Vec<Span>> {
        from.iter()
            .zip(sizes)
            .map(|(&from, &n)| {
                let to = run.scratch(self.count() * n, zeroed)?;
                run.move_rows(to, from, n, (pairs, false))?;
                Ok(to)
            })
            .collect()
    }

    /// Scratch memory for each segment's final states (or initial-state
    /// adjoints), `[segments, size]` each.
    pub(crate) fn scratch(&self, run: &mut Run, sizes: &[usize]) -> Result<Vec<Span>> {
        sizes.iter().map(|&n| run.scratch(self.count() * n, false)).collect()
    }

    /// Each sequence's final states, `[B, size]` each into `to`: its last segment's.
    pub(crate) fn finals(
        &self,
        run: &mut Run,
        segments: &[Span],
        to: &[Span],
        sizes: &[usize],
    ) -> Result<()> {
        let pairs: Vec<(usize, usize)> = self.last.iter().copied().enumerate().collect();
        for ((&from, &to), &n) in segments.iter().zip(to).zip(sizes) {
            run.move_rows(to, from, n, (&pairs, false))?;
        }
        Ok(())
    }

    /// The final states' adjoints per segment, `[segments, size]` each in
    /// scratch memory: each sequence's for its last segment, zeros for the others.
    pub(crate) fn final_adjoints(
        &self,
        run: &mut Run,
        d_final: &[Span],
        sizes: &[usize],
    ) -> Result<Vec<Span>> {
        let pairs: Vec<(usize, usize)> = self.last.iter().enumerate().map(|(b, &j)| (j, b)).collect();
        self.per_segment(run, d_final, sizes, (&pairs, true))
    }

    /// Each sequence's initial-state adjoints, `[B, size]` each into `to`:
    /// the sum of its segments'. The segments are added in order, the
    /// `k`-th of every sequence at once, so no two rows added at once
    /// write the same row.
    pub(crate) fn initial_adjoints(
        &self,
        run: &mut Run,
        segments: &[Span],
        to: &[Span],
        sizes: &[usize],
    ) -> Result<()> {
        for ((&from, &to), &n) in segments.iter().zip(to).zip(sizes) {
            run.zero(to)?;
            for pairs in &self.rounds {
                run.move_rows(to, from, n, (pairs, true))?;
            }
        }
        Ok(())
    }
}
