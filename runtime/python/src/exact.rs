//! `float64` passes for checking (`torch.autograd.gradcheck`): a spec's
//! model run through the interpreter in f64, one sequence at a time
//! ([`cellc_runtime::exact`]), on plain lists of floats.

use crate::errors::to_python;
use crate::spec;
use cellc_runtime::exact::{self, Adjoints, Sequences};
use cellc_runtime::{Precision, Result, RuntimeError};
use pyo3::prelude::*;

/// What an f64 pass returns: the output and final states, then (with
/// adjoints) the gradients of the input, the initial states and the weights.
type ExactOut = (Vec<f64>, Vec<Vec<f64>>, Vec<f64>, Vec<Vec<f64>>, Vec<Vec<f64>>);

/// The adjoints of a backward: the output's rows (like the input's) and,
/// optionally, one buffer per final state.
type ExactAdjoints = (Vec<f64>, Option<Vec<Vec<f64>>>);

/// Splits `flat` (the sequences' rows one after another) into `[b][t]` rows of `width`.
fn rows(flat: &[f64], lengths: &[usize], width: usize, what: &str) -> Result<Vec<Vec<Vec<f64>>>> {
    let steps: usize = lengths.iter().sum();
    if flat.len() != steps * width {
        return Err(RuntimeError::Shape {
            tensor: what.into(),
            expected: format!("[{steps}, {width}] (the sequences' steps, one after another)"),
            found: format!("{} values", flat.len()),
        });
    }
    let mut at = 0;
    Ok(lengths
        .iter()
        .map(|&len| {
            let seq = (0..len).map(|t| flat[at + t * width..at + (t + 1) * width].to_vec()).collect();
            at += len * width;
            seq
        })
        .collect())
}

/// The f64 pass of `spec`'s model over sequences of `lengths` whose rows
/// are `x` (one after another), from `h0` (one buffer per state, or none
/// for zeros), with `weights` (every layer's and direction's parameters in
/// the model's order), per-step `resets` `(sequence, step)`, and the
/// cell's `rates` (its defaults if `None`), masks in evaluation; backwards
/// too where `d_out` (rows like `x`'s) is given, with `d_final`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn exact_pass(
    py: Python<'_>,
    spec: &str,
    lengths: Vec<usize>,
    x: Vec<f64>,
    h0: Option<Vec<Vec<f64>>>,
    weights: Vec<Vec<f64>>,
    resets: Vec<(usize, usize)>,
    rates: Option<Vec<f32>>,
    adjoints: Option<ExactAdjoints>,
) -> PyResult<ExactOut> {
    py.detach(|| -> Result<ExactOut> {
        let model = spec::model(spec, 0)?;
        let xs = rows(&x, &lengths, model.input_size(), "input")?;
        let weights = model.group_by_slot(weights)?;
        let d_out = adjoints
            .as_ref()
            .map(|(d, _)| rows(d, &lengths, model.output_size(), "grad_output"))
            .transpose()?;
        let sequences = Sequences { xs: &xs, h0: h0.as_deref(), resets: &resets };
        let adjoints = d_out
            .as_ref()
            .map(|d_out| Adjoints { d_out, d_final: adjoints.as_ref().and_then(|(_, f)| f.as_deref()) });
        let pass = exact::run(&model, &weights, sequences, adjoints, (Precision::F32, rates.as_deref()))?;
        let flat = |x: Vec<Vec<Vec<f64>>>| -> Vec<f64> { x.into_iter().flatten().flatten().collect() };
        Ok((
            flat(pass.out),
            pass.finals,
            flat(pass.d_in),
            pass.d_h0,
            pass.d_params.into_iter().flatten().collect(),
        ))
    })
    .map_err(|e| to_python(py, e))
}
