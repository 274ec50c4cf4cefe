//! A product with a packed weight: rows times its f32 panels
//! ([`super::panels`]) or its bf16 pair panels ([`super::bf16`]), with the
//! microkernel this processor runs best.

use super::bf16::{self, Bf16Kernel};
use super::panels::{Isa, PackedB, Rows};
use std::ops::Range;

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
