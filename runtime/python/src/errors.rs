//! Runtime errors as the exceptions of `cellc.errors`, each naming the
//! tensor and the shapes where the runtime's error does.

use cellc_runtime::RuntimeError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// The class in `cellc.errors` that stands for `e`.
fn class_name(e: &RuntimeError) -> &'static str {
    match e {
        RuntimeError::Compile(_) | RuntimeError::NoCell { .. } => "CellCompileError",
        RuntimeError::Shape { .. }
        | RuntimeError::MissingWeight { .. }
        | RuntimeError::UnexpectedWeight { .. }
        | RuntimeError::SizeConflict { .. }
        | RuntimeError::UnboundSize { .. }
        | RuntimeError::Layer { .. } => "ShapeError",
        RuntimeError::Length { .. } | RuntimeError::BatchSizes { .. } | RuntimeError::Permutation { .. } => {
            "LengthError"
        }
        RuntimeError::TooLarge { .. } => "TooLargeError",
        RuntimeError::Rate { .. } => "RateError",
        RuntimeError::NotStreamable { .. } | RuntimeError::Backend { .. } | RuntimeError::Io { .. } => {
            "BackendError"
        }
        RuntimeError::Internal(_) | RuntimeError::NoOwnWeights => "InternalError",
    }
}

/// The message of `e` in the terms of the Python API: sizes are bound
/// with `sizes={...}` (or `hidden_size`), not the command line's `-D`.
fn message(e: &RuntimeError) -> String {
    match e {
        RuntimeError::UnboundSize { size } => format!(
            "size `{size}` has no value and cannot be inferred from input_size: pass sizes={{'{size}': N}} \
             (or hidden_size=N where it sizes the state)"
        ),
        RuntimeError::SizeConflict { size, first, first_from, second, second_from } => {
            let from = |s: &str| match s.strip_prefix("-D ") {
                Some(name) => format!("sizes['{name}']"),
                None => s.to_string(),
            };
            format!(
                "size `{size}` is bound two ways: {size}={first} from {}, {size}={second} from {}",
                from(first_from),
                from(second_from)
            )
        }
        other => other.to_string(),
    }
}

/// `e` as a Python exception of `cellc.errors`.
pub fn to_python(py: Python<'_>, e: RuntimeError) -> PyErr {
    let message = message(&e);
    let class = py.import("cellc.errors").and_then(|m| m.getattr(class_name(&e)));
    match class.and_then(|c| c.call1((message.clone(),))) {
        Ok(exception) => PyErr::from_value(exception),
        Err(_) => PyRuntimeError::new_err(message),
    }
}
