//! The oracle: the interpreter run on each sequence alone (each segment
//! between its per-step resets alone, from the initial states), layer by
//! layer and direction by direction, forwards and backwards: the plainest
//! possible statement of what a model computes.
//!
//! It runs twice, in f64 (the values back ends must match) and in f32
//! (whose distance from the f64 values measures how much this cell, on
//! this data, amplifies rounding: the noise floor below which f32 back ends
//! cannot be told apart, see [`Oracle::noise`]).

use crate::batch::Batch;
use cellc_runtime::{Model, Precision};
use num_traits::Float;

/// Per-sequence results (in f64), indexed like the batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Oracle {
    /// `out[b][t]`: the last layer's output at step `t` (both directions).
    pub out: Vec<Vec<Vec<f64>>>,
    /// One buffer per state, `[layers * directions, B, size]`.
    pub finals: Vec<Vec<f64>>,
    /// `d_in[b][t]`: the gradient of the model's input.
    pub d_in: Vec<Vec<Vec<f64>>>,
    pub d_h0: Vec<Vec<f64>>,
    /// `[layer * directions + direction][param]`.
    pub d_params: Vec<Vec<Vec<f64>>>,
}

/// What `model` should compute on `batch`, forwards and backwards, and
/// the same computed in f32: `(f64 results, f32 results)`.
pub fn oracle(model: &Model, batch: &Batch) -> Result<(Oracle, Oracle), String> {
    Ok((run::<f64>(model, batch, Precision::F32)?, run::<f32>(model, batch, Precision::F32)?))
}

/// What `model` computes on `batch` with the products of its matrix
/// parameters in `precision` ([`cellc::interp::BoundCell::with_precision`]),
/// everything else in f64: with [`Precision::Bf16`], what bf16 arithmetic
/// itself gives, against which a bf16 back end's error is judged.
pub fn oracle_in(model: &Model, batch: &Batch, precision: Precision) -> Result<Oracle, String> {
    run::<f64>(model, batch, precision)
}

fn run<T: Float>(model: &Model, batch: &Batch, precision: Precision) -> Result<Oracle, String> {
    let f64s = |v: &[T]| -> Vec<f64> { v.iter().map(|x| x.to_f64().unwrap_or(f64::NAN)).collect() };
    let ts = |v: &[f32]| -> Vec<T> { v.iter().map(|&x| T::from(x).unwrap_or_else(T::nan)).collect() };
    let cell = &model.compiled().forward;
    let grad = &model.compiled().backward;
    let dirs = model.directions();
    let n_seq = batch.lengths.len();
    let nstates = cell.states.len();
    let mut finals: Vec<Vec<T>> = batch.h0.iter().map(|h| vec![T::zero(); h.len()]).collect();
    let mut d_h0: Vec<Vec<T>> = batch.h0.iter().map(|h| vec![T::zero(); h.len()]).collect();
    let mut d_params: Vec<Vec<Vec<T>>> = (0..model.layers().len() * dirs)
        .map(|slot| {
            model.params(slot / dirs, slot % dirs == 1).iter().map(|p| vec![T::zero(); p.len()]).collect()
        })
        .collect();
    let mut out = Vec::with_capacity(n_seq);
    let mut d_in_all = Vec::with_capacity(n_seq);
    let err = |e: cellc::InterpError| e.to_string();
    for b in 0..n_seq {
        let len = batch.lengths[b];
        let segments = batch.segments(b);
        let state_of = |buf: &[Vec<f32>], i: usize, slot: usize, n: usize| {
            ts(&buf[i][(slot * n_seq + b) * n..(slot * n_seq + b + 1) * n])
        };
        // Forward, keeping each layer's input for the backward.
        let mut layer_in: Vec<Vec<Vec<T>>> = vec![batch.xs[b].iter().map(|r| ts(r)).collect()];
        for (k, layer) in model.layers().iter().enumerate() {
            let bound = cell.bind(&layer.sizes).map_err(err)?.with_precision(precision);
            let mut next = vec![Vec::new(); len];
            for d in 0..dirs {
                let slot = k * dirs + d;
                let params: Vec<Vec<T>> = model.params(k, d == 1).iter().map(|p| ts(p)).collect();
                let h0: Vec<Vec<T>> =
                    (0..nstates).map(|i| state_of(&batch.h0, i, slot, layer.state_sizes[i])).collect();
                // Each segment (resets split a sequence) from the initial states.
                for &(first, end) in &segments {
                    let mut seq: Vec<Vec<T>> = layer_in[k][first..end].to_vec();
                    if d == 1 {
                        seq.reverse();
                    }
                    let run = bound.run(&seq.concat(), &h0, &params).map_err(err)?;
                    let o = layer.output_size;
                    for s in 0..end - first {
                        let t = if d == 1 { end - 1 - s } else { first + s };
                        next[t].extend_from_slice(&run.outputs[s * o..(s + 1) * o]);
                    }
                    for ((dst, src), &n) in finals.iter_mut().zip(&run.final_states).zip(&layer.state_sizes) {
                        dst[(slot * n_seq + b) * n..(slot * n_seq + b + 1) * n].copy_from_slice(src);
                    }
                }
            }
            layer_in.push(next);
        }
        out.push(layer_in.last().cloned().unwrap_or_default());
        // Backward, last layer first.
        let mut d_above: Vec<Vec<T>> = batch.d_out[b].iter().map(|r| ts(r)).collect();
        for (k, layer) in model.layers().iter().enumerate().rev() {
            let bound = cell.bind(&layer.sizes).map_err(err)?.with_precision(precision);
            let mut d_below = vec![vec![T::zero(); layer.input_size]; len];
            for d in 0..dirs {
                let slot = k * dirs + d;
                let params: Vec<Vec<T>> = model.params(k, d == 1).iter().map(|p| ts(p)).collect();
                let h0: Vec<Vec<T>> =
                    (0..nstates).map(|i| state_of(&batch.h0, i, slot, layer.state_sizes[i])).collect();
                let df: Vec<Vec<T>> =
                    (0..nstates).map(|i| state_of(&batch.d_final, i, slot, layer.state_sizes[i])).collect();
                let no_df: Vec<Vec<T>> = df.iter().map(|d| vec![T::zero(); d.len()]).collect();
                let o = layer.output_size;
                // Each segment backwards; the final states' adjoints are the
                // last segment's; the initial states' sum every segment's.
                for (j, &(first, end)) in segments.iter().enumerate() {
                    let order: Vec<usize> =
                        if d == 1 { (first..end).rev().collect() } else { (first..end).collect() };
                    let seq: Vec<T> = order.iter().flat_map(|&t| layer_in[k][t].iter().copied()).collect();
                    let dseq: Vec<T> =
                        order.iter().flat_map(|&t| d_above[t][d * o..(d + 1) * o].iter().copied()).collect();
                    let df = if j + 1 == segments.len() { &df } else { &no_df };
                    let g = bound.backward(grad, &seq, &h0, &params, &dseq, df).map_err(err)?;
                    for (s, &t) in order.iter().enumerate() {
                        let row = &g.d_inputs[s * layer.input_size..(s + 1) * layer.input_size];
                        d_below[t].iter_mut().zip(row).for_each(|(acc, &v)| *acc = *acc + v);
                    }
                    for ((dst, src), &n) in d_h0.iter_mut().zip(&g.d_initial_states).zip(&layer.state_sizes) {
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
        d_in_all.push(d_above);
    }
    let rows = |x: Vec<Vec<Vec<T>>>| -> Vec<Vec<Vec<f64>>> {
        x.into_iter().map(|seq| seq.iter().map(|r| f64s(r)).collect()).collect()
    };
    Ok(Oracle {
        out: rows(out),
        finals: finals.iter().map(|f| f64s(f)).collect(),
        d_in: rows(d_in_all),
        d_h0: d_h0.iter().map(|f| f64s(f)).collect(),
        d_params: d_params.iter().map(|ps| ps.iter().map(|p| f64s(p)).collect()).collect(),
    })
}

/// The largest `|a - b| / max(1, |b|)` over two runs' values of one tensor.
pub fn noise(f32_run: &[f64], f64_run: &[f64]) -> f64 {
    f32_run
        .iter()
        .zip(f64_run)
        .map(|(a, b)| if a.is_finite() && b.is_finite() { (a - b).abs() / b.abs().max(1.0) } else { 0.0 })
        .fold(0.0, f64::max)
}
