//! Elementwise math on any [`Lanes`], op for op the Cranelift emitter's
//! ([`cellc::clif::math`]): the same clamps, range reductions, polynomial
//! coefficients, fused multiply-adds, comparisons and NaN rules, in the
//! same order. Each lane is an IEEE operation on the same operands as the
//! emitter's `f32x4` (or scalar) instruction, so every result is bitwise
//! what Cranelift's code computes, on either instruction set; `tests::*`
//! check it against the JIT.
//!
//! Everything here is `#[inline(always)]`: it becomes the set's
//! instructions inside the walker's [`Lanes::enter`].

use super::lanes::{Lanes, Math};
use cellc::ir::{BinaryOp, UnaryOp};
use cellc::kernel::cpu_math::*;
use std::arch::x86_64::{
    _CMP_EQ_OQ, _CMP_GE_OQ, _CMP_GT_OQ, _CMP_LT_OQ, _CMP_NEQ_UQ, _CMP_NGE_UQ, _CMP_UNORD_Q,
};

/// `r`, or NaN (`x + y`) where `x` or `y` is NaN.
#[inline(always)]
fn keep_nan<S: Math>(s: S, x: S::V, y: S::V, r: S::V) -> S::V {
    let unordered = s.cmp::<_CMP_UNORD_Q>(x, y);
    s.blend(unordered, r, s.add(x, y))
}

#[inline(always)]
fn neg<S: Math>(s: S, x: S::V) -> S::V {
    s.float(s.xor(s.bits(x), s.splat_int(i32::MIN)))
}

#[inline(always)]
fn abs<S: Math>(s: S, x: S::V) -> S::V {
    s.float(s.and(s.bits(x), s.splat_int(i32::MAX)))
}

/// 1.0 where the comparison `P` holds, else 0.0; NaN if `a` or `c` is.
#[inline(always)]
fn indicator<S: Math, const P: i32>(s: S, a: S::V, c: S::V) -> S::V {
    let r = s.blend(s.cmp::<P>(a, c), s.splat(0.0), s.splat(1.0));
    keep_nan(s, a, c, r)
}

#[inline(always)]
fn exp<S: Math>(s: S, x: S::V) -> S::V {
    keep_nan(s, x, x, exp_of_ordered(s, x))
}

#[inline(always)]
fn exp_of_ordered<S: Math>(s: S, x: S::V) -> S::V {
    let x = s.max(x, s.splat(EXP_LO));
    let x = s.min(x, s.splat(EXP_HI));
    let magic = s.splat(EXP_MAGIC);
    let j = s.fma(x, s.splat(std::f32::consts::LOG2_E), magic);
    let n = s.sub(j, magic);
    let r = s.fma(n, s.splat(EXP_LN2_HI), x);
    let r = s.fma(n, s.splat(EXP_LN2_LO), r);
    let mut p = s.splat(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = s.fma(p, r, s.splat(c));
    }
    let r2 = s.mul(r, r);
    let r1 = s.add(r, s.splat(1.0));
    let e = s.fma(p, r2, r1);
    // 2^n = (bits(j) << 23) + (127 << 23)
    let scale = s.int_add(s.shl_23(s.bits(j)), s.splat_int(127 << 23));
    s.mul(e, s.float(scale))
}

#[inline(always)]
fn sigmoid<S: Math>(s: S, x: S::V) -> S::V {
    let e = exp(s, neg(s, x));
    let one = s.splat(1.0);
    s.div(one, s.add(one, e))
}

#[inline(always)]
fn tanh<S: Math>(s: S, x: S::V) -> S::V {
    let clamped = s.min(x, s.splat(TANH_BOUND));
    let clamped = s.max(clamped, s.splat(-TANH_BOUND));
    let x2 = s.mul(clamped, clamped);
    let mut p = s.splat(TANH_P[0]);
    for &c in &TANH_P[1..] {
        p = s.fma(x2, p, s.splat(c));
    }
    let p = s.mul(clamped, p);
    let mut q = s.splat(TANH_Q[0]);
    for &c in &TANH_Q[1..] {
        q = s.fma(x2, q, s.splat(c));
    }
    let r = s.div(p, q);
    let is_tiny = s.cmp::<_CMP_LT_OQ>(abs(s, x), s.splat(TANH_TINY));
    let r = s.blend(is_tiny, r, x);
    keep_nan(s, x, x, r)
}

#[inline(always)]
fn log<S: Math>(s: S, x: S::V) -> S::V {
    // Subnormals: scale by 2^23 first, and take 23 off the exponent after.
    let is_sub = s.cmp::<_CMP_LT_OQ>(x, s.splat(f32::MIN_POSITIVE));
    let xn = s.blend(is_sub, x, s.mul(x, s.splat(8_388_608.0)));
    let bits = s.bits(xn);
    // Exponent and mantissa m in [1, 2).
    let e_int = s.int_sub(s.shr_23(bits), s.splat_int(127));
    let m = s.float(s.or(s.and(bits, s.splat_int(0x007f_ffff)), s.splat_int(0x3f80_0000)));
    let e = s.int_to_float(e_int);
    let e = s.blend(is_sub, e, s.sub(e, s.splat(23.0)));
    // m > sqrt(2): m /= 2, e += 1, so m is in [sqrt(1/2), sqrt(2)).
    let big = s.cmp::<_CMP_GT_OQ>(m, s.splat(std::f32::consts::SQRT_2));
    let m = s.blend(big, m, s.mul(m, s.splat(0.5)));
    let one = s.splat(1.0);
    let e = s.blend(big, e, s.add(e, one));
    let f = s.sub(m, one);
    let z = s.mul(f, f);
    let mut p = s.splat(LOG_POLY[0]);
    for &c in &LOG_POLY[1..] {
        p = s.fma(p, f, s.splat(c));
    }
    let y = s.mul(s.mul(f, z), p);
    let y = s.fma(e, s.splat(LOG_LN2_LO), y);
    let y = s.fma(z, s.splat(-0.5), y);
    let r = s.add(f, y);
    let r = s.fma(e, s.splat(LOG_LN2_HI), r);
    // x == 0 -> -inf; x < 0 or NaN -> NaN; +inf -> +inf.
    let zero = s.splat(0.0);
    let r = s.blend(s.cmp::<_CMP_EQ_OQ>(x, zero), r, s.splat(f32::NEG_INFINITY));
    let r = s.blend(s.cmp::<_CMP_NGE_UQ>(x, zero), r, s.splat(f32::NAN));
    let inf = s.splat(f32::INFINITY);
    s.blend(s.cmp::<_CMP_EQ_OQ>(x, inf), r, inf)
}

/// The smaller of `x` and `y`; NaN if either is.
#[inline(always)]
fn min<S: Math>(s: S, x: S::V, y: S::V) -> S::V {
    keep_nan(s, x, y, s.min(x, y))
}

/// The larger of `x` and `y`; NaN if either is.
#[inline(always)]
fn max<S: Math>(s: S, x: S::V, y: S::V) -> S::V {
    keep_nan(s, x, y, s.max(x, y))
}

/// `x < 0 ? 0 : x`: NaN stays NaN.
#[inline(always)]
fn relu<S: Math>(s: S, x: S::V) -> S::V {
    let zero = s.splat(0.0);
    s.blend(s.cmp::<_CMP_LT_OQ>(x, zero), x, zero)
}

#[inline(always)]
fn rsqrt<S: Math>(s: S, x: S::V) -> S::V {
    s.div(s.splat(1.0), s.sqrt(x))
}

/// `max(x, 0) + log(1 + exp(-|x|))`.
#[inline(always)]
fn softplus<S: Math>(s: S, x: S::V) -> S::V {
    let m = max(s, x, s.splat(0.0));
    let e = exp(s, neg(s, abs(s, x)));
    s.add(m, log(s, s.add(s.splat(1.0), e)))
}

#[inline(always)]
fn silu<S: Math>(s: S, x: S::V) -> S::V {
    s.mul(x, sigmoid(s, x))
}

/// Each indicator is NaN for NaN, and so is their difference.
#[inline(always)]
fn sign<S: Math>(s: S, x: S::V) -> S::V {
    let zero = s.splat(0.0);
    s.sub(indicator::<S, _CMP_GT_OQ>(s, x, zero), indicator::<S, _CMP_LT_OQ>(s, x, zero))
}

#[inline(always)]
fn copy<S: Math>(_: S, x: S::V) -> S::V {
    x
}

#[inline(always)]
fn step<S: Math>(s: S, x: S::V) -> S::V {
    indicator::<S, _CMP_GT_OQ>(s, x, s.splat(0.0))
}

/// `where(c, a, b)`: `a` where `c` is nonzero, `b` where zero, and a NaN `c` itself.
#[inline(always)]
pub fn select_one<S: Math>(s: S, c: S::V, a: S::V, b: S::V) -> S::V {
    // Unordered-or-not-equal: a NaN picks `a`, then is kept below.
    let chosen = s.blend(s.cmp::<_CMP_NEQ_UQ>(c, s.splat(0.0)), b, a);
    s.blend(s.cmp::<_CMP_UNORD_Q>(c, c), chosen, c)
}

/// `$body` with `$f` the function that computes unary op `$op` on one
/// vector: the one table of which function computes which op.
macro_rules! by_unary_op {
    ($op:expr, $f:ident => $body:expr) => {
        match $op {
            UnaryOp::Neg => {
                let $f = neg;
                $body
            }
            UnaryOp::Copy | UnaryOp::StopGradient => {
                let $f = copy;
                $body
            }
            UnaryOp::Sigmoid => {
                let $f = sigmoid;
                $body
            }
            UnaryOp::Tanh => {
                let $f = tanh;
                $body
            }
            UnaryOp::Relu => {
                let $f = relu;
                $body
            }
            UnaryOp::Exp => {
                let $f = exp;
                $body
            }
            UnaryOp::Log => {
                let $f = log;
                $body
            }
            UnaryOp::Sqrt => {
                let $f = S::sqrt;
                $body
            }
            UnaryOp::Rsqrt => {
                let $f = rsqrt;
                $body
            }
            UnaryOp::Abs => {
                let $f = abs;
                $body
            }
            UnaryOp::Softplus => {
                let $f = softplus;
                $body
            }
            UnaryOp::Silu => {
                let $f = silu;
                $body
            }
            UnaryOp::Step => {
                let $f = step;
                $body
            }
            UnaryOp::Sign => {
                let $f = sign;
                $body
            }
        }
    };
}

/// As [`by_unary_op`], for binary ops.
macro_rules! by_binary_op {
    ($op:expr, $f:ident => $body:expr) => {
        match $op {
            BinaryOp::Add => {
                let $f = S::add;
                $body
            }
            BinaryOp::Sub => {
                let $f = S::sub;
                $body
            }
            BinaryOp::Mul => {
                let $f = S::mul;
                $body
            }
            BinaryOp::Div => {
                let $f = S::div;
                $body
            }
            BinaryOp::Min => {
                let $f = min;
                $body
            }
            BinaryOp::Max => {
                let $f = max;
                $body
            }
            BinaryOp::Ge => {
                let $f = indicator::<S, _CMP_GE_OQ>;
                $body
            }
            BinaryOp::Gt => {
                let $f = indicator::<S, _CMP_GT_OQ>;
                $body
            }
        }
    };
}

/// `out[k] = f(s, a[k], ...)` for registers `k < n` of set `S`: a loop of constant
/// length where `n` is a whole pass's registers, which the compiler
/// unrolls. A loop, not a closure handed to one: a closure is a function
/// of its own, not compiled for the set unless inlined.
macro_rules! each {
    ($set:ident: $s:ident, $n:ident, $out:ident = $f:expr, $($a:ident),+) => {
        if $n == $set::REGISTERS {
            for k in 0..$set::REGISTERS {
                *$out.add(k) = $f($s, $($s.load($a.add(k * $set::LANES))),+);
            }
        } else {
            for k in 0..$n {
                *$out.add(k) = $f($s, $($s.load($a.add(k * $set::LANES))),+);
            }
        }
    };
}

/// `where(cond, a, b)` on registers `cond[..n]`, `a[..n]`, `b[..n]` into
/// `out[..n]`.
///
/// # Safety
/// `cond`, `a`, `b` readable and `out` writable for `n` registers.
#[inline(always)]
pub unsafe fn select<S: Lanes>(s: S, [cond, a, b]: [*const f32; 3], out: *mut S::V, n: usize) {
    // SAFETY: per the contract.
    unsafe { each!(S: s, n, out = select_one, cond, a, b) }
}

/// One unary op on registers `a[..n]` into `out[..n]` (the op chosen once,
/// the registers' chains then independent). `a` and `out` may be the same.
///
/// # Safety
/// `a` readable and `out` writable for `n` registers.
#[inline(always)]
pub unsafe fn unary<S: Lanes>(s: S, op: UnaryOp, a: *const f32, out: *mut S::V, n: usize) {
    // SAFETY (every arm): per the contract.
    unsafe { by_unary_op!(op, f => each!(S: s, n, out = f, a)) }
}

/// One binary op on registers `a[..n]` and `b[..n]` into `out[..n]`.
///
/// # Safety
/// `a`, `b` readable and `out` writable for `n` registers.
#[inline(always)]
pub unsafe fn binary<S: Lanes>(s: S, op: BinaryOp, [a, b]: [*const f32; 2], out: *mut S::V, n: usize) {
    // SAFETY (every arm): per the contract.
    unsafe { by_binary_op!(op, f => each!(S: s, n, out = f, a, b)) }
}

/// One unary op on one vector (the trace's: [`super::trace`]).
#[inline(always)]
pub fn unary_vector<S: Math>(s: S, op: UnaryOp, x: S::V) -> S::V {
    by_unary_op!(op, f => f(s, x))
}

/// One binary op on one vector each.
#[inline(always)]
pub fn binary_vector<S: Math>(s: S, op: BinaryOp, x: S::V, y: S::V) -> S::V {
    by_binary_op!(op, f => f(s, x, y))
}
