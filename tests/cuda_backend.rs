//! The CUDA back end's driver on the emulated device (host memory, the
//! generated kernels compiled as host C++): inference on every shipped
//! cell as a 2-layer bidirectional model (one-way where the cell's input
//! cannot read a bidirectional layer) over an unsorted variable-length
//! batch, padded in all four layouts and packed, against the reference
//! back end. Tolerance 2e-5 relative to max(1, |expected|).

mod support;

use cellc_runtime::backend::cuda::Cuda;
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Backend;
use cellc_runtime::{Align, CompiledCell, Input, Major, Model, ModelConfig, PackedSequence, RuntimeError};
use std::sync::Arc;
use support::Rng;

const LENGTHS: [usize; 4] = [3, 5, 1, 4];
const STEPS: usize = 5;

/// A 2-layer bidirectional model when the cell allows it, else 2 layers one way.
fn model(c: &Arc<CompiledCell>, backend: &dyn Fn() -> Box<dyn Backend>) -> Model {
    let sizes = [("H".to_string(), 37), ("P".to_string(), 5)]
        .into_iter()
        .filter(|(k, _)| c.cell.sizes.contains(k))
        .collect();
    let input = if c.cell.input_dim().variables() == ["H"] { 37 } else { 6 };
    let two_way = ModelConfig { layers: 2, bidirectional: true };
    match Model::new(c.clone(), two_way, &sizes, Some(input), None, 3, backend()) {
        Ok(m) => m,
        Err(RuntimeError::Layer { .. }) => {
            let one_way = ModelConfig { layers: 2, bidirectional: false };
            Model::new(c.clone(), one_way, &sizes, Some(input), None, 3, backend()).expect("model")
        }
        Err(e) => panic!("{}: {e}", c.cell.name),
    }
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (j, (a, b)) in got.iter().zip(want).enumerate() {
        let err = (a - b).abs() / b.abs().max(1.0);
        assert!(err <= 2e-5, "{what}[{j}]: emulated CUDA {a}, reference {b}");
    }
}

#[test]
fn inference_on_the_emulated_device_matches_the_reference() {
    inference_matches_the_reference(Arc::new(Cuda::emulated().expect("emulated device")));
}

/// The same on a real GPU, where there is one.
#[test]
fn inference_on_a_gpu_matches_the_reference() {
    if !cellc_runtime::backend::cuda::driver_available() {
        eprintln!("SKIPPED: no CUDA driver on this machine; the GPU path was not run");
        return;
    }
    inference_matches_the_reference(Arc::new(Cuda::gpu(0).expect("GPU back end")));
}

fn inference_matches_the_reference(cuda: Arc<Cuda>) {
    let mut checked = 0;
    for path in support::shipped_cells().iter().filter(|p| p.file_stem().is_some_and(|s| s != "prelude")) {
        let c = Arc::new(CompiledCell::from_file(path, None).expect("compiles"));
        // The same seed gives both models the same weights.
        let reference = model(&c, &|| Box::new(Reference));
        let on_cuda = model(&c, &|| Box::new(CudaRef(cuda.clone())));
        let mut rng = Rng::new(7);
        let features = reference.input_size();
        let x: Vec<f32> = rng.vec(LENGTHS.len() * STEPS * features, 1.0).iter().map(|&v| v as f32).collect();
        for major in [Major::BatchFirst, Major::TimeFirst] {
            for align in [Align::Left, Align::Right] {
                let input = Input::Padded {
                    data: &x,
                    batch: LENGTHS.len(),
                    steps: STEPS,
                    major,
                    align,
                    lengths: &LENGTHS,
                };
                let want = reference.forward(input, None).expect("reference");
                let got = on_cuda.forward(input, None).unwrap_or_else(|e| panic!("{}: {e}", c.cell.name));
                let what = format!("{} {major:?} {align:?}", c.cell.name);
                close(&format!("{what} output"), &got.data, &want.data);
                for (g, w) in got.final_states.iter().zip(&want.final_states) {
                    close(&format!("{what} final"), g, w);
                }
            }
        }
        let packed =
            PackedSequence::from_padded(&x, &LENGTHS, STEPS, features, Major::BatchFirst, Align::Left)
                .expect("packs");
        let want = reference.forward(Input::Packed(&packed), None).expect("reference");
        let got = on_cuda.forward(Input::Packed(&packed), None).expect("packed");
        close(&format!("{} packed", c.cell.name), &got.data, &want.data);
        checked += 1;
    }
    assert_eq!(checked, 14);
}

/// Shares one emulated device (and its compiled modules) between models.
struct CudaRef(Arc<Cuda>);

impl Backend for CudaRef {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn forward(
        &self,
        job: &cellc_runtime::backend::ForwardJob,
        output: &mut cellc_runtime::backend::RowsMut,
    ) -> cellc_runtime::Result<cellc_runtime::backend::ForwardResult> {
        self.0.forward(job, output)
    }
    fn backward(
        &self,
        job: &cellc_runtime::backend::BackwardJob,
        tape: &cellc_runtime::backend::Tape,
        d_input: &mut cellc_runtime::backend::RowsMut,
    ) -> cellc_runtime::Result<cellc_runtime::backend::BackwardResult> {
        self.0.backward(job, tape, d_input)
    }
}
