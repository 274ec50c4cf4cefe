//! The Rust samples of the book's page "Rust: models, calls and streams"
//! (`docs/src/guides/rust.md`). The page shows the lines between each
//! `ANCHOR: name` and `ANCHOR_END: name`; the assertions check what the
//! page says of them.

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::{
    Align, BackwardOut, Call, CallOptions, CompiledCell, ForwardOut, Input, Major, Model, ModelConfig,
    PackedSequence, RuntimeError, Weights,
};
use charlm::paths::repo_root;
use std::error::Error;
use std::sync::Arc;

type Result<T = ()> = std::result::Result<T, Box<dyn Error>>;

/// `n` floats in [-1, 1], the same for the same `seed`.
fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + seed * 13) as f32 * 0.37).sin()).collect()
}

fn close(a: &[f32], b: &[f32], tolerance: f32) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tolerance * y.abs().max(1.0))
}

#[test]
fn a_model_runs_padded_and_packed_batches_and_trains() -> Result {
    // ANCHOR: compile
    // A cell from a file (CompiledCell::from_source takes the text itself), in an Arc:
    // models share one compiled cell.
    let cell = Arc::new(CompiledCell::from_file(&repo_root().join("cells/lstm.cell"), None)?);
    // ANCHOR_END: compile

    // ANCHOR: model
    let sizes = [("H".to_string(), 8)].into(); // -D H=8
    let config = ModelConfig { layers: 2, bidirectional: true };
    let input_size = 4; // binds the cell's I
    let backend = Box::new(Cpu::new(2, Kernels::Fastest)?); // at most 2 threads
    let model = Model::new(cell.clone(), config.clone(), &sizes, Some(input_size), None, 42, backend)?;
    // The output: both directions' h, side by side.
    assert_eq!(model.output_size(), 2 * 8);
    // ANCHOR_END: model
    fn send_sync<T: Send + Sync>(_: &T) {}
    send_sync(&model); // as the page says

    // ANCHOR: padded
    // Three sequences of lengths 5, 2 and 4 (unsorted), batch-first, padded at the end.
    let (batch, steps) = (3, 5);
    let lengths = [5, 2, 4];
    let x = data(batch * steps * input_size, 1); // [B, T, I]
    let input = Input::Padded {
        data: &x,
        batch,
        steps,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &lengths,
    };
    let out = model.forward(input, None)?; // initial states: zeros
    assert_eq!(out.data.len(), batch * steps * 16); // [B, T, 2 * H], zeros at padding
    let finals: Vec<usize> = out.final_states.iter().map(Vec::len).collect(); // h and c
    assert_eq!(finals, [4 * batch * 8; 2]);
    // ANCHOR_END: padded
    let padding = &out.data[(steps + 2) * 16..2 * steps * 16]; // sequence 1, steps 2..5
    assert!(padding.iter().all(|&v| v == 0.0));

    // ANCHOR: packed
    // The same batch packed as PyTorch's pack_padded_sequence packs it.
    let packed =
        PackedSequence::from_padded(&x, &lengths, steps, input_size, Major::BatchFirst, Align::Left)?;
    assert_eq!(packed.batch_sizes, [3, 3, 2, 2, 1]);
    assert_eq!(packed.sorted_indices, [0, 2, 1]);
    let out_packed = model.forward(Input::Packed(packed.view()), None)?;
    assert_eq!(out_packed.final_states, out.final_states);
    // ANCHOR_END: packed

    // ANCHOR: train
    // Training: loss = 0.5 * |output|^2, so d_output = output.
    let mut model = model;
    let mut losses = Vec::new();
    for _ in 0..5 {
        let (out, trace) = model.forward_train(input, None)?;
        losses.push(out.data.iter().map(|v| 0.5 * v * v).sum::<f32>());
        let grads = model.backward(&trace, &out.data, None)?; // d_final: None (zeros)
        assert_eq!(grads.d_input.len(), x.len()); // laid out like the input
        for (params, d) in model.params_mut().iter_mut().zip(&grads.d_params) {
            for (p, g) in params.iter_mut().zip(d) {
                p.iter_mut().zip(g).for_each(|(w, g)| *w -= 0.01 * g);
            }
        }
    }
    assert!(losses[4] < losses[0]);
    // ANCHOR_END: train
    assert!(losses.iter().all(|l| l.is_finite()));

    // ANCHOR: save
    // PyTorch's names: weight_ih_l0, ..., bias_hh_l1_reverse.
    let path = std::env::temp_dir().join(format!("book_rust_{}.safetensors", std::process::id()));
    model.weights().save(&path)?;
    let weights = Weights::load(&path)?;
    assert!(weights.get("weight_hh_l1_reverse").is_some());
    // Sizes from the weights' shapes: no -D H, no input size.
    let again = Model::new(cell, config, &Default::default(), None, Some(&weights), 0, Box::new(Reference))?;
    assert!(close(&again.forward(input, None)?.data, &model.forward(input, None)?.data, 1e-5));
    // ANCHOR_END: save
    std::fs::remove_file(&path)?;
    Ok(())
}

#[test]
fn a_pytorch_state_dict_loads_as_it_is_and_bad_weights_are_named() -> Result {
    // ANCHOR: pytorch
    // An nn.LSTM(3, 4, num_layers=2, bidirectional=True) state_dict, saved in Python with
    // safetensors.torch.save_file(lstm.state_dict(), "lstm_weights.safetensors").
    let weights = Weights::load(&repo_root().join("tests/fixtures/runtime/lstm_weights.safetensors"))?;
    let shape = weights.get("weight_ih_l0").map(|w| w.shape.clone());
    assert_eq!(shape, Some(vec![16, 3])); // [4*H, I]

    let cell = Arc::new(CompiledCell::from_file(&repo_root().join("cells/lstm.cell"), None)?);
    let config = ModelConfig { layers: 2, bidirectional: true };
    let no_sizes = Default::default(); // no -D: H and I come from the weights' shapes
    let load = |weights: &Weights| {
        Model::new(cell.clone(), config.clone(), &no_sizes, None, Some(weights), 0, Box::new(Reference))
    };
    let model = load(&weights)?;
    assert_eq!((model.input_size(), model.output_size()), (3, 2 * 4));
    // ANCHOR_END: pytorch

    // ANCHOR: errors
    // A weight the model does not have, a weight of another size, a bad batch:
    // typed errors whose messages name the tensor, never a panic.
    let mut extra = weights.clone();
    extra.insert("weight_ih_l2".into(), vec![16, 8], vec![0.0; 16 * 8]);
    let error = load(&extra).expect_err("a third layer's weight in a two-layer model");
    assert!(matches!(error, RuntimeError::UnexpectedWeight { .. }));
    assert!(error.to_string().starts_with("weight `weight_ih_l2` does not belong to this model"));

    let h5 = [("H".to_string(), 5)].into();
    let error = Model::new(cell.clone(), config, &h5, None, Some(&weights), 0, Box::new(Reference))
        .expect_err("weights of H = 4 in a model of H = 5");
    assert!(matches!(&error, RuntimeError::Shape { tensor, .. } if tensor == "weight_ih_l0"));
    println!("{error}"); // `weight_ih_l0` has shape 16, expected [4*H] = 20

    let x = vec![0.0; 2 * 4 * 3];
    let input = Input::Padded {
        data: &x,
        batch: 2,
        steps: 4,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &[4, 5],
    };
    let error = model.forward(input, None).expect_err("a sequence longer than the padded steps");
    assert_eq!(error.to_string(), "sequence 1 has length 5, longer than the 4 padded steps");
    // ANCHOR_END: errors
    Ok(())
}

/// A one-layer LSTM at H = 8, I = 4 on the CPU back end.
fn small_lstm() -> Result<Model> {
    let cell = Arc::new(CompiledCell::from_file(&repo_root().join("cells/lstm.cell"), None)?);
    let sizes = [("H".to_string(), 8)].into();
    let cpu = Box::new(Cpu::new(1, Kernels::Fastest)?);
    Ok(Model::new(cell, ModelConfig::default(), &sizes, Some(4), None, 7, cpu)?)
}

#[test]
fn a_reset_restarts_a_sequence_from_its_initial_state() -> Result {
    let model = small_lstm()?;
    let (batch, steps, i, o) = (2, 6, 4, 8);
    let x = data(batch * steps * i, 2);
    // ANCHOR: resets
    // One flag per row of the input's layout ([B, T] here): sequence 0 restarts at step 3.
    let mut resets = vec![false; batch * steps];
    resets[3] = true;
    let input = Input::Padded {
        data: &x,
        batch,
        steps,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &[6, 6],
    };
    let out =
        model.forward_with(input, None, &CallOptions { resets: Some(&resets), ..Default::default() })?;
    // ANCHOR_END: resets

    // Steps 3..6 of sequence 0 as a sequence of its own give the same outputs.
    let tail = Input::Padded {
        data: &x[3 * i..6 * i],
        batch: 1,
        steps: 3,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &[3],
    };
    let alone = model.forward(tail, None)?;
    assert!(close(&out.data[3 * o..6 * o], &alone.data, 1e-6));
    // Sequence 1 has no reset: as without flags.
    let plain = model.forward(input, None)?;
    assert_eq!(out.data[steps * o..], plain.data[steps * o..]);
    Ok(())
}

#[test]
fn passes_over_the_callers_memory_equal_the_models_own() -> Result {
    let model = small_lstm()?;
    let (batch, steps, lengths) = (2, 5, [5, 3]);
    let x = data(batch * steps * model.input_size(), 3);
    let input = Input::Padded {
        data: &x,
        batch,
        steps,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &lengths,
    };
    let d_output = data(batch * steps * model.output_size(), 4);

    // ANCHOR: forward_into
    // The caller's buffers: the output, the final states, and the reserve in which
    // the forward keeps what the backward reads (one row per row of the input's layout).
    let call = Call::new(input);
    let rows = batch * steps;
    let mut output = vec![0.0; rows * model.output_size()];
    let mut finals: Vec<Vec<f32>> =
        model.state_shapes(batch).iter().map(|s| vec![0.0; s.iter().product()]).collect();
    let mut reserve = vec![0.0; rows * model.reserve_floats_per_row()];
    let out =
        ForwardOut { output: &mut output, final_states: finals.iter_mut().map(|s| &mut s[..]).collect() };
    model.forward_into(&call, out, Some(&mut reserve))?;
    // ANCHOR_END: forward_into

    // ANCHOR: backward_from
    let mut d_input = vec![0.0; x.len()];
    let zeros = model.weight_names().iter().map(|(_, shape)| vec![0.0; shape.iter().product()]).collect();
    let mut d_params = model.group_by_slot(zeros)?; // [layer * directions + direction][param]
    let out = BackwardOut {
        d_input: &mut d_input,
        d_h0: Vec::new(), // the initial states' gradients are not wanted
        d_params: d_params.iter_mut().map(|ps| ps.iter_mut().map(|p| &mut p[..]).collect()).collect(),
    };
    model.backward_from(&call, &reserve, &d_output, None, out)?;
    // ANCHOR_END: backward_from

    // The model's own passes in evaluation mode (no masks) give the same bits.
    let (own, trace) = model.forward_traced(input, None, &CallOptions::default())?;
    let grads = model.backward(&trace, &d_output, None)?;
    assert_eq!(own.data, output);
    assert_eq!(own.final_states, finals);
    assert_eq!(grads.d_input, d_input);
    assert_eq!(grads.d_params, d_params);
    Ok(())
}

#[test]
fn a_stream_computes_what_a_batch_computes() -> Result {
    let model = small_lstm()?;
    let (batch, steps, i, o) = (2, 6, 4, 8);

    // ANCHOR: stream
    let x = data(steps * batch * i, 5); // [T, B, I]: time first, 6 steps
    let mut stream = model.stream(batch)?; // two sequences side by side, states at zero
    let mut y = vec![0.0; steps * batch * o];
    for (frame, out) in x.chunks(batch * i).zip(y.chunks_mut(batch * o)) {
        stream.run(frame, out)?; // [1, B, I] in, [1, B, O] out: one step
    }
    // The states now: h and c, [layers, B, H] each.
    let states = stream.states();
    // ANCHOR_END: stream

    // The same sequences in one batch, time first.
    let whole = model.forward(
        Input::Padded {
            data: &x,
            batch,
            steps,
            major: Major::TimeFirst,
            align: Align::Left,
            lengths: &[steps, steps],
        },
        None,
    )?;
    assert!(close(&y, &whole.data, 2e-5));
    for (s, f) in states.iter().zip(&whole.final_states) {
        assert!(close(s, f, 2e-5));
    }

    // ANCHOR: stream_states
    stream.reset(); // zeros: the next call starts new sequences
    assert!(stream.states().iter().flatten().all(|&v| v == 0.0));
    stream.set_states(&states)?; // or carry on from saved states
    let (two_steps, two_outputs) = (&x[..2 * batch * i], &mut y[..2 * batch * o]);
    stream.run(two_steps, two_outputs)?;
    // ANCHOR_END: stream_states

    let bidirectional = Model::new(
        Arc::new(CompiledCell::from_file(&repo_root().join("cells/lstm.cell"), None)?),
        ModelConfig { layers: 1, bidirectional: true },
        &[("H".to_string(), 8)].into(),
        Some(4),
        None,
        0,
        Box::new(Reference),
    )?;
    assert!(matches!(bidirectional.stream(1), Err(RuntimeError::NotStreamable { .. })));
    Ok(())
}
