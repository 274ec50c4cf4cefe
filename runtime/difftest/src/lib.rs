//! Differential testing of cellc: random valid cells
//! ([`cellc::fuzzgen`]) run on every back end — the reference back end,
//! the CPU back end with JIT-compiled, interpreted and ahead-of-time
//! linked kernels, and the CUDA back end on the emulated device — at
//! random small sizes, as stacked and bidirectional models on unsorted
//! variable-length batches in every layout, forwards and backwards, each
//! against the interpreter run on every sequence alone in f64; and each
//! cell's derived backward against finite differences.
//!
//! [`fuzz::run_seed`] is one seed end to end (generate, check, confirm,
//! shrink); `cellc fuzz` runs seeds for as long as it is asked to, the
//! tests run a fixed set, and the cargo-fuzz target feeds the generator a
//! fuzzer's bytes.

pub mod backends;
pub mod batch;
pub mod check;
pub mod fuzz;
pub mod oracle;

pub use backends::BackendKind;
pub use check::{check, Case, Check, Checks, Failure, Passed};
pub use fuzz::{run_seed, Found, Outcome};
