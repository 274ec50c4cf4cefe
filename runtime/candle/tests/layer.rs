//! The candle layer against the runtime's oracle: on every shipped cell
//! it gives the reference back end's output, final states and gradients
//! (input, initial states, every weight) through candle's autograd, padded
//! either way round; a PyTorch `state_dict` loads through `VarBuilder`;
//! finite differences agree through candle's graph; bad input gets typed
//! errors.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use cellc::dims::Bindings;
use cellc_candle::{Align, Major, Padding, Rnn};
use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device as RnnDevice;
use cellc_runtime::{CallOptions, CompiledCell, Input, Model, ModelConfig, RuntimeError, Weights};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const LENGTHS: [usize; 4] = [3, 6, 1, 5];
const STEPS: usize = 6;
const INPUT: usize = 5;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn cell(name: &str) -> Arc<CompiledCell> {
    let path = repo().join("cells").join(format!("{name}.cell"));
    Arc::new(CompiledCell::from_file(&path, None).expect("a shipped cell"))
}

fn model(cell: Arc<CompiledCell>, layers: usize, bidirectional: bool, backend: Box<dyn RnnDevice>) -> Model {
    // H and P, and D (the sLSTM cells' head size; dropped where a cell has none).
    let sizes: Bindings =
        [("H", 4), ("P", 3), ("D", 2)].into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let config = ModelConfig { layers, bidirectional };
    // INPUT features, or what the sizes give where the cell ties them (sru's `x[H]`).
    let input = cell.forward.input_dim().eval(&sizes).map_or(INPUT, |n| n as usize);
    Model::new(cell, config, &sizes, Some(input), None, 7, backend).expect("model")
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{what}[{i}]: candle {x}, reference {y}");
    }
}

/// `x` as the 4-sequence batch of [`LENGTHS`], batch-first, left aligned.
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

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().and_then(|t| t.to_vec1()).expect("f32 values")
}

/// The layer on the CPU back end, driven by candle's autograd, against
/// the reference back end's own passes with the same weights.
/// With `resets`, some steps restart their sequence's state (and the
/// oracle is given the same flags).
fn agrees_with_reference(name: &str, layers: usize, bidirectional: bool, padding: Padding, resets: bool) {
    let compiled = cell(name);
    let oracle = model(compiled.clone(), layers, bidirectional, Box::new(Reference));
    let cpu = model(
        compiled,
        layers,
        bidirectional,
        Box::new(Cpu::new(2, Kernels::Jit).expect("cpu").split_every_step()),
    );
    let varmap = VarMap::new();
    let rnn = Rnn::new(cpu, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).expect("layer");
    // A fresh VarMap starts from the model's own (seeded) weights.
    assert_eq!(varmap.all_vars().len(), oracle.weight_names().len());
    for (name, t) in rnn.weights() {
        let own = oracle.weights().get(name).expect("named as the model's").data.clone();
        assert_eq!(flat(t), own, "{name} starts as the model's weight");
    }

    let batch = LENGTHS.len();
    let features = oracle.input_size();
    let dims = match padding.major {
        Major::BatchFirst => (batch, STEPS, features),
        Major::TimeFirst => (STEPS, batch, features),
    };
    let x_data = values(batch * STEPS * features, 1);
    let x = Var::from_tensor(&Tensor::from_vec(x_data.clone(), dims, &Device::Cpu).expect("x")).expect("var");
    let slots = layers * (1 + usize::from(bidirectional));
    let sizes = oracle.layers()[0].state_sizes.clone();
    let h0_data: Vec<Vec<f32>> =
        sizes.iter().enumerate().map(|(i, &n)| values(slots * batch * n, 10 + i as u64)).collect();
    let h0: Vec<Var> = h0_data
        .iter()
        .zip(&sizes)
        .map(|(d, &n)| {
            Var::from_tensor(&Tensor::from_vec(d.clone(), (slots, batch, n), &Device::Cpu).expect("h0"))
                .expect("var")
        })
        .collect();
    let h0_tensors: Vec<Tensor> = h0.iter().map(|v| v.as_tensor().clone()).collect();
    // Training mode, as the oracle's `forward_train`: a cell with masks draws
    // them alike in both (two models made with one seed, each its first call).
    let flags: Vec<bool> = (0..batch * STEPS).map(|r| resets && r % 5 == 2).collect();
    let (out, finals) = match resets {
        true => rnn.forward_with_resets_t(&x, &LENGTHS, padding, Some(&h0_tensors), &flags, true),
        false => rnn.forward_with_states_t(&x, &LENGTHS, padding, Some(&h0_tensors), true),
    }
    .expect("forward");

    // A loss that weighs every output and final state differently.
    let r_out = Tensor::from_vec(values(out.elem_count(), 3), out.shape(), &Device::Cpu).expect("r");
    let mut loss = (&out * &r_out).and_then(|t| t.sum_all()).expect("loss");
    let r_finals: Vec<Tensor> = finals
        .iter()
        .enumerate()
        .map(|(i, f)| {
            Tensor::from_vec(values(f.elem_count(), 20 + i as u64), f.shape(), &Device::Cpu).expect("r")
        })
        .collect();
    for (f, r) in finals.iter().zip(&r_finals) {
        loss = (loss + (f * r).and_then(|t| t.sum_all()).expect("term")).expect("sum");
    }
    let grads = loss.backward().expect("backward");

    let input = Input::Padded {
        data: &x_data,
        batch,
        steps: STEPS,
        major: padding.major,
        align: padding.align,
        lengths: &LENGTHS,
    };
    let seed = Some(oracle.next_mask_seed());
    let flags = resets.then_some(&flags[..]);
    let options = CallOptions { masks: seed, resets: flags, ..Default::default() };
    let (expected, trace) = oracle.forward_traced(input, Some(&h0_data), &options).expect("oracle forward");
    close(&format!("{name} output"), &flat(&out), &expected.data, 1e-5);
    for (i, (f, e)) in finals.iter().zip(&expected.final_states).enumerate() {
        close(&format!("{name} final state {i}"), &flat(f), e, 1e-5);
    }
    let d_final: Vec<Vec<f32>> = r_finals.iter().map(flat).collect();
    let g = oracle.backward(&trace, &flat(&r_out), Some(&d_final)).expect("oracle backward");
    close(&format!("{name} d_input"), &flat(grads.get(&x).expect("input gradient")), &g.d_input, 1e-4);
    for (i, (v, e)) in h0.iter().zip(&g.d_h0).enumerate() {
        close(&format!("{name} d_h0[{i}]"), &flat(grads.get(v).expect("h0 gradient")), e, 1e-4);
    }
    for ((wname, w), e) in rnn.weights().iter().zip(g.d_params.iter().flatten()) {
        close(&format!("{name} d_{wname}"), &flat(grads.get(w).expect("weight gradient")), e, 1e-4);
    }
}

#[test]
fn every_shipped_cell_agrees_with_the_reference_back_end() {
    let mut cells: Vec<String> = std::fs::read_dir(repo().join("cells"))
        .expect("cells/")
        .filter_map(|e| {
            let path = e.ok()?.path();
            (path.extension()? == "cell").then(|| path.file_stem()?.to_str().map(str::to_string))?
        })
        .filter(|n| n != "prelude")
        .collect();
    cells.sort();
    assert!(cells.len() >= 10, "{cells:?}");
    for name in &cells {
        agrees_with_reference(name, 1, false, Padding::default(), false);
    }
}

#[test]
fn layers_directions_paddings_and_resets_agree_with_the_reference_back_end() {
    for name in ["lstm", "gru", "layernorm_lstm"] {
        agrees_with_reference(name, 2, true, Padding { major: Major::TimeFirst, align: Align::Right }, false);
        agrees_with_reference(
            name,
            2,
            false,
            Padding { major: Major::BatchFirst, align: Align::Right },
            false,
        );
        agrees_with_reference(name, 1, true, Padding { major: Major::TimeFirst, align: Align::Left }, false);
        // Per-step resets, through candle's autograd.
        agrees_with_reference(name, 2, true, Padding { major: Major::BatchFirst, align: Align::Right }, true);
    }
}

#[test]
fn a_pytorch_state_dict_loads_through_var_builder() {
    // examples/pytorch/charlm_lstm.safetensors: an nn.LSTM's state_dict under `rnn.`.
    let path = repo().join("examples/pytorch/charlm_lstm.safetensors");
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu) }.expect("file");
    let sizes: Bindings = [("H".to_string(), 128)].into_iter().collect();
    let config = ModelConfig { layers: 1, bidirectional: false };
    let build = |weights: Option<&Weights>| {
        Model::new(cell("lstm"), config.clone(), &sizes, Some(64), weights, 0, Box::new(Reference))
            .expect("model")
    };
    let rnn = Rnn::new(build(None), vb.pp("rnn")).expect("loads");
    let (weights, _) = Weights::load_with_metadata(&path).expect("file");
    let mut own = Weights::default();
    for (name, _) in rnn.weights() {
        let t = weights.get(&format!("rnn.{name}")).expect("in the file");
        own.insert(name.clone(), t.shape.clone(), t.data.clone());
        assert_eq!(flat(&rnn.weights().iter().find(|(n, _)| n == name).expect("weight").1), t.data);
    }
    let loaded = build(Some(&own));
    let x_data = values(3 * 4 * 64, 5);
    let lengths = [4, 2, 3];
    let x = Tensor::from_vec(x_data.clone(), (3, 4, 64), &Device::Cpu).expect("x");
    let out = rnn.forward(&x, &lengths, Padding::default()).expect("forward");
    let input = Input::Padded {
        data: &x_data,
        batch: 3,
        steps: 4,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &lengths,
    };
    close("output", &flat(&out), &loaded.forward(input, None).expect("forward").data, 1e-6);
}

#[test]
fn gradients_match_finite_differences_through_candle() {
    // A cell of the test's own: multiplicative integration (Wu et al. 2016).
    let source = "cell mi_rnn {
        input x[I]
        state h[H]
        param w[H, I], u[H, H], alpha[H] = ones, beta[H] = ones, b[H] = zeros
        h' = tanh(alpha * (w @ x) * (u @ h) + beta * (w @ x) + beta * (u @ h) + b)
        output h'
    }";
    let compiled = Arc::new(CompiledCell::from_source("mi_rnn.cell", source, None).expect("compiles"));
    let m = model(compiled, 1, false, Box::new(Cpu::new(1, Kernels::Jit).expect("cpu")));
    let varmap = VarMap::new();
    let rnn = Rnn::new(m, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).expect("layer");
    let lengths = [3, 1, 2];
    let x = Tensor::from_vec(values(3 * 3 * INPUT, 8), (3, 3, INPUT), &Device::Cpu).expect("x");
    let r = Tensor::from_vec(values(3 * 3 * 4, 9), (3, 3, 4), &Device::Cpu).expect("r");
    let loss = |rnn: &Rnn| -> f64 {
        let out = rnn.forward(&x, &lengths, Padding::default()).expect("forward");
        f64::from((out * &r).and_then(|t| t.sum_all()).and_then(|t| t.to_scalar::<f32>()).expect("loss"))
    };
    let out = rnn.forward(&x, &lengths, Padding::default()).expect("forward");
    let grads = (out * &r).and_then(|t| t.sum_all()).and_then(|l| l.backward()).expect("backward");
    let eps = 1e-2f32;
    for var in varmap.all_vars() {
        let analytic = flat(grads.get(var.as_tensor()).expect("gradient"));
        let original = flat(var.as_tensor());
        for i in 0..original.len() {
            let mut shifted = original.clone();
            shifted[i] = original[i] + eps;
            var.set(&Tensor::from_vec(shifted.clone(), var.shape(), &Device::Cpu).expect("t")).expect("set");
            let plus = loss(&rnn);
            shifted[i] = original[i] - eps;
            var.set(&Tensor::from_vec(shifted, var.shape(), &Device::Cpu).expect("t")).expect("set");
            let minus = loss(&rnn);
            var.set(&Tensor::from_vec(original.clone(), var.shape(), &Device::Cpu).expect("t")).expect("set");
            let numeric = (plus - minus) / (2.0 * f64::from(eps));
            let a = f64::from(analytic[i]);
            assert!(
                (a - numeric).abs() <= 2e-3 + 2e-2 * numeric.abs(),
                "element {i}: analytic {a}, numeric {numeric}"
            );
        }
    }
}

#[test]
fn a_detached_layer_tracks_nothing() {
    let varmap = VarMap::new();
    let m = model(cell("gru"), 1, false, Box::new(Cpu::new(1, Kernels::Jit).expect("cpu")));
    let rnn = Rnn::new(m, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).expect("layer");
    let x = Tensor::from_vec(values(2 * 3 * INPUT, 4), (2, 3, INPUT), &Device::Cpu).expect("x");
    let tracked = rnn.forward(&x, &[3, 2], Padding::default()).expect("forward");
    let detached = rnn.detach().forward(&x, &[3, 2], Padding::default()).expect("forward");
    assert!(tracked.track_op() && !detached.track_op());
    assert_eq!(flat(&tracked), flat(&detached));
}

/// The runtime's error of a failed call.
fn runtime_error(e: cellc_candle::Error) -> RuntimeError {
    let text = e.to_string();
    match e {
        cellc_candle::Error::Runtime(e) => e,
        cellc_candle::Error::Candle(_) => RuntimeError::Internal(format!("not a runtime error: {text}")),
    }
}

#[test]
fn bad_input_gets_typed_errors() {
    let varmap = VarMap::new();
    let m = model(cell("lstm"), 1, false, Box::new(Cpu::new(1, Kernels::Jit).expect("cpu")));
    let rnn = Rnn::new(m, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).expect("layer");
    let x = Tensor::zeros((2, 3, INPUT), DType::F32, &Device::Cpu).expect("x");

    let e = runtime_error(rnn.forward(&x, &[3, 4], Padding::default()).expect_err("too long"));
    assert!(matches!(e, RuntimeError::Length { sequence: 1, .. }), "{e}");
    let e = runtime_error(rnn.forward(&x, &[3], Padding::default()).expect_err("one length"));
    assert!(e.to_string().contains("length"), "{e}");
    let flat_x = Tensor::zeros((6, INPUT), DType::F32, &Device::Cpu).expect("x");
    let e = runtime_error(rnn.forward(&flat_x, &[3, 3], Padding::default()).expect_err("rank 2"));
    assert!(matches!(&e, RuntimeError::Shape { tensor, .. } if tensor == "input"), "{e}");
    let wide = Tensor::zeros((2, 3, INPUT + 1), DType::F32, &Device::Cpu).expect("x");
    let e = runtime_error(rnn.forward(&wide, &[3, 3], Padding::default()).expect_err("features"));
    assert!(e.to_string().contains("input"), "{e}");
    let h0 = [Tensor::zeros((1, 2, 4), DType::F32, &Device::Cpu).expect("h")];
    let e = runtime_error(
        rnn.forward_with_states(&x, &[3, 3], Padding::default(), Some(&h0)).expect_err("one state"),
    );
    assert!(matches!(&e, RuntimeError::Shape { tensor, .. } if tensor == "h0"), "{e}");
    let double = x.to_dtype(DType::F64).expect("f64");
    let e = runtime_error(rnn.forward(&double, &[3, 3], Padding::default()).expect_err("f64"));
    assert!(matches!(&e, RuntimeError::Shape { tensor, .. } if tensor == "input"), "{e}");
}

/// The model's dropout between layers: `forward` (evaluation) drops
/// nothing; `forward_t(.., true)` drops as the runtime's own training pass
/// of a model made alike (the same seed, its first call), and its gradient
/// flows through the same masks; each training call draws new ones.
#[test]
fn forward_t_drops_between_layers_as_the_runtime_does() {
    let cpu = || -> Box<dyn RnnDevice> { Box::new(Cpu::new(2, Kernels::default()).expect("cpu")) };
    let dropping = || model(cell("lstm"), 2, true, cpu()).with_dropout(0.4).expect("rate");
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let rnn = Rnn::new(dropping(), vb).expect("layer");
    let twin = dropping();
    let plain = model(cell("lstm"), 2, true, cpu());
    let x_data = values(4 * STEPS * INPUT, 3);
    let x = Var::from_vec(x_data.clone(), (4, STEPS, INPUT), &Device::Cpu).expect("x");
    let padded = padded(&x_data);
    let evaluation = rnn.forward(&x, &LENGTHS, Padding::default()).expect("forward");
    assert_eq!(flat(&evaluation), plain.forward(padded, None).expect("forward").data);
    let trained = rnn.forward_t(&x, &LENGTHS, Padding::default(), true).expect("forward_t");
    let (want, trace) = twin.forward_train(padded, None).expect("forward_train");
    assert_eq!(flat(&trained), want.data);
    let d_out = values(want.data.len(), 4);
    let grads = trained
        .mul(&Tensor::from_vec(d_out.clone(), trained.dims(), &Device::Cpu).expect("d_out"))
        .and_then(|t| t.sum_all())
        .and_then(|t| t.backward())
        .expect("backward");
    let want_grads = twin.backward(&trace, &d_out, None).expect("backward");
    assert_eq!(flat(grads.get(&x).expect("d_input")), want_grads.d_input);
    let again = rnn.forward_t(&x, &LENGTHS, Padding::default(), true).expect("forward_t");
    assert_ne!(flat(&again), flat(&trained), "a second call drew the first call's masks");
}

/// A cell's own masks (`zoneout_lstm`): `forward_t(.., true)` draws them
/// at the layer's rates ([`Rnn::with_rates`]) as the runtime's own training
/// pass of the same model does; evaluation takes zoneout's expectation at
/// those rates; bad rates are typed errors.
#[test]
fn forward_t_draws_the_cells_masks_at_the_layers_rates() {
    let cpu = || -> Box<dyn RnnDevice> { Box::new(Cpu::new(2, Kernels::default()).expect("cpu")) };
    let rates = [("zh", 0.3), ("zc", 0.2)];
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let rnn = Rnn::new(model(cell("zoneout_lstm"), 1, false, cpu()), vb).expect("layer");
    let rnn = rnn.with_rates(&rates).expect("rates");
    assert_eq!(rnn.rates(), [0.3, 0.2]);
    let twin = model(cell("zoneout_lstm"), 1, false, cpu()).with_rates(&rates).expect("rates");
    let x_data = values(4 * STEPS * INPUT, 5);
    let x = Var::from_vec(x_data.clone(), (4, STEPS, INPUT), &Device::Cpu).expect("x");
    let padded = padded(&x_data);
    let evaluation = rnn.forward(&x, &LENGTHS, Padding::default()).expect("forward");
    assert_eq!(flat(&evaluation), twin.forward(padded, None).expect("forward").data);
    let trained = rnn.forward_t(&x, &LENGTHS, Padding::default(), true).expect("forward_t");
    let (want, _) = twin.forward_train(padded, None).expect("forward_train");
    assert_eq!(flat(&trained), want.data);
    assert_ne!(flat(&trained), flat(&evaluation));
    let e = runtime_error(rnn.clone().with_rates(&[("zq", 0.1)]).expect_err("unknown rate"));
    assert!(matches!(&e, RuntimeError::Rate { name, .. } if name == "zq"), "{e}");
}

#[test]
fn half_precision_inputs_run_in_f32_and_come_back_in_their_dtype() {
    let compiled = cell("lstm");
    let cpu = model(compiled, 1, false, Box::new(Cpu::new(1, Kernels::Jit).expect("cpu")));
    let varmap = VarMap::new();
    let rnn = Rnn::new(cpu, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).expect("layer");
    let x32 = Tensor::from_vec(values(4 * STEPS * INPUT, 5), (4, STEPS, INPUT), &Device::Cpu).expect("x");
    for dtype in [DType::BF16, DType::F16] {
        let x = Var::from_tensor(&x32.to_dtype(dtype).expect("cast")).expect("var");
        let out = rnn.forward(&x, &LENGTHS, Padding::default()).expect("forward");
        assert_eq!(out.dtype(), dtype);
        let exact =
            rnn.forward(&x.to_dtype(DType::F32).expect("f32"), &LENGTHS, Padding::default()).expect("f32");
        let got = flat(&out.to_dtype(DType::F32).expect("f32"));
        close("half output", &got, &flat(&exact), 1e-2);
        let grads =
            out.to_dtype(DType::F32).and_then(|o| o.sum_all()).and_then(|l| l.backward()).expect("backward");
        assert_eq!(grads.get(&x).expect("input gradient").dtype(), dtype);
    }
}
