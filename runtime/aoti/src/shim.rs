//! `cellc::cellc_rnn`'s C shim: the function AOTInductor's generated code
//! calls for the operator on CPU tensors, with the signature it derives
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
//! of the state sizes]`; the Python package splits it). A failure is
//! written to standard error, as PyTorch's own shims write theirs, and
//! returned as a nonzero code, which the generated code raises.

use crate::torch::{api, Tensor, TensorHandle};
use cellc_runtime::spec::{exported_model, LayoutName, PaddedInference};
use cellc_runtime::{Result, RuntimeError};
use std::ffi::{c_char, CStr};

/// The operator on CPU tensors (see the module's documentation); 0 on
/// success.
///
/// # Safety
/// Called by AOTInductor's generated code as its declaration says: C
/// strings, live tensor handles, `h0_len` and `weights_len` handles at
/// `h0` and `weights`, `lengths` null or a handle's address, and two
/// handles to write.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn aoti_torch_cpu_cellc_rnn(
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
    /// The pass: the new output and final-state tensors.
    ///
    /// # Safety
    /// Every handle is live for the call.
    unsafe fn run(&self) -> Result<(TensorHandle, TensorHandle)> {
        let api = api()?;
        let model = exported_model(&self.spec)?;
        let (major, align) = match LayoutName::parse(&self.layout)? {
            LayoutName::Padded(major, align) => (major, align),
            LayoutName::Packed => {
                return Err(RuntimeError::Internal(
                    "a packed batch in an exported model: give a padded batch and its lengths".into(),
                ))
            }
        };
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
            if self.precision != "f32" {
                return Err(RuntimeError::Internal(format!(
                    "an exported model computes in f32, and this one asks for `{}`",
                    self.precision
                )));
            }
            let lengths = self.lengths.map(|h| api.tensor(h, "lengths", "int64")).transpose()?;
            let read = |handles: &[TensorHandle], name: &str| -> Result<Vec<Tensor>> {
                handles
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| api.tensor(h, &format!("{name}[{i}]"), "float32"))
                    .collect()
            };
            let (h0, weights) = (read(&self.h0, "h0")?, read(&self.weights, "weights")?);
            let call = PaddedInference {
                input: x.floats(),
                dims: [x.shape[0], x.shape[1], x.shape[2]],
                major,
                align,
                lengths: lengths.as_ref().map(|t| t.int64s()),
                h0: h0.iter().map(|t| t.floats()).collect(),
                weights: weights.iter().map(|t| t.floats()).collect(),
            };
            let (out_handle, out) =
                api.empty(&[x.shape[0], x.shape[1], model.output_size()], "the output")?;
            let batch = match major {
                cellc_runtime::Major::BatchFirst => x.shape[0],
                cellc_runtime::Major::TimeFirst => x.shape[1],
            };
            let slots = model.layers().len() * model.directions();
            let sizes = model.layers().first().map(|l| l.state_sizes.clone()).unwrap_or_default();
            let mut states: Vec<Vec<f32>> = sizes.iter().map(|&s| vec![0.0; slots * batch * s]).collect();
            let final_states = states.iter_mut().map(|s| &mut s[..]).collect();
            call.run(&model, out.floats_mut(), final_states)?;
            let width: usize = sizes.iter().sum();
            let (finals_handle, finals) = api.empty(&[slots, batch, width], "the final states")?;
            interleave(&states, &sizes, finals.floats_mut());
            Ok((out_handle, finals_handle))
        }
    }
}

/// The final states, one `[slots, B, size]` block per state, written as
/// one `[slots, B, sum of sizes]` tensor (each row the states in order).
fn interleave(states: &[Vec<f32>], sizes: &[usize], out: &mut [f32]) {
    let width: usize = sizes.iter().sum();
    if width == 0 {
        return;
    }
    for (row, chunk) in out.chunks_mut(width).enumerate() {
        let mut at = 0;
        for (state, &size) in states.iter().zip(sizes) {
            chunk[at..at + size].copy_from_slice(&state[row * size..][..size]);
            at += size;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_states_are_concatenated_along_the_features() {
        // Two rows (slots times batch), states of sizes 2 and 1.
        let states = vec![vec![1.0, 2.0, 3.0, 4.0], vec![5.0, 6.0]];
        let mut out = vec![0.0; 6];
        interleave(&states, &[2, 1], &mut out);
        assert_eq!(out, [1.0, 2.0, 5.0, 3.0, 4.0, 6.0]);
    }

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
