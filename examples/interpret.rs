//! Compile a shipped cell and run it on the reference interpreter.
//!
//! ```text
//! cargo run -p cellc-examples --example interpret -- cells/gru.cell H=8 I=4
//! ```
//!
//! Parameters start from their declared initialisers (seeded), the input
//! is a fixed sine wave, and the output of every step is printed.

use cellc::interp::ConcreteInit;
use std::error::Error;

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| "cells/lstm.cell".to_string());
    let mut sizes = cellc::dims::Bindings::new();
    for a in args {
        let (k, v) = a.split_once('=').ok_or(format!("expected NAME=VALUE, found `{a}`"))?;
        sizes.insert(k.to_string(), v.parse()?);
    }

    let source = std::fs::read_to_string(&path)?;
    let module = cellc::compile(&path, &source).into_result()?;
    let cell = module.cells.first().ok_or("the file defines no cell")?;
    for s in &cell.sizes {
        sizes.entry(s.clone()).or_insert(4);
    }
    let bound = cell.bind(&sizes)?;

    // A tiny linear congruential generator keeps the example dependency-free.
    let mut seed = 42u64;
    let mut uniform = move |bound: f64| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * bound
    };
    let params: Vec<Vec<f32>> = bound
        .param_shapes()
        .iter()
        .zip(bound.param_inits()?)
        .map(|(&(r, c), init)| {
            (0..r * c)
                .map(|_| match init {
                    ConcreteInit::Zeros => 0.0,
                    ConcreteInit::Ones => 1.0,
                    ConcreteInit::Constant(v) => v as f32,
                    ConcreteInit::Uniform(b) => uniform(b) as f32,
                })
                .collect()
        })
        .collect();
    let h0: Vec<Vec<f32>> = bound.state_sizes().iter().map(|&n| vec![0.0; n]).collect();

    let steps = 5;
    let xs: Vec<f32> = (0..steps * bound.input_size()).map(|i| (i as f32 * 0.3).sin()).collect();
    let run = bound.run(&xs, &h0, &params)?;

    println!("cell {} with {:?}: {} steps", cell.name, bound.sizes(), steps);
    for (t, out) in run.outputs.chunks(bound.output_size()).enumerate() {
        let shown: Vec<String> = out.iter().map(|v| format!("{v:+.4}")).collect();
        println!("  t={t}: [{}]", shown.join(", "));
    }
    Ok(())
}
