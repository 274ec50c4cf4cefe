//! Models by spec: the JSON text the Python module writes once for a
//! `cellc.RNN` (the cell's source and its configuration), and the models
//! made from it, once per spec and thread count.

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::cuda::Cuda;
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Backend;
use cellc_runtime::{CompiledCell, Model, ModelConfig, Result, RuntimeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

/// A model's description, as `cellc.RNN` writes it.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    /// The `.cell` source, and the name its diagnostics give the file.
    source: String,
    file: String,
    /// Which cell of the source (`None`: the first).
    cell: Option<String>,
    input_size: usize,
    /// Explicit size bindings (`{"H": 256}`).
    sizes: BTreeMap<String, usize>,
    layers: usize,
    bidirectional: bool,
    /// `cpu`, `reference`, `cuda` or `cuda-emulated`.
    backend: String,
}

fn parse(spec: &str) -> Result<Spec> {
    serde_json::from_str(spec)
        .map_err(|e| RuntimeError::Internal(format!("a model spec that does not parse: {e}")))
}

/// The back end `name` on `threads` threads (the CPU) or CUDA device `device`.
fn backend(name: &str, threads: usize, device: usize) -> Result<Box<dyn Backend>> {
    match name {
        "cpu" => Ok(Box::new(Cpu::new(threads, Kernels::Jit)?)),
        "reference" => Ok(Box::new(Reference)),
        "cuda" => Ok(Box::new(cuda(Some(device))?)),
        "cuda-emulated" => Ok(Box::new(cuda(None)?)),
        other => Err(no_such_backend(other)),
    }
}

/// The CUDA back end on `device` (`None`: the emulated device), one per
/// device for every model of the process: they share its stream, its
/// compiled kernels and its memory pools.
fn cuda(device: Option<usize>) -> Result<Arc<Cuda>> {
    static DEVICES: OnceLock<Mutex<HashMap<Option<usize>, Arc<Cuda>>>> = OnceLock::new();
    let mut devices = DEVICES.get_or_init(Default::default).lock().map_err(|_| poisoned())?;
    if let Some(d) = devices.get(&device) {
        return Ok(d.clone());
    }
    let made = Arc::new(match device {
        Some(ordinal) => Cuda::gpu(ordinal)?,
        None => Cuda::emulated()?,
    });
    devices.insert(device, made.clone());
    Ok(made)
}

fn no_such_backend(name: &str) -> RuntimeError {
    RuntimeError::Backend {
        backend: name.into(),
        message: "no such back end (there are `cpu`, `cuda`, `cuda-emulated` and `reference`)".into(),
    }
}

/// A model made from `spec` on `backend`, with parameters from `seed`.
fn make(spec: &Spec, seed: u64, backend: Box<dyn Backend>) -> Result<Model> {
    let compiled = compiled(&spec.file, &spec.source, spec.cell.as_deref())?;
    let config = ModelConfig { layers: spec.layers, bidirectional: spec.bidirectional };
    if spec.layers == 0 {
        return Err(RuntimeError::Layer { layer: 0, message: "a model needs at least one layer".into() });
    }
    Model::new(compiled, config, &spec.sizes, Some(spec.input_size), None, seed, backend)
}

/// A cell compiled once per source.
fn compiled(file: &str, source: &str, cell: Option<&str>) -> Result<Arc<CompiledCell>> {
    type Cells = Mutex<HashMap<(String, Option<String>), Arc<CompiledCell>>>;
    static CELLS: OnceLock<Cells> = OnceLock::new();
    let key = (source.to_string(), cell.map(str::to_string));
    let cells = CELLS.get_or_init(Default::default);
    if let Some(c) = cells.lock().map_err(|_| poisoned())?.get(&key) {
        return Ok(c.clone());
    }
    let c = Arc::new(CompiledCell::from_source(file, source, cell)?);
    cells.lock().map_err(|_| poisoned())?.insert(key, c.clone());
    Ok(c)
}

fn poisoned() -> RuntimeError {
    RuntimeError::Internal("a cache lock was poisoned by an earlier panic".into())
}

/// The model for `spec` running on `threads` threads (the CPU) or CUDA
/// device `device`, made on first use. Its own parameters are never read
/// by the operators: each call passes the module's weights.
pub fn model(spec: &str, threads: usize, device: usize) -> Result<Arc<Model>> {
    type Models = Mutex<HashMap<(String, usize, usize), Arc<Model>>>;
    static MODELS: OnceLock<Models> = OnceLock::new();
    let models = MODELS.get_or_init(Default::default);
    let key = (spec.to_string(), threads.max(1), device);
    if let Some(m) = models.lock().map_err(|_| poisoned())?.get(&key) {
        return Ok(m.clone());
    }
    let spec = parse(spec)?;
    let model = Arc::new(make(&spec, 0, backend(&spec.backend, key.1, device)?)?);
    models.lock().map_err(|_| poisoned())?.insert(key, model.clone());
    Ok(model)
}

/// What `spec`'s model is ([`Description`]), without opening a device: a
/// CPU model is made (and kept) for its reserve's size; the other back
/// ends keep their tapes themselves, so the reference back end describes
/// them.
pub fn describe(text: &str) -> Result<Description> {
    let spec = parse(text)?;
    match spec.backend.as_str() {
        "cpu" => Description::of(&*model(text, 1, 0)?),
        "reference" | "cuda" | "cuda-emulated" => Description::of(&make(&spec, 0, Box::new(Reference))?),
        other => Err(no_such_backend(other)),
    }
}

/// The parameters the cell's `init` clauses give for `seed`, in the order of [`Model::weight_names`].
pub fn initial_weights(spec: &str, seed: u64) -> Result<Vec<Vec<f32>>> {
    // Initialisation does not depend on the back end: the reference one
    // starts no threads and opens no device.
    let mut model = make(&parse(spec)?, seed, Box::new(Reference))?;
    Ok(model.params_mut().iter_mut().flatten().map(std::mem::take).collect())
}

/// What `cellc.RNN` needs to know of a model.
#[derive(Debug)]
pub struct Description {
    cell: String,
    /// Layers times directions: the first dimension of every state tensor.
    slots: usize,
    weights: Vec<(String, Vec<usize>)>,
    states: Vec<(String, usize)>,
    input_size: usize,
    output_size: usize,
    reserve_per_row: Option<usize>,
}

impl Description {
    pub fn of(model: &Model) -> Result<Description> {
        let forward = &model.compiled().forward;
        let sizes = model.layers().first().map(|l| l.state_sizes.clone()).unwrap_or_default();
        Ok(Description {
            cell: forward.name.clone(),
            slots: model.layers().len() * model.directions(),
            weights: model.weight_names(),
            states: forward.states.iter().map(|s| s.name.clone()).zip(sizes).collect(),
            input_size: model.input_size(),
            output_size: model.output_size(),
            reserve_per_row: model.reserve_floats_per_row()?,
        })
    }
}

impl<'py> IntoPyObject<'py> for Description {
    type Target = PyDict;
    type Output = Bound<'py, PyDict>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("cell", self.cell)?;
        d.set_item("slots", self.slots)?;
        d.set_item("weights", self.weights)?;
        d.set_item("states", self.states)?;
        d.set_item("input_size", self.input_size)?;
        d.set_item("output_size", self.output_size)?;
        d.set_item("reserve_per_row", self.reserve_per_row)?;
        Ok(d)
    }
}
