//! The `cellc::RNN` operator's declaration to ONNX Runtime (`OrtCustomOp`,
//! version 17 of its C API) and the library's entry point.
//!
//! Inputs, by position: `X` (float), `lengths` (int64, optional), then a
//! variadic list of floats: the initial states when the node's
//! `initial_states` attribute says so (one per state of the cell), then
//! every weight. Outputs: `Y`, then one final state per state of the cell
//! (variadic floats).

use crate::api::{register, status, API_VERSION};
use crate::kernel::Kernel;
use ort_sys::{
    ONNXTensorElementDataType, OrtApi, OrtApiBase, OrtCustomOp, OrtCustomOpDomain,
    OrtCustomOpInputOutputCharacteristic as Characteristic, OrtKernelContext, OrtKernelInfo, OrtMemType,
    OrtSessionOptions, OrtStatus, OrtStatusPtr,
};
use std::ffi::{c_char, c_int, c_void};

/// Adds the `cellc` domain with its `RNN` operator to a session's options.
///
/// # Safety
/// Called by ONNX Runtime with live session options and its API base.
#[no_mangle]
pub unsafe extern "C" fn RegisterCustomOps(
    options: *mut OrtSessionOptions,
    base: *const OrtApiBase,
) -> *mut OrtStatus {
    // SAFETY (block): ONNX Runtime's API base and options, per the contract.
    unsafe {
        let Some(api) = register(base) else {
            // No API to make a status with: said here, and the session then finds no
            // `cellc::RNN` operator.
            eprintln!("cellc: this ONNX Runtime has no version {API_VERSION} of its C API (1.17 or later is needed)");
            return std::ptr::null_mut();
        };
        let mut domain: *mut OrtCustomOpDomain = std::ptr::null_mut();
        let created = (api.CreateCustomOpDomain)(c"cellc".as_ptr(), &mut domain);
        if !created.0.is_null() {
            return created.0;
        }
        // The domain lives as long as the sessions that use it: never released.
        let added = (api.CustomOpDomain_Add)(domain, &OP);
        if !added.0.is_null() {
            return added.0;
        }
        (api.AddCustomOpDomain)(options, domain).0
    }
}

/// The operator.
static OP: OrtCustomOp = OrtCustomOp {
    version: API_VERSION,
    CreateKernel: None,
    GetName: Some(name),
    GetExecutionProviderType: Some(provider),
    GetInputType: Some(input_type),
    GetInputTypeCount: Some(three),
    GetOutputType: Some(output_type),
    GetOutputTypeCount: Some(two),
    KernelCompute: None,
    KernelDestroy: Some(destroy),
    GetInputCharacteristic: Some(input_characteristic),
    GetOutputCharacteristic: Some(output_characteristic),
    GetInputMemoryType: Some(memory_type),
    GetVariadicInputMinArity: Some(one),
    GetVariadicInputHomogeneity: Some(one),
    GetVariadicOutputMinArity: Some(one),
    GetVariadicOutputHomogeneity: Some(one),
    CreateKernelV2: Some(create),
    KernelComputeV2: Some(compute),
    InferOutputShapeFn: None,
    GetStartVersion: None,
    GetEndVersion: None,
};

unsafe extern "system" fn name(_: *const OrtCustomOp) -> *const c_char {
    c"RNN".as_ptr()
}

unsafe extern "system" fn provider(_: *const OrtCustomOp) -> *const c_char {
    // CPU: ONNX Runtime's default execution provider.
    std::ptr::null()
}

unsafe extern "system" fn three(_: *const OrtCustomOp) -> usize {
    3
}

unsafe extern "system" fn two(_: *const OrtCustomOp) -> usize {
    2
}

unsafe extern "system" fn one(_: *const OrtCustomOp) -> c_int {
    1
}

unsafe extern "system" fn input_type(_: *const OrtCustomOp, index: usize) -> ONNXTensorElementDataType {
    if index == 1 {
        ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
    } else {
        ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
    }
}

unsafe extern "system" fn output_type(_: *const OrtCustomOp, _: usize) -> ONNXTensorElementDataType {
    ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
}

unsafe extern "system" fn input_characteristic(_: *const OrtCustomOp, index: usize) -> Characteristic {
    match index {
        0 => Characteristic::INPUT_OUTPUT_REQUIRED,
        1 => Characteristic::INPUT_OUTPUT_OPTIONAL,
        _ => Characteristic::INPUT_OUTPUT_VARIADIC,
    }
}

unsafe extern "system" fn output_characteristic(_: *const OrtCustomOp, index: usize) -> Characteristic {
    if index == 0 {
        Characteristic::INPUT_OUTPUT_REQUIRED
    } else {
        Characteristic::INPUT_OUTPUT_VARIADIC
    }
}

unsafe extern "system" fn memory_type(_: *const OrtCustomOp, _: usize) -> OrtMemType {
    OrtMemType::OrtMemTypeDefault
}

unsafe extern "system" fn create(
    _: *const OrtCustomOp,
    _: *const OrtApi,
    info: *const OrtKernelInfo,
    kernel: *mut *mut c_void,
) -> OrtStatusPtr {
    let made = std::panic::catch_unwind(|| {
        // SAFETY: ONNX Runtime's kernel info, live for the call.
        unsafe { Kernel::new(info) }
    });
    match made {
        Ok(Ok(k)) => {
            // SAFETY: ONNX Runtime's pointer to write the kernel to.
            unsafe { *kernel = Box::into_raw(Box::new(k)).cast() };
            OrtStatusPtr::default()
        }
        Ok(Err(e)) => status(&format!("cellc::RNN: {e}")),
        Err(_) => status("cellc::RNN: panicked making the kernel (a bug in cellc)"),
    }
}

unsafe extern "system" fn compute(kernel: *mut c_void, context: *mut OrtKernelContext) -> OrtStatusPtr {
    // SAFETY: a kernel `create` made, and ONNX Runtime's context for this run.
    let done = std::panic::catch_unwind(|| unsafe { (*kernel.cast::<Kernel>()).compute(context) });
    match done {
        Ok(Ok(())) => OrtStatusPtr::default(),
        Ok(Err(e)) => status(&format!("cellc::RNN: {e}")),
        Err(_) => status("cellc::RNN: panicked (a bug in cellc)"),
    }
}

unsafe extern "system" fn destroy(kernel: *mut c_void) {
    if !kernel.is_null() {
        // SAFETY: a kernel `create` boxed, destroyed once by ONNX Runtime.
        drop(unsafe { Box::from_raw(kernel.cast::<Kernel>()) });
    }
}
