//! `charlm`: a character-level language model whose recurrent network is a
//! `.cell` file, compiled by cellc and run (forward and backward) by the
//! runtime's CPU back end.
//!
//! Everything around the RNN is plain Rust here, one module per job:
//!
//! - [`text`]: the corpus (one sequence per line), its vocabulary, the
//!   train/validation split and the unigram baseline;
//! - [`batches`]: padded batches of variable-length sequences, bucketed by length;
//! - [`linalg`]: matrix products through the `gemm` crate;
//! - [`embedding`] and [`head`]: the layers before and after the RNN, the
//!   head with its softmax cross-entropy masked to the real lengths;
//! - [`lm`]: the whole model, the loss of a batch and its gradients;
//! - [`optim`]: Adam and global-norm gradient clipping;
//! - [`train`]: the training loop, its learning-rate schedule and history;
//! - [`sample`]: text generation;
//! - [`checkpoint`]: weights in safetensors under a PyTorch module's names;
//! - [`plot`]: the loss curve as an SVG image;
//! - [`paths`]: where the repository keeps the cells, the text and the
//!   PyTorch export.
//!
//! The `charlm` example trains one from the command line; `charlm_pytorch`
//! runs one trained by PyTorch (`examples/pytorch/train_export.py`).

pub mod batches;
pub mod checkpoint;
pub mod embedding;
pub mod head;
pub mod linalg;
pub mod lm;
pub mod optim;
pub mod paths;
pub mod plot;
pub mod sample;
pub mod text;
pub mod train;

pub use batches::Batch;
pub use lm::{CharLm, LmSpec};
pub use text::{Corpus, Vocab};

use std::fmt;

/// What can go wrong in this crate: the runtime's errors, files, text
/// outside the vocabulary, malformed checkpoints.
#[derive(Debug)]
pub enum Error {
    Runtime(cellc_runtime::RuntimeError),
    Io {
        path: String,
        message: String,
    },
    /// Text with a character the model's vocabulary lacks.
    UnknownChar {
        ch: char,
        context: String,
    },
    /// A checkpoint or corpus that does not hold what it must.
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Runtime(e) => write!(f, "{e}"),
            Error::Io { path, message } => write!(f, "{path}: {message}"),
            Error::UnknownChar { ch, context } => {
                write!(f, "{context}: the character {ch:?} is not in the model's vocabulary")
            }
            Error::Invalid(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for Error {}

impl From<cellc_runtime::RuntimeError> for Error {
    fn from(e: cellc_runtime::RuntimeError) -> Error {
        Error::Runtime(e)
    }
}

impl Error {
    pub(crate) fn io(path: &std::path::Path, e: impl fmt::Display) -> Error {
        Error::Io { path: path.display().to_string(), message: e.to_string() }
    }
}
