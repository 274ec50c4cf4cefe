//! The CUDA back end. So far: NVRTC compilation of the generated kernels
//! (`cellc::cuda` writes them), loaded at run time with no CUDA toolkit at
//! build time. Running them through the driver API comes next.

pub mod nvrtc;
