//! Dropout between layers ([`Model::with_dropout`], PyTorch's
//! `nn.LSTM(dropout=p)`): a two-layer bidirectional LSTM trained with
//! dropout gives exactly what two one-layer models give with the masks
//! applied between them by hand from `cellc::random` (forward and every
//! gradient), on the reference, CPU and emulated CUDA back ends, by the
//! model's own passes and over the caller's host and device memory;
//! inference and calls in evaluation mode (no masks) never drop, a call in
//! training mode drops with or without a reserve; the masks a call used
//! can be seen (`Model::dropout_masks`); bad rates are typed errors.

mod support;

use cellc::random::{draw, kept, threshold, MaskStream};
use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::cuda::Cuda;
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::dropout::BETWEEN_LAYERS;
use cellc_runtime::{
    Align, BackwardOut, Call, CallOptions, CompiledCell, DeviceBackwardOut, DeviceCall, DeviceFloats,
    DeviceForwardOut, ForwardOut, Input, Major, MaskSeed, Model, ModelConfig, RuntimeError,
};
use std::sync::Arc;

const LENGTHS: [usize; 4] = [3, 5, 1, 5];
const STEPS: usize = 6;
const H: usize = 4;
const I: usize = 3;
const RATE: f32 = 0.4;
const SEED: u64 = 17;

fn lstm() -> Arc<CompiledCell> {
    Arc::new(CompiledCell::from_file(&support::root().join("cells/lstm.cell"), None).expect("compiles"))
}

fn model(layers: usize, input: usize, backend: Box<dyn Device>) -> Model {
    let sizes = [("H".to_string(), H)].into_iter().collect();
    let config = ModelConfig { layers, bidirectional: true };
    Model::new(lstm(), config, &sizes, Some(input), None, SEED, backend).expect("model")
}

fn data(n: usize, seed: u64) -> Vec<f32> {
    support::Rng::new(seed).vec(n, 1.0).iter().map(|&v| v as f32).collect()
}

fn padded(x: &[f32]) -> Input<'_> {
    Input::Padded {
        data: x,
        batch: 4,
        steps: STEPS,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &LENGTHS,
    }
}

/// Multiplies each valid row of `rows` (`[B, T, 2H]`, batch-first, left
/// aligned) by the masks of layer 0's output that `seed` draws.
fn apply_masks(rows: &mut [f32], seed: MaskSeed) {
    let t = threshold(RATE);
    let scale = 1.0 / (1.0 - RATE);
    for (b, &len) in LENGTHS.iter().enumerate() {
        for step in 0..len {
            for d in 0..2 {
                let stream = MaskStream {
                    seed: seed.seed,
                    offset: seed.offset,
                    layer: 0,
                    direction: d,
                    mask: BETWEEN_LAYERS,
                };
                let key = stream.key();
                for u in 0..H {
                    let m = if kept(draw(key, b as u32, step as u32, u as u32), t) { scale } else { 0.0 };
                    rows[(b * STEPS + step) * 2 * H + d as usize * H + u] *= m;
                }
            }
        }
    }
}

/// What a training forward and its backward give.
#[derive(Debug, PartialEq)]
struct Trained {
    output: Vec<f32>,
    d_input: Vec<f32>,
    /// `[slot][param]`, both layers.
    d_params: Vec<Vec<Vec<f32>>>,
}

/// The two-layer model's training pass (its first: masks at offset 0).
fn two_layers(backend: Box<dyn Device>, x: &[f32], d_out: &[f32]) -> Trained {
    let m = model(2, I, backend).with_dropout(RATE).expect("rate");
    let (out, trace) = m.forward_train(padded(x), None).expect("forward");
    let g = m.backward(&trace, d_out, None).expect("backward");
    Trained { output: out.data, d_input: g.d_input, d_params: g.d_params }
}

/// The same by hand: layer 0, the masks, layer 1; backwards through the
/// masks again.
fn by_hand(backend: impl Fn() -> Box<dyn Device>, x: &[f32], d_out: &[f32]) -> Trained {
    let whole = model(2, I, backend());
    let mut first = model(1, I, backend());
    let mut second = model(1, 2 * H, backend());
    for d in 0..2 {
        first.params_mut()[d] = whole.params(0, d == 1).to_vec();
        second.params_mut()[d] = whole.params(1, d == 1).to_vec();
    }
    let seed = MaskSeed { seed: SEED, offset: 0 };
    let (y0, trace0) = first.forward_train(padded(x), None).expect("layer 0");
    let mut y0 = y0.data;
    apply_masks(&mut y0, seed);
    let (y1, trace1) = second.forward_train(padded(&y0), None).expect("layer 1");
    let g1 = second.backward(&trace1, d_out, None).expect("layer 1 backward");
    let mut d_y0 = g1.d_input;
    apply_masks(&mut d_y0, seed);
    let g0 = first.backward(&trace0, &d_y0, None).expect("layer 0 backward");
    let d_params = g0.d_params.into_iter().chain(g1.d_params).collect();
    Trained { output: y1.data, d_input: g0.d_input, d_params }
}

/// Makes a fresh back end.
type MakeBackend = fn() -> Box<dyn Device>;

fn backends() -> Vec<(&'static str, MakeBackend)> {
    vec![
        ("reference", || Box::new(Reference)),
        ("cpu", || Box::new(Cpu::new(2, Kernels::default()).expect("cpu").split_every_step())),
        ("cuda (emulated device)", || Box::new(Cuda::emulated().expect("emulated device"))),
    ]
}

#[test]
fn training_drops_between_layers_as_two_one_layer_models_with_the_masks_would() {
    let x = data(4 * STEPS * I, 1);
    let d_out = data(4 * STEPS * 2 * H, 2);
    for (name, backend) in backends() {
        let got = two_layers(backend(), &x, &d_out);
        let want = by_hand(backend, &x, &d_out);
        assert_eq!(got, want, "{name}");
        // The masks drop about RATE of layer 0's units: the two differ from no dropout.
        let plain = model(2, I, backend());
        let (out, _) = plain.forward_train(padded(&x), None).expect("forward");
        assert_ne!(out.data, got.output, "{name}: dropout changed nothing");
    }
}

#[test]
fn inference_never_drops_and_each_training_call_draws_new_masks() {
    let x = data(4 * STEPS * I, 3);
    let plain = model(2, I, Box::new(Reference));
    let dropping = model(2, I, Box::new(Reference)).with_dropout(0.5).expect("rate");
    assert_eq!(
        dropping.forward(padded(&x), None).expect("forward"),
        plain.forward(padded(&x), None).expect("forward")
    );
    let (first, _) = dropping.forward_train(padded(&x), None).expect("forward");
    let (second, _) = dropping.forward_train(padded(&x), None).expect("forward");
    assert_ne!(first.data, second.data, "the second call drew the first call's masks");
}

#[test]
fn the_callers_memory_draws_the_masks_its_seed_says_on_host_and_device() {
    let x = data(4 * STEPS * I, 4);
    let d_out = data(4 * STEPS * 2 * H, 5);
    let seed = MaskSeed { seed: SEED, offset: 0 };
    for (name, backend) in backends() {
        let want = two_layers(backend(), &x, &d_out);
        let m = model(2, I, backend()).with_dropout(RATE).expect("rate");
        let mut weights: Vec<Vec<Vec<f32>>> = (0..4).map(|s| m.params(s / 2, s % 2 == 1).to_vec()).collect();
        let rows = 4 * STEPS;
        let mut output = vec![f32::NAN; rows * 2 * H];
        let mut finals: Vec<Vec<f32>> = (0..2).map(|_| vec![f32::NAN; 4 * 4 * H]).collect();
        let mut reserve = vec![f32::NAN; rows * m.reserve_floats_per_row()];
        let mut d_input = vec![f32::NAN; rows * I];
        let mut d_params: Vec<Vec<Vec<f32>>> =
            weights.iter().map(|ps| ps.iter().map(|p| vec![f32::NAN; p.len()]).collect()).collect();
        if name.starts_with("cuda") {
            // The emulated device's memory is the host's: its addresses are pointers.
            let (at, at_mut) = (DeviceFloats::emulated, DeviceFloats::emulated_mut);
            let (shape, data) = padded(&x).split();
            let w: Vec<Vec<DeviceFloats>> =
                weights.iter_mut().map(|ps| ps.iter_mut().map(|p| at_mut(p)).collect()).collect();
            let call = DeviceCall {
                shape,
                input: at(data),
                weights: &w,
                h0: None,
                stream: 0,
                options: CallOptions { masks: Some(seed), ..Default::default() },
            };
            let out = DeviceForwardOut {
                output: at_mut(&mut output),
                final_states: finals.iter_mut().map(|s| at_mut(s)).collect(),
            };
            let reserve = at_mut(&mut reserve);
            m.forward_into(&call, &out, Some(reserve)).expect("forward_into");
            let out = DeviceBackwardOut {
                d_input: at_mut(&mut d_input),
                d_h0: Vec::new(),
                d_params: d_params.iter_mut().map(|ps| ps.iter_mut().map(|p| at_mut(p)).collect()).collect(),
            };
            m.backward_from(&call, reserve, at(&d_out), None, &out).expect("backward_from");
        } else {
            let w: Vec<Vec<&[f32]>> =
                weights.iter().map(|ps| ps.iter().map(Vec::as_slice).collect()).collect();
            let call = Call {
                weights: Some(&w),
                options: CallOptions { masks: Some(seed), ..Default::default() },
                ..Call::new(padded(&x))
            };
            let out = ForwardOut {
                output: &mut output,
                final_states: finals.iter_mut().map(Vec::as_mut_slice).collect(),
            };
            m.forward_into(&call, out, Some(&mut reserve)).expect("forward_into");
            let out = BackwardOut {
                d_input: &mut d_input,
                d_h0: Vec::new(),
                d_params: d_params
                    .iter_mut()
                    .map(|ps| ps.iter_mut().map(Vec::as_mut_slice).collect())
                    .collect(),
            };
            m.backward_from(&call, &reserve, &d_out, None, out).expect("backward_from");
        }
        assert_eq!(Trained { output, d_input, d_params }, want, "{name}");
    }
}

#[test]
fn bad_rates_are_typed_errors_and_a_call_without_masks_drops_nothing() {
    for rate in [1.0, -0.1, f32::NAN, 2.0] {
        let e = model(2, I, Box::new(Reference)).with_dropout(rate).unwrap_err();
        assert!(matches!(e, RuntimeError::Rate { ref name, .. } if name == "dropout"), "{rate}: {e}");
        assert!(e.to_string().contains("[0, 1)"), "{e}");
    }
    let m = model(2, I, Box::new(Reference)).with_dropout(0.2).expect("rate");
    let x = data(4 * STEPS * I, 6);
    let mut output = vec![0.0; 4 * STEPS * 2 * H];
    let mut finals: Vec<Vec<f32>> = (0..2).map(|_| vec![0.0; 4 * 4 * H]).collect();
    let mut reserve = vec![0.0; 4 * STEPS * m.reserve_floats_per_row()];
    // Evaluation mode (no masks), with a reserve (gradients in evaluation mode) or without.
    let call = Call::new(padded(&x));
    let want = m.forward(padded(&x), None).expect("inference").data;
    for reserve in [Some(&mut reserve[..]), None] {
        let finals = finals.iter_mut().map(Vec::as_mut_slice).collect();
        m.forward_into(&call, ForwardOut { output: &mut output, final_states: finals }, reserve)
            .expect("evaluation");
        assert_eq!(output, want);
    }
    // Training mode without a reserve (no gradients) drops as a training forward does.
    let (trained, _) = m.forward_train(padded(&x), None).expect("training");
    let training = Call {
        options: CallOptions { masks: Some(MaskSeed { seed: SEED, offset: 0 }), ..Default::default() },
        ..call
    };
    let finals = finals.iter_mut().map(Vec::as_mut_slice).collect();
    m.forward_into(&training, ForwardOut { output: &mut output, final_states: finals }, None)
        .expect("training");
    assert_eq!(output, trained.data);
}

#[test]
fn the_masks_a_call_used_can_be_seen() {
    let m = model(3, I, Box::new(Reference)).with_dropout(RATE).expect("rate");
    let x = data(4 * STEPS * I, 7);
    let seed = MaskSeed { seed: SEED, offset: 0 };
    let masks = m.dropout_masks(padded(&x), seed, None).expect("masks");
    assert_eq!(masks.len(), 2, "one per layer boundary");
    let mut want = vec![0.0f32; 4 * STEPS * 2 * H];
    for (b, &len) in LENGTHS.iter().enumerate() {
        want[b * STEPS * 2 * H..(b * STEPS + len) * 2 * H].fill(1.0);
    }
    apply_masks(&mut want, seed);
    assert_eq!(masks[0], want, "layer 0's masks, as drawn by hand");
    assert_ne!(masks[1], masks[0], "each layer draws its own");
    let plain = model(3, I, Box::new(Reference));
    assert!(plain.dropout_masks(padded(&x), seed, None).expect("masks").is_empty());
}
