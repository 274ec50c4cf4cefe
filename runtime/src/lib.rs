//! The cellc runtime: runs a compiled cell over real batches.
//!
//! A [`Model`] stacks a compiled cell into layers and directions, holds its
//! weights (loaded from a PyTorch `state_dict` in safetensors, or
//! initialised from a seed), and runs it on a [`backend::Device`] over
//! packed sequences or padded batches — batch- or time-first, padding at
//! the end or at the start — without sorting or copying the data: only the
//! lengths are sorted ([`sequence::BatchOrder`]) and rows are gathered and
//! scattered through a [`sequence::RowLayout`].
//!
//! ```
//! use cellc_runtime::{backend::reference::Reference, CompiledCell, Input, Major, Align, Model, ModelConfig};
//! use std::sync::Arc;
//!
//! let cell = CompiledCell::from_source("rnn.cell", "
//!     cell rnn {
//!         input x[I]
//!         state h[H]
//!         param weight_ih[H, I], weight_hh[H, H], bias_ih[H], bias_hh[H]
//!         h' = tanh(weight_ih @ x + bias_ih + weight_hh @ h + bias_hh)
//!         output h'
//!     }", None)?;
//! let sizes = [("H".to_string(), 4)].into();
//! let config = ModelConfig { layers: 2, bidirectional: true };
//! let model = Model::new(Arc::new(cell), config, &sizes, Some(3), None, 42, Box::new(Reference))?;
//!
//! // Two sequences of lengths 3 and 1, padded to 3 steps, batch-first.
//! let x = vec![0.5f32; 2 * 3 * 3];
//! let out = model.forward(
//!     Input::Padded { data: &x, batch: 2, steps: 3, major: Major::BatchFirst, align: Align::Left, lengths: &[3, 1] },
//!     None,
//! )?;
//! assert_eq!(out.data.len(), 2 * 3 * 8);             // [B, T, 2 * H]
//! assert!(out.data[(3 + 1) * 8..].iter().all(|&v| v == 0.0)); // padding stays zero
//! assert_eq!(out.final_states[0].len(), 4 * 2 * 4);  // [layers * directions, B, H]
//! # Ok::<(), cellc_runtime::RuntimeError>(())
//! ```

#![warn(missing_docs)]

pub mod backend;
pub mod cell;
pub mod dropout;
pub mod error;
pub mod exact;
pub mod files;
pub mod input;
pub mod layers;
pub mod masks;
pub(crate) mod memory;
pub mod model;
pub mod options;
pub mod pass;
pub mod plan;
pub mod pool;
pub mod resets;
pub mod results;
pub mod sequence;
pub mod spec;
pub mod weights;

pub use call::{Call, CallerMemory};
pub use cellc::precision::Precision;
pub use device_call::{DeviceBackwardOut, DeviceCall, DeviceFloats, DeviceForwardOut};
pub use dropout::MaskSeed;
pub use error::{Result, RuntimeError};
pub use files::{read_at_most, write_atomically, MOST_CELL_BYTES};
pub use input::{BatchShape, Input};
pub use model::passes::Trace;
pub use model::{call, device_call, stream};
pub use model::{CompiledCell, Layer, Model, ModelConfig, Side};
pub use options::CallOptions;
pub use results::{BackwardOut, ForwardOut, Gradients, Output};
pub use sequence::{Align, BatchOrder, Major, PackedIndex, PackedSequence, PackedView, RowLayout};
pub use stream::Stream;
pub use weights::{
    read_metadata, read_tensors, write_tensors, write_tensors_with_metadata, Metadata, Tensor, TensorData,
    Weights,
};

/// Gives the memory kept for reuse back to the system: the recycled
/// buffers ([`pool`]), the CPU back end's recycled weight panels, and what
/// the C allocator holds free. For when no model is left to reuse them (the
/// Python package calls it when its last module is deleted).
pub fn release_memory() {
    backend::cpu::aligned::release_recycled();
    pool::release();
}
