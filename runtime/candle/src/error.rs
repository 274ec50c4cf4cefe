//! The layer's errors: the runtime's, typed (a shape naming its tensor, a
//! length naming its sequence, ...), or candle's own.

use cellc_runtime::RuntimeError;
use std::fmt;

/// What a layer's call can fail with.
#[derive(Debug)]
pub enum Error {
    /// Bad input, named: the runtime's error as it is.
    Runtime(RuntimeError),
    /// An error of candle's (a tensor operation around the pass).
    Candle(candle_core::Error),
}

/// A result of the layer's calls.
pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Runtime(e) => write!(f, "{e}"),
            Error::Candle(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<RuntimeError> for Error {
    fn from(e: RuntimeError) -> Error {
        Error::Runtime(e)
    }
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Error {
        Error::Candle(e)
    }
}

/// So that `?` works in code returning candle's `Result` (the message kept, the type not).
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> candle_core::Error {
        match e {
            Error::Candle(e) => e,
            Error::Runtime(e) => candle_core::Error::wrap(e),
        }
    }
}
