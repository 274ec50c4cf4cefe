//! The oracle: the interpreter run on each sequence alone (each segment
//! between its per-step resets alone, from the initial states), layer by
//! layer and direction by direction, forwards and backwards: the plainest
//! possible statement of what a model computes ([`cellc_runtime::exact`]).
//!
//! It runs three times: in f64 (the values back ends must match), and in
//! f32 twice, on the data as it is and on the data with every value
//! (weights included) nudged by one ulp. Their distances from the f64
//! values measure how much this cell, on this data, amplifies rounding: the
//! noise floor below which f32 back ends cannot be told apart. One f32 run
//! alone can land near the f64 values by luck where the cell cancels
//! (a LayerNorm of two nearly equal values); the nudged run then still
//! shows how far one rounding moves the results. For bf16 products it runs
//! twice more with those products' operands rounded ([`twins_in`]): in f64
//! and in f32 arithmetic.

use crate::batch::Batch;
use cellc_runtime::exact::{self, Adjoints, Sequences};
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
/// the same computed in f32, on the data and on the data nudged by an ulp:
/// `(f64 results, [f32 results; 2])`.
pub fn oracle(model: &Model, batch: &Batch) -> Result<(Oracle, [Oracle; 2]), String> {
    let f32_twins =
        [run::<f32>(model, batch, Precision::F32, false)?, run::<f32>(model, batch, Precision::F32, true)?];
    Ok((run::<f64>(model, batch, Precision::F32, false)?, f32_twins))
}

/// What `model` computes on `batch` with the products of its matrix
/// parameters in `precision` ([`cellc::interp::BoundCell::with_precision`]),
/// everything else in f64: with [`Precision::Bf16`], what bf16 arithmetic
/// itself gives, against which a bf16 back end's error is judged.
pub fn oracle_in(model: &Model, batch: &Batch, precision: Precision) -> Result<Oracle, String> {
    run::<f64>(model, batch, precision, false)
}

/// [`oracle_in`], and the same with everything else in f32. The f32 twin's
/// operands land on another bf16 neighbour wherever f32's rounding moves
/// them across a midpoint, as a back end's do: where the cell amplifies
/// that (a LayerNorm of a nearly zero row), the f64 twin alone would hold
/// a back end to a noise floor it cannot reach.
pub fn twins_in(model: &Model, batch: &Batch, precision: Precision) -> Result<[Oracle; 2], String> {
    Ok([oracle_in(model, batch, precision)?, run::<f32>(model, batch, precision, false)?])
}

/// `x` moved one ulp, up or down by `i`'s parity (zero and non-finite values as they are).
fn nudged(x: f32, i: usize) -> f32 {
    match x.is_finite() && x != 0.0 {
        true if i.is_multiple_of(2) => f32::from_bits(x.to_bits() + 1),
        true => f32::from_bits(x.to_bits() - 1),
        false => x,
    }
}

/// The oracle in `T`; with `nudge`, on every value of the data and the
/// weights moved one ulp.
fn run<T: Float>(model: &Model, batch: &Batch, precision: Precision, nudge: bool) -> Result<Oracle, String> {
    let ts = |v: &[f32]| -> Vec<T> {
        v.iter()
            .enumerate()
            .map(|(i, &x)| T::from(if nudge { nudged(x, i) } else { x }).unwrap_or_else(T::nan))
            .collect()
    };
    let f64s = |v: &[T]| -> Vec<f64> { v.iter().map(|x| x.to_f64().unwrap_or(f64::NAN)).collect() };
    let rows_in = |x: &[Vec<Vec<f32>>]| -> Vec<Vec<Vec<T>>> {
        x.iter().map(|s| s.iter().map(|r| ts(r)).collect()).collect()
    };
    let rows_out = |x: Vec<Vec<Vec<T>>>| -> Vec<Vec<Vec<f64>>> {
        x.into_iter().map(|seq| seq.iter().map(|r| f64s(r)).collect()).collect()
    };
    let dirs = model.directions();
    let weights: Vec<Vec<Vec<T>>> = (0..model.layers().len() * dirs)
        .map(|slot| model.params(slot / dirs, slot % dirs == 1).iter().map(|p| ts(p)).collect())
        .collect();
    let (xs, d_out) = (rows_in(&batch.xs), rows_in(&batch.d_out));
    let h0: Vec<Vec<T>> = batch.h0.iter().map(|h| ts(h)).collect();
    let d_final: Vec<Vec<T>> = batch.d_final.iter().map(|h| ts(h)).collect();
    let sequences = Sequences { xs: &xs, h0: Some(&h0), resets: &batch.resets };
    let adjoints = Adjoints { d_out: &d_out, d_final: Some(&d_final) };
    let pass = exact::run(model, &weights, sequences, Some(adjoints), (precision, None))
        .map_err(|e| e.to_string())?;
    Ok(Oracle {
        out: rows_out(pass.out),
        finals: pass.finals.iter().map(|f| f64s(f)).collect(),
        d_in: rows_out(pass.d_in),
        d_h0: pass.d_h0.iter().map(|f| f64s(f)).collect(),
        d_params: pass.d_params.iter().map(|ps| ps.iter().map(|p| f64s(p)).collect()).collect(),
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
