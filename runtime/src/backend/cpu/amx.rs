//! bf16 products on Intel's AMX tiles (`tdpbf16ps`: Sapphire Rapids and later).
//!
//! One `tdpbf16ps` multiplies a 16-row tile of bf16 pairs by a 16-column
//! tile of pair rows into a 16x16 f32 tile: 8192 multiply-adds, at about
//! 15 times the rate of AVX-512 f32 FMAs on the Xeon it was measured on
//! (`cellc peak`: 2.5 against 0.17 TFLOP/s a core). Its operands are exactly
//! [`super::bf16`]'s layouts: the left rows as pairs (`vdpbf16ps`'s), and a
//! pair panel's rows, 16 of them a tile, each half panel (16 columns, 64
//! bytes) one tile `PANEL` words apart. So the weight is packed once, as for
//! the other bf16 kernels, with its pair rows padded to a multiple of
//! [`TILE_PAIRS`] ([`super::bf16::pair_rows`]), and the left rows likewise.
//!
//! Linux enables the tile registers for a process only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); [`usable`] asks once, and where the
//! request fails (an old kernel, a signal stack too small for the tiles'
//! state) the AVX512-BF16 kernel runs instead. No Rust intrinsics for AMX
//! are stable, so the instructions are written with `asm!`.
//!
//! `tdpbf16ps` adds a tile's 32 products of an output its own way: its
//! results are not `vdpbf16ps`'s bit for bit (nor those of adding the pairs
//! in order), but they depend only on an output's row and column and on
//! the blocks of [`TILE_PAIRS`] pairs, always taken from the first: the
//! same bits whatever the rows, the panels or the threads of a call.

use super::panels::{TileOut, PANEL};

/// Pairs (32-bit words) of the inner dimension per tile: a tile row is 64 bytes.
pub const TILE_PAIRS: usize = 16;

/// Rows per tile of the left operand and of the result.
pub const TILE_ROWS: usize = 16;

/// Whether this processor has AMX with bf16 and Linux lets this process
/// use its tiles (asked once).
pub fn usable() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(|| has_instructions() && permitted())
}

/// AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), with
/// AVX-512F for the results' stores.
fn has_instructions() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return false;
        }
        // Leaf 7 exists on every processor with AVX-512F.
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        edx & (1 << 24) != 0 && edx & (1 << 22) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Linux's permission for this process to use the tile data registers.
fn permitted() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a request about this process's own register state.
        unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    false
}

/// The tile configuration `ldtilecfg` reads: palette 1, every one of the
/// eight tiles 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: Config = Config {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// The tiles configured for [`Block::run`] on this thread, released
/// (returned to their initial state, so that a context switch saves
/// nothing of them) when dropped. Configured per call: another library
/// on the thread (a framework's own AMX kernels) may configure them otherwise between calls.
#[derive(Debug)]
pub(super) struct Tiles(());

impl Tiles {
    /// # Safety
    /// [`usable`] is true.
    #[cfg(target_arch = "x86_64")]
    pub(super) unsafe fn configure() -> Tiles {
        // SAFETY: AMX is usable; CONFIG is 64 valid bytes.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly, preserves_flags))
        };
        Tiles(())
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured, so AMX is usable.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}

/// Up to 32 rows of the left operand's pairs times one pair panel.
pub(super) struct Block {
    pub out: TileOut,
    /// The rows' pairs, `pairs` words a row, with rows up to a multiple
    /// of [`TILE_ROWS`] readable (zeros past the block).
    pub a: *const u32,
    /// Pairs of the inner dimension, a multiple of [`TILE_PAIRS`] (zeros past the operands').
    pub pairs: usize,
    /// The pair panel, `pairs` rows of [`PANEL`] words (64-byte aligned).
    pub panel: *const u32,
}

/// 32 rows of a panel's results, as the tiles store them.
#[repr(C, align(64))]
struct Stored([[f32; PANEL]; 2 * TILE_ROWS]);

impl Block {
    /// Multiplies `rows` (1 to 32) rows into the panel's columns: up to
    /// two row tiles by the two half panels, in four result tiles; each
    /// block of 16 pairs loads the half panels' tiles once for both row tiles.
    ///
    /// Alternating two sets of operand tiles (so that a load need not wait
    /// for the `tdpbf16ps` still reading its tile), with two result tiles,
    /// measured no faster in a pass on a Xeon with AMX, and slower from 17
    /// rows, where each half panel is then streamed separately.
    ///
    /// # Safety
    /// The tiles are [configured](Tiles::configure) on this thread; the
    /// processor has AVX-512F; `a` holds `rows.next_multiple_of(16)` rows
    /// of `pairs` words, the panel `pairs` rows, and `out` the block's
    /// `rows` rows and `width` columns.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn run(&self, rows: usize) {
        use std::arch::asm;
        use std::arch::x86_64::*;
        debug_assert!((1..=2 * TILE_ROWS).contains(&rows) && self.pairs.is_multiple_of(TILE_PAIRS));
        let (a_stride, b_stride) = (self.pairs * 4, PANEL * 4);
        let second = self.a.wrapping_add(TILE_ROWS * self.pairs);
        // SAFETY (every block below): the tiles are configured (16 rows of
        // 64 bytes); each load reads 16 rows of 64 bytes inside the operands
        // (the contract); the stores write inside `stored`.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem, preserves_flags)
            );
            for q in (0..self.pairs).step_by(TILE_PAIRS) {
                // The two half panels' tiles, by the first row tile.
                asm!(
                    "tileloadd tmm6, [{b} + {bs}*1]",
                    "tileloadd tmm7, [{b} + {bs}*1 + 64]",
                    "tileloadd tmm4, [{a} + {as}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    b = in(reg) self.panel.add(q * PANEL),
                    bs = in(reg) b_stride,
                    a = in(reg) self.a.add(q),
                    as = in(reg) a_stride,
                    options(nostack, readonly, preserves_flags)
                );
                // By the second.
                if rows > TILE_ROWS {
                    asm!(
                        "tileloadd tmm5, [{a} + {as}*1]",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        a = in(reg) second.add(q),
                        as = in(reg) a_stride,
                        options(nostack, readonly, preserves_flags)
                    );
                }
            }
            let out = &self.out;
            if !out.accumulate && out.width == PANEL && rows.is_multiple_of(TILE_ROWS) {
                // Whole tiles: stored straight into the result's rows.
                store_pair(0, out.y, out.ldy * 4);
                if rows > TILE_ROWS {
                    store_pair(2, out.y.add(TILE_ROWS * out.ldy), out.ldy * 4);
                }
                return;
            }
            let mut stored = std::mem::MaybeUninit::<Stored>::uninit();
            let c = stored.as_mut_ptr().cast::<f32>();
            store_pair(0, c, b_stride);
            if rows > TILE_ROWS {
                store_pair(2, c.add(TILE_ROWS * PANEL), b_stride);
            }
            for i in 0..rows {
                let row = c.add(i * PANEL);
                out.write_avx512(i, [_mm512_load_ps(row), _mm512_load_ps(row.add(16))]);
            }
        }
    }
}

/// Stores result tiles `first` and `first + 1` (0 or 2: one row tile's two
/// half panels) as 16 rows `stride` bytes apart from `to`, the second 16 floats on.
///
/// # Safety
/// The tiles are configured; 16 rows of 32 floats are writable there.
#[cfg(target_arch = "x86_64")]
unsafe fn store_pair(first: usize, to: *mut f32, stride: usize) {
    // A tile is named in the instruction, so each pair has its own.
    macro_rules! store {
        ($low:literal, $high:literal) => {
            std::arch::asm!(
                concat!("tilestored [{c} + {cs}*1], ", $low),
                concat!("tilestored [{c} + {cs}*1 + 64], ", $high),
                c = in(reg) to,
                cs = in(reg) stride,
                options(nostack, preserves_flags)
            )
        };
    }
    // SAFETY: per the contract.
    unsafe {
        if first == 0 {
            store!("tmm0", "tmm1");
        } else {
            store!("tmm2", "tmm3");
        }
    }
}

/// `iters` rounds of four independent `tdpbf16ps` on one thread (the
/// tiles' operands as they are, the results kept in the tiles): the
/// instruction's rate, for [`super::peak`].
///
/// # Safety
/// [`usable`] is true.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn dot_rounds(iters: u64) {
    // SAFETY: AMX is usable; only tile registers are read and written.
    unsafe {
        let _tiles = Tiles::configure();
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "tilezero tmm4",
            "tilezero tmm5",
            "tilezero tmm6",
            "tilezero tmm7",
            options(nostack, nomem, preserves_flags)
        );
        for _ in 0..iters {
            std::arch::asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                options(nostack, nomem, preserves_flags)
            );
        }
    }
}

/// Multiply-adds of one [`dot_rounds`] round.
pub(super) const DOT_ROUND_MACS: usize = 4 * TILE_ROWS * 16 * 2 * TILE_PAIRS;
