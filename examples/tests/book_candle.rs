//! The Rust samples of the book's page "candle" (`docs/src/guides/candle.md`):
//! a cellc RNN as a candle layer. The page shows the lines between each
//! `ANCHOR: name` and `ANCHOR_END: name`; the assertions check what the
//! page says of them.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use cellc_candle::{Align, Major, Padding, Rnn};
use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::{CompiledCell, Model, ModelConfig, RuntimeError};
use charlm::paths::repo_root;
use std::error::Error;
use std::sync::Arc;

type Result<T = ()> = std::result::Result<T, Box<dyn Error>>;

/// The largest |a - b| / max(1, |b|) of two tensors of the same shape.
fn error(a: &Tensor, b: &Tensor) -> Result<f32> {
    let (a, b) = (a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
    assert_eq!(a.len(), b.len());
    Ok(a.iter().zip(&b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f32::max))
}

#[test]
fn an_rnn_layer_runs_trains_and_detaches() -> Result {
    // ANCHOR: layer
    // The runtime's model: cell, sizes, layers, back end. Its own weights are not used:
    // the layer's are candle Vars, made here by the VarMap from the cell's init clauses.
    let cell = Arc::new(CompiledCell::from_file(&repo_root().join("cells/lstm.cell"), None)?);
    let sizes = [("H".to_string(), 8)].into();
    let config = ModelConfig { layers: 1, bidirectional: false };
    let cpu = Arc::new(Cpu::new(2, Kernels::Fastest)?);
    let model = Model::new(cell, config, &sizes, Some(3), None, 1, Box::new(cpu.clone()))?;

    let device = Device::Cpu;
    let varmap = VarMap::new();
    let rnn = Rnn::new(model, VarBuilder::from_varmap(&varmap, DType::F32, &device).pp("rnn"))?;
    let mut names: Vec<String> = varmap.data().lock().expect("the VarMap").keys().cloned().collect();
    names.sort();
    assert_eq!(names, ["rnn.bias_hh_l0", "rnn.bias_ih_l0", "rnn.weight_hh_l0", "rnn.weight_ih_l0"]);
    // ANCHOR_END: layer

    // ANCHOR: forward
    // Four sequences of lengths 5, 2, 4 and 3 (unsorted), padded to 5 steps, batch-first.
    let lengths = [5, 2, 4, 3];
    let x = Var::randn(0f32, 1.0, (4, 5, 3), &device)?; // [B, T, I]: a Var, to see its gradient
    let out = rnn.forward(&x, &lengths, Padding::default())?; // [B, T, H], zeros at padding
    assert_eq!(out.dims(), [4, 5, 8]);
    // ANCHOR_END: forward
    let padding = out.get(1)?.narrow(0, 2, 3)?; // sequence 1 after its 2 steps
    assert_eq!(padding.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);

    // ANCHOR: states
    // Time-first, each sequence's steps at the end of the time axis; initial states given
    // (one tensor per state, h and c, [layers * directions, B, H] as nn.LSTM's h_0 and c_0).
    let time_first = Padding { major: Major::TimeFirst, align: Align::Right };
    let x_t = x.transpose(0, 1)?.contiguous()?; // [T, B, I]
    let h0 = [Tensor::zeros((1, 4, 8), DType::F32, &device)?, Tensor::zeros((1, 4, 8), DType::F32, &device)?];
    let (out_t, finals) = rnn.forward_with_states(&x_t, &lengths, time_first, Some(&h0))?;
    assert_eq!(out_t.dims(), [5, 4, 8]);
    // The final states: h and c after each sequence's last step.
    assert_eq!(finals[0].dims(), [1, 4, 8]);
    // ANCHOR_END: states
    // The longest sequence is not padded: its outputs are the same either way.
    assert!(error(&out_t.narrow(1, 0, 1)?.squeeze(1)?, &out.get(0)?)? < 1e-6);

    // ANCHOR: backward
    // The loss's gradient reaches every Var: the weights, and here the input.
    let loss = out.sqr()?.mean_all()?;
    let grads = loss.backward()?;
    for (name, weight) in rnn.weights() {
        let grad = grads.get(weight).ok_or(format!("no gradient for {name}"))?;
        assert_eq!(grad.dims(), weight.dims());
    }
    assert_eq!(grads.get(&x).map(|g| g.dims().to_vec()), Some(vec![4, 5, 3]));
    // ANCHOR_END: backward

    // ANCHOR: train
    // A few steps of candle-nn's AdamW on the VarMap's Vars, on cellc's threads
    // (candle's own tensor ops then run on the same threads as the RNN).
    let params = ParamsAdamW { lr: 0.01, ..Default::default() };
    let mut adam = AdamW::new(varmap.all_vars(), params)?;
    let losses = cpu.install(|| -> candle_core::Result<Vec<f32>> {
        let mut losses = Vec::new();
        for _ in 0..5 {
            let loss = rnn.forward(&x, &lengths, Padding::default())?.sqr()?.mean_all()?;
            adam.backward_step(&loss)?;
            losses.push(loss.to_scalar::<f32>()?);
        }
        Ok(losses)
    })?;
    assert!(losses[4] < losses[0]);
    // ANCHOR_END: train

    // ANCHOR: detach
    // Evaluation: the same weights, detached. Nothing is kept for a backward.
    let eval = rnn.detach();
    let x_eval = x.as_tensor().detach(); // x is a Var: detached too
    let y = eval.forward(&x_eval, &lengths, Padding::default())?;
    assert!(!y.track_op());
    // ANCHOR_END: detach
    assert!(error(&y, &rnn.forward(&x, &lengths, Padding::default())?)? == 0.0);

    // ANCHOR: save
    let path = std::env::temp_dir().join(format!("book_candle_{}.safetensors", std::process::id()));
    // rnn.weight_ih_l0, ...: PyTorch's names under the prefix "rnn".
    varmap.save(&path)?;
    // ANCHOR_END: save
    let saved = candle_core::safetensors::load(&path, &device)?;
    assert!(saved.contains_key("rnn.weight_hh_l0"));
    std::fs::remove_file(&path)?;
    Ok(())
}

#[test]
fn a_pytorch_state_dict_gives_pytorchs_outputs_and_gradients() -> Result {
    let device = Device::Cpu;
    let fixtures = repo_root().join("tests/fixtures/runtime");
    // ANCHOR: pytorch
    // The Vars made under PyTorch's names (no prefix), then an nn.LSTM(3, 4, num_layers=2,
    // bidirectional=True) state_dict loaded into them as it is.
    let cell = Arc::new(CompiledCell::from_file(&repo_root().join("cells/lstm.cell"), None)?);
    let config = ModelConfig { layers: 2, bidirectional: true };
    let sizes = [("H".to_string(), 4)].into();
    let model = Model::new(cell, config, &sizes, Some(3), None, 0, Box::new(Cpu::new(1, Kernels::Fastest)?))?;
    let mut varmap = VarMap::new();
    let rnn = Rnn::new(model, VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    varmap.load(fixtures.join("lstm_weights.safetensors"))?;
    // ANCHOR_END: pytorch

    // What PyTorch computed on a batch of 4 unsorted sequences, padded to 7 steps.
    let input = candle_core::safetensors::load(fixtures.join("lstm_left_input.safetensors"), &device)?;
    let expected = candle_core::safetensors::load(fixtures.join("lstm_left_expected.safetensors"), &device)?;
    let lengths: Vec<usize> = input["lengths"].to_vec1::<i64>()?.iter().map(|&n| n as usize).collect();
    let h0 = [input["h0.h"].clone(), input["h0.c"].clone()];
    let (out, finals) = rnn.forward_with_states(&input["input"], &lengths, Padding::default(), Some(&h0))?;
    assert!(error(&out, &expected["output"])? < 1e-5);
    assert!(error(&finals[0], &expected["final.h"])? < 1e-5);
    assert!(error(&finals[1], &expected["final.c"])? < 1e-5);

    // The same adjoints as PyTorch's backward: the weights' gradients agree.
    let loss = (out * &input["grad_output"])?.sum_all()?
        + (&finals[0] * &input["grad_final.h"])?.sum_all()?
        + (&finals[1] * &input["grad_final.c"])?.sum_all()?;
    let grads = loss?.backward()?;
    for (name, weight) in rnn.weights() {
        let grad = grads.get(weight).ok_or(format!("no gradient for {name}"))?;
        assert!(error(grad, &expected[&format!("grad.{name}")])? < 1e-4, "{name}");
    }
    Ok(())
}

#[test]
fn bad_input_is_a_typed_error() -> Result {
    let cell = Arc::new(CompiledCell::from_file(&repo_root().join("cells/lstm.cell"), None)?);
    let sizes = [("H".to_string(), 8)].into();
    let model = Model::new(
        cell,
        ModelConfig::default(),
        &sizes,
        Some(3),
        None,
        0,
        Box::new(Cpu::new(1, Kernels::Fastest)?),
    )?;
    let varmap = VarMap::new();
    let rnn = Rnn::new(model, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    let x = Tensor::zeros((2, 4, 3), DType::F32, &Device::Cpu)?;
    // ANCHOR: errors
    // A sequence longer than the padded steps: the runtime's error, checked before the op runs.
    let result = rnn.forward(&x, &[4, 6], Padding::default());
    let Err(cellc_candle::Error::Runtime(error)) = result else { panic!("a typed error") };
    assert!(matches!(error, RuntimeError::Length { sequence: 1, length: 6, steps: 4 }));
    assert_eq!(error.to_string(), "sequence 1 has length 6, longer than the 4 padded steps");
    // ANCHOR_END: errors
    Ok(())
}
