//! The fused step on the CPU (each thread computes its tiles' columns of a
//! step's products and then the pointwise stage on them) against the
//! unfused step: the same bits, forwards and backwards, on every shipped
//! cell the compiler fuses, at sizes whose last tile is narrower than the
//! others, with unsorted variable lengths; on one, two and three sequences
//! (two threads split units, one barrier a step), and on sixteen and more
//! on one and two threads (each owns its sequences and runs the input
//! projection in the step, tile by tile). And proof that the fused step
//! ran: its pointwise work, and the input projection of a thread that owns
//! its rows, are timed with the products.

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
    let (b, t) = (lengths.len(), lengths.iter().copied().max().unwrap_or(1));
    let mut rng = support::Rng::new(h as u64 * 31 + b as u64);
    let x: Vec<f32> = rng.vec(b * t * fused.input_size(), 1.0).iter().map(|&v| v as f32).collect();
    let dy: Vec<f32> = rng.vec(b * t * fused.output_size(), 1.0).iter().map(|&v| v as f32).collect();
    let input =
        Input::Padded { data: &x, batch: b, steps: t, major: Major::TimeFirst, align: Align::Left, lengths };
    let what = format!("{name} H={h} layers={layers} {precision:?} lengths={lengths:?} threads={threads}");
    let (a, z) = (fused.forward(input, None).expect("fused"), unfused.forward(input, None).expect("unfused"));
    assert_eq!(a.data, z.data, "{what}: outputs");
    assert_eq!(a.final_states, z.final_states, "{what}: final states");
    let options = CallOptions { masks: Some(MaskSeed { seed: 5, offset: 0 }), ..Default::default() };
    let (a, ta) = fused.forward_traced(input, None, &options).expect("fused training");
    let (z, tz) = unfused.forward_traced(input, None, &options).expect("unfused training");
    assert_eq!(a.data, z.data, "{what}: training outputs");
    let (ga, gz) =
        (fused.backward(&ta, &dy, None).expect("backward"), unfused.backward(&tz, &dy, None).expect("b"));
    assert_eq!(ga.d_input, gz.d_input, "{what}: input gradients");
    assert_eq!(ga.d_params, gz.d_params, "{what}: parameter gradients");
}

#[test]
fn every_fused_cell_gives_the_unfused_bits() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut fused_cells = 0;
    for cell in support::compiled_cells() {
        // Which stages fuse does not depend on the sizes.
        if cell.schedule(&support::cell_sizes(&cell, 64, 32)).fusion.is_empty() {
            continue;
        }
        fused_cells += 1;
        // 40 and 17 units: a last tile narrower than the first; 64: even tiles.
        for h in [17, 40, 64] {
            for lengths in [&[5][..], &[3, 6], &[4, 1, 6]] {
                same_bits(&cell, (h, 1, Precision::F32), lengths);
            }
        }
        same_bits(&cell, (24, 2, Precision::F32), &[2, 5, 3]);
        same_bits(&cell, (40, 1, Precision::Bf16), &[3, 6]);
        // Threads that own their sequences: unsorted lengths, a full grid,
        // tiles narrower than the units and a narrower last one.
        let ragged: Vec<usize> = (0..17).map(|i| 1 + (i * 7) % 6).collect();
        for (h, lengths) in [(40, &ragged[..]), (300, &[4; 16][..])] {
            same_bits(&cell, (h, 1, Precision::F32), lengths);
        }
        same_bits(&cell, (24, 2, Precision::F32), &ragged);
        same_bits(&cell, (40, 1, Precision::Bf16), &ragged);
        same_bits_on(1, &cell, (300, 1, Precision::F32), &ragged[..9]);
    }
    assert!(fused_cells >= 8, "the compiler fuses the LSTMs, GRUs and the RNN: {fused_cells}");
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
/// forward on `lengths`, fused or not.
fn phases(fused: bool, lengths: &[usize]) -> [f64; 3] {
    let cell = support::compiled_cells().into_iter().find(|c| c.forward.name == "lstm").expect("lstm");
    let m = model(&cell, (64, 1, Precision::F32), (2, fused)).expect("model");
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
    profile::enable(true);
    let _ = profile::take();
    m.forward(input, None).expect("forward");
    let taken = profile::take();
    profile::enable(false);
    let phase = |p: profile::Phase| taken.iter().find(|(q, _)| *q == p).map_or(0.0, |(_, s)| *s);
    [phase(profile::Phase::Pointwise), phase(profile::Phase::Products), phase(profile::Phase::BeforeLoop)]
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
}
