//! The forward and backward operators' Rust side: the tensors of a call
//! as slices (in place, nothing copied), run by the runtime with the
//! interpreter lock released.

use crate::errors::to_python;
use crate::spec;
use crate::tensors::{Tensor, TensorArg};
use cellc_runtime::backend::cpu::threads;
use cellc_runtime::spec::LayoutName;
use cellc_runtime::{
    BackwardOut, BatchShape, Call, CallOptions, DeviceBackwardOut, DeviceCall, DeviceFloats,
    DeviceForwardOut, ForwardOut, Major, MaskSeed, Model, PackedIndex, Precision, Result, RuntimeError,
};
use pyo3::prelude::*;

/// A batch's shape (from the input tensor's) and index tensors, read.
struct Batch {
    layout: LayoutName,
    /// Padded: `[lengths]` (every length `T` when the call gives none); packed:
    /// `[batch_sizes, sorted_indices, unsorted_indices]`.
    index: Vec<Vec<usize>>,
    /// Padded: `(B, T)`; packed: `(N, 0)`.
    dims: (usize, usize),
    features: usize,
    /// Per-step resets, one flag per layout row (`CallOptions::resets`).
    resets: Option<Vec<bool>>,
}

impl Batch {
    /// The batch of `x` laid out as `layout_name` says, its `index`
    /// tensors and its per-step `resets` if any (i64, nonzero where the
    /// state restarts).
    ///
    /// # Safety
    /// `index` and `resets` per [`Tensor::indices`] (`x` is only measured).
    unsafe fn read(
        layout_name: &str,
        x: &Tensor,
        index: &[Tensor],
        resets: Option<&Tensor>,
    ) -> Result<Batch> {
        // SAFETY: per the contract.
        let resets = resets.map(|r| unsafe { r.indices(false, 0) }).transpose()?;
        let resets = resets.map(|flags| flags.into_iter().map(|v| v != 0).collect());
        let layout = LayoutName::parse(layout_name)?;
        let rank = match layout {
            LayoutName::Padded(..) => 3,
            LayoutName::Packed => 2,
        };
        if x.shape.len() != rank {
            return Err(RuntimeError::Shape {
                tensor: "input".into(),
                expected: format!("{rank} dimensions"),
                found: format!("{:?}", x.shape),
            });
        }
        let (dims, features) = match layout {
            LayoutName::Padded(Major::BatchFirst, _) => ((x.shape[0], x.shape[1]), x.shape[2]),
            LayoutName::Padded(Major::TimeFirst, _) => ((x.shape[1], x.shape[0]), x.shape[2]),
            LayoutName::Packed => ((x.shape[0], 0), x.shape[1]),
        };
        let expected = if matches!(layout, LayoutName::Packed) { 3 } else { 1 };
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
            LayoutName::Padded(major, align) => BatchShape::Padded {
                batch: self.dims.0,
                steps: self.dims.1,
                major,
                align,
                lengths: &self.index[0],
            },
            LayoutName::Packed => BatchShape::Packed(PackedIndex {
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
/// batch's index tensors and resets, the initial states and the weights.
struct CallTensors {
    x: Tensor,
    index: Vec<Tensor>,
    resets: Option<Tensor>,
    h0: Vec<Tensor>,
    weights: Vec<Tensor>,
}

impl CallTensors {
    fn new(
        x: TensorArg,
        (index, resets): (Vec<TensorArg>, Option<TensorArg>),
        h0: Vec<TensorArg>,
        weights: Vec<TensorArg>,
    ) -> CallTensors {
        CallTensors {
            x: Tensor::new("input", x),
            index: Tensor::each("index", index),
            resets: resets.map(|r| Tensor::new("resets", r)),
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
                batch: Batch::read(layout, &self.x, &self.index, self.resets.as_ref())?,
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
            batch: unsafe { Batch::read(layout, &self.x, &self.index, self.resets.as_ref())? },
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
    /// The call over these inputs, with `options` (and the batch's resets).
    fn call<'a>(&'a self, options: CallOptions<'a>) -> Call<'a> {
        Call {
            input: self.batch.shape().with_data(self.data),
            weights: Some(&self.weights),
            h0: (!self.h0.is_empty()).then_some(&self.h0[..]),
            options: CallOptions { resets: self.batch.resets.as_deref(), ..options },
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
    /// The call over these inputs queued on `stream`, with `options` (and the batch's resets).
    fn call<'a>(&'a self, stream: u64, options: CallOptions<'a>) -> DeviceCall<'a> {
        DeviceCall {
            shape: self.batch.shape(),
            input: self.data,
            weights: &self.weights,
            h0: (!self.h0.is_empty()).then_some(&self.h0[..]),
            stream,
            options: CallOptions { resets: self.batch.resets.as_deref(), ..options },
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

    /// The model of `spec`, on this memory's device.
    fn model(self, spec: &str) -> Result<std::sync::Arc<Model>> {
        match self {
            Memory::Host { .. } => spec::model(spec, 0),
            Memory::Device { ordinal, .. } => spec::model(spec, ordinal),
        }
    }
}

/// A call's options as the operators give them: `masks` (`(seed,
/// offset)`), the rates, the dropout between layers, and the precision
/// asked for the products (`"f32"`, `"bf16"`, `"f16"` or `"tf32"`: what
/// `cellc.RNN` asks under autocast, for half-precision tensors, and of
/// float32 calls on the GPU where PyTorch lets cuDNN's RNN use TF32),
/// which `model`'s device computes or, where it has no such products,
/// computes in f32 ([`products`]).
fn options<'a>(
    model: &Model,
    masks: Option<(u64, u64)>,
    (rates, dropout): (Option<&'a [f32]>, Option<f32>),
    precision: &str,
) -> Result<CallOptions<'a>> {
    let asked = precision.parse::<Precision>().map_err(RuntimeError::Internal)?;
    Ok(CallOptions {
        masks: masks.map(|(seed, offset)| MaskSeed { seed, offset }),
        rates,
        dropout,
        resets: None,
        precision: Some(products(model, asked)?),
    })
}

/// The precision `model`'s device computes for a call of `cellc.RNN` that
/// asks for `asked`, or f32 where it has no such products: autocast asks,
/// it does not demand (PyTorch leaves ops without a lower-precision kernel
/// in f32 too), so the CPU's calls under fp16 autocast and the reference's
/// under any compute f32 products rather than fail.
fn products(model: &Model, asked: Precision) -> Result<Precision> {
    model.computes(asked).or_else(|_| model.computes(Precision::F32))
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
    resets: Option<TensorArg>,
    precision: &str,
) -> PyResult<()> {
    let tensors = CallTensors::new(x, (index, resets), h0, weights);
    let (output, finals) = (Tensor::new("output", output), Tensor::each("final_states", finals));
    let reserve = reserve.map(|r| Tensor::new("reserve", r));
    let memory = Memory::new(threads, device);
    py.detach(|| -> Result<()> {
        let model = memory.model(spec)?;
        let options = options(&model, masks, (rates.as_deref(), dropout), precision)?;
        match memory {
            // SAFETY (block): the Python half checked every tensor (contiguous,
            // on the CPU, f32 or i64) and holds them for the call; the outputs
            // are fresh tensors no input aliases.
            Memory::Host { threads } => unsafe {
                let inputs = tensors.read(&model, layout)?;
                let out = ForwardOut { output: output.floats_mut()?, final_states: write_all(&finals)? };
                let reserve = reserve.as_ref().map(|r| r.floats_mut()).transpose()?;
                threads::with_limit(threads, || model.forward_into(&inputs.call(options), out, reserve))
            },
            Memory::Device { stream, .. } => {
                // SAFETY: the Python half checked the index tensors (contiguous i64 on the CPU) and
                // every other tensor (contiguous f32 on the model's device), and holds them all.
                let inputs = unsafe { tensors.on_device(&model, layout)? };
                let out = DeviceForwardOut { output: output.on_device(), final_states: on_device(&finals) };
                let reserve = reserve.as_ref().map(Tensor::on_device);
                model.forward_into(&inputs.call(stream, options), &out, reserve)
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
    resets: Option<TensorArg>,
    precision: &str,
) -> PyResult<()> {
    let tensors = CallTensors::new(x, (index, resets), h0, weights);
    let (reserve, grad_output) = (Tensor::new("reserve", reserve), Tensor::new("grad_output", grad_output));
    let grad_finals = Tensor::each("grad_final_states", grad_finals);
    let (grad_input, grad_h0) = (Tensor::new("grad_input", grad_input), Tensor::each("grad_h0", grad_h0));
    let grad_weights = Tensor::each("grad_weights", grad_weights);
    let memory = Memory::new(threads, device);
    py.detach(|| -> Result<()> {
        let model = memory.model(spec)?;
        let options = options(&model, masks, (rates.as_deref(), dropout), precision)?;
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
                        &inputs.call(options),
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
                let call = inputs.call(stream, options);
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
        let model = Memory::Host { threads: 1 }.model(spec)?;
        // SAFETY: the Python half checked the tensors (contiguous, on the CPU,
        // f32 or i64) and holds them for the call.
        let (batch, data) = unsafe { (Batch::read(layout, &x, &index, None)?, x.floats()?) };
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
        let model = Memory::Host { threads: 1 }.model(spec)?;
        // SAFETY: the Python half checked the tensors (contiguous, on the CPU,
        // f32 or i64) and holds them for the call.
        let (batch, data) = unsafe { (Batch::read(layout, &x, &index, None)?, x.floats()?) };
        model.dropout_masks(batch.shape().with_data(data), MaskSeed { seed, offset }, Some(dropout))
    })
    .map_err(|e| to_python(py, e))
}
