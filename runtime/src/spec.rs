//! Model specs: the JSON text a framework layer writes once for a model
//! (`cellc.RNN`'s `spec`: the cell's source, its sizes and configuration,
//! the back end, cellc's version), and what every reader of one needs from
//! it: the parsed spec, its model on a device, and the names of the batch
//! layouts its calls give. The Python package and the ahead-of-time
//! operator library (`cellc-aoti`) both read specs through this module.

use crate::backend::cpu::{Cpu, Kernels};
use crate::backend::cuda::Cuda;
use crate::backend::reference::Reference;
use crate::backend::Device;
use crate::{
    Align, BatchShape, Call, CallOptions, CompiledCell, DeviceCall, DeviceFloats, DeviceForwardOut,
    ForwardOut, Major, Model, ModelConfig, Precision, Result, RuntimeError,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// A model's description, as `cellc.RNN` writes it.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The `.cell` source.
    pub source: String,
    /// The name the source's diagnostics give its file.
    pub file: String,
    /// Which cell of the source (`None`: the first).
    pub cell: Option<String>,
    /// Features of the first layer's input.
    pub input_size: usize,
    /// Explicit size bindings (`{"H": 256}`).
    pub sizes: BTreeMap<String, usize>,
    /// Layers, each reading the one before.
    pub layers: usize,
    /// Whether every layer runs both ways.
    pub bidirectional: bool,
    /// Dropout between layers in training mode (`nn.LSTM`'s `dropout`).
    #[serde(default)]
    pub dropout: f32,
    /// The device its models run on.
    pub backend: Backend,
    /// The version of cellc that wrote it: a spec is a constant argument of
    /// the package's operators, so caches keyed by a graph's constants
    /// (`torch.compile`'s) never reuse shapes, such as the reserve's, that
    /// another version computed; and an exported model names the version
    /// it needs ([`ModelSpec::check_version`]). Absent in a module saved by
    /// an older one.
    #[serde(default, rename = "cellc")]
    pub version: Option<String>,
}

/// The device a spec names: `cellc.RNN`'s `backend` (`cpu`, `reference`,
/// `cuda` or `cuda-emulated`), parsed once with the spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// The CPU back end.
    Cpu,
    /// The reference back end (the interpreter).
    Reference,
    /// The CUDA back end on a GPU.
    Cuda,
    /// The CUDA back end on the emulated device (host threads).
    CudaEmulated,
}

impl Backend {
    /// The device (the CPU's: every usable core, each call capped by its
    /// caller's thread count; CUDA's on device `device`). Every call asks
    /// for its own precision ([`crate::CallOptions::precision`]).
    pub fn device(self, device: usize) -> Result<Box<dyn Device>> {
        match self {
            Backend::Cpu => Ok(Box::new(Cpu::new(0, Kernels::Fastest)?)),
            Backend::Reference => Ok(Box::new(Reference)),
            Backend::Cuda => Ok(Box::new(cuda(Some(device))?)),
            Backend::CudaEmulated => Ok(Box::new(cuda(None)?)),
        }
    }

    /// How the device reads CPU tensors, known without opening it:
    /// `"host"` where they lie (its memory is the host's), `"staged"`
    /// (a GPU: uploaded, and the results downloaded), or `"device"` (the
    /// emulated device, whose memory is the host's: CPU tensors are its
    /// device memory, as CUDA tensors are a GPU's).
    pub fn cpu_tensors(self) -> &'static str {
        match self {
            Backend::Cpu | Backend::Reference => "host",
            Backend::Cuda => "staged",
            Backend::CudaEmulated => "device",
        }
    }

    /// Whether it reads CUDA tensors (a GPU's device; the others read CPU tensors only).
    pub fn cuda_tensors(self) -> bool {
        self == Backend::Cuda
    }

    /// Whether a module's plain inference calls take the Python package's
    /// native fast path: the CPU's; the reference device, the oracle, runs
    /// every call as the operators run it.
    pub fn fast_path(self) -> bool {
        self == Backend::Cpu
    }

    /// The name `cellc.RNN` gave it, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Reference => "reference",
            Backend::Cuda => "cuda",
            Backend::CudaEmulated => "cuda-emulated",
        }
    }
}

/// The CUDA device on `device` (`None`: the emulated device), one per
/// device for every model of the process: they share its stream, its
/// compiled kernels and its memory pools (kept for the process's life).
/// On a GPU, passes run as CUDA graphs (launched on the caller's stream;
/// see `Cuda::with_graphs`) unless `CELLC_CUDA_GRAPHS=0`.
fn cuda(device: Option<usize>) -> Result<Arc<Cuda>> {
    type Devices = Mutex<HashMap<Option<usize>, Arc<Cuda>>>;
    static DEVICES: OnceLock<Devices> = OnceLock::new();
    let mut devices = DEVICES.get_or_init(Default::default).lock().map_err(|_| poisoned())?;
    if let Some(d) = devices.get(&device) {
        return Ok(d.clone());
    }
    let made = Arc::new(match device {
        Some(ordinal) => {
            Cuda::gpu(ordinal)?.with_graphs(std::env::var("CELLC_CUDA_GRAPHS").as_deref() != Ok("0"))
        }
        None => Cuda::emulated()?,
    });
    devices.insert(device, made.clone());
    Ok(made)
}

fn poisoned() -> RuntimeError {
    RuntimeError::Internal("a cache lock was poisoned by an earlier panic".into())
}

impl ModelSpec {
    /// The spec written as `text`.
    pub fn parse(text: &str) -> Result<ModelSpec> {
        serde_json::from_str(text)
            .map_err(|e| RuntimeError::Internal(format!("a model spec that does not parse: {e}")))
    }

    /// Whether this build of cellc runs the spec: the version that wrote it
    /// is this one (an exported model needs the cellc it was exported
    /// with; a spec without a version is refused too).
    pub fn check_version(&self) -> Result<()> {
        let ours = env!("CARGO_PKG_VERSION");
        match self.version.as_deref() {
            Some(v) if v == ours => Ok(()),
            found => Err(RuntimeError::Internal(format!(
                "the model was written by cellc {}, and this is cellc {ours}: run it with the cellc it was \
                 exported with, or export it again with this one",
                found.unwrap_or("of unknown version")
            ))),
        }
    }

    /// The model's layers and directions.
    pub fn config(&self) -> Result<ModelConfig> {
        if self.layers == 0 {
            return Err(RuntimeError::Layer { layer: 0, message: "a model needs at least one layer".into() });
        }
        Ok(ModelConfig { layers: self.layers, bidirectional: self.bidirectional })
    }

    /// The spec's cell, compiled once while some model uses it.
    pub fn compiled(&self) -> Result<Arc<CompiledCell>> {
        type Cells = Mutex<HashMap<(String, Option<String>), Weak<CompiledCell>>>;
        static CELLS: OnceLock<Cells> = OnceLock::new();
        let key = (self.source.clone(), self.cell.clone());
        let mut cells = CELLS.get_or_init(Default::default).lock().map_err(|_| poisoned())?;
        cells.retain(|_, c| c.strong_count() > 0);
        if let Some(c) = cells.get(&key).and_then(Weak::upgrade) {
            return Ok(c);
        }
        let c = Arc::new(CompiledCell::from_source(&self.file, &self.source, self.cell.as_deref())?);
        cells.insert(key, Arc::downgrade(&c));
        Ok(c)
    }

    /// The model the spec describes on `backend`, keeping no weights (every call passes them).
    pub fn model(&self, backend: Box<dyn Device>) -> Result<Model> {
        Model::without_weights(self.compiled()?, self.config()?, &self.sizes, Some(self.input_size), backend)?
            .with_dropout(self.dropout)
    }
}

/// Where an exported model's call finds its tensors: CPU tensors, or
/// CUDA tensors on the device of that ordinal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorsOn {
    /// CPU tensors.
    Cpu,
    /// CUDA tensors on the device of this ordinal.
    Cuda(usize),
}

/// An exported model, made for where its call's tensors lie
/// ([`exported_model`]).
#[derive(Debug, Clone)]
pub struct Exported {
    /// The model.
    pub model: Arc<Model>,
    /// Whether the call's tensors are its device's memory (a GPU's CUDA
    /// tensors, or the emulated device's CPU tensors): the call is a
    /// [`PaddedInference::run_on_device`]; otherwise, host memory and
    /// [`PaddedInference::run`].
    pub device_memory: bool,
}

/// The model of the spec written as `text` for a call over tensors `on`,
/// made at its first use and kept for the process: what the exported
/// models' operator libraries (AOTInductor's `cellc-aoti`, ONNX Runtime's
/// `cellc-onnx`) run. CUDA tensors run on the CUDA back end of their
/// device, which the spec must name; CPU tensors on the emulated device
/// where the spec names it (its memory is the host's: what the model was
/// exported on), else on the CPU back end, whatever other back end the
/// spec names. A spec that another cellc version wrote is refused
/// ([`ModelSpec::check_version`]).
pub fn exported_model(text: &str, on: TensorsOn) -> Result<Exported> {
    // By spec, then by device: a call looks its model up without copying the spec's text.
    type Models = Mutex<HashMap<String, HashMap<TensorsOn, Exported>>>;
    static MODELS: OnceLock<Models> = OnceLock::new();
    let mut models = MODELS.get_or_init(Default::default).lock().map_err(|_| poisoned())?;
    if let Some(m) = models.get(text).and_then(|by_device| by_device.get(&on)) {
        return Ok(m.clone());
    }
    let spec = exported_spec(text)?;
    let (backend, ordinal) = match (on, spec.backend) {
        (TensorsOn::Cuda(ordinal), Backend::Cuda) => (Backend::Cuda, ordinal),
        (TensorsOn::Cuda(ordinal), other) => {
            return Err(RuntimeError::Internal(format!(
            "the model's tensors are CUDA tensors (device {ordinal}), but it was exported for the `{}` back \
                 end, which runs CPU tensors: export it with its tensors on the GPU",
            other.name()
        )))
        }
        (TensorsOn::Cpu, Backend::CudaEmulated) => (Backend::CudaEmulated, 0),
        (TensorsOn::Cpu, _) => (Backend::Cpu, 0),
    };
    let made = Exported {
        model: Arc::new(spec.model(backend.device(ordinal)?)?),
        device_memory: backend != Backend::Cpu,
    };
    models.entry(text.to_string()).or_default().insert(on, made.clone());
    Ok(made)
}

/// The spec written as `text`, parsed and its version checked
/// ([`ModelSpec::check_version`]) at its first use and kept for the
/// process: an exported model's operator checks it before it reads a
/// tensor.
pub fn exported_spec(text: &str) -> Result<Arc<ModelSpec>> {
    static SPECS: OnceLock<Mutex<HashMap<String, Arc<ModelSpec>>>> = OnceLock::new();
    let mut specs = SPECS.get_or_init(Default::default).lock().map_err(|_| poisoned())?;
    if let Some(s) = specs.get(text) {
        return Ok(s.clone());
    }
    let spec = ModelSpec::parse(text)?;
    spec.check_version()?;
    let spec = Arc::new(spec);
    specs.insert(text.to_string(), spec.clone());
    Ok(spec)
}

/// An exported model's inference call over a padded batch, its tensors'
/// data as `D`: host slices ([`PaddedInference::run`]) or device memory
/// ([`PaddedInference::run_on_device`]).
#[derive(Debug)]
pub struct PaddedInference<'a, D> {
    /// The input, `[B, T, I]` (batch first) or `[T, B, I]`.
    pub input: D,
    /// The input's dimensions.
    pub dims: [usize; 3],
    /// Batch first or time first.
    pub major: Major,
    /// Where each sequence's padding lies.
    pub align: Align,
    /// Each sequence's length, on the host (`None`: every sequence runs all `T` steps).
    pub lengths: Option<&'a [i64]>,
    /// The initial states, one per state of the cell, or none (zeros).
    pub h0: Vec<D>,
    /// Every layer's and direction's parameters, in the model's order.
    pub weights: Vec<D>,
}

impl<D> PaddedInference<'_, D> {
    /// Each sequence's length, checked.
    fn lengths(&self) -> Result<Vec<usize>> {
        let (batch, steps) = self.batch_and_steps();
        crate::sequence::lengths_from_i64(self.lengths, batch, steps)
    }

    /// `(B, T)`.
    pub fn batch_and_steps(&self) -> (usize, usize) {
        match self.major {
            Major::BatchFirst => (self.dims[0], self.dims[1]),
            Major::TimeFirst => (self.dims[1], self.dims[0]),
        }
    }

    /// The batch's shape over `lengths`.
    fn shape<'l>(&self, lengths: &'l [usize]) -> BatchShape<'l> {
        let (batch, steps) = self.batch_and_steps();
        BatchShape::Padded { batch, steps, major: self.major, align: self.align, lengths }
    }
}

impl<'a> PaddedInference<'a, &'a [f32]> {
    /// Runs it on `model` in f32, writing `output` (laid out as the input) and
    /// each final state (`[layers * directions, B, size]`).
    pub fn run(&self, model: &Model, output: &mut [f32], finals: Vec<&mut [f32]>) -> Result<()> {
        let lengths = self.lengths()?;
        let weights = model.group_by_slot(self.weights.clone())?;
        let call = Call {
            input: self.shape(&lengths).with_data(self.input),
            weights: Some(&weights),
            h0: (!self.h0.is_empty()).then_some(&self.h0[..]),
            options: CallOptions { precision: Some(Precision::F32), ..CallOptions::default() },
        };
        model.forward_into(&call, ForwardOut { output, final_states: finals }, None)
    }
}

impl PaddedInference<'_, DeviceFloats> {
    /// Runs it on `model`'s device, queued on `stream`, with products in
    /// `precision`, writing `out`.
    pub fn run_on_device(
        &self,
        model: &Model,
        stream: u64,
        precision: Precision,
        out: &DeviceForwardOut,
    ) -> Result<()> {
        let lengths = self.lengths()?;
        let weights = model.group_by_slot(self.weights.clone())?;
        let call = DeviceCall {
            shape: self.shape(&lengths),
            input: self.input,
            weights: &weights,
            h0: (!self.h0.is_empty()).then_some(&self.h0[..]),
            stream,
            options: CallOptions { precision: Some(precision), ..CallOptions::default() },
        };
        model.forward_into(&call, out, None)
    }
}

/// How a call's input rows are laid out, by the names the operators give
/// (`"batch_first/left"`, `"time_first/right"`, ..., `"packed"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutName {
    /// Padded `[B, T, F]` (batch first) or `[T, B, F]`, padding after
    /// (left-aligned) or before (right-aligned) each sequence.
    Padded(Major, Align),
    /// Packed `[N, F]`, as `pack_padded_sequence` gives.
    Packed,
}

impl LayoutName {
    /// The layout called `name`.
    pub fn parse(name: &str) -> Result<LayoutName> {
        Ok(match name {
            "batch_first/left" => LayoutName::Padded(Major::BatchFirst, Align::Left),
            "batch_first/right" => LayoutName::Padded(Major::BatchFirst, Align::Right),
            "time_first/left" => LayoutName::Padded(Major::TimeFirst, Align::Left),
            "time_first/right" => LayoutName::Padded(Major::TimeFirst, Align::Right),
            "packed" => LayoutName::Packed,
            other => return Err(RuntimeError::Internal(format!("no such layout `{other}`"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(version: Option<&str>) -> String {
        let version = version.map(|v| format!(r#","cellc":"{v}""#)).unwrap_or_default();
        format!(
            r#"{{"source":"cell c {{ }}","file":"c.cell","cell":null,"input_size":3,"sizes":{{"H":4}},"layers":1,"bidirectional":false,"backend":"cpu"{version}}}"#
        )
    }

    #[test]
    fn a_spec_of_another_version_is_refused_by_name() {
        let ours = env!("CARGO_PKG_VERSION");
        assert!(ModelSpec::parse(&spec(Some(ours))).expect("parses").check_version().is_ok());
        let e = ModelSpec::parse(&spec(Some("0.0.1"))).expect("parses").check_version().expect_err("refused");
        assert!(e.to_string().contains("cellc 0.0.1") && e.to_string().contains(ours), "{e}");
        assert!(ModelSpec::parse(&spec(None)).expect("parses").check_version().is_err());
    }

    #[test]
    fn an_exported_models_tensors_choose_its_device() {
        let source = r"cell c { input x[I] state h[H] param w[H, I] h' = tanh(w @ x + h) output h' }";
        let ours = spec(Some(env!("CARGO_PKG_VERSION"))).replace("cell c { }", source);
        let on_cpu = exported_model(&ours, TensorsOn::Cpu).expect("the CPU back end");
        assert!(!on_cpu.device_memory);
        // CUDA tensors for a model exported on the CPU: refused, naming the back end, before
        // any device is opened.
        let e = exported_model(&ours, TensorsOn::Cuda(0)).expect_err("refused");
        assert!(e.to_string().contains("`cpu` back end"), "{e}");
    }

    #[test]
    fn layouts_by_name() {
        assert_eq!(LayoutName::parse("packed").expect("packed"), LayoutName::Packed);
        assert_eq!(
            LayoutName::parse("time_first/right").expect("padded"),
            LayoutName::Padded(Major::TimeFirst, Align::Right)
        );
        assert!(LayoutName::parse("sideways").is_err());
    }
}
