//! A product with a packed weight: rows times its f32 panels
//! ([`super::panels`]) or its bf16 pair panels ([`super::bf16`]), with the
//! microkernel this processor runs best.

use super::bf16::{self, Bf16Kernel};
use super::panels::{Isa, PackedB, Rows};
use cellc::precision::Precision;
use std::ops::Range;

/// Whether products at `precision` are bound by streaming their weights
/// rather than by arithmetic: bf16 on AMX tiles, whose products outrun
/// the rate at which even L2 supplies a weight's tiles (a 1 KiB tile loads
/// in 9 ns from L2, 43 ns from memory; a tile product takes about 6 ns, on
/// a Xeon with AMX). Such a pass should read each weight as few times as
/// it can.
pub fn bound_by_weights(precision: Precision) -> bool {
    precision == Precision::Bf16 && Bf16Kernel::detect() == Bf16Kernel::Amx
}

/// Bytes a packed weight takes per element with products at `precision`:
/// bf16 pairs, else f32.
pub fn packed_bytes(precision: Precision) -> usize {
    match precision {
        Precision::Bf16 => 2,
        _ => 4,
    }
}

/// `Y[i, j] (+)= Σ_kk A[i, kk] · B[kk, j]` for rows `i < m` and the columns
/// of `panels`, on the calling thread.
///
/// # Safety
/// `a` holds `m` rows of `b.k()` floats, `lda` apart; `y` holds `m` rows,
/// `ldy` apart, with every column of `panels` writable; `y` does not overlap
/// `a` or `b`.
pub unsafe fn multiply(rows: Rows, b: &PackedB, panels: Range<usize>, accumulate: bool) {
    // SAFETY: forwarded from the caller.
    unsafe {
        if b.bf16 {
            bf16::multiply_with(Bf16Kernel::detect(), rows, b, panels, accumulate)
        } else {
            super::panels::multiply_with(Isa::detect(), rows, b, panels, accumulate)
        }
    }
}
