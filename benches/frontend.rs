//! Front-end cost: compiling every shipped cell (lex, parse, lower,
//! verify), and one interpreter step of the LSTM. The compiler runs once
//! per model, so this guards against accidental blow-ups rather than
//! chasing microseconds.
//!
//! `cargo bench -p cellc-benches --bench frontend`

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use std::path::Path;

fn shipped() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cells");
    let mut v: Vec<(String, String)> = std::fs::read_dir(dir)
        .expect("cells/ exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cell"))
        .map(|p| (p.display().to_string(), std::fs::read_to_string(&p).expect("readable")))
        .collect();
    v.sort();
    v
}

fn compile_all(c: &mut Criterion) {
    let cells = shipped();
    c.bench_function("compile all shipped cells", |b| {
        b.iter(|| {
            for (name, src) in &cells {
                black_box(cellc::compile(name, src).module);
            }
        })
    });
}

fn interpret_lstm_step(c: &mut Criterion) {
    let src = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../cells/lstm.cell"))
        .expect("lstm.cell");
    let module = cellc::compile("lstm.cell", &src).into_result().expect("compiles");
    let cell = module.cell("lstm").expect("lstm");
    let bound = cell.bind(&[("I".to_string(), 64), ("H".to_string(), 64)].into()).expect("binds");
    let params: Vec<Vec<f32>> = bound.param_shapes().iter().map(|&(r, c)| vec![0.01; r * c]).collect();
    let states: Vec<Vec<f32>> = bound.state_sizes().iter().map(|&n| vec![0.1; n]).collect();
    let x = vec![0.5f32; bound.input_size()];
    c.bench_function("interpreter lstm step I=H=64", |b| {
        b.iter(|| black_box(bound.step(&x, &states, &params).expect("runs")))
    });
}

criterion_group!(benches, compile_all, interpret_lstm_step);
criterion_main!(benches);
