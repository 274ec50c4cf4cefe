//! The few functions of PyTorch's AOTInductor C API (`aoti_torch/c/shim.h`,
//! and the generated `c_shim_cpu.h`/`c_shim_cuda.h`) the operator uses,
//! found in the process at the first call: in its global scope (a C++
//! program linked against libtorch), else in an already loaded
//! `libtorch_cpu.so` or `libtorch_cuda.so` (a Python process, where
//! PyTorch's libraries are loaded locally). Nothing links against libtorch,
//! so the library builds and loads without it; the CUDA functions are
//! looked up only for CUDA tensors.

use cellc_runtime::spec::TensorsOn;
use cellc_runtime::{DeviceFloats, Result, RuntimeError};
use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

/// `AtenTensorHandle`: an opaque tensor of the C API.
pub type TensorHandle = *mut c_void;

/// `aoti_torch_get_*`: a property of a tensor, written through the pointer.
type Getter<T> = unsafe extern "C" fn(TensorHandle, *mut T) -> i32;
/// `aoti_torch_empty_strided(ndim, sizes, strides, dtype, device_type, device_index, out)`.
type EmptyStrided =
    unsafe extern "C" fn(i64, *const i64, *const i64, i32, i32, i32, *mut TensorHandle) -> i32;
/// `aoti_torch_dtype_*`, `aoti_torch_device_type_*`: a code.
type Code = unsafe extern "C" fn() -> i32;
/// `aoti_torch_delete_tensor_object(tensor)`.
type Delete = unsafe extern "C" fn(TensorHandle) -> i32;
/// `aoti_torch_{cpu,cuda}_cat(tensors, tensors_len, dim, out)`.
type Cat = unsafe extern "C" fn(*const TensorHandle, i64, i64, *mut TensorHandle) -> i32;
/// `aoti_torch_get_current_cuda_stream(device_index, out)`.
type CurrentStream = unsafe extern "C" fn(i32, *mut *mut c_void) -> i32;

/// The functions, resolved.
#[derive(Debug)]
pub struct Api {
    pub get_data_ptr: Getter<*mut c_void>,
    pub get_dim: Getter<i64>,
    pub get_sizes: Getter<*const i64>,
    pub get_strides: Getter<*const i64>,
    pub get_dtype: Getter<i32>,
    pub get_device_type: Getter<i32>,
    pub get_device_index: Getter<i32>,
    pub empty_strided: EmptyStrided,
    pub delete_tensor: Delete,
    pub cpu_cat: Cat,
    pub dtype_float32: i32,
    pub dtype_int64: i32,
    pub device_cpu: i32,
    pub device_cuda: i32,
}

/// The API, or why it was not found.
pub fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(resolve).as_ref().map_err(|e| RuntimeError::Internal(e.clone()))
}

/// The C API function `name`: in the process's global scope, else in
/// PyTorch's already loaded CPU or CUDA library.
fn symbol(name: &CStr) -> std::result::Result<*mut c_void, String> {
    // SAFETY: dlsym over the process's scope.
    let global = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if !global.is_null() {
        return Ok(global);
    }
    for library in [c"libtorch_cpu.so", c"libtorch_cuda.so"] {
        // SAFETY: dlopen with RTLD_NOLOAD only returns a library already
        // loaded (and counts a reference to it, which the process keeps).
        let handle = unsafe { libc::dlopen(library.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if handle.is_null() {
            continue;
        }
        // SAFETY: dlsym over a handle dlopen returned.
        let found = unsafe { libc::dlsym(handle, name.as_ptr()) };
        if !found.is_null() {
            return Ok(found);
        }
    }
    Err(format!(
        "PyTorch's `{}` is not in this process: cellc's AOTInductor operator runs in a process that has \
         libtorch loaded (libtorch_cuda for CUDA tensors)",
        name.to_string_lossy()
    ))
}

fn resolve() -> std::result::Result<Api, String> {
    // SAFETY: each symbol is the C API function of that name, whose
    // signature shim.h gives and the field's type repeats.
    unsafe {
        let constant = |name: &CStr| -> std::result::Result<i32, String> {
            let f = std::mem::transmute::<*mut c_void, Code>(symbol(name)?);
            Ok(f())
        };
        Ok(Api {
            get_data_ptr: std::mem::transmute::<*mut c_void, Getter<*mut c_void>>(symbol(
                c"aoti_torch_get_data_ptr",
            )?),
            get_dim: std::mem::transmute::<*mut c_void, Getter<i64>>(symbol(c"aoti_torch_get_dim")?),
            get_sizes: std::mem::transmute::<*mut c_void, Getter<*const i64>>(symbol(
                c"aoti_torch_get_sizes",
            )?),
            get_strides: std::mem::transmute::<*mut c_void, Getter<*const i64>>(symbol(
                c"aoti_torch_get_strides",
            )?),
            get_dtype: std::mem::transmute::<*mut c_void, Getter<i32>>(symbol(c"aoti_torch_get_dtype")?),
            get_device_type: std::mem::transmute::<*mut c_void, Getter<i32>>(symbol(
                c"aoti_torch_get_device_type",
            )?),
            get_device_index: std::mem::transmute::<*mut c_void, Getter<i32>>(symbol(
                c"aoti_torch_get_device_index",
            )?),
            empty_strided: std::mem::transmute::<*mut c_void, EmptyStrided>(symbol(
                c"aoti_torch_empty_strided",
            )?),
            delete_tensor: std::mem::transmute::<*mut c_void, Delete>(symbol(
                c"aoti_torch_delete_tensor_object",
            )?),
            cpu_cat: std::mem::transmute::<*mut c_void, Cat>(symbol(c"aoti_torch_cpu_cat")?),
            dtype_float32: constant(c"aoti_torch_dtype_float32")?,
            dtype_int64: constant(c"aoti_torch_dtype_int64")?,
            device_cpu: constant(c"aoti_torch_device_type_cpu")?,
            device_cuda: constant(c"aoti_torch_device_type_cuda")?,
        })
    }
}

/// The CUDA functions (`aoti_torch_cuda_cat`, the current stream), or why
/// they were not found.
struct CudaApi {
    cat: Cat,
    current_stream: CurrentStream,
}

fn cuda_api() -> Result<&'static CudaApi> {
    static API: OnceLock<std::result::Result<CudaApi, String>> = OnceLock::new();
    API.get_or_init(|| {
        // SAFETY: as in `resolve`.
        unsafe {
            Ok(CudaApi {
                cat: std::mem::transmute::<*mut c_void, Cat>(symbol(c"aoti_torch_cuda_cat")?),
                current_stream: std::mem::transmute::<*mut c_void, CurrentStream>(symbol(
                    c"aoti_torch_get_current_cuda_stream",
                )?),
            })
        }
    })
    .as_ref()
    .map_err(|e| RuntimeError::Internal(e.clone()))
}

/// A checked call of the API: its error code as an error naming `what`.
pub fn check(code: i32, what: &str) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(RuntimeError::Internal(format!("PyTorch's C API failed on {what} (error {code})")))
    }
}

/// A tensor of the call, read: its shape, first element and device.
#[derive(Debug)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: *mut c_void,
    pub on: TensorsOn,
}

impl Api {
    /// `handle`, checked to be a contiguous CPU or CUDA tensor of `dtype` (`"float32"` or `"int64"`).
    ///
    /// # Safety
    /// `handle` is a live tensor handle.
    pub unsafe fn tensor(&self, handle: TensorHandle, name: &str, dtype: &str) -> Result<Tensor> {
        let want = if dtype == "int64" { self.dtype_int64 } else { self.dtype_float32 };
        let (mut dim, mut sizes, mut strides) = (0i64, std::ptr::null(), std::ptr::null());
        let (mut found_dtype, mut device, mut index, mut data) = (0i32, 0i32, 0i32, std::ptr::null_mut());
        // SAFETY (block): a live handle, per the contract; the pointers the
        // C API returns are borrowed from it and read at once.
        unsafe {
            check((self.get_dim)(handle, &mut dim), name)?;
            check((self.get_sizes)(handle, &mut sizes), name)?;
            check((self.get_strides)(handle, &mut strides), name)?;
            check((self.get_dtype)(handle, &mut found_dtype), name)?;
            check((self.get_device_type)(handle, &mut device), name)?;
            check((self.get_device_index)(handle, &mut index), name)?;
            check((self.get_data_ptr)(handle, &mut data), name)?;
            let dim = usize::try_from(dim).unwrap_or(0);
            let sizes = std::slice::from_raw_parts(sizes, dim);
            let strides = std::slice::from_raw_parts(strides, dim);
            let shape: Vec<usize> = sizes.iter().map(|&s| usize::try_from(s).unwrap_or(0)).collect();
            let shape_error = |expected: &str, found: String| RuntimeError::Shape {
                tensor: name.to_string(),
                expected: expected.to_string(),
                found,
            };
            if found_dtype != want {
                return Err(shape_error(&format!("a {dtype} tensor"), format!("dtype code {found_dtype}")));
            }
            let on = if device == self.device_cpu {
                TensorsOn::Cpu
            } else if device == self.device_cuda {
                TensorsOn::Cuda(usize::try_from(index).unwrap_or(0))
            } else {
                return Err(shape_error("a CPU or CUDA tensor", format!("device type {device}")));
            };
            let mut expected = 1i64;
            for (i, (&size, &stride)) in sizes.iter().zip(strides).enumerate().rev() {
                if size > 1 && stride != expected {
                    return Err(shape_error(
                        "a contiguous tensor",
                        format!("stride {stride} in dimension {i}"),
                    ));
                }
                expected *= size.max(1);
            }
            Ok(Tensor { shape, data, on })
        }
    }

    /// A new contiguous float32 tensor of `shape`, `on` the CPU or a GPU.
    pub fn empty(&self, shape: &[usize], on: TensorsOn, name: &str) -> Result<(TensorHandle, Tensor)> {
        let sizes: Vec<i64> = shape.iter().map(|&s| s as i64).collect();
        let mut strides = vec![1i64; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * sizes[i + 1].max(1);
        }
        let (device_type, device_index) = match on {
            TensorsOn::Cpu => (self.device_cpu, 0),
            TensorsOn::Cuda(ordinal) => (self.device_cuda, ordinal as i32),
        };
        let mut handle = std::ptr::null_mut();
        // SAFETY: sizes and strides of `shape.len()` elements each; a fresh handle is written.
        check(
            unsafe {
                (self.empty_strided)(
                    sizes.len() as i64,
                    sizes.as_ptr(),
                    strides.as_ptr(),
                    self.dtype_float32,
                    device_type,
                    device_index,
                    &mut handle,
                )
            },
            name,
        )?;
        // SAFETY: the handle PyTorch just made.
        let tensor = unsafe { self.tensor(handle, name, "float32")? };
        Ok((handle, tensor))
    }
}

impl Api {
    /// A new tensor, `tensors` joined along dimension `dim` on their device
    /// (PyTorch's `cat`, queued on its current stream for CUDA tensors).
    ///
    /// # Safety
    /// Live tensor handles, all on `on`.
    pub unsafe fn cat(
        &self,
        tensors: &[TensorHandle],
        dim: i64,
        on: TensorsOn,
        name: &str,
    ) -> Result<TensorHandle> {
        let cat = match on {
            TensorsOn::Cpu => self.cpu_cat,
            TensorsOn::Cuda(_) => cuda_api()?.cat,
        };
        let mut handle = std::ptr::null_mut();
        // SAFETY: per the contract; a fresh handle is written.
        check(unsafe { cat(tensors.as_ptr(), tensors.len() as i64, dim, &mut handle) }, name)?;
        Ok(handle)
    }

    /// Releases a tensor this library made and hands to no one.
    ///
    /// # Safety
    /// A live handle, not used after.
    pub unsafe fn delete(&self, tensor: TensorHandle) {
        // SAFETY: per the contract. A failure leaks the tensor, nothing worse.
        let _ = unsafe { (self.delete_tensor)(tensor) };
    }

    /// PyTorch's current stream on CUDA device `ordinal` (a `cudaStream_t`).
    pub fn current_stream(&self, ordinal: usize) -> Result<u64> {
        let mut stream = std::ptr::null_mut();
        // SAFETY: the C API's function; a stream handle is written.
        check(
            unsafe { (cuda_api()?.current_stream)(ordinal as i32, &mut stream) },
            "the current CUDA stream",
        )?;
        Ok(stream as u64)
    }
}

impl Tensor {
    /// Elements in all.
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The tensor's floats.
    ///
    /// # Safety
    /// A float32 tensor read by [`Api::tensor`], alive and not written during the borrow.
    pub unsafe fn floats<'a>(&self) -> &'a [f32] {
        if self.elements() == 0 {
            return &[];
        }
        // SAFETY: per the contract.
        unsafe { std::slice::from_raw_parts(self.data as *const f32, self.elements()) }
    }

    /// The tensor's floats, to write.
    ///
    /// # Safety
    /// As for [`Tensor::floats`], and no other borrow of it is alive.
    pub unsafe fn floats_mut<'a>(&self) -> &'a mut [f32] {
        if self.elements() == 0 {
            return &mut [];
        }
        // SAFETY: per the contract.
        unsafe { std::slice::from_raw_parts_mut(self.data as *mut f32, self.elements()) }
    }

    /// The tensor's floats as device memory (a GPU's, or, for a CPU
    /// tensor, the emulated device's, which is the host's).
    pub fn device_floats(&self) -> DeviceFloats {
        DeviceFloats { addr: self.data as u64, len: self.elements() }
    }

    /// The tensor's int64 values.
    ///
    /// # Safety
    /// An int64 tensor read by [`Api::tensor`], alive during the borrow.
    pub unsafe fn int64s<'a>(&self) -> &'a [i64] {
        if self.elements() == 0 {
            return &[];
        }
        // SAFETY: per the contract.
        unsafe { std::slice::from_raw_parts(self.data as *const i64, self.elements()) }
    }
}
