//! What the CUDA driver needs from a device, behind one trait, so the same
//! driver runs on a GPU and, for verification on machines without one, on
//! an emulated device: host memory, the generated kernels compiled as host
//! C++ through the emulation header (`g++`), GEMMs through the CPU back
//! end's `gemm`.
//!
//! Addresses are plain `u64`s, as device pointers are: a pointer table is
//! a buffer of addresses, and an offset into a buffer is arithmetic.

use super::recorder::Recorder;
use crate::backend::cpu::gemm::{matmul, View};
pub(super) use crate::error::cuda_error as error;
use crate::error::Result;
use cellc::cuda::prelude::ROW_KERNELS;
use cellc::cuda::Kernel;
use std::any::Any;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub use crate::pass::Buf;

/// A kernel argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
}

/// `C = op(A) · op(B)`, or `C += op(A) · op(B)` with `accumulate`, on
/// row-major matrices at device addresses with row strides `lda`, `ldb`,
/// `ldc` (in floats). `op(A)` is `[m, k]`: `A` stored `[m, k]`, or stored
/// `[k, m]` and transposed (`trans_a`); likewise `op(B)` is `[k, n]`.
///
/// The RNN's products: `Y = X · Wᵀ` (`trans_b`), `Y = D · W`,
/// `dW = Dᵀ · X` (`trans_a`), and a column sum as `ones · V`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: u64,
    pub lda: usize,
    pub trans_a: bool,
    pub b: u64,
    pub ldb: usize,
    pub trans_b: bool,
    pub c: u64,
    pub ldc: usize,
    pub accumulate: bool,
    /// The operands' precision, the sums f32 ([`cellc::precision::Precision`]: bf16 or
    /// fp16 on a GPU's tensor cores, with `CUBLAS_COMPUTE_32F_FAST_16BF` or
    /// `_16F`).
    pub operands: cellc::precision::Precision,
    /// One product, or one per head of a block-diagonal weight.
    pub batch: Batch,
}

/// `count` products of the same shapes (a strided batched GEMM), the
/// `i`-th on `A`, `B` and `C` `i * a`, `i * b` and `i * c` floats on: the
/// heads of a block-diagonal weight, each on its columns of the vectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Batch {
    pub count: usize,
    pub a: usize,
    pub b: usize,
    pub c: usize,
}

impl Batch {
    /// A single product.
    pub const ONE: Batch = Batch { count: 1, a: 0, b: 0, c: 0 };
}

/// One operation of a run: a kernel launch or a GEMM. A forward or
/// backward pass is a list of these, built after every upload, so the
/// list can run as it is or be captured into a CUDA graph.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Call {
    Launch {
        kernel: String,
        grid: u32,
        block: u32,
        args: Vec<Arg>,
    },
    /// A step-loop kernel ([`cellc::cuda::persistent`]): every block
    /// resident at once, each with `shared` bytes of dynamic shared memory.
    Cooperative {
        kernel: String,
        grid: u32,
        block: u32,
        shared: u32,
        args: Vec<Arg>,
    },
    Gemm(Gemm),
    /// `floats` floats from `addr` set to zero.
    Zero {
        addr: u64,
        floats: usize,
    },
}

/// A loaded set of kernels.
pub(crate) struct Module {
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

pub(crate) trait Device: Send + Sync {
    fn name(&self) -> String;
    /// Threads per block to launch with (a power of two, at most [`cellc::cuda::BLOCK`]).
    fn block_size(&self) -> u32 {
        cellc::cuda::BLOCK
    }
    /// `len` zeroed floats.
    fn zeros(&self, len: usize) -> Result<Buf>;
    fn upload(&self, data: &[f32]) -> Result<Buf>;
    /// Floats uploaded by [`Device::upload`] so far (parameters, inputs,
    /// states; not pointer tables).
    fn floats_uploaded(&self) -> usize;
    /// A table of addresses.
    fn upload_addresses(&self, addresses: &[u64]) -> Result<Buf>;
    fn upload_i32(&self, data: &[i32]) -> Result<Buf>;
    /// Floats `[from, from + len)` of `buf` (a float buffer), once every call run so far is done.
    fn download(&self, buf: &Buf, from: usize, len: usize) -> Result<Vec<f32>>;
    /// Compiles and loads `kernels` (with the prelude's helpers).
    fn load(&self, kernels: &[Kernel]) -> Result<Module>;
    /// Runs `calls` in order. With `graph`, a device that has CUDA graphs
    /// captures them into one and launches that, reusing it whenever the
    /// same calls come again; others run them one by one.
    fn run(&self, module: &Module, calls: &[Call], graph: bool) -> Result<()>;
    /// How many runs reused a captured graph, and how many captured one.
    fn graph_stats(&self) -> GraphStats {
        GraphStats::default()
    }
    /// What a cooperative launch may use here, or `None` where the device
    /// cannot launch one (step loops then run as launches per step).
    fn cooperative_limits(&self) -> Option<CooperativeLimits> {
        None
    }
    /// This device working on the caller's stream (a `CUstream` handle):
    /// every allocation, copy, fill and free ordered on that stream and
    /// nothing waited for by the host, so a framework's own work before and
    /// after is ordered with it ([`super::resident`]). `None` where the
    /// device has no streams (the emulated device, whose work is done when
    /// a call returns): use it as it is.
    fn on_stream(&self, stream: u64) -> Result<Option<Box<dyn Device + '_>>> {
        let _ = stream;
        Ok(None)
    }
}

/// The grid of a cooperative launch: its blocks (all resident at once, one
/// per multiprocessor on a GPU) and the dynamic shared memory a block may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CooperativeLimits {
    /// Blocks of the grid.
    pub blocks: usize,
    /// Dynamic shared memory a block may have, in bytes.
    pub shared_bytes: usize,
}

/// The two things a device does for a [`Call`]; [`Primitives::issue`]
/// runs a list of them in order.
pub(crate) trait Primitives {
    fn launch(&self, module: &Module, kernel: &str, grid: u32, block: u32, args: &[Arg]) -> Result<()>;
    /// `kernel` on `dims` (grid, block, dynamic shared bytes), every block resident at once.
    fn launch_cooperative(
        &self,
        module: &Module,
        kernel: &str,
        dims: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<()>;
    fn gemm(&self, g: &Gemm) -> Result<()>;
    fn zero(&self, addr: u64, floats: usize) -> Result<()>;

    fn issue(&self, module: &Module, calls: &[Call]) -> Result<()> {
        for call in calls {
            match call {
                Call::Launch { kernel, grid, block, args } => {
                    self.launch(module, kernel, *grid, *block, args)?
                }
                Call::Cooperative { kernel, grid, block, shared, args } => {
                    self.launch_cooperative(module, kernel, (*grid, *block, *shared), args)?
                }
                Call::Gemm(g) => self.gemm(g)?,
                &Call::Zero { addr, floats } => self.zero(addr, floats)?,
            }
        }
        Ok(())
    }
}

/// Counts of a device's runs with CUDA graphs on ([`super::Cuda::with_graphs`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Runs of calls seen for the first time, run without a graph.
    pub warmed_up: usize,
    /// Runs that launched a graph captured before for the same calls.
    pub replayed: usize,
    /// Runs whose calls were captured into a new graph (and launched).
    pub captured: usize,
}

/// Whether floats `[from, from + len)` lie inside `buf`.
pub(crate) fn check_range(buf: &Buf, from: usize, len: usize) -> Result<()> {
    match from.checked_add(len) {
        Some(end) if end <= buf.len => Ok(()),
        _ => Err(error(format!("download of [{from}, {from}+{len}) from a buffer of {} floats", buf.len))),
    }
}

/// Freed device memory kept for reuse, by size in bytes (PyTorch's
/// caching allocator does the same: allocating is a driver call that
/// synchronises). A request takes the free block of its size with the
/// lowest address, so which block it gets depends only on what is free,
/// not on the order things were freed in: a pass run again at the same
/// shape, once everything it used is free again, gets the same addresses,
/// its [`Call`]s are identical, and a captured graph is replayed.
pub(crate) struct Pool<T> {
    free: Mutex<BTreeMap<usize, BTreeMap<u64, T>>>,
}

impl<T> Default for Pool<T> {
    fn default() -> Self {
        Pool { free: Mutex::new(BTreeMap::new()) }
    }
}

impl<T> std::fmt::Debug for Pool<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pool")
    }
}

impl<T: Send + 'static> Pool<T> {
    /// The free block of `bytes` with the lowest address, if there is one.
    pub fn take(&self, bytes: usize) -> Option<(u64, T)> {
        self.free.lock().ok()?.get_mut(&bytes)?.pop_first()
    }

    /// Drops every cached block (a device out of memory frees them and retries).
    pub fn clear(&self) {
        if let Ok(mut free) = self.free.lock() {
            free.clear();
        }
    }

    /// A [`Buf`] of `len` elements over `block` at `addr`, returned to this pool when dropped.
    pub fn buf(self: &Arc<Self>, addr: u64, len: usize, bytes: usize, block: T) -> Buf
    where
        T: Sync,
    {
        Buf::new(addr, len, Box::new(Pooled { block: Some(block), addr, bytes, pool: self.clone() }))
    }
}

/// A block on loan from a [`Pool`].
struct Pooled<T: Send + 'static> {
    block: Option<T>,
    addr: u64,
    bytes: usize,
    pool: Arc<Pool<T>>,
}

impl<T: Send + 'static> Drop for Pooled<T> {
    fn drop(&mut self) {
        if let (Some(block), Ok(mut free)) = (self.block.take(), self.pool.free.lock()) {
            free.entry(self.bytes).or_default().insert(self.addr, block);
        }
    }
}

/// The kernels as one host-C++ file: the generated translation unit, each
/// kernel (and the prelude's [`ROW_KERNELS`]) exported as
/// `cellc_launch_<name>`, and `cellc_find_launch(name)` to look one up
/// (step loops: `cellc_launch_grid_<name>`, `cellc_find_launch_grid(name)`).
pub fn emulation_source(kernels: &[Kernel]) -> String {
    let mut src = cellc::cuda::translation_unit(kernels);
    for k in kernels.iter().filter(|k| k.cooperative) {
        src.push_str(&format!("CELLC_EMU_EXPORT_GRID({})\n", k.name));
    }
    let names: Vec<&str> =
        kernels.iter().filter(|k| !k.cooperative).map(|k| k.name.as_str()).chain(ROW_KERNELS).collect();
    for name in &names {
        src.push_str(&format!("CELLC_EMU_EXPORT({name})\n"));
    }
    src.push_str("extern \"C\" void (*cellc_find_launch(const char* name))(unsigned, unsigned, void**) {\n");
    for name in &names {
        src.push_str(&format!("    if (!std::strcmp(name, \"{name}\")) return &cellc_launch_{name};\n"));
    }
    src.push_str("    return nullptr;\n}\n");
    src.push_str(
        "extern \"C\" void (*cellc_find_launch_grid(const char* name))(unsigned, unsigned, unsigned, void**) {\n",
    );
    for k in kernels.iter().filter(|k| k.cooperative) {
        src.push_str(&format!(
            "    if (!std::strcmp(name, \"{0}\")) return &cellc_launch_grid_{0};\n",
            k.name
        ));
    }
    src.push_str("    return nullptr;\n}\n");
    src
}

/// Whether `g++` runs here (asked once per process).
pub fn gxx_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::process::Command::new("g++").arg("--version").output().is_ok_and(|o| o.status.success())
    })
}

/// The flags every emulated build uses (a library build adds `-shared`).
const GXX_FLAGS: [&str; 4] = ["-std=c++20", "-O1", "-pthread", "-fPIC"];

/// The emulation header, written once per machine into a temporary folder
/// named after its contents, beside a precompiled copy for [`GXX_FLAGS`]:
/// parsing the header's standard library is most of a kernel build's
/// time, and g++ takes the precompiled copy wherever the flags match (it
/// reads the header itself otherwise: sanitizer builds). Several
/// processes may race to write it; each writes a whole file and renames.
fn emulation_header() -> Result<PathBuf> {
    static HEADER: std::sync::OnceLock<std::result::Result<PathBuf, String>> = std::sync::OnceLock::new();
    let made = HEADER.get_or_init(|| {
        use std::hash::{Hash, Hasher};
        let text = cellc::cuda::prelude::HOST_EMULATION_HEADER;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        text.hash(&mut h);
        GXX_FLAGS.hash(&mut h);
        let dir = std::env::temp_dir().join(format!("cellc-emulation-{:016x}", h.finish()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let header = dir.join("cuda_host_emu.h");
        if std::fs::read_to_string(&header).ok().as_deref() != Some(text) {
            crate::files::write_atomically(&header, text.as_bytes()).map_err(|e| e.to_string())?;
        }
        let pch = dir.join("cuda_host_emu.h.gch");
        if !pch.exists() {
            let tmp = dir.join(format!("cuda_host_emu.h.gch.tmp-{}", std::process::id()));
            let built = std::process::Command::new("g++")
                .args(GXX_FLAGS)
                .args(["-Wno-pragma-once-outside-header", "-x", "c++-header"])
                .arg(&header)
                .arg("-o")
                .arg(&tmp)
                .output();
            // Without a precompiled header every build parses the header: slower, not wrong.
            if built.is_ok_and(|o| o.status.success()) {
                let _ = std::fs::rename(&tmp, &pch);
            }
            let _ = std::fs::remove_file(&tmp);
        }
        Ok(header)
    });
    made.clone().map_err(error)
}

/// Compiles `files` as host C++ with g++ and the emulation header into
/// `output`; `args` choose a shared library or an executable, debug
/// information, sanitizers.
pub fn gxx(files: &[PathBuf], args: &[&str], output: &Path) -> Result<()> {
    let header = emulation_header()?;
    let out = std::process::Command::new("g++")
        .args(GXX_FLAGS)
        .arg("-include")
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

/// The emulated device: everything in host memory, kernels through g++,
/// GEMMs through the CPU back end's `gemm`. With `graph`, runs are matched
/// against the ones seen before exactly as the GPU matches captured
/// graphs (and counted in [`Device::graph_stats`]), then run call by call.
#[derive(Debug)]
pub(crate) struct Emulated {
    dir: PathBuf,
    pool: Arc<Pool<Box<[u64]>>>,
    graphs: Mutex<GraphCache<()>>,
    uploaded: std::sync::atomic::AtomicUsize,
    /// Images of every step-loop launch, where asked for ([`Emulated::recording`]).
    recorder: Option<Recorder>,
}

type Launch = unsafe extern "C" fn(u32, u32, *mut *mut c_void);
type LaunchGrid = unsafe extern "C" fn(u32, u32, u32, *mut *mut c_void);

/// cuLaunchKernel-style arguments: one slot per argument, 8 bytes each (an
/// i32 in the low 4 bytes of its little-endian slot), and a pointer to each.
fn argument_slots(args: &[Arg]) -> Vec<u64> {
    args.iter()
        .map(|a| match *a {
            Arg::Ptr(p) => p,
            Arg::I32(i) => i as u32 as u64,
        })
        .collect()
}

struct EmulatedModule {
    lib: libloading::Library,
    /// Kernels whose threads share nothing (lane form, row copies): run
    /// serially, every (block, thread) in turn on the calling thread,
    /// which gives the same results without an OS thread per CUDA thread.
    /// Block-form kernels, whose threads meet at barriers, run threaded.
    serial: std::collections::HashSet<String>,
    /// The name of its source beside a recorder's images.
    source_file: String,
}

impl Emulated {
    /// Needs `g++` (C++20) on the path: an error says so when it is missing.
    pub fn new() -> Result<Emulated> {
        if !gxx_available() {
            return Err(error(
                "the emulated device compiles the generated CUDA C++ as host C++ with g++ (C++20), \
                 and no `g++` was found on the PATH: install it (Debian: apt install g++)",
            ));
        }
        // One folder per device: another device's drop removes its own.
        static DEVICES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = DEVICES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("cellc-emulated-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| error(format!("{}: {e}", dir.display())))?;
        Ok(Emulated {
            dir,
            pool: Arc::default(),
            graphs: Mutex::new(GraphCache::new(GRAPHS_KEPT)),
            uploaded: Default::default(),
            recorder: None,
        })
    }

    /// This device writing a replayable image of each step-loop launch, and
    /// each module's source, into `dir` ([`super::recorder`]).
    pub fn recording(mut self, dir: &Path) -> Result<Emulated> {
        self.recorder = Some(Recorder::new(dir)?);
        Ok(self)
    }

    /// Host memory for `bytes` (8-byte aligned), from the pool if it can.
    /// `addresses`: the block holds addresses (a recorder relocates them).
    fn block(&self, bytes: usize, len: usize, addresses: bool, fill: impl FnOnce(&mut [u8])) -> Buf {
        let mut block = self
            .pool
            .take(bytes)
            .map(|(_, b)| b)
            .unwrap_or_else(|| vec![0u64; bytes.div_ceil(8)].into_boxed_slice());
        // SAFETY: the block holds at least `bytes` bytes.
        fill(unsafe { std::slice::from_raw_parts_mut(block.as_mut_ptr().cast::<u8>(), bytes) });
        let addr = block.as_ptr() as u64;
        if let Some(r) = &self.recorder {
            r.handed_out(addr, bytes, addresses);
        }
        self.pool.buf(addr, len, bytes, block)
    }

    fn upload_bytes<T: Copy>(&self, data: &[T], addresses: bool) -> Buf {
        let bytes = std::mem::size_of_val(data);
        self.block(bytes, data.len(), addresses, |dst| {
            // SAFETY: `data` is `bytes` bytes of plain values.
            let src = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), bytes) };
            dst.copy_from_slice(src);
        })
    }
}

impl Primitives for Emulated {
    fn launch(&self, module: &Module, kernel: &str, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        let m =
            module.inner.downcast_ref::<EmulatedModule>().ok_or_else(|| error("not an emulated module"))?;
        // SAFETY: CELLC_EMU_EXPORT defines this symbol with this signature.
        let mode = if m.serial.contains(kernel) { "serial_" } else { "" };
        let f: libloading::Symbol<Launch> =
            unsafe { m.lib.get(format!("cellc_launch_{mode}{kernel}").as_bytes()) }
                .map_err(|_| error(format!("no kernel `{kernel}` in the module")))?;
        let mut values = argument_slots(args);
        let mut ptrs: Vec<*mut c_void> = values.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        // SAFETY: the arguments match the kernel's parameters (pointers are 8 bytes, an i32
        // is read from the low 4 bytes of its little-endian slot); every address is memory
        // this device handed out.
        unsafe { f(grid, block, ptrs.as_mut_ptr()) };
        Ok(())
    }

    fn launch_cooperative(
        &self,
        module: &Module,
        kernel: &str,
        (grid, block, shared): (u32, u32, u32),
        args: &[Arg],
    ) -> Result<()> {
        let m =
            module.inner.downcast_ref::<EmulatedModule>().ok_or_else(|| error("not an emulated module"))?;
        // SAFETY: CELLC_EMU_EXPORT_GRID defines this symbol with this signature.
        let f: libloading::Symbol<LaunchGrid> =
            unsafe { m.lib.get(format!("cellc_launch_grid_{kernel}").as_bytes()) }
                .map_err(|_| error(format!("no cooperative kernel `{kernel}` in the module")))?;
        let slots = argument_slots(args);
        let mut values = slots.clone();
        let mut ptrs: Vec<*mut c_void> = values.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        let mut launch = move || {
            // SAFETY: as for `launch`; every block of the grid runs at once on its own threads.
            unsafe { f(grid, block, shared, ptrs.as_mut_ptr()) };
            Ok(())
        };
        match &self.recorder {
            Some(r) => r.record((&m.source_file, kernel), (grid, block, shared), &slots, launch),
            None => launch(),
        }
    }

    fn gemm(&self, p: &Gemm) -> Result<()> {
        let Gemm { m, n, k, a, lda, trans_a, b, ldb, trans_b, c, ldc, accumulate, operands, batch } = *p;
        if batch.count != 1 {
            // Each head on its own, as cuBLAS's strided batched GEMM does.
            for i in 0..batch.count as u64 {
                let at = |addr: u64, stride: usize| addr + 4 * i * stride as u64;
                let (a, b, c) = (at(a, batch.a), at(b, batch.b), at(c, batch.c));
                self.gemm(&Gemm { a, b, c, batch: Batch::ONE, ..*p })?;
            }
            return Ok(());
        }
        let a = if trans_a {
            View::rows(a as *const f32, k, m, lda).t()
        } else {
            View::rows(a as *const f32, m, k, lda)
        };
        let b = if trans_b {
            View::rows(b as *const f32, n, k, ldb).t()
        } else {
            View::rows(b as *const f32, k, n, ldb)
        };
        let c = View::rows(c as *const f32, m, n, ldc);
        if operands == cellc::precision::Precision::F32 {
            // SAFETY: the caller passes addresses of this device's buffers with these shapes.
            unsafe { matmul(c, a, b, accumulate) };
            return Ok(());
        }
        // bf16 or fp16 operands: rounded copies, row-major, then the same product.
        // SAFETY: as above; the copies are the operands' shapes.
        let (a, b) = unsafe { (rounded(a, operands), rounded(b, operands)) };
        unsafe { matmul(c, View::rows(a.as_ptr(), m, k, k), View::rows(b.as_ptr(), k, n, n), accumulate) };
        Ok(())
    }

    fn zero(&self, addr: u64, floats: usize) -> Result<()> {
        // SAFETY: the caller passes a range of memory this device handed out (or the caller's own).
        unsafe { std::ptr::write_bytes(addr as *mut f32, 0, floats) };
        Ok(())
    }
}

/// A row-major copy of `v`, each element rounded to `precision`.
///
/// # Safety
/// `v` describes valid memory.
unsafe fn rounded(v: View, precision: cellc::precision::Precision) -> Vec<f32> {
    (0..v.rows * v.cols)
        .map(|e| {
            let (i, j) = ((e / v.cols) as isize, (e % v.cols) as isize);
            // SAFETY: inside the view, per the contract.
            precision.round(unsafe { *v.ptr.offset(i * v.rs + j * v.cs) })
        })
        .collect()
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
        Ok(self.block(4 * len, len, false, |b| b.fill(0)))
    }

    fn upload(&self, data: &[f32]) -> Result<Buf> {
        self.uploaded.fetch_add(data.len(), std::sync::atomic::Ordering::Relaxed);
        Ok(self.upload_bytes(data, false))
    }

    fn floats_uploaded(&self) -> usize {
        self.uploaded.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn upload_addresses(&self, addresses: &[u64]) -> Result<Buf> {
        Ok(self.upload_bytes(addresses, true))
    }

    fn upload_i32(&self, data: &[i32]) -> Result<Buf> {
        Ok(self.upload_bytes(data, false))
    }

    fn download(&self, buf: &Buf, from: usize, len: usize) -> Result<Vec<f32>> {
        check_range(buf, from, len)?;
        // SAFETY: emulated buffers are host memory of `buf.len` floats, owned by `buf`.
        Ok(unsafe { std::slice::from_raw_parts((buf.addr as *const f32).add(from), len) }.to_vec())
    }

    fn load(&self, kernels: &[Kernel]) -> Result<Module> {
        let src = emulation_source(kernels);
        let hash = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            src.hash(&mut h);
            h.finish()
        };
        let source_file = format!("k{hash:016x}.cu");
        if let Some(r) = &self.recorder {
            r.module_source(&source_file, &src)?;
        }
        let cu = self.dir.join(&source_file);
        let so = self.dir.join(format!("libk{hash:016x}.so"));
        std::fs::write(&cu, &src).map_err(|e| error(e.to_string()))?;
        gxx(&[cu], &["-shared"], &so)?;
        // SAFETY: a library just built from the generated kernels; loading runs no constructors of ours.
        let lib = unsafe { libloading::Library::new(&so) }.map_err(|e| error(e.to_string()))?;
        let serial = kernels
            .iter()
            .filter(|k| k.units > 0 && !k.cooperative)
            .map(|k| k.name.clone())
            .chain(ROW_KERNELS.map(String::from))
            .collect();
        Ok(Module { inner: Box::new(EmulatedModule { lib, serial, source_file }) })
    }

    fn run(&self, module: &Module, calls: &[Call], graph: bool) -> Result<()> {
        if graph {
            let mut graphs = self.graphs.lock().map_err(|_| error("graph cache poisoned"))?;
            if graphs.step(calls) == GraphStep::Capture {
                graphs.insert(calls.to_vec(), ());
            }
        }
        self.issue(module, calls)
    }

    fn graph_stats(&self) -> GraphStats {
        self.graphs.lock().map(|g| g.stats).unwrap_or_default()
    }

    /// Three blocks (an OS thread per CUDA thread of all of them), shared
    /// memory as a GPU's multiprocessor has.
    fn cooperative_limits(&self) -> Option<CooperativeLimits> {
        Some(CooperativeLimits { blocks: 3, shared_bytes: 227 * 1024 })
    }
}

impl Drop for Emulated {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Captured graphs kept per device: a model's layers and directions, forward
/// and backward, at a few batch shapes.
pub(crate) const GRAPHS_KEPT: usize = 64;

/// Instantiated graphs by the exact calls they captured, the oldest
/// dropped past a bound. A graph replays its captured arguments, so it is
/// reused only for identical calls (the same kernels, grids, pointer
/// tables' addresses and GEMM operands); the tables' contents are read
/// when it runs.
///
/// Calls are run once without a graph before they are captured (a
/// warm-up, as PyTorch's own graph capture asks for): a module's kernels
/// are loaded lazily at their first launch, and cuBLAS's first call in a
/// process sets itself up, neither of which may happen inside a capture.
#[derive(Debug)]
pub(crate) struct GraphCache<G> {
    entries: Vec<(u64, Vec<Call>, G)>,
    /// The calls run once already, by their hash, the oldest dropped past the bound.
    warmed: Vec<u64>,
    bound: usize,
    pub stats: GraphStats,
}

/// What a run with graphs does with its calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GraphStep<G> {
    /// First seen: run them as they are.
    WarmUp,
    /// Seen once before: capture them, keep the graph ([`GraphCache::insert`]), launch it.
    Capture,
    /// Captured before: launch that graph.
    Replay(G),
}

impl<G: Copy> GraphCache<G> {
    pub fn new(bound: usize) -> Self {
        GraphCache { entries: Vec::new(), warmed: Vec::new(), bound, stats: GraphStats::default() }
    }

    fn key(calls: &[Call]) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        calls.hash(&mut h);
        h.finish()
    }

    /// What to do with `calls` (counted as warmed up or replayed; a capture
    /// is counted when it is kept).
    pub fn step(&mut self, calls: &[Call]) -> GraphStep<G> {
        let key = Self::key(calls);
        if let Some((_, _, graph)) = self.entries.iter().find(|(k, c, _)| *k == key && c.as_slice() == calls)
        {
            self.stats.replayed += 1;
            return GraphStep::Replay(*graph);
        }
        if self.warmed.contains(&key) {
            return GraphStep::Capture;
        }
        if self.warmed.len() >= self.bound.max(1) {
            self.warmed.remove(0);
        }
        self.warmed.push(key);
        self.stats.warmed_up += 1;
        GraphStep::WarmUp
    }

    /// Keeps `graph` for `calls` (counted as captured); returns the one dropped to make room.
    pub fn insert(&mut self, calls: Vec<Call>, graph: G) -> Option<G> {
        self.stats.captured += 1;
        let evicted = (self.entries.len() >= self.bound.max(1)).then(|| self.entries.remove(0).2);
        self.entries.push((Self::key(&calls), calls, graph));
        evicted
    }

    /// Every graph kept, for the device to destroy.
    pub fn drain(&mut self) -> Vec<G> {
        self.entries.drain(..).map(|(_, _, g)| g).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(kernel: &str, table: u64) -> Call {
        Call::Launch { kernel: kernel.into(), grid: 1, block: 32, args: vec![Arg::Ptr(table), Arg::I32(3)] }
    }

    #[test]
    fn graphs_are_captured_after_a_warm_up_and_reused_only_for_identical_calls() {
        let mut cache = GraphCache::new(2);
        assert_eq!(cache.step(&[launch("a", 16)]), GraphStep::WarmUp, "first seen: run as it is");
        assert_eq!(cache.step(&[launch("a", 16)]), GraphStep::Capture, "seen before: captured");
        assert_eq!(cache.insert(vec![launch("a", 16)], 1), None);
        assert_eq!(cache.step(&[launch("a", 16)]), GraphStep::Replay(1));
        assert_eq!(cache.step(&[launch("a", 32)]), GraphStep::WarmUp, "another table address");
        assert_eq!(cache.step(&[launch("b", 16)]), GraphStep::WarmUp, "another kernel");
        assert_eq!(cache.step(&[launch("a", 16), launch("a", 16)]), GraphStep::WarmUp, "more calls");
        assert_eq!(cache.step(&[launch("b", 16)]), GraphStep::Capture);
        assert_eq!(cache.insert(vec![launch("b", 16)], 2), None);
        assert_eq!(cache.insert(vec![launch("c", 16)], 3), Some(1), "the oldest goes");
        assert_eq!(cache.step(&[launch("a", 32)]), GraphStep::WarmUp, "warm-ups are bounded too");
        assert_eq!(cache.stats, GraphStats { warmed_up: 5, replayed: 1, captured: 3 });
        assert_eq!(cache.drain(), vec![2, 3]);
    }

    #[test]
    fn freed_memory_comes_back_lowest_address_first() {
        let device = Emulated::new().expect("emulated device");
        let (a, b) = (device.zeros(10).expect("a"), device.zeros(10).expect("b"));
        let (low, high) = (a.addr.min(b.addr), a.addr.max(b.addr));
        // Whatever the order they are freed in, they are handed out by address.
        drop(b);
        drop(a);
        let again = [device.upload(&[1.0; 10]).expect("a"), device.zeros(10).expect("b")];
        assert_eq!([again[0].addr, again[1].addr], [low, high]);
        assert_eq!(device.download(&again[1], 0, 10).expect("download"), vec![0.0; 10], "zeroed again");
        assert_eq!(device.download(&again[0], 4, 6).expect("download"), vec![1.0; 6]);
        assert!(device.download(&again[0], 5, 6).is_err(), "past the end");
        let other_size = device.zeros(11).expect("c");
        assert!(other_size.addr != low && other_size.addr != high, "blocks are reused only at their size");
    }
}
