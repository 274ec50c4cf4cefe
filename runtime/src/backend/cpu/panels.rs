//! Weight matrices packed once into column panels, and the microkernel
//! that multiplies rows by them at the machine's vector width.
//!
//! An RNN multiplies the same weight by a few rows at every step. A GEMM
//! library packs its right operand on every call (`gemm` 0.19 and
//! `matrixmultiply` both do; neither takes a pre-packed operand), which at
//! B=16 costs as much as a tenth of the product. Here `B` (`Wᵀ` for
//! `X · Wᵀ`, `W` for `D · W`) is packed once per model into panels of
//! [`PANEL`] columns, each panel `k` rows of `PANEL` contiguous floats,
//! zero-padded: a step streams each panel front to back, and a thread
//! that always takes the same panels keeps them in its own L2.
//!
//! The microkernel holds a tile of a few rows × one panel in
//! registers: eight rows on AVX-512 (two `zmm` per row) when the processor has it,
//! six on AVX2 + FMA (half a panel at a time), or portable Rust. Every path adds
//! the `k` products of an output in the same order, whatever the rows, the
//! panels or the thread count, so results are bitwise reproducible.

use super::aligned::AlignedBuf;
use std::ops::Range;

/// Columns per panel: two AVX-512 registers.
pub const PANEL: usize = 32;

/// Rows per register tile, at most.
const MR: usize = 8;

/// Rows per block whose `A` rows stay in L2 while every panel passes over them.
pub(super) const ROW_BLOCK: usize = 192;

/// Panel rows ahead of the one being multiplied that a microkernel asks the
/// cache for. A tile reads its panel front to back once; with the weight in
/// L2 or beyond, the hardware prefetcher alone left a tile of eight rows at
/// 91% of the FMA peak (weight in L2) and 50% (weight in L3). Asking 1 KiB
/// ahead gave 97% and 60% (Xeon, one thread, best of 25 alternating rounds:
/// 4 to 32 rows ahead measured alike).
pub(super) const PREFETCH_ROWS: usize = 8;

/// Asks the cache for the panel row [`PREFETCH_ROWS`] after `row`:
/// `lines` cache lines of it, from `row`'s column offset on. A hint: the
/// address may lie past the panel (a prefetch never faults).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_ahead<T>(row: *const T, lines: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let ahead = row.cast::<u8>().wrapping_add(PREFETCH_ROWS * PANEL * 4);
    for line in 0..lines {
        // SAFETY: a prefetch reads nothing architecturally and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line * 64).cast()) };
    }
}

/// Writes `panel[kk * PANEL + c] = src[c * cols + kk]` for whole blocks
/// transposed in registers (16x16 on AVX-512, 8x8 on AVX2), `c < done.0`,
/// `kk < done.1`; returns `done` (`(0, 0)` without either), the rest being
/// the caller's.
fn transpose_blocks(src: &[f32], cols: usize, width: usize, panel: &mut [f32]) -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return by_blocks(src, cols, width, panel, 16, transpose16);
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return by_blocks(src, cols, width, panel, 8, transpose8);
        }
    }
    (0, 0)
}

/// [`transpose_blocks`] with `block` (`n`x`n`, whose processor features
/// the caller checked).
#[cfg(target_arch = "x86_64")]
fn by_blocks(
    src: &[f32],
    cols: usize,
    width: usize,
    panel: &mut [f32],
    n: usize,
    block: unsafe fn(*const f32, usize, *mut f32),
) -> (usize, usize) {
    let (rows_n, cols_n) = (width / n * n, cols / n * n);
    if rows_n == 0 || cols_n == 0 {
        return (0, 0);
    }
    assert!(src.len() >= (rows_n - 1) * cols + cols_n && panel.len() >= cols_n * PANEL && n <= PANEL);
    for h in (0..rows_n).step_by(n) {
        for kb in (0..cols_n).step_by(n) {
            // SAFETY: rows h..h+n of src have columns kb..kb+n (asserted above), and
            // panel rows kb..kb+n have columns h..h+n (h + n <= width <= PANEL).
            unsafe { block(src.as_ptr().add(h * cols + kb), cols, panel.as_mut_ptr().add(kb * PANEL + h)) };
        }
    }
    (rows_n, cols_n)
}

/// `dst[j * PANEL + i] = src[i * ld + j]` for `i, j < 8`.
///
/// # Safety
/// `src` readable at 8 rows of 8 floats `ld` apart, `dst` writable at 8
/// rows of 8 floats `PANEL` apart; AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose8(src: *const f32, ld: usize, dst: *mut f32) {
    // SAFETY (block): per the contract.
    unsafe {
        for (j, column) in transposed8(src, ld).into_iter().enumerate() {
            std::arch::x86_64::_mm256_storeu_ps(dst.add(j * PANEL), column);
        }
    }
}

/// The 8 columns of the 8x8 block at `src` (rows `ld` floats apart):
/// element `i` of vector `j` is `src[i * ld + j]`.
///
/// # Safety
/// `src` readable at 8 rows of 8 floats `ld` apart; AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn transposed8(src: *const f32, ld: usize) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    // SAFETY: per the contract.
    let r: [__m256; 8] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(src.add(i * ld)) });
    // Pairs of rows interleaved, then pairs of pairs, then the 128-bit halves.
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // u[4q + c] holds column c (low half) and c + 4 (high half) of rows 4q..4q+4.
    let u: [__m256; 8] = std::array::from_fn(|i| {
        let base = i / 4 * 4;
        let (a, b) = (t[base + i % 4 / 2], t[base + i % 4 / 2 + 2]);
        if i % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(a, b)
        } else {
            _mm256_shuffle_ps::<0xee>(a, b)
        }
    });
    std::array::from_fn(|j| {
        let (a, b) = (u[j % 4], u[j % 4 + 4]);
        if j < 4 {
            _mm256_permute2f128_ps::<0x20>(a, b)
        } else {
            _mm256_permute2f128_ps::<0x31>(a, b)
        }
    })
}

/// `dst[j * PANEL + i] = src[i * ld + j]` for `i, j < 16`.
///
/// # Safety
/// `src` readable at 16 rows of 16 floats `ld` apart, `dst` writable at 16
/// rows of 16 floats `PANEL` apart; AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(src: *const f32, ld: usize, dst: *mut f32) {
    // SAFETY (block): per the contract.
    unsafe {
        for (j, column) in transposed16(src, ld).into_iter().enumerate() {
            std::arch::x86_64::_mm512_storeu_ps(dst.add(j * PANEL), column);
        }
    }
}

/// The 16 columns of the 16x16 block at `src` (rows `ld` floats apart):
/// element `i` of vector `j` is `src[i * ld + j]`.
///
/// # Safety
/// `src` readable at 16 rows of 16 floats `ld` apart; AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transposed16(src: *const f32, ld: usize) -> [std::arch::x86_64::__m512; 16] {
    use std::arch::x86_64::*;
    // SAFETY: per the contract.
    let r: [__m512; 16] = std::array::from_fn(|i| unsafe { _mm512_loadu_ps(src.add(i * ld)) });
    // Pairs of rows interleaved, then pairs of pairs, then 128-bit lanes twice.
    let t: [__m512; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    let u: [__m512; 16] = std::array::from_fn(|i| {
        let base = i / 4 * 4;
        let (a, b) = (_mm512_castps_pd(t[base + i % 4 / 2]), _mm512_castps_pd(t[base + i % 4 / 2 + 2]));
        _mm512_castpd_ps(if i % 2 == 0 { _mm512_unpacklo_pd(a, b) } else { _mm512_unpackhi_pd(a, b) })
    });
    let v: [__m512; 16] = std::array::from_fn(|i| {
        let base = i / 8 * 8;
        let (a, b) = (u[base + i % 4], u[base + i % 4 + 4]);
        if i % 8 < 4 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xdd>(a, b)
        }
    });
    std::array::from_fn(|j| {
        let (a, b) = (v[j % 8], v[j % 8 + 8]);
        if j < 8 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xdd>(a, b)
        }
    })
}

/// `B: [k, n]` in column panels, of f32 or of bf16 pairs.
#[derive(Debug)]
pub struct PackedB {
    pub(super) k: usize,
    pub(super) n: usize,
    /// Panels of bf16 pairs ([`super::bf16`]): rows of [`PANEL`] 32-bit
    /// words, held in `data`'s float slots.
    pub(super) bf16: bool,
    /// Rows of each panel: `k`, or for bf16 pairs [`super::bf16::pair_rows`].
    pub(super) panel_rows: usize,
    pub(super) data: AlignedBuf,
}

impl PackedB {
    /// Panels written by `fill(p, panel)`, each panel `k` rows of
    /// [`PANEL`] floats; the columns past `n` in the last panel are zeros.
    /// Panels are filled in parallel (on the current call's threads), into
    /// recycled memory: a model whose weights come anew with each call
    /// (a framework's tensors) packs them on every call.
    fn build(k: usize, n: usize, fill: impl Fn(usize, &mut [f32]) + Sync) -> PackedB {
        let panels = n.div_ceil(PANEL);
        let mut data = AlignedBuf::recycled(panels * k * PANEL);
        let last = n.saturating_sub(panels.saturating_sub(1) * PANEL);
        super::threads::for_each_chunk_mut(data.as_mut_slice(), k * PANEL, &|p, panel| {
            if p + 1 == panels && last < PANEL {
                panel.chunks_mut(PANEL).for_each(|row| row[last..].fill(0.0));
            }
            fill(p, panel);
        });
        PackedB { k, n, bf16: false, panel_rows: k, data }
    }

    /// `B = Wᵀ` for a row-major `W: [rows, cols]`: the right operand of `X · Wᵀ`.
    pub fn of_transpose(w: &[f32], rows: usize, cols: usize) -> PackedB {
        PackedB::of_transpose_by(w, rows, cols, |r| r)
    }

    /// [`PackedB::of_transpose`] of `W`'s rows in another order: row `r`
    /// of the `Wᵀ` packed is row `source(r)` of `w` (a fused step's tile
    /// order), gathered as it is packed.
    pub fn of_transpose_by(
        w: &[f32],
        rows: usize,
        cols: usize,
        source: impl Fn(usize) -> usize + Sync,
    ) -> PackedB {
        assert!(w.len() >= rows * cols, "weight of {} floats packed as [{rows}, {cols}]", w.len());
        // Panel p holds rows p*PANEL.. (in order): each panel row gathers
        // one column of those rows, whose current cache lines stay in L1.
        PackedB::build(cols, rows, |p, panel| {
            let width = PANEL.min(rows - p * PANEL);
            let first = source(p * PANEL);
            let contiguous = (1..width).all(|c| source(p * PANEL + c) == first + c);
            // Whole 16x16 blocks in registers where the processor can (the
            // scalar gather took 9x as long as a B=1 step's product), the
            // edges one float at a time.
            let done =
                if contiguous { transpose_blocks(&w[first * cols..], cols, width, panel) } else { (0, 0) };
            for (kk, dst) in panel.chunks_mut(PANEL).enumerate() {
                let from = if kk < done.1 { done.0 } else { 0 };
                for (c, x) in dst[..width].iter_mut().enumerate().skip(from) {
                    *x = w[source(p * PANEL + c) * cols + kk];
                }
            }
        })
    }

    /// `B = W` for a row-major `W: [rows, cols]`: the right operand of `D · W`.
    pub fn of(w: &[f32], rows: usize, cols: usize) -> PackedB {
        assert!(w.len() >= rows * cols, "weight of {} floats packed as [{rows}, {cols}]", w.len());
        PackedB::build(rows, cols, |p, panel| {
            let width = PANEL.min(cols - p * PANEL);
            for (kk, dst) in panel.chunks_mut(PANEL).enumerate() {
                dst[..width].copy_from_slice(&w[kk * cols + p * PANEL..][..width]);
            }
        })
    }

    /// Whether the panels hold bf16 pairs ([`PackedB::of_transpose_bf16`], [`PackedB::of_bf16`]).
    pub fn is_bf16(&self) -> bool {
        self.bf16
    }

    /// The inner dimension.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Output columns.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Column panels of [`PANEL`] floats (the last one padded with zeros).
    pub fn panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// The panels `part` of `parts` takes: contiguous, as even as whole
    /// panels allow, the same for a given `(parts, part)` every step.
    pub fn share(&self, part: usize, parts: usize) -> Range<usize> {
        let p = self.panels();
        p * part / parts..p * (part + 1) / parts
    }

    /// Panel `p`'s first float (or, for bf16 panels, word).
    pub(super) fn panel(&self, p: usize) -> *const f32 {
        // SAFETY: p < panels, so the offset is inside the buffer.
        unsafe { self.data.as_ptr().add(p * self.panel_rows * PANEL) }
    }

    /// Floats of output column panel `p` that exist.
    pub(super) fn width(&self, p: usize) -> usize {
        (self.n - p * PANEL).min(PANEL)
    }
}

/// Which microkernel this processor runs, decided once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Avx512,
    Avx2,
    Portable,
}

impl Isa {
    /// Rows per register tile: eight on AVX-512 (two of its 32 registers a
    /// row); six on AVX2, half a panel at a time (twelve of its sixteen
    /// registers as accumulators: 1.07-1.25x four rows at B >= 8 on a Zen 3).
    fn tile_rows(self) -> usize {
        match self {
            Isa::Avx2 => 6,
            Isa::Avx512 | Isa::Portable => MR,
        }
    }

    /// The widest this processor supports.
    pub fn detect() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    return Isa::Avx512;
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    return Isa::Avx2;
                }
            }
            Isa::Portable
        })
    }
}

/// The left operand and the result of a product: `m` rows of each, with
/// their row strides in floats.
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    /// The result's first row.
    pub y: *mut f32,
    /// The result's row stride.
    pub ldy: usize,
    /// The left operand's first row.
    pub a: *const f32,
    /// The left operand's row stride.
    pub lda: usize,
    /// Rows of each.
    pub m: usize,
}

/// [`super::product::multiply`] with a chosen microkernel (the tests run every one the host has).
///
/// # Safety
/// As [`multiply`]; `isa` must be supported by this processor.
pub(crate) unsafe fn multiply_with(
    isa: Isa,
    rows: Rows,
    b: &PackedB,
    panels: Range<usize>,
    accumulate: bool,
) {
    assert!(!b.bf16, "bf16 panels given to an f32 kernel");
    let Rows { y, ldy, a, lda, m } = rows;
    let k = b.k;
    let tile_rows = isa.tile_rows();
    for r0 in (0..m).step_by(ROW_BLOCK) {
        let rows = (m - r0).min(ROW_BLOCK);
        for p in panels.clone() {
            let (panel, width) = (b.panel(p), b.width(p));
            for i0 in (r0..r0 + rows).step_by(tile_rows) {
                let mr = (r0 + rows - i0).min(tile_rows);
                // SAFETY: rows i0..i0 + mr exist in a and y; panel p exists;
                // columns p*PANEL..+width are in y's rows (the caller's contract).
                unsafe {
                    let t = Tile {
                        out: TileOut { y: y.add(i0 * ldy + p * PANEL), ldy, width, accumulate },
                        a: a.add(i0 * lda),
                        lda,
                        k,
                        panel,
                    };
                    t.run(isa, mr)
                }
            }
        }
    }
}

/// Where a register tile's results go: `width` columns of rows `ldy`
/// floats apart from `y`, added to what is there when `accumulate`.
#[derive(Clone, Copy)]
pub(super) struct TileOut {
    pub y: *mut f32,
    pub ldy: usize,
    pub width: usize,
    pub accumulate: bool,
}

impl TileOut {
    /// Writes (or adds, when accumulating) `values` to row `i` from column `from` on.
    ///
    /// # Safety
    /// Row `i` and columns `from..from + values.len()` are the tile's.
    pub(super) unsafe fn write(&self, i: usize, from: usize, values: &[f32]) {
        for (c, &x) in values.iter().enumerate() {
            // SAFETY: per the contract.
            unsafe {
                let out = self.y.add(i * self.ldy + from + c);
                *out = if self.accumulate { *out + x } else { x };
            }
        }
    }

    /// Writes (or adds) row `i`'s two registers of a 32-column panel, masked to `width`.
    ///
    /// # Safety
    /// Row `i` is the tile's; the processor has AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn write_avx512(&self, i: usize, acc: [std::arch::x86_64::__m512; 2]) {
        use std::arch::x86_64::*;
        let w = self.width;
        let masks = [mask16(w.min(16)), mask16(w.saturating_sub(16))];
        for (h, (&v, &m)) in acc.iter().zip(&masks).enumerate() {
            // SAFETY: masked to the tile's existing columns of row i.
            unsafe {
                let out = self.y.add(i * self.ldy + h * 16);
                let v = if self.accumulate { _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), v) } else { v };
                _mm512_mask_storeu_ps(out, m, v);
            }
        }
    }
}

/// `$tile.$kernel::<R>()` with the tile's `$rows` rows (1 to 8) as a constant.
macro_rules! by_rows {
    ($tile:expr, $rows:expr, $kernel:ident) => {
        match $rows {
            1 => $tile.$kernel::<1>(),
            2 => $tile.$kernel::<2>(),
            3 => $tile.$kernel::<3>(),
            4 => $tile.$kernel::<4>(),
            5 => $tile.$kernel::<5>(),
            6 => $tile.$kernel::<6>(),
            7 => $tile.$kernel::<7>(),
            _ => $tile.$kernel::<8>(),
        }
    };
}
pub(super) use by_rows;

/// One register tile: up to [`MR`] rows of `A` times one panel.
struct Tile {
    out: TileOut,
    a: *const f32,
    lda: usize,
    k: usize,
    panel: *const f32,
}

impl Tile {
    /// # Safety
    /// As [`multiply_with`], for this tile's `mr` rows.
    unsafe fn run(&self, isa: Isa, mr: usize) {
        // SAFETY: the ISA was detected on this processor (or chosen by a test that checked it).
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => by_rows!(self, mr, avx512),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => {
                    // Half a panel at a time for three to six rows (twelve accumulators of
                    // AVX2's sixteen registers at six); one or two rows take the whole panel
                    // in one pass (eight chains of additions instead of two or four: B=1,
                    // H=256, 21 -> 28 GFLOP/s on a Zen 3).
                    match mr {
                        1 => self.avx2_panel::<1>(),
                        2 => self.avx2_panel::<2>(),
                        3 => self.avx2::<3>(),
                        4 => self.avx2::<4>(),
                        5 => self.avx2::<5>(),
                        _ => self.avx2::<6>(),
                    }
                }
                _ => by_rows!(self, mr, portable),
            }
        }
    }

    /// # Safety
    /// As [`Tile::run`].
    unsafe fn portable<const R: usize>(&self) {
        let mut acc = [[0.0f32; PANEL]; R];
        for kk in 0..self.k {
            // SAFETY: panel rows kk < k exist; A rows < R have k floats.
            let brow = unsafe { std::slice::from_raw_parts(self.panel.add(kk * PANEL), PANEL) };
            for (i, row) in acc.iter_mut().enumerate() {
                let av = unsafe { *self.a.add(i * self.lda + kk) };
                for (c, x) in row.iter_mut().enumerate() {
                    *x = av.mul_add(brow[c], *x);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            // SAFETY: the tile's row i, columns 0..width.
            unsafe { self.out.write(i, 0, &row[..self.out.width]) };
        }
    }

    /// # Safety
    /// As [`Tile::run`]; the processor has AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512<const R: usize>(&self) {
        use std::arch::x86_64::*;
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let (mut b, mut a) = (self.panel, self.a);
        for _ in 0..self.k {
            // SAFETY: panel rows are 32 floats, 64-byte aligned (the buffer
            // is, and a row is 128 bytes); A rows < R have k floats.
            unsafe {
                prefetch_ahead(b, 2);
                let b0 = _mm512_load_ps(b);
                let b1 = _mm512_load_ps(b.add(16));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*a.add(i * self.lda));
                    acc[0] = _mm512_fmadd_ps(av, b0, acc[0]);
                    acc[1] = _mm512_fmadd_ps(av, b1, acc[1]);
                }
                b = b.add(PANEL);
                a = a.add(1);
            }
        }
        for (i, &acc) in acc.iter().enumerate() {
            // SAFETY: row i is the tile's; the processor has AVX-512F.
            unsafe { self.out.write_avx512(i, acc) };
        }
    }

    /// # Safety
    /// As [`Tile::run`]; the processor has AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2<const R: usize>(&self) {
        use std::arch::x86_64::*;
        for half in 0..2 {
            let cols = self.out.width.saturating_sub(half * 16).min(16);
            if cols == 0 {
                break;
            }
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            let (mut b, mut a) = (self.panel.wrapping_add(half * 16), self.a);
            for _ in 0..self.k {
                // SAFETY: as avx512; 32-byte aligned halves of a panel row.
                unsafe {
                    prefetch_ahead(b, 1);
                    let b0 = _mm256_load_ps(b);
                    let b1 = _mm256_load_ps(b.add(8));
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let av = _mm256_set1_ps(*a.add(i * self.lda));
                        acc[0] = _mm256_fmadd_ps(av, b0, acc[0]);
                        acc[1] = _mm256_fmadd_ps(av, b1, acc[1]);
                    }
                    b = b.add(PANEL);
                    a = a.add(1);
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                let mut lanes = [0.0f32; 16];
                // SAFETY: a local array of 16 floats.
                unsafe {
                    _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
                    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
                }
                // SAFETY: row i, columns half*16 .. half*16 + cols <= width.
                unsafe { self.out.write(i, half * 16, &lanes[..cols]) };
            }
        }
    }

    /// The whole panel for `R` (one or two) rows at once: four vectors a row.
    ///
    /// # Safety
    /// As [`Tile::run`]; the processor has AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_panel<const R: usize>(&self) {
        use std::arch::x86_64::*;
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        let (mut b, mut a) = (self.panel, self.a);
        for _ in 0..self.k {
            // SAFETY: panel rows are 32 floats, 32-byte aligned (the buffer is 64-byte
            // aligned, a row 128 bytes); A rows < R have k floats.
            unsafe {
                prefetch_ahead(b, 2);
                let bv: [__m256; 4] = std::array::from_fn(|v| _mm256_load_ps(b.add(v * 8)));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let av = _mm256_set1_ps(*a.add(i * self.lda));
                    for v in 0..4 {
                        acc[v] = _mm256_fmadd_ps(av, bv[v], acc[v]);
                    }
                }
                b = b.add(PANEL);
                a = a.add(1);
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            let mut lanes = [0.0f32; PANEL];
            // SAFETY: a local array of PANEL floats.
            unsafe {
                for (v, &x) in acc.iter().enumerate() {
                    _mm256_storeu_ps(lanes.as_mut_ptr().add(v * 8), x);
                }
            }
            // SAFETY: the tile's row i, columns 0..width.
            unsafe { self.out.write(i, 0, &lanes[..self.out.width]) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn mask16(n: usize) -> u16 {
    ((1u32 << n.min(16)) - 1) as u16
}

#[cfg(test)]
mod tests {
    use super::super::product::multiply;
    use super::*;

    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect()
    }

    #[test]
    fn products_match_a_naive_loop_at_ragged_sizes() {
        for &(m, k, n) in &[
            (1, 1, 1),
            (3, 5, 7),
            (8, 64, 32),
            (9, 17, 33),
            (20, 31, 100),
            (23, 19, 40),
            (34, 8, 33),
            (200, 40, 65),
        ] {
            let a = data(m * k, 1.0);
            let w = data(n * k, 2.0); // [n, k]: X · Wᵀ
            let want: Vec<f32> = (0..m * n)
                .map(|e| {
                    (0..k).map(|p| a[e / n * k + p] as f64 * w[e % n * k + p] as f64).sum::<f64>() as f32
                })
                .collect();
            let packed = PackedB::of_transpose(&w, n, k);
            let plain = PackedB::of(&transpose(&w, n, k), k, n);
            for isa in isas() {
                for b in [&packed, &plain] {
                    for parts in [1, 2, 3] {
                        let mut y = vec![f32::NAN; m * n];
                        for part in 0..parts {
                            // SAFETY: y is [m, n], a is [m, k], b is [k, n].
                            unsafe {
                                multiply_with(isa, rows(&mut y, &a, m, k, n), b, b.share(part, parts), false)
                            };
                        }
                        for (e, (x, w)) in y.iter().zip(&want).enumerate() {
                            assert!((x - w).abs() < 1e-4, "{isa:?} {m}x{k}x{n} [{e}]: {x} vs {w}");
                        }
                        // Accumulating adds the product once more.
                        // SAFETY: as above.
                        unsafe { multiply_with(isa, rows(&mut y, &a, m, k, n), b, 0..b.panels(), true) };
                        for (x, w) in y.iter().zip(&want) {
                            assert!((x - 2.0 * w).abs() < 2e-4, "{isa:?} accumulate: {x} vs {}", 2.0 * w);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_the_split_or_the_rows() {
        let (m, k, n) = (13, 50, 70);
        let a = data(m * k, 3.0);
        let b = PackedB::of(&data(k * n, 4.0), k, n);
        let mut whole = vec![0.0; m * n];
        // SAFETY: shapes as declared.
        unsafe { multiply(rows(&mut whole, &a, m, k, n), &b, 0..b.panels(), false) };
        for i in 0..m {
            let mut row = vec![0.0; n];
            for part in 0..3 {
                // SAFETY: one row of a and y.
                unsafe { multiply(rows(&mut row, &a[i * k..], 1, k, n), &b, b.share(part, 3), false) };
            }
            assert_eq!(row, whole[i * n..(i + 1) * n], "row {i}");
        }
    }

    /// Every bf16 kernel's bits depend on neither the rows that share its
    /// tiles (AMX's: 32 rows) nor the panels a thread takes.
    #[test]
    fn bf16_results_do_not_depend_on_the_split_or_the_rows() {
        use super::super::bf16::{multiply_with as multiply_bf16_with, Bf16Kernel};
        let (m, k, n) = (45, 70, 70);
        let a = data(m * k, 3.0);
        let b = PackedB::of_bf16(&data(k * n, 4.0), k, n);
        for kernel in Bf16Kernel::available() {
            let mut whole = vec![0.0; m * n];
            // SAFETY (each call): shapes as declared.
            unsafe { multiply_bf16_with(kernel, rows(&mut whole, &a, m, k, n), &b, 0..b.panels(), false) };
            // The rows from the third on, so that each shares tiles with others.
            let mut shifted = vec![0.0; (m - 3) * n];
            unsafe {
                multiply_bf16_with(
                    kernel,
                    rows(&mut shifted, &a[3 * k..], m - 3, k, n),
                    &b,
                    0..b.panels(),
                    false,
                )
            };
            assert_eq!(shifted, whole[3 * n..], "{kernel:?}: rows shifted");
            for i in 0..m {
                let mut row = vec![0.0; n];
                for part in 0..3 {
                    unsafe {
                        multiply_bf16_with(
                            kernel,
                            rows(&mut row, &a[i * k..], 1, k, n),
                            &b,
                            b.share(part, 3),
                            false,
                        )
                    };
                }
                assert_eq!(row, whole[i * n..(i + 1) * n], "{kernel:?}: row {i}");
            }
        }
    }

    #[test]
    fn packing_a_transpose_equals_packing_the_transposed_matrix() {
        // Whole 16x16 blocks, ragged edges in both dimensions, a panel of 16 rows.
        for &(n, k) in &[(1, 1), (16, 16), (17, 33), (32, 16), (100, 37), (64, 48), (1024, 256), (48, 250)] {
            let w = data(n * k, 3.0); // [n, k]
            let a = PackedB::of_transpose(&w, n, k);
            let b = PackedB::of(&transpose(&w, n, k), k, n);
            assert_eq!(a.data.as_slice(), b.data.as_slice(), "{n}x{k}");
        }
    }

    /// The AVX2 block transpose (packing's path without AVX-512, and the
    /// in-place product's), run wherever the host has AVX2.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn an_avx2_block_transpose_moves_every_float() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let ld = 11;
        let src = data(8 * ld, 5.0);
        // SAFETY: src holds 8 rows of ld >= 8 floats.
        let columns = unsafe { transposed8(src.as_ptr(), ld) };
        for (j, column) in columns.iter().enumerate() {
            let mut lanes = [0.0f32; 8];
            // SAFETY: a local array of 8 floats.
            unsafe { std::arch::x86_64::_mm256_storeu_ps(lanes.as_mut_ptr(), *column) };
            for (i, &x) in lanes.iter().enumerate() {
                assert_eq!(x, src[i * ld + j], "row {i}, column {j}");
            }
        }
    }

    /// The bf16 kernels against a loop over the rounded operands in f64, at
    /// ragged sizes, every split and accumulation, within f32's summation
    /// error; the kernels that add in `vdpbf16ps`'s order (portable, AVX2)
    /// give the same bits, and AVX512-BF16 (where the host has it) the same
    /// within that error (its flushing of subnormals, its own rounding).
    #[test]
    fn bf16_products_match_the_rounded_operands_on_every_kernel() {
        use super::super::bf16::{multiply_with as multiply_bf16_with, Bf16Kernel};
        use cellc::precision::round_bf16;
        for &(m, k, n) in
            &[(1, 1, 1), (3, 5, 7), (8, 64, 32), (9, 17, 33), (20, 31, 100), (200, 40, 65), (5, 257, 64)]
        {
            let a = data(m * k, 1.0);
            let w = data(n * k, 2.0); // [n, k]: X · Wᵀ
            let bound = |e: usize| -> (f64, f64) {
                let terms =
                    (0..k).map(|p| round_bf16(a[e / n * k + p]) as f64 * round_bf16(w[e % n * k + p]) as f64);
                let magnitude: f64 = terms.clone().map(f64::abs).sum();
                (terms.sum(), magnitude)
            };
            let packed = PackedB::of_transpose_bf16(&w, n, k);
            let plain = PackedB::of_bf16(&transpose(&w, n, k), k, n);
            assert_eq!(packed.data.as_slice(), plain.data.as_slice(), "{n}x{k}: the two packings differ");
            let mut first: Option<Vec<f32>> = None;
            for kernel in Bf16Kernel::available() {
                for b in [&packed, &plain] {
                    for parts in [1, 2, 3] {
                        let mut y = vec![f32::NAN; m * n];
                        for part in 0..parts {
                            // SAFETY: y is [m, n], a is [m, k], b is [k, n].
                            unsafe {
                                multiply_bf16_with(
                                    kernel,
                                    rows(&mut y, &a, m, k, n),
                                    b,
                                    b.share(part, parts),
                                    false,
                                )
                            };
                        }
                        for (e, &x) in y.iter().enumerate() {
                            let (want, magnitude) = bound(e);
                            // Summing k exact products in f32 in any order is within
                            // (k - 1)·2⁻²⁴ of their magnitudes; 2⁻²³ leaves room for a
                            // processor's own order and rounding inside vdpbf16ps.
                            let slack = k as f64 * f64::powi(2.0, -23) * magnitude + 1e-30;
                            assert!(
                                (x as f64 - want).abs() <= slack,
                                "{kernel:?} {m}x{k}x{n} [{e}]: {x} vs {want}"
                            );
                        }
                        match (&first, kernel) {
                            (None, _) => first = Some(y.clone()),
                            (Some(bits), Bf16Kernel::Portable | Bf16Kernel::Avx2) => {
                                assert_eq!(bits, &y, "{kernel:?} {m}x{k}x{n}: not the portable kernel's bits")
                            }
                            _ => {}
                        }
                        // SAFETY: as above.
                        unsafe {
                            multiply_bf16_with(kernel, rows(&mut y, &a, m, k, n), b, 0..b.panels(), true)
                        };
                        for (e, &x) in y.iter().enumerate() {
                            let (want, magnitude) = bound(e);
                            assert!(
                                (x as f64 - 2.0 * want).abs()
                                    <= (k + 1) as f64 * f64::powi(2.0, -22) * magnitude + 1e-30,
                                "{kernel:?} accumulate"
                            );
                        }
                    }
                }
            }
        }
    }

    /// bf16 products stay within bf16's rounding of the f32 ones (the
    /// operands' relative error 2^-9 each), and NaN and infinity pass through.
    #[test]
    fn bf16_products_are_near_the_f32_ones_and_keep_nan_and_infinity() {
        use super::super::bf16::{multiply_with as multiply_bf16_with, Bf16Kernel};
        let (m, k, n) = (6, 300, 70);
        let mut a = data(m * k, 5.0);
        let w = data(n * k, 6.0);
        let f32_panels = PackedB::of_transpose(&w, n, k);
        let bf16_panels = PackedB::of_transpose_bf16(&w, n, k);
        let mut exact = vec![0.0; m * n];
        // SAFETY: shapes as declared.
        unsafe { multiply(rows(&mut exact, &a, m, k, n), &f32_panels, 0..f32_panels.panels(), false) };
        a[k + 3] = f32::NAN;
        a[2 * k + 7] = f32::INFINITY;
        for kernel in Bf16Kernel::available() {
            let mut y = vec![0.0; m * n];
            // SAFETY: shapes as declared.
            unsafe {
                multiply_bf16_with(
                    kernel,
                    rows(&mut y, &a, m, k, n),
                    &bf16_panels,
                    0..bf16_panels.panels(),
                    false,
                )
            };
            for i in [0, 3, 4, 5] {
                for j in 0..n {
                    let magnitude: f32 = (0..k).map(|p| (a[i * k + p] * w[j * k + p]).abs()).sum();
                    let (x, e) = (y[i * n + j], exact[i * n + j]);
                    assert!((x - e).abs() <= 2.0 * magnitude / 256.0, "{kernel:?} [{i}, {j}]: {x} vs {e}");
                }
            }
            assert!(y[n..2 * n].iter().all(|x| x.is_nan()), "{kernel:?}: a NaN operand");
            // Infinity times weights of both signs: some infinite, some NaN, none finite.
            assert!(y[2 * n..3 * n].iter().all(|x| !x.is_finite()), "{kernel:?}: an infinite operand");
        }
    }

    fn rows(y: &mut [f32], a: &[f32], m: usize, k: usize, n: usize) -> Rows {
        assert!(y.len() >= m * n && a.len() >= m * k);
        Rows { y: y.as_mut_ptr(), ldy: n, a: a.as_ptr(), lda: k, m }
    }

    fn transpose(w: &[f32], r: usize, c: usize) -> Vec<f32> {
        (0..r * c).map(|e| w[(e % r) * c + e / r]).collect()
    }
}
