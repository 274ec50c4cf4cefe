//! xLSTM's sLSTM against the `xlstm` package: its cell on the `vanilla`
//! back end (PyTorch autograd through the package's pointwise function),
//! one head, on sixteen unsorted sequences of 1 to 256 steps, padded
//! either way round, forward and backward, on every back end, against the
//! fixtures of tests/fixtures/gen_xlstm.py: outputs, final states and every
//! gradient to 1e-5 relative.
//!
//! The cell (tests/fixtures/xlstm/slstm_one_head.cell) is the package's
//! `slstm` pointwise function written in the language; its parameters are
//! the package's state_dict entries with the model's layer suffix `_l0`.
//! The package tests `n == 0` for the whole batch at once, the cell each
//! element: they differ only where some of a call's normalisers are zero
//! and others not, which a batch starting from the zero state never has.

mod support;

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::cuda::Cuda;
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Backend;
use cellc_runtime::{read_tensors, Align, CompiledCell, Input, Major, Model, ModelConfig, Weights};
use std::sync::Arc;

const TOLERANCE: f64 = 1e-5;

/// A back end by name, and how to make one.
type NamedBackend = (&'static str, fn() -> Box<dyn Backend>);

/// The package's cell with one head, in the language.
const SLSTM_ONE_HEAD: &str = include_str!("fixtures/xlstm/slstm_one_head.cell");

/// Norm-wise `‖a − b‖ / max(‖b‖, 1e-30)`.
fn relative(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (diff / norm.max(1e-60)).sqrt()
}

/// Each sequence's first `length` steps of `[B, T, width]` moved to the end of the T axis.
fn shift_right(data: &[f32], lengths: &[usize], steps: usize, width: usize) -> Vec<f32> {
    let mut out = vec![0.0; data.len()];
    for (b, &length) in lengths.iter().enumerate() {
        let row = |t: usize| (b * steps + t) * width;
        out[row(steps - length)..row(steps)].copy_from_slice(&data[row(0)..row(length)]);
    }
    out
}

#[test]
fn one_head_slstm_matches_the_xlstm_package_on_every_back_end() {
    let dir = support::root().join("tests/fixtures/xlstm");
    let x = read_tensors(&dir.join("slstm_nh1_input.safetensors")).expect("input");
    let want = read_tensors(&dir.join("slstm_nh1_expected.safetensors")).expect("expected");
    let stored = read_tensors(&dir.join("slstm_nh1_weights.safetensors")).expect("weights");
    let cell = Arc::new(CompiledCell::from_source("slstm.cell", SLSTM_ONE_HEAD, None).expect("compiles"));
    let (b, t, features) = {
        let s = &x["input"].shape;
        (s[0], s[1], s[2])
    };
    let hidden = features / 4;
    let lengths: Vec<usize> = support::fixture(&x, "lengths").iter().map(|&l| l as usize).collect();
    let mut weights = Weights::default();
    for name in ["_recurrent_kernel_", "_bias_"] {
        let tensor = &stored[name];
        // `_recurrent_kernel_` is [heads = 1, 4H, H]: one matrix.
        let shape = if tensor.shape.len() == 3 { tensor.shape[1..].to_vec() } else { tensor.shape.clone() };
        weights.insert(format!("{name}_l0"), shape, support::f32s(tensor));
    }
    let states = ["y", "c", "n", "m"];
    let gf: Vec<Vec<f32>> = states.iter().map(|s| support::fixture(&x, &format!("grad_final.{s}"))).collect();
    let backends: [NamedBackend; 3] = [
        ("reference", || Box::new(Reference)),
        ("cpu", || Box::new(Cpu::new(2, Kernels::Fastest).expect("cpu"))),
        ("cuda-emulated", || Box::new(Cuda::emulated().expect("emulated device"))),
    ];
    let mut report = Vec::new();
    for (name, backend) in backends {
        if name == "cuda-emulated" && !cellc_runtime::backend::cuda::device::gxx_available() {
            eprintln!("skipped: no g++ for the emulated device");
            continue;
        }
        let config = ModelConfig { layers: 1, bidirectional: false };
        let model = Model::new(
            cell.clone(),
            config,
            &Default::default(),
            Some(features),
            Some(&weights),
            0,
            backend(),
        )
        .expect("the package's weights load");
        for align in [Align::Left, Align::Right] {
            let laid = |data: Vec<f32>, width: usize| match align {
                Align::Left => data,
                Align::Right => shift_right(&data, &lengths, t, width),
            };
            let data = laid(support::fixture(&x, "input"), features);
            let dy = laid(support::fixture(&x, "grad_output"), hidden);
            let input = Input::Padded {
                data: &data,
                batch: b,
                steps: t,
                major: Major::BatchFirst,
                align,
                lengths: &lengths,
            };
            let (out, trace) = model.forward_train(input, None).expect("forward");
            let grads = model.backward(&trace, &dy, Some(&gf)).expect("backward");
            let mut check = |what: &str, ours: &[f32], theirs: Vec<f32>| {
                let e = relative(ours, &theirs);
                assert!(e <= TOLERANCE, "{name} {align:?} {what}: {e:.2e} from the xlstm package");
                report.push(format!("{name} {align:?} {what} {e:.1e}"));
            };
            check("output", &out.data, laid(support::fixture(&want, "output"), hidden));
            check("grad.input", &grads.d_input, laid(support::fixture(&want, "grad.input"), features));
            for (k, s) in states.iter().enumerate() {
                check(
                    &format!("final.{s}"),
                    &out.final_states[k],
                    support::fixture(&want, &format!("final.{s}")),
                );
            }
            let d = grads.d_params.iter().flatten().collect::<Vec<_>>();
            check("grad._recurrent_kernel_", d[0], support::fixture(&want, "grad._recurrent_kernel_"));
            check("grad._bias_", d[1], support::fixture(&want, "grad._bias_"));
        }
    }
    support::report(&format!("sLSTM (1 head) against the xlstm package: {}", report.join(", ")));
}
