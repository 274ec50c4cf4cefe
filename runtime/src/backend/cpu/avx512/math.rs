//! Elementwise math on AVX-512 vectors, op for op the Cranelift emitter's
//! ([`cellc::clif::math`]): the same clamps, range reductions, polynomial
//! coefficients, fused multiply-adds, comparisons and NaN rules, in the
//! same order. Each lane is an IEEE operation on the same operands as the
//! emitter's `f32x4` (or scalar) instruction, so every result is bitwise
//! what Cranelift's code computes; `tests::*` check it against the JIT.

use cellc::ir::{BinaryOp, UnaryOp};
use cellc::kernel::cpu_math::*;
use std::arch::x86_64::*;

/// Sixteen lanes.
pub type V = __m512;

#[inline]
#[target_feature(enable = "avx512f")]
fn splat(x: f32) -> V {
    _mm512_set1_ps(x)
}

/// `r`, or NaN (`x + y`) where `x` or `y` is NaN.
#[inline]
#[target_feature(enable = "avx512f")]
fn keep_nan(x: V, y: V, r: V) -> V {
    let unordered = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, y);
    _mm512_mask_blend_ps(unordered, r, _mm512_add_ps(x, y))
}

/// `x < y ? x : y` (the emitter's `min_ordered`: `minps`'s rule).
#[inline]
#[target_feature(enable = "avx512f")]
fn min_ordered(x: V, y: V) -> V {
    _mm512_min_ps(x, y)
}

/// `y < x ? x : y` (the emitter's `max_ordered`: `maxps`'s rule).
#[inline]
#[target_feature(enable = "avx512f")]
fn max_ordered(x: V, y: V) -> V {
    _mm512_max_ps(x, y)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn neg(x: V) -> V {
    _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(i32::MIN)))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn abs(x: V) -> V {
    _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(i32::MAX)))
}

/// 1.0 where the comparison `P` holds, else 0.0; NaN if `a` or `c` is.
#[inline]
#[target_feature(enable = "avx512f")]
fn indicator<const P: i32>(a: V, c: V) -> V {
    let cond = _mm512_cmp_ps_mask::<P>(a, c);
    let r = _mm512_mask_blend_ps(cond, splat(0.0), splat(1.0));
    keep_nan(a, c, r)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn exp(x: V) -> V {
    keep_nan(x, x, exp_of_ordered(x))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn exp_of_ordered(x: V) -> V {
    let x = max_ordered(x, splat(EXP_LO));
    let x = min_ordered(x, splat(EXP_HI));
    let magic = splat(EXP_MAGIC);
    let j = _mm512_fmadd_ps(x, splat(std::f32::consts::LOG2_E), magic);
    let n = _mm512_sub_ps(j, magic);
    let r = _mm512_fmadd_ps(n, splat(EXP_LN2_HI), x);
    let r = _mm512_fmadd_ps(n, splat(EXP_LN2_LO), r);
    let mut p = splat(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, splat(c));
    }
    let r2 = _mm512_mul_ps(r, r);
    let r1 = _mm512_add_ps(r, splat(1.0));
    let e = _mm512_fmadd_ps(p, r2, r1);
    let jb = _mm512_slli_epi32::<23>(_mm512_castps_si512(j));
    let sc = _mm512_add_epi32(jb, _mm512_set1_epi32(127 << 23));
    _mm512_mul_ps(e, _mm512_castsi512_ps(sc))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn sigmoid(x: V) -> V {
    let e = exp(neg(x));
    let one = splat(1.0);
    _mm512_div_ps(one, _mm512_add_ps(one, e))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn tanh(x: V) -> V {
    let clamped = min_ordered(x, splat(TANH_BOUND));
    let clamped = max_ordered(clamped, splat(-TANH_BOUND));
    let x2 = _mm512_mul_ps(clamped, clamped);
    let mut p = splat(TANH_P[0]);
    for &c in &TANH_P[1..] {
        p = _mm512_fmadd_ps(x2, p, splat(c));
    }
    let p = _mm512_mul_ps(clamped, p);
    let mut q = splat(TANH_Q[0]);
    for &c in &TANH_Q[1..] {
        q = _mm512_fmadd_ps(x2, q, splat(c));
    }
    let r = _mm512_div_ps(p, q);
    let is_tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(abs(x), splat(TANH_TINY));
    let r = _mm512_mask_blend_ps(is_tiny, r, x);
    keep_nan(x, x, r)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn log(x: V) -> V {
    let is_sub = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, splat(f32::MIN_POSITIVE));
    let xn = _mm512_mask_blend_ps(is_sub, x, _mm512_mul_ps(x, splat(8_388_608.0)));
    let bits = _mm512_castps_si512(xn);
    let e_int = _mm512_sub_epi32(_mm512_srli_epi32::<23>(bits), _mm512_set1_epi32(127));
    let m_bits = _mm512_or_si512(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x007f_ffff)),
        _mm512_set1_epi32(0x3f80_0000),
    );
    let m = _mm512_castsi512_ps(m_bits);
    let e = _mm512_cvtepi32_ps(e_int);
    let e = _mm512_mask_blend_ps(is_sub, e, _mm512_sub_ps(e, splat(23.0)));
    let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(m, splat(std::f32::consts::SQRT_2));
    let m = _mm512_mask_blend_ps(big, m, _mm512_mul_ps(m, splat(0.5)));
    let one = splat(1.0);
    let e = _mm512_mask_blend_ps(big, e, _mm512_add_ps(e, one));
    let f = _mm512_sub_ps(m, one);
    let z = _mm512_mul_ps(f, f);
    let mut p = splat(LOG_POLY[0]);
    for &c in &LOG_POLY[1..] {
        p = _mm512_fmadd_ps(p, f, splat(c));
    }
    let y = _mm512_mul_ps(_mm512_mul_ps(f, z), p);
    let y = _mm512_fmadd_ps(e, splat(LOG_LN2_LO), y);
    let y = _mm512_fmadd_ps(z, splat(-0.5), y);
    let r = _mm512_add_ps(f, y);
    let r = _mm512_fmadd_ps(e, splat(LOG_LN2_HI), r);
    let zero = splat(0.0);
    let r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_EQ_OQ>(x, zero), r, splat(f32::NEG_INFINITY));
    let r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_NGE_UQ>(x, zero), r, splat(f32::NAN));
    let inf = splat(f32::INFINITY);
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_EQ_OQ>(x, inf), r, inf)
}

/// The smaller of `x` and `y`; NaN if either is.
#[inline]
#[target_feature(enable = "avx512f")]
fn min(x: V, y: V) -> V {
    keep_nan(x, y, min_ordered(x, y))
}

/// The larger of `x` and `y`; NaN if either is.
#[inline]
#[target_feature(enable = "avx512f")]
fn max(x: V, y: V) -> V {
    keep_nan(x, y, max_ordered(x, y))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn copy(x: V) -> V {
    x
}

/// `x < 0 ? 0 : x`: NaN stays NaN.
#[inline]
#[target_feature(enable = "avx512f")]
fn relu(x: V) -> V {
    let z = splat(0.0);
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, z), x, z)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn sqrt(x: V) -> V {
    _mm512_sqrt_ps(x)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn rsqrt(x: V) -> V {
    _mm512_div_ps(splat(1.0), _mm512_sqrt_ps(x))
}

/// `max(x, 0) + log(1 + exp(-|x|))`.
#[inline]
#[target_feature(enable = "avx512f")]
fn softplus(x: V) -> V {
    let m = max(x, splat(0.0));
    let e = exp(neg(abs(x)));
    let l = log(_mm512_add_ps(splat(1.0), e));
    _mm512_add_ps(m, l)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn silu(x: V) -> V {
    _mm512_mul_ps(x, sigmoid(x))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn step(x: V) -> V {
    indicator::<_CMP_GT_OQ>(x, splat(0.0))
}

/// Each indicator is NaN for NaN, and so is their difference.
#[inline]
#[target_feature(enable = "avx512f")]
fn sign(x: V) -> V {
    let z = splat(0.0);
    _mm512_sub_ps(indicator::<_CMP_GT_OQ>(x, z), indicator::<_CMP_LT_OQ>(x, z))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn add(x: V, y: V) -> V {
    _mm512_add_ps(x, y)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn sub(x: V, y: V) -> V {
    _mm512_sub_ps(x, y)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn mul(x: V, y: V) -> V {
    _mm512_mul_ps(x, y)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn div(x: V, y: V) -> V {
    _mm512_div_ps(x, y)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn ge(x: V, y: V) -> V {
    indicator::<_CMP_GE_OQ>(x, y)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn gt(x: V, y: V) -> V {
    indicator::<_CMP_GT_OQ>(x, y)
}

/// `where(cond, a, b)` on registers `cond[..n]`, `a[..n]`, `b[..n]` into
/// `out[..n]`: `a` where `cond` is nonzero, `b` where zero, and a NaN
/// `cond` itself.
///
/// # Safety
/// `cond`, `a`, `b` readable and `out` writable for `n` registers.
#[target_feature(enable = "avx512f")]
pub unsafe fn select(cond: *const V, a: *const V, b: *const V, out: *mut V, n: usize) {
    for k in 0..n {
        // SAFETY: per the contract.
        unsafe {
            let c = *cond.add(k);
            // Unordered-or-not-equal: a NaN picks `a`, then is kept below.
            let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(c, splat(0.0));
            let chosen = _mm512_mask_blend_ps(nonzero, *b.add(k), *a.add(k));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(c, c);
            *out.add(k) = _mm512_mask_blend_ps(nan, chosen, c);
        }
    }
}

/// One unary op on registers `a[..n]` into `out[..n]` (the op chosen once,
/// the registers' chains then independent). `a` and `out` may be the same.
///
/// # Safety
/// `a` readable and `out` writable for `n` registers.
#[target_feature(enable = "avx512f")]
pub unsafe fn unary(op: UnaryOp, a: *const V, out: *mut V, n: usize) {
    macro_rules! each {
        ($f:ident) => {
            for k in 0..n {
                // SAFETY: per the contract.
                unsafe { *out.add(k) = $f(*a.add(k)) }
            }
        };
    }
    match op {
        UnaryOp::Neg => each!(neg),
        UnaryOp::Copy | UnaryOp::StopGradient => each!(copy),
        UnaryOp::Sigmoid => each!(sigmoid),
        UnaryOp::Tanh => each!(tanh),
        UnaryOp::Relu => each!(relu),
        UnaryOp::Exp => each!(exp),
        UnaryOp::Log => each!(log),
        UnaryOp::Sqrt => each!(sqrt),
        UnaryOp::Rsqrt => each!(rsqrt),
        UnaryOp::Abs => each!(abs),
        UnaryOp::Softplus => each!(softplus),
        UnaryOp::Silu => each!(silu),
        UnaryOp::Step => each!(step),
        UnaryOp::Sign => each!(sign),
    }
}

/// One binary op on registers `a[..n]` and `b[..n]` into `out[..n]`.
///
/// # Safety
/// `a`, `b` readable and `out` writable for `n` registers.
#[target_feature(enable = "avx512f")]
pub unsafe fn binary(op: BinaryOp, a: *const V, b: *const V, out: *mut V, n: usize) {
    macro_rules! each {
        ($f:ident) => {
            for k in 0..n {
                // SAFETY: per the contract.
                unsafe { *out.add(k) = $f(*a.add(k), *b.add(k)) }
            }
        };
    }
    match op {
        BinaryOp::Add => each!(add),
        BinaryOp::Sub => each!(sub),
        BinaryOp::Mul => each!(mul),
        BinaryOp::Div => each!(div),
        BinaryOp::Min => each!(min),
        BinaryOp::Max => each!(max),
        BinaryOp::Ge => each!(ge),
        BinaryOp::Gt => each!(gt),
    }
}
