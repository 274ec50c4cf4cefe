//! Matrix products of row-major `f32` matrices through the `gemm` crate
//! (the runtime's, with its AVX-512 kernels), run on the current rayon pool.
//!
//! A [`Mat`] is a slice with a shape, read as stored or transposed (no data
//! moves); [`matmul`] checks every shape and length before the one unsafe
//! call, so `gemm` only ever touches memory the slices own.

/// A row-major `[rows, cols]` matrix, or the transpose of one.
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a> {
    data: &'a [f32],
    /// Shape as stored.
    stored: (usize, usize),
    transposed: bool,
}

impl<'a> Mat<'a> {
    /// `data` as a `[rows, cols]` row-major matrix.
    ///
    /// # Panics
    /// If `data` does not hold exactly `rows * cols` values.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Mat<'a> {
        assert_eq!(data.len(), rows * cols, "a [{rows}, {cols}] matrix needs {} values", rows * cols);
        Mat { data, stored: (rows, cols), transposed: false }
    }

    /// The transpose.
    pub fn t(self) -> Mat<'a> {
        Mat { transposed: !self.transposed, ..self }
    }

    /// `(rows, cols)` as read.
    pub fn shape(&self) -> (usize, usize) {
        if self.transposed {
            (self.stored.1, self.stored.0)
        } else {
            self.stored
        }
    }

    /// `(row stride, column stride)` as read.
    fn strides(&self) -> (isize, isize) {
        let row = self.stored.1 as isize;
        if self.transposed {
            (1, row)
        } else {
            (row, 1)
        }
    }
}

/// `dst = a · b`, or `dst += a · b` with `accumulate`; `dst` is row-major
/// `[a.rows, b.cols]`.
///
/// # Panics
/// If the shapes do not agree.
pub fn matmul(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool) {
    let (m, k) = a.shape();
    let (k2, n) = b.shape();
    assert_eq!(k, k2, "cannot multiply [{m}, {k}] by [{k2}, {n}]");
    assert_eq!(
        dst.len(),
        m * n,
        "the product is [{m}, {n}]: {} values, the destination has {}",
        m * n,
        dst.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    let (a_rs, a_cs) = a.strides();
    let (b_rs, b_cs) = b.strides();
    // SAFETY: `a` is [m, k] and `b` is [k, n] as read, each within its own
    // slice (checked by `Mat::new` and the shape asserts above); `dst` is an
    // exclusively borrowed [m, n] row-major slice, so it overlaps neither.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a_cs,
            a_rs,
            b.data.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
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

    fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..cols).flat_map(|j| (0..rows).map(move |i| x[i * cols + j])).collect()
    }

    #[test]
    fn products_with_either_operand_transposed_match_the_definition() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.91).cos()).collect();
        let want = naive(&a, &b, m, k, n);
        let (at, bt) = (transpose(&a, m, k), transpose(&b, k, n));
        let close = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| (p - q).abs() < 1e-5);

        let mut c = vec![0.0; m * n];
        matmul(&mut c, Mat::new(&a, m, k), Mat::new(&b, k, n), false);
        assert!(close(&c, &want));
        matmul(&mut c, Mat::new(&at, k, m).t(), Mat::new(&bt, n, k).t(), false);
        assert!(close(&c, &want));
        matmul(&mut c, Mat::new(&a, m, k), Mat::new(&bt, n, k).t(), true);
        let twice: Vec<f32> = want.iter().map(|v| 2.0 * v).collect();
        assert!(close(&c, &twice));
    }
}
