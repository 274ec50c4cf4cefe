//! Dropout masks drawn on the CPU from cellc's one generator
//! ([`cellc::random`]): a row of units at a time, eight Philox counters
//! (32 units) at once with AVX2 where the processor has it, bitwise the
//! same as one counter at a time.

use cellc::random::{kept, philox4x32_10};

/// Where one row of a mask comes from: its key, the sequence (its index in
/// the caller's batch) and step it belongs to (either may be
/// [`cellc::random::SHARED`]), and what a unit becomes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MaskRow {
    /// The mask's key ([`cellc::random::MaskStream::key`]).
    pub key: [u32; 2],
    /// The sequence's index in the caller's batch.
    pub sequence: u32,
    /// The step within the sequence.
    pub step: u32,
    /// A unit is kept where its bits reach this ([`cellc::random::threshold`]).
    pub threshold: u32,
    /// A kept unit's value (`1 / (1 - rate)` for dropout); a dropped one is 0.
    pub scale: f32,
}

/// Fills `out` with units `first..first + out.len()` of `row`'s mask:
/// [`MaskRow::scale`] where kept, 0 where dropped.
pub fn fill(row: MaskRow, first: u32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2.
        return unsafe { avx2::fill(row, first, out) };
    }
    fill_one_counter_at_a_time(row, first, out)
}

/// [`fill`], one Philox counter (four units) at a time.
pub fn fill_one_counter_at_a_time(row: MaskRow, first: u32, out: &mut [f32]) {
    let mut group = None;
    let mut words = [0u32; 4];
    for (i, o) in out.iter_mut().enumerate() {
        let unit = first + i as u32;
        if group != Some(unit / 4) {
            group = Some(unit / 4);
            words = philox4x32_10([unit / 4, row.step, row.sequence, 0], row.key);
        }
        *o = value(row, words[(unit % 4) as usize]);
    }
}

fn value(row: MaskRow, bits: u32) -> f32 {
    if kept(bits, row.threshold) {
        row.scale
    } else {
        0.0
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::backend::cpu::masks::MaskRow;
    use std::arch::x86_64::*;

    /// The high and low 32 bits of each lane's `m * x` (unsigned).
    #[target_feature(enable = "avx2")]
    fn mul_hi_lo(m: __m256i, x: __m256i) -> (__m256i, __m256i) {
        let lo = _mm256_mullo_epi32(m, x);
        // 64-bit products of the even lanes, then of the odd ones.
        let even = _mm256_mul_epu32(m, x);
        let odd = _mm256_mul_epu32(_mm256_srli_epi64::<32>(m), _mm256_srli_epi64::<32>(x));
        let hi = _mm256_blend_epi32::<0b1010_1010>(_mm256_srli_epi64::<32>(even), odd);
        (hi, lo)
    }

    /// Philox4x32-10 of eight counters at once (word `j` of each in `c[j]`).
    #[target_feature(enable = "avx2")]
    fn philox8(mut c: [__m256i; 4], key: [u32; 2]) -> [__m256i; 4] {
        let m0 = _mm256_set1_epi32(0xD251_1F53u32 as i32);
        let m1 = _mm256_set1_epi32(0xCD9E_8D57u32 as i32);
        let mut k = key;
        for round in 0..10 {
            if round > 0 {
                k = [k[0].wrapping_add(0x9E37_79B9), k[1].wrapping_add(0xBB67_AE85)];
            }
            let (hi0, lo0) = mul_hi_lo(m0, c[0]);
            let (hi1, lo1) = mul_hi_lo(m1, c[2]);
            let k0 = _mm256_set1_epi32(k[0] as i32);
            let k1 = _mm256_set1_epi32(k[1] as i32);
            c = [
                _mm256_xor_si256(_mm256_xor_si256(hi1, c[1]), k0),
                lo1,
                _mm256_xor_si256(_mm256_xor_si256(hi0, c[3]), k1),
                lo0,
            ];
        }
        c
    }

    /// The values of 32 units (eight counters' words, unit `4 * lane + j`
    /// from word `j` of `lane`), in unit order: four vectors of eight.
    #[target_feature(enable = "avx2")]
    fn values(words: [__m256i; 4], row: MaskRow) -> [__m256; 4] {
        // A 4 x 8 transpose: each counter's four words side by side.
        let t0 = _mm256_unpacklo_epi32(words[0], words[1]);
        let t1 = _mm256_unpackhi_epi32(words[0], words[1]);
        let t2 = _mm256_unpacklo_epi32(words[2], words[3]);
        let t3 = _mm256_unpackhi_epi32(words[2], words[3]);
        let u0 = _mm256_unpacklo_epi64(t0, t2);
        let u1 = _mm256_unpackhi_epi64(t0, t2);
        let u2 = _mm256_unpacklo_epi64(t1, t3);
        let u3 = _mm256_unpackhi_epi64(t1, t3);
        let ordered = [
            _mm256_permute2x128_si256::<0x20>(u0, u1),
            _mm256_permute2x128_si256::<0x20>(u2, u3),
            _mm256_permute2x128_si256::<0x31>(u0, u1),
            _mm256_permute2x128_si256::<0x31>(u2, u3),
        ];
        // Kept where bits >> 8 reach the threshold (both below 2^25: a signed compare is exact).
        let threshold = _mm256_set1_epi32(row.threshold as i32);
        let scale = _mm256_set1_ps(row.scale);
        ordered.map(|bits| {
            let dropped = _mm256_cmpgt_epi32(threshold, _mm256_srli_epi32::<8>(bits));
            _mm256_andnot_ps(_mm256_castsi256_ps(dropped), scale)
        })
    }

    /// [`super::fill`] with AVX2: 32 units (eight counters) at a time.
    ///
    /// # Safety
    /// The processor has AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn fill(row: MaskRow, first: u32, out: &mut [f32]) {
        let end = u64::from(first) + out.len() as u64;
        let mut group = first / 4;
        while u64::from(group) * 4 < end {
            let c0 =
                _mm256_add_epi32(_mm256_set1_epi32(group as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            let step = _mm256_set1_epi32(row.step as i32);
            let sequence = _mm256_set1_epi32(row.sequence as i32);
            let block = values(philox8([c0, step, sequence, _mm256_setzero_si256()], row.key), row);
            let start = u64::from(group) * 4;
            if start >= u64::from(first) && start + 32 <= end {
                let at = (start - u64::from(first)) as usize;
                for (k, v) in block.iter().enumerate() {
                    // SAFETY: units start..start + 32 lie in `out` (checked above).
                    unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(at + 8 * k), *v) };
                }
            } else {
                let mut units = [0.0f32; 32];
                for (k, v) in block.iter().enumerate() {
                    // SAFETY: eight floats of `units`.
                    unsafe { _mm256_storeu_ps(units.as_mut_ptr().add(8 * k), *v) };
                }
                for (i, &x) in units.iter().enumerate() {
                    let unit = start + i as u64;
                    if unit >= u64::from(first) && unit < end {
                        out[(unit - u64::from(first)) as usize] = x;
                    }
                }
            }
            group += 8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellc::random::{draw, threshold, MaskStream, SHARED};

    fn row(rate: f32, sequence: u32, step: u32) -> MaskRow {
        let key = MaskStream { seed: 9, offset: 4, layer: 1, direction: 1, mask: 0 }.key();
        MaskRow { key, sequence, step, threshold: threshold(rate), scale: 1.0 / (1.0 - rate) }
    }

    #[test]
    fn every_way_of_filling_draws_the_generators_bits() {
        for (rate, sequence, step) in [(0.3, 0, 0), (0.5, 7, 99), (0.9, SHARED, 3), (0.1, 2, SHARED)] {
            let r = row(rate, sequence, step);
            for (first, len) in [(0u32, 1usize), (0, 37), (3, 64), (5, 200), (31, 33), (1000, 7)] {
                let mut fast = vec![f32::NAN; len];
                let mut plain = vec![f32::NAN; len];
                fill(r, first, &mut fast);
                fill_one_counter_at_a_time(r, first, &mut plain);
                let want: Vec<f32> =
                    (0..len as u32).map(|u| value(r, draw(r.key, sequence, step, first + u))).collect();
                assert_eq!(plain, want, "one at a time, rate {rate} units {first}+{len}");
                assert_eq!(fast, want, "fill, rate {rate} units {first}+{len}");
            }
        }
    }

    #[test]
    fn a_rate_of_zero_keeps_every_unit_at_scale_one() {
        let mut out = vec![0.0; 50];
        fill(row(0.0, 1, 1), 0, &mut out);
        assert!(out.iter().all(|&x| x == 1.0));
    }
}
