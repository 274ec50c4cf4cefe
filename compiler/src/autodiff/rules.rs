//! One adjoint rule per op: given a forward value `v` and its adjoint `dv`,
//! add the contributions to `v`'s operands' adjoints.
//!
//! Rules read forward values where that is cheaper than recomputing:
//! `sigmoid' = y (1 - y)` and `tanh' = 1 - y²` from the saved output `y`,
//! `exp' = y`. Ops that are piecewise constant (`step`, `sign`, `ge`,
//! `gt`) contribute nothing, and neither does `stop_gradient`, by
//! definition, nor a `select`'s condition.

use super::Builder;
use crate::ir::{BinaryOp, Op, ReduceOp, Type, UnaryOp, ValueId};

pub(super) fn backprop(b: &mut Builder, v: ValueId, dv: ValueId) {
    let node = b.g.node(v).clone();
    let ops = b.g.operands(v);
    match node.op {
        // A mask is drawn, not computed: nothing flows into it.
        Op::Input(_)
        | Op::State(_)
        | Op::Param(_)
        | Op::Mask(_)
        | Op::Const(_)
        | Op::DimValue(_)
        | Op::Seed(_) => {}
        Op::Unary(op) => unary(b, op, v, ops[0], dv),
        Op::Binary(op) => binary(b, op, v, ops[0], ops[1], dv),
        Op::Select => {
            // The adjoint goes to the operand chosen; a NaN condition makes it NaN.
            let (cond, x, y) = (ops[0], ops[1], ops[2]);
            let zero = b.constant_like(0.0, &node.ty);
            let dx = b.add(Op::Select, node.ty.clone(), &[cond, dv, zero]);
            b.contribute(x, dx);
            let dy = b.add(Op::Select, node.ty.clone(), &[cond, zero, dv]);
            b.contribute(y, dy);
        }
        Op::Broadcast => {
            let s = b.add(Op::Reduce(ReduceOp::Sum), Type::Scalar, &[dv]);
            b.contribute(ops[0], s);
        }
        Op::MatVec => {
            // y = W x:  dW += dy ⊗ x,  dx += Wᵀ dy
            let (w, x) = (ops[0], ops[1]);
            let wty = b.ty(w);
            let dw = b.add(Op::Outer, wty, &[dv, x]);
            b.contribute(w, dw);
            let xty = b.ty(x);
            let dx = b.add(Op::MatVecT, xty, &[w, dv]);
            b.contribute(x, dx);
        }
        Op::MatVecT => {
            // z = Wᵀ y:  dW += y ⊗ dz,  dy += W dz
            let (w, y) = (ops[0], ops[1]);
            let wty = b.ty(w);
            let dw = b.add(Op::Outer, wty, &[y, dv]);
            b.contribute(w, dw);
            let yty = b.ty(y);
            let dy = b.add(Op::MatVec, yty, &[w, dv]);
            b.contribute(y, dy);
        }
        Op::Outer => {
            // M = a ⊗ b:  da += dM b,  db += dMᵀ a
            let (x, y) = (ops[0], ops[1]);
            let (xty, yty) = (b.ty(x), b.ty(y));
            let dx = b.add(Op::MatVec, xty, &[dv, y]);
            b.contribute(x, dx);
            let dy = b.add(Op::MatVecT, yty, &[dv, x]);
            b.contribute(y, dy);
        }
        Op::Reduce(op) => {
            let aty = b.ty(ops[0]);
            let scaled = match (op, &aty) {
                (ReduceOp::Sum, _) => dv,
                (ReduceOp::Mean, Type::Vector(n)) => {
                    let n = b.add(Op::DimValue(n.clone()), Type::Scalar, &[]);
                    b.binary(BinaryOp::Div, dv, n)
                }
                (ReduceOp::Mean, _) => dv,
            };
            let d = b.add(Op::Broadcast, aty, &[scaled]);
            b.contribute(ops[0], d);
        }
        Op::Slice { offset } => {
            let aty = b.ty(ops[0]);
            let d = b.add(Op::Pad { offset }, aty, &[dv]);
            b.contribute(ops[0], d);
        }
        Op::Pad { offset } => {
            let aty = b.ty(ops[0]);
            let d = b.add(Op::Slice { offset }, aty, &[dv]);
            b.contribute(ops[0], d);
        }
        Op::Concat => {
            let mut offset = crate::dims::Dim::default();
            for o in ops {
                let oty = b.ty(o);
                let d = b.add(Op::Slice { offset: offset.clone() }, oty.clone(), &[dv]);
                b.contribute(o, d);
                if let Some(len) = oty.vector_dim() {
                    offset = offset.checked_add(len).unwrap_or(offset);
                }
            }
        }
    }
}

/// `y = op(a)`, `dy` given: contributes `dy * op'(a)` to `a`.
fn unary(b: &mut Builder, op: UnaryOp, y: ValueId, a: ValueId, dy: ValueId) {
    use BinaryOp::{Add, Div, Mul, Sub};
    let ty = b.ty(a);
    let d = match op {
        UnaryOp::Neg => b.unary(UnaryOp::Neg, dy),
        UnaryOp::Copy => dy,
        UnaryOp::Sigmoid => {
            // y (1 - y)
            let one = b.constant_like(1.0, &ty);
            let one_minus = b.binary(Sub, one, y);
            let deriv = b.binary(Mul, y, one_minus);
            b.binary(Mul, dy, deriv)
        }
        UnaryOp::Tanh => {
            // 1 - y²
            let one = b.constant_like(1.0, &ty);
            let y2 = b.binary(Mul, y, y);
            let deriv = b.binary(Sub, one, y2);
            b.binary(Mul, dy, deriv)
        }
        UnaryOp::Relu => {
            let mask = b.unary(UnaryOp::Step, a);
            b.binary(Mul, dy, mask)
        }
        UnaryOp::Exp => b.binary(Mul, dy, y),
        UnaryOp::Log => b.binary(Div, dy, a),
        UnaryOp::Sqrt => {
            // 0.5 / y
            let half = b.constant_like(0.5, &ty);
            let t = b.binary(Mul, dy, half);
            b.binary(Div, t, y)
        }
        UnaryOp::Rsqrt => {
            // -0.5 y / a
            let neg_half = b.constant_like(-0.5, &ty);
            let t = b.binary(Mul, dy, y);
            let t = b.binary(Div, t, a);
            b.binary(Mul, t, neg_half)
        }
        UnaryOp::Abs => {
            let s = b.unary(UnaryOp::Sign, a);
            b.binary(Mul, dy, s)
        }
        UnaryOp::Softplus => {
            let s = b.unary(UnaryOp::Sigmoid, a);
            b.binary(Mul, dy, s)
        }
        UnaryOp::Silu => {
            // s (1 + a (1 - s)),  s = sigmoid(a)
            let s = b.unary(UnaryOp::Sigmoid, a);
            let one = b.constant_like(1.0, &ty);
            let one_minus = b.binary(Sub, one, s);
            let t = b.binary(Mul, a, one_minus);
            let t = b.binary(Add, one, t);
            let deriv = b.binary(Mul, s, t);
            b.binary(Mul, dy, deriv)
        }
        UnaryOp::Step | UnaryOp::Sign | UnaryOp::StopGradient => return,
    };
    b.contribute(a, d);
}

/// `y = a op c`, `dy` given.
fn binary(b: &mut Builder, op: BinaryOp, y: ValueId, a: ValueId, c: ValueId, dy: ValueId) {
    use BinaryOp::{Add, Div, Ge, Mul, Sub};
    match op {
        Add => {
            b.contribute(a, dy);
            b.contribute(c, dy);
        }
        Sub => {
            b.contribute(a, dy);
            let n = b.unary(UnaryOp::Neg, dy);
            b.contribute(c, n);
        }
        Mul => {
            let da = b.binary(Mul, dy, c);
            b.contribute(a, da);
            let dc = b.binary(Mul, dy, a);
            b.contribute(c, dc);
        }
        Div => {
            // d(a/c)/da = 1/c,  d(a/c)/dc = -y/c
            let da = b.binary(Div, dy, c);
            b.contribute(a, da);
            let t = b.binary(Mul, dy, y);
            let t = b.binary(Div, t, c);
            let dc = b.unary(UnaryOp::Neg, t);
            b.contribute(c, dc);
        }
        BinaryOp::Min | BinaryOp::Max => {
            // The adjoint goes to the operand that was chosen, and a tie
            // splits it evenly, as PyTorch's `maximum` and `minimum` do:
            // `mask` is 1, 1/2 or 0 for `a` chosen, tied or not chosen
            // (`a` is chosen where `x > y`).
            let (x, y) = if op == BinaryOp::Max { (a, c) } else { (c, a) };
            let ge = b.binary(Ge, x, y);
            let gt = b.binary(BinaryOp::Gt, x, y);
            let both = b.binary(Add, ge, gt);
            let ty = b.ty(a);
            let half = b.constant_like(0.5, &ty);
            let mask = b.binary(Mul, both, half);
            let da = b.binary(Mul, dy, mask);
            b.contribute(a, da);
            let one = b.constant_like(1.0, &ty);
            let inv = b.binary(Sub, one, mask);
            let dc = b.binary(Mul, dy, inv);
            b.contribute(c, dc);
        }
        Ge | BinaryOp::Gt => {}
    }
}
