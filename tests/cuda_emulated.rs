//! The generated CUDA kernels, compiled as host C++ through the emulation
//! header and run on the CPU, against the interpreter's semantics
//! (`Interpreted` stages) on every shipped cell: every forward and backward
//! pointwise stage over several rows, and whole-sequence stages over
//! sequences of different lengths with each row's state chained to the
//! previous row's result. Blocks of 32 threads on vectors longer than 32
//! exercise the strided loops and the block reductions; two blocks on
//! three rows exercise the grid-stride loop.
//!
//! Tolerance: 2e-5 relative (to max(1, |expected|)). Both sides run the
//! same float operations; they differ only in libm's `expf`/`tanhf`
//! against Rust's and in the reduction order (a tree over the block's
//! threads against a left-to-right sum).

#[path = "cuda/emu.rs"]
mod emu;
mod support;

use cellc::cuda::{self, Context, BLOCK};
use cellc::schedule::StageKind;
use cellc_runtime::backend::cpu::stage::{Interpreted, StageExec};
use cellc_runtime::CompiledCell;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Arc;

type Launch = unsafe extern "C" fn(u32, u32, *mut *mut c_void);

fn close(what: &str, got: &[f32], want: &[f32]) {
    for (j, (a, b)) in got.iter().zip(want).enumerate() {
        let err = (a - b).abs() / b.abs().max(1.0);
        assert!(err <= 2e-5 || (a.is_nan() && b.is_nan()), "{what}[{j}]: emulated CUDA {a}, interpreter {b}");
    }
}

fn scratch_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cellc-cuda-emu-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Every stage of every shipped cell, emulated against the interpreter.
#[test]
fn every_kernel_of_every_shipped_cell_matches_the_interpreter() {
    let dir = scratch_dir("all");
    let mut checked = 0;
    for path in support::shipped_cells().iter().filter(|p| p.file_stem().is_some_and(|s| s != "prelude")) {
        let c = Arc::new(CompiledCell::from_file(path, None).expect("compiles"));
        let cell = c.cell.name.clone();
        let all_sides = emu::sides(&c, 37, 5);
        let mut kernels = Vec::new();
        let mut cases = Vec::new();
        for (side_name, side) in &all_sides {
            for (i, st) in side.stages.iter().enumerate() {
                if !matches!(st.kind, StageKind::Pointwise { .. } | StageKind::WholeSequence { .. }) {
                    continue;
                }
                let name = format!("{cell}_{side_name}_s{i}");
                let k = cuda::emit_stage(&side.graph, &side.plan, st, &name, Context::default())
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                kernels.push(k);
                cases.push((name, *side_name, i));
            }
        }
        let so = emu::build(&dir, &cell, &kernels);
        // SAFETY: a library this test just built from generated source.
        let lib = unsafe { libloading::Library::new(&so) }.expect("dlopen");
        for ((name, side_name, i), kernel) in cases.iter().zip(&kernels) {
            let side = &all_sides.iter().find(|(n, _)| *n == *side_name).expect("side").1;
            let st = &side.stages[*i];
            let whole = kernel.whole_sequence;
            let seq_rows: Vec<usize> = if whole { vec![3, 1, 2] } else { vec![3] };
            let want = emu::run_buffers(side, st, &seq_rows, whole, 11);
            let mut got = emu::run_buffers(side, st, &seq_rows, whole, 11);
            let rows: usize = seq_rows.iter().sum();
            let oracle =
                Interpreted::new(side.graph.clone(), side.plan.clone(), &st.values, &st.inputs, &st.outputs);
            // SAFETY: the table holds `rows` rows of buffers sized by the plan.
            unsafe { oracle.run(rows, &want.table) };
            let launch: libloading::Symbol<Launch> =
                // SAFETY: the symbol was exported by CELLC_EMU_EXPORT with this signature.
                unsafe { lib.get(format!("cellc_launch_{name}").as_bytes()) }.expect("symbol");
            let mut scratch = vec![0.0f32; 2 * kernel.scratch.max(1)];
            let mut args_ptr = got.table.as_mut_ptr();
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
                // SAFETY: arguments packed as the kernel's parameters, in order.
                unsafe { launch(2, 32, args.as_mut_ptr()) };
            } else {
                let mut n = rows as i32;
                let mut args: [*mut c_void; 3] = [
                    (&mut args_ptr as *mut *mut *mut f32).cast(),
                    (&mut n as *mut i32).cast(),
                    (&mut scratch_ptr as *mut *mut f32).cast(),
                ];
                // SAFETY: as above.
                unsafe { launch(2, 32, args.as_mut_ptr()) };
            }
            // Compare every output buffer (outputs are the buffers filled with NaN at the start).
            let k = st.inputs.len() + st.outputs.len();
            for r in 0..rows {
                for o in 0..st.outputs.len() {
                    let at = r * k + st.inputs.len() + o;
                    // SAFETY: table entries point into the runs' own buffers.
                    let n = side.plan.elements(st.outputs[o]);
                    let (g, w) = unsafe {
                        (
                            std::slice::from_raw_parts(got.table[at], n),
                            std::slice::from_raw_parts(want.table[at], n),
                        )
                    };
                    close(&format!("{name} row {r} output {}", st.outputs[o]), g, w);
                }
            }
            checked += 1;
        }
    }
    assert!(checked >= 30, "only {checked} kernels checked");
    eprintln!("{checked} kernels emulated, all within 2e-5 of the interpreter (blocks of 32 of {BLOCK} max)");
    let _ = std::fs::remove_dir_all(&dir);
}
