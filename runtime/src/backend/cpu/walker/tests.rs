//! The walked kernels against Cranelift's code, bit for bit, on each
//! instruction set this processor has (on AVX-512 with their loops
//! compiled, and walked): every stage of every shipped cell and of random
//! cells, forward and backward, at lengths that fill whole registers, part
//! of one, and several passes, on rows holding ordinary values and every
//! special one.

use super::{Avx2, Avx512, Lanes};

/// `#[test]` functions, each running a check generic over the instruction
/// set on every set this processor has.
macro_rules! on_each_set {
    ($($(#[$doc:meta])* $test:ident: $check:path;)*) => {$(
        $(#[$doc])*
        #[test]
        fn $test() {
            $crate::backend::cpu::walker::tests::on::<$crate::backend::cpu::walker::Avx512>($check);
            $crate::backend::cpu::walker::tests::on::<$crate::backend::cpu::walker::Avx2>($check);
        }
    )*};
}

/// Runs `check` where the processor has set `S`.
fn on<S: Lanes>(check: impl FnOnce(S)) {
    match S::detect() {
        Some(s) => check(s),
        None => eprintln!("skipped on {}: this processor lacks it", S::NAME),
    }
}

#[cfg(feature = "jit")]
mod against_the_jit {
    use super::super::{Lanes, WalkedStage};
    use crate::backend::cpu::codegen::jit;
    use crate::backend::cpu::stage::StageExec;
    use cellc::program::{Side, Steps};
    use cellc::shapes::Shapes;

    /// Values that take every branch of the math: NaN, infinities, signed
    /// zeros, subnormals, the clamps' edges, tanh's tiny and saturated
    /// ranges, and numbers either side of 1.
    const SPECIAL: [f32; 16] = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1e-40,
        -1e-40,
        1e-4,
        -3e-4,
        88.5,
        -88.0,
        7.95,
        -9.0,
        std::f32::consts::SQRT_2,
        f32::MAX,
        -0.7,
    ];

    /// Every kernel stage of the cell in `src` at each of `sizes`, run by
    /// the JIT and walked on `S`, and compared; returns how many stages ran.
    fn every_stage<S: Lanes>(src: &str, name: &str, sizes: &[usize]) -> usize {
        let module = cellc::compile("c.cell", src).into_result().unwrap_or_else(|e| panic!("{name}: {e:?}"));
        let mut stages = 0;
        for cell in &module.cells {
            let Ok(steps) = Steps::compile(cell) else { continue };
            for &h in sizes {
                let bindings: cellc::dims::Bindings =
                    cell.sizes.iter().map(|s| (s.clone(), if s == "I" { 3 } else { h })).collect();
                let Ok(program) = steps.program(&bindings) else { continue };
                for side in Side::BOTH {
                    let shapes = program.shapes(side);
                    for (i, st) in program.stages(side).iter().enumerate().filter(|(_, s)| s.kind.is_kernel())
                    {
                        let kernel = program.kernel(side, i).expect("a kernel stage has a plan");
                        let what = format!("{name}/{} H={h} {side:?} stage {i}", cell.name);
                        let jit = jit::compile_stage(shapes, &kernel.plan, &st.inputs, &st.outputs)
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                        let wide = WalkedStage::<S>::new(shapes, &kernel.plan, &st.inputs, &st.outputs)
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert_eq!(wide.uncompiled_loops(), 0, "{what}: a loop did not compile");
                        for special in [false, true] {
                            compare(&jit, &wide, shapes, special, &format!("{what} on {}", S::NAME));
                        }
                        if S::COMPILED.is_some() {
                            // And with its loops walked, not compiled.
                            let walked = wide.walking_every_loop();
                            for special in [false, true] {
                                compare(
                                    &jit,
                                    &walked,
                                    shapes,
                                    special,
                                    &format!("{what} walked on {}", S::NAME),
                                );
                            }
                        }
                        stages += 1;
                    }
                }
            }
        }
        stages
    }

    fn compare(jit: &dyn StageExec, wide: &dyn StageExec, shapes: &Shapes, special: bool, what: &str) {
        let rows = 3;
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            seed >> 33
        };
        let mut inputs: Vec<Vec<f32>> = Vec::new();
        for _ in 0..rows {
            for &v in jit.inputs() {
                inputs.push(
                    (0..shapes.elements(v))
                        .map(|_| {
                            let r = next();
                            if special && r % 5 == 0 {
                                SPECIAL[(r / 5) as usize % SPECIAL.len()]
                            } else {
                                (r % 20_000) as f32 / 2_000.0 - 5.0
                            }
                        })
                        .collect(),
                );
            }
        }
        let run = |stage: &dyn StageExec, inputs: &mut Vec<Vec<f32>>| -> Vec<Vec<f32>> {
            let mut outs: Vec<Vec<f32>> = (0..rows)
                .flat_map(|_| {
                    stage.outputs().iter().map(|&v| vec![f32::from_bits(0x7fc0_dead); shapes.elements(v)])
                })
                .collect();
            let (ni, no) = (stage.inputs().len(), stage.outputs().len());
            let mut table = Vec::new();
            for r in 0..rows {
                table.extend(inputs[r * ni..(r + 1) * ni].iter_mut().map(|x| x.as_mut_ptr()));
                table.extend(outs[r * no..(r + 1) * no].iter_mut().map(|x| x.as_mut_ptr()));
            }
            // SAFETY: every pointer is a live buffer of its value's length.
            unsafe { stage.run(rows, &table) };
            outs
        };
        let (a, b) = (run(jit, &mut inputs.clone()), run(wide, &mut inputs));
        let no = jit.outputs().len();
        for (k, (a, b)) in a.iter().zip(&b).enumerate() {
            for (e, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                    "{what}: output {} [{e}] (row {}): Cranelift {x:e} ({:#x}), walked {y:e} ({:#x})",
                    jit.outputs()[k % no],
                    k / no,
                    x.to_bits(),
                    y.to_bits()
                );
            }
        }
    }

    /// Every stage of every shipped cell, walked on `S`.
    fn shipped_cells<S: Lanes>(_: S) {
        let mut stages = 0;
        for (name, src) in crate::backend::cpu::codegen::tests::shipped_cells() {
            // Under a register, one, part of a second, several passes with a ragged end.
            stages += every_stage::<S>(&src, &name, &[1, 5, 16, 37, 64, 130]);
        }
        assert!(stages >= 200, "only {stages} stages compared on {}", S::NAME);
    }

    /// Every stage of 60 random cells, walked on `S`.
    fn random_cells<S: Lanes>(_: S) {
        let mut stages = 0;
        for seed in 0..60u64 {
            let spec =
                cellc::fuzzgen::generate(&mut cellc::fuzzgen::Entropy::seeded(seed), &format!("fuzz{seed}"));
            stages += every_stage::<S>(&spec.to_string(), &format!("seed {seed}"), &[3, 19, 70]);
        }
        eprintln!("{stages} stages of random cells compared on {}", S::NAME);
        assert!(stages > 100, "only {stages} stages compared on {}", S::NAME);
    }

    on_each_set! {
        every_stage_of_every_shipped_cell_is_bitwise_the_jits: shipped_cells;
        every_stage_of_random_cells_is_bitwise_the_jits: random_cells;
    }
}

/// A loop's passes read and write each of its floats once, whole
/// registers but in the last pass, and nothing past its end; the last
/// pass's registers hold zeros there.
fn passes_cover_each_float_once<S: Lanes>(s: S) {
    let chunk = super::chunk::<S>();
    let lens = (1..=2 * S::LANES + 1).chain([chunk - 1, chunk, chunk + 1, chunk + 40, 3 * chunk + 5]);
    for len in lens {
        let mut src: Vec<f32> = (1..=len).map(|i| i as f32).collect();
        let mut dst = vec![-1.0f32; len + chunk];
        let mut regs = vec![super::Line([f32::NAN; 16]); chunk / 16];
        let regs = regs.as_mut_ptr().cast::<S::V>();
        for off in (0..len).step_by(chunk) {
            let left = len - off;
            // SAFETY: `src` holds `len` floats, `dst` more, `regs` a pass's registers; the set was detected.
            let got = unsafe {
                super::load_pass(s, &super::Held::Mem(src.as_mut_ptr()), off, left, regs);
                super::store_pass(s, regs, dst.as_mut_ptr().add(off), left);
                std::slice::from_raw_parts(regs.cast::<f32>(), left.min(chunk).next_multiple_of(S::LANES))
            };
            let (inside, past) = got.split_at(left.min(chunk));
            assert_eq!(inside, &src[off..off + inside.len()], "{}: {len} floats, pass at {off}", S::NAME);
            assert!(past.iter().all(|&x| x == 0.0), "{}: {len} floats, zeros past the end", S::NAME);
        }
        assert_eq!(&dst[..len], &src[..], "{}: {len} floats", S::NAME);
        assert!(dst[len..].iter().all(|&x| x == -1.0), "{}: {len} floats, nothing past the end", S::NAME);
    }
}

on_each_set! {
    passes_cover_every_float_once: passes_cover_each_float_once;
}

on_each_set! {
    row_sums_add_in_the_emitters_order: row_sums_in_the_emitters_order;
}

fn row_sums_in_the_emitters_order<S: Lanes>(s: S) {
    // Sixteen chains over blocks of 64, folded in halves; one f32x4 over the rest; lanes pairwise; the tail.
    let reference = |x: &[f32]| -> f32 {
        let (wide, vec) = (x.len() / 64 * 64, x.len() / 4 * 4);
        if vec == 0 {
            return x.iter().fold(0.0, |t, &v| t + v);
        }
        let mut chains = vec![[0.0f32; 4]; 16];
        for block in x[..wide].chunks(64) {
            for (c, chain) in chains.iter_mut().enumerate() {
                for (l, lane) in chain.iter_mut().enumerate() {
                    *lane += block[4 * c + l];
                }
            }
        }
        while chains.len() > 1 {
            let half = chains.len() / 2;
            chains = (0..half).map(|c| std::array::from_fn(|l| chains[c][l] + chains[c + half][l])).collect();
        }
        let mut acc = chains[0];
        for four in x[wide..vec].chunks(4) {
            for (a, &v) in acc.iter_mut().zip(four) {
                *a += v;
            }
        }
        x[vec..].iter().fold((acc[0] + acc[1]) + (acc[2] + acc[3]), |t, &v| t + v)
    };
    for n in [0usize, 1, 3, 4, 7, 15, 16, 17, 33, 63, 64, 65, 100, 128, 1000, 1024] {
        let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 * 1.37e-3 - 0.61).collect();
        // SAFETY: n floats.
        let got = s.enter(|| unsafe { super::sum(s, x.as_ptr(), n) });
        assert_eq!(got.to_bits(), reference(&x).to_bits(), "{}: n = {n}", S::NAME);
    }
}

#[test]
fn fastest_is_the_widest_set_the_processor_has() {
    use crate::backend::cpu::{Cpu, Kernels};
    let (avx512, avx2) = (Avx512::detect().is_some(), Avx2::detect().is_some());
    let widest = if avx512 {
        Kernels::Avx512
    } else if avx2 {
        Kernels::Avx2
    } else {
        Kernels::Jit
    };
    let cpu = Cpu::new(1, Kernels::Fastest).expect("a cpu back end");
    assert_eq!(cpu.kernels(), widest, "Fastest is resolved when the back end is made");
    for (kind, has, set) in [(Kernels::Avx512, avx512, Avx512::NAME), (Kernels::Avx2, avx2, Avx2::NAME)] {
        match Cpu::new(1, kind) {
            Ok(cpu) => assert!(has && cpu.kernels() == kind, "{kind:?} accepted without {set}"),
            Err(e) => assert!(!has && e.to_string().contains(set), "{kind:?}: {e}"),
        }
    }
}
