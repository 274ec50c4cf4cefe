//! cellc's ONNX Runtime custom-operator library (`libcellc_onnx.so`): runs
//! the `cellc::RNN` nodes that `torch.onnx.export` writes for `cellc.RNN`
//! calls. ONNX Runtime loads it with
//! `SessionOptions.register_custom_ops_library(path)` (C:
//! `RegisterCustomOpsLibrary_V2`) and calls [`RegisterCustomOps`], which
//! adds the operator to the session's `cellc` domain.
//!
//! Each node carries its model's spec (the cell's source, sizes,
//! configuration and the cellc version that exported it): the kernel
//! compiles the cell when the session is made, and a spec of another cellc
//! version fails the session there, by name. Nothing of ONNX Runtime is
//! linked or downloaded at build time: the runtime hands the library its
//! API table when it registers the operators.

mod api;
mod kernel;
mod op;

pub use op::RegisterCustomOps;
