//! The hostile inputs of issue 13 §5 that reach the runtime, on every back
//! end: an empty batch, a cell without parameters, NaN in the data, and
//! sizes too large to allocate. Each gets a result or a typed error, never
//! a panic or an abort.

mod support;

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::cuda::Cuda;
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::{Align, CompiledCell, Input, Major, Model, ModelConfig, RuntimeError};
use std::sync::Arc;

type MakeBackend = fn() -> Box<dyn Device>;

const BACKENDS: [(&str, MakeBackend); 4] = [
    ("reference", || Box::new(Reference)),
    ("cpu", || Box::new(Cpu::new(2, Kernels::Jit).expect("cpu").split_every_step())),
    ("cpu interpreted", || Box::new(Cpu::new(2, Kernels::Interpreted).expect("cpu").split_every_step())),
    ("cuda emulated", || Box::new(Cuda::emulated().expect("emulated device"))),
];

fn compiled(name: &str, source: &str) -> Arc<CompiledCell> {
    Arc::new(CompiledCell::from_source(name, source, None).expect("compiles"))
}

/// Two bidirectional layers (one when the cell's input must be its state's size).
fn model(cell: &Arc<CompiledCell>, sizes: &[(&str, usize)], input: usize, backend: Box<dyn Device>) -> Model {
    let sizes = sizes.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let layers = if cell.forward.input_dim() == cell.forward.states[0].dim { 1 } else { 2 };
    let config = ModelConfig { layers, bidirectional: true };
    Model::new(cell.clone(), config, &sizes, Some(input), None, 3, backend).expect("model")
}

fn padded<'a>(data: &'a [f32], batch: usize, steps: usize, lengths: &'a [usize]) -> Input<'a> {
    Input::Padded { data, batch, steps, major: Major::BatchFirst, align: Align::Right, lengths }
}

const RNN: &str = "cell rnn {
    input x[I]
    state h[H]
    param w[H, I], u[H, H], b[H]
    h' = tanh(w @ x + u @ h + b)
    output h'
}";

#[test]
fn an_empty_batch_gives_empty_outputs_and_zero_gradients() {
    let cell = compiled("rnn.cell", RNN);
    for (name, backend) in BACKENDS {
        let m = model(&cell, &[("H", 4)], 3, backend());
        let out = m.forward(padded(&[], 0, 5, &[]), None).expect(name);
        assert!(out.data.is_empty() && out.final_states.iter().all(Vec::is_empty), "{name}");
        let (out, trace) = m.forward_train(padded(&[], 0, 5, &[]), None).expect(name);
        assert!(out.data.is_empty(), "{name}");
        let g = m.backward(&trace, &[], None).expect(name);
        assert!(g.d_input.is_empty() && g.d_h0.iter().all(Vec::is_empty), "{name}");
        assert!(g.d_params.iter().flatten().flatten().all(|&d| d == 0.0), "{name}");
    }
}

#[test]
fn a_cell_without_parameters_runs_forward_and_backward() {
    let cell = compiled(
        "free.cell",
        "cell free {\n input x[H]\n state h[H]\n h' = tanh(x + 0.5 * h)\n output h'\n}",
    );
    let lengths = [3usize, 1];
    let x: Vec<f32> = (0..2 * 3 * 4).map(|i| (i as f32 * 0.37).sin()).collect();
    let reference = model(&cell, &[("H", 4)], 4, Box::new(Reference));
    let (want, trace) = reference.forward_train(padded(&x, 2, 3, &lengths), None).expect("reference");
    let dy = vec![0.25f32; want.data.len()];
    let want_g = reference.backward(&trace, &dy, None).expect("reference backward");
    for (name, backend) in BACKENDS {
        let m = model(&cell, &[("H", 4)], 4, backend());
        assert!(m.weight_names().is_empty(), "{name}");
        let (out, trace) = m.forward_train(padded(&x, 2, 3, &lengths), None).expect(name);
        let g = m.backward(&trace, &dy, None).expect(name);
        for (a, b) in out.data.iter().zip(&want.data).chain(g.d_input.iter().zip(&want_g.d_input)) {
            assert!((a - b).abs() <= 1e-5, "{name}: {a} vs {b}");
        }
    }
}

/// Every function, `min`/`max` and `abs` (whose adjoints use the internal
/// `step`, `sign` and `ge`) on a value that is NaN in one sequence.
const EVERY_FUNCTION: &str = "cell every {
    input x[I]
    state h[H]
    param w[H, I]
    let a = w @ x
    let s = sigmoid(a) + tanh(a) + relu(a) + exp(0.1 * a) + softplus(a) + silu(a)
    let t = min(a, h) + max(a, h) + abs(a) + sqrt(abs(a) + 1) + log(abs(a) + 1) + rsqrt(abs(a) + 1)
    h' = 0.1 * (s + t) + 0.5 * h
    output h'
}";

#[test]
fn nan_propagates_through_every_function_on_every_backend() {
    let cell = compiled("every.cell", EVERY_FUNCTION);
    let (b, t, i) = (2usize, 3usize, 3usize);
    let mut x: Vec<f32> = (0..b * t * i).map(|k| (k as f32 * 0.61).cos()).collect();
    x[i] = f32::NAN; // sequence 0, step 1 (of 3, right-aligned: all steps real)
    let lengths = [3usize, 3];
    for (name, backend) in BACKENDS {
        let m = model(&cell, &[("H", 5)], i, backend());
        let (out, trace) = m.forward_train(padded(&x, b, t, &lengths), None).expect(name);
        let width = m.output_size();
        // Layer 0's forward direction is poisoned from step 1 on, its reverse
        // one up to step 1, so layer 1 reads a NaN at every step of sequence
        // 0: all its outputs there are NaN, and none of sequence 1's.
        for step in 0..t {
            for seq in 0..b {
                let row = &out.data[(seq * t + step) * width..(seq * t + step + 1) * width];
                if seq == 0 {
                    assert!(row.iter().all(|v| v.is_nan()), "{name}: step {step} hides the NaN: {row:?}");
                } else {
                    assert!(row.iter().all(|v| v.is_finite()), "{name}: step {step}: {row:?}");
                }
            }
        }
        let dy = vec![0.1f32; out.data.len()];
        let g = m.backward(&trace, &dy, None).expect(name);
        // Weights read the poisoned sequence: every parameter gradient of the first layer is NaN somewhere.
        for (slot, grads) in g.d_params.iter().enumerate().take(2) {
            for d in grads {
                assert!(d.iter().any(|v| v.is_nan()), "{name}: layer-0 slot {slot} gradient hides the NaN");
            }
        }
        let d_x1 = &g.d_input[t * i..];
        assert!(d_x1.iter().all(|v| v.is_finite()), "{name}: sequence 1's input gradient: {d_x1:?}");
    }
}

#[test]
fn a_tensor_too_large_to_index_is_refused_with_its_bytes() {
    let cell = compiled("rnn.cell", RNN);
    let sizes = [("H".to_string(), 1_000_000_000)].into();
    let err = Model::new(cell, ModelConfig::default(), &sizes, Some(3), None, 1, Box::new(Reference))
        .expect_err("a [1e9, 1e9] matrix");
    assert!(matches!(err, RuntimeError::Layer { .. } | RuntimeError::TooLarge { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("parameter `w` has shape [1000000000, 3]: 3000000000 elements need 12.0 GB"),
        "{text}"
    );
}

#[test]
fn a_pass_larger_than_memory_is_refused_before_allocating() {
    let cell = compiled(
        "wide.cell",
        "cell wide {\n input x[I]\n state h[H], s[P]\n param w[H, I]\n h' = tanh(w @ x + h)\n s' = 0.5 * s\n output h'\n}",
    );
    // 2^30 floats a state: each sequence holds at least 16 GiB of it, so 64 need a terabyte.
    let sizes = [("H".to_string(), 2), ("P".to_string(), 1 << 30)].into();
    let m = Model::new(cell, ModelConfig::default(), &sizes, Some(1), None, 1, Box::new(Reference))
        .expect("model");
    let x = vec![0.5f32; 64];
    let lengths = vec![1usize; 64];
    let err = m.forward(padded(&x, 64, 1, &lengths), None).expect_err("a terabyte");
    assert!(matches!(err, RuntimeError::TooLarge { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("a forward pass of cell `wide` over 64 sequences") && text.contains("TB"),
        "{text}"
    );
}

#[test]
fn a_weight_that_fits_no_size_is_named_once() {
    let lstm = Arc::new(
        CompiledCell::from_file(&support::root().join("cells/lstm.cell"), None).expect("lstm compiles"),
    );
    let mut weights = cellc_runtime::Weights::default();
    weights.insert("weight_ih_l0".into(), vec![7, 3], vec![0.0; 21]); // 7 rows: not 4*H
    let err = Model::new(
        lstm,
        ModelConfig::default(),
        &Default::default(),
        Some(3),
        Some(&weights),
        0,
        Box::new(Reference),
    )
    .expect_err("7 is not 4*H");
    let text = err.to_string();
    assert!(text.contains("`weight_ih_l0` has shape 7, expected a size of the form [4*H]"), "{text}");
    assert!(!text.contains("``"), "{text}");
}
