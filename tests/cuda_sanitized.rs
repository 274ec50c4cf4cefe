//! The generated CUDA kernels under sanitizers, run on the CPU through the
//! emulation header and a small harness (`tests/cuda/harness.cpp`) in which
//! every row buffer is its own heap allocation:
//!
//! - AddressSanitizer + UndefinedBehaviorSanitizer on every kernel of the
//!   LSTM, LayerNorm-LSTM (block reductions) and SRU (whole-sequence,
//!   chained through time): any read or write outside a row's buffer fails;
//! - ThreadSanitizer on LayerNorm-LSTM's kernels, whose block reductions
//!   and per-row barriers make the block's threads share memory: a missing
//!   `__syncthreads` is reported as a data race; and on the LSTM's and
//!   SRU's lane-form kernels, which have no barrier and must share nothing.
//!
//! The results are checked against the interpreter too (2e-5), so a
//! sanitized build that computes something else fails as well.
//!
//! Step loops (one cooperative kernel per time loop, every block at once,
//! a grid-wide barrier between stages) are replayed from the images the
//! emulated device recorded while an LSTM and a LayerNorm-LSTM trained
//! (`tests/cuda/step_loop_harness.cpp`): under AddressSanitizer + UBSan,
//! and under ThreadSanitizer, which reports a missing grid or block barrier
//! as a race; each replay must give the recorded run's bits.

#[path = "cuda/emu.rs"]
mod emu;
mod support;

use cellc::cuda::{self, Context};
use cellc_runtime::backend::cpu::stage::{Interpreted, StageExec};
use cellc_runtime::backend::cuda::Cuda;
use cellc_runtime::{Align, CompiledCell, Input, Major, Precision};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

fn cell(name: &str) -> Arc<CompiledCell> {
    let path = support::root().join("cells").join(format!("{name}.cell"));
    Arc::new(CompiledCell::from_file(&path, None).expect("compiles"))
}

fn u32s(out: &mut Vec<u8>, values: impl IntoIterator<Item = u32>) {
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Reads the harness' output: every buffer back.
fn read_buffers(path: &Path) -> Vec<Vec<f32>> {
    let bytes = std::fs::read(path).expect("harness output");
    let mut at = 0;
    let mut word = || {
        let w = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        at += 4;
        w
    };
    let n = word();
    (0..n).map(|_| (0..word()).map(|_| f32::from_bits(word())).collect()).collect()
}

/// Runs a sanitized harness on its input, writing `output`; fails with its report as `what`.
fn run_harness(exe: &Path, (input, output): (&Path, &Path), what: &str) {
    let run = Command::new(exe)
        .arg(input)
        .arg(output)
        .env("TSAN_OPTIONS", "halt_on_error=1")
        .env("ASAN_OPTIONS", "detect_leaks=1")
        .output()
        .expect("harness runs");
    assert!(run.status.success(), "{what}:\n{}", String::from_utf8_lossy(&run.stderr));
}

/// Builds the harness for `cell`'s kernels with `sanitize` and runs every
/// kernel once, comparing with the interpreter. Returns how many ran.
fn run_sanitized(cell_name: &str, sanitize: &str, threads: u32) -> usize {
    let dir =
        std::env::temp_dir().join(format!("cellc-cuda-san-{cell_name}-{sanitize}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let c = cell(cell_name);
    let sides = emu::sides(&c, 37, 5);
    let mut kernels = Vec::new();
    let mut cases = Vec::new();
    for (side_name, side) in &sides {
        for (i, st) in side.stages.iter().enumerate() {
            if st.kind.is_kernel() {
                let name = format!("{cell_name}_{side_name}_s{i}");
                kernels.push(
                    cuda::emit_stage(&side.graph, &side.plan, st, &side.plans[&i], &name, Context::default())
                        .expect("emits"),
                );
                cases.push((side, i));
            }
        }
    }
    let cu = dir.join("kernels.cu");
    std::fs::write(&cu, emu::emulation_source(&kernels)).expect("source");
    let harness: PathBuf = support::root().join("tests/cuda/harness.cpp");
    let exe = dir.join("harness");
    let flag = format!("-fsanitize={sanitize}");
    emu::gxx(&[cu, harness], &[&flag, "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"], &exe);
    for ((side, i), kernel) in cases.iter().zip(&kernels) {
        let st = &side.stages[*i];
        let whole = kernel.whole_sequence;
        let seq_rows: Vec<usize> = if whole { vec![3, 1, 2] } else { vec![3] };
        let rows: usize = seq_rows.iter().sum();
        let want = emu::run_buffers(side, st, &seq_rows, whole, 5);
        let got = emu::run_buffers(side, st, &seq_rows, whole, 5);
        let oracle =
            Interpreted::new(side.graph.clone(), side.plan.clone(), &st.values, &st.inputs, &st.outputs);
        // SAFETY: the table holds `rows` rows of buffers sized by the plan.
        unsafe { oracle.run(rows, &want.table) };
        // The job: the kernel, launch shape, buffers, and the table as buffer indices.
        let k = st.inputs.len() + st.outputs.len();
        let mut job = Vec::new();
        u32s(&mut job, [kernel.name.len() as u32]);
        job.extend_from_slice(kernel.name.as_bytes());
        u32s(&mut job, [2, threads, whole as u32, rows as u32, k as u32, kernel.scratch as u32]);
        u32s(&mut job, [got.buffers.len() as u32]);
        for b in &got.buffers {
            u32s(&mut job, [b.len() as u32]);
            u32s(&mut job, b.iter().map(|x| x.to_bits()));
        }
        u32s(&mut job, [got.slots.len() as u32]);
        u32s(&mut job, got.slots.iter().map(|&s| s as u32));
        if whole {
            u32s(&mut job, [seq_rows.len() as u32]);
            let starts = seq_rows.iter().scan(0u32, |at, &n| {
                let s = *at;
                *at += n as u32;
                Some(s)
            });
            u32s(&mut job, starts.collect::<Vec<_>>());
            u32s(&mut job, seq_rows.iter().map(|&n| n as u32));
        }
        let (job_path, out_path) =
            (dir.join(format!("{}.job", kernel.name)), dir.join(format!("{}.out", kernel.name)));
        std::fs::write(&job_path, &job).expect("job");
        run_harness(&exe, (&job_path, &out_path), &format!("{} under -fsanitize={sanitize}", kernel.name));
        let back = read_buffers(&out_path);
        for r in 0..rows {
            for o in 0..st.outputs.len() {
                let at = r * k + st.inputs.len() + o;
                let n = side.plan.elements(st.outputs[o]);
                // SAFETY: the oracle's table entries point into `want`'s own buffers.
                let w = unsafe { std::slice::from_raw_parts(want.table[at], n) };
                let g = &back[got.slots[at]];
                support::close_to_interpreter(&format!("{} row {r} output {o}", kernel.name), g, w);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    kernels.len()
}

#[test]
fn kernels_are_clean_under_address_and_undefined_behaviour_sanitizers() {
    let mut n = 0;
    for cell in ["lstm", "layernorm_lstm", "sru"] {
        n += run_sanitized(cell, "address,undefined", 32);
    }
    support::report(&format!("{n} kernels clean under AddressSanitizer + UBSan"));
}

#[test]
fn block_cooperative_kernels_are_race_free_under_thread_sanitizer() {
    let n = run_sanitized("layernorm_lstm", "thread", 32);
    support::report(&format!(
        "{n} kernels race-free under ThreadSanitizer (threaded emulation, barriers as std::barrier)"
    ));
}

/// Lane-form kernels have no barrier at all: they are right only if no
/// thread ever reads what another wrote, which ThreadSanitizer checks (an
/// LSTM's [4*H] pieces and SRU's register-carried state).
#[test]
fn lane_form_kernels_share_nothing_under_thread_sanitizer() {
    let mut n = 0;
    for cell in ["lstm", "sru"] {
        n += run_sanitized(cell, "thread", 32);
    }
    support::report(&format!(
        "{n} kernels race-free under ThreadSanitizer (lane form: no barriers, no shared memory)"
    ));
}

/// Little-endian words of a file.
fn words(path: &Path) -> Vec<u64> {
    let bytes = std::fs::read(path).expect("file");
    bytes.chunks(8).map(|c| u64::from_le_bytes(c.try_into().expect("whole words"))).collect()
}

/// A byte string of a recorder's image at `at` (its length, then its padded bytes).
fn text(w: &[u64], at: &mut usize) -> String {
    let len = w[*at] as usize;
    let bytes: Vec<u8> = w[*at + 1..*at + 1 + len.div_ceil(8)].iter().flat_map(|x| x.to_le_bytes()).collect();
    *at += 1 + len.div_ceil(8);
    String::from_utf8(bytes[..len].to_vec()).expect("utf-8")
}

/// Trains a 2-layer bidirectional LSTM (f32 and bf16) and LayerNorm-LSTM
/// (TF32; H = 37, varlen) on the emulated device, recording every step loop, then replays each
/// under `sanitize`: returns how many replayed, each with the recorded bits.
fn step_loops_sanitized(sanitize: &str) -> usize {
    let dir = std::env::temp_dir().join(format!("cellc-step-loop-san-{sanitize}-{}", std::process::id()));
    let images = dir.join("images");
    let cuda = Arc::new(Cuda::emulated_recording(&images).expect("emulated device"));
    let lengths = [3, 5, 1, 4];
    // f32 products on CUDA cores; bf16 and TF32 on the emulated tensor
    // cores (the warp's fragment exchange).
    let runs = [("lstm", Precision::F32), ("lstm", Precision::Bf16), ("layernorm_lstm", Precision::Tf32)];
    for (name, precision) in runs {
        let c = cell(name);
        let model = support::two_layer_model(&c, (37, 5, 6), 3, &|| Box::new(cuda.clone()))
            .with_precision(precision)
            .expect("precision");
        let x: Vec<f32> =
            (0..lengths.len() * 5 * model.input_size()).map(|i| (i as f32 * 0.37).sin()).collect();
        let input = Input::Padded {
            data: &x,
            batch: lengths.len(),
            steps: 5,
            major: Major::TimeFirst,
            align: Align::Right,
            lengths: &lengths,
        };
        let (out, trace) = model.forward_train(input, None).expect("forward");
        model.backward(&trace, &vec![0.5; out.data.len()], None).expect("backward");
    }
    let harness: PathBuf = support::root().join("tests/cuda/step_loop_harness.cpp");
    let flag = format!("-fsanitize={sanitize}");
    let mut built: std::collections::HashMap<String, PathBuf> = Default::default();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&images)
        .expect("images")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "img"))
        .collect();
    paths.sort();
    for image in &paths {
        let w = words(image);
        let mut at = 0;
        let module = text(&w, &mut at);
        let kernel = text(&w, &mut at);
        let exe = built.entry(module.clone()).or_insert_with(|| {
            let exe = dir.join(format!("harness-{}", built_name(&module)));
            emu::gxx(
                &[images.join(&module), harness.clone()],
                &[&flag, "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"],
                &exe,
            );
            exe
        });
        at += 3;
        at += 1 + w[at] as usize;
        let blocks = w[at] as usize;
        at += 1;
        let mut shape = Vec::new();
        for _ in 0..blocks {
            let (bytes, addresses) = (w[at + 1] as usize, w[at + 2] != 0);
            shape.push((bytes, addresses));
            at += 3 + bytes.div_ceil(8);
        }
        let out = image.with_extension("out");
        run_harness(
            exe,
            (image, &out),
            &format!("{kernel} ({}) under -fsanitize={sanitize}", image.display()),
        );
        let back = words(&out);
        assert_eq!(back[0] as usize, blocks, "{kernel}: blocks written back");
        let mut from = 1;
        for (i, &(bytes, addresses)) in shape.iter().enumerate() {
            assert_eq!(back[from] as usize, bytes, "{kernel}: block {i}'s size");
            let n = bytes.div_ceil(8);
            if !addresses {
                assert!(
                    back[from + 1..from + 1 + n] == w[at..at + n],
                    "{kernel}: block {i} differs from the recorded run"
                );
            }
            from += 1 + n;
            at += n;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(cuda.step_loops_run() > 0 && paths.len() == cuda.step_loops_run(), "{} images", paths.len());
    paths.len()
}

/// A file name for a harness built with `module`.
fn built_name(module: &str) -> String {
    module.trim_end_matches(".cu").to_string()
}

#[test]
fn step_loops_are_clean_under_address_and_undefined_behaviour_sanitizers() {
    let n = step_loops_sanitized("address,undefined");
    support::report(&format!(
        "{n} step-loop launches replayed clean under AddressSanitizer + UBSan, bit for bit"
    ));
}

#[test]
fn step_loops_are_race_free_under_thread_sanitizer() {
    let n = step_loops_sanitized("thread");
    support::report(&format!(
        "{n} step-loop launches replayed race-free under ThreadSanitizer (grid barrier as a std::barrier), bit for bit"
    ));
}
