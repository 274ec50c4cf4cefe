//! `charlm`: a character-level language model in candle whose recurrent
//! network is a `.cell` file, compiled by cellc and run (forward and
//! backward) by the runtime's CPU back end as a candle layer
//! (`cellc-candle`); the embedding, head, cross-entropy and AdamW are
//! candle-nn's.
//!
//! One module per job:
//!
//! - [`text`]: the corpus (one sequence per line), its vocabulary, the
//!   train/validation split and the unigram baseline;
//! - [`batches`]: padded batches of variable-length sequences, bucketed by length;
//! - [`lm`]: the model, the loss of a batch, its score;
//! - [`train`]: the training loop (global-norm clipping, AdamW), its
//!   learning-rate schedule and history;
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
pub mod lm;
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
    Candle(candle_core::Error),
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
            Error::Candle(e) => write!(f, "{e}"),
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

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Error {
        Error::Candle(e)
    }
}

impl From<cellc_candle::Error> for Error {
    fn from(e: cellc_candle::Error) -> Error {
        match e {
            cellc_candle::Error::Runtime(e) => Error::Runtime(e),
            cellc_candle::Error::Candle(e) => Error::Candle(e),
        }
    }
}

impl Error {
    pub(crate) fn io(path: &std::path::Path, e: impl fmt::Display) -> Error {
        Error::Io { path: path.display().to_string(), message: e.to_string() }
    }
}
