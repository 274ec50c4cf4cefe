//! Models by spec: the JSON text the Python module writes once for a
//! `cellc.RNN` (the cell's source and its configuration), and the models
//! made from it, once per spec and device, kept while a module holds the
//! spec ([`Handle`]).
//!
//! The models keep no weights (the module's parameters come with every
//! call) and share the process's one team of threads; the thread count is
//! the caller's, per call. When the last module of a spec is deleted, its
//! models go, and with them the memory kept for reuse.

use cellc_runtime::backend::reference::Reference;
use cellc_runtime::spec::{Backend, ModelSpec};
use cellc_runtime::{CompiledCell, Model, Result};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The models of the specs that modules hold: per spec, how many
/// [`Handle`]s hold it and its model per device (the CPU's at 0).
struct Held {
    handles: usize,
    models: HashMap<usize, Arc<Model>>,
}

fn held() -> std::sync::MutexGuard<'static, HashMap<String, Held>> {
    static HELD: OnceLock<Mutex<HashMap<String, Held>>> = OnceLock::new();
    HELD.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// The model for `spec` on CUDA device `device` (0 for the CPU), made on
/// first use and kept while a module holds the spec; without one (an
/// operator called directly), made for the call alone. Its calls ask for
/// their own precision.
pub fn model(spec: &str, device: usize) -> Result<Arc<Model>> {
    let mut held = held();
    if let Some(entry) = held.get_mut(spec) {
        if let Some(m) = entry.models.get(&device) {
            return Ok(m.clone());
        }
        let model = Arc::new(unshared_model(spec, device)?);
        entry.models.insert(device, model.clone());
        return Ok(model);
    }
    drop(held);
    Ok(Arc::new(unshared_model(spec, device)?))
}

/// A model of `spec` on device `device` of its back end (0 for the CPU),
/// made now and not kept with the spec's models: what [`model`] keeps, or
/// one given weights of its own (a module's frozen calls, [`crate::fast`]).
pub fn unshared_model(spec: &str, device: usize) -> Result<Model> {
    let parsed = ModelSpec::parse(spec)?;
    parsed.model(parsed.backend.device(device)?)
}

/// A module's hold on its spec's models: they live while some handle of
/// the spec does. Dropping a spec's last handle frees its models and gives
/// the memory kept for reuse back to the system.
#[pyclass(module = "cellc._cellc", frozen)]
#[derive(Debug)]
pub struct Handle {
    spec: String,
}

#[pymethods]
impl Handle {
    #[new]
    fn new(spec: String) -> Handle {
        held().entry(spec.clone()).or_insert_with(|| Held { handles: 0, models: HashMap::new() }).handles +=
            1;
        Handle { spec }
    }

    /// Pickled and deep-copied as its spec: a copy holds the spec too.
    fn __reduce__(&self, py: Python<'_>) -> PyResult<(Py<PyAny>, (String,))> {
        Ok((py.get_type::<Handle>().into_any().unbind(), (self.spec.clone(),)))
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let mut held = held();
        let gone = match held.get_mut(&self.spec) {
            Some(entry) => {
                entry.handles -= 1;
                entry.handles == 0
            }
            None => false,
        };
        // Dropped outside the lock: freeing a model may take a while.
        let freed = if gone { held.remove(&self.spec) } else { None };
        drop(held);
        if let Some(freed) = freed {
            drop(freed);
            // The buffers kept for reuse were sized by the models that ran, this one among them:
            // they go back to the system with it (the models still held make theirs again at
            // their next call), so that a process that makes and deletes models of many sizes
            // keeps none of theirs.
            cellc_runtime::release_memory();
        }
    }
}

/// The number of specs held and of models made for them (for tests).
pub fn held_counts() -> (usize, usize) {
    let held = held();
    (held.len(), held.values().map(|h| h.models.len()).sum())
}

/// What `spec`'s model is ([`Description`]), without opening a device:
/// the CPU model itself (made and kept while the spec is held) for its
/// reserve's size; the other back ends keep their tapes themselves, so a
/// reference model describes them.
pub fn describe(text: &str) -> Result<Description> {
    let spec = ModelSpec::parse(text)?;
    match spec.backend {
        Backend::Cpu => Description::of(&*model(text, 0)?, spec.backend),
        Backend::Reference | Backend::Cuda | Backend::CudaEmulated => {
            Description::of(&spec.model(Box::new(Reference))?, spec.backend)
        }
    }
}

/// The parameters the cell's `init` clauses give for `seed`, in the order of [`Model::weight_names`].
pub fn initial_weights(spec: &str, seed: u64) -> Result<Vec<Vec<f32>>> {
    // Initialisation does not depend on the back end: the reference one
    // starts no threads and opens no device.
    let spec = ModelSpec::parse(spec)?;
    let mut model = Model::new(
        spec.compiled()?,
        spec.config()?,
        &spec.sizes,
        Some(spec.input_size),
        None,
        seed,
        Box::new(Reference),
    )?;
    Ok(model.params_mut().iter_mut().flatten().map(std::mem::take).collect())
}

/// The size variables of a cell (in order of first appearance) and the
/// one that sizes its first state alone (`H` for an LSTM: what
/// `nn.LSTM`'s `hidden_size` binds), if there is one.
pub fn cell_sizes(file: &str, source: &str, cell: Option<&str>) -> Result<(Vec<String>, Option<String>)> {
    // The declarations are all it needs: the backward is derived once, by the model.
    let cell = CompiledCell::checked(file, source, cell)?;
    let hidden = cell.states.first().and_then(|s| match s.dim.variables().as_slice() {
        [v] if s.dim == cellc::dims::Dim::var(v) => Some(v.clone()),
        _ => None,
    });
    Ok((cell.sizes, hidden))
}

/// Each weight's initialiser as the cell's `init` clause gives it, in
/// [`Model::weight_names`]' order: `("uniform", bound)`, `("constant", v)`,
/// `("zeros", 0)` or `("ones", 1)`.
pub fn param_inits(text: &str) -> Result<Vec<(&'static str, f64)>> {
    use cellc::interp::ConcreteInit;
    let model = ModelSpec::parse(text)?.model(Box::new(Reference))?;
    Ok(model
        .param_inits()?
        .iter()
        .flatten()
        .map(|init| match *init {
            ConcreteInit::Zeros => ("zeros", 0.0),
            ConcreteInit::Ones => ("ones", 1.0),
            ConcreteInit::Uniform(b) => ("uniform", b),
            ConcreteInit::Constant(v) => ("constant", v),
        })
        .collect())
}

/// What `cellc.RNN` needs to know of a model.
#[derive(Debug)]
pub struct Description {
    /// Its device's name, for messages.
    device: &'static str,
    /// How its device reads CPU tensors (`Backend::cpu_tensors`).
    cpu_tensors: &'static str,
    /// Whether its device reads CUDA tensors (`Backend::cuda_tensors`).
    cuda_tensors: bool,
    /// Whether plain inference calls take the native fast path (`Backend::fast_path`).
    fast_path: bool,
    cell: String,
    /// Layers times directions: the first dimension of every state tensor.
    slots: usize,
    weights: Vec<(String, Vec<usize>)>,
    states: Vec<(String, usize)>,
    input_size: usize,
    output_size: usize,
    reserve_per_row: usize,
    /// The cell's rates and their defaults.
    rates: Vec<(String, f64)>,
    /// Whether the cell draws masks of its own (so a training call needs a seed).
    has_masks: bool,
}

impl Description {
    /// What `model`, on `backend`'s device, is.
    fn of(model: &Model, backend: Backend) -> Result<Description> {
        let forward = &model.compiled().forward;
        let sizes = model.layers().first().map(|l| l.state_sizes.clone()).unwrap_or_default();
        Ok(Description {
            device: backend.name(),
            cpu_tensors: backend.cpu_tensors(),
            cuda_tensors: backend.cuda_tensors(),
            fast_path: backend.fast_path(),
            cell: forward.name.clone(),
            slots: model.layers().len() * model.directions(),
            weights: model.weight_names(),
            states: forward.states.iter().map(|s| s.name.clone()).zip(sizes).collect(),
            input_size: model.input_size(),
            output_size: model.output_size(),
            reserve_per_row: model.reserve_floats_per_row(),
            rates: forward.rates.iter().map(|r| (r.name.clone(), r.default)).collect(),
            has_masks: !forward.masks.is_empty(),
        })
    }
}

impl<'py> IntoPyObject<'py> for Description {
    type Target = PyDict;
    type Output = Bound<'py, PyDict>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("device", self.device)?;
        d.set_item("cpu_tensors", self.cpu_tensors)?;
        d.set_item("cuda_tensors", self.cuda_tensors)?;
        d.set_item("fast_path", self.fast_path)?;
        d.set_item("cell", self.cell)?;
        d.set_item("slots", self.slots)?;
        d.set_item("weights", self.weights)?;
        d.set_item("states", self.states)?;
        d.set_item("input_size", self.input_size)?;
        d.set_item("output_size", self.output_size)?;
        d.set_item("reserve_per_row", self.reserve_per_row)?;
        d.set_item("rates", self.rates)?;
        d.set_item("has_masks", self.has_masks)?;
        Ok(d)
    }
}
