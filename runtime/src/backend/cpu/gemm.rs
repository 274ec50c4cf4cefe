//! Matrix products through the `gemm` crate (AVX-512 kernels with its
//! `x86-v4` feature), on strided row-major views: the weight gradients
//! `dW += Dᵀ · X` over all steps, and products of matrices the cell computes
//! (products of parameters read them packed once, see [`super::panels`]),
//! split by output columns across threads where one call is too small to
//! share out by rows.

/// A strided view of an `f32` matrix: element `(i, j)` is at `ptr + i*rs + j*cs`.
#[derive(Clone, Copy, Debug)]
pub struct View {
    /// Element `(0, 0)`.
    pub ptr: *const f32,
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix.
    pub cols: usize,
    /// Row stride, in floats.
    pub rs: isize,
    /// Column stride, in floats.
    pub cs: isize,
}

impl View {
    /// A row-major matrix stored with `row_stride` floats between rows.
    pub fn rows(ptr: *const f32, rows: usize, cols: usize, row_stride: usize) -> View {
        View { ptr, rows, cols, rs: row_stride as isize, cs: 1 }
    }

    /// The transpose (no data moves).
    pub fn t(self) -> View {
        View { ptr: self.ptr, rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs }
    }

    /// Columns `[from, from + n)`.
    pub fn columns(self, from: usize, n: usize) -> View {
        View { ptr: self.ptr.wrapping_offset(from as isize * self.cs), cols: n, ..self }
    }
}

// SAFETY: a View is a plain description of memory; the functions that
// dereference it state what must hold.
unsafe impl Send for View {}
unsafe impl Sync for View {}

/// `dst = a · b` (or `dst += a · b` with `accumulate`), single-threaded.
///
/// # Safety
/// Every view must describe valid memory for its shape; `dst` must be
/// writable and must not overlap `a` or `b`; shapes must agree
/// (`a: [m, k]`, `b: [k, n]`, `dst: [m, n]`).
pub unsafe fn matmul(dst: View, a: View, b: View, accumulate: bool) {
    debug_assert!(a.rows == dst.rows && b.cols == dst.cols && a.cols == b.rows);
    if dst.rows == 0 || dst.cols == 0 {
        return;
    }
    if a.cols == 0 {
        if !accumulate {
            for i in 0..dst.rows {
                for j in 0..dst.cols {
                    // SAFETY: inside dst, per the contract.
                    unsafe { *(dst.ptr as *mut f32).offset(i as isize * dst.rs + j as isize * dst.cs) = 0.0 };
                }
            }
        }
        return;
    }
    // SAFETY: forwarded from the caller. gemm computes
    // dst := alpha*dst + beta*(a·b), reading dst only when read_dst is set.
    unsafe {
        gemm::gemm(
            dst.rows,
            dst.cols,
            a.cols,
            dst.ptr as *mut f32,
            dst.cs,
            dst.rs,
            accumulate,
            a.ptr,
            a.cs,
            a.rs,
            b.ptr,
            b.cs,
            b.rs,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// The columns `(from, count)` that share `part` of `parts` of `cols`
/// output columns takes: blocks of a multiple of 16 (one AVX-512 register)
/// where possible, the last one shorter or empty.
pub fn column_share(cols: usize, part: usize, parts: usize) -> (usize, usize) {
    let per = cols.div_ceil(parts.max(1)).next_multiple_of(16);
    let (from, to) = ((part * per).min(cols), ((part + 1) * per).min(cols));
    (from, to - from)
}

/// `dst (+)= a · b`, split by output columns into `parts` pieces run on
/// the current call's threads ([`super::threads::for_each`]).
///
/// # Safety
/// As [`matmul`].
pub unsafe fn matmul_split(dst: View, a: View, b: View, accumulate: bool, parts: usize) {
    let parts = parts.clamp(1, dst.cols.max(1));
    if parts == 1 {
        // SAFETY: forwarded.
        return unsafe { matmul(dst, a, b, accumulate) };
    }
    let blocks: Vec<(usize, usize)> =
        (0..parts).map(|part| column_share(dst.cols, part, parts)).filter(|&(_, n)| n > 0).collect();
    super::threads::for_each(blocks.len(), &|i| {
        let (from, n) = blocks[i];
        // SAFETY: the blocks write disjoint columns of dst.
        unsafe { matmul(dst.columns(from, n), a, b.columns(from, n), accumulate) }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    #[test]
    fn products_in_every_orientation() {
        let (m, k, n) = (5, 7, 33);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.3).sin()).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.7).cos()).collect(); // [n, k], PyTorch layout
        let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect(); // [k, n]
        let want = naive(&a, &wt, m, k, n);
        for split in [1, 2, 3] {
            let mut c = vec![0.0f32; m * n];
            // SAFETY: all buffers have the described shapes.
            unsafe {
                matmul_split(
                    View::rows(c.as_mut_ptr(), m, n, n),
                    View::rows(a.as_ptr(), m, k, k),
                    View::rows(w.as_ptr(), n, k, k).t(),
                    false,
                    split,
                )
            };
            for (x, y) in c.iter().zip(&want) {
                assert!((x - y).abs() < 1e-4, "{x} vs {y}");
            }
        }
        // Accumulate: dW[n, k] += Cᵀ · A  with C = [m, n].
        let mut dw = vec![1.0f32; n * k];
        let c = want.clone();
        // SAFETY: as above.
        unsafe {
            matmul(
                View::rows(dw.as_mut_ptr(), n, k, k),
                View::rows(c.as_ptr(), m, n, n).t(),
                View::rows(a.as_ptr(), m, k, k),
                true,
            )
        };
        let ct: Vec<f32> = (0..n * m).map(|i| c[(i % m) * n + i / m]).collect();
        let want = naive(&ct, &a, n, m, k);
        for (x, y) in dw.iter().zip(&want) {
            assert!((x - (y + 1.0)).abs() < 1e-3, "{x} vs {}", y + 1.0);
        }
    }
}
