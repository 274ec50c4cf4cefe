//! The eager inference call in one native call: what a generation loop or
//! an evaluation pass pays per call on the CPU. `cellc.RNN` makes an
//! [`Eager`] for a CPU model and hands it the call's tensors as they are;
//! it accepts only the plainest call (contiguous float32 CPU tensors of the
//! shapes the model takes, lengths as integers, nothing to draw) and reads
//! their addresses, makes the outputs and runs the pass without the Python
//! layer's steps. Anything else, a mistake included, it declines (`None`)
//! and the Python layer takes the call, so that every error keeps the one
//! type and message that layer gives it: this module decides nothing
//! about errors, only whether a call is plain.
//!
//! Inside `RNN.frozen()` ([`Eager::freeze`]) the plain calls read a copy
//! of the weights that a model of the module's own keeps, packed once for
//! the block, instead of the tensors of each call: a generation loop's
//! calls of one step otherwise spend as long reading the weights as
//! computing with them.

use crate::errors::to_python;
use crate::recycled;
use crate::spec;
use cellc_runtime::backend::cpu::threads;
use cellc_runtime::{Align, Call, ForwardOut, Input, Major, Model, Weights};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyTuple};
use std::sync::{Arc, Mutex};

/// The PyTorch objects a plain call is checked against, looked up once.
struct Torch {
    tensor: Py<PyAny>,
    parameter: Py<PyAny>,
    float32: Py<PyAny>,
    int64: Py<PyAny>,
}

fn torch(py: Python<'_>) -> PyResult<&Torch> {
    static TORCH: PyOnceLock<Torch> = PyOnceLock::new();
    TORCH.get_or_try_init(py, || {
        let torch = py.import("torch")?;
        Ok(Torch {
            tensor: torch.getattr("Tensor")?.unbind(),
            parameter: torch.getattr("nn")?.getattr("Parameter")?.unbind(),
            float32: torch.getattr("float32")?.unbind(),
            int64: torch.getattr("int64")?.unbind(),
        })
    })
}

/// A call's output and final states, as PyTorch tensors.
type Outputs<'py> = (Bound<'py, PyAny>, Vec<Bound<'py, PyAny>>);

/// A model's eager inference calls on the CPU (see the module documentation).
#[pyclass(module = "cellc._cellc", frozen)]
pub struct Eager {
    spec: String,
    model: Arc<Model>,
    major: Major,
    frozen: Mutex<Frozen>,
}

/// A module's frozen blocks ([`Eager::freeze`]).
#[derive(Debug, Default)]
struct Frozen {
    /// How many blocks the calls are inside: none, they read the module's weights.
    depth: usize,
    /// The model keeping the weights of the outermost block's entry.
    model: Option<Arc<Model>>,
}

impl std::fmt::Debug for Eager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Eager")
            .field("cell", &self.model.compiled().forward.name)
            .field("major", &self.major)
            .finish()
    }
}

#[pymethods]
impl Eager {
    /// The CPU model of `spec` (its `cpu` back end's, as every other call of it uses);
    /// `batch_first`: the module's layout.
    #[new]
    fn new(py: Python<'_>, spec: &str, batch_first: bool) -> PyResult<Eager> {
        let model = py.detach(|| spec::model(spec, 0)).map_err(|e| to_python(py, e))?;
        let major = if batch_first { Major::BatchFirst } else { Major::TimeFirst };
        Ok(Eager { spec: spec.to_string(), model, major, frozen: Mutex::default() })
    }

    /// Freezes the module's plain calls on `weights` (the module's, in the
    /// operators' order): until as many [`Eager::thaw`]s, they read a copy
    /// of them, packed for the products once, not the tensors of each call.
    /// False (nothing frozen) where a weight is not a plain float32 CPU
    /// tensor: the calls then read the module's weights as ever.
    fn freeze(&self, py: Python<'_>, weights: &Bound<'_, PyList>) -> PyResult<bool> {
        let mut frozen = self.frozen.lock().map_err(|_| poisoned())?;
        if frozen.depth > 0 {
            frozen.depth += 1;
            return Ok(true);
        }
        let t = torch(py)?;
        let names = self.model.weight_names();
        if names.len() != weights.len() {
            return Ok(false);
        }
        let Some(tensors) = plain_all(t, weights)? else { return Ok(false) };
        let mut copy = Weights::default();
        for ((name, _), (addr, shape)) in names.into_iter().zip(tensors) {
            let n = shape.iter().product::<usize>();
            // SAFETY: `plain` checked a contiguous float32 CPU tensor of `n` elements,
            // which the caller holds for this call; it is copied here.
            let data = unsafe { std::slice::from_raw_parts(addr as *const f32, n) }.to_vec();
            // A shape other than the model's is refused by `set_weights`, naming the weight.
            copy.insert(name, shape, data);
        }
        // The module's own model, made at its first block and kept between blocks with
        // its compiled kernels (a block of a few calls would pay their compilation again).
        let kept = frozen.model.take().and_then(|m| Arc::try_unwrap(m).ok());
        let model = py
            .detach(|| {
                let mut model = match kept {
                    Some(m) => m,
                    None => spec::unshared_model(&self.spec, 0)?,
                };
                model.set_weights(&copy).map(|()| model)
            })
            .map_err(|e| to_python(py, e))?;
        *frozen = Frozen { depth: 1, model: Some(Arc::new(model)) };
        Ok(true)
    }

    /// Undoes one [`Eager::freeze`]; the last one lets the calls read the module's weights
    /// again and drops the copy (the model stays, for the next block).
    fn thaw(&self) -> PyResult<()> {
        let mut frozen = self.frozen.lock().map_err(|_| poisoned())?;
        frozen.depth = frozen.depth.saturating_sub(1);
        if frozen.depth == 0 {
            if let Some(model) = frozen.model.as_mut().and_then(Arc::get_mut) {
                model.params_mut().iter_mut().flatten().for_each(|p| *p = Vec::new());
            }
        }
        Ok(())
    }

    /// The output and final states of an inference call, or `None` where the call is not a
    /// plain one (the Python layer then takes it, with its checks and errors).
    #[pyo3(signature = (x, weights, hx, lengths, align, threads))]
    #[allow(clippy::too_many_arguments)] // the call's own arguments, as the module's forward takes them
    fn infer<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        weights: &Bound<'py, PyList>,
        hx: &Bound<'py, PyAny>,
        lengths: &Bound<'py, PyAny>,
        align: &str,
        threads: usize,
    ) -> PyResult<Option<Outputs<'py>>> {
        let t = torch(py)?;
        let frozen = {
            let frozen = self.frozen.lock().map_err(|_| poisoned())?;
            frozen.model.clone().filter(|_| frozen.depth > 0)
        };
        let model: &Model = frozen.as_deref().unwrap_or(&self.model);
        let align = match align {
            "left" => Align::Left,
            "right" => Align::Right,
            _ => return Ok(None),
        };
        let Some((x_addr, x_shape)) = plain(t, x, &t.float32)? else { return Ok(None) };
        let [d0, d1, features] = x_shape[..] else { return Ok(None) };
        let (batch, steps) = match self.major {
            Major::BatchFirst => (d0, d1),
            Major::TimeFirst => (d1, d0),
        };
        if features != model.input_size() {
            return Ok(None);
        }
        let Some(lengths) = read_lengths(t, lengths, batch)? else { return Ok(None) };
        let slots = model.layers().len() * model.directions();
        let state_sizes = model.layers().first().map(|l| l.state_sizes.clone()).unwrap_or_default();
        let Some(h0) = read_states(t, hx, slots, batch, &state_sizes)? else { return Ok(None) };
        // Frozen, the model's own copy is read instead.
        let weight_slices = match frozen {
            Some(_) => Vec::new(),
            None => match plain_all(t, weights)? {
                Some(tensors) => {
                    tensors.into_iter().map(|(addr, shape)| (addr, shape.iter().product())).collect()
                }
                None => return Ok(None),
            },
        };
        // The outputs, fresh: the output laid out as the input, the final states.
        let out_shape = [x_shape[0], x_shape[1], model.output_size()];
        let output = recycled::recycled_tensor(py, out_shape.to_vec())?;
        let finals = state_sizes
            .iter()
            .map(|&size| recycled::recycled_tensor(py, vec![slots, batch, size]))
            .collect::<PyResult<Vec<_>>>()?;
        let (out_addr, _) = address(&output)?;
        let final_addrs = finals.iter().map(|f| address(f).map(|(a, _)| a)).collect::<PyResult<Vec<_>>>()?;
        let lengths_or_full = lengths.unwrap_or_else(|| vec![steps; batch]);
        let run = || -> cellc_runtime::Result<()> {
            // SAFETY (block): `plain` checked that every tensor is a contiguous float32 CPU
            // tensor of the shape read (its address and element count), held by the caller
            // for the call; the outputs are fresh tensors made above, of the shapes the
            // model writes, which nothing else refers to yet.
            let (data, weights, h0, output, finals) = unsafe {
                let data = std::slice::from_raw_parts(x_addr as *const f32, x_shape.iter().product());
                let weights: Vec<&[f32]> = weight_slices
                    .iter()
                    .map(|&(a, n)| std::slice::from_raw_parts(a as *const f32, n))
                    .collect();
                let h0: Vec<&[f32]> =
                    h0.iter().map(|&(a, n)| std::slice::from_raw_parts(a as *const f32, n)).collect();
                let output = std::slice::from_raw_parts_mut(out_addr as *mut f32, out_shape.iter().product());
                let finals: Vec<&mut [f32]> = final_addrs
                    .iter()
                    .zip(&state_sizes)
                    .map(|(&a, &size)| std::slice::from_raw_parts_mut(a as *mut f32, slots * batch * size))
                    .collect();
                (data, weights, h0, output, finals)
            };
            let weights = if frozen.is_some() { None } else { Some(model.group_by_slot(weights)?) };
            let input =
                Input::Padded { data, batch, steps, major: self.major, align, lengths: &lengths_or_full };
            let call = Call {
                weights: weights.as_deref(),
                h0: (!h0.is_empty()).then_some(&h0[..]),
                ..Call::new(input)
            };
            let out = ForwardOut { output, final_states: finals };
            threads::with_limit(threads, || model.forward_into(&call, out, None))
        };
        py.detach(run).map_err(|e| to_python(py, e))?;
        Ok(Some((output, finals)))
    }
}

/// The error of a lock whose holder panicked.
fn poisoned() -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err("cellc: a frozen module's state was poisoned by a panic")
}

/// A plain tensor's address and shape ([`plain`]).
type Plain = (usize, Vec<usize>);

/// Every weight's address and shape ([`plain`], float32), or `None` where one is not plain.
fn plain_all(t: &Torch, weights: &Bound<'_, PyList>) -> PyResult<Option<Vec<Plain>>> {
    let mut tensors = Vec::with_capacity(weights.len());
    for w in weights.iter() {
        let Some(tensor) = plain(t, &w, &t.float32)? else { return Ok(None) };
        tensors.push(tensor);
    }
    Ok(Some(tensors))
}

/// A plain tensor's address and shape: a `torch.Tensor` or `nn.Parameter` (no subclass) of
/// `dtype`, on the CPU, contiguous; `None` for anything else.
fn plain(t: &Torch, x: &Bound<'_, PyAny>, dtype: &Py<PyAny>) -> PyResult<Option<Plain>> {
    let py = x.py();
    let ty = x.get_type();
    if !(ty.is(t.tensor.bind(py)) || ty.is(t.parameter.bind(py))) {
        return Ok(None);
    }
    if !x.getattr(intern!(py, "dtype"))?.is(dtype.bind(py))
        || !x.getattr(intern!(py, "is_cpu"))?.extract::<bool>()?
        || !x.call_method0(intern!(py, "is_contiguous"))?.extract::<bool>()?
    {
        return Ok(None);
    }
    address(x).map(Some)
}

fn address(x: &Bound<'_, PyAny>) -> PyResult<(usize, Vec<usize>)> {
    let py = x.py();
    Ok((x.call_method0(intern!(py, "data_ptr"))?.extract()?, x.getattr(intern!(py, "shape"))?.extract()?))
}

/// The lengths of a plain call: `None` (every sequence runs all its steps) as `Some(None)`;
/// a list of `batch` Python integers or a `[batch]` int64 CPU tensor, none negative (the
/// runtime checks them against the steps, as it does every call's; a negative one is left to
/// the Python layer, which reports it as the integer it is).
fn read_lengths(t: &Torch, lengths: &Bound<'_, PyAny>, batch: usize) -> PyResult<Option<Option<Vec<usize>>>> {
    if lengths.is_none() {
        return Ok(Some(None));
    }
    let values: Vec<i64> = if lengths.is_exact_instance_of::<PyList>() {
        match lengths.extract::<Vec<i64>>() {
            Ok(v) => v,
            Err(_) => return Ok(None),
        }
    } else {
        let Some((addr, shape)) = plain(t, lengths, &t.int64)? else { return Ok(None) };
        if shape != [batch] {
            return Ok(None);
        }
        // SAFETY: a contiguous int64 CPU tensor of `batch` elements, held by the caller.
        unsafe { std::slice::from_raw_parts(addr as *const i64, batch) }.to_vec()
    };
    if values.len() != batch || values.iter().any(|&n| n < 0) {
        return Ok(None);
    }
    Ok(Some(Some(values.into_iter().map(|n| n as usize).collect())))
}

/// The initial states of a plain call, as (address, elements): none (`None`: zeros), one
/// tensor for a one-state cell, or a tuple or list with one per state, each a plain float32
/// `[slots, batch, size]`.
fn read_states(
    t: &Torch,
    hx: &Bound<'_, PyAny>,
    slots: usize,
    batch: usize,
    sizes: &[usize],
) -> PyResult<Option<Vec<(usize, usize)>>> {
    if hx.is_none() {
        return Ok(Some(Vec::new()));
    }
    let states: Vec<Bound<'_, PyAny>> =
        if hx.is_exact_instance_of::<PyTuple>() || hx.is_exact_instance_of::<PyList>() {
            hx.try_iter()?.collect::<PyResult<_>>()?
        } else {
            vec![hx.clone()]
        };
    if states.len() != sizes.len() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(states.len());
    for (h, &size) in states.iter().zip(sizes) {
        let Some((addr, shape)) = plain(t, h, &t.float32)? else { return Ok(None) };
        if shape != [slots, batch, size] {
            return Ok(None);
        }
        out.push((addr, slots * batch * size));
    }
    Ok(Some(out))
}
