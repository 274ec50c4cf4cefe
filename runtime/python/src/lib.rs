//! `cellc._cellc`: the Rust half of the `cellc` Python package.
//!
//! The Python half (`python/cellc`) owns the tensors: it allocates every
//! output with PyTorch's allocator, checks dtype, device, contiguity and
//! shapes, and hands this module each tensor as its address and shape.
//! Here those become slices the runtime reads and writes in place
//! ([`cellc_runtime::Call`], [`cellc_runtime::Model::forward_into`]),
//! with the interpreter lock released. Models are found by their spec, a
//! JSON text of the cell and its configuration ([`spec`]), and made once:
//! the operators themselves keep no state, since the weights and the
//! reserve the backward reads travel as tensors.

mod errors;
mod exact;
mod fast;
mod passes;
mod recycled;
mod spec;
mod tensors;

// AOTInductor's generated code calls them by name once this extension's
// symbols are global (cellc._ops promotes them at import).
pub use cellc_aoti::{aoti_torch_cpu_cellc_rnn, aoti_torch_cuda_cellc_rnn};
// ONNX Runtime finds it by name in the library `cellc.onnx_library()` names.
pub use cellc_onnx::RegisterCustomOps;
use cellc_runtime::backend::cpu::threads;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The cells shipped in the repository's `cells/` folder: `(name, source)`.
const SHIPPED_CELLS: &[(&str, &str)] = include!(concat!(env!("OUT_DIR"), "/shipped_cells.rs"));

/// The source of a shipped cell, by name (`"lstm"`), or `None`.
#[pyfunction]
fn shipped_cell(name: &str) -> Option<&'static str> {
    SHIPPED_CELLS.iter().find(|(n, _)| *n == name).map(|(_, source)| *source)
}

/// The names of the cells that ship with cellc (its `cells/` folder), which
/// `cellc.RNN` takes in place of a path or source text.
///
/// Returns:
///     list[str]: the names, in alphabetical order, such as ``"lstm"``.
#[pyfunction]
fn shipped_cells() -> Vec<&'static str> {
    SHIPPED_CELLS.iter().map(|(n, _)| *n).collect()
}

/// What the Python module needs to know of a model: its weights' names
/// and shapes, its states' names and sizes, its input and output sizes,
/// and the reserve a training forward keeps per layout row (`None` where
/// the back end keeps its tapes itself).
#[pyfunction]
fn describe(py: Python<'_>, spec: &str) -> PyResult<spec::Description> {
    py.detach(|| spec::describe(spec)).map_err(|e| errors::to_python(py, e))
}

/// The weights the cell's `init` clauses give for `seed`, in
/// [`describe`]'s order, each as little-endian f32 bytes.
#[pyfunction]
fn initial_weights<'py>(py: Python<'py>, spec: &str, seed: u64) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let weights = py.detach(|| spec::initial_weights(spec, seed)).map_err(|e| errors::to_python(py, e))?;
    Ok(weights
        .iter()
        .map(|w| {
            let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            PyBytes::new(py, &bytes)
        })
        .collect())
}

/// Runs this process's CPU calls on `team`: `"openmp"`, the OpenMP
/// runtime already loaded (PyTorch's), or `"cellc"`, cellc's own pool.
/// Returns the team now in use (`"cellc"` where no OpenMP runtime is loaded).
#[pyfunction]
fn set_threading(team: &str) -> PyResult<&'static str> {
    match team {
        "openmp" => {
            threads::use_openmp();
        }
        "cellc" => threads::use_own_pool(),
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "threading must be 'openmp' or 'cellc', not {other:?}"
            )))
        }
    }
    Ok(threads::team_name())
}

/// `(team, threads)`: the team this process's CPU calls run on now, and
/// the most threads a call may use here (the usable cores: the affinity
/// mask and the cgroup's CPU quota).
#[pyfunction]
fn threading() -> (&'static str, usize) {
    (threads::team_name(), threads::usable_cores())
}

/// `(sizes, hidden)`: a cell's size variables, and the one its first
/// state's size is alone (what `hidden_size` binds), or `None`.
#[pyfunction]
#[pyo3(signature = (file, source, cell=None))]
fn cell_sizes(
    py: Python<'_>,
    file: &str,
    source: &str,
    cell: Option<&str>,
) -> PyResult<(Vec<String>, Option<String>)> {
    py.detach(|| spec::cell_sizes(file, source, cell)).map_err(|e| errors::to_python(py, e))
}

/// Each weight's initialiser, `(kind, value)`, in [`describe`]'s order.
#[pyfunction]
fn param_inits(py: Python<'_>, spec: &str) -> PyResult<Vec<(&'static str, f64)>> {
    py.detach(|| spec::param_inits(spec)).map_err(|e| errors::to_python(py, e))
}

/// `(specs, models)` held by live modules (for tests).
#[pyfunction]
fn held_models() -> (usize, usize) {
    spec::held_counts()
}

#[pymodule]
fn _cellc(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<spec::Handle>()?;
    m.add_class::<fast::Eager>()?;
    m.add("MOST_CELL_BYTES", cellc_runtime::MOST_CELL_BYTES)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(set_threading, m)?)?;
    m.add_function(wrap_pyfunction!(threading, m)?)?;
    m.add_function(wrap_pyfunction!(held_models, m)?)?;
    m.add_function(wrap_pyfunction!(cell_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(param_inits, m)?)?;
    m.add_function(wrap_pyfunction!(shipped_cell, m)?)?;
    m.add_function(wrap_pyfunction!(shipped_cells, m)?)?;
    m.add_function(wrap_pyfunction!(describe, m)?)?;
    m.add_function(wrap_pyfunction!(initial_weights, m)?)?;
    m.add_function(wrap_pyfunction!(passes::forward, m)?)?;
    m.add_function(wrap_pyfunction!(passes::backward, m)?)?;
    m.add_function(wrap_pyfunction!(passes::dropout_masks, m)?)?;
    m.add_function(wrap_pyfunction!(passes::cell_masks, m)?)?;
    m.add_function(wrap_pyfunction!(recycled::recycled_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(exact::exact_pass, m)?)?;
    Ok(())
}
