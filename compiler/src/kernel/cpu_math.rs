//! The constants of the CPU kernels' math: the clamps, range reductions
//! and polynomial coefficients, and the row sums' chains, that the Cranelift emitter
//! (`cellc::clif::math`, with the `cranelift` feature) and the runtime's
//! walked kernels (AVX-512 and AVX2) both evaluate, in the same order.
//! Kept here, in one place, because the two must compute the same bits.
//!
//! `exp` is `2^n · e^r` with `|r| <= ln2/2` (Cephes' `expf`); `tanh` one
//! odd/even rational function of the clamped argument (Eigen's
//! `ptanh_float`, which PyTorch's and TensorFlow's CPU kernels use); `log`
//! `e·ln2 + log(m)` with `m ∈ [√½, √2)` (Cephes' `logf`).

// Written as published, with more digits than an f32 holds; the compiler rounds them once.
#![allow(clippy::excessive_precision)]

/// `exp`'s argument is clamped to `[EXP_LO, EXP_HI]`.
pub const EXP_LO: f32 = -87.336_54;
/// Upper end of `exp`'s clamp (see [`EXP_LO`]).
pub const EXP_HI: f32 = 88.376_26;
/// 1.5 · 2^23: added to `x · log2(e)`, it leaves `round(x / ln2)` in the low bits.
pub const EXP_MAGIC: f32 = 12_582_912.0;
/// `ln 2` in two parts, subtracted one after the other (`r = x - n·ln2`).
pub const EXP_LN2_HI: f32 = -0.693_359_4;
/// The low part of `ln 2` (see [`EXP_LN2_HI`]).
pub const EXP_LN2_LO: f32 = 2.121_944_4e-4;
/// `e^r ≈ 1 + r + r²·p(r)`: `p`'s coefficients, highest degree first.
pub const EXP_POLY: [f32; 6] =
    [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.000_000_1e-1];

/// `tanh`'s argument is clamped to `±TANH_BOUND`, where it rounds to ±1.
pub const TANH_BOUND: f32 = 7.905_311;
/// Below this magnitude `tanh(x)` is `x` to f32 precision.
pub const TANH_TINY: f32 = 0.0004;
/// `tanh(x) ≈ x·p(x²) / q(x²)`: the coefficients, highest degree first.
pub const TANH_P: [f32; 7] = [
    -2.760_768_5e-16,
    2.000_187_9e-13,
    -8.604_671_5e-11,
    5.122_297_1e-8,
    1.485_722_4e-5,
    6.372_619_3e-4,
    4.893_524_6e-3,
];
/// The coefficients of `q` in `tanh(x) ≈ x·p(x²) / q(x²)`, highest degree first.
pub const TANH_Q: [f32; 4] = [1.198_258_4e-6, 1.185_347_1e-4, 2.268_434_6e-3, 4.893_525_2e-3];

/// `log(m)` for `f = m - 1`: `f + f³·p(f) - f²/2`; `p`'s coefficients, highest degree first.
pub const LOG_POLY: [f32; 9] = [
    7.037_683_6e-2,
    -1.151_461e-1,
    1.167_699_9e-1,
    -1.242_014_1e-1,
    1.424_932_3e-1,
    -1.666_805_8e-1,
    2.000_071_4e-1,
    -2.499_999_4e-1,
    3.333_333_1e-1,
];
/// `ln 2` in two parts, added as `e·LOG_LN2_LO` first and `e·LOG_LN2_HI` last.
pub const LOG_LN2_LO: f32 = -2.121_944_4e-4;
/// The high part of `ln 2` (see [`LOG_LN2_LO`]).
pub const LOG_LN2_HI: f32 = 0.693_359_4;

/// A row sum adds this many `f32x4` chains over blocks of `4 * SUM_CHAINS`
/// floats (chain `c` takes floats `4c..4c + 4` of each block), then folds
/// them in halves (chain `c` plus chain `c + SUM_CHAINS / 2`, ...).
pub const SUM_CHAINS: usize = 16;
