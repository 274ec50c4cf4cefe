//! The runtime's typed errors: every bad input names the tensor and both
//! shapes, and no public function panics.

use std::fmt;

#[derive(Clone, Debug, PartialEq)]
pub enum RuntimeError {
    /// The `.cell` source did not compile: its diagnostics, typed, with the
    /// sources to render them against.
    Compile(Box<cellc::CompileError>),
    /// A file that compiles but has no cell (of that name).
    NoCell { file: String, name: Option<String> },
    /// A tensor has the wrong shape.
    Shape { tensor: String, expected: String, found: String },
    /// A sequence length is not positive or is longer than the padded length.
    Length { sequence: usize, length: i64, steps: usize },
    /// `batch_sizes` must be positive and non-increasing.
    BatchSizes { step: usize, message: String },
    /// A permutation (`sorted_indices`) is not one.
    Permutation { tensor: String, message: String },
    /// A weight is missing, or one the model does not have was given.
    MissingWeight { name: String },
    /// A pass without weights on a model that keeps none ([`crate::Model::without_weights`]).
    NoOwnWeights,
    UnexpectedWeight {
        name: String,
        /// The names the model's weights do have.
        expected: Vec<String>,
    },
    /// A tensor, or a pass over a batch, needs more memory than cellc can
    /// index or the machine has: refused before anything is allocated.
    TooLarge { what: String, bytes: u128, limit: String },
    /// A size variable has two values (bound by `-D` and inferred, or inferred twice).
    SizeConflict { size: String, first: usize, first_from: String, second: usize, second_from: String },
    /// A size variable has no value and none could be inferred.
    UnboundSize { size: String },
    /// Layer sizes do not fit together (e.g. a cell whose input must be `[H]` fed `2*H` features).
    Layer { layer: usize, message: String },
    /// A model that cannot run step by step ([`crate::Model::stream`]).
    NotStreamable { reason: String },
    /// The backend cannot run here (e.g. no CUDA driver).
    Backend { backend: String, message: String },
    /// Reading or writing weights or tensors.
    Io { path: String, message: String },
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
            RuntimeError::NotStreamable { reason } => write!(f, "this model cannot run step by step: {reason}"),
            RuntimeError::Backend { backend, message } => write!(f, "backend `{backend}`: {message}"),
            RuntimeError::Io { path, message } => write!(f, "{path}: {message}"),
            RuntimeError::Internal(m) => write!(f, "internal error (a bug in cellc): {m}"),
        }
    }
}

impl std::error::Error for RuntimeError {}

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

pub type Result<T> = std::result::Result<T, RuntimeError>;

/// `[2, 3, 4]`
pub(crate) fn shape_text(dims: &[usize]) -> String {
    let parts: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}
