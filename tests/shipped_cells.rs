//! Every shipped cell in `cells/` compiles with no diagnostics at all,
//! runs on the interpreter, and its IR matches the snapshot in
//! `tests/snapshots/ir/` (`CELLC_BLESS=1` rewrites the snapshots).

mod support;

use cellc::dims::Bindings;
use cellc::interp::ConcreteInit;
use support::Rng;

const REQUIRED: [&str; 14] = [
    "lstm",
    "gru",
    "rnn_tanh",
    "rnn_relu",
    "peephole_lstm",
    "layernorm_lstm",
    "layernorm_gru",
    "mi_lstm",
    "indrnn",
    "sru",
    "lstmp",
    "cifg_lstm",
    "mingru",
    "residual_lstm",
];

#[test]
fn every_required_cell_is_shipped() {
    let shipped: Vec<String> = support::shipped_cells()
        .iter()
        .map(|p| p.file_stem().and_then(|s| s.to_str()).expect("utf-8").to_string())
        .collect();
    for name in REQUIRED {
        assert!(shipped.iter().any(|s| s == name), "cells/{name}.cell is missing");
    }
}

#[test]
fn shipped_cells_check_clean() {
    for path in support::shipped_cells() {
        let name = path.file_name().and_then(|n| n.to_str()).expect("utf-8").to_string();
        let source = std::fs::read_to_string(&path).expect("readable");
        let c = cellc::compile(&name, &source);
        assert!(c.diagnostics.is_empty(), "{name} is not clean:\n{}", c.render(false));
        let module = c.module.expect("no errors");
        let stem = name.trim_end_matches(".cell");
        if stem != "prelude" {
            assert!(module.cell(stem).is_some(), "{name} must define `cell {stem}`");
        }
    }
}

/// Sizes for a cell: distinct small primes, so a wrong stride shows.
fn sizes_for(cell: &cellc::Cell) -> Bindings {
    let primes = [3usize, 5, 7, 2, 11, 13];
    cell.sizes.iter().zip(primes).map(|(s, p)| (s.clone(), p)).collect()
}

fn init_params(bound: &cellc::BoundCell, rng: &mut Rng) -> Vec<Vec<f64>> {
    let inits = bound.param_inits().expect("initialisers evaluate");
    bound
        .param_shapes()
        .iter()
        .zip(inits)
        .map(|(&(r, c), init)| match init {
            ConcreteInit::Zeros => vec![0.0; r * c],
            ConcreteInit::Ones => vec![1.0; r * c],
            ConcreteInit::Constant(v) => vec![v; r * c],
            // Wider than the default so gates leave their linear region.
            ConcreteInit::Uniform(b) => rng.vec(r * c, 2.0 * b),
        })
        .collect()
}

#[test]
fn shipped_cells_run_and_f32_tracks_f64() {
    let mut rng = Rng::new(7);
    for path in support::shipped_cells() {
        let module = support::compile_shipped(&path);
        for cell in &module.cells {
            let sizes = sizes_for(cell);
            let bound = cell.bind(&sizes).unwrap_or_else(|e| panic!("{}: {e}", cell.name));
            let params = init_params(&bound, &mut rng);
            let h0: Vec<Vec<f64>> = bound.state_sizes().iter().map(|&n| rng.vec(n, 0.5)).collect();
            let steps = 7;
            let xs = rng.vec(steps * bound.input_size(), 1.0);
            let run = bound.run(&xs, &h0, &params).expect("runs");
            assert_eq!(run.outputs.len(), steps * bound.output_size());
            assert!(run.outputs.iter().all(|v| v.is_finite()), "{}: non-finite output", cell.name);

            let to32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
            let p32: Vec<Vec<f32>> = params.iter().map(|p| to32(p)).collect();
            let h32: Vec<Vec<f32>> = h0.iter().map(|s| to32(s)).collect();
            let run32 = bound.run(&to32(&xs), &h32, &p32).expect("runs in f32");
            let worst = run
                .outputs
                .iter()
                .zip(&run32.outputs)
                .map(|(a, &b)| (a - b as f64).abs() / a.abs().max(1.0))
                .fold(0.0, f64::max);
            assert!(worst < 1e-4, "{}: f32 drifts from f64 by {worst:e}", cell.name);
        }
    }
}

#[test]
fn ir_snapshots() {
    let dir = support::root().join("tests/snapshots/ir");
    let mut failures = Vec::new();
    for path in support::shipped_cells() {
        let module = support::compile_shipped(&path);
        for cell in &module.cells {
            let text = cellc::ir::print::to_text(cell, None);
            failures.extend(support::snapshot(&dir.join(format!("{}.ir", cell.name)), &text));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
