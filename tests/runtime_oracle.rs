//! Every shipped cell, run by the runtime's reference backend as a
//! multi-layer bidirectional model over an unsorted variable-length batch
//! (padded, both alignments, both axis orders, and packed), forwards and
//! backwards, against the plainest possible oracle: the interpreter run on
//! each sequence alone, layer by layer, direction by direction.

mod support;

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Backend;
use cellc_runtime::{Align, CompiledCell, Input, Major, Model, PackedSequence, RowLayout};
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
fn build(compiled: Arc<CompiledCell>, rng: &mut Rng, backend: &dyn Fn() -> Box<dyn Backend>) -> Case {
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

/// Per-sequence oracle results, in f64.
struct Oracle {
    /// `out[b][t]`: the last layer's output at step t (both directions).
    out: Vec<Vec<Vec<f64>>>,
    finals: Vec<Vec<f64>>,
    d_in: Vec<Vec<Vec<f64>>>,
    d_h0: Vec<Vec<f64>>,
    d_params: Vec<Vec<Vec<f64>>>,
}

fn oracle(case: &Case, xs: &[Vec<Vec<f32>>], d_out: &[Vec<Vec<f32>>]) -> Oracle {
    let m = &case.model;
    let cell = &m.compiled().cell;
    let grad = &m.compiled().grad;
    let dirs = m.directions();
    let batch = xs.len();
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let nstates = cell.states.len();
    let mut finals: Vec<Vec<f64>> = case.h0.iter().map(|h| vec![0.0; h.len()]).collect();
    let mut d_h0: Vec<Vec<f64>> = case.h0.iter().map(|h| vec![0.0; h.len()]).collect();
    let mut d_params: Vec<Vec<Vec<f64>>> = (0..m.layers().len() * dirs)
        .map(|slot| m.params(slot / dirs, slot % dirs == 1).iter().map(|p| vec![0.0; p.len()]).collect())
        .collect();
    let mut out = Vec::new();
    let mut d_in_all = Vec::new();
    for b in 0..batch {
        let len = xs[b].len();
        // Forward, keeping each layer's input for the backward.
        let mut layer_in: Vec<Vec<Vec<f64>>> = vec![xs[b].iter().map(|r| f64s(r)).collect()];
        for (k, layer) in m.layers().iter().enumerate() {
            let bound = cell.bind(&layer.sizes).expect("binds");
            let mut next = vec![Vec::new(); len];
            for d in 0..dirs {
                let slot = k * dirs + d;
                let params: Vec<Vec<f64>> = m.params(k, d == 1).iter().map(|p| f64s(p)).collect();
                let h0: Vec<Vec<f64>> = (0..nstates)
                    .map(|i| {
                        let n = layer.state_sizes[i];
                        f64s(&case.h0[i][(slot * batch + b) * n..(slot * batch + b + 1) * n])
                    })
                    .collect();
                let mut seq: Vec<Vec<f64>> = layer_in[k].clone();
                if d == 1 {
                    seq.reverse();
                }
                let run = bound.run(&seq.concat(), &h0, &params).expect("runs");
                let o = layer.output_size;
                for s in 0..len {
                    let t = if d == 1 { len - 1 - s } else { s };
                    next[t].extend_from_slice(&run.outputs[s * o..(s + 1) * o]);
                }
                for i in 0..nstates {
                    let n = layer.state_sizes[i];
                    finals[i][(slot * batch + b) * n..(slot * batch + b + 1) * n]
                        .copy_from_slice(&run.final_states[i]);
                }
            }
            layer_in.push(next);
        }
        out.push(layer_in.last().cloned().unwrap_or_default());
        // Backward, last layer first.
        let mut d_above: Vec<Vec<f64>> = d_out[b].iter().map(|r| f64s(r)).collect();
        for (k, layer) in m.layers().iter().enumerate().rev() {
            let bound = cell.bind(&layer.sizes).expect("binds");
            let mut d_below = vec![vec![0.0; layer.input_size]; len];
            for d in 0..dirs {
                let slot = k * dirs + d;
                let params: Vec<Vec<f64>> = m.params(k, d == 1).iter().map(|p| f64s(p)).collect();
                let pick = |buf: &[Vec<f32>], i: usize| {
                    let n = layer.state_sizes[i];
                    f64s(&buf[i][(slot * batch + b) * n..(slot * batch + b + 1) * n])
                };
                let h0: Vec<Vec<f64>> = (0..nstates).map(|i| pick(&case.h0, i)).collect();
                let df: Vec<Vec<f64>> = (0..nstates).map(|i| pick(&case.d_final, i)).collect();
                let o = layer.output_size;
                let order: Vec<usize> = if d == 1 { (0..len).rev().collect() } else { (0..len).collect() };
                let seq: Vec<f64> = order.iter().flat_map(|&t| layer_in[k][t].iter().copied()).collect();
                let dseq: Vec<f64> =
                    order.iter().flat_map(|&t| d_above[t][d * o..(d + 1) * o].iter().copied()).collect();
                let g = bound.backward(grad, &seq, &h0, &params, &dseq, &df).expect("backward");
                for (s, &t) in order.iter().enumerate() {
                    for (acc, v) in d_below[t]
                        .iter_mut()
                        .zip(&g.d_inputs[s * layer.input_size..(s + 1) * layer.input_size])
                    {
                        *acc += v;
                    }
                }
                for i in 0..nstates {
                    let n = layer.state_sizes[i];
                    d_h0[i][(slot * batch + b) * n..(slot * batch + b + 1) * n]
                        .copy_from_slice(&g.d_initial_states[i]);
                }
                for (acc, gp) in d_params[slot].iter_mut().zip(&g.d_params) {
                    acc.iter_mut().zip(gp).for_each(|(a, v)| *a += v);
                }
            }
            d_above = d_below;
        }
        d_in_all.push(d_above);
    }
    Oracle { out, finals, d_in: d_in_all, d_h0, d_params }
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
    conformance(&|| Box::new(Cpu::new(2, Kernels::Interpreted).expect("cpu backend")));
}

#[test]
fn cpu_backend_with_jit_kernels_matches_per_sequence_interpreter() {
    conformance(&|| Box::new(Cpu::new(2, Kernels::Jit).expect("cpu backend")));
}

/// The whole suite, for one backend.
fn conformance(backend: &dyn Fn() -> Box<dyn Backend>) {
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
        let want = oracle(&case, &xs, &d_out);

        for (major, align) in [
            (Major::BatchFirst, Align::Left),
            (Major::BatchFirst, Align::Right),
            (Major::TimeFirst, Align::Left),
            (Major::TimeFirst, Align::Right),
        ] {
            let plan = cellc_runtime::BatchPlan::new(&LENGTHS, STEPS).expect("plan");
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
            let name = format!("{} {major:?} {align:?}", m.compiled().cell.name);
            let (out, trace) =
                m.forward_train(input, Some(&case.h0)).unwrap_or_else(|e| panic!("{name}: forward: {e}"));
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
        let plan = cellc_runtime::BatchPlan::new(&LENGTHS, STEPS).expect("plan");
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
        let out = m.forward(Input::Packed(&packed), Some(&case.h0)).expect("packed forward");
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
            m.compiled().cell.name,
            m.layers().len(),
            if m.directions() == 2 { "bidirectional" } else { "one direction" }
        ));
    }
    assert!(covered.len() >= 14, "{covered:?}");
    eprintln!("covered: {}", covered.join(", "));
}
