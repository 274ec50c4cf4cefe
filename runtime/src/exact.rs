//! A model's pass in any float type, f64 above all, through the
//! interpreter, one sequence at a time: the plainest statement of what a
//! model computes, for checking. The differential fuzzer's oracle is this
//! pass; the Python package runs `float64` modules (and so
//! `torch.autograd.gradcheck`) through it.
//!
//! Each sequence runs alone, layer by layer and direction by direction,
//! each stretch between its per-step resets from the initial states (as
//! [`crate::resets`] defines them), its masks in evaluation at the model's
//! rates (or the call's). Dropout between layers is a training pass's, so
//! it never applies here. The backward runs the interpreter's
//! backpropagation through time on the cell's derived backward step.

use crate::error::{Result, RuntimeError};
use crate::model::Model;
use cellc::precision::Precision;
use num_traits::Float;

/// A batch as the exact pass reads it: per sequence and step.
#[derive(Clone, Copy, Debug)]
pub struct Sequences<'a, T> {
    /// `xs[b][t]`: the input features of sequence `b` at step `t`.
    pub xs: &'a [Vec<Vec<T>>],
    /// One buffer per state, `[layers * directions, B, size]` (zeros if `None`).
    pub h0: Option<&'a [Vec<T>]>,
    /// `(sequence, step)`s at which the state restarts from the initial
    /// states; those at a first step or past a sequence's end change nothing.
    pub resets: &'a [(usize, usize)],
}

/// The adjoints a backward pass starts from.
#[derive(Clone, Copy, Debug)]
pub struct Adjoints<'a, T> {
    /// `d_out[b][t]`: the adjoint of the last layer's output (both directions).
    pub d_out: &'a [Vec<Vec<T>>],
    /// One buffer per state, like `h0` (zeros if `None`).
    pub d_final: Option<&'a [Vec<T>]>,
}

/// What an exact pass computed: the forward's values and, where adjoints
/// were given, the gradients (empty otherwise).
#[derive(Clone, Debug, PartialEq)]
pub struct ExactPass<T> {
    /// `out[b][t]`: the last layer's output (both directions).
    pub out: Vec<Vec<Vec<T>>>,
    /// One buffer per state, `[layers * directions, B, size]`.
    pub finals: Vec<Vec<T>>,
    /// `d_in[b][t]`: the gradient of the model's input.
    pub d_in: Vec<Vec<Vec<T>>>,
    /// One buffer per state, like `finals`.
    pub d_h0: Vec<Vec<T>>,
    /// `[layer * directions + direction][param]`.
    pub d_params: Vec<Vec<Vec<T>>>,
}

/// Sequence `b`'s stretches `(first step, end)` of its `len` steps, split at its resets.
pub fn segments(b: usize, len: usize, resets: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut cuts: Vec<usize> =
        resets.iter().filter(|&&(s, t)| s == b && t > 0 && t < len).map(|&(_, t)| t).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let starts = std::iter::once(0).chain(cuts.iter().copied());
    let ends = cuts.iter().copied().chain(std::iter::once(len));
    starts.zip(ends).collect()
}

/// What `model` computes on `batch` with `weights` (`[layer * directions +
/// direction][param]`, each in its shape, row-major), in `T`, with the
/// products of matrix parameters in `precision` and the masks evaluated at
/// `rates` (the model's where `None`); backwards too, where `adjoints` are given.
pub fn run<T: Float>(
    model: &Model,
    weights: &[Vec<Vec<T>>],
    batch: Sequences<T>,
    adjoints: Option<Adjoints<T>>,
    (precision, rates): (Precision, Option<&[f32]>),
) -> Result<ExactPass<T>> {
    let cell = &model.compiled().forward;
    let grad = &model.compiled().backward;
    let dirs = model.directions();
    let layers = model.layers();
    let n_seq = batch.xs.len();
    let ld = layers.len() * dirs;
    let states = &layers[0].state_sizes;
    let rates = rates.unwrap_or(&model.rates);
    check(model, weights, &batch, adjoints.as_ref())?;
    let zeros: Vec<Vec<T>> = states.iter().map(|&n| vec![T::zero(); ld * n_seq * n]).collect();
    let h0 = batch.h0.unwrap_or(&zeros);
    let mut finals = zeros.clone();
    let mut d_h0 = zeros.clone();
    let mut d_params: Vec<Vec<Vec<T>>> =
        weights.iter().map(|ps| ps.iter().map(|p| vec![T::zero(); p.len()]).collect()).collect();
    let (mut out, mut d_in) = (Vec::with_capacity(n_seq), Vec::with_capacity(n_seq));
    let bound: Vec<cellc::BoundCell> = layers
        .iter()
        .map(|l| Ok(cell.bind(&l.sizes)?.with_precision(precision).with_rates(rates)))
        .collect::<Result<_>>()?;
    for (b, xs) in batch.xs.iter().enumerate() {
        let len = xs.len();
        let segments = segments(b, len, batch.resets);
        let state_of = |buf: &[Vec<T>], i: usize, slot: usize| {
            let n = states[i];
            buf[i][(slot * n_seq + b) * n..(slot * n_seq + b + 1) * n].to_vec()
        };
        // Forward, keeping each layer's input for the backward.
        let mut layer_in: Vec<Vec<Vec<T>>> = vec![xs.clone()];
        for (k, layer) in layers.iter().enumerate() {
            let mut next = vec![Vec::new(); len];
            for d in 0..dirs {
                let slot = k * dirs + d;
                let h0: Vec<Vec<T>> = (0..states.len()).map(|i| state_of(h0, i, slot)).collect();
                for &(first, end) in &segments {
                    let mut seq: Vec<Vec<T>> = layer_in[k][first..end].to_vec();
                    if d == 1 {
                        seq.reverse();
                    }
                    let run = bound[k].run(&seq.concat(), &h0, &weights[slot])?;
                    let o = layer.output_size;
                    for s in 0..end - first {
                        let t = if d == 1 { end - 1 - s } else { first + s };
                        next[t].extend_from_slice(&run.outputs[s * o..(s + 1) * o]);
                    }
                    for ((dst, src), &n) in finals.iter_mut().zip(&run.final_states).zip(states) {
                        dst[(slot * n_seq + b) * n..(slot * n_seq + b + 1) * n].copy_from_slice(src);
                    }
                }
            }
            layer_in.push(next);
        }
        out.push(layer_in.last().cloned().unwrap_or_default());
        let Some(adjoints) = adjoints else { continue };
        // Backward, last layer first.
        let d_final = adjoints.d_final.unwrap_or(&zeros);
        let mut d_above: Vec<Vec<T>> = adjoints.d_out[b].clone();
        for (k, layer) in layers.iter().enumerate().rev() {
            let mut d_below = vec![vec![T::zero(); layer.input_size]; len];
            for d in 0..dirs {
                let slot = k * dirs + d;
                let h0: Vec<Vec<T>> = (0..states.len()).map(|i| state_of(h0, i, slot)).collect();
                let df: Vec<Vec<T>> = (0..states.len()).map(|i| state_of(d_final, i, slot)).collect();
                let no_df: Vec<Vec<T>> = df.iter().map(|d| vec![T::zero(); d.len()]).collect();
                let o = layer.output_size;
                // Each stretch backwards; the final states' adjoints are the
                // last stretch's; the initial states' sum every stretch's.
                for (j, &(first, end)) in segments.iter().enumerate() {
                    let order: Vec<usize> =
                        if d == 1 { (first..end).rev().collect() } else { (first..end).collect() };
                    let seq: Vec<T> = order.iter().flat_map(|&t| layer_in[k][t].iter().copied()).collect();
                    let dseq: Vec<T> =
                        order.iter().flat_map(|&t| d_above[t][d * o..(d + 1) * o].iter().copied()).collect();
                    let df = if j + 1 == segments.len() { &df } else { &no_df };
                    let g = bound[k].backward(grad, &seq, &h0, &weights[slot], &dseq, df)?;
                    for (s, &t) in order.iter().enumerate() {
                        let row = &g.d_inputs[s * layer.input_size..(s + 1) * layer.input_size];
                        d_below[t].iter_mut().zip(row).for_each(|(acc, &v)| *acc = *acc + v);
                    }
                    for ((dst, src), &n) in d_h0.iter_mut().zip(&g.d_initial_states).zip(states) {
                        let row = &mut dst[(slot * n_seq + b) * n..(slot * n_seq + b + 1) * n];
                        row.iter_mut().zip(src).for_each(|(a, &v)| *a = *a + v);
                    }
                    for (acc, gp) in d_params[slot].iter_mut().zip(&g.d_params) {
                        acc.iter_mut().zip(gp).for_each(|(a, &v)| *a = *a + v);
                    }
                }
            }
            d_above = d_below;
        }
        d_in.push(d_above);
    }
    if adjoints.is_none() {
        (d_h0, d_params) = (Vec::new(), Vec::new());
    }
    Ok(ExactPass { out, finals, d_in, d_h0, d_params })
}

/// Every tensor of an exact pass has the shape the model reads.
fn check<T: Copy>(
    model: &Model,
    weights: &[Vec<Vec<T>>],
    batch: &Sequences<T>,
    adjoints: Option<&Adjoints<T>>,
) -> Result<()> {
    let views: Vec<Vec<&[T]>> = weights.iter().map(|ps| ps.iter().map(Vec::as_slice).collect()).collect();
    model.check_weights(&views)?;
    let n_seq = batch.xs.len();
    let states = |what: &str, bufs: Option<&[Vec<T>]>| match bufs {
        Some(b) => model.check_states(b.len(), |i| b[i].len(), n_seq, what),
        None => Ok(()),
    };
    rows_of("input", batch.xs, model.input_size())?;
    states("h0", batch.h0)?;
    if let Some(a) = adjoints {
        states("d_final", a.d_final)?;
        let lengths = |v: &[Vec<Vec<T>>]| v.iter().map(Vec::len).collect::<Vec<_>>();
        if lengths(a.d_out) != lengths(batch.xs) {
            return Err(RuntimeError::Shape {
                tensor: "d_output".into(),
                expected: format!("steps {:?}", lengths(batch.xs)),
                found: format!("{:?}", lengths(a.d_out)),
            });
        }
        rows_of("d_output", a.d_out, model.output_size())?;
    }
    Ok(())
}

/// Every step of every sequence of `tensor` has `width` values.
fn rows_of<T>(tensor: &str, sequences: &[Vec<Vec<T>>], width: usize) -> Result<()> {
    for (b, seq) in sequences.iter().enumerate() {
        if let Some(row) = seq.iter().find(|r| r.len() != width) {
            return Err(RuntimeError::Shape {
                tensor: format!("{tensor} (sequence {b})"),
                expected: format!("[{width}] a step"),
                found: format!("[{}]", row.len()),
            });
        }
    }
    Ok(())
}
