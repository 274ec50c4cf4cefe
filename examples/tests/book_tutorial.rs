//! The Rust part of the book's tutorial (`docs/src/tutorial.md`): the JANET cell of
//! `docs/samples/janet.cell`, run forward and backward by the CPU back end on an unsorted
//! variable-length batch, and checked against the reference back end (the interpreter's
//! semantics).

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::{Align, CompiledCell, Input, Major, Model, ModelConfig};
use charlm::paths::repo_root;
use std::error::Error;
use std::sync::Arc;

#[test]
fn janet_runs_forward_and_backward_on_the_cpu() -> Result<(), Box<dyn Error>> {
    let path = repo_root().join("docs/samples/janet.cell");
    // ANCHOR: model
    let cell = Arc::new(CompiledCell::from_file(&path, None)?);
    let sizes = [("H".to_string(), 64)].into(); // I comes from the input
    let config = ModelConfig { layers: 2, bidirectional: false };
    let cpu = Cpu::new(0, Kernels::Fastest)?; // every usable core
    let model = Model::new(cell.clone(), config.clone(), &sizes, Some(32), None, 7, Box::new(cpu))?;
    // ANCHOR_END: model

    // ANCHOR: batch
    let (batch, steps, features) = (4, 20, 32);
    let lengths = [20, 3, 11, 1]; // unsorted, no packing
    let x: Vec<f32> = (0..batch * steps * features).map(|i| (i as f32 * 0.37).sin()).collect();
    let input = Input::Padded {
        data: &x,
        batch,
        steps,
        major: Major::BatchFirst,
        align: Align::Left, // padding after each sequence; Align::Right: before
        lengths: &lengths,
    };
    let (out, tape) = model.forward_train(input, None)?; // out.data: [B, T, H]
    let d_output = vec![1.0; out.data.len()]; // the gradient of sum(output)
    let grads = model.backward(&tape, &d_output, None)?; // d_input, d_h0, d_params
                                                         // ANCHOR_END: batch
    assert_eq!(out.data.len(), batch * steps * 64);
    assert_eq!(grads.d_input.len(), x.len());

    // ANCHOR: oracle
    // The same weights on the reference back end: the interpreter's semantics.
    let reference =
        Model::new(cell, config, &sizes, Some(32), Some(&model.weights()), 0, Box::new(Reference))?;
    let (want, want_tape) = reference.forward_train(input, None)?;
    let want_grads = reference.backward(&want_tape, &d_output, None)?;
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| (a - b).abs() <= 1e-4 * (1.0 + b.abs()));
    assert!(close(&out.data, &want.data));
    assert!(close(&grads.d_input, &want_grads.d_input));
    // ANCHOR_END: oracle
    for (d, w) in grads.d_params.iter().flatten().zip(want_grads.d_params.iter().flatten()) {
        assert!(close(d, w), "a weight gradient differs from the reference's");
    }
    Ok(())
}
