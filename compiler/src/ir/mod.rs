//! The checked graph IR of one cell step, held in a petgraph `StableDiGraph`.
//!
//! A [`Cell`] is a dataflow graph: nodes are values ([`Node`]: an [`Op`]
//! and its [`Type`]), edges run from operand to user and carry the operand's
//! slot. The op set is closed, so every pass and back end matches it
//! exhaustively. Values are named by [`ValueId`], printed `v12` everywhere
//! (dumps, errors, tests). Source spans live in a side table, not in the
//! nodes. Petgraph types stay private: the graph is reached through
//! `Cell`'s methods, so passes cannot break the invariants that
//! [`verify`] checks.

pub mod graph;
pub mod masks;
pub mod op;
pub mod print;
pub mod verify;

pub use graph::Graph;
pub use masks::{MaskDecl, MaskFn, MaskPeriod, RateDecl};
pub use op::{BinaryOp, Op, ReduceOp, UnaryOp};

use crate::diag::Span;
use crate::dims::Dim;
use std::fmt;

/// A value of the step graph, printed `v12`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(u32);

impl ValueId {
    /// The id as a dense index, for tables indexed by value (below [`Graph::value_bound`]).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

impl fmt::Debug for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// The type of a value: a scalar, a vector `[d]`, or (parameters only) a
/// matrix `[m, n]` or a block-diagonal one `[heads, m, n]`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum Type {
    /// A single number.
    Scalar,
    /// A vector `[d]`.
    Vector(Dim),
    /// `heads` matrices `[m, n]` on the diagonal of a block-diagonal
    /// `[heads*m, heads*n]` one, stored one after another, each row-major
    /// (so in memory `[heads*m, n]`). A plain matrix `[m, n]` has one head.
    /// `W @ v` multiplies head `k`'s block by `v[k*n .. (k+1)*n]` into
    /// `[k*m .. (k+1)*m]` of the result.
    Matrix(Dim, Dim, Dim),
}

impl Type {
    /// The length `d` of a vector `[d]`; `None` for a scalar or matrix.
    pub fn vector_dim(&self) -> Option<&Dim> {
        match self {
            Type::Vector(d) => Some(d),
            _ => None,
        }
    }

    /// A plain (one-head) matrix `[m, n]`.
    pub fn matrix(m: Dim, n: Dim) -> Type {
        Type::Matrix(Dim::constant(1), m, n)
    }

    /// For a matrix, the vectors it multiplies: `(heads*m, heads*n)`, the
    /// lengths of `W @ v` and of `v`; `None` if a product overflows.
    pub fn product_dims(&self) -> Option<(Dim, Dim)> {
        match self {
            Type::Matrix(h, m, n) => Some((h.checked_mul(m)?, h.checked_mul(n)?)),
            _ => None,
        }
    }
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Type::Scalar => f.write_str("scalar"),
            Type::Vector(d) => write!(f, "[{d}]"),
            Type::Matrix(h, m, n) if h.as_constant() == Some(1) => write!(f, "[{m}, {n}]"),
            Type::Matrix(h, m, n) => write!(f, "[{h}, {m}, {n}]"),
        }
    }
}

impl fmt::Debug for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// One value: what computes it and its type.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// What computes the value.
    pub op: Op,
    /// The value's type.
    pub ty: Type,
}

/// A declared input or state: a vector.
#[derive(Clone, Debug, PartialEq)]
pub struct VarDecl {
    /// The name as declared.
    pub name: String,
    /// Its length, symbolically (`H`, `4*H`).
    pub dim: Dim,
    /// Where it is declared.
    pub span: Span,
}

/// A declared parameter: a vector, a matrix or a block-diagonal matrix, with its initialiser.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamDecl {
    /// The name as declared.
    pub name: String,
    /// A vector `[d]`, a matrix `[m, n]` or a block-diagonal `[heads, m, n]`.
    pub ty: Type,
    /// Declared with a head axis, `[heads, m, n]`: its weights have three
    /// axes even with one head.
    pub declared_heads: bool,
    /// How it is initialised (an omitted initialiser is already filled in).
    pub init: Init,
    /// Where it is declared.
    pub span: Span,
}

impl ParamDecl {
    /// The shape of its weights at fixed sizes, from its `(rows, cols)` as
    /// stored (`(heads*m, n)` for a block-diagonal one) and its `heads`:
    /// `[d]`, `[m, n]` or, declared with a head axis, `[heads, m, n]`.
    pub fn weight_shape(&self, (rows, cols): (usize, usize), heads: usize) -> Vec<usize> {
        match self.ty {
            Type::Matrix(..) if self.declared_heads => vec![heads, rows / heads.max(1), cols],
            Type::Matrix(..) => vec![rows, cols],
            _ => vec![rows],
        }
    }

    /// `[m, n]` for a matrix, `[heads, m, n]` for a block-diagonal one, `[d]` for a vector.
    pub fn shape(&self) -> Vec<Dim> {
        match &self.ty {
            Type::Matrix(h, m, n) if self.declared_heads => vec![h.clone(), m.clone(), n.clone()],
            Type::Matrix(_, m, n) => vec![m.clone(), n.clone()],
            Type::Vector(d) => vec![d.clone()],
            Type::Scalar => vec![],
        }
    }
}

/// How a parameter starts, before any training.
#[derive(Clone, Debug, PartialEq)]
pub enum Init {
    /// `= zeros`.
    Zeros,
    /// `= ones`.
    Ones,
    /// Uniform in `[-bound, bound]`.
    Uniform(ConstExpr),
    /// `= constant(c)`: every element `c`.
    Constant(ConstExpr),
}

/// A scalar known once the sizes are: `1/sqrt(H)`.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstExpr {
    /// A number literal, or a `const`'s value.
    Number(f64),
    /// A size expression such as `H` or `4*H`.
    Size(Dim),
    /// `-e`.
    Neg(Box<ConstExpr>),
    /// `a op b` or a two-argument built-in (`max(a, b)`).
    Binary(BinaryOp, Box<ConstExpr>, Box<ConstExpr>),
    /// A one-argument built-in such as `sqrt(e)`.
    Unary(UnaryOp, Box<ConstExpr>),
}

impl ConstExpr {
    /// The value under `bindings`; `Err` names an unbound size variable.
    pub fn eval(&self, bindings: &crate::dims::Bindings) -> Result<f64, String> {
        Ok(match self {
            ConstExpr::Number(v) => *v,
            ConstExpr::Size(d) => d.eval(bindings).map_err(|e| match e {
                crate::dims::EvalError::Unbound(name) => name,
                crate::dims::EvalError::Overflow => format!("{d} overflows"),
            })? as f64,
            ConstExpr::Neg(e) => -e.eval(bindings)?,
            ConstExpr::Binary(op, a, b) => op.apply(a.eval(bindings)?, b.eval(bindings)?),
            ConstExpr::Unary(op, a) => op.apply(a.eval(bindings)?),
        })
    }
}

impl ConstExpr {
    /// Writes the expression, parenthesising only where precedence needs it.
    fn write(&self, f: &mut fmt::Formatter<'_>, parent_prec: u8) -> fmt::Result {
        let prec = match self {
            ConstExpr::Binary(BinaryOp::Add | BinaryOp::Sub, ..) => 1,
            ConstExpr::Binary(BinaryOp::Mul | BinaryOp::Div, ..) => 2,
            ConstExpr::Neg(_) => 3,
            _ => 4,
        };
        if prec < parent_prec {
            f.write_str("(")?;
        }
        match self {
            ConstExpr::Number(v) => write!(f, "{v}")?,
            ConstExpr::Size(d) if d.as_constant().is_none() && d.variables().len() > 1 => write!(f, "({d})")?,
            ConstExpr::Size(d) => write!(f, "{d}")?,
            ConstExpr::Neg(e) => {
                f.write_str("-")?;
                e.write(f, 3)?;
            }
            ConstExpr::Binary(op, a, b) => match op.infix() {
                Some(sym) => {
                    a.write(f, prec)?;
                    write!(f, " {sym} ")?;
                    b.write(f, prec + 1)?;
                }
                None => {
                    write!(f, "{}(", op.name())?;
                    a.write(f, 0)?;
                    f.write_str(", ")?;
                    b.write(f, 0)?;
                    f.write_str(")")?;
                }
            },
            ConstExpr::Unary(op, a) => {
                write!(f, "{}(", op.name())?;
                a.write(f, 0)?;
                f.write_str(")")?;
            }
        }
        if prec < parent_prec {
            f.write_str(")")?;
        }
        Ok(())
    }
}

impl fmt::Display for ConstExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f, 0)
    }
}

impl fmt::Display for Init {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Init::Zeros => f.write_str("zeros"),
            Init::Ones => f.write_str("ones"),
            Init::Uniform(e) => write!(f, "uniform({e})"),
            Init::Constant(e) => write!(f, "constant({e})"),
        }
    }
}

/// One step of one cell, checked.
#[derive(Clone, Debug)]
pub struct Cell {
    /// The cell's name, as in `cell NAME { ... }`.
    pub name: String,
    /// Where the cell is defined.
    pub span: Span,
    /// Size variables in order of first appearance in the declarations.
    pub sizes: Vec<String>,
    /// The `input` declarations, in order: consecutive slices of the step's feature vector.
    pub inputs: Vec<VarDecl>,
    /// The `state` declarations, in order.
    pub states: Vec<VarDecl>,
    /// The `param` declarations, in order.
    pub params: Vec<ParamDecl>,
    /// The `rate` declarations, in order.
    pub rates: Vec<RateDecl>,
    /// Each call of a mask function, in source order: mask `i` is the
    /// stream [`Op::Mask`]`(i)` reads (see [`masks`]).
    pub masks: Vec<MaskDecl>,
    /// The step's output value.
    pub output: ValueId,
    /// `next_states[i]` is the value of `states[i]` at the end of the step.
    pub next_states: Vec<ValueId>,
    graph: Graph,
}

impl std::ops::Deref for Cell {
    type Target = Graph;
    fn deref(&self) -> &Graph {
        &self.graph
    }
}

impl std::ops::DerefMut for Cell {
    fn deref_mut(&mut self) -> &mut Graph {
        &mut self.graph
    }
}

impl Cell {
    /// An empty graph; lowering fills it and sets `output` / `next_states`.
    pub fn new(name: String, span: Span) -> Cell {
        Cell {
            name,
            span,
            sizes: Vec::new(),
            inputs: Vec::new(),
            states: Vec::new(),
            params: Vec::new(),
            rates: Vec::new(),
            masks: Vec::new(),
            output: ValueId(0),
            next_states: Vec::new(),
            graph: Graph::default(),
        }
    }

    /// Removes values neither the output nor a next state depends on.
    pub fn remove_dead_values(&mut self) -> usize {
        let mut roots = self.next_states.clone();
        roots.push(self.output);
        self.graph.remove_dead_values(&roots)
    }

    /// The index in [`Cell::states`] of the state called `name`.
    pub fn state_index(&self, name: &str) -> Option<usize> {
        self.states.iter().position(|s| s.name == name)
    }

    /// Each mask's type, by mask index.
    pub fn mask_types(&self) -> Vec<Type> {
        self.masks.iter().map(|m| m.ty.clone()).collect()
    }

    /// Each rate's default, in declaration order (f32, as every back end runs).
    pub fn default_rates(&self) -> Vec<f32> {
        self.rates.iter().map(|r| r.default as f32).collect()
    }

    /// The index in [`Cell::rates`] of the rate called `name`.
    pub fn rate_index(&self, name: &str) -> Option<usize> {
        self.rates.iter().position(|r| r.name == name)
    }

    /// The index in [`Cell::params`] of the parameter called `name`.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|p| p.name == name)
    }

    /// The step's feature size: the inputs' dimensions added up.
    pub fn input_dim(&self) -> Dim {
        self.inputs.iter().fold(Dim::default(), |acc, i| acc.checked_add(&i.dim).unwrap_or(acc))
    }

    /// The output's dimension.
    pub fn output_dim(&self) -> Dim {
        self.ty(self.output).vector_dim().cloned().unwrap_or_default()
    }
}
