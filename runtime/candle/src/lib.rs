//! cellc as a layer of candle: a fused RNN of any `.cell` cell, its
//! forward and derived backward run by cellc's runtime inside candle's
//! autograd, its weights candle tensors under PyTorch's names.
//!
//! ```
//! # fn main() -> cellc_candle::Result<()> {
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use cellc_candle::{Padding, Rnn};
//! use cellc_runtime::{backend::cpu::{Cpu, Kernels}, CompiledCell, Model, ModelConfig};
//!
//! let cell = CompiledCell::from_file("../../cells/lstm.cell".as_ref(), None)?; // the repository's LSTM
//! let backend = Box::new(Cpu::new(2, Kernels::Fastest)?);
//! let config = ModelConfig { layers: 1, bidirectional: false };
//! let sizes = [("H".to_string(), 8)].into();
//! let model = Model::new(cell.into(), config, &sizes, Some(3), None, 1, backend)?;
//!
//! let varmap = VarMap::new();                                       // the weights: weight_ih_l0, ...
//! let rnn = Rnn::new(model, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("rnn"))?;
//! let x = Tensor::randn(0f32, 1., (4, 5, 3), &Device::Cpu)?;       // [B, T, I], padded
//! let lengths = [5, 2, 4, 3];                                       // unsorted is fine
//! let out = rnn.forward(&x, &lengths, Padding::default())?;         // [B, T, H], zeros at padding
//! assert_eq!(out.dims(), [4, 5, 8]);
//!
//! let grads = out.sqr()?.sum_all()?.backward()?;                   // reaches every Var
//! for (name, w) in rnn.weights() {                                  // weight_ih_l0, ..., bias_hh_l0
//!     assert!(grads.get(w).is_some_and(|g| g.dims() == w.dims()), "{name}");
//! }
//! assert_eq!(varmap.all_vars().len(), 4);
//! # Ok(()) }
//! ```
//!
//! **Three operands.** candle's custom ops take at most three tensors and
//! give back one. The layer's op takes the input, every weight in
//! one flat buffer and every initial state in one flat buffer, and gives
//! back the output followed, when asked for, by the final states, which
//! the layer cuts out as views. The weights stay one candle tensor each,
//! each a `Var` of the `VarMap` under its PyTorch name (so a `VarMap`
//! saves, loads and optimises them, and a PyTorch `state_dict` loads
//! through `VarBuilder` as it is); the flat operand is their
//! concatenation, made each forward (one copy of the weights, 1.3 MB for
//! the main job's LSTM), whose backward hands each weight its slice of the
//! gradient. One flat `Var` with named views, as cuDNN keeps its weights,
//! would save that copy but not be a candle layer: views of a `Var` are
//! not `Var`s, so no candle optimiser or `VarMap` would see them.
//!
//! **Tapes.** A training forward keeps what the backward reads (the back
//! end's tapes) in a reserve owned by the op node, which candle's graph
//! holds until the backward and drops with the graph. A forward in which
//! no operand tracks a gradient ([`Rnn::detach`]) keeps nothing.
//!
//! **Devices.** candle's CPU device. candle 0.11 and cellc's runtime use
//! the same cudarc (0.19), so the CUDA back end's device-memory passes
//! (`Model::forward_into`) can run on a candle CUDA tensor's memory
//! and stream; this crate does not do it yet: candle's `cuda` feature
//! compiles its kernels with `nvcc`, which neither CI nor the development
//! machine has, so such a build could not be tested here. A CUDA tensor
//! gets an error naming the device.

#![warn(missing_docs)]

mod batch;
mod error;
mod layer;
mod op;

pub use cellc_runtime::{Align, Major};
pub use error::{Error, Result};
pub use layer::{Padding, Rnn};
