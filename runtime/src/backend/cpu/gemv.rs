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
    in_halves(y, m, |y, rows| block(y, x, w, n, m, k, rows));
}

/// Runs `part` on two threads, for output indices `0..half` and `half..len`
/// (`half` rounded up to 16), each with the whole of `y` but writing only
/// its own indices.
fn in_halves(y: &mut [f32], len: usize, part: impl Fn(&mut [f32], std::ops::Range<usize>) + Sync) {
    let half = (len / 2).next_multiple_of(16).min(len);
    let ptr = SendPtr(y.as_mut_ptr());
    let size = y.len();
    let run = |range: std::ops::Range<usize>| {
        // SAFETY: the two calls write disjoint indices of y (the caller's
        // `part` writes only its range); y outlives the join.
        let y = unsafe { std::slice::from_raw_parts_mut(ptr.get(), size) };
        part(y, range)
    };
    rayon::join(|| run(0..half), || run(half..len));
}

/// `y[r, cols] = Σ_j d[r, j] · W[j, cols]`: the adjoint product `D · W`.
/// Up to 256 output columns per pass are held in registers (16 AVX-512
/// accumulators, fewer per row when several rows share a pass) while the
/// rows of `W` stream by, each read as one contiguous piece; sums run over
/// `j` in order, so the result does not depend on how columns were split.
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
    assert!(d.len() >= n * m && w.len() >= m * k && y.len() >= n * k && cols.end <= k);
    // SAFETY (all calls): sizes checked above; each pass stays inside `cols`.
    unsafe {
        match n {
            1 => dw_rows::<1, 16>(y, d, w, m, k, cols),
            2 => dw_rows::<2, 8>(y, d, w, m, k, cols),
            3 => dw_rows::<3, 4>(y, d, w, m, k, cols),
            _ => {
                dw_rows::<4, 4>(y, d, w, m, k, cols.clone());
                if n > 4 {
                    let (d, y) = (&d[4 * m..], &mut y[4 * k..]);
                    dw_avx512(y, d, w, n - 4, m, k, cols);
                }
            }
        }
    }
}

/// `R` rows of `D · W` over `cols`, in passes of `V` registers (16 columns
/// each); the last pass of a range narrower than `16·V` is masked.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dw_rows<const R: usize, const V: usize>(
    y: &mut [f32],
    d: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    cols: std::ops::Range<usize>,
) {
    use std::arch::x86_64::*;
    let mut c0 = cols.start;
    while c0 < cols.end {
        let width = (cols.end - c0).min(16 * V);
        // Lanes of each register that are inside this pass.
        let masks: [__mmask16; V] = std::array::from_fn(|v| {
            let lanes = width.saturating_sub(16 * v).min(16);
            ((1u32 << lanes) - 1) as u16
        });
        // SAFETY: rows j < m of W and columns c0..c0 + width < k; masked
        // lanes are neither read nor written.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); V]; R];
            for j in 0..m {
                let wr = w.as_ptr().add(j * k + c0);
                let row: [__m512; V] =
                    std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], wr.add(16 * v)));
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let dj = _mm512_set1_ps(*d.get_unchecked(r * m + j));
                    for v in 0..V {
                        acc_r[v] = _mm512_fmadd_ps(row[v], dj, acc_r[v]);
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                let yr = y.as_mut_ptr().add(r * k + c0);
                for v in 0..V {
                    _mm512_mask_storeu_ps(yr.add(16 * v), masks[v], acc_r[v]);
                }
            }
        }
        c0 += width;
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
    in_halves(y, k, |y, cols| dw_block(y, d, w, n, m, k, cols));
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
