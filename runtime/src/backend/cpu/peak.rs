//! This machine's arithmetic peak, measured: the rate of independent
//! chains of the widest f32 fused multiply-add it has (AVX-512, else AVX2
//! with FMA), of its bf16 dot product (`vdpbf16ps`, where it has
//! AVX512-BF16), and of its bf16 tile product (AMX's `tdpbf16ps`, where
//! Linux lets the process use the tiles), on one core and on several at once. Every speed the
//! project reports is a fraction of it (`cellc peak`, `cellc bench`), so a
//! rate says how much of the machine it uses, whatever the machine.
//!
//! Each thread runs [`CHAINS`] accumulators, more than an FMA unit's
//! latency times its ports on the processors the project targets (4
//! cycles by 2 ports on AMD Zen and Intel Xeon), so the units never wait
//! for a result; the inputs are opaque to the compiler and the result is
//! kept, so nothing is folded away.

use crate::error::{Result, RuntimeError};
use std::time::Instant;

/// Independent accumulators per thread.
pub const CHAINS: usize = 12;

/// The instructions a peak is measured with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeakKind {
    /// f32 fused multiply-adds, the widest the processor has.
    F32Fma,
    /// bf16 pair dot products into f32 (`vdpbf16ps`).
    Bf16Dot,
    /// bf16 tile products into f32 (AMX's `tdpbf16ps`).
    Bf16Tiles,
}

impl PeakKind {
    /// Every kind, in the order `cellc peak` prints them.
    pub const ALL: [PeakKind; 3] = [PeakKind::F32Fma, PeakKind::Bf16Dot, PeakKind::Bf16Tiles];

    /// The name `cellc peak --json` gives it.
    pub fn name(self) -> &'static str {
        match self {
            PeakKind::F32Fma => "f32_fma",
            PeakKind::Bf16Dot => "bf16_dot",
            PeakKind::Bf16Tiles => "bf16_tiles",
        }
    }
}

/// A measured peak.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Peak {
    /// What was measured.
    pub kind: PeakKind,
    /// The instruction set: `"avx512"`, `"avx2"`, `"avx512bf16"` or `"amx"`.
    pub isa: &'static str,
    /// Threads that ran at once.
    pub threads: usize,
    /// Floating-point operations per second, all threads together (a
    /// multiply-add is two).
    pub flops: f64,
}

/// The peak of `kind` on `threads` threads at once, the best of several
/// runs of at least `min_time` seconds in all: an error where the
/// processor has no such instructions (bf16 dot products without
/// AVX512-BF16; anything off x86-64).
pub fn measure(kind: PeakKind, threads: usize, min_time: f64) -> Result<Peak> {
    let Kernel { isa, run, macs } = kernel(kind)?;
    // Two operations per multiply-add (a bf16 dot product's two products
    // summed into a lane count as two multiply-adds, as a GEMM's flops do).
    let per_iter = (macs * 2) as f64;
    let threads = threads.max(1);
    // Calibrate: iterations that take about a tenth of the time on one thread.
    let mut iters = 1u64 << 12;
    loop {
        let t = Instant::now();
        run(iters);
        let secs = t.elapsed().as_secs_f64();
        if secs > 0.005 || iters >= 1 << 40 {
            iters = ((iters as f64) * (min_time / 10.0).max(0.001) / secs.max(1e-9)).max(1.0) as u64;
            break;
        }
        iters *= 4;
    }
    let mut best: f64 = 0.0;
    let start = Instant::now();
    while best == 0.0 || start.elapsed().as_secs_f64() < min_time {
        let t = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| run(iters));
            }
        });
        let secs = t.elapsed().as_secs_f64();
        best = best.max(threads as f64 * iters as f64 * per_iter / secs);
    }
    Ok(Peak { kind, isa, threads, flops: best })
}

/// A loop that measures a peak.
struct Kernel {
    /// Its instruction set's name.
    isa: &'static str,
    /// Runs every chain this many times.
    run: fn(u64),
    /// Multiply-adds per iteration, all chains together.
    macs: usize,
}

/// The loop that measures `kind` on this processor.
fn kernel(kind: PeakKind) -> Result<Kernel> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let found = match kind {
            PeakKind::F32Fma if has!("avx512f") => {
                Some(Kernel { isa: "avx512", run: x86::fma_avx512, macs: CHAINS * 16 })
            }
            PeakKind::F32Fma if has!("avx2") && has!("fma") => {
                Some(Kernel { isa: "avx2", run: x86::fma_avx2, macs: CHAINS * 8 })
            }
            // 16 f32 lanes, each adding two products.
            PeakKind::Bf16Dot if has!("avx512f") && has!("avx512bf16") => {
                Some(Kernel { isa: "avx512bf16", run: x86::dot_bf16, macs: CHAINS * 32 })
            }
            PeakKind::Bf16Tiles if super::amx::usable() => {
                Some(Kernel { isa: "amx", run: x86::tiles_bf16, macs: super::amx::DOT_ROUND_MACS })
            }
            _ => None,
        };
        if let Some(k) = found {
            return Ok(k);
        }
    }
    let what = match kind {
        PeakKind::F32Fma => "f32 fused multiply-adds (AVX2 with FMA, or AVX-512)",
        PeakKind::Bf16Dot => "bf16 dot products (AVX512-BF16)",
        PeakKind::Bf16Tiles => "bf16 tile products (AMX-BF16, permitted by the kernel)",
    };
    Err(RuntimeError::Backend { backend: "cpu".into(), message: format!("this processor has no {what}") })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;
    use std::hint::black_box;

    /// `iters` times, every chain `acc = a * acc + b` in 16 lanes.
    pub fn fma_avx512(iters: u64) {
        // SAFETY: chosen only where the processor has AVX-512F.
        black_box(unsafe { fma_avx512_on(iters) });
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn fma_avx512_on(iters: u64) -> f32 {
        let (a, b) = (_mm512_set1_ps(black_box(0.999_999)), _mm512_set1_ps(black_box(1e-7)));
        let mut acc = [_mm512_set1_ps(black_box(1.0)); CHAINS];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(a, *x, b);
            }
        }
        let sum = acc.iter().fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x));
        _mm512_reduce_add_ps(sum)
    }

    /// `iters` times, every chain `acc = a * acc + b` in 8 lanes.
    pub fn fma_avx2(iters: u64) {
        // SAFETY: chosen only where the processor has AVX2 and FMA.
        black_box(unsafe { fma_avx2_on(iters) });
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn fma_avx2_on(iters: u64) -> f32 {
        let (a, b) = (_mm256_set1_ps(black_box(0.999_999)), _mm256_set1_ps(black_box(1e-7)));
        let mut acc = [_mm256_set1_ps(black_box(1.0)); CHAINS];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(a, *x, b);
            }
        }
        let sum = acc.iter().fold(_mm256_setzero_ps(), |s, &x| _mm256_add_ps(s, x));
        let mut lanes = [0.0f32; 8];
        // SAFETY: eight floats of room.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        lanes.iter().sum()
    }

    /// `iters` times, every chain `acc += a · b` over 16 pairs of bf16 pairs.
    pub fn dot_bf16(iters: u64) {
        // SAFETY: chosen only where the processor has AVX-512F and AVX512-BF16.
        black_box(unsafe { dot_bf16_on(iters) });
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn dot_bf16_on(iters: u64) -> f32 {
        // 0x3f80 is bf16 1.0, 0x3400 a small bf16: two of each per 32-bit word.
        let (a, b): (__m512bh, __m512bh) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(black_box(0x3f80_3f80))),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(black_box(0x3400_3400))),
            )
        };
        let mut acc = [_mm512_set1_ps(black_box(0.0)); CHAINS];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_dpbf16_ps(*x, a, b);
            }
        }
        let sum = acc.iter().fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x));
        _mm512_reduce_add_ps(sum)
    }

    /// `iters` rounds of four independent tile products ([`super::super::amx::dot_rounds`]).
    pub fn tiles_bf16(iters: u64) {
        // SAFETY: chosen only where AMX is usable.
        unsafe { super::super::amx::dot_rounds(black_box(iters)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_f32_peak_is_a_positive_rate_and_grows_with_threads_no_faster_than_them() {
        let Ok(one) = measure(PeakKind::F32Fma, 1, 0.05) else {
            eprintln!("skipped: no FMA unit on this processor");
            return;
        };
        assert!(one.flops > 1e9, "{one:?}");
        // Each the best of three rounds, alternating: on a shared machine one
        // round of one thread can run while another process holds the core.
        let (mut one, mut two) = (one.flops, 0.0f64);
        for round in 0..3 {
            if round > 0 {
                one = one.max(measure(PeakKind::F32Fma, 1, 0.05).expect("the same instructions").flops);
            }
            two = two.max(measure(PeakKind::F32Fma, 2, 0.05).expect("the same instructions").flops);
        }
        // Two threads share at most twice the units (on a busy or one-core machine, fewer).
        assert!(two < 2.5 * one, "one thread {one:e} FLOP/s, two {two:e}");
    }

    #[test]
    fn bf16_dot_products_are_measured_where_the_processor_has_them_and_refused_by_name_elsewhere() {
        match measure(PeakKind::Bf16Dot, 1, 0.05) {
            Ok(p) => assert!(p.flops > 1e9 && p.isa == "avx512bf16", "{p:?}"),
            Err(e) => assert!(e.to_string().contains("AVX512-BF16"), "{e}"),
        }
        match measure(PeakKind::Bf16Tiles, 1, 0.05) {
            Ok(p) => assert!(p.flops > 1e9 && p.isa == "amx", "{p:?}"),
            Err(e) => assert!(e.to_string().contains("AMX-BF16"), "{e}"),
        }
    }
}
