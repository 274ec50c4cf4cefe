//! Running a model over a batch: layers, directions, initial and final
//! states, training forward and backward.
//!
//! Layer `k` reads layer `k-1`'s output; a bidirectional layer writes its
//! forward direction's output in features `[0, O)` and the reverse one's in
//! `[O, 2O)`. Intermediate layers' outputs live in buffers laid out like
//! the caller's input (same row layout, wider rows), so the caller's input
//! and output are never copied or reordered.

use crate::backend::{BackwardJob, ForwardJob, Rows, RowsMut, Tape};
use crate::error::{Result, RuntimeError};
use crate::model::Model;
use crate::sequence::{check_len, Align, BatchOrder, Major, PackedSequence, RowLayout};

/// A batch in the caller's own layout.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    /// `[B, T, F]` or `[T, B, F]`, padded, with each sequence's length.
    Padded { data: &'a [f32], batch: usize, steps: usize, major: Major, align: Align, lengths: &'a [usize] },
    /// A PyTorch packed sequence.
    Packed(&'a PackedSequence),
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
    order: BatchOrder,
    layout: RowLayout,
    /// The input of each layer after the first.
    layer_inputs: Vec<Vec<f32>>,
    tapes: Vec<Tape>,
}

struct LaidOutBatch {
    order: BatchOrder,
    layout: RowLayout,
    rows: usize,
    data_features: usize,
}

impl Model {
    fn prepare(&self, input: &Input) -> Result<LaidOutBatch> {
        match input {
            Input::Padded { data, batch, steps, major, align, lengths } => {
                if lengths.len() != *batch {
                    return Err(RuntimeError::Shape {
                        tensor: "lengths".into(),
                        expected: format!("[{batch}]"),
                        found: format!("[{}]", lengths.len()),
                    });
                }
                check_len("input", data.len(), &[*batch, *steps, self.input_size()])?;
                let order = BatchOrder::new(lengths, *steps)?;
                let layout = RowLayout::padded(&order, *steps, *major, *align);
                Ok(LaidOutBatch { order, layout, rows: batch * steps, data_features: self.input_size() })
            }
            Input::Packed(p) => {
                if p.features != self.input_size() {
                    return Err(RuntimeError::Shape {
                        tensor: "input".into(),
                        expected: format!("{} features", self.input_size()),
                        found: format!("{} features", p.features),
                    });
                }
                let order = p.order()?;
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
    fn ensure_pass_fits(&self, p: &LaidOutBatch, training: bool) -> Result<()> {
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
            Input::Packed(p) => &p.data,
        }
    }

    /// Checks `[L*D, B, size]` state buffers, or makes zeros.
    fn states_or_zeros(&self, given: Option<&[Vec<f32>]>, batch: usize, what: &str) -> Result<Vec<Vec<f32>>> {
        let sizes = &self.layers[0].state_sizes;
        let ld = self.layers.len() * self.directions();
        match given {
            None => Ok(sizes.iter().map(|&n| vec![0.0; ld * batch * n]).collect()),
            Some(g) => {
                if g.len() != sizes.len() {
                    return Err(RuntimeError::Shape {
                        tensor: what.into(),
                        expected: format!("{} state tensors", sizes.len()),
                        found: format!("{}", g.len()),
                    });
                }
                for ((buf, &n), decl) in g.iter().zip(sizes).zip(&self.compiled.forward.states) {
                    check_len(&format!("{what}.{}", decl.name), buf.len(), &[ld, batch, n])?;
                }
                Ok(g.to_vec())
            }
        }
    }

    /// Inference: runs every layer and direction over the batch.
    pub fn forward(&self, input: Input, h0: Option<&[Vec<f32>]>) -> Result<Output> {
        self.run_forward(input, h0, false).map(|(o, _)| o)
    }

    /// A forward pass that keeps what [`Model::backward`] needs.
    pub fn forward_train<'a>(
        &self,
        input: Input<'a>,
        h0: Option<&[Vec<f32>]>,
    ) -> Result<(Output, Trace<'a>)> {
        let (out, trace) = self.run_forward(input, h0, true)?;
        let trace = trace.ok_or_else(|| RuntimeError::Internal("training forward kept no trace".into()))?;
        Ok((out, trace))
    }

    fn run_forward<'a>(
        &self,
        input: Input<'a>,
        h0: Option<&[Vec<f32>]>,
        training: bool,
    ) -> Result<(Output, Option<Trace<'a>>)> {
        let p = self.prepare(&input)?;
        let batch = p.order.batch();
        self.ensure_pass_fits(&p, training)?;
        let h0 = self.states_or_zeros(h0, batch, "h0")?;
        if batch == 0 {
            // An empty batch: nothing to run, and no back end sees one.
            let trace = training.then(|| Trace {
                input,
                order: p.order,
                layout: p.layout,
                layer_inputs: Vec::new(),
                tapes: Vec::new(),
            });
            return Ok((Output { data: Vec::new(), final_states: h0 }, trace));
        }
        let dirs = self.directions();
        let mut final_states: Vec<Vec<f32>> = h0.iter().map(|b| vec![0.0; b.len()]).collect();
        let mut layer_inputs: Vec<Vec<f32>> = Vec::new();
        let mut tapes = Vec::new();
        let mut current: Option<Vec<f32>> = None;
        for (k, layer) in self.layers.iter().enumerate() {
            let width = layer.output_size * dirs;
            let mut out = vec![0.0f32; p.rows * width];
            let in_data: &[f32] = current.as_deref().unwrap_or(Self::input_data(&input));
            let in_width = if k == 0 { p.data_features } else { layer.input_size };
            for d in 0..dirs {
                let slot = k * dirs + d;
                let h0_slices: Vec<&[f32]> = layer
                    .state_sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| &h0[i][slot * batch * n..(slot + 1) * batch * n])
                    .collect();
                let job = ForwardJob {
                    cell: &self.compiled,
                    layer,
                    params: self.params(k, d == 1),
                    order: &p.order,
                    reverse: d == 1,
                    input: Rows { data: in_data, layout: &p.layout, width: in_width, offset: 0 },
                    h0: &h0_slices,
                    training,
                    prepared: self.prepared(k, d == 1),
                };
                let mut rows =
                    RowsMut { data: &mut out, layout: &p.layout, width, offset: d * layer.output_size };
                let r = self.backend.forward(&job, &mut rows)?;
                for (i, &n) in layer.state_sizes.iter().enumerate() {
                    final_states[i][slot * batch * n..(slot + 1) * batch * n]
                        .copy_from_slice(&r.final_states[i]);
                }
                if let Some(t) = r.tape {
                    tapes.push(t);
                }
            }
            if let Some(prev) = current.take() {
                if training {
                    layer_inputs.push(prev);
                }
            }
            current = Some(out);
        }
        let data = current.unwrap_or_default();
        let trace = training.then(|| Trace { input, order: p.order, layout: p.layout, layer_inputs, tapes });
        Ok((Output { data, final_states }, trace))
    }

    /// Backpropagation through the whole model: `d_output` is laid out like
    /// the output; `d_final` (optional) like the final states.
    pub fn backward(
        &self,
        trace: &Trace,
        d_output: &[f32],
        d_final: Option<&[Vec<f32>]>,
    ) -> Result<Gradients> {
        let batch = trace.order.batch();
        let dirs = self.directions();
        let rows = match trace.input {
            Input::Padded { batch, steps, .. } => batch * steps,
            Input::Packed(_) => trace.order.rows(),
        };
        check_len("grad_output", d_output.len(), &[rows, self.output_size()])?;
        let d_final = self.states_or_zeros(d_final, batch, "grad_final")?;
        let mut d_h0: Vec<Vec<f32>> = d_final.iter().map(|b| vec![0.0; b.len()]).collect();
        let mut d_params: Vec<Vec<Vec<f32>>> =
            self.params.iter().map(|ps| ps.iter().map(|p| vec![0.0; p.len()]).collect()).collect();
        if batch == 0 {
            return Ok(Gradients { d_input: Vec::new(), d_h0, d_params });
        }
        let mut d_above: Vec<f32> = d_output.to_vec();
        for (k, layer) in self.layers.iter().enumerate().rev() {
            let in_data: &[f32] =
                if k == 0 { Self::input_data(&trace.input) } else { &trace.layer_inputs[k - 1] };
            let in_width = layer.input_size;
            let mut d_in = vec![0.0f32; rows * in_width];
            for d in 0..dirs {
                let slot = k * dirs + d;
                let d_final_slices: Vec<&[f32]> = layer
                    .state_sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| &d_final[i][slot * batch * n..(slot + 1) * batch * n])
                    .collect();
                let job = BackwardJob {
                    cell: &self.compiled,
                    layer,
                    params: self.params(k, d == 1),
                    prepared: self.prepared(k, d == 1),
                    order: &trace.order,
                    reverse: d == 1,
                    input: Rows { data: in_data, layout: &trace.layout, width: in_width, offset: 0 },
                    d_output: Rows {
                        data: &d_above,
                        layout: &trace.layout,
                        width: layer.output_size * dirs,
                        offset: d * layer.output_size,
                    },
                    d_final: &d_final_slices,
                };
                let tape = trace
                    .tapes
                    .get(slot)
                    .ok_or_else(|| RuntimeError::Internal(format!("no tape for layer {k}")))?;
                let mut rows_mut =
                    RowsMut { data: &mut d_in, layout: &trace.layout, width: in_width, offset: 0 };
                let r = self.backend.backward(&job, tape, &mut rows_mut)?;
                for (i, &n) in layer.state_sizes.iter().enumerate() {
                    d_h0[i][slot * batch * n..(slot + 1) * batch * n].copy_from_slice(&r.d_h0[i]);
                }
                d_params[slot] = r.d_params;
            }
            d_above = d_in;
        }
        Ok(Gradients { d_input: d_above, d_h0, d_params })
    }
}

impl Model {
    /// Zeroed parameter gradients shaped like this model's (input and
    /// initial-state gradients empty), for [`Model::backward_into`].
    pub fn zero_gradients(&self) -> Gradients {
        Gradients {
            d_input: Vec::new(),
            d_h0: Vec::new(),
            d_params: self.params.iter().map(|ps| ps.iter().map(|p| vec![0.0; p.len()]).collect()).collect(),
        }
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
