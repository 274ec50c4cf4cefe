//! The runtime's typed errors: every bad input names the tensor and both
//! shapes, and no public function panics.

use std::fmt;

/// Every error the runtime returns; its `Display` is a complete message.
#[derive(Clone, Debug, PartialEq)]
pub enum RuntimeError {
    /// The `.cell` source did not compile: its diagnostics, typed, with the
    /// sources to render them against.
    Compile(Box<cellc::CompileError>),
    /// A file that compiles but has no cell (of that name).
    NoCell {
        /// The file's name.
        file: String,
        /// The cell's name asked for; `None` where none was (the file has no cell at all).
        name: Option<String>,
    },
    /// A tensor has the wrong shape.
    Shape {
        /// The tensor, as the caller knows it (`input`, `lengths`, a weight's name).
        tensor: String,
        /// The shape it should have (with its element count where that helps).
        expected: String,
        /// The shape or length it has.
        found: String,
    },
    /// A sequence length is not positive or is longer than the padded length.
    Length {
        /// The sequence's index in the batch.
        sequence: usize,
        /// Its length as given (a caller's may be negative).
        length: i64,
        /// The padded length, `T`.
        steps: usize,
    },
    /// `batch_sizes` must be positive and non-increasing.
    BatchSizes {
        /// The step whose batch size is wrong.
        step: usize,
        /// What is wrong with it.
        message: String,
    },
    /// A permutation (`sorted_indices`) is not one.
    Permutation {
        /// `sorted_indices` or `unsorted_indices`.
        tensor: String,
        /// What is wrong with it.
        message: String,
    },
    /// A weight the model needs was not given.
    MissingWeight {
        /// The weight's name, as in a PyTorch `state_dict`.
        name: String,
    },
    /// A pass without weights on a model that keeps none ([`crate::Model::without_weights`]).
    NoOwnWeights,
    /// A weight was given that the model does not have.
    UnexpectedWeight {
        /// The name given.
        name: String,
        /// The names the model's weights do have.
        expected: Vec<String>,
    },
    /// A tensor, or a pass over a batch, needs more memory than cellc can
    /// index or the machine has: refused before anything is allocated.
    TooLarge {
        /// What needs the memory (a tensor and its shape, a pass).
        what: String,
        /// The bytes it needs at least.
        bytes: u128,
        /// The limit it exceeds, in words, with where that limit comes from.
        limit: String,
    },
    /// A size variable has two values (bound by `-D` and inferred, or inferred twice).
    SizeConflict {
        /// The size variable, e.g. `H`.
        size: String,
        /// The value bound first.
        first: usize,
        /// Where the first value came from (`-D`, a weight, the input).
        first_from: String,
        /// The value that disagrees.
        second: usize,
        /// Where the second value came from.
        second_from: String,
    },
    /// A size variable has no value and none could be inferred.
    UnboundSize {
        /// The size variable, e.g. `H`.
        size: String,
    },
    /// Layer sizes do not fit together (e.g. a cell whose input must be `[H]` fed `2*H` features).
    Layer {
        /// The layer's index, from 0.
        layer: usize,
        /// What does not fit.
        message: String,
    },
    /// A dropout rate out of range, or one the model does not have.
    Rate {
        /// The rate's name (`dropout`).
        name: String,
        /// What is wrong with it.
        message: String,
    },
    /// A model that cannot run step by step ([`crate::Model::stream`]).
    NotStreamable {
        /// Why not (e.g. a bidirectional model).
        reason: String,
    },
    /// The backend cannot run here (e.g. no CUDA driver).
    Backend {
        /// The back end's name ([`crate::backend::Device::name`]).
        backend: String,
        /// What went wrong.
        message: String,
    },
    /// Reading or writing weights or tensors.
    Io {
        /// The file.
        path: String,
        /// What went wrong: the operating system's error, or what is wrong with the file.
        message: String,
    },
    /// A compiler invariant broke: a bug.
    Internal(String),
}

impl fmt::Display for RuntimeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuntimeError::Compile(e) => write!(f, "the cell does not compile:\n{}", e.rendered),
            RuntimeError::NoCell { file, name: None } => write!(f, "{file} defines no cell"),
            RuntimeError::NoCell { file, name: Some(n) } => write!(f, "{file} defines no cell named `{n}`"),
            RuntimeError::Shape { tensor, expected, found } => {
                write!(f, "`{tensor}` has shape {found}, expected {expected}")
            }
            RuntimeError::Length { sequence, length, .. } if *length < 0 => {
                write!(f, "sequence {sequence} has negative length {length}")
            }
            RuntimeError::Length { sequence, length, steps } if *length == 0 => {
                write!(f, "sequence {sequence} has length 0 (every sequence needs at least one step; the padded length is {steps})")
            }
            RuntimeError::Length { sequence, length, steps } => {
                write!(f, "sequence {sequence} has length {length}, longer than the {steps} padded steps")
            }
            RuntimeError::BatchSizes { step, message } => write!(f, "`batch_sizes[{step}]`: {message}"),
            RuntimeError::Permutation { tensor, message } => write!(f, "`{tensor}` is not a permutation: {message}"),
            RuntimeError::MissingWeight { name } => write!(f, "weight `{name}` is missing"),
            RuntimeError::NoOwnWeights => write!(
                f,
                "this model keeps no weights of its own (Model::without_weights): pass them with each call"
            ),
            RuntimeError::UnexpectedWeight { name, expected } => {
                const SHOWN: usize = 8;
                let mut names: Vec<String> = expected.iter().take(SHOWN).map(|n| format!("`{n}`")).collect();
                if expected.len() > SHOWN {
                    names.push(format!("and {} more", expected.len() - SHOWN));
                }
                let have = if names.is_empty() { "none".to_string() } else { names.join(", ") };
                write!(f, "weight `{name}` does not belong to this model (its weights: {have})")
            }
            RuntimeError::TooLarge { what, bytes, limit } => {
                write!(f, "{what} needs {}: {limit}", cellc::interp::bytes_text(*bytes))
            }
            RuntimeError::SizeConflict { size, first, first_from, second, second_from } => write!(
                f,
                "size `{size}` is bound two ways: {size}={first} from {first_from}, {size}={second} from {second_from}"
            ),
            RuntimeError::UnboundSize { size } => {
                write!(f, "size `{size}` has no value and cannot be inferred (bind it with -D {size}=N)")
            }
            RuntimeError::Layer { layer, message } => write!(f, "layer {layer}: {message}"),
            RuntimeError::Rate { name, message } => write!(f, "rate `{name}` {message}"),
            RuntimeError::NotStreamable { reason } => write!(f, "this model cannot run step by step: {reason}"),
            RuntimeError::Backend { backend, message } => write!(f, "backend `{backend}`: {message}"),
            RuntimeError::Io { path, message } => write!(f, "{path}: {message}"),
            RuntimeError::Internal(m) => write!(f, "internal error (a bug in cellc): {m}"),
        }
    }
}

impl std::error::Error for RuntimeError {}

/// An error of the CUDA back end (every module of `backend::cuda` names its errors with it).
pub(crate) fn cuda_error(message: impl Into<String>) -> RuntimeError {
    RuntimeError::Backend { backend: "cuda".into(), message: message.into() }
}

impl RuntimeError {
    /// A weight's shape error, named as its gradient's (a gradient buffer
    /// is checked against its weight's shape).
    pub(crate) fn named_as_gradient(self) -> RuntimeError {
        match self {
            RuntimeError::Shape { tensor, expected, found } => {
                RuntimeError::Shape { tensor: format!("gradient of {tensor}"), expected, found }
            }
            other => other,
        }
    }
}

impl From<cellc::InterpError> for RuntimeError {
    fn from(e: cellc::InterpError) -> RuntimeError {
        match e {
            cellc::InterpError::UnboundSize { size, .. } => RuntimeError::UnboundSize { size },
            cellc::InterpError::Shape { tensor, expected, found } => {
                RuntimeError::Shape { tensor, expected, found }
            }
            cellc::InterpError::TooLarge { what, shape, elements } => RuntimeError::TooLarge {
                what: format!("{what} {shape}"),
                bytes: elements * 4,
                limit: format!("one tensor may have at most {} elements", cellc::interp::MAX_TENSOR_ELEMENTS),
            },
            other => RuntimeError::Internal(other.to_string()),
        }
    }
}

/// A result whose error is a [`RuntimeError`].
pub type Result<T> = std::result::Result<T, RuntimeError>;

/// `[2, 3, 4]`
pub(crate) fn shape_text(dims: &[usize]) -> String {
    let parts: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}
