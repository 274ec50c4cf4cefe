//! An LSTM compiled ahead of time (see `build.rs`), run without a code
//! generator: a 2-layer bidirectional PyTorch `nn.LSTM` `state_dict`
//! (`tests/fixtures/runtime/lstm_weights.safetensors`) loads into the
//! generated `Lstm` type, which runs an unsorted variable-length batch,
//! padded both ways, forwards and backwards; every result is compared with
//! what PyTorch computed (`tests/fixtures/gen_runtime.py`).
//!
//! ```text
//! cargo run --release -p cellc-example-aot [-- FIXTURES_DIR]
//! ```
//!
//! Built with `--features jit`, the same program compiles its kernels at
//! run time instead, for comparing start-up time and binary size.

// ANCHOR: module
mod lstm {
    include!(concat!(env!("OUT_DIR"), "/cellc_lstm.rs"));
}
// ANCHOR_END: module

use cellc_runtime::{read_tensors, Align, Input, Major, ModelConfig, Tensor, TensorData};
use lstm::{Lstm, LstmStates};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

type Tensors = BTreeMap<String, Tensor>;

fn f32s<'a>(t: &'a Tensors, name: &str) -> Result<&'a [f32], String> {
    match t.get(name) {
        Some(Tensor { data: TensorData::F32(d), .. }) => Ok(d),
        _ => Err(format!("no f32 tensor `{name}`")),
    }
}

fn shape<'a>(t: &'a Tensors, name: &str) -> Result<&'a [usize], String> {
    t.get(name).map(|t| t.shape.as_slice()).ok_or_else(|| format!("no tensor `{name}`"))
}

/// Largest |a - b| / max(1, |b|).
fn error(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f32::max)
}

/// The model on the linked kernels, or (with `--features jit`) the same one compiled at run time.
fn model(weights: &Path) -> Result<Lstm, String> {
    // ANCHOR: load
    let config = ModelConfig { layers: 2, bidirectional: true };
    #[cfg(not(feature = "jit"))]
    let model = Lstm::load(config, weights, 1);
    // ANCHOR_END: load
    #[cfg(feature = "jit")]
    let model =
        cellc_runtime::backend::cpu::Cpu::new(1, cellc_runtime::backend::cpu::Kernels::Jit).and_then(|cpu| {
            Lstm::from_weights_on(config, &cellc_runtime::Weights::load(weights)?, Box::new(cpu))
        });
    model.map_err(|e| e.to_string())
}

fn run(dir: &Path) -> Result<f32, String> {
    let start = Instant::now();
    let weights = dir.join("lstm_weights.safetensors");
    let model = model(&weights)?;
    let ready = start.elapsed();
    let mut first_result = None;
    let mut worst = 0.0f32;
    for align in ["left", "right"] {
        let read = |what: &str| {
            read_tensors(&dir.join(format!("lstm_{align}_{what}.safetensors"))).map_err(|e| e.to_string())
        };
        let (input, expected) = (read("input")?, read("expected")?);
        let dims = shape(&input, "input")?;
        let (batch, steps) = (dims[0], dims[1]);
        let lengths: Vec<usize> = match input.get("lengths") {
            Some(Tensor { data: TensorData::I64(l), .. }) => l.iter().map(|&n| n as usize).collect(),
            _ => return Err("no i64 tensor `lengths`".into()),
        };
        let x = f32s(&input, "input")?;
        let align_ = if align == "left" { Align::Left } else { Align::Right };
        let batch_input = Input::Padded {
            data: x,
            batch,
            steps,
            major: Major::BatchFirst,
            align: align_,
            lengths: &lengths,
        };
        // ANCHOR: run
        let h0 = LstmStates { h: f32s(&input, "h0.h")?.to_vec(), c: f32s(&input, "h0.c")?.to_vec() };
        let t = Instant::now();
        let (output, finals, trace) =
            model.forward_train(batch_input, Some(&h0)).map_err(|e| e.to_string())?;
        let forward = t.elapsed();
        first_result.get_or_insert(start.elapsed());
        let d_final = LstmStates {
            h: f32s(&input, "grad_final.h")?.to_vec(),
            c: f32s(&input, "grad_final.c")?.to_vec(),
        };
        let grads = model
            .backward(&trace, f32s(&input, "grad_output")?, Some(&d_final))
            .map_err(|e| e.to_string())?;
        // ANCHOR_END: run
        let mut checks = vec![
            ("output", error(&output, f32s(&expected, "output")?)),
            ("final h", error(&finals.h, f32s(&expected, "final.h")?)),
            ("final c", error(&finals.c, f32s(&expected, "final.c")?)),
            ("d input", error(&grads.d_input, f32s(&expected, "grad.input")?)),
            ("d h0", error(&grads.d_h0.h, f32s(&expected, "grad.h0.h")?)),
            ("d c0", error(&grads.d_h0.c, f32s(&expected, "grad.h0.c")?)),
        ];
        for layer in 0..2 {
            for reverse in [false, true] {
                let g = &grads.d_params[layer * 2 + usize::from(reverse)];
                let suffix = format!("_l{layer}{}", if reverse { "_reverse" } else { "" });
                let want = |p: &str| f32s(&expected, &format!("grad.{p}{suffix}"));
                let e = [
                    error(&g.weight_ih, want("weight_ih")?),
                    error(&g.weight_hh, want("weight_hh")?),
                    error(&g.bias_ih, want("bias_ih")?),
                    error(&g.bias_hh, want("bias_hh")?),
                ];
                checks.push(("d params", e.into_iter().fold(0.0, f32::max)));
            }
        }
        let max = checks.iter().map(|c| c.1).fold(0.0, f32::max);
        println!(
            "{align}-aligned batch of {batch} (lengths {lengths:?}): forward {:.3} ms, outputs, final states and \
             every gradient within {max:.1e} of PyTorch",
            forward.as_secs_f64() * 1e3
        );
        worst = worst.max(max);
    }
    let kernels = if cfg!(feature = "jit") { "compiled at run time (JIT)" } else { "linked ahead of time" };
    println!(
        "kernels {kernels}: model loaded {:.2} ms after start, first forward done {:.2} ms after start",
        ready.as_secs_f64() * 1e3,
        first_result.unwrap_or_default().as_secs_f64() * 1e3
    );
    Ok(worst)
}

fn main() -> ExitCode {
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/runtime"));
    match run(&dir) {
        Ok(worst) if worst <= 1e-4 => ExitCode::SUCCESS,
        Ok(worst) => {
            eprintln!("error: results differ from PyTorch's by {worst:.1e} (more than 1e-4)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
