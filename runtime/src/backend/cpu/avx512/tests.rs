//! The AVX-512 kernels against Cranelift's code, bit for bit: every stage
//! of every shipped cell and of random cells, forward and backward, at
//! lengths that fill whole registers, part of one, and several chunks, on
//! rows holding ordinary values and every special one.

#[cfg(feature = "jit")]
mod against_the_jit {
    use super::super::{supported, Avx512Stage};
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
    /// both and compared; returns how many stages ran.
    fn every_stage(src: &str, name: &str, sizes: &[usize]) -> usize {
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
                        let wide = Avx512Stage::new(shapes, &kernel.plan, &st.inputs, &st.outputs)
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                        for special in [false, true] {
                            compare(&jit, &wide, shapes, special, &what);
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
                    "{what}: output {} [{e}] (row {}): Cranelift {x:e} ({:#x}), AVX-512 {y:e} ({:#x})",
                    jit.outputs()[k % no],
                    k / no,
                    x.to_bits(),
                    y.to_bits()
                );
            }
        }
    }

    #[test]
    fn every_stage_of_every_shipped_cell_is_bitwise_the_jits() {
        if !supported() {
            eprintln!("skipped: this processor has no AVX-512F");
            return;
        }
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../cells");
        let mut files: Vec<_> =
            std::fs::read_dir(&dir).expect("cells/").map(|e| e.expect("entry").path()).collect();
        files.sort();
        let mut stages = 0;
        for path in files.iter().filter(|p| p.extension().is_some_and(|e| e == "cell")) {
            let src = std::fs::read_to_string(path).expect("readable");
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            // Under a register, one, part of a second, several chunks with a ragged end.
            stages += every_stage(&src, &name, &[1, 5, 16, 37, 64, 130]);
        }
        assert!(stages >= 200, "only {stages} stages compared");
    }

    #[test]
    fn every_stage_of_random_cells_is_bitwise_the_jits() {
        if !supported() {
            eprintln!("skipped: this processor has no AVX-512F");
            return;
        }
        let mut stages = 0;
        for seed in 0..60u64 {
            let spec =
                cellc::fuzzgen::generate(&mut cellc::fuzzgen::Entropy::seeded(seed), &format!("fuzz{seed}"));
            stages += every_stage(&spec.to_string(), &format!("seed {seed}"), &[3, 19, 70]);
        }
        eprintln!("{stages} stages of random cells compared");
        assert!(stages > 100, "only {stages} stages compared");
    }
}

#[test]
fn masks_cover_exactly_the_floats_left() {
    for left in [0, 1, 15, 16, 17, 48, 63, super::CHUNK - 1, super::CHUNK, super::CHUNK + 40] {
        let masks = super::masks(left);
        for (k, &m) in masks.iter().enumerate() {
            let lanes = left.saturating_sub(16 * k).min(16);
            assert_eq!(m, ((1u32 << lanes) - 1) as u16, "{left} floats left, register {k}");
        }
        let covered: u32 = masks.iter().map(|m| m.count_ones()).sum();
        assert_eq!(covered as usize, left.min(super::CHUNK), "{left} floats left");
    }
}

#[test]
fn row_sums_add_in_the_emitters_order() {
    if !super::supported() {
        return;
    }
    // Four chains over blocks of 16, pairwise; one f32x4 over the rest; lanes pairwise; the tail.
    let reference = |x: &[f32]| -> f32 {
        let (wide, vec) = (x.len() / 16 * 16, x.len() / 4 * 4);
        if vec == 0 {
            return x.iter().fold(0.0, |t, &v| t + v);
        }
        let mut chains = [[0.0f32; 4]; 4];
        for block in x[..wide].chunks(16) {
            for (c, chain) in chains.iter_mut().enumerate() {
                for (l, lane) in chain.iter_mut().enumerate() {
                    *lane += block[4 * c + l];
                }
            }
        }
        let mut acc: [f32; 4] =
            std::array::from_fn(|l| (chains[0][l] + chains[1][l]) + (chains[2][l] + chains[3][l]));
        for four in x[wide..vec].chunks(4) {
            for (a, &v) in acc.iter_mut().zip(four) {
                *a += v;
            }
        }
        x[vec..].iter().fold((acc[0] + acc[1]) + (acc[2] + acc[3]), |t, &v| t + v)
    };
    for n in [0usize, 1, 3, 4, 7, 15, 16, 17, 33, 63, 64, 100, 1000] {
        let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 * 1.37e-3 - 0.61).collect();
        // SAFETY: n floats; AVX-512F checked above.
        let got = unsafe { super::sum(x.as_ptr(), n) };
        assert_eq!(got.to_bits(), reference(&x).to_bits(), "n = {n}");
    }
}

#[test]
fn fastest_is_avx512_exactly_where_the_processor_has_it() {
    use crate::backend::cpu::{Cpu, Kernels};
    let cpu = Cpu::new(1, Kernels::Fastest).expect("a cpu back end");
    assert_eq!(cpu.kernels() == Kernels::Avx512, super::supported(), "{:?}", cpu.kernels());
    assert_ne!(cpu.kernels(), Kernels::Fastest, "Fastest is resolved when the back end is made");
    if !super::supported() {
        match Cpu::new(1, Kernels::Avx512) {
            Ok(_) => panic!("Kernels::Avx512 accepted without AVX-512F"),
            Err(e) => assert!(e.to_string().contains("AVX-512F"), "{e}"),
        }
    }
}
