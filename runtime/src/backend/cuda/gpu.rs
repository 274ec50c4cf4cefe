//! The real device: CUDA's driver API and cuBLAS through cudarc (loaded at
//! run time), kernels compiled by NVRTC to SASS for the device's own
//! architecture.
//!
//! No machine the project is developed on has a GPU: this file is compiled
//! and its gating exercised (no driver: a typed error), but it runs for the
//! first time on a user's GPU. It therefore stays close to the driver API,
//! every call's error turned into a typed error naming the call.
//!
//! Two ways to work:
//! - **the device's own stream** (the runtime's host-memory passes): one
//!   stream of its own, non-blocking, for copies, fills, kernels and cuBLAS
//!   alike, and nothing on CUDA's legacy default stream (whose implicit
//!   synchronisation with other streams is forbidden while any of them is
//!   being captured into a graph, from any thread); memory from a caching
//!   pool ([`Pool`]); a run asked to use a graph runs once as it is, is
//!   captured from that stream into a CUDA graph the next time, kept by its
//!   exact calls ([`GraphCache`]) and relaunched when the same calls come
//!   again;
//! - **a caller's stream** ([`Device::on_stream`], for passes over a
//!   framework's device memory): nothing waits on the host. Scratch memory
//!   comes from a stream-ordered memory pool of cellc's own
//!   (`cuMemAllocFromPoolAsync`, freed with `cuMemFreeAsync` on the same
//!   stream after the pass's work, cached by the driver: the pool never
//!   returns memory to the system while the process runs); pointer tables
//!   are staged in pinned host memory and copied asynchronously, a staging
//!   block reused once an event recorded after its copies has completed;
//!   graphs are captured from the device's own stream and launched on the
//!   caller's (which may be CUDA's legacy stream, never captured itself).
//!
//! Runs on different streams share cuBLAS's workspace: every run records
//! an event on its stream when its work is queued, and a run on another
//! stream than the last one first makes its stream wait for that event (no
//! host wait; neither happens on a stream being captured).

use super::device::{
    check_range, Arg, Buf, Call, CooperativeLimits, Device, Gemm, GraphCache, GraphStats, GraphStep, Module,
    Pool, Primitives, GRAPHS_KEPT,
};
use super::libraries::{self, Library};
use super::nvrtc;
use crate::error::cuda_error as error;
use crate::error::Result;
use cellc::cuda::Kernel;
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

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
    workspace: Buf,
    graphs: Mutex<GraphCache<Handle<drv_sys::CUgraphExec>>>,
    /// One operation at a time (a capture must not take in another
    /// thread's launches), holding what the last run left.
    serial: Mutex<LastRun>,
    /// Recorded at the end of each run, on its stream, and waited for by a run on another.
    handoff: Handle<drv_sys::CUevent>,
    /// Scratch memory of passes on callers' streams (made on first use).
    stream_pool: std::sync::OnceLock<std::result::Result<Handle<drv_sys::CUmemoryPool>, String>>,
    /// Pinned host blocks in which passes on callers' streams stage their tables.
    pinned: Mutex<Vec<Pinned>>,
    uploaded: std::sync::atomic::AtomicUsize,
    /// One block per multiprocessor and the opt-in shared memory of a
    /// block, where the device launches cooperative kernels.
    cooperative: Option<CooperativeLimits>,
}

/// A pinned host block, and the event after which its last copies are done.
struct Pinned {
    addr: usize,
    bytes: usize,
    copied: Option<Arc<Event>>,
}

/// A driver event, destroyed on drop.
struct Event(Handle<drv_sys::CUevent>);

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created once by cuEventCreate; waited-for work keeps no reference to it.
        let _ = unsafe { drv_sys::cuEventDestroy_v2(self.0 .0) };
    }
}

/// The stream the last run used (cuBLAS points at it) and whether
/// [`Gpu::handoff`] was recorded after its work.
struct LastRun {
    stream: Handle<drv_sys::CUstream>,
    recorded: bool,
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
    /// The dynamic shared memory each step loop was allowed, set before its
    /// first launch (which is never captured: graphs warm up first).
    shared_allowed: Mutex<HashMap<String, u32>>,
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
        // cudarc panics on a call into a library it cannot load: each is found first.
        if let Err(missing) = libraries::load(Library::Cublas) {
            return Err(error(missing.to_string()));
        }
        // SAFETY: only tries to dlopen the library, loaded above.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(error("cuBLAS was loaded but cudarc cannot open it by name"));
        }
        if !nvrtc::available() {
            return Err(error(nvrtc::NvrtcError::NotFound.to_string()));
        }
        ctx.bind_to_thread().map_err(|e| error(format!("binding the context: {e:?}")))?;
        let (major, minor) =
            ctx.compute_capability().map_err(|e| error(format!("compute capability: {e:?}")))?;
        let attribute = |a| ctx.attribute(a).map_err(|e| error(format!("device attribute {a:?}: {e:?}")));
        use drv_sys::CUdevice_attribute as A;
        let cooperative = match attribute(A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)? {
            0 => None,
            _ => Some(CooperativeLimits {
                blocks: attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize,
                shared_bytes: attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0)
                    as usize,
            }),
        };
        let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking)
            .map_err(|e| error(format!("cuStreamCreate: {e:?}")))?;
        let handoff = new_event()?;
        let handle = blas::create_handle().map_err(|e| error(format!("cublasCreate: {e:?}")))?;
        let pool: Arc<Pool<DevMem>> = Arc::default();
        let workspace = alloc_pooled(&ctx, &pool, BLAS_WORKSPACE, 0)?;
        // SAFETY: a live handle, stream and workspace of this context.
        unsafe { point_blas_at(handle, stream, &workspace)? };
        Ok(Gpu {
            ctx,
            stream: Handle(stream),
            blas: Handle(handle),
            arch: format!("sm_{major}{minor}"),
            pool,
            workspace,
            graphs: Mutex::new(GraphCache::new(GRAPHS_KEPT)),
            serial: Mutex::new(LastRun { stream: Handle(stream), recorded: false }),
            handoff: Handle(handoff),
            stream_pool: std::sync::OnceLock::new(),
            pinned: Mutex::new(Vec::new()),
            uploaded: Default::default(),
            cooperative,
        })
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| error(format!("binding the context: {e:?}")))
    }

    /// The device to this thread alone, its context bound.
    fn exclusive(&self) -> Result<std::sync::MutexGuard<'_, LastRun>> {
        let guard = self.serial.lock().map_err(|_| error("the device lock is poisoned"))?;
        self.bind()?;
        Ok(guard)
    }

    /// Starts a run on `stream`: after the last run's work if that was on
    /// another stream (they share cuBLAS's workspace), with cuBLAS pointed
    /// at `stream`. Only a wait is queued here: the last run recorded its
    /// event when it ended ([`Gpu::end_run`]), while its stream was alive.
    fn begin_run(&self, last: &mut LastRun, stream: drv_sys::CUstream) -> Result<()> {
        if last.stream.0 == stream {
            return Ok(());
        }
        if last.recorded && !capturing(stream)? {
            // SAFETY: a live event and a stream of this context; the wait is queued, not waited for.
            unsafe { drv_sys::cuStreamWaitEvent(stream, self.handoff.0, 0) }
                .result()
                .map_err(|e| error(format!("cuStreamWaitEvent: {e:?}")))?;
        }
        // SAFETY: a live handle, a stream of this context and the device's workspace.
        unsafe { point_blas_at(self.blas.0, stream, &self.workspace)? };
        *last = LastRun { stream: Handle(stream), recorded: false };
        Ok(())
    }

    /// Ends a run on `stream`: records the hand-off event after its work
    /// (not on a stream being captured, where a record would join the capture).
    fn end_run(&self, last: &mut LastRun, stream: drv_sys::CUstream) -> Result<()> {
        last.recorded = !capturing(stream)?;
        if last.recorded {
            // SAFETY: a live event and a live stream of this context.
            unsafe { drv_sys::cuEventRecord(self.handoff.0, stream) }
                .result()
                .map_err(|e| error(format!("cuEventRecord: {e:?}")))?;
        }
        Ok(())
    }

    /// `calls` issued on `stream` as one run ([`Gpu::begin_run`], [`Gpu::end_run`]).
    fn run_on(&self, stream: drv_sys::CUstream, issue: impl FnOnce() -> Result<()>) -> Result<()> {
        let mut last = self.exclusive()?;
        self.begin_run(&mut last, stream)?;
        let issued = issue();
        self.end_run(&mut last, stream)?;
        issued
    }

    /// The stream-ordered pool of passes on callers' streams: made once,
    /// on this device, keeping what it has allocated (release threshold:
    /// everything).
    fn stream_pool(&self) -> Result<drv_sys::CUmemoryPool> {
        let made = self.stream_pool.get_or_init(|| {
            self.bind().map_err(|e| e.to_string())?;
            // SAFETY: a zeroed property block is valid (every field's zero is a defined value).
            let mut props: drv_sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
            props.allocType = drv_sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            props.location = drv_sys::CUmemLocation {
                type_: drv_sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.ctx.ordinal() as i32,
            };
            let mut pool = std::ptr::null_mut();
            let mut keep_all = u64::MAX;
            // SAFETY: valid properties; the attribute takes a u64.
            unsafe {
                drv_sys::cuMemPoolCreate(&mut pool, &props).result().map_err(|e| {
                    format!("cuMemPoolCreate (stream-ordered memory needs CUDA 11.2 or newer): {e:?}")
                })?;
                drv_sys::cuMemPoolSetAttribute(
                    pool,
                    drv_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut keep_all as *mut u64).cast(),
                )
                .result()
                .map_err(|e| format!("cuMemPoolSetAttribute: {e:?}"))?;
            }
            Ok(Handle(pool))
        });
        made.as_ref().map(|h| h.0).map_err(|e| error(e.clone()))
    }

    fn upload_slice<T: Copy + Send + Sync + 'static>(&self, data: &[T]) -> Result<Buf> {
        let _one = self.exclusive()?;
        let bytes = std::mem::size_of_val(data);
        let buf = alloc_pooled(&self.ctx, &self.pool, bytes, data.len())?;
        if bytes > 0 {
            // SAFETY: `buf` holds `bytes` bytes; queued on the device's stream after earlier
            // work. From pageable memory the call returns once `data` has been staged, so
            // `data` may be dropped as soon as it returns.
            unsafe { drv_sys::cuMemcpyHtoDAsync_v2(buf.addr, data.as_ptr().cast(), bytes, self.stream.0) }
                .result()
                .map_err(|e| error(format!("cuMemcpyHtoDAsync: {e:?}")))?;
        }
        Ok(buf)
    }

    /// `calls` as one graph launched on `stream` (inside a run on it): run
    /// as they are the first time they are seen, captured the second,
    /// the graph relaunched after that ([`GraphCache`]).
    fn run_as_graph(&self, module: &Module, calls: &[Call], stream: drv_sys::CUstream) -> Result<()> {
        let mut graphs = self.graphs.lock().map_err(|_| error("graph cache poisoned"))?;
        let exec = match graphs.step(calls) {
            GraphStep::WarmUp => return On { gpu: self, stream }.issue(module, calls),
            GraphStep::Replay(exec) => exec,
            GraphStep::Capture => {
                let exec = self.capture(module, calls, stream)?;
                if let Some(old) = graphs.insert(calls.to_vec(), exec) {
                    // SAFETY: instantiated by capture(), no longer referenced; its last
                    // launch, on whichever stream, is waited for before it is destroyed.
                    unsafe {
                        let _ = drv::stream::synchronize(stream);
                        let _ = drv::stream::synchronize(self.stream.0);
                        let _ = drv::graph::exec_destroy(old.0);
                    }
                }
                exec
            }
        };
        // SAFETY: an instantiated graph of this context, on a stream of it.
        unsafe { drv::graph::launch(exec.0, stream) }.map_err(|e| error(format!("cuGraphLaunch: {e:?}")))
    }

    /// Captures `calls` into an instantiated graph, from the device's own
    /// stream (a caller's may be CUDA's legacy stream, which cannot be
    /// captured); cuBLAS points at that stream meanwhile, then at `stream`
    /// (the run's) again.
    fn capture(
        &self,
        module: &Module,
        calls: &[Call],
        stream: drv_sys::CUstream,
    ) -> Result<Handle<drv_sys::CUgraphExec>> {
        let own = self.stream.0;
        if stream != own {
            // SAFETY: a live handle, the device's own stream and workspace.
            unsafe { point_blas_at(self.blas.0, own, &self.workspace)? };
        }
        let captured = self.capture_from_own_stream(module, calls);
        if stream != own {
            // SAFETY: as above, back to the run's stream.
            unsafe { point_blas_at(self.blas.0, stream, &self.workspace)? };
        }
        captured
    }

    fn capture_from_own_stream(
        &self,
        module: &Module,
        calls: &[Call],
    ) -> Result<Handle<drv_sys::CUgraphExec>> {
        let mode = drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: the device's own stream, not capturing yet.
        unsafe { drv::stream::begin_capture(self.stream.0, mode) }
            .map_err(|e| error(format!("cuStreamBeginCapture: {e:?}")))?;
        let issued = On { gpu: self, stream: self.stream.0 }.issue(module, calls);
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

/// Whether `stream` is being captured into a graph.
fn capturing(stream: drv_sys::CUstream) -> Result<bool> {
    let mut status = drv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream of the bound context; one out-parameter.
    unsafe { drv_sys::cuStreamIsCapturing(stream, &mut status) }
        .result()
        .map_err(|e| error(format!("cuStreamIsCapturing: {e:?}")))?;
    Ok(status != drv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Points cuBLAS at `stream`, then at `workspace` again: `cublasSetStream`
/// resets the workspace to cuBLAS's own pool, which allocates, also inside a capture.
///
/// # Safety
/// A live handle, stream and workspace of the bound context.
unsafe fn point_blas_at(
    handle: blas_sys::cublasHandle_t,
    stream: drv_sys::CUstream,
    workspace: &Buf,
) -> Result<()> {
    // SAFETY: per this function's contract.
    unsafe {
        blas::set_stream(handle, stream as _).map_err(|e| error(format!("cublasSetStream: {e:?}")))?;
        blas_sys::cublasSetWorkspace_v2(handle, workspace.addr as *mut c_void, BLAS_WORKSPACE)
            .result()
            .map_err(|e| error(format!("cublasSetWorkspace: {e:?}")))
    }
}

/// Kernel `kernel` of `module`, looked up once.
fn function(module: &Module, kernel: &str) -> Result<drv_sys::CUfunction> {
    let m = module.get::<GpuModule>().ok_or_else(|| error("not a GPU module"))?;
    let mut functions = m.functions.lock().map_err(|_| error("function cache poisoned"))?;
    if let Some(&f) = functions.get(kernel) {
        return Ok(f as drv_sys::CUfunction);
    }
    let name = CString::new(kernel).map_err(|_| error("kernel name with a NUL byte"))?;
    // SAFETY: the module is loaded.
    let f = unsafe { drv::module::get_function(m.module, name) }
        .map_err(|e| error(format!("no kernel `{kernel}`: {e:?}")))?;
    functions.insert(kernel.to_string(), f as usize);
    Ok(f)
}

/// A launch's argument values, each in a slot of its own type, which the
/// driver reads through one pointer per argument.
struct ArgumentSlots {
    ptrs: Vec<u64>,
    ints: Vec<i32>,
}

impl ArgumentSlots {
    fn of(args: &[Arg]) -> ArgumentSlots {
        let mut slots = ArgumentSlots { ptrs: Vec::new(), ints: Vec::new() };
        for a in args {
            match *a {
                Arg::Ptr(p) => slots.ptrs.push(p),
                Arg::I32(i) => slots.ints.push(i),
            }
        }
        slots
    }

    /// One pointer per argument of `args` (those `of` was given), in order.
    fn pointers(&mut self, args: &[Arg]) -> Vec<*mut c_void> {
        let (mut pi, mut ii) = (0, 0);
        args.iter()
            .map(|a| match a {
                Arg::Ptr(_) => {
                    pi += 1;
                    (&mut self.ptrs[pi - 1] as *mut u64).cast()
                }
                Arg::I32(_) => {
                    ii += 1;
                    (&mut self.ints[ii - 1] as *mut i32).cast()
                }
            })
            .collect()
    }
}

/// The device's primitives issued on one stream.
struct On<'a> {
    gpu: &'a Gpu,
    stream: drv_sys::CUstream,
}

impl Primitives for On<'_> {
    fn launch(&self, module: &Module, kernel: &str, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        let f = function(module, kernel)?;
        let mut values = ArgumentSlots::of(args);
        let mut params = values.pointers(args);
        // SAFETY: the parameters match the generated kernel's signature; every address is
        // device memory of this context, alive until the run's results are downloaded.
        unsafe { drv::launch_kernel(f, (grid.max(1), 1, 1), (block, 1, 1), 0, self.stream, &mut params) }
            .map_err(|e| error(format!("launching `{kernel}`: {e:?}")))
    }

    fn launch_cooperative(
        &self,
        module: &Module,
        kernel: &str,
        (grid, block, shared): (u32, u32, u32),
        args: &[Arg],
    ) -> Result<()> {
        let f = function(module, kernel)?;
        let mut values = ArgumentSlots::of(args);
        let mut params = values.pointers(args);
        let m = module.get::<GpuModule>().ok_or_else(|| error("not a GPU module"))?;
        let mut allowed = m.shared_allowed.lock().map_err(|_| error("function cache poisoned"))?;
        if allowed.get(kernel).is_none_or(|&a| a < shared) {
            let attribute = drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            // SAFETY: a function of a loaded module; the size is within the device's opt-in
            // limit (`cooperative_limits`), which the launch checks again.
            unsafe { drv_sys::cuFuncSetAttribute(f, attribute, shared as i32) }
                .result()
                .map_err(|e| error(format!("`{kernel}`: {shared} bytes of shared memory: {e:?}")))?;
            allowed.insert(kernel.to_string(), shared);
        }
        drop(allowed);
        // SAFETY: as for `launch`; the driver refuses a grid whose blocks cannot all be resident.
        unsafe {
            drv_sys::cuLaunchCooperativeKernel(
                f,
                grid.max(1),
                1,
                1,
                block,
                1,
                1,
                shared,
                self.stream,
                params.as_mut_ptr(),
            )
        }
        .result()
        .map_err(|e| error(format!("launching `{kernel}` cooperatively ({grid} blocks): {e:?}")))
    }

    fn gemm(&self, p: &Gemm) -> Result<()> {
        let Gemm { m, n, k, a, lda, trans_a, b, ldb, trans_b, c, ldc, accumulate, operands, batch } = *p;
        if m == 0 || n == 0 || batch.count == 0 {
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
        let (n, m, k, lda, ldb, ldc) = (int(n)?, int(m)?, int(k)?, int(lda)?, int(ldb)?, int(ldc)?);
        let count = int(batch.count)?;
        let stride = |x: usize| x as std::ffi::c_longlong;
        let (a, b) = (a as *const f32, b as *const f32);
        let tensor_cores = match operands {
            cellc::precision::Precision::F32 => None,
            cellc::precision::Precision::Bf16 => {
                Some(blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF)
            }
            cellc::precision::Precision::F16 => {
                Some(blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16F)
            }
            cellc::precision::Precision::Tf32 => {
                Some(blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32)
            }
        };
        if let Some(compute) = tensor_cores {
            // bf16, fp16 or TF32 operands, f32 sums: the tensor cores round f32 inputs
            // themselves (the same products, the same layout as sgemm's below).
            let f32_type = blas_sys::cudaDataType::CUDA_R_32F;
            let scalar = |x: &f32| (x as *const f32).cast::<c_void>();
            let algo = blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP;
            let (h, ta, tb) = (self.gpu.blas.0, op(trans_a), op(trans_b));
            // SAFETY: as for sgemm below.
            let done = unsafe {
                if count == 1 {
                    blas::gemm_ex(
                        h,
                        tb,
                        ta,
                        n,
                        m,
                        k,
                        scalar(&alpha),
                        b.cast(),
                        f32_type,
                        ldb,
                        a.cast(),
                        f32_type,
                        lda,
                        scalar(&beta),
                        c as *mut c_void,
                        f32_type,
                        ldc,
                        compute,
                        algo,
                    )
                } else {
                    blas::gemm_strided_batched_ex(
                        h,
                        tb,
                        ta,
                        n,
                        m,
                        k,
                        scalar(&alpha),
                        b.cast(),
                        f32_type,
                        ldb,
                        stride(batch.b),
                        a.cast(),
                        f32_type,
                        lda,
                        stride(batch.a),
                        scalar(&beta),
                        c as *mut c_void,
                        f32_type,
                        ldc,
                        stride(batch.c),
                        count,
                        compute,
                        algo,
                    )
                }
            };
            return done
                .map_err(|e| error(format!("cublasGemmEx ({operands} operands, {count} heads): {e:?}")));
        }
        let (h, ta, tb) = (self.gpu.blas.0, op(trans_a), op(trans_b));
        // SAFETY: device pointers of this context with the described shapes
        // (each head's inside its value); alpha and beta on the host.
        let done = unsafe {
            if count == 1 {
                blas::sgemm(h, tb, ta, n, m, k, &alpha, b, ldb, a, lda, &beta, c as *mut f32, ldc)
            } else {
                blas::sgemm_strided_batched(
                    h,
                    tb,
                    ta,
                    n,
                    m,
                    k,
                    &alpha,
                    b,
                    ldb,
                    stride(batch.b),
                    a,
                    lda,
                    stride(batch.a),
                    &beta,
                    c as *mut f32,
                    ldc,
                    stride(batch.c),
                    count,
                )
            }
        };
        done.map_err(|e| error(format!("cublasSgemm ({count} heads): {e:?}")))
    }

    fn zero(&self, addr: u64, floats: usize) -> Result<()> {
        // SAFETY: `floats` floats of device memory of this context; queued on the stream.
        unsafe { drv_sys::cuMemsetD32Async(addr, 0, floats, self.stream) }
            .result()
            .map_err(|e| error(format!("cuMemsetD32Async: {e:?}")))
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
            // First wait for the work queued on the device's stream and after
            // the last run (on a caller's stream, which may be gone by now:
            // its event is waited for instead), then destroy what it used.
            // SAFETY: the device's own stream and event, alive until below.
            unsafe {
                let _ = drv::stream::synchronize(self.stream.0);
                let _ = drv_sys::cuEventSynchronize(self.handoff.0);
            }
            if let Ok(mut graphs) = self.graphs.lock() {
                for exec in graphs.drain() {
                    // SAFETY: instantiated once by capture() and destroyed once; nothing runs it now.
                    let _ = unsafe { drv::graph::exec_destroy(exec.0) };
                }
            }
            // SAFETY: created once in new(); the work that used them is done.
            unsafe {
                let _ = blas::destroy_handle(self.blas.0);
                let _ = drv::stream::destroy(self.stream.0);
            }
            // SAFETY: made once each; no pass is running (a pass borrows the device).
            unsafe {
                let _ = drv_sys::cuEventDestroy_v2(self.handoff.0);
                if let Some(Ok(pool)) = self.stream_pool.get() {
                    let _ = drv_sys::cuMemPoolDestroy(pool.0);
                }
                if let Ok(mut pinned) = self.pinned.lock() {
                    for block in pinned.drain(..) {
                        let _ = drv_sys::cuMemFreeHost(block.addr as *mut c_void);
                    }
                }
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
        // SAFETY: `buf` holds len * 4 bytes; queued on the device's stream after earlier work.
        unsafe { drv_sys::cuMemsetD8Async(buf.addr, 0, len * 4, self.stream.0) }
            .result()
            .map_err(|e| error(format!("cuMemsetD8Async: {e:?}")))?;
        Ok(buf)
    }

    fn upload(&self, data: &[f32]) -> Result<Buf> {
        self.uploaded.fetch_add(data.len(), std::sync::atomic::Ordering::Relaxed);
        self.upload_slice(data)
    }

    fn floats_uploaded(&self) -> usize {
        self.uploaded.load(std::sync::atomic::Ordering::Relaxed)
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
            // SAFETY: floats [from, from + len) of a device buffer into `out`, queued on the
            // device's stream after the work that wrote them, and waited for below.
            unsafe {
                drv_sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), buf.at(from), len * 4, self.stream.0)
            }
            .result()
            .map_err(|e| error(format!("cuMemcpyDtoHAsync (a kernel before it may have failed): {e:?}")))?;
            // SAFETY: the device's own stream.
            unsafe { drv::stream::synchronize(self.stream.0) }.map_err(|e| {
                error(format!("waiting for a download (a kernel before it may have failed): {e:?}"))
            })?;
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
            shared_allowed: Mutex::new(HashMap::new()),
            ctx: self.ctx.clone(),
        })))
    }

    fn run(&self, module: &Module, calls: &[Call], graph: bool) -> Result<()> {
        let stream = self.stream.0;
        self.run_on(stream, || match graph {
            true => self.run_as_graph(module, calls, stream),
            false => On { gpu: self, stream }.issue(module, calls),
        })
    }

    fn graph_stats(&self) -> GraphStats {
        self.graphs.lock().map(|g| g.stats).unwrap_or_default()
    }

    fn cooperative_limits(&self) -> Option<CooperativeLimits> {
        self.cooperative
    }

    fn on_stream(&self, stream: u64) -> Result<Option<Box<dyn Device + '_>>> {
        let pool = self.stream_pool()?;
        let stream = Handle(stream as drv_sys::CUstream);
        Ok(Some(Box::new(OnStream { gpu: self, stream, pool: Handle(pool), staging: Mutex::default() })))
    }
}

/// The GPU working on a caller's stream (see the module documentation).
struct OnStream<'a> {
    gpu: &'a Gpu,
    stream: Handle<drv_sys::CUstream>,
    pool: Handle<drv_sys::CUmemoryPool>,
    staging: Mutex<Staging>,
}

/// The pinned blocks a pass on a caller's stream has staged tables in; the
/// last one is filled from `used` on.
#[derive(Default)]
struct Staging {
    blocks: Vec<Pinned>,
    used: usize,
}

/// The smallest pinned block staged into (a pass's tables usually fit one).
const PINNED_BLOCK: usize = 1 << 20;

/// Device memory from the stream-ordered pool, freed on its stream when dropped.
struct StreamMem {
    ptr: drv_sys::CUdeviceptr,
    stream: Handle<drv_sys::CUstream>,
    ctx: Arc<CudaContext>,
}

impl Drop for StreamMem {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated on this stream from the pool; freed once, after the work queued before.
            let _ = unsafe { drv_sys::cuMemFreeAsync(self.ptr, self.stream.0) };
        }
    }
}

impl OnStream<'_> {
    /// `bytes` (at least 4) of device memory, ordered on the stream.
    fn alloc(&self, bytes: usize, len: usize) -> Result<Buf> {
        let mut ptr = 0;
        // SAFETY: a pool and stream of this context, which `exclusive` bound.
        unsafe { drv_sys::cuMemAllocFromPoolAsync(&mut ptr, bytes.max(4), self.pool.0, self.stream.0) }
            .result()
            .map_err(|e| error(format!("cuMemAllocFromPoolAsync of {bytes} bytes: {e:?}")))?;
        let owner = StreamMem { ptr, stream: self.stream, ctx: self.gpu.ctx.clone() };
        Ok(Buf::new(ptr, len, Box::new(owner)))
    }

    /// `data` copied to new device memory, asynchronously, through pinned staging.
    fn upload_slice<T: Copy>(&self, data: &[T]) -> Result<Buf> {
        let bytes = std::mem::size_of_val(data);
        let _one = self.gpu.exclusive()?;
        let buf = self.alloc(bytes, data.len())?;
        if bytes == 0 {
            return Ok(buf);
        }
        let host = self.stage(bytes)?;
        // SAFETY: `host` is `bytes` bytes of pinned memory reserved for this copy.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().cast::<u8>(), host as *mut u8, bytes) };
        // SAFETY: pinned source, device destination of `bytes`; the block is not reused before
        // the event recorded after this copy (see `Drop`) has completed.
        unsafe { drv_sys::cuMemcpyHtoDAsync_v2(buf.addr, host as *const c_void, bytes, self.stream.0) }
            .result()
            .map_err(|e| error(format!("cuMemcpyHtoDAsync: {e:?}")))?;
        Ok(buf)
    }

    /// The address of `bytes` of pinned memory for one copy (16-byte aligned).
    fn stage(&self, bytes: usize) -> Result<usize> {
        let mut staging = self.staging.lock().map_err(|_| error("staging lock poisoned"))?;
        let at = staging.used.next_multiple_of(16);
        if let Some(&Pinned { addr, bytes: size, .. }) = staging.blocks.last() {
            if at + bytes <= size {
                staging.used = at + bytes;
                return Ok(addr + at);
            }
        }
        let block = self.gpu.pinned_block(bytes)?;
        let addr = block.addr;
        staging.blocks.push(block);
        staging.used = bytes;
        Ok(addr)
    }
}

impl Gpu {
    /// A free pinned block of at least `bytes` whose copies are done, or a new one.
    fn pinned_block(&self, bytes: usize) -> Result<Pinned> {
        let mut free = self.pinned.lock().map_err(|_| error("pinned pool lock poisoned"))?;
        let done = |p: &Pinned| {
            p.copied.as_ref().is_none_or(|e| {
                // SAFETY: a live event; the query does not wait.
                let status = unsafe { drv_sys::cuEventQuery(e.0 .0) };
                status == drv_sys::CUresult::CUDA_SUCCESS
            })
        };
        if let Some(i) = free.iter().position(|p| p.bytes >= bytes && done(p)) {
            let mut block = free.swap_remove(i);
            block.copied = None;
            return Ok(block);
        }
        let size = bytes.max(PINNED_BLOCK);
        let mut ptr = std::ptr::null_mut();
        // SAFETY: a fresh pinned allocation in the bound context, freed in `Drop for Gpu`.
        unsafe { drv_sys::cuMemHostAlloc(&mut ptr, size, 0) }
            .result()
            .map_err(|e| error(format!("cuMemHostAlloc of {size} bytes: {e:?}")))?;
        Ok(Pinned { addr: ptr as usize, bytes: size, copied: None })
    }
}

impl Drop for OnStream<'_> {
    fn drop(&mut self) {
        let Ok(mut staging) = self.staging.lock() else { return };
        let blocks = std::mem::take(&mut staging.blocks);
        if blocks.is_empty() {
            return;
        }
        // The blocks go back once an event after their copies has completed;
        // if no event can be recorded they are kept out of use (never reused early).
        let Ok(_one) = self.gpu.exclusive() else { return };
        let Ok(event) = new_event() else { return };
        let event = Arc::new(Event(Handle(event)));
        // SAFETY: a live event and the caller's stream.
        if unsafe { drv_sys::cuEventRecord(event.0 .0, self.stream.0) }.result().is_err() {
            return;
        }
        if let Ok(mut free) = self.gpu.pinned.lock() {
            free.extend(blocks.into_iter().map(|b| Pinned { copied: Some(event.clone()), ..b }));
        }
    }
}

impl Device for OnStream<'_> {
    fn name(&self) -> String {
        self.gpu.name()
    }

    fn zeros(&self, len: usize) -> Result<Buf> {
        let _one = self.gpu.exclusive()?;
        let buf = self.alloc(len * 4, len)?;
        // SAFETY: `buf` holds len * 4 bytes; queued on the stream after the allocation.
        unsafe { drv_sys::cuMemsetD8Async(buf.addr, 0, len * 4, self.stream.0) }
            .result()
            .map_err(|e| error(format!("cuMemsetD8Async: {e:?}")))?;
        Ok(buf)
    }

    fn upload(&self, data: &[f32]) -> Result<Buf> {
        self.gpu.uploaded.fetch_add(data.len(), std::sync::atomic::Ordering::Relaxed);
        self.upload_slice(data)
    }

    fn floats_uploaded(&self) -> usize {
        self.gpu.floats_uploaded()
    }

    fn upload_addresses(&self, addresses: &[u64]) -> Result<Buf> {
        self.upload_slice(addresses)
    }

    fn upload_i32(&self, data: &[i32]) -> Result<Buf> {
        self.upload_slice(data)
    }

    fn download(&self, _buf: &Buf, _from: usize, _len: usize) -> Result<Vec<f32>> {
        Err(error("a pass on the caller's stream reads nothing back to the host (it would wait)"))
    }

    fn load(&self, kernels: &[Kernel]) -> Result<Module> {
        self.gpu.load(kernels)
    }

    fn cooperative_limits(&self) -> Option<CooperativeLimits> {
        self.gpu.cooperative
    }

    /// Runs `calls` on the caller's stream; with `graph`, as a graph
    /// launched there ([`Gpu::run_as_graph`]), unless the caller's stream
    /// is being captured itself (the calls then join the caller's graph).
    fn run(&self, module: &Module, calls: &[Call], graph: bool) -> Result<()> {
        let stream = self.stream.0;
        self.gpu.run_on(stream, || match graph && !capturing(stream)? {
            true => self.gpu.run_as_graph(module, calls, stream),
            false => On { gpu: self.gpu, stream }.issue(module, calls),
        })
    }
}

/// A new event without timing.
fn new_event() -> Result<drv_sys::CUevent> {
    let mut event = std::ptr::null_mut();
    // SAFETY: creates an event in the bound context.
    unsafe { drv_sys::cuEventCreate(&mut event, drv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }
        .result()
        .map_err(|e| error(format!("cuEventCreate: {e:?}")))?;
    Ok(event)
}
