//! ONNX Runtime's C API table (version 17), handed over when the library
//! registers its operators, and the conversions between its statuses and
//! cellc's errors.

use cellc_runtime::{Result, RuntimeError};
use ort_sys::{OrtApi, OrtApiBase, OrtErrorCode, OrtStatusPtr};
use std::ffi::{CStr, CString};
use std::sync::atomic::{AtomicPtr, Ordering};

/// The version of ONNX Runtime's C API the operator is written against:
/// 17 (ONNX Runtime 1.17), which every later runtime keeps.
pub const API_VERSION: u32 = 17;

/// The API table ONNX Runtime handed [`crate::RegisterCustomOps`].
static API: AtomicPtr<OrtApi> = AtomicPtr::new(std::ptr::null_mut());

/// The API table, once registered.
pub fn api() -> &'static OrtApi {
    // SAFETY: set by RegisterCustomOps before ONNX Runtime makes any kernel,
    // to a table that lives as long as the runtime.
    unsafe { &*API.load(Ordering::Acquire) }
}

/// An error status for ONNX Runtime, with `message`.
pub fn status(message: &str) -> OrtStatusPtr {
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    // SAFETY: a C string, copied by CreateStatus.
    unsafe { (api().CreateStatus)(OrtErrorCode::ORT_FAIL, text.as_ptr()) }
}

/// Takes ONNX Runtime's API table of [`API_VERSION`] from its API base, for
/// [`api`]; `None` when this runtime is older.
///
/// # Safety
/// `base` is ONNX Runtime's live API base.
pub unsafe fn register(base: *const OrtApiBase) -> Option<&'static OrtApi> {
    // SAFETY: per the contract.
    let table = unsafe { ((*base).GetApi)(API_VERSION) };
    if table.is_null() {
        return None;
    }
    API.store(table.cast_mut(), Ordering::Release);
    Some(api())
}

/// ONNX Runtime's status as an error (released), or nothing.
pub fn checked(status: OrtStatusPtr, what: &str) -> Result<()> {
    if status.0.is_null() {
        return Ok(());
    }
    // SAFETY: a status ONNX Runtime returned, read and released once.
    let message = unsafe {
        let text = CStr::from_ptr((api().GetErrorMessage)(status.0)).to_string_lossy().into_owned();
        (api().ReleaseStatus)(status.0);
        text
    };
    Err(RuntimeError::Internal(format!("ONNX Runtime failed on {what}: {message}")))
}
