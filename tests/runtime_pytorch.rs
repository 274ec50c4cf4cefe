//! The runtime against PyTorch: 2-layer bidirectional nn.LSTM, nn.GRU and
//! nn.RNN state_dicts (safetensors, names unchanged) loaded into
//! cells/lstm.cell, gru.cell and rnn_tanh.cell, run on an unsorted
//! variable-length batch — padded left-aligned, padded right-aligned, and
//! packed — forward and backward, on every backend, against the fixtures
//! of tests/fixtures/gen_runtime.py: outputs, final states and all
//! gradients to 1e-5 relative.

mod support;

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::cuda::Cuda;
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::{
    read_tensors, Align, CompiledCell, Input, Major, Model, ModelConfig, PackedSequence, Weights,
};
use std::path::PathBuf;
use std::sync::Arc;

const TOLERANCE: f64 = 1e-5;

fn dir() -> PathBuf {
    support::root().join("tests/fixtures/runtime")
}

/// Worst `|a - b| / max(1, |b|)`.
fn worst(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs() / (y as f64).abs().max(1.0))
        .fold(0.0, f64::max)
}

fn check(what: &str, ours: &[f32], theirs: &[f32], report: &mut Vec<String>) {
    let w = worst(ours, theirs);
    assert!(w <= TOLERANCE, "{what}: differs from PyTorch by {w:e}");
    report.push(format!("{what}: {w:.1e}"));
}

fn run(kind: &str, backend: &dyn Fn() -> Box<dyn Device>, report: &mut Vec<String>) {
    let cell = Arc::new(
        CompiledCell::from_file(&support::root().join(format!("cells/{kind}.cell")), None).expect("compiles"),
    );
    let states: Vec<String> = cell.forward.states.iter().map(|s| s.name.clone()).collect();
    let weights = Weights::load(&dir().join(format!("{kind}_weights.safetensors"))).expect("weights");
    let config = ModelConfig { layers: 2, bidirectional: true };
    for align in [Align::Left, Align::Right] {
        let tag = if align == Align::Left { "left" } else { "right" };
        let x = read_tensors(&dir().join(format!("{kind}_{tag}_input.safetensors"))).expect("input");
        let want = read_tensors(&dir().join(format!("{kind}_{tag}_expected.safetensors"))).expect("expected");
        let shape = &x["input"].shape;
        let (b, t, i) = (shape[0], shape[1], shape[2]);
        let model = Model::new(
            cell.clone(),
            config.clone(),
            &Default::default(),
            Some(i),
            Some(&weights),
            0,
            backend(),
        )
        .expect("a PyTorch state_dict loads unchanged");
        let lengths: Vec<usize> = support::fixture(&x, "lengths").iter().map(|&l| l as usize).collect();
        let data = support::fixture(&x, "input");
        let h0: Vec<Vec<f32>> = states.iter().map(|s| support::fixture(&x, &format!("h0.{s}"))).collect();
        let gf: Vec<Vec<f32>> =
            states.iter().map(|s| support::fixture(&x, &format!("grad_final.{s}"))).collect();
        let dy = support::fixture(&x, "grad_output");
        let input = Input::Padded {
            data: &data,
            batch: b,
            steps: t,
            major: Major::BatchFirst,
            align,
            lengths: &lengths,
        };
        let (out, trace) = model.forward_train(input, Some(&h0)).expect("forward");
        let grads = model.backward(&trace, &dy, Some(&gf)).expect("backward");
        let name = format!("{kind} {tag} {}", model.backend_name());
        check(&format!("{name} output"), &out.data, &support::fixture(&want, "output"), report);
        check(&format!("{name} grad.input"), &grads.d_input, &support::fixture(&want, "grad.input"), report);
        for (k, s) in states.iter().enumerate() {
            check(
                &format!("{name} final.{s}"),
                &out.final_states[k],
                &support::fixture(&want, &format!("final.{s}")),
                report,
            );
            check(
                &format!("{name} grad.h0.{s}"),
                &grads.d_h0[k],
                &support::fixture(&want, &format!("grad.h0.{s}")),
                report,
            );
        }
        for ((wname, _), d) in model.weight_names().iter().zip(grads.d_params.iter().flatten()) {
            check(
                &format!("{name} grad.{wname}"),
                d,
                &support::fixture(&want, &format!("grad.{wname}")),
                report,
            );
        }

        if align == Align::Left {
            // The same batch packed as PyTorch packs it, gradients included.
            let packed =
                PackedSequence::from_padded(&data, &lengths, t, i, Major::BatchFirst, align).expect("packs");
            let o = model.output_size();
            let dy_packed =
                PackedSequence::from_padded(&dy, &lengths, t, o, Major::BatchFirst, align).expect("packs");
            let (pout, ptrace) =
                model.forward_train(Input::Packed(packed.view()), Some(&h0)).expect("packed forward");
            let pgrads = model.backward(&ptrace, &dy_packed.data, Some(&gf)).expect("packed backward");
            let unpack = |data: Vec<f32>, features: usize| {
                PackedSequence { data, features, ..packed.clone() }
                    .to_padded(t, Major::BatchFirst, align)
                    .expect("unpacks")
            };
            check(
                &format!("{name} packed output"),
                &unpack(pout.data, o),
                &support::fixture(&want, "output"),
                report,
            );
            check(
                &format!("{name} packed grad.input"),
                &unpack(pgrads.d_input, i),
                &support::fixture(&want, "grad.input"),
                report,
            );
            for ((wname, _), d) in model.weight_names().iter().zip(pgrads.d_params.iter().flatten()) {
                check(
                    &format!("{name} packed grad.{wname}"),
                    d,
                    &support::fixture(&want, &format!("grad.{wname}")),
                    report,
                );
            }
        }
    }
}

fn all(backend: &dyn Fn() -> Box<dyn Device>) {
    let mut report = Vec::new();
    for kind in ["lstm", "gru", "rnn_tanh"] {
        run(kind, backend, &mut report);
    }
    eprintln!("{}", report.join("\n"));
}

#[test]
fn reference_backend_matches_pytorch() {
    all(&|| Box::new(Reference));
}

#[test]
fn cpu_backend_matches_pytorch() {
    all(&|| Box::new(Cpu::new(2, Kernels::default()).expect("cpu").split_every_step()));
}

#[test]
fn cuda_backend_on_the_emulated_device_matches_pytorch() {
    all(&|| Box::new(Cuda::emulated().expect("the emulated device (g++)")));
}
