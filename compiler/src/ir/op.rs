//! The closed set of operations a step graph is made of.
//!
//! Adding an op means adding a variant here; every `match` on [`Op`] in the
//! passes and back ends then fails to compile until it handles it.

use crate::dims::Dim;
use std::fmt;

/// What computes a value: a leaf (input, state, parameter, constant, seed) or
/// an operation on operand values.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `inputs[i]` at this step: a slice of the step's feature vector.
    Input(usize),
    /// `states[i]` at the start of the step.
    State(usize),
    /// `params[i]`, a vector or a matrix.
    Param(usize),
    /// A scalar constant.
    Const(f64),
    /// The value of a dimension, as a scalar (`mean`'s adjoint divides by it).
    DimValue(Dim),
    /// Mask `i` of the cell ([`super::MaskDecl`]): a vector the runtime
    /// fills for each row, random in training (see [`super::masks`]).
    Mask(usize),
    /// `seeds[i]` of a backward step: the adjoint flowing in from outside
    /// (the output's, or a next state's).
    Seed(usize),
    /// Elementwise, one operand; result has the operand's type.
    Unary(UnaryOp),
    /// Elementwise, two operands of equal type (scalars are broadcast explicitly).
    Binary(BinaryOp),
    /// A scalar repeated into a vector of the node's type.
    Broadcast,
    /// Matrix `[m, n]` (operand 0) times vector `[n]` (operand 1), giving `[m]`.
    MatVec,
    /// Transposed: matrix `[m, n]` (operand 0) times vector `[m]`, giving `[n]`
    /// (`Wᵀ dy`, the adjoint of `matvec` for its vector).
    MatVecT,
    /// Outer product of `[m]` and `[n]`, giving a matrix `[m, n]`
    /// (`dy ⊗ x`, the adjoint of `matvec` for its matrix).
    Outer,
    /// A vector reduced to a scalar.
    Reduce(ReduceOp),
    /// The elements `[offset, offset + len)` of a vector; `len` is the node's dimension.
    Slice {
        /// Index of the first element taken.
        offset: Dim,
    },
    /// Operands joined end to end.
    Concat,
    /// `where(cond, a, b)`, elementwise: `a` where `cond` is nonzero, `b`
    /// where it is zero, NaN where it is NaN. Three operands of one type.
    Select,
    /// The operand placed at `offset` in a zero vector of the node's dimension
    /// (the adjoint of `slice`).
    Pad {
        /// Index in the result where the operand's first element goes.
        offset: Dim,
    },
}

/// An elementwise operation of one operand: a built-in function of the
/// language (`tanh(x)`), negation (`-x`), or an op the compiler inserts
/// (`step`, `sign`, `copy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `-x`.
    Neg,
    /// `sigmoid(x) = 1 / (1 + e^-x)`.
    Sigmoid,
    /// `tanh(x)`.
    Tanh,
    /// `relu(x) = max(x, 0)`.
    Relu,
    /// `exp(x) = e^x`.
    Exp,
    /// `log(x)`, the natural logarithm.
    Log,
    /// `sqrt(x)`.
    Sqrt,
    /// `rsqrt(x) = 1 / sqrt(x)`.
    Rsqrt,
    /// `abs(x) = |x|`.
    Abs,
    /// `softplus(x) = log(1 + e^x)`.
    Softplus,
    /// `silu(x) = x * sigmoid(x)`.
    Silu,
    /// 1 where the operand is positive, else 0; NaN for NaN (internal: `relu`'s adjoint).
    Step,
    /// -1, 0 or 1; NaN for NaN (internal: `abs`'s adjoint).
    Sign,
    /// The operand itself, as a value of its own (internal: a next state
    /// or state adjoint computed in the step; see `passes::materialize`).
    Copy,
    /// `stop_gradient(x) = x`, through which no adjoint flows: the
    /// backward step treats it as a constant (`torch.no_grad`'s `detach`).
    StopGradient,
}

/// An elementwise operation of two operands: an infix operator (`a + b`), a
/// two-argument built-in (`min(a, b)`), or `ge`, which only backward steps use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`, elementwise.
    Mul,
    /// `a / b`.
    Div,
    /// `min(a, b)`.
    Min,
    /// `max(a, b)`.
    Max,
    /// 1 where `a >= b`, else 0; NaN if either is (`min`/`max`'s adjoints,
    /// and the comparisons `>=`, `<=`, `==`, `!=`).
    Ge,
    /// 1 where `a > b`, else 0; NaN if either is (the comparisons `>` and `<`).
    Gt,
}

/// A reduction of a vector to a scalar, written as a built-in call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// `sum(v)`: the sum of the elements.
    Sum,
    /// `mean(v) = sum(v) / len(v)`.
    Mean,
}

impl UnaryOp {
    /// The built-in functions of this kind, by their source names.
    pub const BUILTINS: [UnaryOp; 11] = [
        UnaryOp::Sigmoid,
        UnaryOp::Tanh,
        UnaryOp::Relu,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Abs,
        UnaryOp::Softplus,
        UnaryOp::Silu,
        UnaryOp::StopGradient,
    ];

    /// The op's source name for a built-in (`tanh`), else its IR mnemonic (`neg`, `step`).
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Relu => "relu",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Abs => "abs",
            UnaryOp::Softplus => "softplus",
            UnaryOp::Silu => "silu",
            UnaryOp::Step => "step",
            UnaryOp::Sign => "sign",
            UnaryOp::Copy => "copy",
            UnaryOp::StopGradient => "stop_gradient",
        }
    }

    /// The built-in function called `name`, if it is a one-argument built-in.
    pub fn from_builtin(name: &str) -> Option<UnaryOp> {
        UnaryOp::BUILTINS.into_iter().find(|op| op.name() == name)
    }

    /// The op's definition, in f64. Backends must agree with this.
    pub fn apply(self, x: f64) -> f64 {
        apply_unary(self, x)
    }
}

/// The semantics of the unary ops, for any float type. A NaN operand
/// gives NaN for every op (as PyTorch's `relu`, `sign` and friends do), so
/// a NaN in the data or the weights is never hidden behind a finite value.
pub fn apply_unary<T: num_traits::Float>(op: UnaryOp, x: T) -> T {
    let (zero, one) = (T::zero(), T::one());
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Sigmoid => one / (one + (-x).exp()),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Relu => {
            if x < zero {
                zero
            } else {
                x
            }
        }
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => one / x.sqrt(),
        UnaryOp::Abs => x.abs(),
        // log(1 + e^x), computed without overflow for large x.
        UnaryOp::Softplus => x.max(zero) + (-x.abs()).exp().ln_1p(),
        UnaryOp::Silu => x / (one + (-x).exp()),
        UnaryOp::Step => {
            if x > zero {
                one
            } else if x <= zero {
                zero
            } else {
                x
            }
        }
        UnaryOp::Sign => {
            if x > zero {
                one
            } else if x < zero {
                -one
            } else if x == zero {
                zero
            } else {
                x
            }
        }
        UnaryOp::Copy | UnaryOp::StopGradient => x,
    }
}

/// The semantics of the binary ops, for any float type. As for the unary
/// ops, a NaN operand gives NaN (`min`/`max` as PyTorch's `minimum`/`maximum`).
pub fn apply_binary<T: num_traits::Float>(op: BinaryOp, a: T, b: T) -> T {
    let either_nan = a.is_nan() || b.is_nan();
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Min | BinaryOp::Max | BinaryOp::Ge | BinaryOp::Gt if either_nan => a + b,
        BinaryOp::Min => a.min(b),
        BinaryOp::Max => a.max(b),
        BinaryOp::Ge => indicator(a >= b),
        BinaryOp::Gt => indicator(a > b),
    }
}

fn indicator<T: num_traits::Float>(holds: bool) -> T {
    if holds {
        T::one()
    } else {
        T::zero()
    }
}

/// The semantics of [`Op::Select`], for any float type: `a` where `cond`
/// is nonzero, `b` where it is zero, and a NaN `cond` stays NaN (a NaN is
/// never hidden behind a finite value, as for the other ops).
pub fn apply_select<T: num_traits::Float>(cond: T, a: T, b: T) -> T {
    if cond.is_nan() {
        cond
    } else if cond != T::zero() {
        a
    } else {
        b
    }
}

impl BinaryOp {
    /// The op's mnemonic in IR dumps (`add`, `min`); also the source name of `min` and `max`.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Min => "min",
            BinaryOp::Max => "max",
            BinaryOp::Ge => "ge",
            BinaryOp::Gt => "gt",
        }
    }

    /// The infix symbol, for the ops written infix in the source.
    pub fn infix(self) -> Option<&'static str> {
        match self {
            BinaryOp::Add => Some("+"),
            BinaryOp::Sub => Some("-"),
            BinaryOp::Mul => Some("*"),
            BinaryOp::Div => Some("/"),
            BinaryOp::Min | BinaryOp::Max | BinaryOp::Ge | BinaryOp::Gt => None,
        }
    }

    /// The built-in functions of this kind, by their source names.
    pub const BUILTINS: [BinaryOp; 2] = [BinaryOp::Min, BinaryOp::Max];

    /// The built-in function called `name`, if it is a two-argument built-in (`min`, `max`).
    pub fn from_builtin(name: &str) -> Option<BinaryOp> {
        BinaryOp::BUILTINS.into_iter().find(|op| op.name() == name)
    }

    /// The op's definition, in f64. Backends must agree with this.
    pub fn apply(self, a: f64, b: f64) -> f64 {
        apply_binary(self, a, b)
    }
}

impl ReduceOp {
    /// The reduction's source name and IR mnemonic (`sum`, `mean`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
        }
    }

    /// Every reduction; each is a built-in function of its name.
    pub const ALL: [ReduceOp; 2] = [ReduceOp::Sum, ReduceOp::Mean];

    /// The reduction called `name`, if it is one.
    pub fn from_builtin(name: &str) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|op| op.name() == name)
    }
}

impl Op {
    /// Whether the op computes each element from the same element of its
    /// operands, all of the result's type: what pointwise kernels fuse.
    pub fn is_elementwise(&self) -> bool {
        matches!(self, Op::Unary(_) | Op::Binary(_) | Op::Select)
    }

    /// The op's mnemonic in IR dumps.
    pub fn mnemonic(&self) -> &'static str {
        match self {
            Op::Input(_) => "input",
            Op::State(_) => "state",
            Op::Param(_) => "param",
            Op::Const(_) => "const",
            Op::DimValue(_) => "dimvalue",
            Op::Mask(_) => "mask",
            Op::Seed(_) => "seed",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Broadcast => "broadcast",
            Op::MatVec => "matvec",
            Op::MatVecT => "matvect",
            Op::Outer => "outer",
            Op::Reduce(r) => r.name(),
            Op::Slice { .. } => "slice",
            Op::Concat => "concat",
            Op::Pad { .. } => "pad",
            Op::Select => "select",
        }
    }

    /// How many operands the op takes; `None` for any number of at least one.
    pub fn arity(&self) -> Option<usize> {
        match self {
            Op::Input(_)
            | Op::State(_)
            | Op::Param(_)
            | Op::Mask(_)
            | Op::Const(_)
            | Op::DimValue(_)
            | Op::Seed(_) => Some(0),
            Op::Unary(_) | Op::Broadcast | Op::Reduce(_) | Op::Slice { .. } | Op::Pad { .. } => Some(1),
            Op::Binary(_) | Op::MatVec | Op::MatVecT | Op::Outer => Some(2),
            Op::Select => Some(3),
            Op::Concat => None,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.mnemonic())
    }
}
