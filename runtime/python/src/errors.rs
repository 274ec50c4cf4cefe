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
        RuntimeError::NotStreamable { .. } | RuntimeError::Backend { .. } | RuntimeError::Io { .. } => {
            "BackendError"
        }
        RuntimeError::Internal(_) => "InternalError",
    }
}

/// `e` as a Python exception of `cellc.errors`.
pub fn to_python(py: Python<'_>, e: RuntimeError) -> PyErr {
    let message = e.to_string();
    let class = py.import("cellc.errors").and_then(|m| m.getattr(class_name(&e)));
    match class.and_then(|c| c.call1((message.clone(),))) {
        Ok(exception) => PyErr::from_value(exception),
        Err(_) => PyRuntimeError::new_err(message),
    }
}
