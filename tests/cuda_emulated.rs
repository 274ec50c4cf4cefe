//! The generated CUDA kernels, compiled as host C++ through the emulation
//! header and run on the CPU, against the interpreter's semantics
//! (`Interpreted` stages) on every shipped cell: every forward and backward
//! pointwise stage over one row and over five, and whole-sequence stages
//! over sequences of different lengths (one empty) with each row's state
//! chained to the previous row's result, at two sizes: H = 37 (not a
//! multiple of 4 or 32) and H = 1.
//!
//! Each kernel runs four ways: threaded emulation with blocks of 32
//! threads on two blocks (vectors longer than a block exercise the strided
//! loops and the block reductions, more rows or sequences than blocks the
//! grid-stride loop), twice, the two runs bitwise equal (no result depends
//! on timing); threaded with three blocks of 24 (not a power of two: the
//! reduction tree must not drop a slot); serial emulation with one thread
//! per block; and, for
//! lane-form whole-sequence kernels, whose threads never communicate,
//! serial emulation with blocks of 32.
//!
//! Tolerance: 2e-5 relative (to max(1, |expected|)). Both sides run the
//! same float operations; they differ only in libm's `expf`/`tanhf`
//! against Rust's and in the reduction order (a tree over the block's
//! threads against a left-to-right sum).

#[path = "cuda/emu.rs"]
mod emu;
mod support;

use cellc::cuda::{self, Context, Kernel, BLOCK};
use cellc::schedule::Stage;
use cellc_runtime::backend::cpu::stage::{Interpreted, StageExec};
use cellc_runtime::CompiledCell;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Arc;

type Launch = unsafe extern "C" fn(u32, u32, *mut *mut c_void);

/// (H, I) pairs every kernel is generated and run at.
const SIZES: [(usize, usize); 2] = [(37, 5), (1, 1)];

fn scratch_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cellc-cuda-emu-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Every output of every row of a run.
fn outputs(side: &emu::Side, st: &Stage, run: &emu::Run, rows: usize) -> Vec<Vec<f32>> {
    let k = st.inputs.len() + st.outputs.len();
    let mut out = Vec::new();
    for r in 0..rows {
        for (o, &v) in st.outputs.iter().enumerate() {
            let n = side.plan.elements(v);
            // SAFETY: table entries point into the run's own buffers, sized by the plan.
            out.push(
                unsafe { std::slice::from_raw_parts(run.table[r * k + st.inputs.len() + o], n) }.to_vec(),
            );
        }
    }
    out
}

/// Launches `kernel` from `lib` on a fresh copy of the run's buffers.
fn launch(
    lib: &libloading::Library,
    kernel: &Kernel,
    serial: bool,
    (grid, block): (u32, u32),
    side: &emu::Side,
    st: &Stage,
    seq_rows: &[usize],
) -> Vec<Vec<f32>> {
    let whole = kernel.whole_sequence;
    let mut run = emu::run_buffers(side, st, seq_rows, whole, 11);
    let rows: usize = seq_rows.iter().sum();
    let symbol = format!("cellc_launch_{}{}", if serial { "serial_" } else { "" }, kernel.name);
    // SAFETY: the symbol was exported by CELLC_EMU_EXPORT with this signature.
    let f: libloading::Symbol<Launch> = unsafe { lib.get(symbol.as_bytes()) }.expect("symbol");
    let mut scratch = vec![0.0f32; grid as usize * kernel.scratch.max(1)];
    let mut args_ptr = run.table.as_mut_ptr();
    let mut scratch_ptr = scratch.as_mut_ptr();
    if whole {
        let starts: Vec<i32> = seq_rows
            .iter()
            .scan(0, |at, &n| {
                let s = *at;
                *at += n as i32;
                Some(s)
            })
            .collect();
        let counts: Vec<i32> = seq_rows.iter().map(|&n| n as i32).collect();
        let (mut sp, mut cp, mut n) = (starts.as_ptr(), counts.as_ptr(), seq_rows.len() as i32);
        let mut args: [*mut c_void; 5] = [
            (&mut args_ptr as *mut *mut *mut f32).cast(),
            (&mut sp as *mut *const i32).cast(),
            (&mut cp as *mut *const i32).cast(),
            (&mut n as *mut i32).cast(),
            (&mut scratch_ptr as *mut *mut f32).cast(),
        ];
        // SAFETY: arguments packed as the kernel's parameters, in order; the
        // table holds `rows` rows of buffers sized by the plan.
        unsafe { f(grid, block, args.as_mut_ptr()) };
    } else {
        let mut n = rows as i32;
        let mut args: [*mut c_void; 3] = [
            (&mut args_ptr as *mut *mut *mut f32).cast(),
            (&mut n as *mut i32).cast(),
            (&mut scratch_ptr as *mut *mut f32).cast(),
        ];
        // SAFETY: as above.
        unsafe { f(grid, block, args.as_mut_ptr()) };
    }
    outputs(side, st, &run, rows)
}

/// The form each kernel takes is part of the design: gated and elementwise
/// recurrences get lane-form kernels (one thread per unit, registers only,
/// no barriers), LayerNorm's row reductions block-form ones.
#[test]
fn kernels_take_the_lane_form_unless_they_reduce_a_row() {
    for cell in ["lstm", "gru", "sru", "mingru", "indrnn"] {
        let c = CompiledCell::from_file(&support::root().join("cells").join(format!("{cell}.cell")), None)
            .expect("compiles");
        let sizes = [("H".to_string(), 37), ("I".to_string(), 5)]
            .into_iter()
            .filter(|(k, _)| c.forward.sizes.contains(k))
            .collect();
        let kernels = cuda::emit_cell(&c.forward, &c.backward, &c.program(&sizes).expect("sizes"), None)
            .expect("emits");
        assert!(!kernels.is_empty());
        // The step's kernel (the first) has a thread per hidden unit; others
        // (e.g. summing two input gradients, [I]) a thread per element.
        assert_eq!(kernels[0].units, 37, "{}", kernels[0].name);
        for k in &kernels {
            assert!(k.units > 0, "{}: not in lane form", k.name);
            assert_eq!(k.scratch, 0, "{}: lane form needs no scratch", k.name);
            assert!(!k.source.contains("__syncthreads") && !k.source.contains("__shared__"), "{}", k.name);
        }
    }
    let c =
        CompiledCell::from_file(&support::root().join("cells/layernorm_lstm.cell"), None).expect("compiles");
    let sizes = [("H".to_string(), 37), ("I".to_string(), 5)].into_iter().collect();
    let kernels =
        cuda::emit_cell(&c.forward, &c.backward, &c.program(&sizes).expect("sizes"), None).expect("emits");
    let fwd = kernels.iter().find(|k| k.name.contains("_fwd_")).expect("a forward kernel");
    assert_eq!(fwd.units, 0, "{}: a row reduction needs the block form", fwd.name);
    assert!(fwd.source.contains("cellc_block_sum"), "{}", fwd.name);
}

/// Every stage of every shipped cell, emulated against the interpreter.
#[test]
fn every_kernel_of_every_shipped_cell_matches_the_interpreter() {
    let dir = scratch_dir("all");
    let (mut kernels_checked, mut runs, mut lane) = (0, 0, 0);
    for path in support::shipped_cells().iter().filter(|p| p.file_stem().is_some_and(|s| s != "prelude")) {
        let c = Arc::new(CompiledCell::from_file(path, None).expect("compiles"));
        let cell = c.forward.name.clone();
        let at_sizes: Vec<_> = SIZES.iter().map(|&(h, i)| (h, emu::sides(&c, h, i))).collect();
        // Every kernel of the cell at every size, in one library.
        let mut cases = Vec::new();
        for (h, sides) in &at_sizes {
            for (side_name, side) in sides {
                for (i, st) in side.stages.iter().enumerate() {
                    if !st.kind.is_kernel() {
                        continue;
                    }
                    let name = format!("{cell}_{side_name}_s{i}_h{h}");
                    let k = cuda::emit_stage(
                        &side.graph,
                        &side.plan,
                        st,
                        &side.plans[&i],
                        &name,
                        Context::default(),
                    )
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                    cases.push((k, side, st));
                }
            }
        }
        let kernels: Vec<Kernel> = cases.iter().map(|(k, _, _)| k.clone()).collect();
        let so = emu::build(&dir, &cell, &kernels);
        // SAFETY: a library this test just built from generated source.
        let lib = unsafe { libloading::Library::new(&so) }.expect("dlopen");
        for (kernel, side, st) in &cases {
            let name = &kernel.name;
            let configs: Vec<Vec<usize>> = if kernel.whole_sequence {
                vec![vec![3, 1, 2], vec![1], vec![2, 0, 5]]
            } else {
                vec![vec![1], vec![5]]
            };
            if kernel.units > 0 {
                lane += 1;
            }
            for seq_rows in &configs {
                let rows: usize = seq_rows.iter().sum();
                let want = emu::run_buffers(side, st, seq_rows, kernel.whole_sequence, 11);
                let oracle = Interpreted::new(
                    side.graph.clone(),
                    side.plan.clone(),
                    &st.values,
                    &st.inputs,
                    &st.outputs,
                );
                // SAFETY: the table holds `rows` rows of buffers sized by the plan.
                unsafe { oracle.run(rows, &want.table) };
                let want = outputs(side, st, &want, rows);
                let mut modes = vec![(false, (2, 32)), (false, (3, 24)), (true, (2, 1))];
                if kernel.units > 0 {
                    modes.push((true, (2, 32)));
                }
                for (serial, shape) in modes {
                    let got = launch(&lib, kernel, serial, shape, side, st, seq_rows);
                    for (n, (g, w)) in got.iter().zip(&want).enumerate() {
                        let what = format!(
                            "emulated CUDA: {name} {seq_rows:?} serial={serial} {shape:?} output {n}"
                        );
                        support::close_to_interpreter(&what, g, w);
                    }
                    if !serial {
                        let again = launch(&lib, kernel, serial, shape, side, st, seq_rows);
                        let bits = |v: &[Vec<f32>]| -> Vec<u32> {
                            v.iter().flatten().map(|x| x.to_bits()).collect()
                        };
                        assert_eq!(bits(&got), bits(&again), "{name} {seq_rows:?}: two threaded runs differ");
                    }
                    runs += 1;
                }
            }
            kernels_checked += 1;
        }
    }
    assert!(kernels_checked >= 70, "only {kernels_checked} kernels checked");
    assert!(lane >= 40, "only {lane} lane-form kernels");
    assert!(
        lane >= 6,
        "only {lane} lane-form kernels: sru, mingru and indrnn have one forward and one backward"
    );
    support::report(&format!(
        "{kernels_checked} kernels emulated ({lane} in lane form), {runs} runs, all within 2e-5 of the interpreter (blocks of 32, 24 and 1, of {BLOCK} max)"
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The source exactly as `cellc compile --target cuda` writes it (every
/// cell of `cells/`, `.cell` lines quoted in comments) compiles as host
/// C++ through the emulation header: a quoted line cannot break the code.
#[test]
fn compile_output_with_quoted_source_lines_is_valid_cpp() {
    let dir = scratch_dir("quoted");
    let mut kernels = Vec::new();
    for path in support::shipped_cells().iter().filter(|p| p.file_stem().is_some_and(|s| s != "prelude")) {
        let text = std::fs::read_to_string(path).expect("readable");
        let compiled = cellc::compile(&path.display().to_string(), &text);
        let module = compiled.module.as_ref().expect("compiles");
        for cell in &module.cells {
            let steps = cellc::program::Steps::compile(cell).expect("verifies");
            // I = 5, P = 3, and 37 for H and any other size (the sLSTM's head size D).
            let sizes = cell
                .sizes
                .iter()
                .map(|k| {
                    (
                        k.clone(),
                        if k == "I" {
                            5
                        } else if k == "P" {
                            3
                        } else {
                            37
                        },
                    )
                })
                .collect();
            let program = steps.program(&sizes).expect("sizes");
            let ks = cuda::emit_cell(&steps.forward, &steps.backward, &program, Some(&compiled.sources))
                .expect("emits");
            assert!(ks.iter().any(|k| k.source.contains(".cell:")), "{}: no quoted lines", cell.name);
            kernels.extend(ks);
        }
    }
    let cu = dir.join("all.cu");
    std::fs::write(&cu, emu::emulation_source(&kernels)).expect("source");
    emu::gxx(&[cu], &["-fsyntax-only", "-Werror"], &dir.join("unused"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The prelude's Philox (`cellc_draw`), compiled as host C++ through the
/// emulation header, draws exactly `cellc::random::draw`'s bits: the
/// known answers, and every unit, step and sequence of a few keys.
#[test]
fn the_preludes_philox_draws_cellc_randoms_bits() {
    use cellc::random::{draw, philox4x32_10, MaskStream, SHARED};
    let dir = scratch_dir("philox");
    let mut src = emu::emulation_source(&[]);
    src.push_str(
        "extern \"C\" unsigned cellc_test_draw(unsigned k0, unsigned k1, unsigned s, unsigned t, unsigned u) {\n\
         \x20   return cellc_draw(k0, k1, s, t, u);\n}\n\
         extern \"C\" void cellc_test_philox(unsigned* c, unsigned k0, unsigned k1) { cellc_philox(c, k0, k1); }\n",
    );
    let cu = dir.join("philox.cu");
    std::fs::write(&cu, src).expect("source");
    let so = dir.join("libphilox.so");
    emu::gxx(&[cu], &["-shared"], &so);
    // SAFETY: a library this test just built from the prelude.
    let lib = unsafe { libloading::Library::new(&so) }.expect("dlopen");
    type Draw = unsafe extern "C" fn(u32, u32, u32, u32, u32) -> u32;
    type Philox = unsafe extern "C" fn(*mut u32, u32, u32);
    // SAFETY: the symbols defined just above, with these signatures.
    let (device_draw, device_philox) = unsafe {
        (
            lib.get::<Draw>(b"cellc_test_draw").expect("symbol"),
            lib.get::<Philox>(b"cellc_test_philox").expect("symbol"),
        )
    };
    let known = [([0u32; 4], [0u32; 2]), ([u32::MAX; 4], [u32::MAX; 2]), ([1, 2, 3, 4], [5, 6])];
    for (counter, key) in known {
        let mut c = counter;
        // SAFETY: four words, as the function reads and writes.
        unsafe { device_philox(c.as_mut_ptr(), key[0], key[1]) };
        assert_eq!(c, philox4x32_10(counter, key), "counter {counter:x?} key {key:x?}");
    }
    for (seed, offset, layer) in [(0u64, 0u64, 0u32), (42, 7, 1), (u64::MAX, 1 << 40, 3)] {
        let key = MaskStream { seed, offset, layer, direction: layer & 1, mask: 2 }.key();
        for sequence in [0, 1, 5, SHARED] {
            for step in [0, 1, 99, SHARED] {
                for unit in 0..37 {
                    // SAFETY: a pure function of its arguments.
                    let got = unsafe { device_draw(key[0], key[1], sequence, step, unit) };
                    assert_eq!(
                        got,
                        draw(key, sequence, step, unit),
                        "seed {seed} sequence {sequence} step {step} unit {unit}"
                    );
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
