//! The IR verifier: checks a [`Cell`]'s invariants after lowering and after
//! every pass (as Cranelift's `verifier`).
//!
//! Invariants:
//! 1. The graph is acyclic.
//! 2. Every value has exactly its op's number of operands, in slots `0..n`
//!    (`concat` at least one).
//! 3. Types agree with the op: unary ops keep the operand's type; binary ops
//!    take two operands of the result's type, which is scalar or vector;
//!    `broadcast` takes a scalar and gives a vector; `matvec` takes a matrix
//!    `[m, n]` and a vector `[n]` and gives `[m]`; reductions take a vector
//!    and give a scalar; `slice` gives a vector no longer than its operand;
//!    `concat` gives a vector whose dimension is the sum of its operands'.
//! 4. Matrices are only parameters, and only read as `matvec`'s operand 0.
//! 5. `input`, `state` and `param` indices are in range and carry the
//!    declared type.
//! 6. `output` and every next state exist; next states have their state's
//!    type, and the output is a vector.

use super::{Cell, Op, Type, ValueId};
use crate::dims::Dim;
use std::fmt;

/// An invariant the IR breaks: always a compiler bug, never a user error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    pub value: Option<ValueId>,
    pub message: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.value {
            Some(v) => write!(f, "IR verifier: {v}: {}", self.message),
            None => write!(f, "IR verifier: {}", self.message),
        }
    }
}

impl std::error::Error for VerifyError {}

/// Checks every invariant; returns all violations found.
pub fn verify(cell: &Cell) -> Result<(), Vec<VerifyError>> {
    let mut errors = Vec::new();
    let mut err = |value: Option<ValueId>, message: String| errors.push(VerifyError { value, message });

    if let Err(v) = cell.topo_order() {
        err(Some(v), "value is on a cycle".into());
    }

    for v in cell.values() {
        let node = cell.node(v);
        let operands = cell.operands(v);
        let slots = cell.operand_slots(v);
        if slots.iter().enumerate().any(|(i, s)| *s as usize != i) {
            err(Some(v), format!("operand slots {slots:?} are not 0..{}", slots.len()));
        }
        match node.op.arity() {
            Some(n) if operands.len() != n => {
                err(Some(v), format!("`{}` takes {n} operands, has {}", node.op, operands.len()));
                continue;
            }
            None if operands.is_empty() => {
                err(Some(v), format!("`{}` needs at least one operand", node.op));
                continue;
            }
            _ => {}
        }
        let ty = |i: usize| cell.ty(operands[i]);
        for (slot, o) in operands.iter().enumerate() {
            if matches!(cell.ty(*o), Type::Matrix(..)) && !(node.op == Op::MatVec && slot == 0) {
                err(Some(v), format!("reads matrix {o} outside `matvec`'s operand 0"));
            }
        }
        let problem: Option<String> = match &node.op {
            Op::Input(i) => match cell.inputs.get(*i) {
                None => Some(format!("input index {i} out of range")),
                Some(d) if node.ty != Type::Vector(d.dim.clone()) => {
                    Some(format!("input type {} is not [{}]", node.ty, d.dim))
                }
                _ => None,
            },
            Op::State(i) => match cell.states.get(*i) {
                None => Some(format!("state index {i} out of range")),
                Some(d) if node.ty != Type::Vector(d.dim.clone()) => {
                    Some(format!("state type {} is not [{}]", node.ty, d.dim))
                }
                _ => None,
            },
            Op::Param(i) => match cell.params.get(*i) {
                None => Some(format!("param index {i} out of range")),
                Some(p) if node.ty != p.ty => Some(format!("param type {} is not {}", node.ty, p.ty)),
                _ => None,
            },
            Op::Const(c) => {
                (!c.is_finite() || node.ty != Type::Scalar).then(|| format!("bad constant {c}: {}", node.ty))
            }
            Op::Unary(_) => (ty(0) != &node.ty || matches!(node.ty, Type::Matrix(..)))
                .then(|| format!("unary op on {} gives {}", ty(0), node.ty)),
            Op::Binary(_) => (ty(0) != &node.ty || ty(1) != &node.ty || matches!(node.ty, Type::Matrix(..)))
                .then(|| format!("binary op on {} and {} gives {}", ty(0), ty(1), node.ty)),
            Op::Broadcast => (ty(0) != &Type::Scalar || !matches!(node.ty, Type::Vector(_)))
                .then(|| format!("broadcast of {} to {}", ty(0), node.ty)),
            Op::MatVec => match (ty(0), ty(1), &node.ty) {
                (Type::Matrix(m, n), Type::Vector(k), Type::Vector(r)) if n == k && m == r => None,
                (a, b, r) => Some(format!("matvec of {a} and {b} gives {r}")),
            },
            Op::Reduce(_) => (!matches!(ty(0), Type::Vector(_)) || node.ty != Type::Scalar)
                .then(|| format!("reduction of {} gives {}", ty(0), node.ty)),
            Op::Slice { offset } => match (ty(0), &node.ty) {
                (Type::Vector(full), Type::Vector(len)) => {
                    let rest = full.checked_sub(offset).and_then(|r| r.checked_sub(len));
                    match rest.and_then(|r| r.as_constant()) {
                        Some(c) if c < 0 => Some(format!("slice [{offset} +{len}] runs past [{full}]")),
                        _ => None,
                    }
                }
                (a, r) => Some(format!("slice of {a} gives {r}")),
            },
            Op::Concat => {
                let mut total = Some(Dim::default());
                for i in 0..operands.len() {
                    total = match (total, ty(i)) {
                        (Some(t), Type::Vector(d)) => t.checked_add(d),
                        _ => None,
                    };
                }
                match (total, &node.ty) {
                    (Some(t), Type::Vector(d)) if &t == d => None,
                    _ => Some(format!("concat operands do not add up to {}", node.ty)),
                }
            }
        };
        if let Some(p) = problem {
            err(Some(v), p);
        }
    }

    if cell.next_states.len() != cell.states.len() {
        err(None, format!("{} states but {} next states", cell.states.len(), cell.next_states.len()));
    }
    for (s, v) in cell.states.iter().zip(&cell.next_states) {
        if !cell.contains(*v) {
            err(Some(*v), format!("next state `{}` is not in the graph", s.name));
        } else if cell.ty(*v) != &Type::Vector(s.dim.clone()) {
            err(Some(*v), format!("next state `{}` has type {}, not [{}]", s.name, cell.ty(*v), s.dim));
        }
    }
    if !cell.contains(cell.output) {
        err(Some(cell.output), "output is not in the graph".into());
    } else if !matches!(cell.ty(cell.output), Type::Vector(_)) {
        err(Some(cell.output), format!("output has type {}", cell.ty(cell.output)));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}
