//! The CPU backend and the reference backend against the f64 interpreter
//! on random shapes: every shipped cell, random sizes (1, odd, not
//! multiples of the SIMD width), random unsorted lengths, every layout,
//! 1-2 layers, one or two directions, forward and backward — and
//! bitwise-identical results from run to run at a given thread count.

mod support;

use cellc_difftest::backends::BackendKind;
use cellc_difftest::check::{check, Case, Checks};
use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::{Align, CallOptions, CompiledCell, Input, Major, MaskSeed, Model, ModelConfig};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

fn cells() -> &'static Vec<(String, Arc<CompiledCell>)> {
    static CELLS: OnceLock<Vec<(String, Arc<CompiledCell>)>> = OnceLock::new();
    CELLS.get_or_init(|| {
        support::shipped_cells()
            .iter()
            .filter(|p| p.file_stem().is_some_and(|s| s != "prelude"))
            .map(|p| {
                let source = std::fs::read_to_string(p).expect("reads");
                let compiled = CompiledCell::from_file(p, None).expect("compiles");
                (source, Arc::new(compiled))
            })
            .collect()
    })
}

/// The shipped cell `name`.
fn shipped(name: &str) -> Arc<CompiledCell> {
    cells().iter().map(|(_, c)| c).find(|c| c.forward.name == name).expect("a shipped cell").clone()
}

/// The shipped LSTM.
fn lstm() -> Arc<CompiledCell> {
    shipped("lstm")
}

fn build(
    cell: &Arc<CompiledCell>,
    h: usize,
    i: usize,
    config: &ModelConfig,
    backend: Box<dyn Device>,
) -> Option<Model> {
    support::try_model(cell, (h, (h / 2).max(1), i), config, 3, backend)
}

/// A padded batch, batch first, each sequence from the first step.
fn batch_first<'a>(data: &'a [f32], (batch, steps): (usize, usize), lengths: &'a [usize]) -> Input<'a> {
    Input::Padded { data, batch, steps, major: Major::BatchFirst, align: Align::Left, lengths }
}

/// The case's sizes for a shipped cell: `H`, `P` (a projection, half of
/// `H`) and `I` (the input), where the cell has them.
fn case_sizes(cell: &CompiledCell, h: usize, i: usize) -> BTreeMap<String, usize> {
    let mut sizes: BTreeMap<String, usize> =
        support::cell_sizes(cell, h, (h / 2).max(1)).into_iter().collect();
    if cell.forward.sizes.iter().any(|v| v == "I") {
        sizes.insert("I".to_string(), i);
    }
    sizes
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Both back ends against the f64 per-sequence interpreter, each held
    /// to `BASE_TOLERANCE` or to a multiple of the f32 interpreter's own
    /// rounding over the pass, whichever is larger (`cellc_difftest`'s
    /// one rule): a LayerNorm over two elements amplifies rounding by
    /// orders of magnitude, and two f32 back ends summing in different
    /// orders differ by what f32 can compute there, not by a fixed bound.
    /// The layouts (axis order, alignment) follow from the seed.
    #[test]
    fn cpu_equals_reference(
        cell in 0usize..17,
        h in prop::sample::select(vec![1usize, 2, 3, 5, 7, 9, 17]),
        i in 1usize..6,
        layers in 1usize..3,
        bidirectional in any::<bool>(),
        lengths in prop::collection::vec(1usize..7, 1..12),
        padded_beyond in any::<bool>(),
        resets in prop::collection::vec((0usize..12, 0usize..7), 0..4),
        seed in any::<u64>(),
    ) {
        let cells = cells();
        let (source, c) = &cells[cell % cells.len()];
        let steps = lengths.iter().copied().max().unwrap_or(1) + usize::from(padded_beyond);
        let case = Case { seed, sizes: case_sizes(c, h, i), layers, bidirectional, lengths, steps, resets };
        let plan = Checks { gradcheck: false, backends: vec![BackendKind::Reference, BackendKind::CpuJit] };
        let name = &c.forward.name;
        check(source, &case, &plan).map_err(|f| TestCaseError::fail(format!("{name}: {f}")))?;
    }

    /// The CPU back end gives the same bits from run to run at a given
    /// thread count, forwards and backwards.
    #[test]
    fn cpu_is_bitwise_repeatable(
        cell in 0usize..17,
        h in prop::sample::select(vec![1usize, 3, 17]),
        layers in 1usize..3,
        bidirectional in any::<bool>(),
        lengths in prop::collection::vec(1usize..7, 1..12),
        seed in any::<u64>(),
    ) {
        let cells = cells();
        let (_, c) = &cells[cell % cells.len()];
        let config = ModelConfig { layers, bidirectional };
        let Some(cpu) = build(c, h, 4, &config, Box::new(Cpu::new(2, Kernels::default()).expect("cpu").split_every_step())) else {
            return Ok(());
        };
        let mut rng = support::Rng::new(seed);
        let (b, t) = (lengths.len(), lengths.iter().copied().max().unwrap_or(1));
        let x: Vec<f32> = rng.vec(b * t * cpu.input_size(), 1.0).iter().map(|&v| v as f32).collect();
        let dy: Vec<f32> = rng.vec(b * t * cpu.output_size(), 1.0).iter().map(|&v| v as f32).collect();
        let input =
            Input::Padded { data: &x, batch: b, steps: t, major: Major::TimeFirst, align: Align::Right, lengths: &lengths };
        // Training mode, the same masks (where the cell draws any) both times.
        let masks = Some(MaskSeed { seed, offset: 1 });
        let (o1, tr1) = cpu.forward_traced(input, None, &CallOptions { masks, ..Default::default() }).expect("cpu forward");
        let g1 = cpu.backward(&tr1, &dy, None).expect("cpu backward");
        let (o2, tr2) = cpu.forward_traced(input, None, &CallOptions { masks, ..Default::default() }).expect("cpu forward again");
        let g2 = cpu.backward(&tr2, &dy, None).expect("cpu backward again");
        prop_assert_eq!(&o2.data, &o1.data);
        prop_assert_eq!(&o2.final_states, &o1.final_states);
        prop_assert_eq!(&g2.d_input, &g1.d_input);
        prop_assert_eq!(&g2.d_params, &g1.d_params);
    }
}

#[test]
fn large_batches_split_across_threads_identically() {
    // Enough rows and columns that pointwise stages and per-step GEMMs split.
    let c = lstm();
    let config = ModelConfig { layers: 1, bidirectional: false };
    let one =
        build(&c, 96, 32, &config, Box::new(Cpu::new(1, Kernels::default()).expect("cpu"))).expect("model");
    let two = build(
        &c,
        96,
        32,
        &config,
        Box::new(Cpu::new(2, Kernels::default()).expect("cpu").split_every_step()),
    )
    .expect("model");
    let reference = build(&c, 96, 32, &config, Box::new(Reference)).expect("model");
    let lengths: Vec<usize> = (0..24).map(|k| 3 + k % 5).collect();
    let mut rng = support::Rng::new(9);
    let x: Vec<f32> = rng.vec(24 * 7 * 32, 1.0).iter().map(|&v| v as f32).collect();
    let input = batch_first(&x, (24, 7), &lengths);
    let a = one.forward(input, None).expect("1 thread");
    let b = two.forward(input, None).expect("2 threads");
    let r = reference.forward(input, None).expect("reference");
    for ((x, y), z) in a.data.iter().zip(&b.data).zip(&r.data) {
        assert!((x - z).abs() < 1e-4 && (y - z).abs() < 1e-4, "{x} {y} {z}");
    }
    assert_eq!(two.forward(input, None).expect("again").data, b.data, "2 threads: bitwise run to run");
}

#[test]
fn weight_gradients_over_long_runs_split_by_rows() {
    // A full-length batch is one run of B*T rows; with at least 512 rows a
    // thread, each thread sums its own rows' weight gradients (and with
    // fewer, its columns): both against the reference back end, and the
    // two-thread result bitwise run to run.
    let config = ModelConfig { layers: 1, bidirectional: false };
    for (name, steps) in [("lstm", 400), ("gru", 400), ("lstm", 100)] {
        let c = shipped(name);
        let cpu = Cpu::new(2, Kernels::default()).expect("cpu").split_every_step();
        let two = build(&c, 40, 24, &config, Box::new(cpu)).expect("model");
        let reference = build(&c, 40, 24, &config, Box::new(Reference)).expect("model");
        let (b, t) = (3, steps);
        let lengths = vec![t; b];
        let mut rng = support::Rng::new(5);
        let x: Vec<f32> = rng.vec(b * t * 24, 1.0).iter().map(|&v| v as f32).collect();
        let dy: Vec<f32> = rng.vec(b * t * two.output_size(), 0.1).iter().map(|&v| v as f32).collect();
        let input = batch_first(&x, (b, t), &lengths);
        let gradients = |m: &Model| {
            let (_, trace) = m.forward_traced(input, None, &CallOptions::default()).expect("forward");
            m.backward(&trace, &dy, None).expect("backward")
        };
        let (ours, want) = (gradients(&two), gradients(&reference));
        for (k, (a, w)) in ours.d_params[0].iter().zip(&want.d_params[0]).enumerate() {
            let norm = w.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-3);
            let err = a.iter().zip(w).map(|(a, w)| (a - w) * (a - w)).sum::<f32>().sqrt() / norm;
            assert!(err < 1e-4, "{name} T={t}: parameter {k}'s gradient off by {err:e} (relative norm)");
        }
        assert_eq!(gradients(&two).d_params, ours.d_params, "{name} T={t}: 2 threads, bitwise run to run");
    }
}

#[test]
fn products_over_one_long_run_give_the_same_bits_on_any_thread_count() {
    // A full-length batch is one run of B*T rows: its products over rows
    // (the input projection, the input's adjoint) are cut into pieces by
    // rows, one a thread, where each piece is long, and split by columns
    // where not. Every row is computed alike either way.
    let config = ModelConfig { layers: 1, bidirectional: false };
    let c = lstm();
    let (b, t, i) = (8, 100, 24);
    let lengths = vec![t; b];
    let mut rng = support::Rng::new(11);
    let x: Vec<f32> = rng.vec(b * t * i, 1.0).iter().map(|&v| v as f32).collect();
    let input = batch_first(&x, (b, t), &lengths);
    let run = |threads: usize| {
        let cpu = Cpu::new(threads, Kernels::default()).expect("cpu");
        let m = build(&c, 40, i, &config, Box::new(cpu)).expect("model");
        let dy: Vec<f32> =
            support::Rng::new(12).vec(b * t * m.output_size(), 0.1).iter().map(|&v| v as f32).collect();
        let out = m.forward(input, None).expect("forward").data;
        let (_, trace) = m.forward_traced(input, None, &CallOptions::default()).expect("forward");
        (out, m.backward(&trace, &dy, None).expect("backward").d_input)
    };
    let one = run(1);
    for threads in [2, 3] {
        let (out, d_input) = run(threads);
        assert_eq!(bits(&out), bits(&one.0), "{threads} threads: the output");
        assert_eq!(bits(&d_input), bits(&one.1), "{threads} threads: the input's adjoint");
    }
}

#[test]
fn gradients_summed_over_rows_do_not_depend_on_threads_or_splits() {
    // A vector parameter's gradient (a bias, a LayerNorm gain) is each
    // sequence's rows added in the backward's order, then the sequences in
    // order: the same bits on one, two and three threads, whether threads
    // own sequences or split units, fused or not; and near the reference's.
    let config = ModelConfig { layers: 2, bidirectional: true };
    for name in ["lstm", "layernorm_lstm", "gru", "layernorm_gru"] {
        let c = shipped(name);
        let vectors: Vec<usize> = (c.forward.params.iter().enumerate())
            .filter(|(_, p)| matches!(p.ty, cellc::ir::Type::Vector(_)))
            .map(|(k, _)| k)
            .collect();
        assert!(!vectors.is_empty(), "{name} has vector parameters");
        let cpus = [
            Cpu::new(1, Kernels::default()).expect("cpu"),
            Cpu::new(2, Kernels::default()).expect("cpu"),
            Cpu::new(2, Kernels::default()).expect("cpu").split_every_step(),
            Cpu::new(2, Kernels::default()).expect("cpu").split_every_step().unfused(),
            Cpu::new(3, Kernels::default()).expect("cpu").split_every_step(),
        ];
        let lengths = [5, 9, 2, 9, 7, 1, 8];
        let (b, t) = (lengths.len(), 9);
        let mut rng = support::Rng::new(17);
        let reference = build(&c, 20, 12, &config, Box::new(Reference))
            .unwrap_or_else(|| panic!("{name}: no model at H=20"));
        let x: Vec<f32> = rng.vec(b * t * reference.input_size(), 1.0).iter().map(|&v| v as f32).collect();
        let dy: Vec<f32> = rng.vec(b * t * reference.output_size(), 0.5).iter().map(|&v| v as f32).collect();
        let input = Input::Padded {
            data: &x,
            batch: b,
            steps: t,
            major: Major::TimeFirst,
            align: Align::Left,
            lengths: &lengths,
        };
        let vector_gradients = |m: &Model| -> Vec<Vec<Vec<f32>>> {
            let (_, trace) = m.forward_traced(input, None, &CallOptions::default()).expect("forward");
            let g = m.backward(&trace, &dy, None).expect("backward");
            g.d_params.iter().map(|d| vectors.iter().map(|&k| d[k].clone()).collect()).collect()
        };
        let want = vector_gradients(&reference);
        let mut first: Option<Vec<Vec<Vec<f32>>>> = None;
        for (i, cpu) in cpus.into_iter().enumerate() {
            let got = vector_gradients(&build(&c, 20, 12, &config, Box::new(cpu)).expect("model"));
            for (a, w) in got.iter().flatten().flatten().zip(want.iter().flatten().flatten()) {
                assert!(
                    (a - w).abs() <= 1e-4 * (1.0 + w.abs()),
                    "{name}, back end {i}: {a} against the reference's {w}"
                );
            }
            match &first {
                None => first = Some(got),
                Some(f) => assert!(
                    f.iter()
                        .flatten()
                        .flatten()
                        .zip(got.iter().flatten().flatten())
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{name}: back end {i}'s sums differ from one thread's"
                ),
            }
        }
    }
}

#[test]
fn kept_rows_read_in_place_give_the_copied_bits() {
    // On a batch of equal lengths the backward's per-step product reads the
    // rows it keeps for after the loop where they lie (evenly spaced at the
    // layout); with a shorter sequence first, they are not, and the rows are
    // copied. Each sequence's input gradient is its own: the same bits.
    let config = ModelConfig { layers: 1, bidirectional: true };
    for name in ["lstm", "gru", "layernorm_lstm"] {
        let c = shipped(name);
        for threads in [1, 2] {
            let cpu = || Box::new(Cpu::new(threads, Kernels::default()).expect("cpu"));
            let m = build(&c, 24, 10, &config, cpu()).expect("model");
            let (t, f, o) = (6, m.input_size(), m.output_size());
            let mut rng = support::Rng::new(23);
            let x: Vec<f32> = rng.vec(4 * t * f, 1.0).iter().map(|&v| v as f32).collect();
            let dy: Vec<f32> = rng.vec(4 * t * o, 0.5).iter().map(|&v| v as f32).collect();
            let d_input = |lengths: &[usize], x: &[f32], dy: &[f32]| {
                let input = Input::Padded {
                    data: x,
                    batch: lengths.len(),
                    steps: t,
                    major: Major::BatchFirst,
                    align: Align::Left,
                    lengths,
                };
                let (_, trace) = m.forward_traced(input, None, &CallOptions::default()).expect("forward");
                m.backward(&trace, dy, None).expect("backward").d_input
            };
            let even = d_input(&[t, t, t], &x[t * f..], &dy[t * o..]);
            let uneven = d_input(&[1, t, t, t], &x, &dy);
            assert_eq!(
                bits(&even),
                bits(&uneven[t * f..]),
                "{name} on {threads} threads: equal lengths against a shorter sequence first"
            );
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn calls_from_inside_the_pool_take_turns() {
    // A program running on the back end's own threads (`Cpu::install`)
    // makes two calls at once: rayon may run the second on the very thread
    // the first waits on, which must neither deadlock nor change a bit.
    let c = lstm();
    let config = ModelConfig { layers: 1, bidirectional: false };
    let cpu = Arc::new(Cpu::new(2, Kernels::default()).expect("cpu").split_every_step());
    let model = Arc::new(build(&c, 40, 8, &config, Box::new(cpu.clone())).expect("model"));
    let lengths: Vec<usize> = (0..12).map(|k| 20 + k % 7).collect();
    let mut rng = support::Rng::new(5);
    let x: Vec<f32> = rng.vec(12 * 26 * 8, 1.0).iter().map(|&v| v as f32).collect();
    let forward = move |model: &Model| {
        let input = batch_first(&x, (12, 26), &lengths);
        model.forward(input, None).expect("forward").data
    };
    let alone = forward(&model);
    assert_eq!(cpu.install(|| forward(&model)), alone, "one call from inside the pool");
    let (done, finished) = std::sync::mpsc::channel();
    // On a thread of its own, so that a deadlock fails the test rather than hanging it.
    std::thread::spawn(move || {
        let both = cpu.install(|| {
            (0..20).map(|_| rayon::join(|| forward(&model), || forward(&model))).collect::<Vec<_>>()
        });
        done.send(both).expect("the test waits");
    });
    let both = finished.recv_timeout(std::time::Duration::from_secs(120)).expect("two calls deadlocked");
    for (a, b) in both {
        assert_eq!(a, alone);
        assert_eq!(b, alone);
    }
}

#[test]
fn states_that_swap_read_the_previous_step() {
    // `a' = b`, `b' = a`: each next state is the other state itself, so the
    // new states must not overwrite the old ones before both are read.
    let src = "
        cell swap {
            input x[H]
            state a[H], b[H]
            param w[H, H]
            a' = b
            b' = tanh(w @ a + x)
            output a' + b'
        }
        cell swap_plain {
            input x[H]
            state a[H], b[H]
            a' = b
            b' = a + x
            output a' * b'
        }";
    for name in ["swap", "swap_plain"] {
        let c = Arc::new(CompiledCell::from_source("swap.cell", src, Some(name)).expect("compiles"));
        let config = ModelConfig { layers: 1, bidirectional: false };
        let cpu = build(
            &c,
            5,
            5,
            &config,
            Box::new(Cpu::new(2, Kernels::default()).expect("cpu").split_every_step()),
        )
        .expect("model");
        let reference = build(&c, 5, 5, &config, Box::new(Reference)).expect("model");
        let lengths = [4usize, 2, 3];
        let mut rng = support::Rng::new(4);
        let x: Vec<f32> = rng.vec(3 * 4 * 5, 1.0).iter().map(|&v| v as f32).collect();
        let h0: Vec<Vec<f32>> =
            (0..2).map(|_| rng.vec(3 * 5, 1.0).iter().map(|&v| v as f32).collect()).collect();
        let input = batch_first(&x, (3, 4), &lengths);
        let a = cpu.forward(input, Some(&h0)).expect("cpu");
        let r = reference.forward(input, Some(&h0)).expect("reference");
        for (x, y) in a
            .data
            .iter()
            .zip(&r.data)
            .chain(a.final_states.iter().flatten().zip(r.final_states.iter().flatten()))
        {
            assert!((x - y).abs() < 1e-4, "{name}: cpu {x} vs reference {y}");
        }
        // Step by step, the first sequence alone.
        let mut stream = cpu.stream(1).expect("stream");
        stream.set_states(&h0.iter().map(|s| s[..5].to_vec()).collect::<Vec<_>>()).expect("states");
        let mut y = vec![0.0; 5];
        for t in 0..4 {
            stream.run(&x[t * 5..(t + 1) * 5], &mut y).expect("step");
            for (x, r) in y.iter().zip(&r.data[t * 5..(t + 1) * 5]) {
                assert!((x - r).abs() < 1e-4, "{name}, step {t}: stream {x} vs reference {r}");
            }
        }
    }
}
