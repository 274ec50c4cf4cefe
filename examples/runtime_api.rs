//! The runtime's Rust API in one page: compile a cell, build a 2-layer
//! bidirectional model, run inference on a padded batch and on the same
//! batch packed, then a training step (forward, backward, SGD update), and
//! save the weights.
//!
//! ```text
//! cargo run -p cellc-examples --example runtime_api
//! ```

use cellc_runtime::backend::reference::Reference;
use cellc_runtime::{Align, CompiledCell, Input, Major, Model, ModelConfig, PackedSequence};
use std::error::Error;
use std::sync::Arc;

fn main() -> Result<(), Box<dyn Error>> {
    // 1. A cell from a string (CompiledCell::from_file reads a .cell file).
    let cell = CompiledCell::from_source(
        "gru_ln.cell",
        "cell gru_ln {
            input  x[I]
            state  h[H]
            param  weight_ih[3*H, I], weight_hh[3*H, H], bias_ih[3*H] = zeros, bias_hh[3*H] = zeros
            param  gain[H] = ones, shift[H] = zeros
            let xr, xz, xn = chunk(weight_ih @ x + bias_ih, 3)
            let hr, hz, hn = chunk(weight_hh @ h + bias_hh, 3)
            let r = sigmoid(xr + hr)
            let z = sigmoid(xz + hz)
            let n = tanh(layernorm(xn + r * hn, gain, shift))
            h' = (1 - z) * n + z * h
            output h'
        }",
        None,
    )?;

    // 2. A model: sizes from -D-style bindings, the input size from the data,
    //    weights initialised from a seed by the cell's init clauses.
    let (batch, steps, features) = (3, 6, 4);
    let sizes = [("H".to_string(), 8)].into();
    let config = ModelConfig { layers: 2, bidirectional: true };
    let mut model =
        Model::new(Arc::new(cell), config, &sizes, Some(features), None, 42, Box::new(Reference))?;
    println!("{model:?}");

    // 3. A padded batch, batch-first, sequences of lengths 6, 2 and 4 (unsorted).
    let lengths = [6, 2, 4];
    let x: Vec<f32> = (0..batch * steps * features).map(|i| ((i as f32) * 0.37).sin()).collect();
    let padded = Input::Padded {
        data: &x,
        batch,
        steps,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &lengths,
    };
    let out = model.forward(padded, None)?;
    println!("output: {} values ([B, T, 2*H] = [{batch}, {steps}, {}])", out.data.len(), model.output_size());

    // The same batch packed as PyTorch would: same numbers, packed order.
    let packed = PackedSequence::from_padded(&x, &lengths, steps, features, Major::BatchFirst, Align::Left)?;
    let out_packed = model.forward(Input::Packed(packed.view()), None)?;
    println!("packed: batch_sizes {:?}, sorted_indices {:?}", packed.batch_sizes, packed.sorted_indices);
    assert_eq!(out.final_states, out_packed.final_states);

    // 4. Training: loss = 0.5 * |output|^2, so d_output = output.
    for step in 0..5 {
        let (out, trace) = model.forward_train(padded, None)?;
        let loss: f32 = out.data.iter().map(|v| 0.5 * v * v).sum();
        let grads = model.backward(&trace, &out.data, None)?;
        for (params, d) in model.params_mut().iter_mut().zip(&grads.d_params) {
            for (p, g) in params.iter_mut().zip(d) {
                p.iter_mut().zip(g).for_each(|(w, g)| *w -= 0.002 * g);
            }
        }
        println!("step {step}: loss {loss:.4}");
    }

    // 5. Save the weights (PyTorch-style names: weight_ih_l0, ..._l1_reverse).
    let path = std::env::temp_dir().join("cellc_runtime_api.safetensors");
    model.weights().save(&path)?;
    println!("saved {} tensors to {}", model.weights().len(), path.display());
    Ok(())
}
