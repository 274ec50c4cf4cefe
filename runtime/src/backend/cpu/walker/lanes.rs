//! The vector instruction sets the walker runs on, as one trait: AVX-512
//! (sixteen lanes) and AVX2 with FMA (eight). Each method is one
//! per-lane IEEE operation, the same on both sets, so code written once
//! against [`Lanes`] computes the same bits on either, and the same bits
//! as the Cranelift emitter's `f32x4` instruction for that operation.
//!
//! The two sets are written side by side, a row an operation with the
//! intrinsic each computes it with, so that what differs between them (AVX2
//! has no mask registers: comparisons give all-ones lanes, blends read
//! their sign bits, masked loads and stores take an integer vector) is
//! read on one line. Minimum and maximum are `minps`'s and `maxps`'s rule
//! on both (the second operand where either is NaN, or where both are
//! zeros); a comparison's predicate is the same `_CMP_*` constant.
//!
//! A value of [`Avx512`] or [`Avx2`] exists only where the processor has
//! that set ([`Lanes::detect`]): it is the proof each method's intrinsic
//! needs. The methods are `#[inline(always)]`, and code that uses them
//! runs inside [`Lanes::enter`], a function compiled for the set, into
//! which they all inline as single instructions (the walker's functions
//! and the closure it enters with are `#[inline(always)]` too, and hand no
//! closure to a function that is not).

use std::arch::x86_64::*;

/// Declares [`Lanes`] and implements it for both sets, from the table
/// below: the sets' descriptions, then a row an operation, its AVX-512
/// intrinsic first.
macro_rules! lanes {
    (
        sets {
            $(#[$a_doc:meta])* $a:ident $a_set:tt
            $(#[$b_doc:meta])* $b:ident $b_set:tt
        }
        values {
            $(
                $(#[$doc:meta])*
                fn $op:ident $(<const $p:ident: $pt:ty>)? ($($arg:ident: $ty:ty),*) -> $ret:ty {
                    $a_op:expr,
                    $b_op:expr $(,)?
                }
            )*
        }
        access {
            $(
                $(#[$acc_doc:meta])*
                fn $acc:ident ($($acc_arg:ident: $acc_ty:ty),*) -> $acc_ret:ty {
                    $a_acc:expr,
                    $b_acc:expr $(,)?
                }
            )*
        }
        memory {
            $(
                $(#[$mem_doc:meta])*
                fn $mem:ident ($($mem_arg:ident: $mem_ty:ty),*) $(-> $mem_ret:ty)? {
                    $a_mem:expr,
                    $b_mem:expr $(,)?
                }
            )*
        }
    ) => {
        /// The per-lane operations of the walker's math (`walker/math.rs`) on vectors
        /// of some width: an instruction set's ([`Lanes`]), or a trace of
        /// them that is compiled later (`walker/trace.rs`).
        pub trait Math: Copy + std::fmt::Debug + Send + Sync + 'static {
            /// A vector of floats.
            type V: Copy;
            /// The same bits as 32-bit integers.
            type Int: Copy;
            /// A comparison's result, lane by lane.
            type Cmp: Copy;

            $(
                $(#[$doc])*
                fn $op $(<const $p: $pt>)? (self, $($arg: $ty),*) -> $ret;
            )*
        }

        /// A vector instruction set: its vectors, the per-lane operations
        /// ([`Math`]), and the lane access and memory operations the walker
        /// uses (see the module's doc). A value of it is proof that the
        /// processor has the set.
        pub trait Lanes: Math {
            /// The lanes a masked load or store touches.
            type Mask: Copy;
            /// The set's name, for messages.
            const NAME: &'static str;
            /// Floats in a vector.
            const LANES: usize;
            /// Vectors of a value that the walker's fused loops compute per
            /// pass (see the walker's module doc).
            const REGISTERS: usize;
            /// The set the walker compiles its fused loops for
            /// (`walker/compiled.rs`) rather than walking them, if any.
            const COMPILED: Option<super::target::Target>;

            /// The set, if this processor has it.
            fn detect() -> Option<Self>;

            /// Runs `f` in a function compiled for the set. `f` should be an
            /// `#[inline(always)]` closure calling `#[inline(always)]`
            /// functions: they inline into it as the set's instructions,
            /// where a function left out of line is compiled without the
            /// set and calls each intrinsic.
            fn enter<R>(self, f: impl FnOnce() -> R) -> R;

            $(
                $(#[$acc_doc])*
                fn $acc(self, $($acc_arg: $acc_ty),*) -> $acc_ret;
            )*

            $(
                $(#[$mem_doc])*
                unsafe fn $mem(self, $($mem_arg: $mem_ty),*) $(-> $mem_ret)?;
            )*
        }

        lanes!(@set [$(#[$a_doc])*] $a $a_set
            $($op $(<const $p: $pt>)? ($($arg: $ty),*) -> $ret { $a_op })*;
            $($acc ($($acc_arg: $acc_ty),*) -> $acc_ret { $a_acc })*;
            $($mem ($($mem_arg: $mem_ty),*) $(-> $mem_ret)? { $a_mem })*);
        lanes!(@set [$(#[$b_doc])*] $b $b_set
            $($op $(<const $p: $pt>)? ($($arg: $ty),*) -> $ret { $b_op })*;
            $($acc ($($acc_arg: $acc_ty),*) -> $acc_ret { $b_acc })*;
            $($mem ($($mem_arg: $mem_ty),*) $(-> $mem_ret)? { $b_mem })*);
    };

    // One set: its token type, and the trait with each operation its intrinsic.
    (@set [$(#[$set_doc:meta])*] $set:ident {
            name: $name:literal,
            features: $features:literal,
            detected: $detected:expr,
            lanes: $lanes:literal,
            registers: $registers:literal,
            compiled: $compiled:ident,
            types: $v:ty, $int:ty, $cmp:ty, $mask:ty $(,)?
        }
        $($op:ident $(<const $p:ident: $pt:ty>)? ($($arg:ident: $ty:ty),*) -> $ret:ty { $e:expr })*;
        $($acc:ident ($($acc_arg:ident: $acc_ty:ty),*) -> $acc_ret:ty { $acc_e:expr })*;
        $($mem:ident ($($mem_arg:ident: $mem_ty:ty),*) $(-> $mem_ret:ty)? { $mem_e:expr })*
    ) => {
        $(#[$set_doc])*
        #[derive(Clone, Copy, Debug)]
        pub struct $set(());

        impl Math for $set {
            type V = $v;
            type Int = $int;
            type Cmp = $cmp;

            $(
                #[inline(always)]
                fn $op $(<const $p: $pt>)? (self, $($arg: $ty),*) -> $ret {
                    // SAFETY: a value of the set exists only where the processor has it.
                    unsafe { $e }
                }
            )*
        }

        impl Lanes for $set {
            type Mask = $mask;
            const NAME: &'static str = $name;
            const LANES: usize = $lanes;
            const REGISTERS: usize = $registers;
            const COMPILED: Option<super::target::Target> = Some(super::target::Target::$compiled);

            fn detect() -> Option<Self> {
                ($detected).then_some($set(()))
            }

            #[inline(always)]
            fn enter<R>(self, f: impl FnOnce() -> R) -> R {
                #[target_feature(enable = $features)]
                fn compiled_for_the_set<R>(f: impl FnOnce() -> R) -> R {
                    f()
                }
                // SAFETY: a value of the set exists only where the processor has it.
                unsafe { compiled_for_the_set(f) }
            }

            $(
                #[inline(always)]
                fn $acc(self, $($acc_arg: $acc_ty),*) -> $acc_ret {
                    // SAFETY: as in `enter`.
                    unsafe { $acc_e }
                }
            )*

            $(
                #[inline(always)]
                unsafe fn $mem(self, $($mem_arg: $mem_ty),*) $(-> $mem_ret)? {
                    // SAFETY: the caller's pointers, per the method's
                    // contract; the set, as in `enter`.
                    unsafe { $mem_e }
                }
            )*
        }
    };
}

lanes! {
    sets {
        /// AVX-512F: sixteen lanes in a `zmm` register, comparisons into mask registers.
        Avx512 {
            name: "AVX-512F",
            features: "avx512f",
            detected: std::arch::is_x86_feature_detected!("avx512f"),
            lanes: 16,
            registers: 8,
            compiled: Avx512,
            types: __m512, __m512i, __mmask16, __mmask16,
        }
        /// AVX2 with FMA: eight lanes in a `ymm` register, comparisons into
        /// all-ones lanes (AMD Zen 1 to 3, Intel from Haswell without AVX-512).
        Avx2 {
            name: "AVX2 and FMA",
            features: "avx2,fma",
            detected: std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma"),
            lanes: 8,
            registers: 16,
            compiled: Avx2,
            types: __m256, __m256i, __m256, __m256i,
        }
    }
    values {
        /// Every lane `x`.
        fn splat(x: f32) -> Self::V { _mm512_set1_ps(x), _mm256_set1_ps(x) }
        /// `x + y`.
        fn add(x: Self::V, y: Self::V) -> Self::V { _mm512_add_ps(x, y), _mm256_add_ps(x, y) }
        /// `x - y`.
        fn sub(x: Self::V, y: Self::V) -> Self::V { _mm512_sub_ps(x, y), _mm256_sub_ps(x, y) }
        /// `x · y`.
        fn mul(x: Self::V, y: Self::V) -> Self::V { _mm512_mul_ps(x, y), _mm256_mul_ps(x, y) }
        /// `x / y`.
        fn div(x: Self::V, y: Self::V) -> Self::V { _mm512_div_ps(x, y), _mm256_div_ps(x, y) }
        /// `x · y + z`, rounded once (Cranelift's `fma`).
        fn fma(x: Self::V, y: Self::V, z: Self::V) -> Self::V {
            _mm512_fmadd_ps(x, y, z), _mm256_fmadd_ps(x, y, z)
        }
        /// `√x`.
        fn sqrt(x: Self::V) -> Self::V { _mm512_sqrt_ps(x), _mm256_sqrt_ps(x) }
        /// `x < y ? x : y`: `y` where either is NaN, or where both are zeros (`minps`'s rule).
        fn min(x: Self::V, y: Self::V) -> Self::V { _mm512_min_ps(x, y), _mm256_min_ps(x, y) }
        /// `y < x ? x : y`: `y` where either is NaN, or where both are zeros (`maxps`'s rule).
        fn max(x: Self::V, y: Self::V) -> Self::V { _mm512_max_ps(x, y), _mm256_max_ps(x, y) }
        /// Where `x P y` holds, for a `_CMP_*` predicate `P`: a mask register's bits on
        /// AVX-512, all-ones lanes on AVX2.
        fn cmp<const P: i32>(x: Self::V, y: Self::V) -> Self::Cmp {
            _mm512_cmp_ps_mask::<P>(x, y), _mm256_cmp_ps::<P>(x, y)
        }
        /// `yes` where `c` holds, else `no` (AVX2 reads a lane's sign bit: all of a comparison's).
        fn blend(c: Self::Cmp, no: Self::V, yes: Self::V) -> Self::V {
            _mm512_mask_blend_ps(c, no, yes), _mm256_blendv_ps(no, yes, c)
        }
        /// The float's bits.
        fn bits(x: Self::V) -> Self::Int { _mm512_castps_si512(x), _mm256_castps_si256(x) }
        /// The floats these bits are.
        fn float(x: Self::Int) -> Self::V { _mm512_castsi512_ps(x), _mm256_castsi256_ps(x) }
        /// Every lane the integer `x`.
        fn splat_int(x: i32) -> Self::Int { _mm512_set1_epi32(x), _mm256_set1_epi32(x) }
        /// `x + y` as integers.
        fn int_add(x: Self::Int, y: Self::Int) -> Self::Int { _mm512_add_epi32(x, y), _mm256_add_epi32(x, y) }
        /// `x - y` as integers.
        fn int_sub(x: Self::Int, y: Self::Int) -> Self::Int { _mm512_sub_epi32(x, y), _mm256_sub_epi32(x, y) }
        /// `x & y`.
        fn and(x: Self::Int, y: Self::Int) -> Self::Int { _mm512_and_si512(x, y), _mm256_and_si256(x, y) }
        /// `x | y`.
        fn or(x: Self::Int, y: Self::Int) -> Self::Int { _mm512_or_si512(x, y), _mm256_or_si256(x, y) }
        /// `x ^ y`.
        fn xor(x: Self::Int, y: Self::Int) -> Self::Int { _mm512_xor_si512(x, y), _mm256_xor_si256(x, y) }
        /// `x << 23`: an integer into a float's exponent field.
        fn shl_23(x: Self::Int) -> Self::Int { _mm512_slli_epi32::<23>(x), _mm256_slli_epi32::<23>(x) }
        /// `x >> 23`, zeros shifted in: a float's sign and exponent fields.
        fn shr_23(x: Self::Int) -> Self::Int { _mm512_srli_epi32::<23>(x), _mm256_srli_epi32::<23>(x) }
        /// The integers as floats, rounded to nearest.
        fn int_to_float(x: Self::Int) -> Self::V { _mm512_cvtepi32_ps(x), _mm256_cvtepi32_ps(x) }
    }
    access {
        /// Lane 0.
        fn first(x: Self::V) -> f32 { _mm512_cvtss_f32(x), _mm256_cvtss_f32(x) }
        /// The first `lanes` lanes (at most [`Lanes::LANES`]).
        fn mask(lanes: usize) -> Self::Mask {
            _cvtu32_mask16((1 << lanes) - 1),
            _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
        }
    }
    memory {
        /// The floats at `p`.
        ///
        /// # Safety
        /// `p` readable for [`Lanes::LANES`] floats.
        fn load(p: *const f32) -> Self::V { _mm512_loadu_ps(p), _mm256_loadu_ps(p) }
        /// The floats at `p` in `mask`'s lanes, zeros in the others.
        ///
        /// # Safety
        /// `p` readable for the mask's lanes.
        fn load_masked(p: *const f32, mask: Self::Mask) -> Self::V {
            _mm512_maskz_loadu_ps(mask, p), _mm256_maskload_ps(p, mask)
        }
        /// Writes `x` to `p`.
        ///
        /// # Safety
        /// `p` writable for [`Lanes::LANES`] floats.
        fn store(p: *mut f32, x: Self::V) { _mm512_storeu_ps(p, x), _mm256_storeu_ps(p, x) }
        /// Writes `mask`'s lanes of `x` to `p`, and nothing else.
        ///
        /// # Safety
        /// `p` writable for the mask's lanes.
        fn store_masked(p: *mut f32, mask: Self::Mask, x: Self::V) {
            _mm512_mask_storeu_ps(p, mask, x), _mm256_maskstore_ps(p, mask, x)
        }
    }
}
