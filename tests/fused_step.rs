//! The fused step on the CPU (each thread computes its tiles' columns of a
//! step's products and then the pointwise stage on them) against the
//! unfused step: the same bits, forwards and backwards, on every shipped
//! cell the compiler fuses, at sizes whose last tile is narrower than the
//! others, with unsorted variable lengths; on one, two and three sequences
//! (two threads split units, one barrier a step), and on sixteen and more
//! on one and two threads (each owns its sequences and runs the input
//! projection in the step, tile by tile). Cells whose step does not fuse
//! but whose input projection may run in the step run it there on sixteen
//! sequences and more, with the same bits as before the loop. And proof
//! that each ran: the fused step's pointwise work, and the input
//! projection of a thread that owns its rows, are timed with the products.
//! The backward step split by units (each thread runs every stage on its
//! own units of every row) gives the whole-row step's bits likewise, on
//! every shipped cell whose backward splits and on random cells, its
//! vectors of several blocks gathered and written back.

mod support;

use cellc_runtime::backend::cpu::{profile, Cpu, Kernels};
use cellc_runtime::{
    Align, CallOptions, CompiledCell, Input, Major, MaskSeed, Model, ModelConfig, Precision,
};
use std::sync::{Arc, Mutex};

/// The profiler's switch and counters are the process's: one test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn cpu(threads: usize, fused: bool) -> Box<Cpu> {
    let cpu = Cpu::new(threads, Kernels::default()).expect("cpu").split_every_step();
    Box::new(if fused { cpu } else { cpu.unfused() })
}

fn model(
    cell: &Arc<CompiledCell>,
    (h, layers, precision): (usize, usize, Precision),
    (threads, fused): (usize, bool),
) -> Option<Model> {
    let config = ModelConfig { layers, bidirectional: layers > 1 };
    let m = support::try_model(cell, (h, (h / 2).max(1), 5), &config, 11, cpu(threads, fused))?;
    Some(m.with_precision(precision).expect("the cpu computes f32 and bf16"))
}

/// Both steps on `lengths` on two threads, training (masks drawn alike)
/// and inference: outputs, final states, and the backward's gradients,
/// bit for bit.
fn same_bits(cell: &Arc<CompiledCell>, at: (usize, usize, Precision), lengths: &[usize]) {
    same_bits_on(2, cell, at, lengths)
}

/// [`same_bits`] on `threads` threads.
fn same_bits_on(
    threads: usize,
    cell: &Arc<CompiledCell>,
    (h, layers, precision): (usize, usize, Precision),
    lengths: &[usize],
) {
    let name = &cell.forward.name;
    let at = (h, layers, precision);
    let (Some(fused), Some(unfused)) = (model(cell, at, (threads, true)), model(cell, at, (threads, false)))
    else {
        return;
    };
    let what = format!("{name} H={h} layers={layers} {precision:?} lengths={lengths:?} threads={threads}");
    compare(&fused, &unfused, lengths, &what);
}

/// The fused and unfused models' results on `lengths`, bit for bit (see [`same_bits`]).
fn compare(fused: &Model, unfused: &Model, lengths: &[usize], what: &str) {
    let h = fused.output_size();
    let (b, t) = (lengths.len(), lengths.iter().copied().max().unwrap_or(1));
    let mut rng = support::Rng::new(h as u64 * 31 + b as u64);
    let x: Vec<f32> = rng.vec(b * t * fused.input_size(), 1.0).iter().map(|&v| v as f32).collect();
    let dy: Vec<f32> = rng.vec(b * t * fused.output_size(), 1.0).iter().map(|&v| v as f32).collect();
    let input =
        Input::Padded { data: &x, batch: b, steps: t, major: Major::TimeFirst, align: Align::Left, lengths };
    let (a, z) = (fused.forward(input, None).expect("fused"), unfused.forward(input, None).expect("unfused"));
    assert_eq!(bits(&a.data), bits(&z.data), "{what}: outputs");
    assert_eq!(bits(&a.final_states.concat()), bits(&z.final_states.concat()), "{what}: final states");
    let options = CallOptions { masks: Some(MaskSeed { seed: 5, offset: 0 }), ..Default::default() };
    let (a, ta) = fused.forward_traced(input, None, &options).expect("fused training");
    let (z, tz) = unfused.forward_traced(input, None, &options).expect("unfused training");
    assert_eq!(bits(&a.data), bits(&z.data), "{what}: training outputs");
    let (ga, gz) =
        (fused.backward(&ta, &dy, None).expect("backward"), unfused.backward(&tz, &dy, None).expect("b"));
    assert_eq!(bits(&ga.d_input), bits(&gz.d_input), "{what}: input gradients");
    let params = |g: &cellc_runtime::Gradients| bits(&g.d_params.concat().concat());
    assert_eq!(params(&ga), params(&gz), "{what}: parameter gradients");
}

/// Each float's bits (a NaN equals the same NaN).
fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn random_cells_give_the_same_bits_fused_sunk_or_not() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (mut fused, mut sunk, mut split) = (0, 0, 0);
    for seed in 0..120u64 {
        let spec =
            cellc::fuzzgen::generate(&mut cellc::fuzzgen::Entropy::seeded(seed), &format!("fuzz{seed}"));
        let Ok(cell) = CompiledCell::from_source("fuzz.cell", &spec.to_string(), None) else { continue };
        let cell = Arc::new(cell);
        let schedule = cell.schedule(&support::cell_sizes(&cell, 24, 8));
        if schedule.fusion.is_empty() && schedule.sinkable.is_empty() && schedule.backward_units.is_none() {
            continue;
        }
        fused += usize::from(!schedule.fusion.is_empty());
        split += usize::from(schedule.backward_units.is_some());
        sunk += usize::from(!schedule.sinkable.is_empty());
        // Every size 24 (the input's from them): a random cell's input may be `[I + J]`.
        let sizes: cellc::dims::Bindings = cell.forward.sizes.iter().map(|k| (k.clone(), 24)).collect();
        let input = cell.forward.input_dim().eval(&sizes).map_or(24, |n| n as usize);
        let config = ModelConfig { layers: 1, bidirectional: false };
        let model =
            |fused| Model::new(cell.clone(), config.clone(), &sizes, Some(input), None, 7, cpu(2, fused));
        let (Ok(f), Ok(u)) = (model(true), model(false)) else { continue };
        let ragged: Vec<usize> = (0..17).map(|i| 1 + (i * 3) % 5).collect();
        for lengths in [&[4, 2][..], &ragged] {
            compare(&f, &u, lengths, &format!("random cell {seed} lengths={lengths:?}:\n{spec}"));
        }
    }
    assert!(
        fused >= 10 && sunk >= 10 && split >= 3,
        "random cells that fuse: {fused}, that sink: {sunk}, whose backward splits: {split}"
    );
}

/// The shipped cells whose schedule satisfies `which` (which stages fuse
/// or may run in the step does not depend on the sizes).
fn shipped_cells_where(which: fn(&cellc::schedule::Schedule) -> bool) -> Vec<Arc<CompiledCell>> {
    let schedule = |c: &Arc<CompiledCell>| c.schedule(&support::cell_sizes(c, 64, 32));
    support::compiled_cells().into_iter().filter(|c| which(&schedule(c))).collect()
}

/// [`same_bits`] on one to three sequences, where two threads split the
/// units: 40 units (the forward's tiles and the backward's shares, 32 and
/// a narrower last 8), 17 (a narrower last tile; too few units for two
/// shares of whole panels: the backward runs whole rows) and 64 (even);
/// two layers, and bf16.
fn same_bits_on_few_sequences(cell: &Arc<CompiledCell>) {
    for h in [17, 40, 64] {
        for lengths in [&[5][..], &[3, 6], &[4, 1, 6]] {
            same_bits(cell, (h, 1, Precision::F32), lengths);
        }
    }
    same_bits(cell, (24, 2, Precision::F32), &[2, 5, 3]);
    same_bits(cell, (40, 1, Precision::Bf16), &[3, 6]);
}

#[test]
fn every_fused_cell_gives_the_unfused_bits() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let fused = shipped_cells_where(|s| !s.fusion.is_empty());
    for cell in &fused {
        same_bits_on_few_sequences(cell);
        // Threads that own their sequences: unsorted lengths, a full grid,
        // tiles narrower than the units and a narrower last one.
        let ragged: Vec<usize> = (0..17).map(|i| 1 + (i * 7) % 6).collect();
        for (h, lengths) in [(40, &ragged[..]), (300, &[4; 16][..])] {
            same_bits(cell, (h, 1, Precision::F32), lengths);
        }
        same_bits(cell, (24, 2, Precision::F32), &ragged);
        same_bits(cell, (40, 1, Precision::Bf16), &ragged);
        same_bits_on(1, cell, (300, 1, Precision::F32), &ragged[..9]);
    }
    assert!(fused.len() >= 8, "the compiler fuses the LSTMs, GRUs and the RNN: {}", fused.len());
}

#[test]
fn every_backward_split_by_units_gives_the_whole_row_bits() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let split = shipped_cells_where(|s| s.backward_units.is_some());
    for cell in &split {
        same_bits_on_few_sequences(cell);
        same_bits_on(3, cell, (96, 1, Precision::F32), &[4, 2]);
    }
    assert!(split.len() >= 8, "the LSTMs' and GRUs' backward steps split: {}", split.len());
}

#[test]
fn a_backward_split_by_units_gathers_vectors_of_several_blocks() {
    // The backward reads `a` (two blocks of H) at each step and writes the
    // gates' adjoint (two blocks): a thread's units of each block are
    // gathered into a row of their own, and written back from one.
    let src = "cell wide { input x[H] state h[H] param w[2*H, H], b[2*H]
        let a = w @ h + b
        let p, q = chunk(a * a, 2)
        h' = tanh(p + x) * sigmoid(q)
        output h' }";
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cell = Arc::new(CompiledCell::from_source("wide.cell", src, None).expect("compiles"));
    let schedule = cell.schedule(&[("H".to_string(), 40)].into());
    let split = schedule.backward_units.as_ref().expect("the backward splits by units");
    let reads_wide = split.stages.iter().any(|&k| {
        let st = &schedule.backward[k];
        st.inputs.iter().chain(&st.outputs).any(|&v| split.blocks_of(v) > 1)
    });
    assert!(reads_wide, "a kernel reads or writes two blocks: {schedule:?}");
    for (h, lengths) in [(32, &[4][..]), (40, &[2, 5]), (72, &[3, 1, 2])] {
        same_bits(&cell, (h, 1, Precision::F32), lengths);
        same_bits_on(3, &cell, (h, 1, Precision::F32), lengths);
    }
}

#[test]
fn input_projections_run_in_the_step_give_the_bits_of_before_the_loop() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let sinking = shipped_cells_where(|s| !s.sinkable.is_empty());
    for cell in &sinking {
        let ragged: Vec<usize> = (0..17).map(|i| 1 + (i * 5) % 7).collect();
        same_bits(cell, (40, 1, Precision::F32), &ragged);
        same_bits(cell, (24, 2, Precision::F32), &ragged);
        same_bits(cell, (40, 1, Precision::Bf16), &[6; 16]);
        same_bits_on(1, cell, (40, 1, Precision::F32), &ragged[..9]);
    }
    assert!(
        sinking.len() >= 10,
        "most shipped cells' input projections may run in the step: {}",
        sinking.len()
    );
}

#[test]
fn states_that_swap_fuse_and_read_the_previous_step() {
    // `a' = b`: the new `a` is the old `b`, moved per unit by each thread.
    let src = "cell swap { input x[H] state a[H], b[H] param w[2*H, H]
        let p, q = chunk(w @ a, 2)
        a' = b
        b' = tanh(p + x) * sigmoid(q)
        output a' + b' }";
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cell = Arc::new(CompiledCell::from_source("swap.cell", src, None).expect("compiles"));
    assert_eq!(cell.schedule(&[("H".to_string(), 40)].into()).fusion.len(), 1);
    for (h, lengths) in [(32, &[4][..]), (40, &[2, 5]), (48, &[3, 1, 2])] {
        same_bits(&cell, (h, 1, Precision::F32), lengths);
    }
}

/// The pointwise, products and before-the-loop times of an LSTM's
/// forward on `lengths`, fused or not: each the least of five calls.
fn phases(fused: bool, lengths: &[usize]) -> [f64; 3] {
    phases_of(("lstm", Precision::F32), fused, lengths)
}

/// [`phases`] of the shipped cell `name` with products at `precision`.
fn phases_of((name, precision): (&str, Precision), fused: bool, lengths: &[usize]) -> [f64; 3] {
    let cell = support::compiled_cells().into_iter().find(|c| c.forward.name == name).expect("cell");
    let m = model(&cell, (64, 1, precision), (2, fused)).expect("model");
    let steps = lengths.iter().copied().max().unwrap_or(1);
    let x = vec![0.5f32; lengths.len() * steps * m.input_size()];
    let input = Input::Padded {
        data: &x,
        batch: lengths.len(),
        steps,
        major: Major::TimeFirst,
        align: Align::Left,
        lengths,
    };
    // The least of a few calls' times per phase: a shared machine's stalls
    // (a call preempted, the first call's pages) would otherwise blur which
    // phase runs what.
    let mut least = [f64::INFINITY; 3];
    profile::enable(true);
    for _ in 0..5 {
        let _ = profile::take();
        m.forward(input, None).expect("forward");
        let taken = profile::take();
        let phase = |p: profile::Phase| taken.iter().find(|(q, _)| *q == p).map_or(0.0, |(_, s)| *s);
        let phases = [
            phase(profile::Phase::Pointwise),
            phase(profile::Phase::Products),
            phase(profile::Phase::BeforeLoop),
        ];
        for (l, p) in least.iter_mut().zip(phases) {
            *l = l.min(p);
        }
    }
    profile::enable(false);
    least
}

#[test]
fn the_fused_step_runs_its_pointwise_work_with_the_products() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // Threads that split units.
    let [pointwise, products, _] = phases(true, &[3, 2]);
    assert_eq!(pointwise, 0.0, "no pointwise stage of its own");
    assert!(products > 0.0);
    assert!(phases(false, &[3, 2])[0] > 0.0, "the unfused step runs its pointwise stage apart");
    // Threads that own their rows also run the input projection in the step.
    let many = [20; 16];
    let [pointwise, _, before_loop] = phases(true, &many);
    assert_eq!(pointwise, 0.0, "no pointwise stage of its own");
    let unfused = phases(false, &many);
    assert!(unfused[0] > 0.0);
    assert!(
        before_loop < unfused[2] / 4.0,
        "the input projection runs in the step: {before_loop} s before the loop, {} s unfused",
        unfused[2]
    );
    // A step that does not fuse (a LayerNorm's reductions) runs it there too.
    let layernorm = ("layernorm_lstm", Precision::F32);
    let [pointwise, _, before_loop] = phases_of(layernorm, true, &many);
    let unfused = phases_of(layernorm, false, &many);
    assert!(pointwise > 0.0, "the LayerNorm-LSTM's step does not fuse");
    assert!(
        before_loop < unfused[2] / 4.0,
        "its input projection runs in the step: {before_loop} s before the loop, {} s unfused",
        unfused[2]
    );
}

/// Products bound by streaming their weights (bf16 on AMX tiles) keep the
/// input projection before the loop, where each thread reads its share of
/// the weight once; elsewhere bf16 runs it in the step, as f32 does.
#[test]
fn products_bound_by_their_weights_keep_the_input_projection_before_the_loop() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let many = [20; 16];
    let lstm = ("lstm", Precision::Bf16);
    let [_, _, before_loop] = phases_of(lstm, true, &many);
    let unfused = phases_of(lstm, false, &many)[2];
    if cellc_runtime::backend::cpu::product::bound_by_weights(Precision::Bf16) {
        assert!(before_loop > unfused / 4.0, "before the loop: {before_loop} s, {unfused} s unfused");
    } else {
        assert!(
            before_loop < unfused / 4.0,
            "in the step: {before_loop} s before the loop, {unfused} s unfused"
        );
    }
}
