//! Whole RNNs through the public runtime API on the CPU back end: lstm,
//! gru, layernorm_lstm and sru, T=100 steps, lengths uniform in [T/2, T],
//! I = H, inference and a training step (forward keeping activations, then
//! backward). `benches/compare_pytorch.py` puts the same shapes next to
//! PyTorch; this is the cellc-only view with criterion's statistics.
//!
//! `cargo bench -p cellc-benches --bench rnn`

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::{Align, CompiledCell, Input, Major, Model, ModelConfig};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const STEPS: usize = 100;

fn model(cell: &str, h: usize) -> Model {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../cells/{cell}.cell"));
    let compiled = Arc::new(CompiledCell::from_file(&path, None).expect("cell compiles"));
    let sizes = [("H".to_string(), h), ("I".to_string(), h)]
        .into_iter()
        .filter(|(k, _)| compiled.forward.sizes.contains(k))
        .collect();
    let config = ModelConfig { layers: 1, bidirectional: false };
    let cpu = Cpu::new(0, Kernels::Fastest).expect("cpu back end");
    Model::new(compiled, config, &sizes, Some(h), None, 1, Box::new(cpu)).expect("model")
}

/// Lengths uniform in [T/2, T] from a fixed linear congruential sequence.
fn lengths(batch: usize) -> Vec<usize> {
    let mut state = 0x5eed_u64;
    (0..batch)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            STEPS / 2 + (state >> 33) as usize % (STEPS / 2 + 1)
        })
        .collect()
}

fn rnn(c: &mut Criterion) {
    let mut g = c.benchmark_group("rnn T=100");
    g.sample_size(10).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    for cell in ["lstm", "gru", "layernorm_lstm", "sru"] {
        for h in [128, 512] {
            let model = model(cell, h);
            for batch in [1, 64] {
                let lengths = lengths(batch);
                let x: Vec<f32> = (0..batch * STEPS * h).map(|i| ((i % 11) as f32 - 5.0) * 0.05).collect();
                let dy = vec![0.01f32; batch * STEPS * model.output_size()];
                let input = Input::Padded {
                    data: &x,
                    batch,
                    steps: STEPS,
                    major: Major::BatchFirst,
                    align: Align::Left,
                    lengths: &lengths,
                };
                g.throughput(Throughput::Elements(lengths.iter().sum::<usize>() as u64));
                g.bench_function(BenchmarkId::new(format!("{cell} H={h} infer"), batch), |b| {
                    b.iter(|| model.forward(input, None).expect("forward"))
                });
                g.bench_function(BenchmarkId::new(format!("{cell} H={h} train"), batch), |b| {
                    b.iter(|| {
                        let (_, trace) = model.forward_train(input, None).expect("forward");
                        model.backward(&trace, &dy, None).expect("backward")
                    })
                });
            }
        }
    }
    g.finish();
}

criterion_group!(benches, rnn);
criterion_main!(benches);
