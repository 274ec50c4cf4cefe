//! Elementwise math in Cranelift IR, generic over scalar `f32` and `f32x4`
//! (the widest vector Cranelift's x86-64 back end supports).
//!
//! Cranelift has no `exp`, `log` or `tanh`, so these are range-reduced
//! polynomials (Cephes' single-precision coefficients): `exp` by
//! `2^n · e^r` with `|r| <= ln2/2`, `log` by `e·ln2 + log(m)` with
//! `m ∈ [√½, √2)`, `tanh` by a rational function (Eigen's); the constants
//! live in [`crate::kernel::cpu_math`], shared with the runtime's walked
//! (AVX-512 and AVX2) kernels. The accuracy sweep (the runtime's codegen tests) holds each to
//! [`MAX_ULP`].

/// The most units in the last place any function here may be from the
/// exact value (tanh's rational form, 5.2 ulp just below ±1): where a
/// cell amplifies rounding, results differ from a correctly rounded
/// library's by up to this factor more (the differential tests allow it).
pub const MAX_ULP: f64 = 6.0;

use crate::kernel::cpu_math::*;
use cranelift_codegen::ir::condcodes::FloatCC;
use cranelift_codegen::ir::{types, Endianness, InstBuilder, MemFlagsData, Type, Value};
use cranelift_frontend::FunctionBuilder;

/// A constant of type `ty` (splatted for a vector).
pub fn fc(b: &mut FunctionBuilder, ty: Type, v: f32) -> Value {
    let s = b.ins().f32const(v);
    if ty.is_vector() {
        b.ins().splat(ty, s)
    } else {
        s
    }
}

fn ic(b: &mut FunctionBuilder, ty: Type, v: i32) -> Value {
    let s = b.ins().iconst(types::I32, v as i64);
    if ty.is_vector() {
        b.ins().splat(ty.as_int(), s)
    } else {
        s
    }
}

fn lane_bitcast(b: &mut FunctionBuilder, to: Type, x: Value) -> Value {
    b.ins().bitcast(to, MemFlagsData::new().with_endianness(Endianness::Little), x)
}

/// `cond ? a : c`, for a comparison result `cond` of `ty`'s shape.
pub fn choose(b: &mut FunctionBuilder, ty: Type, cond: Value, a: Value, c: Value) -> Value {
    if ty.is_vector() {
        let mask = lane_bitcast(b, ty, cond);
        b.ins().bitselect(mask, a, c)
    } else {
        b.ins().select(cond, a, c)
    }
}

/// `x < y ? x : y`: `y` when either is NaN (one `minps`; for clamps).
fn min_ordered(b: &mut FunctionBuilder, ty: Type, x: Value, y: Value) -> Value {
    let lt = b.ins().fcmp(FloatCC::LessThan, x, y);
    choose(b, ty, lt, x, y)
}

/// `y < x ? x : y`: `y` when either is NaN (one `maxps`; for clamps).
fn max_ordered(b: &mut FunctionBuilder, ty: Type, x: Value, y: Value) -> Value {
    let gt = b.ins().fcmp(FloatCC::LessThan, y, x);
    choose(b, ty, gt, x, y)
}

/// `r`, or NaN (`x + y`) where `x` or `y` is NaN: every op propagates NaN.
pub fn keep_nan(b: &mut FunctionBuilder, ty: Type, x: Value, y: Value, r: Value) -> Value {
    let unordered = b.ins().fcmp(FloatCC::Unordered, x, y);
    let nan = b.ins().fadd(x, y);
    choose(b, ty, unordered, nan, r)
}

/// The smaller of `x` and `y`; NaN if either is.
pub fn min(b: &mut FunctionBuilder, ty: Type, x: Value, y: Value) -> Value {
    let r = min_ordered(b, ty, x, y);
    keep_nan(b, ty, x, y, r)
}

/// The larger of `x` and `y`; NaN if either is.
pub fn max(b: &mut FunctionBuilder, ty: Type, x: Value, y: Value) -> Value {
    let r = max_ordered(b, ty, x, y);
    keep_nan(b, ty, x, y, r)
}

/// 1.0 where `a cc c`, else 0.0; NaN if `a` or `c` is.
pub fn indicator(b: &mut FunctionBuilder, ty: Type, cc: FloatCC, a: Value, c: Value) -> Value {
    let cond = b.ins().fcmp(cc, a, c);
    let (one, zero) = (fc(b, ty, 1.0), fc(b, ty, 0.0));
    let r = choose(b, ty, cond, one, zero);
    keep_nan(b, ty, a, c, r)
}

/// `e^x`; NaN for NaN (the clamp below would turn it into a bound).
pub fn exp(b: &mut FunctionBuilder, ty: Type, x: Value) -> Value {
    let r = exp_of_ordered(b, ty, x);
    keep_nan(b, ty, x, x, r)
}

fn exp_of_ordered(b: &mut FunctionBuilder, ty: Type, x: Value) -> Value {
    let lo = fc(b, ty, EXP_LO);
    let hi = fc(b, ty, EXP_HI);
    let x = max_ordered(b, ty, x, lo);
    let x = min_ordered(b, ty, x, hi);
    let magic = fc(b, ty, EXP_MAGIC); // j's low bits hold round(x / ln2)
    let log2e = fc(b, ty, std::f32::consts::LOG2_E);
    let j = b.ins().fma(x, log2e, magic);
    let n = b.ins().fsub(j, magic);
    let c1 = fc(b, ty, EXP_LN2_HI);
    let r = b.ins().fma(n, c1, x);
    let c2 = fc(b, ty, EXP_LN2_LO);
    let r = b.ins().fma(n, c2, r);
    let mut p = fc(b, ty, EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        let k = fc(b, ty, c);
        p = b.ins().fma(p, r, k);
    }
    let r2 = b.ins().fmul(r, r);
    let one = fc(b, ty, 1.0);
    let r1 = b.ins().fadd(r, one);
    let e = b.ins().fma(p, r2, r1);
    // 2^n = (bits(j) << 23) + (127 << 23)
    let ity = ty.as_int();
    let jb = lane_bitcast(b, ity, j);
    let sh = b.ins().iconst(types::I32, 23);
    let jb = b.ins().ishl(jb, sh);
    let bias = ic(b, ty, 127 << 23);
    let sc = b.ins().iadd(jb, bias);
    let sc = lane_bitcast(b, ty, sc);
    b.ins().fmul(e, sc)
}

/// `sigmoid(x) = 1 / (1 + exp(-x))`, with this module's [`exp`].
pub fn sigmoid(b: &mut FunctionBuilder, ty: Type, x: Value) -> Value {
    let nx = b.ins().fneg(x);
    let e = exp(b, ty, nx);
    let one = fc(b, ty, 1.0);
    let d = b.ins().fadd(one, e);
    b.ins().fdiv(one, d)
}

/// `tanh` as one odd/even rational function of `x` clamped to ±7.905,
/// where the function rounds to ±1 (Eigen's `ptanh_float`, which PyTorch's
/// and TensorFlow's CPU kernels use): 13 multiply-adds and one division,
/// where the two-branch form (a polynomial near 0 and `1 - 2/(e^{2|x|}+1)`
/// beyond) computed both branches and an `exp`. `|x| < 0.0004` returns `x`,
/// which is `tanh(x)` to f32 precision. NaN propagates (the clamp keeps it).
pub fn tanh(b: &mut FunctionBuilder, ty: Type, x: Value) -> Value {
    let bound = fc(b, ty, TANH_BOUND);
    let nbound = fc(b, ty, -TANH_BOUND);
    let clamped = min_ordered(b, ty, x, bound);
    let clamped = max_ordered(b, ty, clamped, nbound);
    let x2 = b.ins().fmul(clamped, clamped);
    let mut p = fc(b, ty, TANH_P[0]);
    for &c in &TANH_P[1..] {
        let k = fc(b, ty, c);
        p = b.ins().fma(x2, p, k);
    }
    let p = b.ins().fmul(clamped, p);
    let mut q = fc(b, ty, TANH_Q[0]);
    for &c in &TANH_Q[1..] {
        let k = fc(b, ty, c);
        q = b.ins().fma(x2, q, k);
    }
    let r = b.ins().fdiv(p, q);
    let ax = b.ins().fabs(x);
    let tiny = fc(b, ty, TANH_TINY);
    let is_tiny = b.ins().fcmp(FloatCC::LessThan, ax, tiny);
    let r = choose(b, ty, is_tiny, x, r);
    keep_nan(b, ty, x, x, r)
}

/// Natural log; `log(0) = -inf`, negative or NaN inputs give NaN.
pub fn log(b: &mut FunctionBuilder, ty: Type, x: Value) -> Value {
    let ity = ty.as_int();
    // Subnormals: scale by 2^23 first, and take 23 off the exponent after.
    let tiny = fc(b, ty, f32::MIN_POSITIVE);
    let is_sub = b.ins().fcmp(FloatCC::LessThan, x, tiny);
    let scale = fc(b, ty, 8_388_608.0);
    let xs = b.ins().fmul(x, scale);
    let xn = choose(b, ty, is_sub, xs, x);
    let bits = lane_bitcast(b, ity, xn);
    // Exponent and mantissa m in [1, 2).
    let sh = b.ins().iconst(types::I32, 23);
    let e_bits = b.ins().ushr(bits, sh);
    let bias = ic(b, ty, 127);
    let e_int = b.ins().isub(e_bits, bias);
    let mant_mask = ic(b, ty, 0x007f_ffff);
    let one_bits = ic(b, ty, 0x3f80_0000);
    let m_bits = b.ins().band(bits, mant_mask);
    let m_bits = b.ins().bor(m_bits, one_bits);
    let m = lane_bitcast(b, ty, m_bits);
    let e = b.ins().fcvt_from_sint(ty, e_int);
    let e_less = fc(b, ty, 23.0);
    let e_sub = b.ins().fsub(e, e_less);
    let e = choose(b, ty, is_sub, e_sub, e);
    // m > sqrt(2): m /= 2, e += 1, so m is in [sqrt(1/2), sqrt(2)).
    let sqrt2 = fc(b, ty, std::f32::consts::SQRT_2);
    let big = b.ins().fcmp(FloatCC::GreaterThan, m, sqrt2);
    let half = fc(b, ty, 0.5);
    let mh = b.ins().fmul(m, half);
    let m = choose(b, ty, big, mh, m);
    let one = fc(b, ty, 1.0);
    let e1 = b.ins().fadd(e, one);
    let e = choose(b, ty, big, e1, e);
    let f = b.ins().fsub(m, one);
    let z = b.ins().fmul(f, f);
    let mut p = fc(b, ty, LOG_POLY[0]);
    for &c in &LOG_POLY[1..] {
        let k = fc(b, ty, c);
        p = b.ins().fma(p, f, k);
    }
    let fz = b.ins().fmul(f, z);
    let y = b.ins().fmul(fz, p);
    let c1 = fc(b, ty, LOG_LN2_LO);
    let y = b.ins().fma(e, c1, y);
    let mhalf = fc(b, ty, -0.5);
    let y = b.ins().fma(z, mhalf, y);
    let r = b.ins().fadd(f, y);
    let c2 = fc(b, ty, LOG_LN2_HI);
    let r = b.ins().fma(e, c2, r);
    // Special cases: x == 0 -> -inf; x < 0 or NaN -> NaN; +inf -> +inf.
    let zero = fc(b, ty, 0.0);
    let is_zero = b.ins().fcmp(FloatCC::Equal, x, zero);
    let ninf = fc(b, ty, f32::NEG_INFINITY);
    let r = choose(b, ty, is_zero, ninf, r);
    let bad = b.ins().fcmp(FloatCC::UnorderedOrLessThan, x, zero);
    let nan = fc(b, ty, f32::NAN);
    let r = choose(b, ty, bad, nan, r);
    let inf = fc(b, ty, f32::INFINITY);
    let is_inf = b.ins().fcmp(FloatCC::Equal, x, inf);
    choose(b, ty, is_inf, inf, r)
}
