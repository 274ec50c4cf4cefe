//! Every shipped cell, run by the runtime's reference backend as a
//! multi-layer bidirectional model over an unsorted variable-length batch
//! (padded, both alignments, both axis orders, and packed), forwards and
//! backwards, against the plainest possible oracle: the interpreter run on
//! each sequence alone, layer by layer, direction by direction.

mod support;

use cellc_difftest::batch::Batch;
use cellc_difftest::oracle::oracle_in;
use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::{
    Align, CallOptions, CompiledCell, Input, Major, Model, PackedSequence, Precision, RowLayout,
};
use std::sync::Arc;
use support::Rng;

const LENGTHS: [usize; 3] = [4, 1, 5];
const STEPS: usize = 5;

struct Case {
    model: Model,
    h0: Vec<Vec<f32>>,
    d_final: Vec<Vec<f32>>,
}

/// A 2-layer bidirectional model when the cell allows it, else 2 layers one way.
fn build(compiled: Arc<CompiledCell>, rng: &mut Rng, backend: &dyn Fn() -> Box<dyn Device>) -> Case {
    let model = support::two_layer_model(&compiled, (3, 2, 2), 7, backend);
    let ld = model.layers().len() * model.directions();
    let states: Vec<usize> = model.layers()[0].state_sizes.clone();
    let h0 = states
        .iter()
        .map(|&n| rng.vec(ld * LENGTHS.len() * n, 0.5).iter().map(|&v| v as f32).collect())
        .collect();
    let d_final = states
        .iter()
        .map(|&n| rng.vec(ld * LENGTHS.len() * n, 1.0).iter().map(|&v| v as f32).collect())
        .collect();
    Case { model, h0, d_final }
}

fn assert_close(what: &str, ours: &[f32], theirs: &[f64]) {
    assert_eq!(ours.len(), theirs.len(), "{what}: length");
    for (i, (&a, &b)) in ours.iter().zip(theirs).enumerate() {
        let err = (a as f64 - b).abs() / b.abs().max(1.0);
        assert!(err < 2e-5, "{what}[{i}]: runtime {a}, oracle {b} (error {err:e})");
    }
}

#[test]
fn reference_backend_matches_per_sequence_interpreter_on_every_cell() {
    conformance(&|| Box::new(Reference));
}

#[test]
fn cpu_backend_with_interpreted_kernels_matches_per_sequence_interpreter() {
    conformance(&|| Box::new(Cpu::new(2, Kernels::Interpreted).expect("cpu backend").split_every_step()));
}

#[test]
fn cpu_backend_with_jit_kernels_matches_per_sequence_interpreter() {
    conformance(&|| Box::new(Cpu::new(2, Kernels::Jit).expect("cpu backend").split_every_step()));
}

#[test]
fn cpu_backend_with_walked_kernels_matches_per_sequence_interpreter() {
    use cellc_runtime::backend::cpu::{avx2_supported, avx512_supported};
    for (kernels, supported) in [(Kernels::Avx512, avx512_supported()), (Kernels::Avx2, avx2_supported())] {
        if !supported {
            eprintln!("skipped {kernels:?}: this processor lacks its instruction set");
            continue;
        }
        conformance(&|| Box::new(Cpu::new(2, kernels).expect("cpu backend").split_every_step()));
    }
}

/// The whole suite, for one backend.
fn conformance(backend: &dyn Fn() -> Box<dyn Device>) {
    let mut rng = Rng::new(11);
    let mut covered = Vec::new();
    for path in support::shipped_cells() {
        if path.file_stem().is_some_and(|s| s == "prelude") {
            continue;
        }
        let compiled = Arc::new(CompiledCell::from_file(&path, None).expect("compiles"));
        let case = build(compiled, &mut rng, backend);
        let m = &case.model;
        let (batch, fin, fout) = (LENGTHS.len(), m.input_size(), m.output_size());
        let xs: Vec<Vec<Vec<f32>>> = LENGTHS
            .iter()
            .map(|&l| (0..l).map(|_| rng.vec(fin, 1.0).iter().map(|&v| v as f32).collect()).collect())
            .collect();
        let d_out: Vec<Vec<Vec<f32>>> = LENGTHS
            .iter()
            .map(|&l| (0..l).map(|_| rng.vec(fout, 1.0).iter().map(|&v| v as f32).collect()).collect())
            .collect();
        let sequences = Batch {
            lengths: LENGTHS.to_vec(),
            steps: STEPS,
            xs: xs.clone(),
            d_out: d_out.clone(),
            h0: case.h0.clone(),
            d_final: case.d_final.clone(),
            resets: Vec::new(),
        };
        // The f64 oracle alone, products unrounded (the f32 twins set tolerances, unused here).
        let want = oracle_in(m, &sequences, Precision::F32).expect("the interpreter runs every sequence");

        for (major, align) in [
            (Major::BatchFirst, Align::Left),
            (Major::BatchFirst, Align::Right),
            (Major::TimeFirst, Align::Left),
            (Major::TimeFirst, Align::Right),
        ] {
            let plan = cellc_runtime::BatchOrder::new(&LENGTHS, STEPS).expect("plan");
            let layout = RowLayout::padded(&plan, STEPS, major, align);
            // Garbage at the padding: the runtime must never read it.
            let mut x = rng.vec(batch * STEPS * fin, 100.0).iter().map(|&v| v as f32).collect::<Vec<f32>>();
            let mut dy = vec![f32::NAN; batch * STEPS * fout];
            for b in 0..batch {
                for t in 0..LENGTHS[b] {
                    let r = layout.row(b, t);
                    x[r * fin..(r + 1) * fin].copy_from_slice(&xs[b][t]);
                    dy[r * fout..(r + 1) * fout].copy_from_slice(&d_out[b][t]);
                }
            }
            let input = Input::Padded { data: &x, batch, steps: STEPS, major, align, lengths: &LENGTHS };
            let name = format!("{} {major:?} {align:?}", m.compiled().forward.name);
            // Evaluation mode, as the interpreter runs (a cell's own masks: tests/cell_masks.rs).
            let (out, trace) = m
                .forward_traced(input, Some(&case.h0), &CallOptions::default())
                .unwrap_or_else(|e| panic!("{name}: forward: {e}"));
            let grads = m
                .backward(&trace, &dy, Some(&case.d_final))
                .unwrap_or_else(|e| panic!("{name}: backward: {e}"));
            for b in 0..batch {
                let shift = if align == Align::Right { STEPS - LENGTHS[b] } else { 0 };
                for p in 0..STEPS {
                    let row = if major == Major::BatchFirst { b * STEPS + p } else { p * batch + b };
                    if p >= shift && p - shift < LENGTHS[b] {
                        let tt = p - shift;
                        assert_eq!(row, layout.row(b, tt));
                        assert_close(
                            &format!("{name} output b{b} t{tt}"),
                            &out.data[row * fout..(row + 1) * fout],
                            &want.out[b][tt],
                        );
                        assert_close(
                            &format!("{name} d_input b{b} t{tt}"),
                            &grads.d_input[row * fin..(row + 1) * fin],
                            &want.d_in[b][tt],
                        );
                    } else {
                        assert!(
                            out.data[row * fout..(row + 1) * fout].iter().all(|&v| v == 0.0),
                            "{name}: padding output not zero"
                        );
                        assert!(
                            grads.d_input[row * fin..(row + 1) * fin].iter().all(|&v| v == 0.0),
                            "{name}: padding grad not zero"
                        );
                    }
                }
            }
            for i in 0..want.finals.len() {
                assert_close(&format!("{name} final state {i}"), &out.final_states[i], &want.finals[i]);
                assert_close(&format!("{name} d_h0 {i}"), &grads.d_h0[i], &want.d_h0[i]);
            }
            for (slot, (ours, theirs)) in grads.d_params.iter().zip(&want.d_params).enumerate() {
                for (p, (a, b)) in ours.iter().zip(theirs).enumerate() {
                    assert_close(&format!("{name} d_param slot {slot} #{p}"), a, b);
                }
            }
        }

        // Packed input gives the same numbers, in packed order.
        let plan = cellc_runtime::BatchOrder::new(&LENGTHS, STEPS).expect("plan");
        let layout = RowLayout::padded(&plan, STEPS, Major::BatchFirst, Align::Left);
        let mut x = vec![0.0f32; batch * STEPS * fin];
        for b in 0..batch {
            for t in 0..LENGTHS[b] {
                let r = layout.row(b, t);
                x[r * fin..(r + 1) * fin].copy_from_slice(&xs[b][t]);
            }
        }
        let packed = PackedSequence::from_padded(&x, &LENGTHS, STEPS, fin, Major::BatchFirst, Align::Left)
            .expect("packs");
        let out = m.forward(Input::Packed(packed.view()), Some(&case.h0)).expect("packed forward");
        let unpacked = PackedSequence { data: out.data, features: fout, ..packed.clone() }
            .to_padded(STEPS, Major::BatchFirst, Align::Left)
            .expect("unpacks");
        for b in 0..batch {
            for t in 0..LENGTHS[b] {
                let r = layout.row(b, t);
                assert_close(
                    &format!("packed output b{b} t{t}"),
                    &unpacked[r * fout..(r + 1) * fout],
                    &want.out[b][t],
                );
            }
        }
        covered.push(format!(
            "{} ({} layers, {})",
            m.compiled().forward.name,
            m.layers().len(),
            if m.directions() == 2 { "bidirectional" } else { "one direction" }
        ));
    }
    assert!(covered.len() >= 14, "{covered:?}");
    eprintln!("covered: {}", covered.join(", "));
}
