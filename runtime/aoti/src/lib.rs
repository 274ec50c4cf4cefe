//! cellc's operators for models that PyTorch's AOTInductor compiled
//! (`torch._inductor.aoti_compile_and_package`): the generated code calls
//! `cellc::cellc_rnn` through the C functions [`aoti_torch_cpu_cellc_rnn`]
//! (CPU tensors) and [`aoti_torch_cuda_cellc_rnn`] (CUDA tensors)
//! (the Python package declares them in
//! `torch._inductor.config.aot_inductor.custom_ops_to_c_shims`), not
//! through Python, so the package runs in a process without the Python
//! package: a C++ program that links this library beside libtorch, or a
//! Python process that loads it.
//!
//! The operator's spec (the cell's source, sizes, configuration and the
//! cellc version that exported it) is a constant argument of the call, so
//! the package carries everything the runtime needs to compile the cell;
//! a model exported by another cellc version is refused by name.

mod shim;
mod torch;

pub use shim::{aoti_torch_cpu_cellc_rnn, aoti_torch_cuda_cellc_rnn};
