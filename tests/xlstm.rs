//! xLSTM's sLSTM against the `xlstm` package, and TiRex's variant against
//! TiRex: the shipped cells `cells/slstm.cell` (with 1 and 4 heads) and
//! `cells/tirex_slstm.cell` (4 heads) on sixteen unsorted sequences of 1 to
//! 256 steps, padded either way round, forward and backward, on every back
//! end, against the fixtures of tests/fixtures/gen_xlstm.py: outputs, final
//! states and every gradient to 1e-5 relative. Each sequence also runs alone
//! (batch 1), the one-step one included, against its rows of the fixture.
//!
//! The packages' state_dict entries load unchanged, with the model's layer
//! suffix `_l0`: `_recurrent_kernel_` [heads, 4*D, D] (the `xlstm` package's
//! vanilla layout) or [heads, D, 4*D] (TiRex's), and `_bias_`. The packages
//! test `n == 0` for the whole batch at once, the cells each element: they
//! differ only where some of a call's normalisers are zero and others not,
//! which a batch starting from the zero state never has.

mod support;

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::cuda::Cuda;
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::{read_tensors, Align, CompiledCell, Input, Major, Model, ModelConfig, Tensor, Weights};
use std::collections::BTreeMap;
use std::sync::Arc;

const TOLERANCE: f64 = 1e-5;
const STATES: [&str; 4] = ["y", "c", "n", "m"];

/// A back end by name, and how to make one.
type NamedBackend = (&'static str, fn() -> Box<dyn Device>);

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

fn backends() -> [NamedBackend; 3] {
    [
        ("reference", || Box::new(Reference)),
        ("cpu", || Box::new(Cpu::new(2, Kernels::Fastest).expect("cpu"))),
        ("cuda-emulated", || Box::new(Cuda::emulated().expect("emulated device"))),
    ]
}

/// A fixture's three files: inputs, expected values, the package's weights.
struct Fixture {
    x: BTreeMap<String, Tensor>,
    want: BTreeMap<String, Tensor>,
    weights: Weights,
    lengths: Vec<usize>,
    batch: usize,
    steps: usize,
    features: usize,
}

impl Fixture {
    fn load(tag: &str) -> Fixture {
        let dir = support::root().join("tests/fixtures/xlstm");
        let read = |what: &str| read_tensors(&dir.join(format!("{tag}_{what}.safetensors"))).expect(what);
        let (x, want, stored) = (read("input"), read("expected"), read("weights"));
        let mut weights = Weights::default();
        for (name, tensor) in &stored {
            // As the package stores them: only the layer suffix is added.
            weights.insert(format!("{name}_l0"), tensor.shape.clone(), support::f32s(tensor));
        }
        let s = &x["input"].shape;
        let lengths = support::fixture(&x, "lengths").iter().map(|&l| l as usize).collect();
        Fixture { lengths, batch: s[0], steps: s[1], features: s[2], x, want, weights }
    }

    fn hidden(&self) -> usize {
        self.features / 4
    }

    /// `name`'s rows `[b0, b0 + count)` of a `[B, T, width]` tensor of `map`.
    fn rows(map: &BTreeMap<String, Tensor>, name: &str, (b0, count): (usize, usize)) -> Vec<f32> {
        let data = support::fixture(map, name);
        let per = data.len() / map[name].shape[0];
        data[b0 * per..(b0 + count) * per].to_vec()
    }
}

/// Runs `source` on `fix` on every back end, padded both ways, on the whole
/// batch (every gradient checked) and on each sequence alone (outputs,
/// final states and the input's gradient); the worst errors for the log.
fn check(what: &str, source: &str, fix: &Fixture) -> String {
    let cell = Arc::new(CompiledCell::from_source("slstm.cell", source, None).expect("compiles"));
    let (t, hidden, features) = (fix.steps, fix.hidden(), fix.features);
    let mut worst: BTreeMap<String, f64> = BTreeMap::new();
    for (name, backend) in backends() {
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
            Some(&fix.weights),
            0,
            backend(),
        )
        .expect("the package's weights load");
        // The whole batch, then each sequence alone.
        let groups: Vec<(usize, usize)> =
            std::iter::once((0, fix.batch)).chain((0..fix.batch).map(|b| (b, 1))).collect();
        for (b0, count) in groups {
            let lengths = &fix.lengths[b0..b0 + count];
            // A sequence alone runs for its own length only.
            let steps = if count == 1 { lengths[0] } else { t };
            let trim = |data: Vec<f32>, width: usize| -> Vec<f32> {
                (0..count).flat_map(|b| data[b * t * width..][..steps * width].to_vec()).collect()
            };
            for align in [Align::Left, Align::Right] {
                let laid = |data: Vec<f32>, width: usize| match align {
                    Align::Left => trim(data, width),
                    Align::Right => shift_right(&trim(data, width), lengths, steps, width),
                };
                let rows = |map, name: &str| Fixture::rows(map, name, (b0, count));
                let data = laid(rows(&fix.x, "input"), features);
                let dy = laid(rows(&fix.x, "grad_output"), hidden);
                let input = Input::Padded {
                    data: &data,
                    batch: count,
                    steps,
                    major: Major::BatchFirst,
                    align,
                    lengths,
                };
                let finals: Vec<Vec<f32>> = STATES
                    .iter()
                    .map(|s| {
                        support::fixture(&fix.x, &format!("grad_final.{s}"))[b0 * hidden..][..count * hidden]
                            .to_vec()
                    })
                    .collect();
                let (out, trace) = model.forward_train(input, None).expect("forward");
                let grads = model.backward(&trace, &dy, Some(&finals)).expect("backward");
                let mut expect = |what: &str, ours: &[f32], theirs: Vec<f32>| {
                    let e = relative(ours, &theirs);
                    assert!(
                        e <= TOLERANCE,
                        "{name} {align:?} batch {b0}..{}: {what}: {e:.2e} from the package",
                        b0 + count
                    );
                    let w = worst.entry(format!("{name} {what}")).or_insert(0.0);
                    *w = w.max(e);
                };
                expect("output", &out.data, laid(rows(&fix.want, "output"), hidden));
                expect("grad.input", &grads.d_input, laid(rows(&fix.want, "grad.input"), features));
                for (k, s) in STATES.iter().enumerate() {
                    let theirs = support::fixture(&fix.want, &format!("final.{s}"));
                    expect(
                        &format!("final.{s}"),
                        &out.final_states[k],
                        theirs[b0 * hidden..][..count * hidden].to_vec(),
                    );
                }
                if count == fix.batch {
                    let d = grads.d_params.iter().flatten().collect::<Vec<_>>();
                    for (i, p) in ["_recurrent_kernel_", "_bias_"].iter().enumerate() {
                        expect(&format!("grad.{p}"), d[i], support::fixture(&fix.want, &format!("grad.{p}")));
                    }
                }
            }
        }
    }
    let line: Vec<String> = worst.iter().map(|(k, e)| format!("{k} {e:.1e}")).collect();
    format!("{what}: {}", line.join(", "))
}

/// `cells/<name>.cell` with `HEADS` heads.
fn shipped_with_heads(name: &str, heads: usize) -> String {
    let source =
        std::fs::read_to_string(support::root().join(format!("cells/{name}.cell"))).expect("shipped cell");
    assert!(source.contains("const HEADS = 4\n"), "{name}.cell declares `const HEADS = 4`");
    source.replace("const HEADS = 4\n", &format!("const HEADS = {heads}\n"))
}

#[test]
fn slstm_matches_the_xlstm_package_with_one_head() {
    let report = check(
        "sLSTM (1 head) against the xlstm package",
        &shipped_with_heads("slstm", 1),
        &Fixture::load("slstm_nh1"),
    );
    support::report(&report);
}

#[test]
fn slstm_matches_the_xlstm_package_with_four_heads() {
    let report = check(
        "sLSTM (4 heads) against the xlstm package",
        &shipped_with_heads("slstm", 4),
        &Fixture::load("slstm_nh4"),
    );
    support::report(&report);
}

#[test]
fn tirex_slstm_matches_tirex_with_four_heads() {
    let report = check(
        "TiRex's sLSTM (4 heads) against TiRex",
        &shipped_with_heads("tirex_slstm", 4),
        &Fixture::load("tirex_nh4"),
    );
    support::report(&report);
}
