//! bf16 products ([`Precision::Bf16`]) on every shipped cell: outputs,
//! final states and every gradient of a 2-layer (bidirectional where the
//! cell allows) model over an unsorted variable-length batch, against the
//! f64 interpreter run on each sequence alone.
//!
//! Each tensor's norm-wise relative error `‖x − x₆₄‖ / ‖x₆₄‖` must be within
//! 1e-2, or within four times the error of bf16 arithmetic itself: the
//! interpreter in f64 with only the same products' operands rounded to bf16
//! ([`oracle_in`]). Two kinds of cell exceed 1e-2 there whoever computes
//! them: a recurrence that amplifies every perturbation (layernorm_lstm,
//! whose normalised cell state is carried: its f32 error grows with the
//! length too), and ReLU cells' gradients (rounding moves pre-activations
//! near zero across the kink, and with them whole terms of the gradient).
//! The table of errors (the back end's in bf16, bf16 arithmetic's, the
//! f32 back end's) is printed and kept in the verification log.

mod support;

use cellc::fuzzgen::Entropy;
use cellc_difftest::batch::{Batch, LaidOut, Layout};
use cellc_difftest::oracle::{oracle_in, Oracle};
use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::{CallOptions, Model, Precision};

const LENGTHS: [usize; 4] = [24, 7, 40, 1];
const STEPS: usize = 40;
const TOLERANCE: f64 = 1e-2;

/// `‖a − b‖₂ / ‖b‖₂` (0 for two zero tensors).
fn relative(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| y * y).sum();
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}

/// Each tensor's relative error of `model`'s forward and backward on `batch`, by name.
fn errors(model: &Model, batch: &Batch, want: &Oracle) -> Vec<(String, f64)> {
    let layout = Layout::Padded { batch_first: true, right_aligned: true };
    let (fin, fout) = (model.input_size(), model.output_size());
    let x = LaidOut::inputs(batch, layout, fin).expect("lays out");
    let dy: Vec<f32> = batch
        .lay_out(layout, &batch.d_out, fout)
        .expect("lays out")
        .iter()
        .map(|v| if v.is_nan() { 0.0 } else { *v })
        .collect();
    let (out, trace) =
        model.forward_traced(x.input(batch), Some(&batch.h0), &CallOptions::default()).expect("forward");
    let grads = model.backward(&trace, &dy, Some(&batch.d_final)).expect("backward");
    let at = batch.row_layout(layout).expect("layout");
    let gather = |data: &[f32], width: usize| -> Vec<f32> {
        (0..batch.lengths.len())
            .flat_map(|b| (0..batch.lengths[b]).map(move |t| (b, t)))
            .flat_map(|(b, t)| data[at.row(b, t) * width..][..width].to_vec())
            .collect()
    };
    let flat = |rows: &[Vec<Vec<f64>>]| -> Vec<f64> { rows.iter().flatten().flatten().copied().collect() };
    let mut all = vec![
        ("output".to_string(), relative(&gather(&out.data, fout), &flat(&want.out))),
        ("d_input".to_string(), relative(&gather(&grads.d_input, fin), &flat(&want.d_in))),
    ];
    for (i, (got, w)) in out.final_states.iter().zip(&want.finals).enumerate() {
        all.push((format!("final state {i}"), relative(got, w)));
    }
    for (i, (got, w)) in grads.d_h0.iter().zip(&want.d_h0).enumerate() {
        all.push((format!("d_h0 {i}"), relative(got, w)));
    }
    let names = model.compiled().forward.params.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
    for (slot, (got, w)) in grads.d_params.iter().zip(&want.d_params).enumerate() {
        for (p, (a, b)) in got.iter().zip(w).enumerate() {
            all.push((
                format!(
                    "d_{} (layer {}, direction {})",
                    names[p],
                    slot / model.directions(),
                    slot % model.directions()
                ),
                relative(a, b),
            ));
        }
    }
    all
}

/// The relative error of each tensor of `ideal` against `want`, in [`errors`]' order.
fn ideal_errors(ideal: &Oracle, want: &Oracle) -> Vec<(String, f64)> {
    let flat = |rows: &[Vec<Vec<f64>>]| -> Vec<f64> { rows.iter().flatten().flatten().copied().collect() };
    let rel = |a: &[f64], b: &[f64]| relative(&a.iter().map(|&x| x as f32).collect::<Vec<_>>(), b);
    let mut all = vec![
        ("output".to_string(), rel(&flat(&ideal.out), &flat(&want.out))),
        ("d_input".to_string(), rel(&flat(&ideal.d_in), &flat(&want.d_in))),
    ];
    all.extend(ideal.finals.iter().zip(&want.finals).map(|(a, b)| ("final state".to_string(), rel(a, b))));
    all.extend(ideal.d_h0.iter().zip(&want.d_h0).map(|(a, b)| ("d_h0".to_string(), rel(a, b))));
    for (got, w) in ideal.d_params.iter().zip(&want.d_params) {
        all.extend(got.iter().zip(w).map(|(a, b)| ("d_param".to_string(), rel(a, b))));
    }
    all
}

#[test]
fn bf16_products_are_as_accurate_as_bf16_arithmetic_on_every_shipped_cell() {
    let cpu = || -> Box<dyn cellc_runtime::backend::Device> {
        Box::new(Cpu::new(2, Kernels::Fastest).expect("cpu"))
    };
    let kernel = cellc_runtime::backend::cpu::bf16::Bf16Kernel::detect();
    support::report(&format!(
        "bf16 accuracy (norm-wise relative error against the f64 interpreter; H=64, input 48, 2 layers, \
         lengths {LENGTHS:?}; bf16 kernel {kernel:?}):"
    ));
    support::report(
        "| cell | bf16 outputs | bf16 gradients (worst) | bf16 arithmetic: outputs | gradients | f32 outputs | f32 gradients |",
    );
    support::report("|---|---|---|---|---|---|---|");
    let mut failures = Vec::new();
    for cell in support::compiled_cells() {
        let bf16 = support::two_layer_model(&cell, (64, 32, 48), 5, &cpu)
            .with_precision(Precision::Bf16)
            .expect("bf16");
        let f32 = support::two_layer_model(&cell, (64, 32, 48), 5, &cpu);
        let ld = bf16.layers().len() * bf16.directions();
        let states = bf16.layers()[0].state_sizes.clone();
        let mut rng = Entropy::seeded(17);
        let batch =
            Batch::random(&mut rng, &LENGTHS, STEPS, (bf16.input_size(), bf16.output_size()), &states, ld);
        let want = oracle_in(&bf16, &batch, Precision::F32).expect("the interpreter runs every sequence");
        let ideal = oracle_in(&bf16, &batch, Precision::Bf16).expect("the interpreter runs every sequence");
        let (low, full) = (errors(&bf16, &batch, &want), errors(&f32, &batch, &want));
        let arithmetic = ideal_errors(&ideal, &want);
        let split = |e: &[(String, f64)]| -> (f64, (String, f64)) {
            let forward = e
                .iter()
                .filter(|(n, _)| n == "output" || n.starts_with("final"))
                .map(|e| e.1)
                .fold(0.0, f64::max);
            let backward =
                e.iter().filter(|(n, _)| n.starts_with("d_")).max_by(|a, b| a.1.total_cmp(&b.1)).cloned();
            (forward, backward.unwrap_or_default())
        };
        let ((lf, lb), (af, ab), (ff, fb)) = (split(&low), split(&arithmetic), split(&full));
        support::report(&format!(
            "| {} | {lf:.1e} | {:.1e} ({}) | {af:.1e} | {:.1e} | {ff:.1e} | {:.1e} |",
            cell.forward.name, lb.1, lb.0, ab.1, fb.1
        ));
        for ((name, e), (_, bound)) in low.iter().zip(&arithmetic) {
            // A NaN error fails too.
            if e.is_nan() || *e > TOLERANCE.max(4.0 * bound) {
                failures
                    .push(format!("{}: {name}: {e:.3e} (bf16 arithmetic: {bound:.3e})", cell.forward.name));
            }
        }
    }
    assert!(failures.is_empty(), "bf16 errors over {TOLERANCE}: {failures:#?}");
}

/// A NaN in one sequence's input reaches that sequence's outputs from its
/// step on (a 2-layer model one way), in bf16 as in f32, and no other
/// sequence's; an infinity saturates the gates in both alike.
#[test]
fn nan_and_infinity_propagate_in_bf16_as_in_f32() {
    use cellc_runtime::{Align, Input, Major};
    let cell = support::compiled_cells().into_iter().find(|c| c.forward.name == "lstm").expect("lstm ships");
    let cpu = || -> Box<dyn cellc_runtime::backend::Device> {
        Box::new(Cpu::new(2, Kernels::Fastest).expect("cpu"))
    };
    let (batch, steps, features) = (3, 5, 48);
    let lengths = [5, 4, 5];
    for poison in [f32::NAN, f32::INFINITY] {
        let mut finite_by_precision = Vec::new();
        for precision in [Precision::F32, Precision::Bf16] {
            let config = cellc_runtime::ModelConfig { layers: 2, bidirectional: false };
            let model = support::try_model(&cell, (16, 8, features), &config, 3, cpu()).expect("stacks");
            let model = model.with_precision(precision).expect("f32 and bf16 products");
            let mut x: Vec<f32> = (0..batch * steps * features).map(|i| (i as f32 * 0.37).sin()).collect();
            x[(5 + 2) * features + 7] = poison; // sequence 1, step 2 (batch-first)
            let input = Input::Padded {
                data: &x,
                batch,
                steps,
                major: Major::BatchFirst,
                align: Align::Left,
                lengths: &lengths,
            };
            let out = model.forward(input, None).expect("forward");
            let o = model.output_size();
            let finite: Vec<bool> = out.data.chunks(o).map(|row| row.iter().all(|v| v.is_finite())).collect();
            finite_by_precision.push(finite);
        }
        assert_eq!(finite_by_precision[0], finite_by_precision[1], "{poison}: bf16 and f32 differ");
        let finite = &finite_by_precision[0];
        // Sequence 1 (rows 5..10): steps 0 and 1 finite. A NaN makes its steps from 2
        // on NaN (step 4 is padding, zeros); an infinity saturates the gates, and
        // every output stays finite. Every other sequence stays finite.
        let poisoned = poison.is_nan();
        assert!(
            finite[5] && finite[6] && finite[7] != poisoned && finite[8] != poisoned,
            "{poison}: {finite:?}"
        );
        assert!(finite[..5].iter().chain(&finite[10..]).all(|&f| f), "{poison}: {finite:?}");
    }
}

/// The CUDA back end's bf16, fp16 and TF32 products (cuBLAS's
/// `CUBLAS_COMPUTE_32F_FAST_16BF`, `_16F` and `_TF32` on a GPU; here the
/// emulated device, which rounds the same operands) are as accurate as
/// bf16, fp16 or TF32 arithmetic, through the passes in device memory, and
/// are theirs, not f32's.
#[test]
fn cuda_half_precision_products_on_the_emulated_device_are_that_arithmetic() {
    use cellc_runtime::backend::cuda::Cuda;
    if !cellc_runtime::backend::cuda::device::gxx_available() {
        eprintln!("skipped: no g++ for the emulated device");
        return;
    }
    let cuda = || -> Box<dyn cellc_runtime::backend::Device> {
        Box::new(Cuda::emulated().expect("emulated device"))
    };
    let lengths = [6, 2, 5];
    let cells = support::compiled_cells();
    // The sLSTM's heads: tiles of the step loop's tensor-core products
    // whose columns span two heads take the element-wise route.
    let cells = cells.iter().filter(|c| ["lstm", "gru", "slstm"].contains(&c.forward.name.as_str()));
    for (cell, precision) in
        cells.flat_map(|c| [Precision::Bf16, Precision::F16, Precision::Tf32].map(|p| (c, p)))
    {
        let mut half = support::two_layer_model(cell, (16, 8, 12), 5, &cuda);
        let mut f32 = support::two_layer_model(cell, (16, 8, 12), 5, &cuda);
        draw_zero_parameters(&mut half);
        draw_zero_parameters(&mut f32);
        let half = half.with_precision(precision).expect("half");
        let ld = half.layers().len() * half.directions();
        let states = half.layers()[0].state_sizes.clone();
        let mut rng = Entropy::seeded(23);
        let shape = (half.input_size(), half.output_size());
        let batch = Batch::random(&mut rng, &lengths, 6, shape, &states, ld);
        let want = oracle_in(&half, &batch, Precision::F32).expect("the interpreter runs every sequence");
        let ideal = oracle_in(&half, &batch, precision).expect("the interpreter runs every sequence");
        let (low, full) = (errors(&half, &batch, &want), errors(&f32, &batch, &want));
        let bounds = ideal_errors(&ideal, &want);
        let worst = |errors: &[(String, f64)]| errors.iter().map(|(_, e)| *e).fold(0.0, f64::max);
        eprintln!(
            "emulated CUDA, {} in {precision}: worst relative error {:.1e} ({precision} arithmetic {:.1e}, f32 {:.1e})",
            cell.forward.name,
            worst(&low),
            worst(&bounds),
            worst(&full)
        );
        for (((name, e), (_, bound)), (_, e32)) in low.iter().zip(&bounds).zip(&full) {
            let cell = &cell.forward.name;
            assert!(
                !e.is_nan() && *e <= TOLERANCE.max(4.0 * bound),
                "{cell} in {precision}: {name}: {e:.3e} ({precision} arithmetic: {bound:.3e})"
            );
            assert!(
                *e > 10.0 * e32 || *bound == 0.0,
                "{cell}: {name}: {e:.3e}, f32's {e32:.3e}: not {precision} products"
            );
        }
    }
}

/// Gives every parameter that starts at zero (the sLSTM's recurrent
/// kernel) values in [-0.5, 0.5), the same on every call, so that its
/// products count.
fn draw_zero_parameters(model: &mut Model) {
    for (i, p) in model.params_mut().iter_mut().flatten().enumerate() {
        if p.iter().all(|&w| w == 0.0) {
            let mut rng = Entropy::seeded(100 + i as u64);
            p.iter_mut().for_each(|w| *w = rng.below(1024) as f32 / 1024.0 - 0.5);
        }
    }
}

/// fp16 and TF32 products are the CUDA back end's: the CPU, which has no
/// unit that multiplies fp16 or TF32 pairs into f32 sums, refuses them by
/// name, for a model and for one call.
#[test]
fn the_cpu_refuses_fp16_and_tf32_products_by_name() {
    let cell = support::compiled_cells().into_iter().find(|c| c.forward.name == "lstm").expect("lstm ships");
    let cpu = || -> Box<dyn cellc_runtime::backend::Device> {
        Box::new(Cpu::new(1, Kernels::Fastest).expect("cpu"))
    };
    let model = support::two_layer_model(&cell, (8, 4, 6), 5, &cpu);
    let x = vec![0.5f32; 2 * 3 * 6];
    let input = cellc_runtime::Input::Padded {
        data: &x,
        batch: 2,
        steps: 3,
        major: cellc_runtime::Major::BatchFirst,
        align: cellc_runtime::Align::Left,
        lengths: &[3, 2],
    };
    for (precision, name) in [(Precision::F16, "fp16"), (Precision::Tf32, "TF32")] {
        let options = CallOptions { precision: Some(precision), ..Default::default() };
        let e = model.forward_with(input, None, &options).unwrap_err();
        let text = e.to_string();
        assert!(text.contains(name) && text.contains("cuda"), "{text}");
        let e = support::two_layer_model(&cell, (8, 4, 6), 5, &cpu).with_precision(precision).unwrap_err();
        let text = e.to_string();
        assert!(text.contains(name) && text.contains("cuda"), "{text}");
    }
}

/// A call's precision is its own: one model's calls alternate between f32
/// and bf16 products, each giving the bits of a model made for that
/// precision (its prepared weights are kept per precision, never mixed),
/// and its training passes' gradients follow the forward's precision.
#[test]
fn a_call_asks_for_its_own_precision() {
    use cellc_runtime::{Align, Input, Major};
    let cell = support::compiled_cells().into_iter().find(|c| c.forward.name == "lstm").expect("lstm ships");
    let cpu = || -> Box<dyn cellc_runtime::backend::Device> {
        Box::new(Cpu::new(2, Kernels::Fastest).expect("cpu"))
    };
    let model = support::two_layer_model(&cell, (32, 16, 24), 5, &cpu);
    let bf16_model =
        support::two_layer_model(&cell, (32, 16, 24), 5, &cpu).with_precision(Precision::Bf16).expect("bf16");
    assert_eq!((model.precision(), bf16_model.precision()), (Precision::F32, Precision::Bf16));
    let x: Vec<f32> = (0..3 * 7 * 24).map(|i| (i as f32 * 0.37).sin()).collect();
    let input = Input::Padded {
        data: &x,
        batch: 3,
        steps: 7,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &[7, 3, 5],
    };
    let bf16 = CallOptions { precision: Some(Precision::Bf16), ..Default::default() };
    let f32_call = CallOptions { precision: Some(Precision::F32), ..Default::default() };
    let want_f32 = model.forward(input, None).expect("f32");
    let want_bf16 = bf16_model.forward(input, None).expect("bf16 model");
    assert_ne!(want_f32.data, want_bf16.data, "bf16 products differ from f32 ones");
    for _ in 0..2 {
        assert_eq!(model.forward_with(input, None, &bf16).expect("bf16 call").data, want_bf16.data);
        assert_eq!(model.forward(input, None).expect("f32 again").data, want_f32.data);
        assert_eq!(bf16_model.forward_with(input, None, &f32_call).expect("f32 call").data, want_f32.data);
    }
    let d_out: Vec<f32> = want_f32.data.iter().map(|v| v * 0.5 + 0.1).collect();
    let (out, trace) = model.forward_traced(input, None, &bf16).expect("bf16 traced");
    let (out_b, trace_b) =
        bf16_model.forward_traced(input, None, &CallOptions::default()).expect("bf16 model traced");
    assert_eq!(out.data, out_b.data);
    let grads = model.backward(&trace, &d_out, None).expect("bf16 backward");
    let grads_b = bf16_model.backward(&trace_b, &d_out, None).expect("bf16 model backward");
    assert_eq!(grads, grads_b, "the backward follows its forward's precision");
}
