//! Streaming ([`Model::stream`]): calls of a few steps, the states carried
//! between them, give what one forward pass over the whole sequences
//! gives — on every shipped cell, odd sizes, one and two layers, on the
//! CPU's step path and on the reference back end's batched one — and bad
//! calls get typed errors.

mod support;

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::{Align, Input, Major, Model, ModelConfig, RuntimeError, Stream};
use std::sync::Arc;

fn cpu() -> Box<dyn Device> {
    Box::new(Cpu::new(2, Kernels::default()).expect("cpu").split_every_step())
}

fn data(n: usize, seed: u64) -> Vec<f32> {
    support::Rng::new(seed).vec(n, 1.0).iter().map(|&v| v as f32).collect()
}

/// The whole sequences in one pass, time first, from `h0`.
fn whole(model: &Model, x: &[f32], batch: usize, steps: usize, h0: &[Vec<f32>]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let lengths = vec![steps; batch];
    let input = Input::Padded {
        data: x,
        batch,
        steps,
        major: Major::TimeFirst,
        align: Align::Left,
        lengths: &lengths,
    };
    let out = model.forward(input, Some(h0)).expect("forward");
    (out.data, out.final_states)
}

/// The same sequences through a stream, in calls of `chunks` steps.
fn streamed(stream: &mut Stream, x: &[f32], chunks: &[usize], i: usize, o: usize) -> Vec<f32> {
    let b = stream.batch();
    let mut y = vec![0.0; x.len() / i * o];
    let mut s = 0;
    for &n in chunks {
        stream.run(&x[s * b * i..(s + n) * b * i], &mut y[s * b * o..(s + n) * b * o]).expect("stream");
        s += n;
    }
    y
}

fn assert_close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 2e-5 * y.abs().max(1.0), "{what}[{k}]: stream {x} vs whole {y}");
    }
}

#[test]
fn streams_equal_whole_sequences_on_every_cell() {
    let chunks = [1usize, 3, 1, 2];
    let steps: usize = chunks.iter().sum();
    for cell in support::compiled_cells() {
        let name = cell.forward.name.clone();
        for (backend, make) in
            [("cpu", cpu as fn() -> Box<dyn Device>), ("reference", || Box::new(Reference))]
        {
            for (layers, h, batch) in [(1usize, 5usize, 1usize), (2, 17, 3), (1, 33, 9)] {
                let config = ModelConfig { layers, bidirectional: false };
                let Some(model) = support::try_model(&cell, (h, (h / 2).max(1), 3), &config, 11, make())
                else {
                    continue;
                };
                let (i, o) = (model.input_size(), model.output_size());
                let x = data(steps * batch * i, 5);
                let mut stream = model.stream(batch).expect("stream");
                let h0: Vec<Vec<f32>> =
                    stream.states().iter().enumerate().map(|(k, s)| data(s.len(), 40 + k as u64)).collect();
                stream.set_states(&h0).expect("set states");
                let y = streamed(&mut stream, &x, &chunks, i, o);
                let (want, finals) = whole(&model, &x, batch, steps, &h0);
                let what = format!("{name} on {backend}, {layers} layers, H={h}, B={batch}");
                assert_close(&format!("{what}: output"), &y, &want);
                for (a, w) in stream.states().iter().zip(&finals) {
                    assert_close(&format!("{what}: states"), a, w);
                }
                // Reset: the next call starts from zeros, as a fresh pass does.
                stream.reset();
                let y = streamed(&mut stream, &x[..batch * i], &[1], i, o);
                let (want, _) = whole(&model, &x[..batch * i], batch, 1, &stream_zeros(&stream));
                assert_close(&format!("{what}: after reset"), &y, &want);
            }
        }
    }
}

fn stream_zeros(stream: &Stream) -> Vec<Vec<f32>> {
    stream.states().iter().map(|s| vec![0.0; s.len()]).collect()
}

#[test]
fn one_stream_per_thread_on_a_shared_model() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Stream>();
    let cell = support::compiled_cells().into_iter().find(|c| c.forward.name == "lstm").expect("lstm");
    let sizes = support::cell_sizes(&cell, 24, 12);
    let model = Arc::new(
        Model::new(cell, ModelConfig { layers: 2, bidirectional: false }, &sizes, Some(7), None, 3, cpu())
            .expect("model"),
    );
    let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3u64)
            .map(|t| {
                let model = &model;
                s.spawn(move || {
                    let x = data(6 * 2 * 7, 100 + t);
                    let mut stream = model.stream(2).expect("stream");
                    let y = streamed(&mut stream, &x, &[1; 6], 7, 24);
                    (x, y)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    for (x, y) in results {
        let zeros: Vec<Vec<f32>> = vec![vec![0.0; 2 * 2 * 24]; 2];
        let (want, _) = whole(&model, &x, 2, 6, &zeros);
        assert_close("threaded stream", &y, &want);
    }
}

#[test]
fn bad_streams_and_calls_are_typed_errors() {
    let cell = support::compiled_cells().into_iter().find(|c| c.forward.name == "gru").expect("gru");
    let sizes = support::cell_sizes(&cell, 4, 2);
    let both = Model::new(
        cell.clone(),
        ModelConfig { layers: 1, bidirectional: true },
        &sizes,
        Some(3),
        None,
        1,
        cpu(),
    )
    .expect("model");
    assert!(matches!(both.stream(1), Err(RuntimeError::NotStreamable { .. })));
    let model = Model::new(cell, ModelConfig::default(), &sizes, Some(3), None, 1, cpu()).expect("model");
    assert!(matches!(model.stream(0), Err(RuntimeError::Shape { .. })));
    let mut stream = model.stream(2).expect("stream");
    let mut y = vec![0.0; 8];
    let e = stream.run(&[0.0; 5], &mut y).expect_err("5 floats are not [steps, 2, 3]");
    assert!(e.to_string().contains("`input`"), "{e}");
    let e = stream.run(&[0.0; 6], &mut [0.0; 7]).expect_err("output of 7 floats");
    assert!(e.to_string().contains("`output`"), "{e}");
    let e = stream.set_states(&[vec![0.0; 3]]).expect_err("a state of 3 floats");
    assert!(e.to_string().contains("states.h"), "{e}");
    // Nothing to run: no steps.
    stream.run(&[], &mut []).expect("zero steps");
}
