//! Every value's shape at fixed sizes, and an order in which the values
//! can be computed: what the interpreter evaluates by, what the schedule's
//! kernel plans, the tape and every back end size their buffers by.
//! (The interpreter adds the semantics of each op at these shapes:
//! [`Shapes::compute`].)

use crate::dims::{Bindings, EvalError};
use crate::interp::error::{InterpError, MAX_TENSOR_ELEMENTS};
use crate::ir::{Graph, Op, Type, ValueId};

/// A graph ready to evaluate at fixed sizes: its order and every value's shape.
#[derive(Clone, Debug)]
pub struct Shapes {
    pub(crate) order: Vec<ValueId>,
    /// `(rows, cols)` of each value: `(1, 1)` scalar, `(d, 1)` vector, `(m, n)`
    /// matrix, `(heads*m, n)` block-diagonal matrix (its memory).
    pub(crate) shape: Vec<(usize, usize)>,
    /// Heads of each matrix value (1 for a plain matrix and for vectors).
    pub(crate) heads: Vec<usize>,
    /// Offset of each `slice`/`pad`, or the value of a `dimvalue` (0 elsewhere).
    pub(crate) extra: Vec<usize>,
}

impl Shapes {
    /// Fixes every value's shape under `sizes` (`cell` names errors).
    pub fn new(graph: &Graph, sizes: &Bindings, cell: &str) -> Result<Shapes, InterpError> {
        let order = graph.topo_order().map_err(|v| InterpError::Shape {
            tensor: format!("{v}"),
            expected: "an acyclic graph".into(),
            found: "a cycle".into(),
        })?;
        let mut shape = vec![(0usize, 0usize); graph.value_bound()];
        let mut extra = vec![0usize; graph.value_bound()];
        let mut heads = vec![1usize; graph.value_bound()];
        let eval = |what: &str, d: &crate::dims::Dim| eval_dim(cell, sizes, what, d);
        for &v in &order {
            let what = format!("value {v}");
            shape[v.index()] = match graph.ty(v) {
                Type::Scalar => (1, 1),
                Type::Vector(d) => (eval(&what, d)?, 1),
                Type::Matrix(h, m, n) => {
                    heads[v.index()] = eval(&what, h)?;
                    let rows = heads[v.index()].checked_mul(eval(&what, m)?).ok_or_else(|| {
                        InterpError::DimOverflow { what: what.clone(), dim: graph.ty(v).to_string() }
                    })?;
                    (rows, eval(&what, n)?)
                }
            };
            check_elements(&what, shape[v.index()].0, shape[v.index()].1)?;
            match &graph.node(v).op {
                // An offset may be 0, which `eval_dim` rejects.
                Op::Slice { offset } | Op::Pad { offset } => {
                    extra[v.index()] = offset
                        .eval(sizes)
                        .ok()
                        .and_then(|o| usize::try_from(o).ok())
                        .ok_or_else(|| InterpError::DimOverflow { what, dim: offset.to_string() })?;
                }
                Op::DimValue(d) => extra[v.index()] = eval(&what, d)?,
                _ => {}
            }
        }
        Ok(Shapes { order, shape, heads, extra })
    }

    /// Where `slice` value `v` starts in its operand, or `pad` value `v`'s
    /// operand in its result, at these sizes (for other ops: meaningless).
    pub fn offset(&self, v: ValueId) -> usize {
        self.extra[v.index()]
    }

    /// Elements of a value.
    pub fn elements(&self, v: ValueId) -> usize {
        let (r, c) = self.shape[v.index()];
        r * c
    }

    /// Values in the order they can be computed.
    pub fn order(&self) -> &[ValueId] {
        &self.order
    }

    /// `(rows, cols)` of a value: `(1, 1)` scalar, `(d, 1)` vector, `(m, n)`
    /// matrix, `(heads*m, n)` for `heads` blocks `[m, n]` (as they are stored).
    pub fn shape(&self, v: ValueId) -> (usize, usize) {
        self.shape[v.index()]
    }

    /// The heads of a matrix value: its diagonal blocks (1 for a plain matrix).
    pub fn heads(&self, v: ValueId) -> usize {
        self.heads[v.index()]
    }

    /// A matrix value's heads and one head's block `[m, n]`: `(heads, m, n)`
    /// (a plain matrix: one head, the whole matrix).
    pub fn block(&self, v: ValueId) -> (usize, usize, usize) {
        let ((rows, cols), heads) = (self.shape(v), self.heads(v));
        (heads, rows / heads, cols)
    }
}

/// Refuses a `rows x cols` tensor over [`MAX_TENSOR_ELEMENTS`], before anything is allocated.
pub(crate) fn check_elements(what: &str, rows: usize, cols: usize) -> Result<(), InterpError> {
    let elements = rows as u128 * cols as u128;
    if elements <= MAX_TENSOR_ELEMENTS {
        return Ok(());
    }
    let shape = if cols == 1 { format!("[{rows}]") } else { format!("[{rows}, {cols}]") };
    Err(InterpError::TooLarge { what: what.to_string(), shape, elements })
}

/// The value of dimension `d` under `sizes`, positive (`cell` and `what` name errors).
pub(crate) fn eval_dim(
    cell: &str,
    sizes: &Bindings,
    what: &str,
    d: &crate::dims::Dim,
) -> Result<usize, InterpError> {
    match d.eval(sizes) {
        Ok(v) if v > 0 => {
            usize::try_from(v).map_err(|_| InterpError::DimOverflow { what: what.into(), dim: d.to_string() })
        }
        Ok(v) => Err(InterpError::NonPositiveDim { what: what.into(), dim: d.to_string(), value: v }),
        Err(EvalError::Unbound(size)) => Err(InterpError::UnboundSize { cell: cell.to_string(), size }),
        Err(EvalError::Overflow) => Err(InterpError::DimOverflow { what: what.into(), dim: d.to_string() }),
    }
}
