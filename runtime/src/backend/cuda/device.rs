//! What the CUDA driver needs from a device, behind one trait, so the same
//! driver runs on a GPU and, for verification on machines without one, on
//! an emulated device: host memory, the generated kernels compiled as host
//! C++ through the emulation header (`g++`), GEMMs through the CPU back
//! end's `gemm`.
//!
//! Addresses are plain `u64`s, as device pointers are: a pointer table is
//! a buffer of addresses, and an offset into a buffer is arithmetic.

use crate::backend::cpu::gemm::{matmul, View};
use crate::error::{Result, RuntimeError};
use cellc::cuda::Kernel;
use std::any::Any;
use std::ffi::c_void;
use std::path::{Path, PathBuf};

/// Device memory: its address, its length in elements, and what owns it.
pub struct Buf {
    pub addr: u64,
    pub len: usize,
    _owner: Box<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buf({:#x}, {})", self.addr, self.len)
    }
}

impl Buf {
    /// Memory at `addr` of `len` elements, kept alive by `owner`.
    pub fn new(addr: u64, len: usize, owner: Box<dyn Any + Send + Sync>) -> Buf {
        Buf { addr, len, _owner: owner }
    }

    /// The address of float `i`.
    pub fn at(&self, i: usize) -> u64 {
        self.addr + 4 * i as u64
    }
}

/// A kernel argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
}

/// `C[m, n] = A[m, k] · B[n, k]ᵀ` on device addresses, row-major with row
/// strides `lda`, `ldb`, `ldc` (in floats).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmNt {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: u64,
    pub lda: usize,
    pub b: u64,
    pub ldb: usize,
    pub c: u64,
    pub ldc: usize,
}

/// A loaded set of kernels.
pub struct Module {
    inner: Box<dyn Any + Send + Sync>,
}

impl Module {
    pub fn new(inner: Box<dyn Any + Send + Sync>) -> Module {
        Module { inner }
    }

    /// The device's own module type.
    pub fn get<T: 'static>(&self) -> Option<&T> {
        self.inner.downcast_ref::<T>()
    }
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Module")
    }
}

pub trait Device: Send + Sync {
    fn name(&self) -> String;
    /// Threads per block to launch with (a power of two, at most [`cellc::cuda::BLOCK`]).
    fn block_size(&self) -> u32 {
        cellc::cuda::BLOCK
    }
    /// `len` zeroed floats.
    fn zeros(&self, len: usize) -> Result<Buf>;
    fn upload(&self, data: &[f32]) -> Result<Buf>;
    /// A table of addresses.
    fn upload_addresses(&self, addresses: &[u64]) -> Result<Buf>;
    fn upload_i32(&self, data: &[i32]) -> Result<Buf>;
    fn download(&self, buf: &Buf) -> Result<Vec<f32>>;
    /// Compiles and loads `kernels` (with the prelude's helpers).
    fn load(&self, kernels: &[Kernel]) -> Result<Module>;
    fn launch(&self, module: &Module, kernel: &str, grid: u32, block: u32, args: &[Arg]) -> Result<()>;
    /// `C = A · Bᵀ` (see [`GemmNt`]).
    fn gemm_nt(&self, p: GemmNt) -> Result<()>;
}

fn error(message: impl Into<String>) -> RuntimeError {
    RuntimeError::Backend { backend: "cuda".into(), message: message.into() }
}

/// The kernels as one host-C++ file: the generated translation unit, each
/// kernel (and the prelude's `cellc_copy_rows`) exported as
/// `cellc_launch_<name>`, and `cellc_find_launch(name)` to look one up.
pub fn emulation_source(kernels: &[Kernel]) -> String {
    let mut src = cellc::cuda::translation_unit(kernels);
    let names: Vec<&str> = kernels.iter().map(|k| k.name.as_str()).chain(["cellc_copy_rows"]).collect();
    for name in &names {
        src.push_str(&format!("CELLC_EMU_EXPORT({name})\n"));
    }
    src.push_str("extern \"C\" void (*cellc_find_launch(const char* name))(unsigned, unsigned, void**) {\n");
    for name in &names {
        src.push_str(&format!("    if (!std::strcmp(name, \"{name}\")) return &cellc_launch_{name};\n"));
    }
    src.push_str("    return nullptr;\n}\n");
    src
}

/// Compiles `files` as host C++ with g++ and the emulation header (written
/// into `dir`) into `output`; `args` choose a shared library or an
/// executable, debug information, sanitizers.
pub fn gxx(dir: &Path, files: &[PathBuf], args: &[&str], output: &Path) -> Result<()> {
    let header = dir.join("cuda_host_emu.h");
    std::fs::write(&header, cellc::cuda::prelude::HOST_EMULATION_HEADER).map_err(|e| error(e.to_string()))?;
    let out = std::process::Command::new("g++")
        .args(["-std=c++20", "-O1", "-pthread", "-include"])
        .arg(&header)
        .args(args)
        .args(["-x", "c++"])
        .args(files)
        .arg("-o")
        .arg(output)
        .output()
        .map_err(|e| error(format!("the emulated device needs g++: {e}")))?;
    if !out.status.success() {
        return Err(error(format!("g++ failed on {files:?}:\n{}", String::from_utf8_lossy(&out.stderr))));
    }
    Ok(())
}

/// The emulated device: everything in host memory, kernels through g++.
#[derive(Debug)]
pub struct Emulated {
    dir: PathBuf,
}

type Launch = unsafe extern "C" fn(u32, u32, *mut *mut c_void);

struct EmulatedModule {
    lib: libloading::Library,
}

impl Emulated {
    /// Needs `g++` (C++20) on the path when kernels are loaded.
    pub fn new() -> Result<Emulated> {
        let dir = std::env::temp_dir().join(format!("cellc-emulated-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| error(format!("{}: {e}", dir.display())))?;
        Ok(Emulated { dir })
    }
}

impl Device for Emulated {
    fn name(&self) -> String {
        "emulated (host C++)".into()
    }

    /// One OS thread per CUDA thread: small blocks keep the emulation quick
    /// while still striding over rows longer than a block.
    fn block_size(&self) -> u32 {
        32
    }

    fn zeros(&self, len: usize) -> Result<Buf> {
        self.upload(&vec![0.0; len])
    }

    fn upload(&self, data: &[f32]) -> Result<Buf> {
        let owned: Box<[f32]> = data.to_vec().into_boxed_slice();
        Ok(Buf { addr: owned.as_ptr() as u64, len: owned.len(), _owner: Box::new(owned) })
    }

    fn upload_addresses(&self, addresses: &[u64]) -> Result<Buf> {
        let owned: Box<[u64]> = addresses.to_vec().into_boxed_slice();
        Ok(Buf { addr: owned.as_ptr() as u64, len: owned.len(), _owner: Box::new(owned) })
    }

    fn upload_i32(&self, data: &[i32]) -> Result<Buf> {
        let owned: Box<[i32]> = data.to_vec().into_boxed_slice();
        Ok(Buf { addr: owned.as_ptr() as u64, len: owned.len(), _owner: Box::new(owned) })
    }

    fn download(&self, buf: &Buf) -> Result<Vec<f32>> {
        // SAFETY: emulated buffers are host memory of `len` floats, owned by `buf`.
        Ok(unsafe { std::slice::from_raw_parts(buf.addr as *const f32, buf.len) }.to_vec())
    }

    fn load(&self, kernels: &[Kernel]) -> Result<Module> {
        let src = emulation_source(kernels);
        let hash = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            src.hash(&mut h);
            h.finish()
        };
        let cu = self.dir.join(format!("k{hash:016x}.cu"));
        let so = self.dir.join(format!("libk{hash:016x}.so"));
        std::fs::write(&cu, &src).map_err(|e| error(e.to_string()))?;
        gxx(&self.dir, &[cu], &["-shared", "-fPIC"], &so)?;
        // SAFETY: a library just built from the generated kernels; loading runs no constructors of ours.
        let lib = unsafe { libloading::Library::new(&so) }.map_err(|e| error(e.to_string()))?;
        Ok(Module { inner: Box::new(EmulatedModule { lib }) })
    }

    fn launch(&self, module: &Module, kernel: &str, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        let m =
            module.inner.downcast_ref::<EmulatedModule>().ok_or_else(|| error("not an emulated module"))?;
        // SAFETY: CELLC_EMU_EXPORT defines this symbol with this signature.
        let f: libloading::Symbol<Launch> = unsafe { m.lib.get(format!("cellc_launch_{kernel}").as_bytes()) }
            .map_err(|_| error(format!("no kernel `{kernel}` in the module")))?;
        // cuLaunchKernel-style: one pointer to each argument's value.
        let mut values: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) => p,
                Arg::I32(i) => i as u32 as u64,
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = values.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        // SAFETY: the arguments match the kernel's parameters (pointers are 8 bytes, an i32
        // is read from the low 4 bytes of its little-endian slot); every address is memory
        // this device handed out.
        unsafe { f(grid, block, ptrs.as_mut_ptr()) };
        Ok(())
    }

    fn gemm_nt(&self, p: GemmNt) -> Result<()> {
        let GemmNt { m, n, k, a, lda, b, ldb, c, ldc } = p;
        // SAFETY: the caller passes addresses of this device's buffers with these shapes.
        unsafe {
            matmul(
                View::rows(c as *const f32, m, n, ldc),
                View::rows(a as *const f32, m, k, lda),
                View::rows(b as *const f32, n, k, ldb).t(),
                false,
            )
        };
        Ok(())
    }
}

impl Drop for Emulated {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
