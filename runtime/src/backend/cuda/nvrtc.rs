//! NVRTC through cudarc, loaded dynamically: the project builds and runs
//! where CUDA is absent, and asking for a compilation there is a typed
//! error, never a panic.
//!
//! The library (CUDA 13's or 12's) is found by [`super::libraries`]: the
//! folders of `CELLC_CUDA_LIB_DIR`, PyTorch's NVIDIA wheels, the system's.

use cudarc::nvrtc::{result, sys};
use std::ffi::CString;

/// What one compilation produced.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The PTX of the whole translation unit.
    pub ptx: String,
    /// SASS for a real architecture (`sm_XX`); empty for a virtual one (`compute_XX`).
    pub cubin: Vec<u8>,
    /// NVRTC's log: with `--ptxas-options=-v`, the registers, spills and
    /// shared memory of every kernel.
    pub log: String,
}

/// Why a compilation did not happen or failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NvrtcError {
    /// `libnvrtc` could not be loaded.
    NotFound,
    /// NVRTC rejected the source or the options: its log, then the source
    /// with line numbers (NVRTC's messages cite them).
    Compile {
        /// The options the compilation was given.
        options: Vec<String>,
        /// NVRTC's log of the failure.
        log: String,
        /// The source, each line prefixed with its number.
        numbered_source: String,
    },
    /// Any other NVRTC failure.
    Nvrtc(String),
}

impl std::fmt::Display for NvrtcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NvrtcError::NotFound => match super::libraries::load(super::libraries::Library::Nvrtc) {
                Err(missing) => write!(f, "{missing}"),
                Ok(found) => {
                    write!(f, "NVRTC was loaded from {} but cudarc cannot open it by name", found.path)
                }
            },
            NvrtcError::Compile { options, log, numbered_source } => {
                write!(f, "NVRTC failed with options {options:?}:\n{log}\n--- source ---\n{numbered_source}")
            }
            NvrtcError::Nvrtc(m) => write!(f, "NVRTC: {m}"),
        }
    }
}

impl std::error::Error for NvrtcError {}

/// Whether `libnvrtc` can be loaded in this process.
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the library, found first by `libraries`.
    super::libraries::load(super::libraries::Library::Nvrtc).is_ok() && unsafe { sys::is_culib_present() }
}

/// NVRTC's version, `(major, minor)`.
pub fn version() -> Result<(i32, i32), NvrtcError> {
    if !available() {
        return Err(NvrtcError::NotFound);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    r.result().map_err(|e| NvrtcError::Nvrtc(format!("{e:?}")))?;
    Ok((major, minor))
}

/// Compiles `source` (named `name` in messages) with `options`, e.g.
/// `["--gpu-architecture=sm_80", "--ptxas-options=-v"]`.
pub fn compile(source: &str, name: &str, options: &[String]) -> Result<Compiled, NvrtcError> {
    if !available() {
        return Err(NvrtcError::NotFound);
    }
    let src = CString::new(source).map_err(|_| NvrtcError::Nvrtc("source contains a NUL byte".into()))?;
    let name = CString::new(name).map_err(|_| NvrtcError::Nvrtc("name contains a NUL byte".into()))?;
    let prog = result::create_program(&src, Some(&name)).map_err(|e| NvrtcError::Nvrtc(format!("{e:?}")))?;
    // SAFETY: `prog` was just created and is destroyed below, once.
    let outcome = unsafe { result::compile_program(prog, options) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(prog) }
        .map(|raw| {
            let bytes: Vec<u8> = raw.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    let compiled = match outcome {
        Err(_) => Err(NvrtcError::Compile {
            options: options.to_vec(),
            log,
            numbered_source: source.lines().enumerate().map(|(i, l)| format!("{:4} {l}\n", i + 1)).collect(),
        }),
        Ok(()) => {
            // SAFETY: the program compiled.
            let ptx = unsafe { result::get_ptx(prog) }.map_err(|e| NvrtcError::Nvrtc(format!("{e:?}")))?;
            let ptx: Vec<u8> = ptx.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
            let mut n = 0usize;
            // SAFETY: an out-parameter; the CUBIN is empty for virtual architectures.
            unsafe { sys::nvrtcGetCUBINSize(prog, &mut n) }
                .result()
                .map_err(|e| NvrtcError::Nvrtc(format!("{e:?}")))?;
            let mut cubin = vec![0u8; n];
            if n > 0 {
                // SAFETY: a buffer of the size NVRTC reported.
                unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }
                    .result()
                    .map_err(|e| NvrtcError::Nvrtc(format!("{e:?}")))?;
            }
            Ok(Compiled { ptx: String::from_utf8_lossy(&ptx).into_owned(), cubin, log })
        }
    };
    // SAFETY: created above, not used afterwards.
    let _ = unsafe { result::destroy_program(prog) };
    compiled
}

/// [`compile`], remembered for the process: keyed by the source's hash,
/// the options (architecture included) and NVRTC's version, so a model
/// compiles its kernels once however many times it is built.
pub fn compile_cached(
    source: &str,
    name: &str,
    options: &[String],
) -> Result<std::sync::Arc<Compiled>, NvrtcError> {
    use std::collections::HashMap;
    use std::hash::{Hash, Hasher};
    use std::sync::{Arc, Mutex, OnceLock};
    /// Source hash, options, NVRTC version.
    type Key = (u64, Vec<String>, (i32, i32));
    static CACHE: OnceLock<Mutex<HashMap<Key, Arc<Compiled>>>> = OnceLock::new();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    source.hash(&mut hasher);
    let key = (hasher.finish(), options.to_vec(), version()?);
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(hit) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(hit);
    }
    let compiled = Arc::new(compile(source, name, options)?);
    if let Ok(mut c) = cache.lock() {
        c.insert(key, compiled.clone());
    }
    Ok(compiled)
}

/// Per-kernel resource use parsed from a `--ptxas-options=-v` log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    /// The kernel's entry-function name, as in the log.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores per thread.
    pub spill_stores: u32,
    /// Bytes of spill loads per thread.
    pub spill_loads: u32,
    /// Bytes of shared memory per block (static, `smem`).
    pub shared_bytes: u32,
}

/// Reads ptxas' `Compiling entry function 'k'` / `Used N registers` lines.
pub fn usage(log: &str) -> Vec<Usage> {
    let mut out: Vec<Usage> = Vec::new();
    let number_before = |line: &str, word: &str| -> u32 {
        line.split(',')
            .find(|part| part.contains(word))
            .and_then(|part| part.split_whitespace().find_map(|w| w.parse().ok()))
            .unwrap_or(0)
    };
    for line in log.lines() {
        if let Some(rest) = line.split("entry function '").nth(1) {
            let kernel = rest.split('\'').next().unwrap_or("").to_string();
            out.push(Usage { kernel, registers: 0, spill_stores: 0, spill_loads: 0, shared_bytes: 0 });
        } else if let Some(u) = out.last_mut() {
            if line.contains("Used") && line.contains("registers") {
                u.registers = number_before(line, "registers");
                u.shared_bytes = number_before(line, "smem");
            } else if line.contains("spill stores") {
                u.spill_stores = number_before(line, "spill stores");
                u.spill_loads = number_before(line, "spill loads");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_reports_are_read_per_kernel() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'lstm_fwd_s2' for 'sm_80'\n\
ptxas info    : Function properties for lstm_fwd_s2\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 30 registers, used 1 barriers, 512 bytes smem, 380 bytes cmem[0]\n";
        let u = usage(log);
        assert_eq!(u.len(), 1);
        assert_eq!(u[0].kernel, "lstm_fwd_s2");
        assert_eq!((u[0].registers, u[0].spill_stores, u[0].shared_bytes), (30, 0, 512));
    }

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        if !available() {
            assert_eq!(compile("", "x.cu", &[]).err(), Some(NvrtcError::NotFound));
            assert_eq!(compile_cached("", "x.cu", &[]).err(), Some(NvrtcError::NotFound));
        }
    }

    #[test]
    fn the_cache_compiles_once_and_reports_errors_with_numbered_source() {
        if !available() {
            eprintln!("SKIPPED: libnvrtc not found");
            return;
        }
        let src = "extern \"C\" __global__ void k(float* p) { p[threadIdx.x] = 1.0f; }";
        let opts = vec!["--gpu-architecture=sm_80".to_string()];
        let a = compile_cached(src, "k.cu", &opts).expect("compiles");
        let b = compile_cached(src, "k.cu", &opts).expect("compiles");
        assert!(std::sync::Arc::ptr_eq(&a, &b), "the second call is a cache hit");
        assert!(!a.cubin.is_empty() && a.ptx.contains(".entry k"));
        match compile("__global__ void k() { undefined_fn(); }", "bad.cu", &opts) {
            Err(NvrtcError::Compile { log, numbered_source, .. }) => {
                assert!(log.contains("undefined_fn"), "{log}");
                assert!(numbered_source.starts_with("   1 __global__"), "{numbered_source}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }
}
