//! Why a cell could not be bound to sizes or run on the data given, and
//! the limit on one tensor's size that binding checks.

use std::fmt;

/// Why a cell could not be bound to sizes or run on the data given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InterpError {
    /// A size variable has no value.
    UnboundSize {
        /// The cell's name.
        cell: String,
        /// The size variable, e.g. `H`.
        size: String,
    },
    /// A declared dimension is zero or negative for these sizes.
    NonPositiveDim {
        /// What has the dimension, e.g. ``input `x` `` or `value v3`.
        what: String,
        /// The dimension as written symbolically, e.g. `H - 4`.
        dim: String,
        /// Its value under the bindings.
        value: i64,
    },
    /// A dimension overflowed.
    DimOverflow {
        /// What has the dimension, e.g. ``state `h` ``.
        what: String,
        /// The dimension or slice offset, symbolically; empty when the inputs' total size overflowed.
        dim: String,
    },
    /// A tensor's length does not match its declared shape.
    Shape {
        /// Which tensor: `input`, ``state h``, a parameter's name, `d_outputs`, or a value id.
        tensor: String,
        /// The shape it should have, e.g. `[3]` or `[4, 3] (12 elements)`.
        expected: String,
        /// What was given, e.g. `[2]` or `10 elements`.
        found: String,
    },
    /// A parameter the cell declares was not given.
    MissingParam {
        /// The parameter's name.
        name: String,
    },
    /// A parameter was given by a name the cell does not declare.
    UnknownParam {
        /// The name given.
        name: String,
    },
    /// The wrong number of states or parameters.
    Count {
        /// What was counted: `states` or `parameters`.
        what: &'static str,
        /// How many the cell declares.
        expected: usize,
        /// How many were given.
        found: usize,
    },
    /// A parameter's initialiser could not be evaluated.
    Init {
        /// The parameter's name.
        param: String,
        /// Why, e.g. the size that has no value or the non-finite result.
        message: String,
    },
    /// A tensor has more elements than a kernel can index.
    TooLarge {
        /// Which tensor, e.g. ``parameter `w` ``.
        what: String,
        /// Its shape at these sizes, e.g. `[65536, 65536]`.
        shape: String,
        /// Its number of elements (over [`MAX_TENSOR_ELEMENTS`]).
        elements: u128,
    },
    /// A compiler bug surfaced (an IR invariant broken).
    Internal {
        /// What went wrong.
        message: String,
    },
}

/// The most elements one tensor (a value, state, input or parameter) may
/// have: kernels index a value with 32-bit integers (CUDA's `int`,
/// cuBLAS's dimensions), and a larger one would not fit in memory anyway.
pub const MAX_TENSOR_ELEMENTS: u128 = i32::MAX as u128;

/// A byte count for people: `4.0 TB`, `512 bytes`.
pub fn bytes_text(bytes: u128) -> String {
    const UNITS: [&str; 6] = ["kB", "MB", "GB", "TB", "PB", "EB"];
    if bytes < 1000 {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64 / 1000.0;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

impl fmt::Display for InterpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InterpError::UnboundSize { cell, size } => {
                write!(f, "size variable `{size}` of cell `{cell}` has no value (bind it with -D {size}=N)")
            }
            InterpError::NonPositiveDim { what, dim, value } => {
                write!(f, "{what} has size [{dim}] = {value}, which is not positive")
            }
            InterpError::DimOverflow { what, dim } => write!(f, "{what} has size [{dim}], which overflows"),
            InterpError::Shape { tensor, expected, found } => {
                write!(f, "`{tensor}` has shape {found}, expected {expected}")
            }
            InterpError::MissingParam { name } => write!(f, "parameter `{name}` is missing"),
            InterpError::UnknownParam { name } => write!(f, "`{name}` is not a parameter of this cell"),
            InterpError::Count { what, expected, found } => {
                write!(f, "expected {expected} {what}, found {found}")
            }
            InterpError::Init { param, message } => write!(f, "cannot initialise `{param}`: {message}"),
            InterpError::TooLarge { what, shape, elements } => write!(
                f,
                "{what} has shape {shape}: {elements} elements need {} as f32, and one tensor may have at most {MAX_TENSOR_ELEMENTS} elements",
                bytes_text(elements * 4)
            ),
            InterpError::Internal { message } => write!(f, "internal compiler error: {message}"),
        }
    }
}

impl std::error::Error for InterpError {}
