//! Cells whose output is a per-step product of a state (`output v @ h'`):
//! every fast back end against the reference, forward and backward.
//!
//! No shipped cell has such an output, and this is the case that once got
//! wrong gradients on the CPU: the backward ran `vᵀ · dy` as a per-step
//! product, which reads its rows as the step's first ranks, but the output
//! adjoint `dy` lives in the caller's layout rows, so the CPU read other
//! sequences' rows (and the CUDA driver refused it). The schedule now runs
//! such products before the loop, over all steps at once.

mod support;

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::cuda::Cuda;
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::{Align, CompiledCell, Input, Major, Model, ModelConfig};
use std::sync::Arc;

const PROJECTED_OUTPUT: &str = "
cell projected {
    input x[I]
    state h[H]
    param w[H, I], u[H, H], v[P, H], b[H] = zeros
    h' = tanh(w @ x + u @ h + b)
    output v @ h'
}";

type MakeBackend = fn() -> Box<dyn Device>;

const BACKENDS: [(&str, MakeBackend); 3] = [
    ("cpu", || Box::new(Cpu::new(2, Kernels::Jit).expect("cpu").split_every_step())),
    ("cpu interpreted", || Box::new(Cpu::new(2, Kernels::Interpreted).expect("cpu").split_every_step())),
    ("cuda emulated", || Box::new(Cuda::emulated().expect("emulated device"))),
];

fn model(cell: &Arc<CompiledCell>, layers: usize, bidirectional: bool, backend: Box<dyn Device>) -> Model {
    let sizes = [("H".to_string(), 5), ("P".to_string(), 3)].into_iter().collect();
    Model::new(cell.clone(), ModelConfig { layers, bidirectional }, &sizes, Some(4), None, 11, backend)
        .expect("model")
}

#[test]
fn projected_output_gradients_match_the_reference() {
    let cell =
        Arc::new(CompiledCell::from_source("projected.cell", PROJECTED_OUTPUT, None).expect("compiles"));
    for (name, backend) in BACKENDS {
        for (layers, bidirectional) in [(1, false), (2, true)] {
            for (lengths, align) in [(vec![3usize, 5, 1, 4, 2], Align::Right), (vec![4], Align::Left)] {
                let fast = model(&cell, layers, bidirectional, backend());
                let reference = model(&cell, layers, bidirectional, Box::new(Reference));
                let (b, t) = (lengths.len(), *lengths.iter().max().expect("a sequence"));
                let mut rng = support::Rng::new(5);
                let x: Vec<f32> = rng.vec(b * t * 4, 1.0).iter().map(|&v| v as f32).collect();
                let dy: Vec<f32> =
                    rng.vec(b * t * fast.output_size(), 1.0).iter().map(|&v| v as f32).collect();
                let input = Input::Padded {
                    data: &x,
                    batch: b,
                    steps: t,
                    major: Major::BatchFirst,
                    align,
                    lengths: &lengths,
                };
                let (o1, tr1) = fast.forward_train(input, None).expect("forward");
                let (o2, tr2) = reference.forward_train(input, None).expect("reference forward");
                let g1 = fast.backward(&tr1, &dy, None).expect("backward");
                let g2 = reference.backward(&tr2, &dy, None).expect("reference backward");
                let case =
                    format!("{name}, {layers} layers, bidirectional {bidirectional}, lengths {lengths:?}");
                let close = |what: &str, a: &[f32], r: &[f32]| {
                    for (k, (x, y)) in a.iter().zip(r).enumerate() {
                        assert!(
                            (x - y).abs() <= 1e-4 * y.abs().max(1.0),
                            "{what}[{k}]: {x}, reference {y} ({case})"
                        );
                    }
                };
                close("output", &o1.data, &o2.data);
                close("d_input", &g1.d_input, &g2.d_input);
                for (a, r) in g1.d_h0.iter().zip(&g2.d_h0) {
                    close("d_h0", a, r);
                }
                for (a, r) in g1.d_params.iter().flatten().zip(g2.d_params.iter().flatten()) {
                    close("d_param", a, r);
                }
            }
        }
    }
}
