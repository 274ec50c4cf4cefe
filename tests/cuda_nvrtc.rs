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
use cellc_runtime::backend::cuda::nvrtc;
use cellc_runtime::CompiledCell;

/// Registers per thread allowed: 64. An SM of sm_80/sm_90 has 65536
/// registers, so at 64 a block of up to 1024 threads can launch and eight
/// of our 128-thread blocks (1024 threads, half the SM's maximum) stay
/// resident, the latency hiding a memory-bound kernel needs. The kernels
/// use 18-48 today.
const MAX_REGISTERS: u32 = 64;

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
    let sizes = [("H".to_string(), h), ("P".to_string(), h / 2), ("I".to_string(), h)]
        .into_iter()
        .filter(|(k, _)| c.forward.sizes.contains(k))
        .collect();
    cuda::emit_cell(&c.forward, &c.backward, &c.program(&sizes).expect("sizes"), None).expect("emits")
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
    let mut count = 0;
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
                let form = if k.units > 0 { format!("lane (U={})", k.units) } else { "block".to_string() };
                if h == 256 {
                    support::report(&format!(
                        "{:<16} {:<28} {:<6} {:>9} {:>11}  {form}",
                        c.forward.name, k.name, arch, u.registers, u.shared_bytes
                    ));
                }
                assert_eq!((u.spill_stores, u.spill_loads), (0, 0), "{} (H={h}) spills on {arch}", k.name);
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
    support::report(&format!(
        "{count} kernel compilations (H=256 and H=37, {}): no spills, at most {MAX_REGISTERS} registers",
        archs.join(", ")
    ));
}
