//! The forward and backward operators' Rust side: the tensors of a call
//! as slices (in place, nothing copied), run by the runtime with the
//! interpreter lock released.

use crate::errors::to_python;
use crate::spec;
use crate::tensors::{Tensor, TensorArg};
use cellc_runtime::backend::cpu::threads;
use cellc_runtime::{
    Align, BackwardOut, BatchShape, Call, DeviceBackwardOut, DeviceCall, DeviceFloats, DeviceForwardOut,
    ForwardOut, Major, MaskSeed, Model, PackedIndex, Precision, Result, RuntimeError,
};
use pyo3::prelude::*;

/// A batch's shape (from the input tensor's) and index tensors, read.
struct Batch {
    layout: Layout,
    /// Padded: `[lengths]` (every length `T` when the call gives none); packed:
    /// `[batch_sizes, sorted_indices, unsorted_indices]`.
    index: Vec<Vec<usize>>,
    /// Padded: `(B, T)`; packed: `(N, 0)`.
    dims: (usize, usize),
    features: usize,
    /// Per-step resets, one flag per layout row (`Call::resets`).
    resets: Option<Vec<bool>>,
}

#[derive(Clone, Copy, Debug)]
enum Layout {
    Padded(Major, Align),
    Packed,
}

fn layout(name: &str) -> Result<Layout> {
    Ok(match name {
        "batch_first/left" => Layout::Padded(Major::BatchFirst, Align::Left),
        "batch_first/right" => Layout::Padded(Major::BatchFirst, Align::Right),
        "time_first/left" => Layout::Padded(Major::TimeFirst, Align::Left),
        "time_first/right" => Layout::Padded(Major::TimeFirst, Align::Right),
        "packed" => Layout::Packed,
        other => return Err(RuntimeError::Internal(format!("no such layout `{other}`"))),
    })
}

impl Batch {
    /// A layout name ending in `+resets` has the resets as the last index
    /// tensor (i64, nonzero where the state restarts).
    ///
    /// # Safety
    /// `index` per [`Tensor::indices`] (`x` is only measured).
    unsafe fn read(layout_name: &str, x: &Tensor, index: &[Tensor]) -> Result<Batch> {
        let (layout_name, index, resets) = match layout_name.strip_suffix("+resets") {
            None => (layout_name, index, None),
            Some(name) => {
                let (flags, index) = index
                    .split_last()
                    .ok_or_else(|| RuntimeError::Internal("a `+resets` layout without its resets".into()))?;
                // SAFETY: per the contract.
                let flags = unsafe { flags.indices(false, 0)? };
                (name, index, Some(flags.into_iter().map(|v| v != 0).collect()))
            }
        };
        let layout = layout(layout_name)?;
        let rank = match layout {
            Layout::Padded(..) => 3,
            Layout::Packed => 2,
        };
        if x.shape.len() != rank {
            return Err(RuntimeError::Shape {
                tensor: "input".into(),
                expected: format!("{rank} dimensions"),
                found: format!("{:?}", x.shape),
            });
        }
        let (dims, features) = match layout {
            Layout::Padded(Major::BatchFirst, _) => ((x.shape[0], x.shape[1]), x.shape[2]),
            Layout::Padded(Major::TimeFirst, _) => ((x.shape[1], x.shape[0]), x.shape[2]),
            Layout::Packed => ((x.shape[0], 0), x.shape[1]),
        };
        let expected = if matches!(layout, Layout::Packed) { 3 } else { 1 };
        if index.is_empty() && expected == 1 {
            // A padded batch without lengths: every sequence runs all the steps.
            return Ok(Batch { layout, index: vec![vec![dims.1; dims.0]], dims, features, resets });
        }
        if index.len() != expected {
            return Err(RuntimeError::Internal(format!(
                "{expected} index tensors expected, got {}",
                index.len()
            )));
        }
        let index = index
            .iter()
            .enumerate()
            // SAFETY: per the contract.
            .map(|(i, t)| unsafe { t.indices(i == 0 && expected == 1, dims.1) })
            .collect::<Result<Vec<_>>>()?;
        Ok(Batch { layout, index, dims, features, resets })
    }

    fn shape(&self) -> BatchShape<'_> {
        match self.layout {
            Layout::Padded(major, align) => BatchShape::Padded {
                batch: self.dims.0,
                steps: self.dims.1,
                major,
                align,
                lengths: &self.index[0],
            },
            Layout::Packed => BatchShape::Packed(PackedIndex {
                features: self.features,
                batch_sizes: &self.index[0],
                sorted_indices: &self.index[1],
                unsorted_indices: &self.index[2],
            }),
        }
    }
}

/// # Safety
/// Each tensor per [`Tensor::floats`].
unsafe fn read_all<'a>(tensors: &[Tensor]) -> Result<Vec<&'a [f32]>> {
    // SAFETY: per the contract.
    tensors.iter().map(|t| unsafe { t.floats() }).collect()
}

/// # Safety
/// Each tensor per [`Tensor::floats_mut`].
unsafe fn write_all<'a>(tensors: &[Tensor]) -> Result<Vec<&'a mut [f32]>> {
    // SAFETY: per the contract.
    tensors.iter().map(|t| unsafe { t.floats_mut() }).collect()
}

fn on_device(tensors: &[Tensor]) -> Vec<DeviceFloats> {
    tensors.iter().map(Tensor::on_device).collect()
}

/// The tensors every call takes, named for its errors: the input, the
/// batch's index tensors, the initial states and the weights.
struct CallTensors {
    x: Tensor,
    index: Vec<Tensor>,
    h0: Vec<Tensor>,
    weights: Vec<Tensor>,
}

impl CallTensors {
    fn new(x: TensorArg, index: Vec<TensorArg>, h0: Vec<TensorArg>, weights: Vec<TensorArg>) -> CallTensors {
        CallTensors {
            x: Tensor::new("input", x),
            index: Tensor::each("index", index),
            h0: Tensor::each("h0", h0),
            weights: Tensor::each("weights", weights),
        }
    }

    /// Read on the host.
    ///
    /// # Safety
    /// Every tensor per [`Tensor::floats`] (the index tensors, [`Tensor::indices`]).
    unsafe fn read<'a>(&self, model: &Model, layout: &str) -> Result<Inputs<'a>> {
        // SAFETY (block): per the contract.
        unsafe {
            Ok(Inputs {
                batch: Batch::read(layout, &self.x, &self.index)?,
                data: self.x.floats()?,
                weights: model.group_by_slot(read_all(&self.weights)?)?,
                h0: read_all(&self.h0)?,
            })
        }
    }

    /// In device memory: the index tensors read on the host, every other tensor an address.
    ///
    /// # Safety
    /// The index tensors per [`Tensor::indices`] (the rest are not read here).
    unsafe fn on_device(&self, model: &Model, layout: &str) -> Result<DeviceInputs> {
        Ok(DeviceInputs {
            // SAFETY: per the contract.
            batch: unsafe { Batch::read(layout, &self.x, &self.index)? },
            data: self.x.on_device(),
            weights: model.group_by_slot(on_device(&self.weights))?,
            h0: on_device(&self.h0),
        })
    }
}

/// A call's inputs on the host, read: the batch, the weights by layer and direction, the initial states.
struct Inputs<'a> {
    batch: Batch,
    data: &'a [f32],
    weights: Vec<Vec<&'a [f32]>>,
    h0: Vec<&'a [f32]>,
}

impl Inputs<'_> {
    fn call(&self) -> Call<'_> {
        Call {
            input: self.batch.shape().with_data(self.data),
            weights: Some(&self.weights),
            h0: (!self.h0.is_empty()).then_some(&self.h0[..]),
            masks: None,
            rates: None,
            dropout: None,
            resets: self.batch.resets.as_deref(),
        }
    }
}

/// A call's inputs in device memory.
struct DeviceInputs {
    batch: Batch,
    data: DeviceFloats,
    weights: Vec<Vec<DeviceFloats>>,
    h0: Vec<DeviceFloats>,
}

impl DeviceInputs {
    fn call(&self, stream: u64) -> DeviceCall<'_> {
        DeviceCall {
            shape: self.batch.shape(),
            input: self.data,
            weights: &self.weights,
            h0: (!self.h0.is_empty()).then_some(&self.h0[..]),
            stream,
            masks: None,
            rates: None,
            dropout: None,
            resets: self.batch.resets.as_deref(),
        }
    }
}

/// Where a call's tensors lie: host memory (run on at most `threads`
/// threads), or device memory (`(ordinal, stream)`: CUDA tensors, or the
/// emulated device's host memory), the pass queued on `stream`.
#[derive(Clone, Copy, Debug)]
enum Memory {
    Host { threads: usize },
    Device { ordinal: usize, stream: u64 },
}

impl Memory {
    fn new(threads: usize, device: Option<(usize, u64)>) -> Memory {
        match device {
            None => Memory::Host { threads },
            Some((ordinal, stream)) => Memory::Device { ordinal, stream },
        }
    }

    /// The model of `spec`, on this memory's device, with its products in `precision`.
    fn model(self, spec: &str, precision: Precision) -> Result<std::sync::Arc<Model>> {
        match self {
            Memory::Host { .. } => spec::model(spec, 0, precision),
            Memory::Device { ordinal, .. } => spec::model(spec, ordinal, precision),
        }
    }
}

/// A call's layout name without its precision suffix, and the precision:
/// `+bf16` or `+f16` last asks for bf16 or fp16 products
/// ([`Precision::Bf16`], [`Precision::F16`]; what `cellc.RNN` asks under
/// autocast and for half-precision tensors), `+tf32` for TF32 products
/// ([`Precision::Tf32`]; what it asks of float32 calls on the GPU where
/// PyTorch lets cuDNN's RNN use TF32).
fn precision_of(layout: &str) -> (&str, Precision) {
    [("+bf16", Precision::Bf16), ("+f16", Precision::F16), ("+tf32", Precision::Tf32)]
        .into_iter()
        .find_map(|(suffix, precision)| Some((layout.strip_suffix(suffix)?, precision)))
        .unwrap_or((layout, Precision::F32))
}

/// A forward pass over the caller's tensors, in host or device memory
/// ([`Memory`]): writes `output` and `finals`, and, when `reserve` is
/// given, what the backward reads into it.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn forward(
    py: Python<'_>,
    spec: &str,
    threads: usize,
    device: Option<(usize, u64)>,
    layout: &str,
    x: TensorArg,
    index: Vec<TensorArg>,
    h0: Vec<TensorArg>,
    weights: Vec<TensorArg>,
    output: TensorArg,
    finals: Vec<TensorArg>,
    reserve: Option<TensorArg>,
    masks: Option<(u64, u64)>,
    rates: Option<Vec<f32>>,
    dropout: Option<f32>,
) -> PyResult<()> {
    let masks = masks.map(|(seed, offset)| MaskSeed { seed, offset });
    let rates = rates.as_deref();
    let tensors = CallTensors::new(x, index, h0, weights);
    let (output, finals) = (Tensor::new("output", output), Tensor::each("final_states", finals));
    let reserve = reserve.map(|r| Tensor::new("reserve", r));
    let memory = Memory::new(threads, device);
    let (layout, precision) = precision_of(layout);
    py.detach(|| -> Result<()> {
        let model = memory.model(spec, precision)?;
        match memory {
            // SAFETY (block): the Python half checked every tensor (contiguous,
            // on the CPU, f32 or i64) and holds them for the call; the outputs
            // are fresh tensors no input aliases.
            Memory::Host { threads } => unsafe {
                let inputs = tensors.read(&model, layout)?;
                let out = ForwardOut { output: output.floats_mut()?, final_states: write_all(&finals)? };
                let reserve = reserve.as_ref().map(|r| r.floats_mut()).transpose()?;
                let call = Call { masks, rates, dropout, ..inputs.call() };
                threads::with_limit(threads, || model.forward_into(&call, out, reserve))
            },
            Memory::Device { stream, .. } => {
                // SAFETY: the Python half checked the index tensors (contiguous i64 on the CPU) and
                // every other tensor (contiguous f32 on the model's device), and holds them all.
                let inputs = unsafe { tensors.on_device(&model, layout)? };
                let out = DeviceForwardOut { output: output.on_device(), final_states: on_device(&finals) };
                let reserve = reserve.as_ref().map(Tensor::on_device);
                model.forward_into(
                    &DeviceCall { masks, rates, dropout, ..inputs.call(stream) },
                    &out,
                    reserve,
                )
            }
        }
    })
    .map_err(|e| to_python(py, e))
}

/// The backward of a [`forward`] with a reserve, in the same memory:
/// writes the gradients of the input, the initial states (when given) and
/// the weights.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn backward(
    py: Python<'_>,
    spec: &str,
    threads: usize,
    device: Option<(usize, u64)>,
    layout: &str,
    x: TensorArg,
    index: Vec<TensorArg>,
    h0: Vec<TensorArg>,
    weights: Vec<TensorArg>,
    reserve: TensorArg,
    grad_output: TensorArg,
    grad_finals: Vec<TensorArg>,
    grad_input: TensorArg,
    grad_h0: Vec<TensorArg>,
    grad_weights: Vec<TensorArg>,
    masks: Option<(u64, u64)>,
    rates: Option<Vec<f32>>,
    dropout: Option<f32>,
) -> PyResult<()> {
    let masks = masks.map(|(seed, offset)| MaskSeed { seed, offset });
    let rates = rates.as_deref();
    let tensors = CallTensors::new(x, index, h0, weights);
    let (reserve, grad_output) = (Tensor::new("reserve", reserve), Tensor::new("grad_output", grad_output));
    let grad_finals = Tensor::each("grad_final_states", grad_finals);
    let (grad_input, grad_h0) = (Tensor::new("grad_input", grad_input), Tensor::each("grad_h0", grad_h0));
    let grad_weights = Tensor::each("grad_weights", grad_weights);
    let memory = Memory::new(threads, device);
    let (layout, precision) = precision_of(layout);
    py.detach(|| -> Result<()> {
        let model = memory.model(spec, precision)?;
        match memory {
            // SAFETY (block): as in `forward`.
            Memory::Host { threads } => unsafe {
                let inputs = tensors.read(&model, layout)?;
                let grad_finals = read_all(&grad_finals)?;
                let d_params = model.group_by_slot(write_all(&grad_weights)?)?;
                let d_h0 = write_all(&grad_h0)?;
                let out = BackwardOut { d_input: grad_input.floats_mut()?, d_h0, d_params };
                let d_final = (!grad_finals.is_empty()).then_some(&grad_finals[..]);
                threads::with_limit(threads, || {
                    model.backward_from(
                        &Call { masks, rates, dropout, ..inputs.call() },
                        reserve.floats()?,
                        grad_output.floats()?,
                        d_final,
                        out,
                    )
                })
            },
            Memory::Device { stream, .. } => {
                // SAFETY: as in `forward`.
                let inputs = unsafe { tensors.on_device(&model, layout)? };
                let grad_finals = on_device(&grad_finals);
                let out = DeviceBackwardOut {
                    d_input: grad_input.on_device(),
                    d_h0: on_device(&grad_h0),
                    d_params: model.group_by_slot(on_device(&grad_weights))?,
                };
                let d_final = (!grad_finals.is_empty()).then_some(&grad_finals[..]);
                let call = DeviceCall { masks, rates, dropout, ..inputs.call(stream) };
                model.backward_from(&call, reserve.on_device(), grad_output.on_device(), d_final, &out)
            }
        }
    })
    .map_err(|e| to_python(py, e))
}

/// One mask a call used: its name, shape and values (`cellc_runtime::masks::SeenMask`).
type SeenMask = (String, Vec<usize>, Vec<f32>);

/// The masks of the cell's own mask calls that a call over `x` (laid out
/// as `layout` says) uses, in training mode drawing from `masks` or in
/// evaluation, at `rates` (`Model::cell_masks`): `(name, shape, values)` each.
#[pyfunction]
pub fn cell_masks(
    py: Python<'_>,
    spec: &str,
    layout: &str,
    x: TensorArg,
    index: Vec<TensorArg>,
    masks: Option<(u64, u64)>,
    rates: Option<Vec<f32>>,
) -> PyResult<Vec<SeenMask>> {
    let (x, index) = (Tensor::new("input", x), Tensor::each("index", index));
    let seed = masks.map(|(seed, offset)| MaskSeed { seed, offset });
    py.detach(|| -> Result<Vec<SeenMask>> {
        let model = Memory::Host { threads: 1 }.model(spec, Precision::F32)?;
        // SAFETY: the Python half checked the tensors (contiguous, on the CPU,
        // f32 or i64) and holds them for the call.
        let (batch, data) = unsafe { (Batch::read(layout, &x, &index)?, x.floats()?) };
        let seen = model.cell_masks(batch.shape().with_data(data), seed, rates.as_deref())?;
        Ok(seen.into_iter().map(|m| (m.name, m.shape, m.values)).collect())
    })
    .map_err(|e| to_python(py, e))
}

/// The dropout masks a call in training mode drawing from `masks` (`(seed,
/// offset)`) at rate `dropout` multiplies each layer's output by, for the
/// input `x` laid out as `layout` says (`Model::dropout_masks`): one flat
/// buffer per layer boundary, laid out like the input with the layer's
/// output features.
#[pyfunction]
pub fn dropout_masks(
    py: Python<'_>,
    spec: &str,
    layout: &str,
    x: TensorArg,
    index: Vec<TensorArg>,
    masks: (u64, u64),
    dropout: f32,
) -> PyResult<Vec<Vec<f32>>> {
    let (x, index) = (Tensor::new("input", x), Tensor::each("index", index));
    let (seed, offset) = masks;
    py.detach(|| -> Result<Vec<Vec<f32>>> {
        let model = Memory::Host { threads: 1 }.model(spec, Precision::F32)?;
        // SAFETY: the Python half checked the tensors (contiguous, on the CPU,
        // f32 or i64) and holds them for the call.
        let (batch, data) = unsafe { (Batch::read(layout, &x, &index)?, x.floats()?) };
        model.dropout_masks(batch.shape().with_data(data), MaskSeed { seed, offset }, Some(dropout))
    })
    .map_err(|e| to_python(py, e))
}
