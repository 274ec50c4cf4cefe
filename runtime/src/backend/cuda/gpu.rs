//! The real device: CUDA's driver API and cuBLAS through cudarc (loaded at
//! run time), kernels compiled by NVRTC to SASS for the device's own
//! architecture.
//!
//! No machine the project is developed on has a GPU: this file is compiled
//! and its gating exercised (no driver: a typed error), but it runs for the
//! first time on a user's GPU. It therefore stays close to the driver API:
//! synchronous copies, the legacy default stream for kernels and cuBLAS
//! alike (so every operation is ordered after the previous one), and every
//! call's error turned into a typed error naming the call.

use super::device::{Arg, Buf, Device, GemmNt, Module};
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

/// A GPU with a cuBLAS handle.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    blas: BlasHandle,
    /// `sm_XY` of the device, for NVRTC.
    arch: String,
}

struct BlasHandle(blas_sys::cublasHandle_t);
// SAFETY: the handle is only used with the context bound and calls are serialised by the caller.
unsafe impl Send for BlasHandle {}
unsafe impl Sync for BlasHandle {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("arch", &self.arch).finish()
    }
}

/// Device memory, freed on drop.
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
        let handle = blas::create_handle().map_err(|e| error(format!("cublasCreate: {e:?}")))?;
        Ok(Gpu { ctx, blas: BlasHandle(handle), arch: format!("sm_{major}{minor}") })
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| error(format!("binding the context: {e:?}")))
    }

    fn alloc(&self, bytes: usize) -> Result<DevMem> {
        self.bind()?;
        // SAFETY: a fresh allocation of at least 4 bytes.
        let ptr = unsafe { drv::malloc_sync(bytes.max(4)) }
            .map_err(|e| error(format!("cuMemAlloc of {bytes} bytes: {e:?}")))?;
        Ok(DevMem { ptr, ctx: self.ctx.clone() })
    }

    fn upload_slice<T: Copy + Send + Sync + 'static>(&self, data: &[T]) -> Result<Buf> {
        let mem = self.alloc(std::mem::size_of_val(data))?;
        if !data.is_empty() {
            // SAFETY: `mem` holds size_of_val(data) bytes.
            unsafe { drv::memcpy_htod_sync(mem.ptr, data) }
                .map_err(|e| error(format!("cuMemcpyHtoD: {e:?}")))?;
        }
        Ok(Buf::new(mem.ptr, data.len(), Box::new(mem)))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: created once in new().
            let _ = unsafe { blas::destroy_handle(self.blas.0) };
        }
    }
}

impl Device for Gpu {
    fn name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "CUDA device".into());
        format!("{name} ({})", self.arch)
    }

    fn zeros(&self, len: usize) -> Result<Buf> {
        let mem = self.alloc(len * 4)?;
        // SAFETY: `mem` holds len * 4 bytes.
        unsafe { drv::memset_d8_sync(mem.ptr, 0, len * 4) }
            .map_err(|e| error(format!("cuMemsetD8: {e:?}")))?;
        Ok(Buf::new(mem.ptr, len, Box::new(mem)))
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

    fn download(&self, buf: &Buf) -> Result<Vec<f32>> {
        self.bind()?;
        let mut out = vec![0.0f32; buf.len];
        if buf.len > 0 {
            // SAFETY: `buf` is a device buffer of `len` floats; the copy waits for prior work.
            unsafe { drv::memcpy_dtoh_sync(&mut out, buf.addr) }
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
        self.bind()?;
        // SAFETY: a complete CUBIN image from NVRTC for this device's architecture.
        let module = unsafe { drv::module::load_data(compiled.cubin.as_ptr().cast()) }
            .map_err(|e| error(format!("cuModuleLoadData: {e:?}")))?;
        Ok(Module::new(Box::new(GpuModule {
            module,
            functions: Mutex::new(HashMap::new()),
            ctx: self.ctx.clone(),
        })))
    }

    fn launch(&self, module: &Module, kernel: &str, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        let m = module.get::<GpuModule>().ok_or_else(|| error("not a GPU module"))?;
        self.bind()?;
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
        // device memory of this context, alive until the launch's results are downloaded.
        unsafe {
            drv::launch_kernel(f, (grid.max(1), 1, 1), (block, 1, 1), 0, std::ptr::null_mut(), &mut params)
        }
        .map_err(|e| error(format!("launching `{kernel}`: {e:?}")))
    }

    fn gemm_nt(&self, p: GemmNt) -> Result<()> {
        let GemmNt { m, n, k, a, lda, b, ldb, c, ldc } = p;
        if m == 0 || n == 0 {
            return Ok(());
        }
        self.bind()?;
        // Row-major C = A·Bᵀ is column-major Cᵀ = B·Aᵀ: cuBLAS sees B as a
        // k×n column-major matrix to transpose and A as a k×m one.
        let (alpha, beta) = (1.0f32, 0.0f32);
        let int = |x: usize| {
            i32::try_from(x).map_err(|_| error(format!("GEMM dimension {x} too large for cuBLAS")))
        };
        // SAFETY: device pointers of this context with the described shapes; alpha and beta on the host.
        unsafe {
            blas::sgemm(
                self.blas.0,
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
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
