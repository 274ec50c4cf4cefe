//! The CUDA back end's drivers on the emulated device (host memory, the
//! generated kernels compiled as host C++), against the reference back
//! end, on every shipped cell as a 2-layer bidirectional model (one-way
//! where the cell's input cannot read a bidirectional layer) over an
//! unsorted variable-length batch, padded in all four layouts and packed:
//!
//! - inference: outputs and final states within 2e-5 (relative to
//!   max(1, |expected|));
//! - training: the forward keeping its tape on the device, then the
//!   backward with output and final-state adjoints: input, initial-state
//!   and every parameter's gradient, within 1e-4 (2e-3 for cells with row
//!   reductions; this fixed, well-conditioned batch stays well inside it,
//!   and random ones are checked against the f64 interpreter by
//!   `cellc_difftest`);
//! - CUDA graphs: a pass runs once as it is (a warm-up), is captured the
//!   second time and replayed after that, every round giving the bits of
//!   the first; against a device without graphs, the same bits on the
//!   emulated device and within 1e-5 on a GPU (another cuBLAS handle:
//!   cuBLAS promises the same bits only run to run on one handle's
//!   configuration and one active stream).
//!
//! The same tests run on device 0 where a GPU exists, and say they were
//! skipped where none does (failing instead with `CELLC_REQUIRE_GPU`).

mod support;

use cellc::ir::Op;
use cellc_runtime::backend::cuda::step_loop::StepLoops;
use cellc_runtime::backend::cuda::Cuda;
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::{Align, CompiledCell, Input, Major, Model, PackedSequence};
use std::sync::Arc;
use support::Rng;

const LENGTHS: [usize; 4] = [3, 5, 1, 4];
const STEPS: usize = 5;
/// `H` (odd, so no kernel divides it evenly), `P`, and `I` for cells with their own input size.
const SIZES: (usize, usize, usize) = (37, 5, 6);

fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (j, (a, b)) in got.iter().zip(want).enumerate() {
        let err = (a - b).abs() / b.abs().max(1.0);
        assert!(err <= tol, "{what}[{j}]: CUDA {a}, reference {b}");
    }
}

/// Row reductions (LayerNorm) divide by a row's spread in the backward,
/// which amplifies the two back ends' different summation orders.
fn training_tolerance(cell: &CompiledCell) -> f32 {
    let g = &cell.forward;
    if g.values().any(|v| matches!(g.node(v).op, Op::Reduce(_))) {
        2e-3
    } else {
        1e-4
    }
}

/// Every layout the tests run: four padded ones and packed.
fn inputs<'a>(x: &'a [f32], packed: &'a PackedSequence) -> Vec<(String, Input<'a>)> {
    let mut out = Vec::new();
    for major in [Major::BatchFirst, Major::TimeFirst] {
        for align in [Align::Left, Align::Right] {
            out.push((format!("{major:?} {align:?}"), padded(x, major, align)));
        }
    }
    out.push(("packed".into(), Input::Packed(packed.view())));
    out
}

/// The reference and a CUDA model of `c` with the same weights, and an input batch.
fn models(c: &Arc<CompiledCell>, cuda: &Arc<Cuda>) -> (Model, Model, Vec<f32>) {
    let reference = support::two_layer_model(c, SIZES, 3, &|| Box::new(Reference));
    let on_cuda = support::two_layer_model(c, SIZES, 3, &|| Box::new(cuda.clone()));
    let mut rng = Rng::new(7);
    let features = reference.input_size();
    let x = rng.vec(LENGTHS.len() * STEPS * features, 1.0).iter().map(|&v| v as f32).collect();
    (reference, on_cuda, x)
}

/// The test batch `x`, padded in one of the four layouts.
fn padded(x: &[f32], major: Major, align: Align) -> Input<'_> {
    Input::Padded { data: x, batch: LENGTHS.len(), steps: STEPS, major, align, lengths: &LENGTHS }
}

fn packed(x: &[f32], features: usize) -> PackedSequence {
    PackedSequence::from_padded(x, &LENGTHS, STEPS, features, Major::BatchFirst, Align::Left).expect("packs")
}

#[test]
fn inference_on_the_emulated_device_matches_the_reference() {
    inference_matches_the_reference(Arc::new(Cuda::emulated().expect("emulated device")));
}

#[test]
fn training_on_the_emulated_device_matches_the_reference() {
    training_matches_the_reference(Arc::new(Cuda::emulated().expect("emulated device")));
}

/// The same with every time loop step by step (a GEMM, then the step's
/// kernels), the route the step loops replace where they run.
#[test]
fn inference_step_by_step_on_the_emulated_device_matches_the_reference() {
    let cuda = Cuda::emulated().expect("emulated device").with_step_loops(StepLoops::Never);
    inference_matches_the_reference(Arc::new(cuda));
}

#[test]
fn training_step_by_step_on_the_emulated_device_matches_the_reference() {
    let cuda = Cuda::emulated().expect("emulated device").with_step_loops(StepLoops::Never);
    training_matches_the_reference(Arc::new(cuda));
}

/// The rule's route is taken: with the default setting every pass of a
/// cell with per-step products runs its time loop as one step-loop launch
/// on the emulated device (whose weights fit), none with `Never`.
#[test]
fn step_loops_run_where_the_rule_takes_them() {
    let cells = support::compiled_cells();
    let c = cells.iter().find(|c| c.forward.name == "layernorm_lstm").expect("shipped cell");
    for (setting, expected) in [(StepLoops::Auto, true), (StepLoops::Never, false)] {
        let cuda = Arc::new(Cuda::emulated().expect("emulated device").with_step_loops(setting));
        let (_, model, x) = models(c, &cuda);
        let input = padded(&x, Major::TimeFirst, Align::Right);
        let (out, trace) = model.forward_train(input, None).expect("forward");
        model.backward(&trace, &vec![0.5; out.data.len()], None).expect("backward");
        let passes = 2 * model.layers().len() * model.directions();
        let want = if expected { passes } else { 0 };
        assert_eq!(cuda.step_loops_run(), want, "{setting:?}: step loops run of {passes} passes");
    }
}

#[test]
fn graphs_on_the_emulated_device_replay_and_give_the_same_bits() {
    graphs_replay(|| Cuda::emulated().expect("emulated device"), true);
}

/// The same on a real GPU, where there is one.
#[test]
fn inference_on_a_gpu_matches_the_reference() {
    let Some(gpu) = gpu() else { return };
    inference_matches_the_reference(Arc::new(gpu));
}

#[test]
fn training_on_a_gpu_matches_the_reference() {
    let Some(gpu) = gpu() else { return };
    training_matches_the_reference(Arc::new(gpu));
}

#[test]
fn graphs_on_a_gpu_replay_and_give_the_same_bits() {
    if gpu().is_none() {
        return;
    }
    graphs_replay(|| Cuda::gpu(0).expect("GPU back end"), false);
}

fn gpu() -> Option<Cuda> {
    support::gpu_present("the CUDA back end on a GPU").then(|| Cuda::gpu(0).expect("GPU back end"))
}

fn inference_matches_the_reference(cuda: Arc<Cuda>) {
    let cells = support::compiled_cells();
    for c in &cells {
        let (reference, on_cuda, x) = models(c, &cuda);
        let packed = packed(&x, reference.input_size());
        for (layout, input) in inputs(&x, &packed) {
            let want = reference.forward(input, None).expect("reference");
            let got = on_cuda.forward(input, None).unwrap_or_else(|e| panic!("{}: {e}", c.forward.name));
            let what = format!("{} {layout}", c.forward.name);
            close(&format!("{what} output"), &got.data, &want.data, 2e-5);
            for (g, w) in got.final_states.iter().zip(&want.final_states) {
                close(&format!("{what} final"), g, w, 2e-5);
            }
        }
    }
    assert_eq!(cells.len(), 19);
    support::report(&format!(
        "{}: inference of {} cells x 5 layouts (2 layers, varlen) within 2e-5 of the reference, {} passes as step loops",
        cuda_name(&cuda),
        cells.len(),
        cuda.step_loops_run()
    ));
}

fn cuda_name(cuda: &Cuda) -> String {
    format!("{cuda:?}")
}

fn training_matches_the_reference(cuda: Arc<Cuda>) {
    let cells = support::compiled_cells();
    for c in &cells {
        let (reference, on_cuda, x) = models(c, &cuda);
        let tol = training_tolerance(c);
        let packed = packed(&x, reference.input_size());
        let mut rng = Rng::new(11);
        // Adjoints of the final states too, so each sequence's carry starts at its own last step.
        let d_final: Vec<Vec<f32>> = reference
            .layers()
            .first()
            .map(|l| l.state_sizes.clone())
            .unwrap_or_default()
            .iter()
            .map(|&m| {
                let n = reference.layers().len() * reference.directions() * LENGTHS.len() * m;
                rng.vec(n, 1.0).iter().map(|&v| v as f32).collect()
            })
            .collect();
        for (layout, input) in inputs(&x, &packed) {
            let what = format!("{} {layout}", c.forward.name);
            let (want, want_trace) = reference.forward_train(input, None).expect("reference");
            let (got, got_trace) =
                on_cuda.forward_train(input, None).unwrap_or_else(|e| panic!("{what}: forward: {e}"));
            close(&format!("{what} output"), &got.data, &want.data, 2e-5);
            for (g, w) in got.final_states.iter().zip(&want.final_states) {
                close(&format!("{what} final"), g, w, 2e-5);
            }
            let dy: Vec<f32> = rng.vec(want.data.len(), 1.0).iter().map(|&v| v as f32).collect();
            let want = reference.backward(&want_trace, &dy, Some(&d_final)).expect("reference backward");
            let got = on_cuda
                .backward(&got_trace, &dy, Some(&d_final))
                .unwrap_or_else(|e| panic!("{what}: backward: {e}"));
            close(&format!("{what} d_input"), &got.d_input, &want.d_input, tol);
            for (g, w) in got.d_h0.iter().zip(&want.d_h0) {
                close(&format!("{what} d_h0"), g, w, tol);
            }
            let names = on_cuda.compiled().param_names();
            for (slot, (g, w)) in got.d_params.iter().zip(&want.d_params).enumerate() {
                for ((g, w), name) in g.iter().zip(w).zip(&names) {
                    close(&format!("{what} d_{name} (layer/direction {slot})"), g, w, tol);
                }
            }
        }
    }
    assert_eq!(cells.len(), 19);
    support::report(&format!(
        "{}: training (forward, then input, state and parameter gradients) of {} cells x 5 layouts \
         within 1e-4 (2e-3 with row reductions) of the reference, {} passes as step loops",
        cuda_name(&cuda),
        cells.len(),
        cuda.step_loops_run()
    ));
}

/// LSTM training and SRU (a whole-sequence kernel) inference, run five
/// times with graphs on: the first run of each pass warms up, a pass seen
/// again is captured, and by the last round every pass replays (once the
/// pool hands back the same memory, the calls are identical); every round
/// gives the first round's bits,
/// and the first round equals the run without graphs: bit for bit where
/// `same_bits_across_devices`, else within 1e-5.
fn graphs_replay(device: impl Fn() -> Cuda, same_bits_across_devices: bool) {
    let cells = support::compiled_cells();
    for name in ["lstm", "sru"] {
        let c = cells.iter().find(|c| c.forward.name == name).expect("shipped cell");
        let plain = Arc::new(device());
        let graphs = Arc::new(device().with_graphs(true));
        let (_, without, x) = models(c, &plain);
        let (_, with, _) = models(c, &graphs);
        let input = padded(&x, Major::TimeFirst, Align::Right);
        let passes = with.layers().len() * with.directions();
        let (want, want_trace) = without.forward_train(input, None).expect("without graphs");
        let dy = vec![0.5f32; want.data.len()];
        let want_grads = without.backward(&want_trace, &dy, None).expect("backward without graphs");
        drop(want_trace);
        let mut before = graphs.graph_stats();
        let mut first = None;
        const ROUNDS: usize = 5;
        for round in 0..ROUNDS {
            let (got, trace) = with.forward_train(input, None).expect("with graphs");
            let grads = with.backward(&trace, &dy, None).expect("backward with graphs");
            drop(trace);
            let stats = graphs.graph_stats();
            let warmed = stats.warmed_up - before.warmed_up;
            let (captured, replayed) = (stats.captured - before.captured, stats.replayed - before.replayed);
            support::report(&format!(
                "{name} round {round}: {warmed} passes warmed up, {captured} captured, {replayed} replayed"
            ));
            assert_eq!(warmed + captured + replayed, 2 * passes, "{name}: every pass runs under graphs");
            if round == 0 {
                assert_eq!(warmed, 2 * passes, "{name}: the first round warms up");
            }
            if round == ROUNDS - 1 {
                assert_eq!(replayed, 2 * passes, "{name}: by the last round every pass replays");
            }
            before = stats;
            let Some((first_out, first_grads)) = &first else {
                if same_bits_across_devices {
                    assert_eq!(got, want, "{name}: forward with graphs");
                    assert_eq!(grads, want_grads, "{name}: backward with graphs");
                } else {
                    close(&format!("{name}: output with graphs"), &got.data, &want.data, 1e-5);
                    close(&format!("{name}: d_input with graphs"), &grads.d_input, &want_grads.d_input, 1e-5);
                    for (g, w) in grads.d_params.iter().flatten().zip(want_grads.d_params.iter().flatten()) {
                        close(&format!("{name}: a parameter's gradient with graphs"), g, w, 1e-5);
                    }
                }
                first = Some((got, grads));
                continue;
            };
            assert_eq!(&got, first_out, "{name}: forward, round {round}, against the first round");
            assert_eq!(&grads, first_grads, "{name}: backward, round {round}, against the first round");
        }
    }
}

/// A model's parameters cross to the device on its first pass only, and
/// again after they change (the values then used are the new ones).
#[test]
fn parameters_are_uploaded_once_per_model_until_they_change() {
    let cells = support::compiled_cells();
    let c = cells.iter().find(|c| c.forward.name == "gru").expect("shipped cell");
    let cuda = Arc::new(Cuda::emulated().expect("emulated device"));
    let (reference, mut on_cuda, x) = models(c, &cuda);
    let input = padded(&x, Major::BatchFirst, Align::Left);
    let dirs = on_cuda.directions();
    let params: usize = (0..on_cuda.layers().len() * dirs)
        .flat_map(|s| on_cuda.params(s / dirs, s % dirs == 1).iter().map(Vec::len))
        .sum();
    let start = cuda.floats_uploaded();
    on_cuda.forward(input, None).expect("first pass");
    let first = cuda.floats_uploaded() - start;
    on_cuda.forward(input, None).expect("second pass");
    let second = cuda.floats_uploaded() - start - first;
    assert_eq!(first - second, params, "the first pass uploads the parameters, the second does not");
    assert!(second < params, "the second pass uploads inputs and states only ({second} floats)");
    // A change of parameters is seen: both models get the same new values.
    let mut reference = reference;
    for model in [&mut on_cuda, &mut reference] {
        model.params_mut().iter_mut().flatten().flatten().for_each(|w| *w *= 0.5);
    }
    let before = cuda.floats_uploaded();
    let got = on_cuda.forward(input, None).expect("after the change");
    assert_eq!(cuda.floats_uploaded() - before, first, "uploaded again after params_mut");
    let want = reference.forward(input, None).expect("reference");
    close("output after a change of parameters", &got.data, &want.data, 2e-5);
}
