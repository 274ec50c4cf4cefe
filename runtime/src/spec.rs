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
    Align, BatchShape, Call, CallOptions, CompiledCell, ForwardOut, Major, Model, ModelConfig, Precision,
    Result, RuntimeError,
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

/// The CPU model of the spec written as `text`, made at its first use and
/// kept for the process: what the exported models' operator libraries
/// (AOTInductor's `cellc-aoti`, ONNX Runtime's `cellc-onnx`) run, whatever
/// back end the spec names. A spec that another cellc version wrote is
/// refused ([`ModelSpec::check_version`]).
pub fn exported_model(text: &str) -> Result<Arc<Model>> {
    static MODELS: OnceLock<Mutex<HashMap<String, Arc<Model>>>> = OnceLock::new();
    let mut models = MODELS.get_or_init(Default::default).lock().map_err(|_| poisoned())?;
    if let Some(m) = models.get(text) {
        return Ok(m.clone());
    }
    let spec = ModelSpec::parse(text)?;
    spec.check_version()?;
    let made = Arc::new(spec.model(Backend::Cpu.device(0)?)?);
    models.insert(text.to_string(), made.clone());
    Ok(made)
}

/// An exported model's inference call over a padded batch in host memory.
#[derive(Debug)]
pub struct PaddedInference<'a> {
    /// The input, `[B, T, I]` (batch first) or `[T, B, I]`.
    pub input: &'a [f32],
    /// The input's dimensions.
    pub dims: [usize; 3],
    /// Batch first or time first.
    pub major: Major,
    /// Where each sequence's padding lies.
    pub align: Align,
    /// Each sequence's length (`None`: every sequence runs all `T` steps).
    pub lengths: Option<&'a [i64]>,
    /// The initial states, one per state of the cell, or none (zeros).
    pub h0: Vec<&'a [f32]>,
    /// Every layer's and direction's parameters, in the model's order.
    pub weights: Vec<&'a [f32]>,
}

impl PaddedInference<'_> {
    /// Runs it on `model` in f32, writing `output` (laid out as the input) and
    /// each final state (`[layers * directions, B, size]`).
    pub fn run(&self, model: &Model, output: &mut [f32], finals: Vec<&mut [f32]>) -> Result<()> {
        let (batch, steps) = match self.major {
            Major::BatchFirst => (self.dims[0], self.dims[1]),
            Major::TimeFirst => (self.dims[1], self.dims[0]),
        };
        let lengths = crate::sequence::lengths_from_i64(self.lengths, batch, steps)?;
        let weights = model.group_by_slot(self.weights.clone())?;
        let call = Call {
            input: BatchShape::Padded {
                batch,
                steps,
                major: self.major,
                align: self.align,
                lengths: &lengths,
            }
            .with_data(self.input),
            weights: Some(&weights),
            h0: (!self.h0.is_empty()).then_some(&self.h0[..]),
            options: CallOptions { precision: Some(Precision::F32), ..CallOptions::default() },
        };
        model.forward_into(&call, ForwardOut { output, final_states: finals }, None)
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
    fn layouts_by_name() {
        assert_eq!(LayoutName::parse("packed").expect("packed"), LayoutName::Packed);
        assert_eq!(
            LayoutName::parse("time_first/right").expect("padded"),
            LayoutName::Padded(Major::TimeFirst, Align::Right)
        );
        assert!(LayoutName::parse("sideways").is_err());
    }
}
