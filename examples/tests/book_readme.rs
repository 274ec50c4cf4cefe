//! The README's Rust and candle samples, run: the README shows the lines between each
//! `ANCHOR` pair, and `runtime/cli/tests/book.rs` checks that it shows them unchanged.

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use cellc_candle::{Padding, Rnn};
use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::{Align, CompiledCell, Input, Major, Model, ModelConfig};
use charlm::paths::repo_root;
use std::error::Error;
use std::sync::Arc;

/// Tests run in their crate's folder; the samples read the repository's `cells/`.
fn in_repo_root() {
    std::env::set_current_dir(repo_root()).expect("repository root");
}

#[test]
fn readme_rust() -> Result<(), Box<dyn Error>> {
    in_repo_root();
    let x: Vec<f32> = (0..3 * 50 * 64).map(|i| (i as f32 * 0.1).sin()).collect();
    // ANCHOR: rust
    let cell = Arc::new(CompiledCell::from_file("cells/lstm.cell".as_ref(), None)?);
    let sizes = [("H".to_string(), 128)].into();
    let config = ModelConfig { layers: 2, bidirectional: true };
    let model =
        Model::new(cell, config, &sizes, Some(64), None, 0, Box::new(Cpu::new(0, Kernels::Fastest)?))?;
    let lengths = [50, 7, 31]; // unsorted, padded: no packing, no copies
    let input = Input::Padded {
        data: &x,
        batch: 3,
        steps: 50,
        major: Major::BatchFirst,
        align: Align::Right,
        lengths: &lengths,
    };
    let (out, tape) = model.forward_train(input, None)?; // out.data: [3, 50, 2 * 128]
    let grads = model.backward(&tape, &out.data, None)?; // d_input, d_h0, d_params
                                                         // ANCHOR_END: rust
    assert_eq!(out.data.len(), 3 * 50 * 256);
    assert_eq!(grads.d_params.len(), 4, "two layers, two directions");
    Ok(())
}

#[test]
fn readme_candle() -> Result<(), Box<dyn Error>> {
    in_repo_root();
    let cell = Arc::new(CompiledCell::from_file("cells/gru.cell".as_ref(), None)?);
    let sizes = [("H".to_string(), 128)].into();
    let config = ModelConfig { layers: 1, bidirectional: false };
    let model =
        Model::new(cell, config, &sizes, Some(64), None, 0, Box::new(Cpu::new(0, Kernels::Fastest)?))?;
    // ANCHOR: candle
    let varmap = VarMap::new(); // or VarBuilder::from_mmaped_safetensors: a PyTorch state_dict
    let rnn = Rnn::new(model, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("rnn"))?;
    let x = Tensor::randn(0f32, 1., (16, 40, 64), &Device::Cpu)?; // [B, T, I], padded
    let lengths: Vec<usize> = (0..16).map(|b| 40 - 2 * b).collect();
    let out = rnn.forward(&x, &lengths, Padding::default())?; // [B, T, H]
    let grads = out.sqr()?.sum_all()?.backward()?; // reaches rnn.weight_ih_l0, ...
                                                   // ANCHOR_END: candle
    assert_eq!(out.dims(), &[16, 40, 128]);
    assert_eq!(grads.get(rnn.weights()[0].1.as_ref()).map(|g| g.dims().to_vec()), Some(vec![3 * 128, 64]));
    Ok(())
}
