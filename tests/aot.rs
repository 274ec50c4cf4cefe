//! Kernels compiled ahead of time (by cellc-build, in `build.rs`, and
//! linked into this test as a static library) against the same kernels
//! compiled by the JIT: on every shipped cell, a 2-layer model
//! (bidirectional where the cell allows) over an unsorted variable-length
//! batch, forward and backward, the results are identical bit for bit.
//! Also: the generated typed bindings, and the errors a mismatched table
//! gives.

mod support;

#[allow(dead_code, clippy::all)]
mod linked {
    include!(concat!(env!("OUT_DIR"), "/linked_cells.rs"));
}

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::{Align, Input, Major, ModelConfig};
use support::Rng;

const LENGTHS: [usize; 5] = [3, 6, 1, 4, 6];
const STEPS: usize = 6;

#[test]
fn linked_kernels_equal_the_jit_bit_for_bit_on_every_cell() {
    let cells = support::compiled_cells();
    for c in &cells {
        let kernels = linked::kernels(&c.forward.name).expect("built by build.rs");
        let cpu = |k: Kernels| {
            move || {
                Box::new(Cpu::new(2, k).expect("cpu").split_every_step())
                    as Box<dyn cellc_runtime::backend::Device>
            }
        };
        let jit = support::two_layer_model(c, (7, 3, 5), 9, &cpu(Kernels::Jit));
        let aot = support::two_layer_model(c, (7, 3, 5), 9, &cpu(Kernels::Linked(kernels)));
        let mut rng = Rng::new(21);
        let x: Vec<f32> =
            rng.vec(LENGTHS.len() * STEPS * jit.input_size(), 1.0).iter().map(|&v| v as f32).collect();
        let dy: Vec<f32> =
            rng.vec(LENGTHS.len() * STEPS * jit.output_size(), 1.0).iter().map(|&v| v as f32).collect();
        for (major, align) in [(Major::BatchFirst, Align::Left), (Major::TimeFirst, Align::Right)] {
            let input = Input::Padded {
                data: &x,
                batch: LENGTHS.len(),
                steps: STEPS,
                major,
                align,
                lengths: &LENGTHS,
            };
            let (want, want_trace) = jit.forward_train(input, None).expect("jit forward");
            let (got, got_trace) =
                aot.forward_train(input, None).unwrap_or_else(|e| panic!("{}: {e}", c.forward.name));
            assert_eq!(got, want, "{} {major:?} {align:?}: forward", c.forward.name);
            let want = jit.backward(&want_trace, &dy, None).expect("jit backward");
            let got = aot.backward(&got_trace, &dy, None).expect("linked backward");
            assert_eq!(got, want, "{} {major:?} {align:?}: backward", c.forward.name);
        }
    }
    assert_eq!(cells.len(), 19);
}

/// The generated `Lstm` type: typed parameters and states round-trip, and
/// it computes what a runtime model with the same weights computes.
#[test]
fn typed_bindings_drive_the_linked_kernels() {
    use linked::lstm::{Lstm, LstmParams, LstmStates};
    let config = ModelConfig { layers: 2, bidirectional: true };
    // The input size is free: no kernel of an LSTM depends on it.
    let mut model = Lstm::new(config.clone(), 5, 3, 1).expect("model");
    let p = model.params(1, true).expect("layer 1, reverse");
    assert_eq!((p.weight_ih.len(), p.weight_hh.len(), p.bias_ih.len()), (28 * 14, 28 * 7, 28));
    let doubled = LstmParams { bias_hh: p.bias_hh.iter().map(|b| 2.0 * b).collect(), ..p.clone() };
    model.set_params(1, true, doubled.clone()).expect("same shapes");
    assert_eq!(model.params(1, true).expect("params"), doubled);
    let short = LstmParams { bias_hh: vec![0.0; 3], ..p };
    let err = model.set_params(1, true, short).expect_err("a short bias");
    assert!(err.to_string().contains("bias_hh"), "{err}");
    assert!(model.params(2, false).is_err(), "no layer 2");

    let mut rng = Rng::new(4);
    let x: Vec<f32> = rng.vec(LENGTHS.len() * STEPS * 5, 1.0).iter().map(|&v| v as f32).collect();
    let input = Input::Padded {
        data: &x,
        batch: LENGTHS.len(),
        steps: STEPS,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &LENGTHS,
    };
    let h0 = LstmStates { h: vec![0.25; 4 * 5 * 7], c: vec![-0.5; 4 * 5 * 7] };
    let (out, finals) = model.forward(input, Some(&h0)).expect("forward");
    let same = model.model().forward(input, Some(&[h0.h.clone(), h0.c.clone()])).expect("runtime forward");
    assert_eq!(out, same.data);
    assert_eq!(finals, LstmStates { h: same.final_states[0].clone(), c: same.final_states[1].clone() });
    let (_, _, trace) = model.forward_train(input, Some(&h0)).expect("forward_train");
    let grads = model.backward(&trace, &vec![1.0; out.len()], Some(&finals)).expect("backward");
    assert_eq!(grads.d_params.len(), 4);
    assert_eq!(grads.d_h0.c.len(), h0.c.len());
}

/// A table built for other sizes is refused with a message that says what to do.
#[test]
fn kernels_for_other_sizes_are_a_typed_error() {
    let c = support::compiled_cells().into_iter().find(|c| c.forward.name == "lstm").expect("lstm");
    let kernels = linked::kernels("lstm").expect("lstm kernels");
    let sizes = support::cell_sizes(&c, 8, 3);
    let model = cellc_runtime::Model::new(
        c,
        ModelConfig::default(),
        &sizes,
        Some(5),
        None,
        1,
        Box::new(Cpu::new(1, Kernels::Linked(kernels)).expect("cpu")),
    )
    .expect("a model (kernels are looked up when it first runs)");
    let x = vec![0.0f32; 5];
    let input = Input::Padded {
        data: &x,
        batch: 1,
        steps: 1,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &[1],
    };
    let err = model.forward(input, None).expect_err("H=8 was not built");
    let text = err.to_string();
    assert!(text.contains("no linked kernel") && text.contains("\"H\": 8"), "{text}");
}
