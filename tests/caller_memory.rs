//! Passes over the caller's memory ([`Model::forward_into`],
//! [`Model::backward_from`]), as a framework's tensors drive them: the
//! weights given on each call, the outputs written in place, and what the
//! backward reads kept in a reserve the caller holds. They give exactly
//! what the model's own passes give, on every shipped cell, padded (both
//! alignments) and packed, two layers and both directions, on the CPU and
//! reference back ends (each keeping its tapes in the reserve, laid out as
//! the program says); bad buffers get typed errors.

mod support;

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::{
    Align, BackwardOut, Call, CallOptions, ForwardOut, Input, Major, Model, PackedSequence, RuntimeError,
};

const LENGTHS: [usize; 4] = [3, 5, 1, 5];
const STEPS: usize = 6;

fn cpu() -> Box<dyn Device> {
    Box::new(Cpu::new(2, Kernels::default()).expect("cpu").split_every_step())
}

fn reference() -> Box<dyn Device> {
    Box::new(Reference)
}

fn data(n: usize, seed: u64) -> Vec<f32> {
    support::Rng::new(seed).vec(n, 1.0).iter().map(|&v| v as f32).collect()
}

/// Owned buffers shaped like one pass's results.
struct Results {
    output: Vec<f32>,
    finals: Vec<Vec<f32>>,
    d_input: Vec<f32>,
    d_h0: Vec<Vec<f32>>,
    d_params: Vec<Vec<Vec<f32>>>,
}

/// Forward with a reserve, then backward, all on buffers the test owns,
/// with the weights given as the caller's (copies of the model's own).
fn through_caller_memory(model: &Model, input: Input, h0: &[Vec<f32>], d_out: &[f32]) -> Results {
    let weights: Vec<Vec<Vec<f32>>> = model.weights_by_slot();
    let weight_slices: Vec<Vec<&[f32]>> =
        weights.iter().map(|ps| ps.iter().map(Vec::as_slice).collect()).collect();
    let h0_slices: Vec<&[f32]> = h0.iter().map(Vec::as_slice).collect();
    let call = Call { weights: Some(&weight_slices), h0: Some(&h0_slices), ..Call::new(input) };
    let rows = d_out.len() / model.output_size();
    let per_row = model.reserve_floats_per_row();
    // Garbage where nothing should be read: NaN.
    let mut reserve = vec![f32::NAN; rows * per_row];
    let mut output = vec![f32::NAN; d_out.len()];
    let mut finals: Vec<Vec<f32>> = h0.iter().map(|s| vec![f32::NAN; s.len()]).collect();
    let out =
        ForwardOut { output: &mut output, final_states: finals.iter_mut().map(Vec::as_mut_slice).collect() };
    model.forward_into(&call, out, Some(&mut reserve)).expect("forward_into");
    let in_len = rows * model.input_size();
    let mut d_input = vec![f32::NAN; in_len];
    let mut d_h0: Vec<Vec<f32>> = h0.iter().map(|s| vec![f32::NAN; s.len()]).collect();
    let mut d_params: Vec<Vec<Vec<f32>>> =
        weights.iter().map(|ps| ps.iter().map(|p| vec![f32::NAN; p.len()]).collect()).collect();
    let d_final: Vec<Vec<f32>> =
        finals.iter().enumerate().map(|(k, s)| data(s.len(), 70 + k as u64)).collect();
    let d_final_slices: Vec<&[f32]> = d_final.iter().map(Vec::as_slice).collect();
    let out = BackwardOut {
        d_input: &mut d_input,
        d_h0: d_h0.iter_mut().map(Vec::as_mut_slice).collect(),
        d_params: d_params.iter_mut().map(|ps| ps.iter_mut().map(Vec::as_mut_slice).collect()).collect(),
    };
    model.backward_from(&call, &reserve, d_out, Some(&d_final_slices), out).expect("backward_from");
    Results { output, finals, d_input, d_h0, d_params }
}

/// The model's own passes, for the same batch, in evaluation mode as the
/// calls (no masks: a cell's own are compared in `tests/cell_masks.rs`).
fn through_model(model: &Model, input: Input, h0: &[Vec<f32>], d_out: &[f32]) -> Results {
    let (out, trace) =
        model.forward_traced(input, Some(h0), &CallOptions::default()).expect("forward_traced");
    let d_final: Vec<Vec<f32>> =
        out.final_states.iter().enumerate().map(|(k, s)| data(s.len(), 70 + k as u64)).collect();
    let g = model.backward(&trace, d_out, Some(&d_final)).expect("backward");
    Results {
        output: out.data,
        finals: out.final_states,
        d_input: g.d_input,
        d_h0: g.d_h0,
        d_params: g.d_params,
    }
}

fn assert_same(what: &str, a: &Results, b: &Results) {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a.output), bits(&b.output), "{what}: output");
    for (x, y) in a.finals.iter().zip(&b.finals) {
        assert_eq!(bits(x), bits(y), "{what}: final states");
    }
    assert_eq!(bits(&a.d_input), bits(&b.d_input), "{what}: input gradient");
    for (x, y) in a.d_h0.iter().zip(&b.d_h0) {
        assert_eq!(bits(x), bits(y), "{what}: initial-state gradient");
    }
    for (x, y) in a.d_params.iter().flatten().zip(b.d_params.iter().flatten()) {
        assert_eq!(bits(x), bits(y), "{what}: parameter gradient");
    }
}

trait BySlot {
    /// The model's parameters, copied: `[layer * directions + direction][param]`.
    fn weights_by_slot(&self) -> Vec<Vec<Vec<f32>>>;
}

impl BySlot for Model {
    fn weights_by_slot(&self) -> Vec<Vec<Vec<f32>>> {
        let dirs = self.directions();
        (0..self.layers().len() * dirs).map(|s| self.params(s / dirs, s % dirs == 1).to_vec()).collect()
    }
}

#[test]
fn caller_memory_passes_equal_the_models_own_on_every_cell() {
    for cell in support::compiled_cells() {
        let name = cell.forward.name.clone();
        for (backend, make) in [("cpu", cpu as fn() -> Box<dyn Device>), ("reference", reference)] {
            let model = support::two_layer_model(&cell, (7, 4, 3), 9, &make);
            let (i, o, b) = (model.input_size(), model.output_size(), LENGTHS.len());
            let x = data(b * STEPS * i, 1);
            let d_out = data(b * STEPS * o, 2);
            let h0: Vec<Vec<f32>> = model
                .forward(padded(&x, Major::BatchFirst, Align::Left), None)
                .expect("forward")
                .final_states;
            let h0: Vec<Vec<f32>> =
                h0.iter().enumerate().map(|(k, s)| data(s.len(), 30 + k as u64)).collect();
            for (major, align) in [(Major::BatchFirst, Align::Left), (Major::TimeFirst, Align::Right)] {
                let input = padded(&x, major, align);
                let what = format!("{name} on {backend}, {major:?} {align:?}");
                let got = through_caller_memory(&model, input, &h0, &d_out);
                assert_same(&what, &got, &through_model(&model, input, &h0, &d_out));
                assert!(got.output.iter().all(|v| v.is_finite()), "{what}: padding rows are zeroed");
            }
            let packed = PackedSequence::from_padded(&x, &LENGTHS, STEPS, i, Major::BatchFirst, Align::Left)
                .expect("pack");
            let rows: usize = LENGTHS.iter().sum();
            let input = Input::Packed(packed.view());
            let what = format!("{name} on {backend}, packed");
            let got = through_caller_memory(&model, input, &h0, &d_out[..rows * o]);
            assert_same(&what, &got, &through_model(&model, input, &h0, &d_out[..rows * o]));
        }
    }
}

#[test]
fn a_step_of_a_few_sequences_reads_the_weights_in_place_with_the_same_bits() {
    // Four rows in all: the caller's weights are read where they lie, not packed.
    for cell in support::compiled_cells() {
        let model = support::two_layer_model(&cell, (33, 20, 3), 4, &cpu);
        let (i, o) = (model.input_size(), model.output_size());
        for (batch, steps) in [(4, 1), (1, 4), (3, 1)] {
            let lengths = vec![steps; batch];
            let x = data(batch * steps * i, 11);
            let d_out = data(batch * steps * o, 12);
            let input = Input::Padded {
                data: &x,
                batch,
                steps,
                major: Major::TimeFirst,
                align: Align::Left,
                lengths: &lengths,
            };
            let h0: Vec<Vec<f32>> = model
                .forward(input, None)
                .expect("forward")
                .final_states
                .iter()
                .enumerate()
                .map(|(k, s)| data(s.len(), 40 + k as u64))
                .collect();
            let what = format!("{} B={batch} T={steps}", cell.forward.name);
            assert_same(
                &what,
                &through_caller_memory(&model, input, &h0, &d_out),
                &through_model(&model, input, &h0, &d_out),
            );
        }
    }
}

fn padded(x: &[f32], major: Major, align: Align) -> Input<'_> {
    Input::Padded { data: x, batch: LENGTHS.len(), steps: STEPS, major, align, lengths: &LENGTHS }
}

#[test]
fn the_weights_of_each_call_are_the_ones_read() {
    let cell = support::compiled_cells().into_iter().find(|c| c.forward.name == "lstm").expect("lstm");
    let mut model = support::two_layer_model(&cell, (8, 4, 3), 5, &cpu);
    let x = data(LENGTHS.len() * STEPS * model.input_size(), 3);
    let input = padded(&x, Major::BatchFirst, Align::Left);
    // Warm the model's own packed weights, then hand other weights per call.
    model.forward(input, None).expect("forward");
    let halved: Vec<Vec<Vec<f32>>> = model
        .weights_by_slot()
        .iter()
        .map(|ps| ps.iter().map(|p| p.iter().map(|v| v * 0.5).collect()).collect())
        .collect();
    let slices: Vec<Vec<&[f32]>> = halved.iter().map(|ps| ps.iter().map(Vec::as_slice).collect()).collect();
    let mut output = vec![0.0; LENGTHS.len() * STEPS * model.output_size()];
    let mut finals: Vec<Vec<f32>> = model.forward(input, None).expect("forward").final_states;
    let out =
        ForwardOut { output: &mut output, final_states: finals.iter_mut().map(Vec::as_mut_slice).collect() };
    model
        .forward_into(&Call { weights: Some(&slices), ..Call::new(input) }, out, None)
        .expect("forward_into");
    for (mine, given) in model.params_mut().iter_mut().zip(&halved) {
        mine.clone_from(given);
    }
    let want = model.forward(input, None).expect("forward");
    assert_eq!(output, want.data);
    assert_eq!(finals, want.final_states);
}

#[test]
fn a_weightless_model_given_weights_runs_as_the_model_they_came_from() {
    let cell = support::compiled_cells().into_iter().find(|c| c.forward.name == "gru").expect("gru");
    let model = support::two_layer_model(&cell, (8, 4, 3), 6, &cpu);
    let sizes = support::cell_sizes(&cell, 8, 4);
    let weightless = || {
        Model::without_weights(cell.clone(), model.config().clone(), &sizes, Some(model.input_size()), cpu())
    };
    let mut given = weightless().expect("model");
    given.set_weights(&model.weights()).expect("set_weights");
    assert!(given.owns_weights());
    let x = data(LENGTHS.len() * STEPS * model.input_size(), 5);
    let input = padded(&x, Major::BatchFirst, Align::Left);
    let (want, got) =
        (model.forward(input, None).expect("forward"), given.forward(input, None).expect("forward"));
    assert_eq!(got.data, want.data);
    assert_eq!(got.final_states, want.final_states);
    // A weight of another shape is refused by name; the weights kept stay.
    let mut wrong = model.weights();
    wrong.insert("weight_hh_l1".into(), vec![3, 8], vec![0.0; 24]);
    match given.set_weights(&wrong) {
        Err(RuntimeError::Shape { tensor, .. }) => assert!(tensor.starts_with("weight_hh_l1"), "{tensor}"),
        other => panic!("expected a shape error, got {other:?}"),
    }
    assert_eq!(given.forward(input, None).expect("forward").data, want.data);
}

#[test]
fn bad_caller_buffers_get_typed_errors() {
    let cell = support::compiled_cells().into_iter().find(|c| c.forward.name == "gru").expect("gru");
    let model = support::two_layer_model(&cell, (6, 3, 3), 5, &cpu);
    let x = data(LENGTHS.len() * STEPS * model.input_size(), 3);
    let input = padded(&x, Major::BatchFirst, Align::Left);
    let rows = LENGTHS.len() * STEPS;
    let per_row = model.reserve_floats_per_row();
    let mut output = vec![0.0; rows * model.output_size()];
    let mut finals: Vec<Vec<f32>> = model.forward(input, None).expect("forward").final_states;
    let shape_error = |e: RuntimeError, want: &str| match e {
        RuntimeError::Shape { ref tensor, .. } if tensor == want => {}
        other => panic!("expected a shape error for `{want}`, got {other:?}"),
    };

    let mut short = vec![0.0; rows * per_row - 1];
    let out =
        ForwardOut { output: &mut output, final_states: finals.iter_mut().map(Vec::as_mut_slice).collect() };
    shape_error(model.forward_into(&Call::new(input), out, Some(&mut short)).unwrap_err(), "reserve");

    let mut weights = model.weights_by_slot();
    weights[1][0].pop();
    let slices: Vec<Vec<&[f32]>> = weights.iter().map(|ps| ps.iter().map(Vec::as_slice).collect()).collect();
    let out =
        ForwardOut { output: &mut output, final_states: finals.iter_mut().map(Vec::as_mut_slice).collect() };
    shape_error(
        model.forward_into(&Call { weights: Some(&slices), ..Call::new(input) }, out, None).unwrap_err(),
        "weight_ih_l0_reverse",
    );

    let mut small = vec![0.0; 3];
    let out =
        ForwardOut { output: &mut small, final_states: finals.iter_mut().map(Vec::as_mut_slice).collect() };
    shape_error(model.forward_into(&Call::new(input), out, None).unwrap_err(), "output");
}
