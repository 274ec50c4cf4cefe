//! The real device: CUDA's driver API and cuBLAS through cudarc (loaded at
//! run time), kernels compiled by NVRTC to SASS for the device's own
//! architecture.
//!
//! No machine the project is developed on has a GPU: this file is compiled
//! and its gating exercised (no driver: a typed error), but it runs for the
//! first time on a user's GPU. It therefore stays close to the driver API:
//! synchronous copies, one stream of the device's own (created blocking, so
//! it is ordered with those copies) for kernels and cuBLAS alike, and every
//! call's error turned into a typed error naming the call. Memory comes
//! from a caching pool ([`Pool`]); a run asked to use a graph is captured
//! from that stream into a CUDA graph, kept by its exact calls
//! ([`GraphCache`]) and relaunched when the same calls come again.

use super::device::{
    check_range, Arg, Buf, Call, Device, Gemm, GraphCache, GraphStats, Module, Pool, Primitives, GRAPHS_KEPT,
};
use super::nvrtc;
use crate::error::{Result, RuntimeError};
use cellc::cuda::Kernel;
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

fn error(message: impl Into<String>) -> RuntimeError {
    RuntimeError::Backend { backend: "cuda".into(), message: message.into() }
}

/// cuBLAS's workspace, set once so that no GEMM allocates while a graph is
/// being captured (32 MiB covers what cuBLAS asks for on Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

/// A GPU with its stream, cuBLAS handle, memory pool and graphs.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Handle<drv_sys::CUstream>,
    blas: Handle<blas_sys::cublasHandle_t>,
    /// `sm_XY` of the device, for NVRTC.
    arch: String,
    pool: Arc<Pool<DevMem>>,
    _workspace: Buf,
    graphs: Mutex<GraphCache<Handle<drv_sys::CUgraphExec>>>,
    /// One operation at a time: a capture must not take in another
    /// thread's launches, and the synchronous copies (on the legacy stream,
    /// which waits for ours) must not meet a stream that is capturing.
    serial: Mutex<()>,
}

/// A raw driver or cuBLAS handle.
#[derive(Clone, Copy)]
struct Handle<T>(T);
// SAFETY: handles are plain driver objects, used with the context bound;
// calls through them are serialised by the driver API's own rules.
unsafe impl<T> Send for Handle<T> {}
unsafe impl<T> Sync for Handle<T> {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("arch", &self.arch).finish()
    }
}

/// Device memory, freed on drop (blocks live in the [`Pool`] in between).
struct DevMem {
    ptr: drv_sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl Drop for DevMem {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync in this context and freed once.
            let _ = unsafe { drv::free_sync(self.ptr) };
        }
    }
}

struct GpuModule {
    module: drv_sys::CUmodule,
    functions: Mutex<HashMap<String, usize>>,
    ctx: Arc<CudaContext>,
}

// SAFETY: module and function handles are plain driver handles, used with the context bound.
unsafe impl Send for GpuModule {}
unsafe impl Sync for GpuModule {}

impl Drop for GpuModule {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: loaded once by load_data, unloaded once.
            let _ = unsafe { drv::module::unload(self.module) };
        }
    }
}

impl Gpu {
    /// A device context on `ctx` (see [`super::open_device`]), with cuBLAS.
    pub fn new(ctx: Arc<CudaContext>) -> Result<Gpu> {
        // SAFETY: only tries to dlopen the library (cudarc panics on a call without it).
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(error("cuBLAS not found (libcublas.so cannot be loaded)"));
        }
        if !nvrtc::available() {
            return Err(error(nvrtc::NvrtcError::NotFound.to_string()));
        }
        ctx.bind_to_thread().map_err(|e| error(format!("binding the context: {e:?}")))?;
        let (major, minor) =
            ctx.compute_capability().map_err(|e| error(format!("compute capability: {e:?}")))?;
        let stream = drv::stream::create(drv::stream::StreamKind::Default)
            .map_err(|e| error(format!("cuStreamCreate: {e:?}")))?;
        let handle = blas::create_handle().map_err(|e| error(format!("cublasCreate: {e:?}")))?;
        let pool: Arc<Pool<DevMem>> = Arc::default();
        let workspace = alloc_pooled(&ctx, &pool, BLAS_WORKSPACE, 0)?;
        // SAFETY: a live handle, stream and workspace of this context.
        unsafe {
            blas::set_stream(handle, stream as _).map_err(|e| error(format!("cublasSetStream: {e:?}")))?;
            blas_sys::cublasSetWorkspace_v2(handle, workspace.addr as *mut c_void, BLAS_WORKSPACE)
                .result()
                .map_err(|e| error(format!("cublasSetWorkspace: {e:?}")))?;
        }
        Ok(Gpu {
            ctx,
            stream: Handle(stream),
            blas: Handle(handle),
            arch: format!("sm_{major}{minor}"),
            pool,
            _workspace: workspace,
            graphs: Mutex::new(GraphCache::new(GRAPHS_KEPT)),
            serial: Mutex::new(()),
        })
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| error(format!("binding the context: {e:?}")))
    }

    /// The device to this thread alone, its context bound.
    fn exclusive(&self) -> Result<std::sync::MutexGuard<'_, ()>> {
        let guard = self.serial.lock().map_err(|_| error("the device lock is poisoned"))?;
        self.bind()?;
        Ok(guard)
    }

    fn upload_slice<T: Copy + Send + Sync + 'static>(&self, data: &[T]) -> Result<Buf> {
        let _one = self.exclusive()?;
        let buf = alloc_pooled(&self.ctx, &self.pool, std::mem::size_of_val(data), data.len())?;
        if !data.is_empty() {
            // SAFETY: `buf` holds size_of_val(data) bytes; the copy is ordered after earlier work.
            unsafe { drv::memcpy_htod_sync(buf.addr, data) }
                .map_err(|e| error(format!("cuMemcpyHtoD: {e:?}")))?;
        }
        Ok(buf)
    }

    /// Captures `calls` from the stream into an instantiated graph.
    fn capture(&self, module: &Module, calls: &[Call]) -> Result<Handle<drv_sys::CUgraphExec>> {
        let mode = drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: the device's own stream, not capturing yet.
        unsafe { drv::stream::begin_capture(self.stream.0, mode) }
            .map_err(|e| error(format!("cuStreamBeginCapture: {e:?}")))?;
        let issued = self.issue(module, calls);
        // SAFETY: ends the capture begun above, whatever happened in between.
        let graph = unsafe { drv::stream::end_capture(self.stream.0) };
        if let (Err(e), Ok(g)) = (&issued, &graph) {
            // SAFETY: the partial graph of a failed capture, destroyed once.
            let _ = unsafe { drv::graph::destroy(*g) };
            return Err(e.clone());
        }
        issued?;
        let graph = graph.map_err(|e| error(format!("cuStreamEndCapture: {e:?}")))?;
        // SAFETY: a graph just captured; destroyed once instantiated.
        let exec = unsafe { drv::graph::instantiate(graph, drv_sys::CUgraphInstantiate_flags(0)) };
        // SAFETY: the graph is no longer needed once instantiated (or if that failed).
        let _ = unsafe { drv::graph::destroy(graph) };
        exec.map(Handle).map_err(|e| error(format!("cuGraphInstantiate: {e:?}")))
    }
}

impl Primitives for Gpu {
    fn launch(&self, module: &Module, kernel: &str, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        let m = module.get::<GpuModule>().ok_or_else(|| error("not a GPU module"))?;
        let f = {
            let mut functions = m.functions.lock().map_err(|_| error("function cache poisoned"))?;
            match functions.get(kernel) {
                Some(&f) => f as drv_sys::CUfunction,
                None => {
                    let name = CString::new(kernel).map_err(|_| error("kernel name with a NUL byte"))?;
                    // SAFETY: the module is loaded.
                    let f = unsafe { drv::module::get_function(m.module, name) }
                        .map_err(|e| error(format!("no kernel `{kernel}`: {e:?}")))?;
                    functions.insert(kernel.to_string(), f as usize);
                    f
                }
            }
        };
        // One slot per argument, holding its value; the driver reads each through its pointer.
        let mut ptr_values: Vec<u64> = Vec::with_capacity(args.len());
        let mut int_values: Vec<i32> = Vec::with_capacity(args.len());
        for a in args {
            match *a {
                Arg::Ptr(p) => ptr_values.push(p),
                Arg::I32(i) => int_values.push(i),
            }
        }
        let (mut pi, mut ii) = (0, 0);
        let mut params: Vec<*mut c_void> = Vec::with_capacity(args.len());
        for a in args {
            match a {
                Arg::Ptr(_) => {
                    params.push((&mut ptr_values[pi] as *mut u64).cast());
                    pi += 1;
                }
                Arg::I32(_) => {
                    params.push((&mut int_values[ii] as *mut i32).cast());
                    ii += 1;
                }
            }
        }
        // SAFETY: the parameters match the generated kernel's signature; every address is
        // device memory of this context, alive until the run's results are downloaded.
        unsafe { drv::launch_kernel(f, (grid.max(1), 1, 1), (block, 1, 1), 0, self.stream.0, &mut params) }
            .map_err(|e| error(format!("launching `{kernel}`: {e:?}")))
    }

    fn gemm(&self, p: &Gemm) -> Result<()> {
        let Gemm { m, n, k, a, lda, trans_a, b, ldb, trans_b, c, ldc, accumulate } = *p;
        if m == 0 || n == 0 {
            return Ok(());
        }
        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ. A
        // row-major matrix is its column-major transpose, so an operand not
        // transposed is passed as is (N) and a transposed one as T.
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let int = |x: usize| {
            i32::try_from(x).map_err(|_| error(format!("GEMM dimension {x} too large for cuBLAS")))
        };
        // SAFETY: device pointers of this context with the described shapes; alpha and beta on the host.
        unsafe {
            blas::sgemm(
                self.blas.0,
                op(trans_b),
                op(trans_a),
                int(n)?,
                int(m)?,
                int(k)?,
                &alpha,
                b as *const f32,
                int(ldb)?,
                a as *const f32,
                int(lda)?,
                &beta,
                c as *mut f32,
                int(ldc)?,
            )
        }
        .map_err(|e| error(format!("cublasSgemm: {e:?}")))
    }
}

/// `bytes` of device memory (at least 4) from the pool, or newly
/// allocated; when the device is out of memory the pool's blocks are freed
/// and the allocation tried once more.
fn alloc_pooled(ctx: &Arc<CudaContext>, pool: &Arc<Pool<DevMem>>, bytes: usize, len: usize) -> Result<Buf> {
    let bytes = bytes.max(4);
    if let Some((addr, mem)) = pool.take(bytes) {
        return Ok(pool.buf(addr, len, bytes, mem));
    }
    // SAFETY: a fresh allocation of `bytes` bytes, in the bound context.
    let ptr = match unsafe { drv::malloc_sync(bytes) } {
        Ok(p) => p,
        Err(_) => {
            pool.clear();
            // SAFETY: as above.
            unsafe { drv::malloc_sync(bytes) }
                .map_err(|e| error(format!("cuMemAlloc of {bytes} bytes: {e:?}")))?
        }
    };
    Ok(pool.buf(ptr, len, bytes, DevMem { ptr, ctx: ctx.clone() }))
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            if let Ok(mut graphs) = self.graphs.lock() {
                for exec in graphs.drain() {
                    // SAFETY: instantiated once by capture() and destroyed once.
                    let _ = unsafe { drv::graph::exec_destroy(exec.0) };
                }
            }
            // SAFETY: created once in new(); nothing uses them after the device.
            unsafe {
                let _ = blas::destroy_handle(self.blas.0);
                let _ = drv::stream::synchronize(self.stream.0);
                let _ = drv::stream::destroy(self.stream.0);
            }
        }
    }
}

impl Device for Gpu {
    fn name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "CUDA device".into());
        format!("{name} ({})", self.arch)
    }

    fn zeros(&self, len: usize) -> Result<Buf> {
        let _one = self.exclusive()?;
        let buf = alloc_pooled(&self.ctx, &self.pool, len * 4, len)?;
        // SAFETY: `buf` holds len * 4 bytes; a synchronous memset is ordered after earlier work.
        unsafe { drv::memset_d8_sync(buf.addr, 0, len * 4) }
            .map_err(|e| error(format!("cuMemsetD8: {e:?}")))?;
        Ok(buf)
    }

    fn upload(&self, data: &[f32]) -> Result<Buf> {
        self.upload_slice(data)
    }

    fn upload_addresses(&self, addresses: &[u64]) -> Result<Buf> {
        self.upload_slice(addresses)
    }

    fn upload_i32(&self, data: &[i32]) -> Result<Buf> {
        self.upload_slice(data)
    }

    fn download(&self, buf: &Buf, from: usize, len: usize) -> Result<Vec<f32>> {
        check_range(buf, from, len)?;
        let _one = self.exclusive()?;
        let mut out = vec![0.0f32; len];
        if len > 0 {
            // SAFETY: floats [from, from + len) of a device buffer; the copy waits for prior work.
            unsafe { drv::memcpy_dtoh_sync(&mut out, buf.at(from)) }
                .map_err(|e| error(format!("cuMemcpyDtoH (a kernel before it may have failed): {e:?}")))?;
        }
        Ok(out)
    }

    fn load(&self, kernels: &[Kernel]) -> Result<Module> {
        let source = cellc::cuda::translation_unit(kernels);
        let mut options: Vec<String> = cellc::cuda::NVRTC_OPTIONS.iter().map(|o| o.to_string()).collect();
        options.push(format!("--gpu-architecture={}", self.arch));
        let compiled =
            nvrtc::compile_cached(&source, "cellc_kernels.cu", &options).map_err(|e| error(e.to_string()))?;
        if compiled.cubin.is_empty() {
            return Err(error(format!("NVRTC produced no SASS for {}", self.arch)));
        }
        let _one = self.exclusive()?;
        // SAFETY: a complete CUBIN image from NVRTC for this device's architecture.
        let module = unsafe { drv::module::load_data(compiled.cubin.as_ptr().cast()) }
            .map_err(|e| error(format!("cuModuleLoadData: {e:?}")))?;
        Ok(Module::new(Box::new(GpuModule {
            module,
            functions: Mutex::new(HashMap::new()),
            ctx: self.ctx.clone(),
        })))
    }

    fn run(&self, module: &Module, calls: &[Call], graph: bool) -> Result<()> {
        let _one = self.exclusive()?;
        if !graph {
            return self.issue(module, calls);
        }
        let mut graphs = self.graphs.lock().map_err(|_| error("graph cache poisoned"))?;
        let exec = match graphs.get(calls) {
            Some(exec) => *exec,
            None => {
                let exec = self.capture(module, calls)?;
                if let Some(old) = graphs.insert(calls.to_vec(), exec) {
                    // SAFETY: instantiated by capture(), no longer referenced; launches
                    // of it are ordered before later work on the stream.
                    let _ = unsafe { drv::graph::exec_destroy(old.0) };
                }
                exec
            }
        };
        // SAFETY: an instantiated graph of this context, on the device's stream.
        unsafe { drv::graph::launch(exec.0, self.stream.0) }
            .map_err(|e| error(format!("cuGraphLaunch: {e:?}")))
    }

    fn graph_stats(&self) -> GraphStats {
        self.graphs.lock().map(|g| g.stats).unwrap_or_default()
    }
}
