//! The forward and backward operators' Rust side: the tensors of a call
//! as slices (in place, nothing copied), run by the runtime with the
//! interpreter lock released.

use crate::errors::to_python;
use crate::spec;
use crate::tensors::{Tensor, TensorArg};
use cellc_runtime::{
    Align, BackwardOut, Call, ForwardOut, Input, Major, Model, PackedView, Result, RuntimeError,
};
use pyo3::prelude::*;

/// A batch's input tensor and index tensors, read.
struct Batch<'a> {
    data: &'a [f32],
    layout: Layout,
    /// Padded: `[lengths]`; packed: `[batch_sizes, sorted_indices, unsorted_indices]`.
    index: Vec<Vec<usize>>,
    /// Padded: `(B, T)`; packed: `(N, 0)`.
    dims: (usize, usize),
    features: usize,
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

impl<'a> Batch<'a> {
    /// # Safety
    /// `x` and `index` per [`Tensor::floats`] and [`Tensor::indices`].
    unsafe fn read(layout_name: &str, x: &Tensor, index: &[Tensor]) -> Result<Batch<'a>> {
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
        if index.len() != expected {
            return Err(RuntimeError::Internal(format!(
                "{expected} index tensors expected, got {}",
                index.len()
            )));
        }
        // SAFETY (block): per the contract.
        unsafe {
            let index = index
                .iter()
                .enumerate()
                .map(|(i, t)| t.indices(i == 0 && expected == 1, dims.1))
                .collect::<Result<Vec<_>>>()?;
            Ok(Batch { data: x.floats()?, layout, index, dims, features })
        }
    }

    fn input(&self) -> Input<'_> {
        match self.layout {
            Layout::Padded(major, align) => Input::Padded {
                data: self.data,
                batch: self.dims.0,
                steps: self.dims.1,
                major,
                align,
                lengths: &self.index[0],
            },
            Layout::Packed => Input::Packed(PackedView {
                data: self.data,
                features: self.features,
                batch_sizes: &self.index[0],
                sorted_indices: &self.index[1],
                unsorted_indices: &self.index[2],
            }),
        }
    }
}

/// The weights as the model takes them, `[layer * directions + direction][param]`.
///
/// # Safety
/// Each tensor per [`Tensor::floats`].
unsafe fn weights<'a>(model: &Model, tensors: &[Tensor]) -> Result<Vec<Vec<&'a [f32]>>> {
    let names = model.weight_names();
    if tensors.len() != names.len() {
        return Err(RuntimeError::Shape {
            tensor: "weights".into(),
            expected: format!("{} tensors", names.len()),
            found: format!("{} tensors", tensors.len()),
        });
    }
    let per = model.compiled().forward.params.len();
    let slots = model.layers().len() * model.directions();
    // SAFETY: per the contract.
    let flat: Vec<&[f32]> = tensors.iter().map(|t| unsafe { t.floats() }).collect::<Result<_>>()?;
    Ok((0..slots).map(|s| flat[s * per..(s + 1) * per].to_vec()).collect())
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

/// A call's inputs, read: the batch, the weights by layer and direction, the initial states.
struct Inputs<'a> {
    batch: Batch<'a>,
    weights: Vec<Vec<&'a [f32]>>,
    h0: Vec<&'a [f32]>,
}

impl<'a> Inputs<'a> {
    /// # Safety
    /// Every tensor per [`Tensor::floats`] (the index tensors, [`Tensor::indices`]).
    unsafe fn read(
        model: &Model,
        layout: &str,
        x: &Tensor,
        index: &[Tensor],
        h0: &[Tensor],
        weights: &[Tensor],
    ) -> Result<Inputs<'a>> {
        // SAFETY (block): per the contract.
        unsafe {
            Ok(Inputs {
                batch: Batch::read(layout, x, index)?,
                weights: self::weights(model, weights)?,
                h0: read_all(h0)?,
            })
        }
    }

    fn call(&self) -> Call<'_> {
        Call {
            input: self.batch.input(),
            weights: Some(&self.weights),
            h0: (!self.h0.is_empty()).then_some(&self.h0[..]),
        }
    }
}

/// A forward pass over the caller's tensors: writes `output` and `finals`,
/// and, when `reserve` is given, what the backward reads into it.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn forward(
    py: Python<'_>,
    spec: &str,
    threads: usize,
    layout: &str,
    x: TensorArg,
    index: Vec<TensorArg>,
    h0: Vec<TensorArg>,
    weights: Vec<TensorArg>,
    output: TensorArg,
    finals: Vec<TensorArg>,
    reserve: Option<TensorArg>,
) -> PyResult<()> {
    let (x, index) = (Tensor::new("input", x), Tensor::each("index", index));
    let (h0, weights) = (Tensor::each("h0", h0), Tensor::each("weights", weights));
    let (output, finals) = (Tensor::new("output", output), Tensor::each("final_states", finals));
    let reserve = reserve.map(|r| Tensor::new("reserve", r));
    py.detach(|| -> Result<()> {
        let model = spec::model(spec, threads)?;
        // SAFETY (block): the Python half checked every tensor (contiguous,
        // on the CPU, f32 or i64) and holds them for the call; the outputs
        // are fresh tensors no input aliases.
        unsafe {
            let inputs = Inputs::read(&model, layout, &x, &index, &h0, &weights)?;
            let out = ForwardOut { output: output.floats_mut()?, final_states: write_all(&finals)? };
            let reserve = reserve.as_ref().map(|r| r.floats_mut()).transpose()?;
            model.forward_into(&inputs.call(), out, reserve)
        }
    })
    .map_err(|e| to_python(py, e))
}

/// The backward of a [`forward`] with a reserve: writes the gradients of
/// the input, the initial states (when given) and the weights.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn backward(
    py: Python<'_>,
    spec: &str,
    threads: usize,
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
) -> PyResult<()> {
    let (x, index) = (Tensor::new("input", x), Tensor::each("index", index));
    let (h0, weights) = (Tensor::each("h0", h0), Tensor::each("weights", weights));
    let (reserve, grad_output) = (Tensor::new("reserve", reserve), Tensor::new("grad_output", grad_output));
    let grad_finals = Tensor::each("grad_final_states", grad_finals);
    let (grad_input, grad_h0) = (Tensor::new("grad_input", grad_input), Tensor::each("grad_h0", grad_h0));
    let grad_weights = Tensor::each("grad_weights", grad_weights);
    py.detach(|| -> Result<()> {
        let model = spec::model(spec, threads)?;
        // SAFETY (block): as in `forward`.
        unsafe {
            let inputs = Inputs::read(&model, layout, &x, &index, &h0, &weights)?;
            let grad_finals = read_all(&grad_finals)?;
            let per = model.compiled().forward.params.len();
            let mut grad_weights = write_all(&grad_weights)?.into_iter();
            let d_params =
                (0..inputs.weights.len()).map(|_| grad_weights.by_ref().take(per).collect()).collect();
            // Initial-state gradients the caller does not want go to scratch buffers.
            let mut scratch: Vec<Vec<f32>>;
            let d_h0 = if grad_h0.is_empty() {
                let sizes = model.layers().first().map(|l| l.state_sizes.clone()).unwrap_or_default();
                let slots = model.layers().len() * model.directions();
                scratch = sizes.iter().map(|n| vec![0.0; slots * batch_size(&inputs.batch) * n]).collect();
                scratch.iter_mut().map(Vec::as_mut_slice).collect()
            } else {
                write_all(&grad_h0)?
            };
            let out = BackwardOut { d_input: grad_input.floats_mut()?, d_h0, d_params };
            let d_final = (!grad_finals.is_empty()).then_some(&grad_finals[..]);
            model.backward_from(&inputs.call(), reserve.floats()?, grad_output.floats()?, d_final, out)
        }
    })
    .map_err(|e| to_python(py, e))
}

fn batch_size(batch: &Batch) -> usize {
    match batch.layout {
        Layout::Padded(..) => batch.dims.0,
        Layout::Packed => batch.index[1].len(),
    }
}
