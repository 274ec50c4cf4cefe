//! Products that read a weight where it lies, row-major, unpacked: for a
//! pass whose weights come with the call (a framework's tensors, which may
//! change between calls) over a batch of a few sequences.
//!
//! Packing a weight into panels ([`super::panels`]) pays when many rows
//! pass over it. A call of one step on one sequence, as a generation loop
//! makes, multiplies one row by each weight: packing reads the weight,
//! writes the panels and reads them again, three times the memory traffic
//! of the product itself (measured: 300 of a 345 µs B=1, T=1, H=256 LSTM
//! call). Here the product reads the weight once, in place:
//!
//! - `Y = X · Wᵀ` (`W: [n, k]`): sixteen rows of `W` at a time turned
//!   into sixteen columns in registers (the transpose packing makes, never
//!   stored), each scaled and added into the outputs;
//! - `Y = D · W` (`W: [k, n]`): each row of `W` scaled and added, vectors
//!   along `n`.
//!
//! Either way each output adds its `k` products in order of `k`, one fused
//! multiply-add at a time from zero, as the panels' microkernel does: a
//! pass gives the same bits whether its weights are packed or read here.

use super::panels::Rows;
use std::ops::Range;

/// Rows of `X` that share one pass over the weight.
pub const ROWS: usize = 4;

/// `y[i, j] = Σ_k a[i, k] · w[j, k]` for every row `i < rows.m` and the
/// output columns `cols` (rows of `w`, which has `k` columns, row-major).
///
/// # Safety
/// `rows` describes valid memory (`y` writable at `cols` of each row, `a`
/// readable at `k` floats of each), `w` readable at rows `cols` of `k`
/// floats, and nothing else writes those outputs meanwhile.
pub unsafe fn times_transpose(rows: Rows, w: *const f32, k: usize, cols: Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: forwarded; the feature is present.
        return unsafe { times_transpose_avx512(rows, w, k, cols) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: forwarded; the features are present.
        return unsafe { times_transpose_avx2(rows, w, k, cols) };
    }
    // SAFETY: forwarded.
    unsafe { times_transpose_portable(rows, w, k, cols) }
}

/// `y[i, j] = Σ_r a[i, r] · w[r, j]` for every row `i < rows.m` and the
/// output columns `cols` (`w: [k, n]` row-major).
///
/// # Safety
/// As [`times_transpose`], `w` readable at `k` rows of `n` floats.
pub unsafe fn times(rows: Rows, w: *const f32, k: usize, n: usize, cols: Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: forwarded; the feature is present.
        return unsafe { times_avx512(rows, w, k, n, cols) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: forwarded; the features are present.
        return unsafe { times_avx2(rows, w, k, n, cols) };
    }
    // SAFETY: forwarded.
    unsafe { times_portable(rows, w, k, n, cols) }
}

unsafe fn times_transpose_portable(rows: Rows, w: *const f32, k: usize, cols: Range<usize>) {
    for i in 0..rows.m {
        // SAFETY: per the contract.
        let (a, y) =
            unsafe { (std::slice::from_raw_parts(rows.a.add(i * rows.lda), k), rows.y.add(i * rows.ldy)) };
        for j in cols.clone() {
            // SAFETY: per the contract.
            let wj = unsafe { std::slice::from_raw_parts(w.add(j * k), k) };
            let dot = a.iter().zip(wj).fold(0.0f32, |s, (x, v)| x.mul_add(*v, s));
            // SAFETY: per the contract.
            unsafe { *y.add(j) = dot };
        }
    }
}

unsafe fn times_portable(rows: Rows, w: *const f32, k: usize, n: usize, cols: Range<usize>) {
    for i in 0..rows.m {
        // SAFETY: per the contract.
        let (a, y) =
            unsafe { (std::slice::from_raw_parts(rows.a.add(i * rows.lda), k), rows.y.add(i * rows.ldy)) };
        for j in cols.clone() {
            // SAFETY: per the contract.
            let sum = (0..k).fold(0.0f32, |s, r| a[r].mul_add(unsafe { *w.add(r * n + j) }, s));
            // SAFETY: per the contract.
            unsafe { *y.add(j) = sum };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn times_transpose_avx512(rows: Rows, w: *const f32, k: usize, cols: Range<usize>) {
    for i0 in (0..rows.m).step_by(ROWS) {
        let block = row_block(rows, i0);
        // SAFETY (block): forwarded, for rows i0..i0+m.
        unsafe {
            match block.m {
                1 => rows_times_transpose::<1>(block, w, k, cols.clone()),
                2 => rows_times_transpose::<2>(block, w, k, cols.clone()),
                3 => rows_times_transpose::<3>(block, w, k, cols.clone()),
                _ => rows_times_transpose::<ROWS>(block, w, k, cols.clone()),
            }
        }
    }
}

/// [`times_transpose`] for exactly `R` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_times_transpose<const R: usize>(rows: Rows, w: *const f32, k: usize, cols: Range<usize>) {
    use std::arch::x86_64::*;
    let mut j = cols.start;
    while j < cols.end {
        let g = 16.min(cols.end - j);
        // SAFETY (block): per the contract: R rows of a and y, rows j..j+g of w.
        unsafe {
            let a: [*const f32; R] = std::array::from_fn(|i| rows.a.add(i * rows.lda));
            let mut acc = [_mm512_setzero_ps(); R];
            let mut kk = 0;
            if g == 16 {
                // Sixteen rows of W turned into sixteen columns in registers.
                while kk + 16 <= k {
                    let columns = super::panels::transposed16(w.add(j * k + kk), k);
                    for (c, column) in columns.iter().enumerate() {
                        for i in 0..R {
                            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(*a[i].add(kk + c)), *column, acc[i]);
                        }
                    }
                    kk += 16;
                }
            }
            // The edges, a column of W gathered at a time.
            while kk < k {
                let column: [f32; 16] =
                    std::array::from_fn(|r| if r < g { *w.add((j + r) * k + kk) } else { 0.0 });
                let column = _mm512_loadu_ps(column.as_ptr());
                for i in 0..R {
                    acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(*a[i].add(kk)), column, acc[i]);
                }
                kk += 1;
            }
            let mask = ((1u32 << g) - 1) as __mmask16;
            for (i, v) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(rows.y.add(i * rows.ldy + j), mask, *v);
            }
        }
        j += g;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn times_avx512(rows: Rows, w: *const f32, k: usize, n: usize, cols: Range<usize>) {
    use std::arch::x86_64::*;
    /// Vectors of output columns per pass over the rows of `W`.
    const VECS: usize = 4;
    for i0 in (0..rows.m).step_by(ROWS) {
        let m = ROWS.min(rows.m - i0);
        let mut j = cols.start;
        while j < cols.end {
            let width = (VECS * 16).min(cols.end - j);
            let masks: [__mmask16; VECS] = std::array::from_fn(|v| {
                let left = width.saturating_sub(v * 16).min(16);
                ((1u32 << left) - 1) as __mmask16
            });
            // SAFETY (block): per the contract: rows i0..i0+m of a and y, columns j..j+width of w's k rows.
            unsafe {
                let mut acc = [[_mm512_setzero_ps(); VECS]; ROWS];
                for r in 0..k {
                    let wrow = w.add(r * n + j);
                    let wv: [__m512; VECS] =
                        std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], wrow.add(v * 16)));
                    for (i, acc) in acc.iter_mut().enumerate().take(m) {
                        let d = _mm512_set1_ps(*rows.a.add((i0 + i) * rows.lda + r));
                        for v in 0..VECS {
                            acc[v] = _mm512_fmadd_ps(d, wv[v], acc[v]);
                        }
                    }
                }
                for (i, acc) in acc.iter().enumerate().take(m) {
                    let y = rows.y.add((i0 + i) * rows.ldy + j);
                    for v in 0..VECS {
                        _mm512_mask_storeu_ps(y.add(v * 16), masks[v], acc[v]);
                    }
                }
            }
            j += width;
        }
    }
}

/// Rows `i0..i0 + ROWS` (or fewer at the end) of `rows`.
fn row_block(rows: Rows, i0: usize) -> Rows {
    Rows {
        y: rows.y.wrapping_add(i0 * rows.ldy),
        a: rows.a.wrapping_add(i0 * rows.lda),
        m: ROWS.min(rows.m - i0),
        ..rows
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn times_transpose_avx2(rows: Rows, w: *const f32, k: usize, cols: Range<usize>) {
    for i0 in (0..rows.m).step_by(ROWS) {
        let block = row_block(rows, i0);
        // SAFETY (block): forwarded, for rows i0..i0+m.
        unsafe {
            match block.m {
                1 => rows_times_transpose_avx2::<1>(block, w, k, cols.clone()),
                2 => rows_times_transpose_avx2::<2>(block, w, k, cols.clone()),
                3 => rows_times_transpose_avx2::<3>(block, w, k, cols.clone()),
                _ => rows_times_transpose_avx2::<ROWS>(block, w, k, cols.clone()),
            }
        }
    }
}

/// [`times_transpose`] for exactly `R` rows on AVX2: sixteen outputs at a
/// time, two chains of eight, so that one row's additions are not bound by
/// the latency of a single chain.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_times_transpose_avx2<const R: usize>(rows: Rows, w: *const f32, k: usize, cols: Range<usize>) {
    use std::arch::x86_64::*;
    let mut j = cols.start;
    while j < cols.end {
        let g = 16.min(cols.end - j);
        // SAFETY (block): per the contract: R rows of a and y, rows j..j+g of w.
        unsafe {
            let a: [*const f32; R] = std::array::from_fn(|i| rows.a.add(i * rows.lda));
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            let mut kk = 0;
            if g == 16 {
                // Eight rows of W turned into eight columns in registers, twice.
                while kk + 8 <= k {
                    let low = super::panels::transposed8(w.add(j * k + kk), k);
                    let high = super::panels::transposed8(w.add((j + 8) * k + kk), k);
                    for c in 0..8 {
                        for i in 0..R {
                            let x = _mm256_set1_ps(*a[i].add(kk + c));
                            acc[i][0] = _mm256_fmadd_ps(x, low[c], acc[i][0]);
                            acc[i][1] = _mm256_fmadd_ps(x, high[c], acc[i][1]);
                        }
                    }
                    kk += 8;
                }
            }
            // The edges, a column of W gathered at a time.
            while kk < k {
                let column: [f32; 16] =
                    std::array::from_fn(|r| if r < g { *w.add((j + r) * k + kk) } else { 0.0 });
                let halves = [_mm256_loadu_ps(column.as_ptr()), _mm256_loadu_ps(column.as_ptr().add(8))];
                for i in 0..R {
                    let x = _mm256_set1_ps(*a[i].add(kk));
                    acc[i][0] = _mm256_fmadd_ps(x, halves[0], acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(x, halves[1], acc[i][1]);
                }
                kk += 1;
            }
            for (i, acc) in acc.iter().enumerate() {
                store_first(rows.y.add(i * rows.ldy + j), acc, g);
            }
        }
        j += g;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn times_avx2(rows: Rows, w: *const f32, k: usize, n: usize, cols: Range<usize>) {
    for i0 in (0..rows.m).step_by(ROWS) {
        let block = row_block(rows, i0);
        // SAFETY (block): forwarded, for rows i0..i0+m. Four vectors of
        // columns a pass for one or two rows (four chains), two for more
        // (AVX2's sixteen registers hold eight accumulators and the row of W).
        unsafe {
            match block.m {
                1 => rows_times_avx2::<1, 4>(block, w, k, n, cols.clone()),
                2 => rows_times_avx2::<2, 4>(block, w, k, n, cols.clone()),
                3 => rows_times_avx2::<3, 2>(block, w, k, n, cols.clone()),
                _ => rows_times_avx2::<ROWS, 2>(block, w, k, n, cols.clone()),
            }
        }
    }
}

/// [`times`] for exactly `R` rows on AVX2, `V` vectors of eight columns a pass over `W`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_times_avx2<const R: usize, const V: usize>(
    rows: Rows,
    w: *const f32,
    k: usize,
    n: usize,
    cols: Range<usize>,
) {
    use std::arch::x86_64::*;
    let mut j = cols.start;
    while j < cols.end {
        let width = (V * 8).min(cols.end - j);
        // SAFETY (block): per the contract: R rows of a and y, columns j..j+width of w's k rows.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); V]; R];
            for r in 0..k {
                let wrow = w.add(r * n + j);
                let wv: [__m256; V] =
                    std::array::from_fn(|v| load_first(wrow.add(v * 8), width.saturating_sub(v * 8)));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let d = _mm256_set1_ps(*rows.a.add(i * rows.lda + r));
                    for v in 0..V {
                        acc[v] = _mm256_fmadd_ps(d, wv[v], acc[v]);
                    }
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                store_first(rows.y.add(i * rows.ldy + j), acc, width);
            }
        }
        j += width;
    }
}

/// The first `count` floats at `src` (up to eight), zeros after them.
///
/// # Safety
/// `src` readable at `count.min(8)` floats; AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn load_first(src: *const f32, count: usize) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: per the contract.
    unsafe {
        if count >= 8 {
            return _mm256_loadu_ps(src);
        }
        let lanes: [f32; 8] = std::array::from_fn(|c| if c < count { *src.add(c) } else { 0.0 });
        _mm256_loadu_ps(lanes.as_ptr())
    }
}

/// Writes the first `count` floats of the vectors `v` (eight each) to `dst`.
///
/// # Safety
/// `dst` writable at `count` floats, `count <= 8 * v.len()`; AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn store_first(dst: *mut f32, v: &[std::arch::x86_64::__m256], count: usize) {
    use std::arch::x86_64::*;
    for (h, &x) in v.iter().enumerate() {
        let left = count.saturating_sub(h * 8);
        // SAFETY: per the contract: floats h*8 .. h*8 + left.min(8) of dst.
        unsafe {
            if left >= 8 {
                _mm256_storeu_ps(dst.add(h * 8), x);
            } else if left > 0 {
                let mut lanes = [0.0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), x);
                std::ptr::copy_nonoverlapping(lanes.as_ptr(), dst.add(h * 8), left);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect()
    }

    fn rows(y: &mut [f32], a: &[f32], m: usize, k: usize, n: usize) -> Rows {
        Rows { y: y.as_mut_ptr(), ldy: n, a: a.as_ptr(), lda: k, m }
    }

    #[test]
    fn in_place_products_match_a_naive_loop_in_every_share() {
        for &(m, k, n) in &[(1, 1, 1), (1, 256, 1024), (3, 17, 33), (4, 64, 20), (7, 100, 65), (2, 31, 129)] {
            let a = data(m * k, 1.0);
            let w = data(n * k, 2.0); // [n, k] for X · Wᵀ; [k, n] for D · W
            let want_t: Vec<f64> = (0..m * n)
                .map(|e| (0..k).map(|p| a[e / n * k + p] as f64 * w[e % n * k + p] as f64).sum())
                .collect();
            let want: Vec<f64> = (0..m * n)
                .map(|e| (0..k).map(|p| a[e / n * k + p] as f64 * w[p * n + e % n] as f64).sum())
                .collect();
            for parts in [1, 2, 3] {
                let mut y_t = vec![f32::NAN; m * n];
                let mut y = vec![f32::NAN; m * n];
                for part in 0..parts {
                    let share = n * part / parts..n * (part + 1) / parts;
                    // SAFETY: y is [m, n], a is [m, k], w has n * k floats.
                    unsafe {
                        times_transpose(rows(&mut y_t, &a, m, k, n), w.as_ptr(), k, share.clone());
                        times(rows(&mut y, &a, m, k, n), w.as_ptr(), k, n, share);
                    }
                }
                for (e, ((x, w), (z, v))) in y_t.iter().zip(&want_t).zip(y.iter().zip(&want)).enumerate() {
                    assert!((*x as f64 - w).abs() < 1e-3, "{m}x{k}x{n} Wᵀ [{e}]: {x} vs {w}");
                    assert!((*z as f64 - v).abs() < 1e-3, "{m}x{k}x{n} W [{e}]: {z} vs {v}");
                }
            }
        }
    }

    #[test]
    fn the_portable_path_agrees() {
        let (m, k, n) = (5, 40, 23);
        let a = data(m * k, 3.0);
        let w = data(n * k, 4.0);
        let (mut fast, mut slow) = (vec![0.0; m * n], vec![0.0; m * n]);
        // SAFETY: as above.
        unsafe {
            times_transpose(rows(&mut fast, &a, m, k, n), w.as_ptr(), k, 0..n);
            times_transpose_portable(rows(&mut slow, &a, m, k, n), w.as_ptr(), k, 0..n);
        }
        for (x, y) in fast.iter().zip(&slow) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
        // SAFETY: as above.
        unsafe {
            times(rows(&mut fast, &a, m, k, n), w.as_ptr(), k, n, 0..n);
            times_portable(rows(&mut slow, &a, m, k, n), w.as_ptr(), k, n, 0..n);
        }
        assert_eq!(fast, slow, "D · W adds in the same order on both paths");
    }

    #[test]
    fn in_place_products_give_the_packed_products_bits() {
        use super::super::panels::PackedB;
        use super::super::product::multiply;
        for &(m, k, n) in &[(1, 256, 1024), (3, 40, 37), (4, 16, 16), (2, 7, 5)] {
            let a = data(m * k, 5.0);
            let w = data(n * k, 6.0);
            let mut packed = vec![0.0; m * n];
            let mut here = vec![0.0; m * n];
            let p = PackedB::of_transpose(&w, n, k);
            // SAFETY: y is [m, n], a is [m, k], w is [n, k].
            unsafe {
                multiply(rows(&mut packed, &a, m, k, n), &p, 0..p.panels(), false);
                times_transpose(rows(&mut here, &a, m, k, n), w.as_ptr(), k, 0..n);
            }
            assert_eq!(packed, here, "X · Wᵀ {m}x{k}x{n}");
            let p = PackedB::of(&w, k, n);
            // SAFETY: as above, w read as [k, n].
            unsafe {
                multiply(rows(&mut packed, &a, m, k, n), &p, 0..p.panels(), false);
                times(rows(&mut here, &a, m, k, n), w.as_ptr(), k, n, 0..n);
            }
            assert_eq!(packed, here, "D · W {m}x{k}x{n}");
        }
    }

    /// The AVX2 path, run wherever the host has it (on an AVX-512 host the
    /// dispatch never takes it): the bits of the portable path, one fused
    /// multiply-add at a time in order of `k`.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_path_gives_the_portable_bits() {
        if !(std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")) {
            return;
        }
        for &(m, k, n) in &[(1, 256, 1024), (3, 40, 37), (4, 16, 16), (2, 7, 5), (7, 33, 70), (1, 9, 17)] {
            let a = data(m * k, 7.0);
            let w = data(n * k, 8.0);
            let (mut fast, mut slow) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
            for (from, to) in [(0, n), (n / 3, n)] {
                // SAFETY: y is [m, n], a is [m, k], w has n * k floats.
                unsafe {
                    times_transpose_avx2(rows(&mut fast, &a, m, k, n), w.as_ptr(), k, from..to);
                    times_transpose_portable(rows(&mut slow, &a, m, k, n), w.as_ptr(), k, from..to);
                }
                assert_eq!(fast, slow, "X · Wᵀ {m}x{k}x{n}, columns {from}..{to}");
                // SAFETY: as above, w read as [k, n].
                unsafe {
                    times_avx2(rows(&mut fast, &a, m, k, n), w.as_ptr(), k, n, from..to);
                    times_portable(rows(&mut slow, &a, m, k, n), w.as_ptr(), k, n, from..to);
                }
                assert_eq!(fast, slow, "D · W {m}x{k}x{n}, columns {from}..{to}");
            }
        }
    }
}
