//! `cellc::cellc_rnn`'s C shims: the functions AOTInductor's generated code
//! calls for the operator on CPU tensors (`aoti_torch_cpu_cellc_rnn`) and on
//! CUDA tensors (`aoti_torch_cuda_cellc_rnn`), with the signature it derives
//! from the operator's schema
//! (`cellc_rnn(str spec, str layout, Tensor x, Tensor? lengths, Tensor[] h0,
//! Tensor[] weights, str precision) -> (Tensor, Tensor)`): strings as C
//! strings, an optional tensor as a pointer to a handle (null: none), a
//! list as a pointer and a length, each output a handle to write.
//!
//! The spec comes base64-encoded: AOTInductor writes a string argument
//! into its generated C++ unescaped, and the JSON's quotes and the cell's
//! newlines would end the literal.
//!
//! An inference pass over a padded batch: the output, and every final
//! state concatenated along the features (`[layers * directions, B, sum
//! of the state sizes]`; the Python package splits it). CPU tensors run on
//! the CPU back end (or on the emulated device, where the model was
//! exported for it); CUDA tensors on the CUDA back end of their device,
//! queued on PyTorch's current stream there, with no host wait
//! ([`exported_model`]). A failure is
//! written to standard error, as PyTorch's own shims write theirs, and
//! returned as a nonzero code, which the generated code raises.

use crate::torch::{api, Tensor, TensorHandle};
use cellc_runtime::spec::{exported_model, exported_spec, LayoutName, PaddedInference, TensorsOn};
use cellc_runtime::{DeviceForwardOut, Major, Precision, Result, RuntimeError};
use std::ffi::{c_char, CStr};

/// Defines a C shim of the operator by `name`: AOTInductor derives the name
/// from the graph's device (`aoti_torch_{device}_cellc_rnn`), and both take
/// the same arguments and run the same body, the tensors' device deciding
/// where the pass runs.
macro_rules! shim {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// Called by AOTInductor's generated code as its declaration says: C
        /// strings, live tensor handles, `h0_len` and `weights_len` handles at
        /// `h0` and `weights`, `lengths` null or a handle's address, and two
        /// handles to write.
        #[no_mangle]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "C" fn $name(
            spec: *const c_char,
            layout: *const c_char,
            x: TensorHandle,
            lengths: *mut TensorHandle,
            h0: *const TensorHandle,
            h0_len: i64,
            weights: *const TensorHandle,
            weights_len: i64,
            precision: *const c_char,
            output: *mut TensorHandle,
            finals: *mut TensorHandle,
        ) -> i32 {
            // SAFETY: per the contract.
            unsafe {
                cellc_rnn(spec, layout, x, lengths, (h0, h0_len), (weights, weights_len), precision, output, finals)
            }
        }
    };
}

shim!(
    /// The operator on CPU tensors (see the module's documentation); 0 on success.
    aoti_torch_cpu_cellc_rnn
);
shim!(
    /// The operator on CUDA tensors (see the module's documentation); 0 on success.
    aoti_torch_cuda_cellc_rnn
);

/// Both shims' body: the arguments read, the pass run, a failure written
/// to standard error and returned as 1.
///
/// # Safety
/// As for [`aoti_torch_cpu_cellc_rnn`].
#[allow(clippy::too_many_arguments)]
unsafe fn cellc_rnn(
    spec: *const c_char,
    layout: *const c_char,
    x: TensorHandle,
    lengths: *mut TensorHandle,
    (h0, h0_len): (*const TensorHandle, i64),
    (weights, weights_len): (*const TensorHandle, i64),
    precision: *const c_char,
    output: *mut TensorHandle,
    finals: *mut TensorHandle,
) -> i32 {
    let run = || -> Result<()> {
        // SAFETY (block): per the contract.
        unsafe {
            let text = |p: *const c_char, what: &str| -> Result<String> {
                if p.is_null() {
                    return Err(RuntimeError::Internal(format!("no `{what}` string")));
                }
                Ok(CStr::from_ptr(p).to_string_lossy().into_owned())
            };
            let list = |p: *const TensorHandle, n: i64| -> Vec<TensorHandle> {
                if p.is_null() || n <= 0 {
                    Vec::new()
                } else {
                    std::slice::from_raw_parts(p, n as usize).to_vec()
                }
            };
            let args = Args {
                spec: decoded(&text(spec, "spec")?)?,
                layout: text(layout, "layout")?,
                x,
                lengths: (!lengths.is_null()).then(|| *lengths),
                h0: list(h0, h0_len),
                weights: list(weights, weights_len),
                precision: text(precision, "precision")?,
            };
            let (out, fin) = args.run()?;
            *output = out;
            *finals = fin;
        }
        Ok(())
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            eprintln!("cellc::cellc_rnn: {e}");
            1
        }
        Err(_) => {
            eprintln!("cellc::cellc_rnn: panicked (a bug in cellc)");
            1
        }
    }
}

/// One call's arguments.
struct Args {
    spec: String,
    layout: String,
    x: TensorHandle,
    lengths: Option<TensorHandle>,
    h0: Vec<TensorHandle>,
    weights: Vec<TensorHandle>,
    precision: String,
}

/// The spec text of its base64 encoding.
fn decoded(encoded: &str) -> Result<String> {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|e| RuntimeError::Internal(format!("the model's spec is not base64: {e}")))?;
    String::from_utf8(bytes)
        .map_err(|e| RuntimeError::Internal(format!("the model's spec is not UTF-8: {e}")))
}

impl Args {
    /// The pass: the new output and final-state tensors, on the input's device.
    ///
    /// # Safety
    /// Every handle is live for the call.
    unsafe fn run(&self) -> Result<(TensorHandle, TensorHandle)> {
        let api = api()?;
        let (major, align) = match LayoutName::parse(&self.layout)? {
            LayoutName::Padded(major, align) => (major, align),
            LayoutName::Packed => {
                return Err(RuntimeError::Internal(
                    "a packed batch in an exported model: give a padded batch and its lengths".into(),
                ))
            }
        };
        // The spec first: one of another cellc version is refused before any tensor is read.
        exported_spec(&self.spec)?;
        if self.x.is_null() {
            return Err(RuntimeError::Internal("no `input` tensor".into()));
        }
        // SAFETY (block): live handles, per the contract; the inputs are
        // only read, and the outputs are fresh tensors.
        unsafe {
            let x = api.tensor(self.x, "input", "float32")?;
            if x.shape.len() != 3 {
                return Err(RuntimeError::Shape {
                    tensor: "input".into(),
                    expected: "3 dimensions (a padded batch)".into(),
                    found: format!("{:?}", x.shape),
                });
            }
            let exported = exported_model(&self.spec, x.on)?;
            let model = &exported.model;
            let lengths = self.lengths.map(|h| api.tensor(h, "lengths", "int64")).transpose()?;
            if let Some(t) = lengths.as_ref().filter(|t| t.on != TensorsOn::Cpu) {
                return Err(device_error("lengths", "on the CPU", t.on));
            }
            let read = |handles: &[TensorHandle], name: &str| -> Result<Vec<Tensor>> {
                handles
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| {
                        let name = format!("{name}[{i}]");
                        let t = api.tensor(h, &name, "float32")?;
                        if t.on != x.on {
                            return Err(device_error(
                                &name,
                                &format!("on the input's device ({:?})", x.on),
                                t.on,
                            ));
                        }
                        Ok(t)
                    })
                    .collect()
            };
            let (h0, weights) = (read(&self.h0, "h0")?, read(&self.weights, "weights")?);
            let dims = [x.shape[0], x.shape[1], x.shape[2]];
            let batch = if major == Major::BatchFirst { dims[0] } else { dims[1] };
            let slots = model.layers().len() * model.directions();
            let sizes = model.layers().first().map(|l| l.state_sizes.clone()).unwrap_or_default();
            let (out_handle, out) =
                api.empty(&[dims[0], dims[1], model.output_size()], x.on, "the output")?;
            let mut states = Vec::with_capacity(sizes.len());
            let mut made = Ok(());
            for &size in &sizes {
                match api.empty(&[slots, batch, size], x.on, "a final state") {
                    Ok(state) => states.push(state),
                    Err(e) => {
                        made = Err(e);
                        break;
                    }
                }
            }
            let lengths = lengths.as_ref().map(|t| t.int64s());
            let ran = made.and_then(|()| {
                if exported.device_memory {
                    let precision = self.precision.parse::<Precision>().map_err(RuntimeError::Internal)?;
                    let stream = match x.on {
                        TensorsOn::Cuda(ordinal) => api.current_stream(ordinal)?,
                        TensorsOn::Cpu => 0,
                    };
                    let call = PaddedInference {
                        input: x.device_floats(),
                        dims,
                        major,
                        align,
                        lengths,
                        h0: h0.iter().map(Tensor::device_floats).collect(),
                        weights: weights.iter().map(Tensor::device_floats).collect(),
                    };
                    let out = DeviceForwardOut {
                        output: out.device_floats(),
                        final_states: states.iter().map(|(_, t)| t.device_floats()).collect(),
                    };
                    call.run_on_device(model, stream, precision, &out)
                } else if self.precision != "f32" {
                    Err(RuntimeError::Internal(format!(
                        "an exported model on the CPU computes in f32, and this one asks for `{}`",
                        self.precision
                    )))
                } else {
                    let call = PaddedInference {
                        input: x.floats(),
                        dims,
                        major,
                        align,
                        lengths,
                        h0: h0.iter().map(|t| t.floats()).collect(),
                        weights: weights.iter().map(|t| t.floats()).collect(),
                    };
                    call.run(model, out.floats_mut(), states.iter().map(|(_, t)| t.floats_mut()).collect())
                }
            });
            // The states joined on their device, and every tensor made here released
            // but the ones handed back.
            let handles: Vec<TensorHandle> = states.iter().map(|&(h, _)| h).collect();
            let joined = ran.and_then(|()| api.cat(&handles, 2, x.on, "the final states"));
            for &h in &handles {
                api.delete(h);
            }
            if joined.is_err() {
                api.delete(out_handle);
            }
            Ok((out_handle, joined?))
        }
    }
}

/// A tensor on the wrong device, as an error naming it.
fn device_error(name: &str, expected: &str, found: TensorsOn) -> RuntimeError {
    RuntimeError::Shape {
        tensor: name.to_string(),
        expected: expected.to_string(),
        found: format!("{found:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_libtorch_is_an_error_not_a_crash() {
        // No libtorch in the test process: the call fails with a nonzero code.
        let (mut out, mut fin) = (std::ptr::null_mut(), std::ptr::null_mut());
        let spec = c"e30="; // "{}"
                            // SAFETY: C strings, no tensors (the call fails before reading any).
        let code = unsafe {
            aoti_torch_cpu_cellc_rnn(
                spec.as_ptr(),
                c"batch_first/left".as_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null(),
                0,
                std::ptr::null(),
                0,
                c"f32".as_ptr(),
                &mut out,
                &mut fin,
            )
        };
        assert_eq!(code, 1);
        assert!(out.is_null() && fin.is_null());
    }
}
