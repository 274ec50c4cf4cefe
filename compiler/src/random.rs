//! cellc's one random generator: Philox4x32-10 (Salmon, Moraes, Dror and
//! Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11), a
//! counter-based generator. Every number is a pure function of a key and a
//! counter, so any device draws any mask element on its own, in any order,
//! with no state, and a backward recomputes its forward's masks instead of
//! storing them.
//!
//! A mask element is a pure function of, and only of:
//!
//! - the call's `seed` and `offset` (a framework's generator gives both;
//!   consecutive calls advance the offset), the layer, the direction and
//!   which of the cell's masks it is: together they make one key
//!   ([`MaskStream::key`]);
//! - the sequence's index in the caller's batch, the step within that
//!   sequence and the unit: the counter ([`draw`]). A mask shared over time
//!   (variational dropout) is drawn at step [`SHARED`]; one shared over the
//!   batch and time too (DropConnect) at sequence [`SHARED`] as well.
//!
//! So masks do not depend on the batch's order, its alignment, padding or
//! packing, or how many threads run it. A unit is kept where its 24 high
//! bits are at least [`threshold`]`(rate)`: with probability `1 - rate`, to
//! within 2⁻²⁴, and with the same integer comparison on every device.

/// Philox4x32's round multipliers.
const MULTIPLIERS: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
/// Philox4x32's key schedule (the golden ratio and √3 - 1, in 32 bits).
const WEYL: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// The step or sequence index of a mask shared over steps or sequences.
pub const SHARED: u32 = u32::MAX;

/// Philox4x32-10: the four words of `counter` under `key`.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(WEYL[0]), k[1].wrapping_add(WEYL[1])];
        }
        let p0 = u64::from(MULTIPLIERS[0]) * u64::from(c[0]);
        let p1 = u64::from(MULTIPLIERS[1]) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// Which mask of which call: what selects its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MaskStream {
    /// The call's seed.
    pub seed: u64,
    /// The call's offset: a framework's generator advances it call by call.
    pub offset: u64,
    /// The layer, from 0.
    pub layer: u32,
    /// The direction: 0 forwards, 1 backwards in time.
    pub direction: u32,
    /// Which of the layer's masks (the cell's in declaration order, then the runtime's own).
    pub mask: u32,
}

impl MaskStream {
    /// The key of every element of this mask: Philox of `(offset, layer,
    /// direction and mask)` under the seed, so that two masks differing in
    /// any of them have unrelated keys.
    pub fn key(&self) -> [u32; 2] {
        let seed = [self.seed as u32, (self.seed >> 32) as u32];
        let which = (self.direction & 1) << 31 | (self.mask & 0x7FFF) << 16 | (self.layer & 0xFFFF);
        let words = philox4x32_10([self.offset as u32, (self.offset >> 32) as u32, which, 0], seed);
        [words[0], words[1]]
    }
}

/// The 32 random bits of `unit` of a mask keyed `key`, for the sequence
/// at index `sequence` of the caller's batch at its step `step` (either
/// [`SHARED`] for a shared mask). One Philox call gives four units.
pub fn draw(key: [u32; 2], sequence: u32, step: u32, unit: u32) -> u32 {
    philox4x32_10([unit / 4, step, sequence, 0], key)[(unit % 4) as usize]
}

/// The smallest 24-bit value a kept unit's bits (`bits >> 8`) reach at
/// drop `rate` (in `[0, 1)`): a unit is kept with probability `1 - rate`.
pub fn threshold(rate: f32) -> u32 {
    (f64::from(rate.clamp(0.0, 1.0)) * f64::from(1u32 << 24)).ceil() as u32
}

/// Whether bits `bits` keep their unit at `threshold`.
pub fn kept(bits: u32, threshold: u32) -> bool {
    bits >> 8 >= threshold
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known answers for Philox4x32-10 (its `kat_vectors`).
    #[test]
    fn philox_gives_random123s_known_answers() {
        let cases = [
            ([0, 0, 0, 0], [0, 0], [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]),
            ([u32::MAX; 4], [u32::MAX; 2], [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (counter, key, want) in cases {
            assert_eq!(philox4x32_10(counter, key), want, "counter {counter:x?} key {key:x?}");
        }
    }

    fn stream(offset: u64, layer: u32, direction: u32, mask: u32) -> [u32; 2] {
        MaskStream { seed: 0x5EED_0000_0000_0042, offset, layer, direction, mask }.key()
    }

    #[test]
    fn every_part_of_a_stream_selects_its_own_key() {
        let base = stream(7, 1, 0, 2);
        let others = [stream(8, 1, 0, 2), stream(7, 0, 0, 2), stream(7, 1, 1, 2), stream(7, 1, 0, 3)];
        for other in others {
            assert_ne!(base, other);
        }
        let reseeded = MaskStream { seed: 1, offset: 7, layer: 1, direction: 0, mask: 2 }.key();
        assert_ne!(base, reseeded);
        assert_eq!(base, stream(7, 1, 0, 2), "a pure function");
    }

    #[test]
    fn the_kept_fraction_is_one_minus_the_rate() {
        let key = stream(0, 0, 0, 0);
        let n = 200_000u32;
        for rate in [0.0f32, 0.1, 0.5, 0.9] {
            let t = threshold(rate);
            let kept_count = (0..n).filter(|&u| kept(draw(key, u % 97, u / 97, u % 131), t)).count();
            let p = 1.0 - f64::from(rate);
            let sigma = (p * (1.0 - p) / f64::from(n)).sqrt();
            let got = kept_count as f64 / f64::from(n);
            assert!(
                (got - p).abs() <= 5.0 * sigma + 1e-9,
                "rate {rate}: kept {got}, want {p} ± {}",
                5.0 * sigma
            );
        }
        assert_eq!(threshold(0.0), 0, "rate 0 keeps every unit");
    }

    /// The correlation of two bit sequences' uniforms over `n` draws.
    fn correlation(n: u32, a: impl Fn(u32) -> u32, b: impl Fn(u32) -> u32) -> f64 {
        let u = |x: u32| f64::from(x >> 8) / f64::from(1u32 << 24) - 0.5;
        let (mut ab, mut aa, mut bb) = (0.0, 0.0, 0.0);
        for i in 0..n {
            let (x, y) = (u(a(i)), u(b(i)));
            ab += x * y;
            aa += x * x;
            bb += y * y;
        }
        ab / (aa * bb).sqrt()
    }

    #[test]
    fn neighbouring_units_steps_sequences_and_calls_are_uncorrelated() {
        let n = 50_000u32;
        let bound = 5.0 / f64::from(n).sqrt();
        let key = stream(3, 0, 0, 0);
        let next_call = stream(4, 0, 0, 0);
        let pairs: [(&str, f64); 5] = [
            ("units", correlation(n, |i| draw(key, 0, 0, 2 * i), |i| draw(key, 0, 0, 2 * i + 1))),
            ("steps", correlation(n, |i| draw(key, 0, i, 5), |i| draw(key, 0, i + 1, 5))),
            ("sequences", correlation(n, |i| draw(key, i, 9, 5), |i| draw(key, i + 1, 9, 5))),
            ("calls", correlation(n, |i| draw(key, 1, 2, i), |i| draw(next_call, 1, 2, i))),
            ("shared and per step", correlation(n, |i| draw(key, i, SHARED, 3), |i| draw(key, i, 0, 3))),
        ];
        for (what, c) in pairs {
            assert!(c.abs() <= bound, "{what}: correlation {c:.5} beyond {bound:.5}");
        }
    }
}
