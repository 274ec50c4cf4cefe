//! Products with bf16 operands and f32 accumulation ([`cellc::precision::Precision::Bf16`]).
//!
//! A weight is packed once into *pair panels*: the [`PANEL`] columns of
//! [`super::panels`], but each 32-bit word of a panel row holds two bf16
//! values of one column, rows `2q` (low half) and `2q + 1` (high half) of
//! `B`: the operand layout of `vdpbf16ps`, which sums two products into
//! each f32 lane. The left operand's rows are rounded to bf16 once per call
//! (as pairs for `vdpbf16ps`, as rounded floats for the kernels that
//! widen). Each output then adds, for `q = 0, 1, ...`, first the product of
//! the odd elements and then that of the even ones, each rounded to f32 once
//! (a product of two bf16 values is exact in f32): `vdpbf16ps`'s order,
//! which every kernel here follows, so that the portable and AVX2 kernels
//! give the same bits, and AVX512-BF16 the same up to its flushing of
//! subnormals to zero.
//!
//! The kernel is chosen once per process from what the processor has:
//! AMX tiles ([`super::amx`]: Intel Sapphire Rapids and later), else
//! AVX512-BF16 (`vdpbf16ps`: AMD Zen 4 and later, Intel Cooper Lake and
//! Sapphire Rapids and later), else AVX2 + FMA (the pairs widened to f32 in
//! registers: half the weight's memory traffic, the f32 path's arithmetic),
//! else portable Rust. Rounding to bf16 is round-to-nearest-even; NaN stays
//! NaN and infinities stay infinite.

use super::aligned::AlignedBuf;
use super::amx;
#[cfg(target_arch = "x86_64")]
use super::panels::prefetch_ahead;
use super::panels::{by_rows, PackedB, Rows, TileOut, PANEL, ROW_BLOCK};
use cellc::precision::bf16_bits;
use std::cell::RefCell;
use std::ops::Range;

/// One 32-bit word of a pair panel: `even` in the low half, `odd` in the high.
pub fn pair(even: f32, odd: f32) -> u32 {
    (bf16_bits(odd) as u32) << 16 | bf16_bits(even) as u32
}

/// Packing into pair panels.
impl PackedB {
    /// Pair panels ([`super::bf16`]) written by `fill(p, words)`, each
    /// panel [`pair_rows`] rows of [`PANEL`] words; the columns past `n`
    /// in the last panel are zeros, and so is an odd `k`'s last high half.
    fn build_pairs(k: usize, n: usize, fill: impl Fn(usize, &mut [u32]) + Sync) -> PackedB {
        let (panels, kp) = (n.div_ceil(PANEL), pair_rows(k));
        let mut data = AlignedBuf::recycled(panels * kp * PANEL);
        super::threads::for_each_chunk_mut(data.as_mut_slice(), (kp * PANEL).max(1), &|p, panel| {
            // SAFETY: u32 and f32 have one size and alignment; the slots hold bits only.
            let words =
                unsafe { std::slice::from_raw_parts_mut(panel.as_mut_ptr().cast::<u32>(), panel.len()) };
            words.fill(0);
            fill(p, words);
        });
        PackedB { k, n, bf16: true, panel_rows: kp, data }
    }

    /// [`PackedB::of_transpose`] rounded to bf16 (ties to even), in pair
    /// panels: the two elements of a word are neighbours in a row of `W`.
    pub fn of_transpose_bf16(w: &[f32], rows: usize, cols: usize) -> PackedB {
        PackedB::of_transpose_bf16_by(w, rows, cols, |r| r)
    }

    /// [`PackedB::of_transpose_bf16`] of `W`'s rows in another order (see
    /// [`PackedB::of_transpose_by`]).
    pub fn of_transpose_bf16_by(
        w: &[f32],
        rows: usize,
        cols: usize,
        source: impl Fn(usize) -> usize + Sync,
    ) -> PackedB {
        assert!(w.len() >= rows * cols, "weight of {} floats packed as [{rows}, {cols}]", w.len());
        PackedB::build_pairs(cols, rows, |p, words| {
            for c in 0..PANEL.min(rows - p * PANEL) {
                let row = &w[source(p * PANEL + c) * cols..][..cols];
                for (q, two) in row.chunks(2).enumerate() {
                    words[q * PANEL + c] = pair(two[0], two.get(1).copied().unwrap_or(0.0));
                }
            }
        })
    }

    /// [`PackedB::of`] rounded to bf16 (ties to even), in pair panels: a
    /// word holds an element of `W` and the one below it.
    pub fn of_bf16(w: &[f32], rows: usize, cols: usize) -> PackedB {
        assert!(w.len() >= rows * cols, "weight of {} floats packed as [{rows}, {cols}]", w.len());
        PackedB::build_pairs(rows, cols, |p, words| {
            let (from, width) = (p * PANEL, PANEL.min(cols - p * PANEL));
            for (q, dst) in words.chunks_mut(PANEL).enumerate().take(rows.div_ceil(2)) {
                let even = &w[2 * q * cols + from..][..width];
                let odd = (2 * q + 1 < rows).then(|| &w[(2 * q + 1) * cols + from..][..width]);
                for (c, word) in dst[..width].iter_mut().enumerate() {
                    *word = pair(even[c], odd.map_or(0.0, |o| o[c]));
                }
            }
        })
    }
}

/// Rows of a pair panel for an inner dimension `k`: its `k.div_ceil(2)`
/// pairs, and zero rows up to a whole tile where the AMX kernel runs
/// (which reads 16 pair rows at a time).
pub fn pair_rows(k: usize) -> usize {
    Bf16Kernel::detect().padded_pairs(k.div_ceil(2))
}

/// The even (low) element of a pair word, as f32.
fn even(word: u32) -> f32 {
    f32::from_bits(word << 16)
}

/// The odd (high) element of a pair word, as f32.
fn odd(word: u32) -> f32 {
    f32::from_bits(word & 0xffff_0000)
}

/// Which microkernel multiplies by pair panels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// AMX's `tdpbf16ps`, 32 rows by a 32-column panel in four tiles.
    Amx,
    /// `vdpbf16ps`, eight rows by a 32-column panel in registers.
    Avx512Bf16,
    /// Pairs widened to f32 in registers; the products by FMA.
    Avx2,
    /// Plain Rust.
    Portable,
}

/// The processor features the choice of [`Bf16Kernel`] depends on.
#[derive(Clone, Copy, Debug, Default)]
pub struct Features {
    /// AMX tiles with bf16, which Linux let this process use ([`amx::usable`]).
    pub amx: bool,
    /// AVX512-BF16 with AVX-512F.
    pub avx512_bf16: bool,
    /// AVX2 with FMA.
    pub avx2_fma: bool,
}

impl Features {
    /// This processor's.
    pub fn host() -> Features {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            Features {
                amx: amx::usable(),
                avx512_bf16: has!("avx512f") && has!("avx512bf16"),
                avx2_fma: has!("avx2") && has!("fma"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Features::default()
    }
}

impl Bf16Kernel {
    /// The fastest kernel `features` allow.
    pub fn choose(features: Features) -> Bf16Kernel {
        if features.amx {
            Bf16Kernel::Amx
        } else if features.avx512_bf16 {
            Bf16Kernel::Avx512Bf16
        } else if features.avx2_fma {
            Bf16Kernel::Avx2
        } else {
            Bf16Kernel::Portable
        }
    }

    /// This processor's, chosen once.
    pub fn detect() -> Bf16Kernel {
        static KERNEL: std::sync::OnceLock<Bf16Kernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| Bf16Kernel::choose(Features::host()))
    }

    /// Every kernel this processor can run (the tests compare them).
    pub fn available() -> Vec<Bf16Kernel> {
        let f = Features::host();
        let mut all = vec![Bf16Kernel::Portable];
        if f.avx2_fma {
            all.push(Bf16Kernel::Avx2);
        }
        if f.avx512_bf16 {
            all.push(Bf16Kernel::Avx512Bf16);
        }
        if f.amx {
            all.push(Bf16Kernel::Amx);
        }
        all
    }

    /// 32-bit words of the left operand per pair of its elements: one
    /// bf16 pair for `vdpbf16ps`, two rounded f32 (ready to broadcast from
    /// memory) for the kernels that widen to f32.
    fn left_words(self) -> usize {
        match self {
            Bf16Kernel::Amx | Bf16Kernel::Avx512Bf16 => 1,
            Bf16Kernel::Avx2 | Bf16Kernel::Portable => 2,
        }
    }

    /// `kp` pairs of an inner dimension as this kernel reads them: AMX
    /// reads whole tiles, 16 pairs at a time (zeros past `kp`).
    fn padded_pairs(self, kp: usize) -> usize {
        match self {
            Bf16Kernel::Amx => kp.next_multiple_of(amx::TILE_PAIRS),
            _ => kp,
        }
    }

    /// Words a row of the left operand takes for an inner dimension of `kp` pairs.
    fn row_words(self, kp: usize) -> usize {
        self.padded_pairs(kp) * self.left_words()
    }

    /// A row of the left operand, rounded to bf16, as this kernel reads it
    /// ([`Bf16Kernel::left_words`] per pair; an odd length's last pair padded with 0).
    fn write_left(self, row: &[f32], dst: &mut [u32]) {
        // `vdpbf16ps`'s pairs, 32 floats at a time in AVX-512 registers
        // (the kernel implies AVX-512F), the rest one pair at a time.
        #[cfg(target_arch = "x86_64")]
        let (row, dst) = match self {
            Bf16Kernel::Amx | Bf16Kernel::Avx512Bf16 => {
                let whole = row.len() / 32 * 32;
                // SAFETY: this kernel runs only where AVX-512F is (`Features`).
                unsafe { pairs_avx512(&row[..whole], &mut dst[..whole / 2]) };
                (&row[whole..], &mut dst[whole / 2..])
            }
            _ => (row, dst),
        };
        let (pairs, rest) = row.split_at(row.len() / 2 * 2);
        let last = rest.first().map(|&x| [x, 0.0]);
        let all = pairs.chunks_exact(2).map(|p| [p[0], p[1]]).chain(last);
        match self.left_words() {
            1 => dst.iter_mut().zip(all).for_each(|(w, [e, o])| *w = pair(e, o)),
            _ => dst.chunks_exact_mut(2).zip(all).for_each(|(w, [e, o])| {
                let word = pair(e, o);
                (w[0], w[1]) = (even(word).to_bits(), odd(word).to_bits());
            }),
        }
    }

    /// Rows converted to pairs at a time, each block multiplied by every
    /// panel before the next: AMX's block is one tile pair of rows (32 rows,
    /// 32 KiB at K=512), which stays in L1 while the panels stream from L2
    /// (the other kernels' 192-row block was 15% slower there, for a
    /// 6400 x 512 x 2048 product on a Xeon with AMX).
    fn row_block(self) -> usize {
        match self {
            Bf16Kernel::Amx => 2 * amx::TILE_ROWS,
            _ => ROW_BLOCK,
        }
    }

    /// Rows per register tile.
    fn tile_rows(self) -> usize {
        match self {
            Bf16Kernel::Amx => 2 * amx::TILE_ROWS,
            Bf16Kernel::Avx512Bf16 | Bf16Kernel::Portable => 8,
            // Half a panel: two accumulators a row, two for the row's
            // broadcast pair, four for the panel's widened halves: 16 registers.
            Bf16Kernel::Avx2 => 5,
        }
    }
}

/// [`pair`] of each two floats of `row` (a multiple of 32 long) into
/// `dst`, 16 floats a register: [`cellc::precision::bf16_bits`]'s integer
/// rounding, bit for bit, NaNs included.
///
/// # Safety
/// The processor has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pairs_avx512(row: &[f32], dst: &mut [u32]) {
    use std::arch::x86_64::*;
    debug_assert!(row.len().is_multiple_of(32) && dst.len() * 2 == row.len());
    let rounded = |x: __m512| {
        let bits = _mm512_castps_si512(x);
        let high = _mm512_srli_epi32::<16>(bits);
        let lowest_kept = _mm512_and_si512(high, _mm512_set1_epi32(1));
        let up = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lowest_kept);
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, _mm512_srli_epi32::<16>(up), quiet))
    };
    for (src, out) in row.chunks_exact(32).zip(dst.chunks_exact_mut(16)) {
        // SAFETY: 32 floats in, 16 words (32 halves) out.
        unsafe {
            let lo = rounded(_mm512_loadu_ps(src.as_ptr()));
            let hi = rounded(_mm512_loadu_ps(src.as_ptr().add(16)));
            _mm256_storeu_si256(out.as_mut_ptr().cast(), lo);
            _mm256_storeu_si256(out.as_mut_ptr().add(8).cast(), hi);
        }
    }
}

thread_local! {
    /// The left operand's rows rounded to bf16, as the kernel reads them
    /// ([`Bf16Kernel::left_words`]), per thread, reused.
    static LEFT_PAIRS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// `Y[i, j] (+)= Σ_kk A[i, kk] · B[kk, j]` with `A` rounded to bf16, for
/// rows `i < m` and the columns of `panels` of `b`'s pair panels, on the
/// calling thread with `kernel` (the tests run every one the host has).
///
/// # Safety
/// As [`super::product::multiply`]; `b` holds bf16 pairs; `kernel` runs on this processor.
pub(crate) unsafe fn multiply_with(
    kernel: Bf16Kernel,
    rows: Rows,
    b: &PackedB,
    panels: Range<usize>,
    accumulate: bool,
) {
    assert!(b.is_bf16(), "f32 panels given to a bf16 kernel");
    let Rows { y, ldy, a, lda, m } = rows;
    let k = b.k();
    let kp = k.div_ceil(2);
    if m == 0 || panels.is_empty() {
        return;
    }
    let (tile_rows, row_words) = (kernel.tile_rows(), kernel.row_words(kp));
    // SAFETY: the AMX kernel is chosen only where AMX is usable.
    #[cfg(target_arch = "x86_64")]
    let _tiles = (kernel == Bf16Kernel::Amx).then(|| unsafe { amx::Tiles::configure() });
    LEFT_PAIRS.with_borrow_mut(|left| {
        // A block of rows, in pairs, stays in L2 while every panel passes over it.
        let row_block = kernel.row_block();
        for r0 in (0..m).step_by(row_block) {
            let block = (m - r0).min(row_block);
            left.clear();
            // Zero rows up to a whole tile: AMX loads 16 rows at a time.
            left.resize(block.next_multiple_of(amx::TILE_ROWS) * row_words, 0);
            for (i, dst) in left.chunks_mut(row_words.max(1)).take(block).enumerate() {
                // SAFETY: row r0 + i < m of a has k floats (the caller's contract).
                let row = unsafe { std::slice::from_raw_parts(a.add((r0 + i) * lda), k) };
                kernel.write_left(row, dst);
            }
            for p in panels.clone() {
                let (words, width) = (b.panel(p).cast::<u32>(), b.width(p));
                for i0 in (0..block).step_by(tile_rows) {
                    // SAFETY: row r0 + i0 < m of y, column p*PANEL within its row.
                    let y = unsafe { y.add((r0 + i0) * ldy + p * PANEL) };
                    let (out, a, rows) = (
                        TileOut { y, ldy, width, accumulate },
                        left[i0 * row_words..].as_ptr(),
                        (block - i0).min(tile_rows),
                    );
                    #[cfg(target_arch = "x86_64")]
                    if kernel == Bf16Kernel::Amx {
                        debug_assert_eq!(row_words, b.panel_rows, "the left rows and the panel pad alike");
                        let block = amx::Block { out, a, pairs: row_words, panel: words };
                        // SAFETY: the tiles are configured; the left rows
                        // are padded to whole tiles, the panel to whole
                        // tiles of pairs (`pair_rows`); the rows and columns exist.
                        unsafe { block.run(rows) };
                        continue;
                    }
                    let t = Tile { out, a, kp, panel: words };
                    // SAFETY: the tile's rows and columns exist (the caller's contract).
                    unsafe { t.run(kernel, rows) };
                }
            }
        }
    });
}

/// Up to eight rows of bf16 pairs times one pair panel.
struct Tile {
    out: TileOut,
    /// The rows' pairs, `kp` of [`Bf16Kernel::left_words`] words a row.
    a: *const u32,
    kp: usize,
    panel: *const u32,
}

impl Tile {
    /// # Safety
    /// `mr` rows of `a` and `y` exist, `panel` holds `kp` rows of
    /// [`PANEL`] words (64-byte aligned), `width` of `y`'s columns are the
    /// tile's, and `kernel` runs on this processor.
    unsafe fn run(&self, kernel: Bf16Kernel, mr: usize) {
        // SAFETY: per the contract.
        unsafe {
            match kernel {
                #[cfg(target_arch = "x86_64")]
                Bf16Kernel::Avx512Bf16 => by_rows!(self, mr, avx512_bf16),
                #[cfg(target_arch = "x86_64")]
                Bf16Kernel::Avx2 => match mr {
                    1 => self.avx2::<1, 4>(),
                    2 => self.avx2::<2, 4>(),
                    3 => self.avx2::<3, 2>(),
                    4 => self.avx2::<4, 2>(),
                    _ => self.avx2::<5, 2>(),
                },
                _ => by_rows!(self, mr, portable),
            }
        }
    }

    /// # Safety
    /// As [`Tile::run`].
    unsafe fn portable<const R: usize>(&self) {
        let mut acc = [[0.0f32; PANEL]; R];
        for q in 0..self.kp {
            // SAFETY: panel row q exists; a's rows < R have kp words.
            let b = unsafe { std::slice::from_raw_parts(self.panel.add(q * PANEL), PANEL) };
            for (i, row) in acc.iter_mut().enumerate() {
                // SAFETY: the pair's two rounded floats.
                let (ae, ao) = unsafe {
                    let at = self.a.add(2 * (i * self.kp + q));
                    (f32::from_bits(*at), f32::from_bits(*at.add(1)))
                };
                for (x, &bw) in row.iter_mut().zip(b) {
                    // Exact products, so each addition is vdpbf16ps's one rounding.
                    *x += ao * odd(bw);
                    *x += ae * even(bw);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            // SAFETY: the tile's row i, columns 0..width.
            unsafe { self.out.write(i, 0, &row[..self.out.width]) };
        }
    }

    /// `V` vectors of eight columns (a whole panel at 4, half at 2) at a
    /// time, for `R` rows.
    ///
    /// # Safety
    /// As [`Tile::run`]; the processor has AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2<const R: usize, const V: usize>(&self) {
        use std::arch::x86_64::*;
        let high = _mm256_set1_epi32(0xffff_0000u32 as i32);
        for part in 0..PANEL / (8 * V) {
            let first = part * 8 * V;
            let cols = self.out.width.saturating_sub(first).min(8 * V);
            if cols == 0 {
                break;
            }
            let mut acc = [[_mm256_setzero_ps(); V]; R];
            let (mut b, mut a) = (self.panel.wrapping_add(first), self.a);
            for _ in 0..self.kp {
                // SAFETY: panel rows are PANEL words, 32-byte aligned (the
                // buffer is 64-byte aligned, a row 128 bytes); a's rows have kp words.
                unsafe {
                    prefetch_ahead(b, V / 2);
                    let words: [__m256i; V] = std::array::from_fn(|v| _mm256_load_si256(b.add(v * 8).cast()));
                    let bo: [__m256; V] =
                        std::array::from_fn(|v| _mm256_castsi256_ps(_mm256_and_si256(words[v], high)));
                    let be: [__m256; V] =
                        std::array::from_fn(|v| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(words[v])));
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let at = a.add(2 * i * self.kp).cast::<f32>();
                        let (ae, ao) = (_mm256_broadcast_ss(&*at), _mm256_broadcast_ss(&*at.add(1)));
                        for v in 0..V {
                            acc[v] = _mm256_fmadd_ps(ao, bo[v], acc[v]);
                            acc[v] = _mm256_fmadd_ps(ae, be[v], acc[v]);
                        }
                    }
                    b = b.add(PANEL);
                    a = a.add(2);
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                let mut lanes = [0.0f32; PANEL];
                // SAFETY: a local array of PANEL >= 8 * V floats.
                unsafe {
                    for (v, &x) in acc.iter().enumerate() {
                        _mm256_storeu_ps(lanes.as_mut_ptr().add(v * 8), x);
                    }
                }
                // SAFETY: row i, columns first..first + cols <= width.
                unsafe { self.out.write(i, first, &lanes[..cols]) };
            }
        }
    }

    /// # Safety
    /// As [`Tile::run`]; the processor has AVX-512F and AVX512-BF16.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn avx512_bf16<const R: usize>(&self) {
        use std::arch::x86_64::*;
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let (mut b, mut a) = (self.panel, self.a);
        for _ in 0..self.kp {
            // SAFETY: panel rows are PANEL words, 64-byte aligned; a's rows have kp words.
            unsafe {
                prefetch_ahead(b, 2);
                let b0: __m512bh = std::mem::transmute(_mm512_load_si512(b.cast()));
                let b1: __m512bh = std::mem::transmute(_mm512_load_si512(b.add(16).cast()));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(i * self.kp) as i32));
                    acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
                    acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
                }
                b = b.add(PANEL);
                a = a.add(1);
            }
        }
        for (i, &acc) in acc.iter().enumerate() {
            // SAFETY: row i is the tile's; the processor has AVX-512F (which AVX512-BF16 implies here).
            unsafe { self.out.write_avx512(i, acc) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellc::precision::round_bf16;

    /// The compiler's rounding (which the kernels use) is the `half` crate's.
    #[test]
    fn rounding_is_the_half_crates() {
        // The same as the `half` crate's conversion, over a sweep of values.
        for i in 0..100_000u32 {
            let x = f32::from_bits(i.wrapping_mul(2_654_435_761));
            let want = half::bf16::from_f32(x);
            if x.is_nan() {
                assert!(round_bf16(x).is_nan());
            } else {
                assert_eq!(bf16_bits(x), want.to_bits(), "{x:e}");
            }
        }
    }

    #[test]
    fn the_kernel_choice_follows_the_features() {
        let pick = |avx512_bf16, avx2_fma| Bf16Kernel::choose(Features { amx: false, avx512_bf16, avx2_fma });
        let amx = Features { amx: true, avx512_bf16: true, avx2_fma: true };
        assert_eq!(Bf16Kernel::choose(amx), Bf16Kernel::Amx);
        assert_eq!(pick(true, true), Bf16Kernel::Avx512Bf16);
        assert_eq!(pick(true, false), Bf16Kernel::Avx512Bf16);
        assert_eq!(pick(false, true), Bf16Kernel::Avx2);
        assert_eq!(pick(false, false), Bf16Kernel::Portable);
        assert_eq!(Bf16Kernel::detect(), Bf16Kernel::choose(Features::host()));
        assert!(Bf16Kernel::available().contains(&Bf16Kernel::detect()));
    }

    #[test]
    fn the_avx512_pairs_are_the_scalar_pairs() {
        if !Features::host().avx512_bf16 {
            return;
        }
        // Ties, carries into the exponent, infinities, NaNs, subnormals, a sweep.
        let mut row: Vec<f32> = vec![
            1.0 + f32::EPSILON * 64.0,
            1.0 + f32::EPSILON * 192.0,
            f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0x0000_8000),
            -0.0,
            f32::MIN_POSITIVE / 3.0,
        ];
        row.extend((0..4096u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))));
        row.truncate(row.len() / 32 * 32 + 7);
        let mut fast = vec![0u32; row.len().div_ceil(2)];
        Bf16Kernel::Avx512Bf16.write_left(&row, &mut fast);
        let scalar: Vec<u32> = row.chunks(2).map(|p| pair(p[0], p.get(1).copied().unwrap_or(0.0))).collect();
        assert_eq!(fast, scalar);
    }

    #[test]
    fn pairs_put_the_even_element_low() {
        let w = pair(1.5, -2.0);
        assert_eq!((even(w), odd(w)), (1.5, -2.0));
        assert_eq!(w & 0xffff, bf16_bits(1.5) as u32);
    }
}
