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

mod support;

use cellc::cuda::{self, Context, Kernel, BLOCK};
use cellc::interp::Plan;
use cellc::ir::{Graph, Op, ValueId};
use cellc::schedule::{Stage, StageKind};
use cellc_runtime::backend::cpu::stage::{Interpreted, StageExec};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::{CompiledCell, Model, ModelConfig};
use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use support::Rng;

type Launch = unsafe extern "C" fn(u32, u32, *mut *mut c_void);

/// One side (forward or backward) of a layer: its graph, plan and stages.
struct Side {
    graph: Arc<Graph>,
    plan: Arc<Plan>,
    stages: Vec<Stage>,
    /// For whole-sequence stages: (input value, output value of the previous row) pairs.
    chains: Vec<(ValueId, ValueId)>,
}

fn sides(c: &Arc<CompiledCell>, h: usize, i: usize) -> Vec<(&'static str, Side)> {
    let sizes = [("H".to_string(), h), ("P".to_string(), 3)]
        .into_iter()
        .filter(|(k, _)| c.cell.sizes.contains(k))
        .collect();
    let input = if c.cell.input_dim().variables() == ["H"] { h } else { i };
    let config = ModelConfig { layers: 1, bidirectional: false };
    let model =
        Model::new(c.clone(), config, &sizes, Some(input), None, 1, Box::new(Reference)).expect("model");
    let layer = &model.layers()[0];
    let fwd_graph = Arc::new((*c.cell).clone());
    let bwd_graph = Arc::new(c.grad.graph.clone());
    let state_leaf = |g: &Graph, k: usize| g.values().find(|&v| g.node(v).op == Op::State(k));
    let seed_leaf = |g: &Graph, k: usize| g.values().find(|&v| g.node(v).op == Op::Seed(k));
    let fwd_chains = (0..c.cell.states.len())
        .filter_map(|k| Some((state_leaf(&fwd_graph, k)?, c.cell.next_states[k])))
        .collect();
    let bwd_chains = (0..c.cell.states.len())
        .filter_map(|k| Some((seed_leaf(&bwd_graph, k + 1)?, c.grad.d_states[k]?)))
        .collect();
    vec![
        (
            "fwd",
            Side {
                graph: fwd_graph,
                plan: Arc::new(layer.forward_plan.clone()),
                stages: layer.schedule.forward.clone(),
                chains: fwd_chains,
            },
        ),
        (
            "bwd",
            Side {
                graph: bwd_graph,
                plan: Arc::new(layer.backward_plan.clone()),
                stages: layer.schedule.backward.clone(),
                chains: bwd_chains,
            },
        ),
    ]
}

/// Row buffers and the pointer table of one run: `rows` rows (in sequences
/// of `seq_rows` when the stage is whole-sequence), inputs random (vector
/// constants at their values), chained state inputs pointing at the
/// previous row's outputs.
struct Run {
    /// Owns what the table points into.
    _buffers: Vec<Vec<f32>>,
    table: Vec<*mut f32>,
}

fn run_buffers(side: &Side, stage: &Stage, seq_rows: &[usize], whole: bool, seed: u64) -> Run {
    let constants: HashMap<ValueId, Vec<f32>> =
        side.plan.constant_values::<f32>(&side.graph).into_iter().collect();
    let mut rng = Rng::new(seed);
    let mut buffers: Vec<Vec<f32>> = Vec::new();
    let mut slots: Vec<usize> = Vec::new(); // buffer index per table entry
    let k = stage.inputs.len() + stage.outputs.len();
    for &rows in seq_rows {
        for r in 0..rows {
            let row_start = slots.len();
            for &v in &stage.inputs {
                let chained = side.chains.iter().find(|(input, _)| *input == v).map(|c| c.1);
                match chained {
                    Some(out) if whole && r > 0 => {
                        let at = stage.outputs.iter().position(|o| *o == out).expect("chained output");
                        let prev = row_start - k + stage.inputs.len() + at;
                        slots.push(slots[prev]);
                    }
                    _ => {
                        let n = side.plan.elements(v);
                        let data = constants
                            .get(&v)
                            .cloned()
                            .unwrap_or_else(|| rng.vec(n, 1.0).iter().map(|&x| x as f32).collect());
                        buffers.push(data);
                        slots.push(buffers.len() - 1);
                    }
                }
            }
            for &v in &stage.outputs {
                buffers.push(vec![f32::NAN; side.plan.elements(v)]);
                slots.push(buffers.len() - 1);
            }
        }
    }
    let table = slots.iter().map(|&b| buffers[b].as_mut_ptr()).collect();
    Run { _buffers: buffers, table }
}

/// Compiles the kernels with g++ and the emulation header into a shared library.
fn build(dir: &Path, name: &str, kernels: &[Kernel], extra: &[&str]) -> PathBuf {
    let header = dir.join("cuda_host_emu.h");
    std::fs::write(&header, cuda::prelude::HOST_EMULATION_HEADER).expect("header");
    let mut src = cuda::translation_unit(kernels);
    for k in kernels {
        src.push_str(&format!("CELLC_EMU_EXPORT({})\n", k.name));
    }
    let cu = dir.join(format!("{name}.cu"));
    std::fs::write(&cu, &src).expect("source");
    let so = dir.join(format!("lib{name}.so"));
    let out = Command::new("g++")
        .args(["-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-include"])
        .arg(&header)
        .args(extra)
        .args(["-x", "c++"])
        .arg(&cu)
        .arg("-o")
        .arg(&so)
        .output()
        .expect("g++ runs");
    assert!(out.status.success(), "g++ failed on {name}:\n{}\n{src}", String::from_utf8_lossy(&out.stderr));
    so
}

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
        let all_sides = sides(&c, 37, 5);
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
        let so = build(&dir, &cell, &kernels, &[]);
        // SAFETY: a library this test just built from generated source.
        let lib = unsafe { libloading::Library::new(&so) }.expect("dlopen");
        for ((name, side_name, i), kernel) in cases.iter().zip(&kernels) {
            let side = &all_sides.iter().find(|(n, _)| *n == *side_name).expect("side").1;
            let st = &side.stages[*i];
            let whole = kernel.whole_sequence;
            let seq_rows: Vec<usize> = if whole { vec![3, 1, 2] } else { vec![3] };
            let want = run_buffers(side, st, &seq_rows, whole, 11);
            let mut got = run_buffers(side, st, &seq_rows, whole, 11);
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
