//! A cell's own masks (`dropout`, `variational_dropout`, `zoneout`,
//! `dropconnect` with its `rate`s; see `cellc::ir::masks`):
//!
//! - every back end draws exactly the masks `cellc::random` says, in every
//!   layout and at any thread count;
//! - evaluation is the identity (zoneout: the expectation), so the shipped
//!   cells with masks are their plain cells in evaluation, and at rates 0;
//! - AWD-LSTM's training pass is an LSTM's over the input and recurrent
//!   weight masked by hand, gradients included (through the masks);
//! - the training gradient of a zoneout LSTM matches central differences
//!   of the same call (same masks);
//! - rates are set per model and per call, and bad ones are typed errors.

mod support;

use cellc::random::{draw, kept, threshold, MaskStream, SHARED};
use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::cuda::Cuda;
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::{
    Align, BackwardOut, Call, CallOptions, CompiledCell, ForwardOut, Input, Major, MaskSeed, Model,
    ModelConfig, RuntimeError,
};
use std::sync::Arc;

const LENGTHS: [usize; 4] = [3, 5, 1, 4];
const STEPS: usize = 5;
const H: usize = 6;
const I: usize = 3;
const SEED: u64 = 23;

type MakeBackend = fn() -> Box<dyn Device>;

fn backends() -> Vec<(&'static str, MakeBackend)> {
    vec![
        ("reference", || Box::new(Reference)),
        ("cpu", || Box::new(Cpu::new(2, Kernels::default()).expect("cpu").split_every_step())),
        ("cpu, one thread", || Box::new(Cpu::new(1, Kernels::default()).expect("cpu"))),
        ("cuda (emulated device)", || Box::new(Cuda::emulated().expect("emulated device"))),
    ]
}

fn compile(source: &str) -> Arc<CompiledCell> {
    Arc::new(CompiledCell::from_source("test.cell", source, None).expect("compiles"))
}

fn shipped(name: &str) -> Arc<CompiledCell> {
    let path = support::root().join(format!("cells/{name}.cell"));
    Arc::new(CompiledCell::from_file(&path, None).expect("compiles"))
}

fn model(cell: Arc<CompiledCell>, input: usize, backend: Box<dyn Device>) -> Model {
    let sizes = [("H".to_string(), H)].into_iter().collect();
    let config = ModelConfig { layers: 1, bidirectional: false };
    Model::new(cell, config, &sizes, Some(input), None, SEED, backend).expect("model")
}

fn data(n: usize, seed: u64) -> Vec<f32> {
    support::Rng::new(seed).vec(n, 1.0).iter().map(|&v| v as f32).collect()
}

/// `[B, T, width]` batch-first rows, `align`ed.
fn padded(x: &[f32], align: Align) -> Input<'_> {
    Input::Padded { data: x, batch: 4, steps: STEPS, major: Major::BatchFirst, align, lengths: &LENGTHS }
}

/// Row `(b, t)` of a batch-first batch aligned `align`.
fn row(b: usize, t: usize, align: Align) -> usize {
    let shift = if align == Align::Right { STEPS - LENGTHS[b] } else { 0 };
    b * STEPS + t + shift
}

/// Unit `u` of mask `mask` of a first-layer forward pass at `seed`, for
/// sequence `b` at step `t` (`None`: shared over steps).
fn unit(seed: MaskSeed, mask: u32, rate: f32, (b, t, u): (usize, Option<usize>, usize)) -> bool {
    let key = MaskStream { seed: seed.seed, offset: seed.offset, layer: 0, direction: 0, mask }.key();
    kept(draw(key, b as u32, t.map_or(SHARED, |t| t as u32), u as u32), threshold(rate))
}

/// A call in training mode at `seed` over `x` (`[B, T, input]`), with its
/// output; no reserve (a training call needs none to drop).
fn training_output(m: &Model, x: &[f32], align: Align, seed: MaskSeed, rates: Option<&[f32]>) -> Vec<f32> {
    let mut output = vec![f32::NAN; 4 * STEPS * m.output_size()];
    let mut finals: Vec<Vec<f32>> = m.state_shapes(4).iter().map(|s| vec![0.0; s.iter().product()]).collect();
    let call = Call {
        options: CallOptions { masks: Some(seed), rates, ..Default::default() },
        ..Call::new(padded(x, align))
    };
    let out =
        ForwardOut { output: &mut output, final_states: finals.iter_mut().map(Vec::as_mut_slice).collect() };
    m.forward_into(&call, out, None).expect("forward_into");
    output
}

/// A one-layer, one-direction call over host memory with a reserve, then
/// its backward from `d_out`: the output, the input's gradient and the
/// parameters' gradients.
fn forward_backward(m: &Model, call: &Call, d_out: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
    let rows = 4 * STEPS;
    let mut output = vec![f32::NAN; rows * m.output_size()];
    let mut finals: Vec<Vec<f32>> = m.state_shapes(4).iter().map(|s| vec![0.0; s.iter().product()]).collect();
    let mut reserve = vec![f32::NAN; rows * m.reserve_floats_per_row()];
    let out =
        ForwardOut { output: &mut output, final_states: finals.iter_mut().map(Vec::as_mut_slice).collect() };
    m.forward_into(call, out, Some(&mut reserve)).expect("forward_into");
    let mut d_input = vec![f32::NAN; rows * m.input_size()];
    let mut d_params: Vec<Vec<f32>> = m.params(0, false).iter().map(|p| vec![f32::NAN; p.len()]).collect();
    let out = BackwardOut {
        d_input: &mut d_input,
        d_h0: Vec::new(),
        d_params: vec![d_params.iter_mut().map(Vec::as_mut_slice).collect()],
    };
    m.backward_from(call, &reserve, d_out, None, out).expect("backward_from");
    (output, d_input, d_params)
}

const MASKER: &str = "
cell masker {
    input x[H]
    state s[H]
    rate p = 0.3, q = 0.25, z = 0.4
    s' = zoneout(s, x, z)
    output concat(dropout(x, p), variational_dropout(x, q), s')
}";

#[test]
fn every_back_end_draws_the_masks_the_generator_says_in_every_layout() {
    let seed = MaskSeed { seed: 99, offset: 7 };
    let ones = vec![1.0f32; 4 * STEPS * H];
    for (name, backend) in backends() {
        let m = model(compile(MASKER), H, backend());
        for align in [Align::Left, Align::Right] {
            let got = training_output(&m, &ones, align, seed, None);
            for (b, &len) in LENGTHS.iter().enumerate() {
                let mut s = [0.0f32; H];
                for t in 0..len {
                    let out = &got[row(b, t, align) * 3 * H..][..3 * H];
                    for u in 0..H {
                        let scaled = |keep: bool, rate: f32| if keep { 1.0 / (1.0 - rate) } else { 0.0 };
                        // Masks are numbered in the order the cell's statements call them.
                        let dropout = scaled(unit(seed, 1, 0.3, (b, Some(t), u)), 0.3);
                        let variational = scaled(unit(seed, 2, 0.25, (b, None, u)), 0.25);
                        if unit(seed, 0, 0.4, (b, Some(t), u)) {
                            s[u] = 1.0;
                        }
                        let want = [dropout, variational, s[u]];
                        let have = [out[u], out[H + u], out[2 * H + u]];
                        assert_eq!(have, want, "{name}, {align:?}: sequence {b}, step {t}, unit {u}");
                    }
                }
            }
        }
        // A new offset, new masks; evaluation, none.
        let other = training_output(&m, &ones, Align::Left, MaskSeed { offset: 8, ..seed }, None);
        assert_ne!(other, training_output(&m, &ones, Align::Left, seed, None), "{name}");
        let eval = m.forward(padded(&ones, Align::Left), None).expect("forward");
        for (b, &len) in LENGTHS.iter().enumerate() {
            for t in 0..len {
                let out = &eval.data[row(b, t, Align::Left) * 3 * H..][..3 * H];
                // s' = 0.4 s + 0.6 x from s = 0: 1 - 0.4^(t+1), as f32 computes it.
                let mut s = 0.0f32;
                for _ in 0..=t {
                    s = (1.0 - 0.4f32) * 1.0 + 0.4 * s;
                }
                assert!(out[..2 * H].iter().all(|&v| v == 1.0), "{name}: evaluation dropped");
                assert!(out[2 * H..].iter().all(|&v| (v - s).abs() < 1e-6), "{name}: {out:?} vs {s}");
            }
        }
    }
}

#[test]
fn cells_with_masks_are_their_plain_cells_in_evaluation_and_at_rate_zero() {
    let x = data(4 * STEPS * I, 1);
    let seed = MaskSeed { seed: SEED, offset: 3 };
    for (masked, plain, zero) in [
        ("awd_lstm", "lstm", &[("weight_drop", 0.0), ("dropout_input", 0.0)][..]),
        ("gru_recurrent_dropout", "gru", &[("recurrent_dropout", 0.0)][..]),
        ("zoneout_lstm", "lstm", &[("zh", 0.0), ("zc", 0.0)][..]),
    ] {
        for (name, backend) in backends() {
            let with = model(shipped(masked), I, backend());
            let without = model(shipped(plain), I, backend());
            let want = without.forward(padded(&x, Align::Left), None).expect("forward");
            if masked != "zoneout_lstm" {
                let eval = with.forward(padded(&x, Align::Left), None).expect("forward");
                assert_eq!(eval, want, "{masked} on {name}: evaluation is not the plain cell");
            }
            let at_zero = with.with_rates(zero).expect("rates");
            assert_eq!(
                training_output(&at_zero, &x, Align::Left, seed, None),
                want.data,
                "{masked} on {name}: training at rate 0 is not the plain cell"
            );
        }
    }
}

#[test]
fn zoneout_in_evaluation_is_the_expectation_the_interpreter_computes() {
    let cell = shipped("zoneout_lstm");
    let x = data(4 * STEPS * I, 2);
    let reference = model(cell.clone(), I, Box::new(Reference));
    let sizes = [("I".to_string(), I), ("H".to_string(), H)].into_iter().collect();
    let bound = cell.forward.bind(&sizes).expect("binds");
    let params: Vec<Vec<f64>> =
        reference.params(0, false).iter().map(|p| p.iter().map(|&v| v as f64).collect()).collect();
    for (name, backend) in backends() {
        let m = model(cell.clone(), I, backend());
        let got = m.forward(padded(&x, Align::Left), None).expect("forward");
        for (b, &len) in LENGTHS.iter().enumerate() {
            let xs: Vec<f64> =
                (0..len).flat_map(|t| &x[row(b, t, Align::Left) * I..][..I]).map(|&v| v as f64).collect();
            let want = bound.run(&xs, &[vec![0.0; H], vec![0.0; H]], &params).expect("runs");
            for t in 0..len {
                for u in 0..H {
                    let (g, w) = (got.data[row(b, t, Align::Left) * H + u] as f64, want.outputs[t * H + u]);
                    assert!((g - w).abs() < 1e-5, "{name}: sequence {b} step {t} unit {u}: {g} vs {w}");
                }
            }
        }
    }
}

#[test]
fn awd_lstm_training_is_an_lstm_over_the_input_and_recurrent_weight_masked_by_hand() {
    let (drop_w, drop_x) = (0.3f32, 0.4f32);
    let rates = [("weight_drop", drop_w), ("dropout_input", drop_x)];
    let seed = MaskSeed { seed: SEED, offset: 11 };
    let x = data(4 * STEPS * I, 3);
    let d_out = data(4 * STEPS * H, 4);
    for (name, backend) in backends() {
        let awd = model(shipped("awd_lstm"), I, backend()).with_rates(&rates).expect("rates");
        let weights: Vec<Vec<f32>> = awd.params(0, false).to_vec();
        // By hand: the recurrent weight (param 1) and each sequence's input masked.
        let w_mask: Vec<f32> = (0..weights[1].len())
            .map(|u| {
                let key =
                    MaskStream { seed: seed.seed, offset: seed.offset, layer: 0, direction: 0, mask: 1 }
                        .key();
                if kept(draw(key, SHARED, SHARED, u as u32), threshold(drop_w)) {
                    1.0 / (1.0 - drop_w)
                } else {
                    0.0
                }
            })
            .collect();
        let x_mask = |b: usize, u: usize| {
            if unit(seed, 0, drop_x, (b, None, u)) {
                1.0 / (1.0 - drop_x)
            } else {
                0.0
            }
        };
        let mut lstm = model(shipped("lstm"), I, backend());
        let mut masked_weights = weights.clone();
        masked_weights[1].iter_mut().zip(&w_mask).for_each(|(w, m)| *w *= m);
        lstm.params_mut()[0] = masked_weights;
        let mut x_masked = x.clone();
        for (b, &len) in LENGTHS.iter().enumerate() {
            for t in 0..len {
                for u in 0..I {
                    x_masked[row(b, t, Align::Left) * I + u] *= x_mask(b, u);
                }
            }
        }
        let (want, trace) = lstm.forward_train(padded(&x_masked, Align::Left), None).expect("forward");
        let want_g = lstm.backward(&trace, &d_out, None).expect("backward");

        // The call: forward and backward through the caller's memory, the same seed.
        let w: Vec<Vec<&[f32]>> = vec![weights.iter().map(Vec::as_slice).collect()];
        let call = Call {
            weights: Some(&w),
            options: CallOptions { masks: Some(seed), ..Default::default() },
            ..Call::new(padded(&x, Align::Left))
        };
        let (output, d_input, d_params) = forward_backward(&awd, &call, &d_out);

        let close = |a: &[f32], b: &[f32], what: &str| {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{name}: {what}[{i}]: {x} vs {y}");
            }
        };
        close(&output, &want.data, "output");
        // Through the masks: d x = d x~ * m, d W_hh = d W~ * M.
        let mut want_dx = want_g.d_input.clone();
        for (b, &len) in LENGTHS.iter().enumerate() {
            for t in 0..len {
                for u in 0..I {
                    want_dx[row(b, t, Align::Left) * I + u] *= x_mask(b, u);
                }
            }
        }
        close(&d_input, &want_dx, "d_input");
        let mut want_dw = want_g.d_params[0][1].clone();
        want_dw.iter_mut().zip(&w_mask).for_each(|(g, m)| *g *= m);
        close(&d_params[1], &want_dw, "d_weight_hh");
        for p in [0, 2, 3] {
            close(&d_params[p], &want_g.d_params[0][p], "d_params");
        }
        assert!(w_mask.contains(&0.0) && output != training_output(&lstm, &x, Align::Left, seed, None));
    }
}

#[test]
fn a_zoneout_lstms_training_gradient_matches_central_differences_of_the_same_call() {
    let seed = MaskSeed { seed: SEED, offset: 5 };
    let x = data(4 * STEPS * I, 5);
    let d_out = data(4 * STEPS * H, 6);
    let rates = [("zh", 0.3), ("zc", 0.5)];
    let m = model(shipped("zoneout_lstm"), I, Box::new(Reference)).with_rates(&rates).expect("rates");
    let weights: Vec<Vec<f32>> = m.params(0, false).to_vec();
    let loss = |w: &[Vec<f32>]| -> f64 {
        let slices: Vec<Vec<&[f32]>> = vec![w.iter().map(Vec::as_slice).collect()];
        let call = Call {
            weights: Some(&slices),
            options: CallOptions { masks: Some(seed), ..Default::default() },
            ..Call::new(padded(&x, Align::Left))
        };
        let mut output = vec![0.0; 4 * STEPS * H];
        let mut finals: Vec<Vec<f32>> = (0..2).map(|_| vec![0.0; 4 * H]).collect();
        let out = ForwardOut {
            output: &mut output,
            final_states: finals.iter_mut().map(Vec::as_mut_slice).collect(),
        };
        m.forward_into(&call, out, None).expect("forward");
        output.iter().zip(&d_out).map(|(&y, &g)| y as f64 * g as f64).sum()
    };
    let slices: Vec<Vec<&[f32]>> = vec![weights.iter().map(Vec::as_slice).collect()];
    let call = Call {
        weights: Some(&slices),
        options: CallOptions { masks: Some(seed), ..Default::default() },
        ..Call::new(padded(&x, Align::Left))
    };
    let (_, _, d_params) = forward_backward(&m, &call, &d_out);
    let eps = 1e-2f32;
    let mut checked = 0;
    for (p, grad) in d_params.iter().enumerate() {
        for i in (0..grad.len()).step_by(7) {
            let mut plus = weights.clone();
            plus[p][i] += eps;
            let mut minus = weights.clone();
            minus[p][i] -= eps;
            let fd = (loss(&plus) - loss(&minus)) / (2.0 * eps as f64);
            let g = grad[i] as f64;
            assert!(
                (fd - g).abs() <= 2e-3 + 1e-2 * g.abs(),
                "param {p}[{i}]: backward {g}, differences {fd}"
            );
            checked += 1;
        }
    }
    assert!(checked > 20);
}

#[test]
fn rates_are_set_per_model_and_per_call_and_bad_ones_are_typed_errors() {
    let m = model(shipped("zoneout_lstm"), I, Box::new(Reference));
    assert_eq!(m.rate_names(), ["zh", "zc"]);
    assert_eq!(m.rates(), [0.1, 0.1]);
    let m = m.with_rates(&[("zc", 0.25)]).expect("rates");
    assert_eq!(m.rates(), [0.1, 0.25]);
    assert_eq!(m.rates_with(&[("zh", 0.5)]).expect("rates"), [0.5, 0.25]);
    let e = model(shipped("zoneout_lstm"), I, Box::new(Reference)).with_rates(&[("zo", 0.1)]).unwrap_err();
    assert!(matches!(e, RuntimeError::Rate { ref name, .. } if name == "zo"), "{e}");
    assert!(e.to_string().contains("`zh`, `zc`"), "{e}");
    for bad in [1.0, -0.5, f32::NAN] {
        let e = m.rates_with(&[("zh", bad)]).unwrap_err();
        assert!(e.to_string().contains("[0, 1)"), "{e}");
    }
    // By name, in any order; a name twice is refused.
    assert_eq!(m.rates_with(&[("zc", 0.3), ("zh", 0.2)]).expect("rates"), [0.2, 0.3]);
    let e = m.rates_with(&[("zh", 0.2), ("zh", 0.3)]).unwrap_err();
    assert!(e.to_string().contains("`zh`") && e.to_string().contains("twice"), "{e}");
    // A call's own rates: one per rate, checked; they change the masks.
    let x = data(4 * STEPS * I, 7);
    let seed = MaskSeed { seed: 1, offset: 0 };
    let own = training_output(&m, &x, Align::Left, seed, None);
    assert_eq!(training_output(&m, &x, Align::Left, seed, Some(&[0.1, 0.25])), own);
    assert_ne!(training_output(&m, &x, Align::Left, seed, Some(&[0.6, 0.25])), own);
    let mut output = vec![0.0; 4 * STEPS * H];
    let mut finals: Vec<Vec<f32>> = (0..2).map(|_| vec![0.0; 4 * H]).collect();
    for (rates, needle) in [(&[0.1f32][..], "rates"), (&[0.1, 1.5][..], "[0, 1)")] {
        let call = Call {
            options: CallOptions { masks: Some(seed), rates: Some(rates), ..Default::default() },
            ..Call::new(padded(&x, Align::Left))
        };
        let out = ForwardOut {
            output: &mut output,
            final_states: finals.iter_mut().map(Vec::as_mut_slice).collect(),
        };
        let e = m.forward_into(&call, out, None).unwrap_err();
        assert!(e.to_string().contains(needle), "{e}");
    }
}

#[test]
fn kept_fractions_match_the_rates_and_masks_are_uncorrelated_across_sequences_steps_and_calls() {
    // 64 sequences of 50 steps, H = 64: enough units for tight bounds.
    let sizes = [("H".to_string(), 64)].into_iter().collect();
    let config = ModelConfig { layers: 1, bidirectional: false };
    let m = Model::new(compile(MASKER), config, &sizes, Some(64), None, SEED, Box::new(Reference))
        .expect("model");
    let (batch, steps) = (64, 50);
    let x = vec![0.0f32; batch * steps * 64];
    let lengths = vec![steps; batch];
    let input = Input::Padded {
        data: &x,
        batch,
        steps,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &lengths,
    };
    let seen = |offset: u64| m.cell_masks(input, Some(MaskSeed { seed: 5, offset }), None).expect("masks");
    let (first, second) = (seen(0), seen(1));
    let rates = [("zoneout#0_l0", 0.4), ("dropout#1_l0", 0.3), ("variational_dropout#2_l0", 0.25)];
    for (name, rate) in rates {
        let mask = &first.iter().find(|s| s.name == name).expect("mask").values;
        let kept = mask.iter().filter(|&&v| v != 0.0).count() as f64;
        // A per-sequence mask has batch * units independent units; the others every one.
        let n = if name.starts_with("variational") { (batch * 64) as f64 } else { mask.len() as f64 };
        let fraction = if name.starts_with("variational") { kept / steps as f64 / n } else { kept / n };
        let sigma = (rate * (1.0 - rate) / n).sqrt();
        assert!(
            (fraction - (1.0 - rate)).abs() < 5.0 * sigma,
            "{name}: kept {fraction}, expected {}",
            1.0 - rate
        );
    }
    // Pearson correlation of the keep indicators of two slices of a mask.
    let correlation = |a: &[f32], b: &[f32]| {
        let (a, b): (Vec<f64>, Vec<f64>) =
            a.iter().zip(b).map(|(&x, &y)| ((x != 0.0) as u8 as f64, (y != 0.0) as u8 as f64)).unzip();
        let n = a.len() as f64;
        let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
        let cov: f64 = a.iter().zip(&b).map(|(x, y)| (x - ma) * (y - mb)).sum::<f64>() / n;
        let sd = |v: &[f64], m: f64| (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n).sqrt();
        cov / (sd(&a, ma) * sd(&b, mb))
    };
    let dropout = &first.iter().find(|s| s.name == "dropout#1_l0").expect("mask").values;
    let other_call = &second.iter().find(|s| s.name == "dropout#1_l0").expect("mask").values;
    let row = |b: usize, t: usize| &dropout[(b * steps + t) * 64..][..64];
    let across_sequences: Vec<f32> = (0..batch / 2).flat_map(|b| row(2 * b, 3).to_vec()).collect();
    let next_sequences: Vec<f32> = (0..batch / 2).flat_map(|b| row(2 * b + 1, 3).to_vec()).collect();
    let this_step: Vec<f32> = (0..steps - 1).flat_map(|t| row(7, t).to_vec()).collect();
    let next_step: Vec<f32> = (1..steps).flat_map(|t| row(7, t).to_vec()).collect();
    // Bound: 5 / sqrt(n) for n pairs, far above chance for independent draws.
    for (what, a, b) in [
        ("neighbouring sequences", &across_sequences[..], &next_sequences[..]),
        ("consecutive steps", &this_step[..], &next_step[..]),
        ("consecutive calls", &dropout[..], &other_call[..]),
    ] {
        let r = correlation(a, b);
        assert!(r.abs() < 5.0 / (a.len() as f64).sqrt(), "{what}: correlation {r}");
    }
    assert_ne!(dropout, other_call);
}

/// The caller's device memory (the emulated device, whose memory is the
/// host's) draws the masks its call's seed says, as host memory does:
/// every shipped cell with masks (DropConnect's parameter and gradient
/// masked on the device), training, forward and backward.
#[test]
fn device_memory_draws_what_host_memory_draws() {
    use cellc_runtime::{DeviceBackwardOut, DeviceCall, DeviceFloats, DeviceForwardOut};
    let seed = MaskSeed { seed: 3, offset: 9 };
    for name in ["zoneout_lstm", "awd_lstm", "gru_recurrent_dropout"] {
        let m = model(shipped(name), I, Box::new(Cuda::emulated().expect("emulated device")));
        let host = model(shipped(name), I, Box::new(Cpu::new(2, Kernels::default()).expect("cpu")));
        let x = data(4 * STEPS * I, 8);
        let d_out = data(4 * STEPS * H, 9);
        let mut weights: Vec<Vec<f32>> = m.params(0, false).to_vec();
        let rows = 4 * STEPS;
        let states = m.state_shapes(4);
        let want = {
            let w: Vec<Vec<&[f32]>> = vec![weights.iter().map(Vec::as_slice).collect()];
            let call = Call {
                weights: Some(&w),
                options: CallOptions { masks: Some(seed), ..Default::default() },
                ..Call::new(padded(&x, Align::Right))
            };
            forward_backward(&host, &call, &d_out)
        };
        let (at, at_mut) = (DeviceFloats::emulated, DeviceFloats::emulated_mut);
        let (shape, input) = padded(&x, Align::Right).split();
        let w: Vec<Vec<DeviceFloats>> = vec![weights.iter_mut().map(|p| at_mut(p)).collect()];
        let call = DeviceCall {
            shape,
            input: at(input),
            weights: &w,
            h0: None,
            stream: 0,
            options: CallOptions { masks: Some(seed), ..Default::default() },
        };
        let mut output = vec![f32::NAN; rows * H];
        let mut finals: Vec<Vec<f32>> = states.iter().map(|s| vec![0.0; s.iter().product()]).collect();
        let mut reserve = vec![f32::NAN; rows * m.reserve_floats_per_row()];
        let out = DeviceForwardOut {
            output: at_mut(&mut output),
            final_states: finals.iter_mut().map(|s| at_mut(s)).collect(),
        };
        let reserve = at_mut(&mut reserve);
        m.forward_into(&call, &out, Some(reserve)).expect("device forward");
        let mut d_input = vec![f32::NAN; rows * I];
        let mut d_params: Vec<Vec<f32>> = want.2.iter().map(|p| vec![f32::NAN; p.len()]).collect();
        let out = DeviceBackwardOut {
            d_input: at_mut(&mut d_input),
            d_h0: Vec::new(),
            d_params: vec![d_params.iter_mut().map(|p| at_mut(p)).collect()],
        };
        m.backward_from(&call, reserve, at(&d_out), None, &out).expect("device backward");
        let close = |a: &[f32], b: &[f32], what: &str| {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!((x - y).abs() <= 2e-5 * (1.0 + y.abs()), "{name}: {what}[{i}]: {x} vs {y}");
            }
        };
        close(&output, &want.0, "output");
        close(&d_input, &want.1, "d_input");
        for (p, (g, w)) in d_params.iter().zip(&want.2).enumerate() {
            close(g, w, &format!("d_param {p}"));
        }
    }
}
