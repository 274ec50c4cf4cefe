//! The CPU backend against the reference backend on random shapes:
//! every shipped cell, random sizes (1, odd, not multiples of the SIMD
//! width), random unsorted lengths, every layout, 1-2 layers, one or two
//! directions, forward and backward — and bitwise-identical results from
//! run to run at a given thread count.

mod support;

use cellc::ir::Op;
use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Backend;
use cellc_runtime::{Align, CompiledCell, Input, Major, Model, ModelConfig};
use proptest::prelude::*;
use std::sync::{Arc, OnceLock};

fn cells() -> &'static Vec<Arc<CompiledCell>> {
    static CELLS: OnceLock<Vec<Arc<CompiledCell>>> = OnceLock::new();
    CELLS.get_or_init(|| {
        support::shipped_cells()
            .iter()
            .filter(|p| p.file_stem().is_some_and(|s| s != "prelude"))
            .map(|p| Arc::new(CompiledCell::from_file(p, None).expect("compiles")))
            .collect()
    })
}

fn build(
    cell: &Arc<CompiledCell>,
    h: usize,
    i: usize,
    config: &ModelConfig,
    backend: Box<dyn Backend>,
) -> Option<Model> {
    support::try_model(cell, (h, (h / 2).max(1), i), config, 3, backend)
}

/// How far the two f32 back ends may drift apart on a cell. They sum in
/// different orders (blocked GEMMs vs plain loops); a cell with row
/// reductions (LayerNorm) divides by each row's spread and subtracts means
/// in its backward, which amplifies that rounding: on 2-layer bidirectional
/// LayerNorm-LSTMs the two differ by up to ~7e-4 even with the CPU running
/// the interpreter's own op semantics. Against an f64 oracle both stay
/// within 2e-5 (`runtime_oracle.rs`).
fn tolerance(cell: &CompiledCell) -> f32 {
    let g = &cell.forward;
    if g.values().any(|v| matches!(g.node(v).op, Op::Reduce(_))) {
        2e-3
    } else {
        1e-4
    }
}

fn close(what: &str, a: &[f32], b: &[f32], tol: f32) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.len(), b.len());
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        let err = (x - y).abs() / y.abs().max(1.0);
        prop_assert!(err < tol, "{}[{}]: cpu {} vs reference {}", what, k, x, y);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn cpu_equals_reference(
        cell in 0usize..14,
        h in prop::sample::select(vec![1usize, 2, 3, 5, 7, 9, 17]),
        i in 1usize..6,
        layers in 1usize..3,
        bidirectional in any::<bool>(),
        lengths in prop::collection::vec(1usize..7, 1..12),
        major in prop::sample::select(vec![Major::BatchFirst, Major::TimeFirst]),
        align in prop::sample::select(vec![Align::Left, Align::Right]),
        seed in any::<u64>(),
    ) {
        let cells = cells();
        let c = &cells[cell % cells.len()];
        let config = ModelConfig { layers, bidirectional };
        let Some(cpu) = build(c, h, i, &config, Box::new(Cpu::new(2, Kernels::default()).expect("cpu"))) else { return Ok(()) };
        let Some(reference) = build(c, h, i, &config, Box::new(Reference)) else { return Ok(()) };
        let mut rng = support::Rng::new(seed);
        let (b, t) = (lengths.len(), lengths.iter().copied().max().unwrap_or(1));
        let x: Vec<f32> = rng.vec(b * t * cpu.input_size(), 1.0).iter().map(|&v| v as f32).collect();
        let dy: Vec<f32> = rng.vec(b * t * cpu.output_size(), 1.0).iter().map(|&v| v as f32).collect();
        let input = Input::Padded { data: &x, batch: b, steps: t, major, align, lengths: &lengths };
        let (o1, tr1) = cpu.forward_train(input, None).expect("cpu forward");
        let (o2, tr2) = reference.forward_train(input, None).expect("reference forward");
        let name = &c.forward.name;
        let tol = tolerance(c);
        close(&format!("{name} output"), &o1.data, &o2.data, tol)?;
        for (a, r) in o1.final_states.iter().zip(&o2.final_states) {
            close(&format!("{name} final"), a, r, tol)?;
        }
        let g1 = cpu.backward(&tr1, &dy, None).expect("cpu backward");
        let g2 = reference.backward(&tr2, &dy, None).expect("reference backward");
        close(&format!("{name} d_input"), &g1.d_input, &g2.d_input, tol)?;
        for (a, r) in g1.d_h0.iter().zip(&g2.d_h0) {
            close(&format!("{name} d_h0"), a, r, tol)?;
        }
        for (a, r) in g1.d_params.iter().flatten().zip(g2.d_params.iter().flatten()) {
            close(&format!("{name} d_param"), a, r, tol)?;
        }
        // Run to run, bit for bit.
        let (o3, tr3) = cpu.forward_train(input, None).expect("cpu forward again");
        prop_assert_eq!(&o3.data, &o1.data);
        let g3 = cpu.backward(&tr3, &dy, None).expect("cpu backward again");
        prop_assert_eq!(&g3.d_params, &g1.d_params);
    }
}

#[test]
fn large_batches_split_across_threads_identically() {
    // Enough rows and columns that pointwise stages and per-step GEMMs split.
    let c = cells().iter().find(|c| c.forward.name == "lstm").expect("lstm").clone();
    let config = ModelConfig { layers: 1, bidirectional: false };
    let one =
        build(&c, 96, 32, &config, Box::new(Cpu::new(1, Kernels::default()).expect("cpu"))).expect("model");
    let two =
        build(&c, 96, 32, &config, Box::new(Cpu::new(2, Kernels::default()).expect("cpu"))).expect("model");
    let reference = build(&c, 96, 32, &config, Box::new(Reference)).expect("model");
    let lengths: Vec<usize> = (0..24).map(|k| 3 + k % 5).collect();
    let mut rng = support::Rng::new(9);
    let x: Vec<f32> = rng.vec(24 * 7 * 32, 1.0).iter().map(|&v| v as f32).collect();
    let input = Input::Padded {
        data: &x,
        batch: 24,
        steps: 7,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &lengths,
    };
    let a = one.forward(input, None).expect("1 thread");
    let b = two.forward(input, None).expect("2 threads");
    let r = reference.forward(input, None).expect("reference");
    for ((x, y), z) in a.data.iter().zip(&b.data).zip(&r.data) {
        assert!((x - z).abs() < 1e-4 && (y - z).abs() < 1e-4, "{x} {y} {z}");
    }
    assert_eq!(two.forward(input, None).expect("again").data, b.data, "2 threads: bitwise run to run");
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
        let cpu =
            build(&c, 5, 5, &config, Box::new(Cpu::new(2, Kernels::default()).expect("cpu"))).expect("model");
        let reference = build(&c, 5, 5, &config, Box::new(Reference)).expect("model");
        let lengths = [4usize, 2, 3];
        let mut rng = support::Rng::new(4);
        let x: Vec<f32> = rng.vec(3 * 4 * 5, 1.0).iter().map(|&v| v as f32).collect();
        let h0: Vec<Vec<f32>> =
            (0..2).map(|_| rng.vec(3 * 5, 1.0).iter().map(|&v| v as f32).collect()).collect();
        let input = Input::Padded {
            data: &x,
            batch: 3,
            steps: 4,
            major: Major::BatchFirst,
            align: Align::Left,
            lengths: &lengths,
        };
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
