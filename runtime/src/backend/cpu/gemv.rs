//! Matrix-vector products for a few rows (batch 1-4), where a GEMM library
//! is far from the memory bound: `y[r, j] = Σ_i W[j, i] · x[r, i]` reading
//! each PyTorch-layout row of `W` once, contiguously, with 16 independent
//! lanes (one AVX-512 register) so the compiler vectorises it. The output
//! rows are split in two halves across the cores, so each core streams
//! only its half of `W` — which stays in its own L2 from step to step.

/// Below this many rows a step's `X · Wᵀ` goes through [`gemv`].
pub const MAX_ROWS: usize = 4;

/// `y[r, j] = W[j, :] · x[r, :]` for `j` in `rows`: `U` rows of `W` at a
/// time, each with its own accumulator register (the FMA chains overlap and
/// one load of `x` serves `U` rows), then one fixed horizontal sum per row,
/// so a result never depends on how the rows were shared out.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn block_avx512(
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    n: usize,
    m: usize,
    k: usize,
    rows: std::ops::Range<usize>,
) {
    assert!(x.len() >= n * k && w.len() >= rows.end * k && y.len() >= n.saturating_sub(1) * m + rows.end);
    let mut j = rows.start;
    while j + 8 <= rows.end {
        // SAFETY: rows j..j+8 are within W and the sizes were checked above.
        unsafe { dots::<8>(y, x, w, n, m, k, j) };
        j += 8;
    }
    while j < rows.end {
        // SAFETY: as above, for row j.
        unsafe { dots::<1>(y, x, w, n, m, k, j) };
        j += 1;
    }
}

/// Rows `j..j + U` of `W` against every row of `x`.
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn dots<const U: usize>(y: &mut [f32], x: &[f32], w: &[f32], n: usize, m: usize, k: usize, j: usize) {
    use std::arch::x86_64::*;
    let (full, tail) = (k / 16, k % 16);
    let mask: __mmask16 = ((1u32 << tail) - 1) as u16;
    for r in 0..n {
        // SAFETY (whole block): the caller checked that x holds n rows of k,
        // W rows j..j + U of k, and y row r column j + U - 1; masked loads
        // touch only the k % 16 valid floats of the tail.
        unsafe {
            let xr = x.as_ptr().add(r * k);
            let wr = w.as_ptr().add(j * k);
            let mut acc = [_mm512_setzero_ps(); U];
            for c in 0..full {
                let xv = _mm512_loadu_ps(xr.add(c * 16));
                for (u, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(wr.add(u * k + c * 16)), xv, *a);
                }
            }
            if tail > 0 {
                let xv = _mm512_maskz_loadu_ps(mask, xr.add(full * 16));
                for (u, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, wr.add(u * k + full * 16)), xv, *a);
                }
            }
            for (u, a) in acc.iter().enumerate() {
                y[r * m + j + u] = _mm512_reduce_add_ps(*a);
            }
        }
    }
}

/// Without FMA hardware `mul_add` is a library call; plain products instead.
fn block_portable(
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    n: usize,
    m: usize,
    k: usize,
    rows: std::ops::Range<usize>,
) {
    for j in rows {
        let wr = &w[j * k..(j + 1) * k];
        for r in 0..n {
            y[r * m + j] = wr.iter().zip(&x[r * k..(r + 1) * k]).map(|(a, b)| a * b).sum();
        }
    }
}

fn block(y: &mut [f32], x: &[f32], w: &[f32], n: usize, m: usize, k: usize, rows: std::ops::Range<usize>) {
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the features it is compiled for were just detected.
        unsafe { block_avx512(y, x, w, n, m, k, rows) }
    } else {
        block_portable(y, x, w, n, m, k, rows)
    }
}

/// `y[n, m] = x[n, k] · Wᵀ` with `W: [m, k]` row-major, split in `parts`
/// column blocks on the current rayon pool.
pub fn gemv(y: &mut [f32], x: &[f32], w: &[f32], n: usize, m: usize, k: usize, parts: usize) {
    if parts <= 1 || m < 64 {
        return block(y, x, w, n, m, k, 0..m);
    }
    // Two halves (rounded to 16 rows): each core keeps its half of W hot.
    let half = (m / 2).next_multiple_of(16).min(m);
    let ptr = SendPtr(y.as_mut_ptr());
    let len = y.len();
    rayon::join(
        || {
            // SAFETY: both halves write disjoint columns j of y; y outlives the join.
            let y = unsafe { std::slice::from_raw_parts_mut(ptr.get(), len) };
            block(y, x, w, n, m, k, 0..half)
        },
        || {
            // SAFETY: as above.
            let y = unsafe { std::slice::from_raw_parts_mut(ptr.get(), len) };
            block(y, x, w, n, m, k, half..m)
        },
    );
}

/// `y[r, cols] = Σ_j d[r, j] · W[j, cols]`: the adjoint product `D · W`,
/// one contiguous axpy per row of `W`, vectorised along the outputs.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dw_avx512(
    y: &mut [f32],
    d: &[f32],
    w: &[f32],
    n: usize,
    m: usize,
    k: usize,
    cols: std::ops::Range<usize>,
) {
    const BLOCK: usize = 64; // four AVX-512 registers of partial sums
    for r in 0..n {
        let dr = &d[r * m..(r + 1) * m];
        let mut c0 = cols.start;
        while c0 < cols.end {
            let c1 = (c0 + BLOCK).min(cols.end);
            if c1 - c0 == BLOCK {
                let mut acc = [0.0f32; BLOCK];
                for (j, &dj) in dr.iter().enumerate() {
                    let wr = &w[j * k + c0..j * k + c0 + BLOCK];
                    for l in 0..BLOCK {
                        acc[l] = wr[l].mul_add(dj, acc[l]);
                    }
                }
                y[r * k + c0..r * k + c1].copy_from_slice(&acc);
            } else {
                for c in c0..c1 {
                    y[r * k + c] =
                        dr.iter().enumerate().fold(0.0f32, |a, (j, &dj)| w[j * k + c].mul_add(dj, a));
                }
            }
            c0 = c1;
        }
    }
}

fn dw_block(y: &mut [f32], d: &[f32], w: &[f32], n: usize, m: usize, k: usize, cols: std::ops::Range<usize>) {
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the features it is compiled for were just detected.
        unsafe { dw_avx512(y, d, w, n, m, k, cols) }
    } else {
        for r in 0..n {
            for c in cols.clone() {
                y[r * k + c] = (0..m).map(|j| d[r * m + j] * w[j * k + c]).sum();
            }
        }
    }
}

/// `y[n, k] = d[n, m] · W` with `W: [m, k]` row-major (the backward of a
/// GEMV), the output columns split in two halves across cores.
pub fn gemv_adjoint(y: &mut [f32], d: &[f32], w: &[f32], n: usize, m: usize, k: usize, parts: usize) {
    if parts <= 1 || k < 128 {
        return dw_block(y, d, w, n, m, k, 0..k);
    }
    let half = (k / 2).next_multiple_of(16).min(k);
    let ptr = SendPtr(y.as_mut_ptr());
    let len = y.len();
    rayon::join(
        || {
            // SAFETY: the halves write disjoint columns of y; y outlives the join.
            let y = unsafe { std::slice::from_raw_parts_mut(ptr.get(), len) };
            dw_block(y, d, w, n, m, k, 0..half)
        },
        || {
            // SAFETY: as above.
            let y = unsafe { std::slice::from_raw_parts_mut(ptr.get(), len) };
            dw_block(y, d, w, n, m, k, half..k)
        },
    );
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}
// SAFETY: used only to hand disjoint parts of one buffer to two threads.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_at_odd_sizes() {
        for (n, m, k) in [(1, 1, 1), (1, 130, 37), (3, 512, 128), (4, 65, 300)] {
            let x: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.13).sin()).collect();
            let w: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.07).cos()).collect();
            for parts in [1, 2] {
                // The adjoint form: y2[n, k] = y[n, m] · W.
                let d: Vec<f32> = (0..n * m).map(|i| (i as f32 * 0.11).cos()).collect();
                let mut y2 = vec![0.0; n * k];
                gemv_adjoint(&mut y2, &d, &w, n, m, k, parts);
                for r in 0..n {
                    for i in 0..k {
                        let want: f32 = (0..m).map(|j| d[r * m + j] * w[j * k + i]).sum();
                        assert!((y2[r * k + i] - want).abs() < 1e-3 * want.abs().max(1.0));
                    }
                }
                let mut y = vec![0.0; n * m];
                gemv(&mut y, &x, &w, n, m, k, parts);
                for r in 0..n {
                    for j in 0..m {
                        let want: f32 = (0..k).map(|i| w[j * k + i] * x[r * k + i]).sum();
                        assert!((y[r * m + j] - want).abs() < 1e-3 * want.abs().max(1.0));
                    }
                }
            }
        }
    }
}
