//! A `cellc::RNN` node's kernel: its model, made from the node's spec when
//! the session is made, and each run over ONNX Runtime's tensors.

use crate::api::{api, checked};
use cellc_runtime::spec::{exported_model, Exported, LayoutName, PaddedInference, TensorsOn};
use cellc_runtime::{Align, DeviceFloats, DeviceForwardOut, Major, Precision, Result, RuntimeError};
use ort_sys::{OrtKernelContext, OrtKernelInfo, OrtValue};
use std::ffi::{c_char, c_void, CStr};

/// A node's kernel.
#[derive(Debug)]
pub struct Kernel {
    /// The model, on the CPU back end, or on the emulated device where the spec names it.
    exported: Exported,
    major: Major,
    align: Align,
    /// Whether the node's inputs hold the initial states (after `lengths`).
    initial_states: bool,
    /// Each state's size, in the cell's order.
    state_sizes: Vec<usize>,
}

/// A tensor of the node: its dimensions and first element.
struct Tensor {
    dims: Vec<usize>,
    data: *mut c_void,
}

impl Tensor {
    /// `value`'s dimensions and data.
    ///
    /// # Safety
    /// `value` is a live tensor of ONNX Runtime's.
    unsafe fn of(value: *const OrtValue, name: &str) -> Result<Tensor> {
        let api = api();
        // SAFETY (block): per the contract; the shape information is released once read.
        unsafe {
            let mut info = std::ptr::null_mut();
            checked((api.GetTensorTypeAndShape)(value, &mut info), name)?;
            let mut count = 0usize;
            let read = checked((api.GetDimensionsCount)(info, &mut count), name).and_then(|()| {
                let mut dims = vec![0i64; count];
                checked((api.GetDimensions)(info, dims.as_mut_ptr(), count), name)?;
                Ok(dims)
            });
            (api.ReleaseTensorTypeAndShapeInfo)(info);
            let dims = read?.into_iter().map(|d| usize::try_from(d).unwrap_or(0)).collect();
            let mut data = std::ptr::null_mut();
            checked((api.GetTensorMutableData)(value.cast_mut(), &mut data), name)?;
            Ok(Tensor { dims, data })
        }
    }

    fn elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// # Safety
    /// A float tensor, alive and unwritten while the slice is.
    unsafe fn floats<'a>(&self) -> &'a [f32] {
        if self.elements() == 0 {
            return &[];
        }
        // SAFETY: per the contract.
        unsafe { std::slice::from_raw_parts(self.data.cast::<f32>(), self.elements()) }
    }

    /// # Safety
    /// A float tensor no other slice of is alive.
    unsafe fn floats_mut<'a>(&self) -> &'a mut [f32] {
        if self.elements() == 0 {
            return &mut [];
        }
        // SAFETY: per the contract.
        unsafe { std::slice::from_raw_parts_mut(self.data.cast::<f32>(), self.elements()) }
    }

    /// # Safety
    /// An int64 tensor, alive while the slice is.
    unsafe fn int64s<'a>(&self) -> &'a [i64] {
        if self.elements() == 0 {
            return &[];
        }
        // SAFETY: per the contract.
        unsafe { std::slice::from_raw_parts(self.data.cast::<i64>(), self.elements()) }
    }
}

/// The node's string attribute `name`.
///
/// # Safety
/// `info` is ONNX Runtime's live kernel info.
unsafe fn string_attribute(info: *const OrtKernelInfo, name: &CStr) -> Result<String> {
    let api = api();
    let what = format!("the attribute `{}`", name.to_string_lossy());
    let mut size = 0usize;
    // SAFETY (block): per the contract: the size first, then the bytes.
    unsafe {
        checked(
            (api.KernelInfoGetAttribute_string)(info, name.as_ptr(), std::ptr::null_mut(), &mut size),
            &what,
        )?;
        let mut bytes = vec![0u8; size];
        checked(
            (api.KernelInfoGetAttribute_string)(
                info,
                name.as_ptr(),
                bytes.as_mut_ptr().cast::<c_char>(),
                &mut size,
            ),
            &what,
        )?;
        let text =
            CStr::from_bytes_until_nul(&bytes).map_err(|e| RuntimeError::Internal(format!("{what}: {e}")))?;
        Ok(text.to_string_lossy().into_owned())
    }
}

impl Kernel {
    /// The kernel of the node `info` describes: its model compiled from the spec.
    ///
    /// # Safety
    /// `info` is ONNX Runtime's live kernel info.
    pub unsafe fn new(info: *const OrtKernelInfo) -> Result<Kernel> {
        // SAFETY (block): per the contract.
        unsafe {
            let spec = string_attribute(info, c"spec")?;
            let layout = string_attribute(info, c"layout")?;
            let mut initial_states = 0i64;
            checked(
                (api().KernelInfoGetAttribute_int64)(info, c"initial_states".as_ptr(), &mut initial_states),
                "the attribute `initial_states`",
            )?;
            let exported = exported_model(&spec, TensorsOn::Cpu)?;
            let (major, align) = match LayoutName::parse(&layout)? {
                LayoutName::Padded(major, align) => (major, align),
                LayoutName::Packed => {
                    return Err(RuntimeError::Internal("a packed layout in an exported node".into()));
                }
            };
            let state_sizes =
                exported.model.layers().first().map(|l| l.state_sizes.clone()).unwrap_or_default();
            Ok(Kernel { exported, major, align, initial_states: initial_states != 0, state_sizes })
        }
    }

    /// One run: reads the node's inputs, writes its outputs.
    ///
    /// # Safety
    /// `context` is ONNX Runtime's live context for this kernel's run.
    pub unsafe fn compute(&self, context: *mut OrtKernelContext) -> Result<()> {
        let api = api();
        // SAFETY (block): per the contract; inputs are read, outputs are fresh.
        unsafe {
            let mut count = 0usize;
            checked((api.KernelContext_GetInputCount)(context, &mut count), "the input count")?;
            let input = |i: usize, name: &str| -> Result<Option<Tensor>> {
                let mut value: *const OrtValue = std::ptr::null();
                checked((api.KernelContext_GetInput)(context, i, &mut value), name)?;
                if value.is_null() {
                    return Ok(None);
                }
                Tensor::of(value, name).map(Some)
            };
            let x = input(0, "X")?.ok_or_else(|| RuntimeError::Internal("no input X".into()))?;
            if x.dims.len() != 3 {
                return Err(RuntimeError::Shape {
                    tensor: "X".into(),
                    expected: "3 dimensions (a padded batch)".into(),
                    found: format!("{:?}", x.dims),
                });
            }
            let lengths = if count > 1 { input(1, "lengths")? } else { None };
            let states = if self.initial_states { self.state_sizes.len() } else { 0 };
            let mut floats = Vec::new();
            for i in 2..count {
                let t = input(i, &format!("input {i}"))?
                    .ok_or_else(|| RuntimeError::Internal(format!("input {i} is absent")))?;
                floats.push(t);
            }
            if floats.len() < states {
                return Err(RuntimeError::Internal(format!(
                    "{} initial states expected, {} float inputs given",
                    states,
                    floats.len()
                )));
            }
            let (h0, weights) = floats.split_at(states);
            let output = |i: usize, dims: &[usize], name: &str| -> Result<Tensor> {
                let dims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
                let mut value = std::ptr::null_mut();
                checked(
                    (api.KernelContext_GetOutput)(context, i, dims.as_ptr(), dims.len(), &mut value),
                    name,
                )?;
                Tensor::of(value, name)
            };
            let model = &self.exported.model;
            let y = output(0, &[x.dims[0], x.dims[1], model.output_size()], "Y")?;
            let call = PaddedInference {
                input: x.floats(),
                dims: [x.dims[0], x.dims[1], x.dims[2]],
                major: self.major,
                align: self.align,
                lengths: lengths.as_ref().map(|t| t.int64s()),
                h0: h0.iter().map(|t| t.floats()).collect(),
                weights: weights.iter().map(|t| t.floats()).collect(),
            };
            let (batch, _) = call.batch_and_steps();
            let slots = model.layers().len() * model.directions();
            let finals = self
                .state_sizes
                .iter()
                .enumerate()
                .map(|(i, &size)| output(1 + i, &[slots, batch, size], "a final state"))
                .collect::<Result<Vec<_>>>()?;
            if !self.exported.device_memory {
                return call.run(model, y.floats_mut(), finals.iter().map(|t| t.floats_mut()).collect());
            }
            // The emulated device, whose memory is the host's: the same tensors as its device memory.
            let on_device = PaddedInference {
                input: DeviceFloats::emulated(call.input),
                dims: call.dims,
                major: call.major,
                align: call.align,
                lengths: call.lengths,
                h0: call.h0.iter().map(|h| DeviceFloats::emulated(h)).collect(),
                weights: call.weights.iter().map(|w| DeviceFloats::emulated(w)).collect(),
            };
            let out = DeviceForwardOut {
                output: DeviceFloats::emulated_mut(y.floats_mut()),
                final_states: finals.iter().map(|t| DeviceFloats::emulated_mut(t.floats_mut())).collect(),
            };
            on_device.run_on_device(model, 0, Precision::F32, &out)
        }
    }
}
