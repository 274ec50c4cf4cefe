//! PyTorch tensors over cellc's recycled memory ([`cellc_runtime::pool`]),
//! handed over by DLPack: a step's large buffers (the reserve, the output,
//! the input and weight gradients).
//!
//! A training step's reserve alone is tens of megabytes. From PyTorch's
//! CPU allocator (malloc), a buffer that large is mapped fresh on every
//! call and its pages faulted in as the runtime writes them: measured, that
//! doubled a B=64, H=256 LSTM training step. These buffers come from the
//! pool the runtime's own buffers recycle through, and go back there when
//! PyTorch frees the tensor.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTuple;
use std::ffi::{c_void, CStr};

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What a capsule owns: the tensor's description, its shape, its floats.
#[repr(C)]
struct Owner {
    /// First, so that a `*mut DLManagedTensor` is a `*mut Owner`.
    managed: DLManagedTensor,
    shape: [i64; MOST_DIMS],
    data: Vec<f32>,
}

/// The most dimensions a recycled tensor has (a padded batch's three).
const MOST_DIMS: usize = 3;

const DL_CPU: i32 = 1;
const DL_FLOAT: u8 = 2;
const NAME: &CStr = c"dltensor";

/// Called by the consumer (PyTorch, when the tensor is freed), or by the
/// capsule's destructor if nothing consumed it.
unsafe extern "C" fn delete(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: made by `Box::into_raw` in `recycled`, deleted once (DLPack's contract).
    let owner = unsafe { Box::from_raw(managed as *mut Owner) };
    cellc_runtime::pool::give(owner.data);
}

/// The capsule's destructor: frees the tensor unless a consumer took it
/// (a consumer renames the capsule `used_dltensor`).
unsafe extern "C" fn destroy_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python on a capsule made in `recycled`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()) as *mut DLManagedTensor;
            delete(managed);
        }
    }
}

/// A fresh float32 CPU tensor of `shape` (at most three dimensions) for a
/// call's outputs, its contents unspecified (the runtime writes every float
/// that is read): over the pool's recycled memory where it is large enough
/// for the pool to keep, else from PyTorch's allocator (malloc serves those
/// from memory it holds; the hand-over would cost more than it saves).
#[pyfunction]
pub fn recycled_tensor<'py>(py: Python<'py>, shape: Vec<usize>) -> PyResult<Bound<'py, PyAny>> {
    static TORCH: PyOnceLock<(Py<PyAny>, Py<PyAny>)> = PyOnceLock::new();
    let (empty, from_dlpack) = TORCH.get_or_try_init(py, || -> PyResult<_> {
        let torch = py.import("torch")?;
        Ok((torch.getattr("empty")?.unbind(), torch.getattr("from_dlpack")?.unbind()))
    })?;
    if shape.iter().product::<usize>() >= cellc_runtime::pool::MIN_KEPT_FLOATS {
        return from_dlpack.bind(py).call1((shaped(py, &shape)?,));
    }
    empty.bind(py).call1((PyTuple::new(py, &shape)?,))
}

/// A DLPack capsule of a contiguous f32 tensor of `shape` (at most three
/// dimensions) on the CPU, from the pool.
fn shaped<'py>(py: Python<'py>, shape: &[usize]) -> PyResult<Bound<'py, PyAny>> {
    if shape.len() > MOST_DIMS {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{shape:?}: more than {MOST_DIMS} dimensions"
        )));
    }
    let mut dims = [0i64; MOST_DIMS];
    for (d, &n) in dims.iter_mut().zip(shape) {
        *d = n as i64;
    }
    let mut owner = Box::new(Owner {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: std::ptr::null_mut(),
                device: DLDevice { device_type: DL_CPU, device_id: 0 },
                ndim: shape.len() as i32,
                dtype: DLDataType { code: DL_FLOAT, bits: 32, lanes: 1 },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete),
        },
        shape: dims,
        data: cellc_runtime::pool::take(shape.iter().product()),
    });
    owner.managed.dl_tensor.data = owner.data.as_mut_ptr().cast();
    owner.managed.dl_tensor.shape = owner.shape.as_mut_ptr();
    let raw = Box::into_raw(owner);
    // SAFETY: `raw` stays valid until `delete`; the name is a static string.
    unsafe {
        let capsule = ffi::PyCapsule_New(raw.cast(), NAME.as_ptr(), Some(destroy_capsule));
        if capsule.is_null() {
            delete(raw.cast());
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, capsule))
    }
}
