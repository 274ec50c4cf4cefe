//! Every kernel of every shipped cell through NVRTC for real architectures
//! (sm_80 and sm_90, SASS via NVRTC's built-in ptxas), with spills turned
//! into errors and the register count of each kernel checked against
//! [`MAX_REGISTERS`]. Prints the table (cell, kernel, arch, registers,
//! shared memory, the kernel's form: lane or block).
//!
//! `CELLC_NVRTC_ARCHS` (comma-separated, e.g. `sm_90a`) adds architectures:
//! the GPU check adds the device's own.
//!
//! Needs NVRTC 13 or 12 (found as the back end finds it: CI fetches the
//! wheel and names its folder in `CELLC_CUDA_LIB_DIR`). Without it the test
//! says so and passes, unless `CELLC_REQUIRE_NVRTC` is set (CI sets it),
//! then it fails.

mod support;

use cellc::cuda::{self, Kernel};
use cellc_runtime::backend::cuda::{nvrtc, step_loop};
use cellc_runtime::{CompiledCell, Layer, Side};

/// Registers per thread allowed: 96. An SM of sm_80/sm_90 has 65536
/// registers, so at 96 five of our 128-thread blocks (640 threads) stay
/// resident, enough latency hiding for a memory-bound kernel. The kernels
/// use 14-48 today, but for the sLSTM's backward (one block-form kernel of
/// 82 values that reads 19 vectors and writes 9, their pointers held in
/// registers): 80. Bounding it at 64 (`__launch_bounds__(128, 8)`) spills
/// 60 bytes, which the check below forbids.
const MAX_REGISTERS: u32 = 96;

/// sm_80 and sm_90, and those of `CELLC_NVRTC_ARCHS`.
fn archs() -> Vec<String> {
    let mut archs = vec!["sm_80".to_string(), "sm_90".to_string()];
    let more = std::env::var("CELLC_NVRTC_ARCHS").unwrap_or_default();
    for arch in more.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        if !archs.iter().any(|a| a == arch) {
            archs.push(arch.to_string());
        }
    }
    archs
}

fn kernels(c: &CompiledCell, h: usize) -> Vec<Kernel> {
    // H = h, P = h/2, I = h, and a quarter of h for any other size (the
    // sLSTM cells' head size D, so that their 4 heads are h wide).
    let size = |k: &str| match k {
        "H" | "I" => h,
        "P" => h / 2,
        _ => (h / 4).max(1),
    };
    let sizes = c.forward.sizes.iter().map(|k| (k.clone(), size(k))).collect();
    let layer = Layer::new(c, 0, &sizes).expect("sizes");
    let stages = cuda::emit_cell(&c.forward, &c.backward, &layer, None).expect("emits");
    // The step loops the runtime builds from them.
    let mut all = stages.clone();
    for side in Side::BOTH {
        let of = |i: usize| {
            let mut found = layer.kernels().zip(&stages).filter(|(k, _)| k.side == side && k.stage == i);
            found.next().map(|(_, k)| k)
        };
        let loops = step_loop::step_loops(c, &layer, side, of).expect("step loops");
        all.extend(loops.into_iter().map(|(_, l)| l.kernel));
    }
    all
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_without_spills() {
    if !nvrtc::available() {
        assert!(
            std::env::var_os("CELLC_REQUIRE_NVRTC").is_none(),
            "CELLC_REQUIRE_NVRTC is set but NVRTC cannot be loaded: {}",
            nvrtc::NvrtcError::NotFound
        );
        support::report(
            "SKIPPED: libnvrtc not found; NVRTC compilation of the generated kernels was not checked",
        );
        return;
    }
    let (major, minor) = nvrtc::version().expect("version");
    support::report(&format!("NVRTC {major}.{minor}"));
    support::report(&format!(
        "{:<16} {:<28} {:<6} {:>9} {:>11}  form",
        "cell", "kernel", "arch", "registers", "shared (B)"
    ));
    let (mut count, mut mma_loops) = (0, 0);
    let archs = archs();
    // The table is for H = 256; H = 37 (odd offsets, a partial block) is
    // compiled and checked the same way without printing.
    for (path, h) in support::shipped_cells()
        .iter()
        .filter(|p| p.file_stem().is_some_and(|s| s != "prelude"))
        .flat_map(|p| [(p, 256), (p, 37)])
    {
        let c = CompiledCell::from_file(path, None).expect("compiles");
        let ks = kernels(&c, h);
        let source = cuda::translation_unit(&ks);
        if let (Some(dir), 256) = (std::env::var_os("CELLC_CUDA_DUMP"), h) {
            // For looking at what NVRTC was given.
            std::fs::write(std::path::Path::new(&dir).join(format!("{}.cu", c.forward.name)), &source)
                .expect("dump");
        }
        for arch in &archs {
            let mut options: Vec<String> = cuda::NVRTC_OPTIONS.iter().map(|o| o.to_string()).collect();
            options.extend([
                format!("--gpu-architecture={arch}"),
                "--ptxas-options=-v".into(),
                "--ptxas-options=--warn-on-spills".into(),
                "--ptxas-options=--warning-as-error".into(),
            ]);
            let out = nvrtc::compile(&source, &format!("{}.cu", c.forward.name), &options)
                .unwrap_or_else(|e| panic!("{}: {e}", c.forward.name));
            assert!(!out.cubin.is_empty(), "{} {arch}: no SASS", c.forward.name);
            let usage = nvrtc::usage(&out.log);
            for k in &ks {
                let u = usage
                    .iter()
                    .find(|u| u.kernel == k.name)
                    .unwrap_or_else(|| panic!("{arch}: no ptxas report for {}:\n{}", k.name, out.log));
                let form = match (k.cooperative, k.units) {
                    (true, _) => "step loop".to_string(),
                    (false, 0) => "block".to_string(),
                    (false, u) => format!("lane (U={u})"),
                };
                if h == 256 {
                    support::report(&format!(
                        "{:<16} {:<28} {:<6} {:>9} {:>11}  {form}",
                        c.forward.name, k.name, arch, u.registers, u.shared_bytes
                    ));
                }
                assert_eq!((u.spill_stores, u.spill_loads), (0, 0), "{} (H={h}) spills on {arch}", k.name);
                if k.cooperative && k.source.contains("cellc_mma_product(") {
                    // The products in bf16, fp16 and TF32 are the tensor cores'.
                    let body = out.ptx.split(".entry ").find(|e| e.starts_with(&format!("{}(", k.name)));
                    let body = body.unwrap_or_else(|| panic!("{arch}: no PTX entry {}", k.name));
                    for shape in
                        ["m16n8k16.row.col.f32.bf16", "m16n8k16.row.col.f32.f16", "m16n8k8.row.col.f32.tf32"]
                    {
                        assert!(
                            body.contains(&format!("mma.sync.aligned.{shape}")),
                            "{} on {arch}: no {shape}",
                            k.name
                        );
                    }
                    mma_loops += 1;
                }
                assert!(
                    u.registers <= MAX_REGISTERS,
                    "{} (H={h}) uses {} registers on {arch}",
                    k.name,
                    u.registers
                );
                count += 1;
            }
        }
    }
    assert!(count >= 120, "only {count} kernel compilations checked");
    assert!(mma_loops >= 40, "only {mma_loops} step loops on tensor cores");
    support::report(&format!(
        "{count} kernel compilations (H=256 and H=37, {}): no spills, at most {MAX_REGISTERS} registers; {mma_loops} step loops with tensor-core products",
        archs.join(", ")
    ));
}
