//! The back ends a cell is checked on, and how each is made for a cell:
//! the reference back end, the CPU back end with JIT-compiled, walked
//! (AVX-512 and AVX2, where the processor has them) and interpreted
//! kernels, the CPU back end with kernels compiled ahead of
//! time (an object file, linked by the system linker into a shared library
//! and loaded, as `cellc-build` links it into a program), the CUDA back
//! end on the emulated device (the generated CUDA C++ compiled by g++), and
//! the CPU back end with bf16 products.

use cellc_runtime::backend::cpu::aot::LinkedKernels;
use cellc_runtime::backend::cpu::codegen::object::compile_object;
use cellc_runtime::backend::cpu::native::KernelFn;
use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::cuda::step_loop::StepLoops;
use cellc_runtime::backend::cuda::Cuda;
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::{CompiledCell, Layer, Precision};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A back end under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum BackendKind {
    Reference,
    CpuJit,
    CpuAvx512,
    CpuAvx2,
    CpuInterpreted,
    CpuLinked,
    /// The CUDA back end on the emulated device, its time loops as step
    /// loops (one cooperative kernel each) where the rule takes them.
    CudaEmulated,
    /// The same, every time loop step by step (a GEMM, then the step's kernels).
    CudaEmulatedSteps,
    /// The CPU back end with bf16 products ([`cellc_runtime::Precision::Bf16`]),
    /// held to its own noise rule (see `check::tolerances`).
    CpuBf16,
}

impl BackendKind {
    /// The precision its models' products compute in (`Model::with_precision`).
    pub fn precision(self) -> Precision {
        match self {
            BackendKind::CpuBf16 => Precision::Bf16,
            _ => Precision::F32,
        }
    }

    /// The CUDA back end (on the emulated device), either route.
    pub fn is_cuda(self) -> bool {
        matches!(self, BackendKind::CudaEmulated | BackendKind::CudaEmulatedSteps)
    }

    pub const ALL: [BackendKind; 9] = [
        BackendKind::Reference,
        BackendKind::CpuJit,
        BackendKind::CpuAvx512,
        BackendKind::CpuAvx2,
        BackendKind::CpuInterpreted,
        BackendKind::CpuLinked,
        BackendKind::CudaEmulated,
        BackendKind::CudaEmulatedSteps,
        BackendKind::CpuBf16,
    ];

    /// How many ulp from the exact value this back end's elementary
    /// functions (exp, tanh, ...) may be: 1 for a correctly rounded
    /// library's (the f32 oracle's own), more for approximations.
    pub fn math_ulp(self) -> f64 {
        match self {
            // The interpreter's op semantics: the host's libm.
            BackendKind::Reference | BackendKind::CpuInterpreted => 1.0,
            // Cranelift's range-reduced polynomials (the walked kernels compute the same bits).
            BackendKind::CpuJit
            | BackendKind::CpuAvx512
            | BackendKind::CpuAvx2
            | BackendKind::CpuLinked
            | BackendKind::CpuBf16 => cellc_runtime::backend::cpu::codegen::math::MAX_ULP,
            // CUDA's expf, tanhf, logf: 2 ulp (CUDA's math guide); the
            // emulated device compiles them with the host's libm.
            BackendKind::CudaEmulated | BackendKind::CudaEmulatedSteps => 2.0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Reference => "reference",
            BackendKind::CpuJit => "cpu (JIT kernels)",
            BackendKind::CpuAvx512 => "cpu (AVX-512 kernels)",
            BackendKind::CpuAvx2 => "cpu (AVX2 kernels)",
            BackendKind::CpuInterpreted => "cpu (interpreted kernels)",
            BackendKind::CpuLinked => "cpu (kernels linked ahead of time)",
            BackendKind::CudaEmulated => "cuda (emulated device)",
            BackendKind::CudaEmulatedSteps => "cuda (emulated device, step by step)",
            BackendKind::CpuBf16 => "cpu (bf16 products)",
        }
    }
}

/// Whether the emulated CUDA device can compile kernels here (it needs g++).
pub fn cuda_emulation_available() -> bool {
    cellc_runtime::backend::cuda::device::gxx_available()
}

/// Makes back end `kind` for a model of `cell` whose layers are `layers`.
pub fn make(kind: BackendKind, cell: &CompiledCell, layers: &[Layer]) -> Result<Box<dyn Device>, String> {
    let cpu = |kernels| {
        Cpu::new(2, kernels)
            .map(|c| Box::new(c.split_every_step()) as Box<dyn Device>)
            .map_err(|e| e.to_string())
    };
    match kind {
        BackendKind::Reference => Ok(Box::new(Reference)),
        BackendKind::CpuJit => cpu(Kernels::Jit),
        BackendKind::CpuAvx512 => cpu(Kernels::Avx512),
        BackendKind::CpuAvx2 => cpu(Kernels::Avx2),
        BackendKind::CpuInterpreted => cpu(Kernels::Interpreted),
        BackendKind::CpuLinked => cpu(Kernels::Linked(linked(cell, layers)?)),
        BackendKind::CpuBf16 => cpu(Kernels::Fastest),
        BackendKind::CudaEmulated => {
            Cuda::emulated().map(|c| Box::new(c) as Box<dyn Device>).map_err(|e| e.to_string())
        }
        BackendKind::CudaEmulatedSteps => Cuda::emulated()
            .map(|c| Box::new(c.with_step_loops(StepLoops::Never)) as Box<dyn Device>)
            .map_err(|e| e.to_string()),
    }
}

/// A library loaded for linked kernels, and the kernel table made from it.
struct Loaded {
    _library: libloading::Library,
    _table: &'static LinkedKernels,
}

/// Everything loaded for linked kernels. It stays loaded for the life of
/// the process: the CPU back end caches compiled layers by the kernel
/// table's address, which must never be reused. Kept here, the tables stay
/// reachable, so leak checkers (libFuzzer's) see no leak.
fn loaded() -> &'static Mutex<Vec<Loaded>> {
    static LOADED: Mutex<Vec<Loaded>> = Mutex::new(Vec::new());
    &LOADED
}

/// The cell's kernels for `layers` compiled into an object file, linked
/// into a shared library with the system's C compiler driver, and loaded.
fn linked(cell: &CompiledCell, layers: &[Layer]) -> Result<&'static LinkedKernels, String> {
    let artifacts = compile_object(cell, layers, false).map_err(|e| format!("object file: {e}"))?;
    let dir = scratch_dir()?;
    let object = dir.join("kernels.o");
    let library = dir.join("kernels.so");
    std::fs::write(&object, &artifacts.object).map_err(|e| format!("{}: {e}", object.display()))?;
    link_shared(&object, &library)?;
    // SAFETY: a library built just now from an object holding only the
    // kernels (no initialisers run on loading).
    let lib = unsafe { libloading::Library::new(&library) }
        .map_err(|e| format!("loading {}: {e}", library.display()))?;
    let _ = std::fs::remove_dir_all(&dir);
    let mut functions: Vec<(&'static str, KernelFn)> = Vec::new();
    for k in &artifacts.manifest.kernels {
        // SAFETY: the manifest lists each kernel with the ABI of `KernelFn`.
        let f: KernelFn = unsafe { lib.get::<KernelFn>(k.symbol.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("no symbol {} in the linked library: {e}", k.symbol))?;
        functions.push((Box::leak(k.symbol.clone().into_boxed_str()), f));
    }
    let manifest = serde_json::to_string(&artifacts.manifest).map_err(|e| e.to_string())?;
    let table: &'static LinkedKernels = Box::leak(Box::new(LinkedKernels::new(
        Box::leak(manifest.into_boxed_str()),
        Box::leak(functions.into_boxed_slice()),
    )));
    let mut all = loaded().lock().map_err(|_| "library list poisoned".to_string())?;
    all.push(Loaded { _library: lib, _table: table });
    Ok(table)
}

fn link_shared(object: &Path, library: &Path) -> Result<(), String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = std::process::Command::new(&cc)
        .arg("-shared")
        .arg("-o")
        .arg(library)
        .arg(object)
        .output()
        .map_err(|e| format!("linking the kernels needs a C compiler driver (`{cc}`): {e}"))?;
    if !out.status.success() {
        return Err(format!("`{cc} -shared` failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(())
}

fn scratch_dir() -> Result<PathBuf, String> {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("cellc-difftest-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}
