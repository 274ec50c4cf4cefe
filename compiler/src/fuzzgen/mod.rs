//! Random valid cells for differential testing, after Cranelift's
//! `fuzzgen`: a generator that writes cells covering the language
//! ([`generate`]), and a shrinker that reduces a failing one to a small
//! reproducer ([`shrink`]).
//!
//! The generator draws every decision from an [`Entropy`]: a seed (for
//! fixed test sets and long runs) or the bytes a coverage-guided fuzzer
//! mutates (so a mutation of the bytes is a mutation of the cell). Running
//! the cells and comparing back ends is the runtime's business
//! (`cellc-difftest`); this module only writes `.cell` text.
//!
//! ```
//! use cellc::fuzzgen::{generate, Entropy};
//! let spec = generate(&mut Entropy::seeded(7), "fuzz7");
//! let compiled = cellc::compile("fuzz7.cell", &spec.to_string());
//! assert_eq!(compiled.diagnostics.error_count(), 0);
//! ```

mod generate;
mod shrink;
pub mod spec;

pub use generate::generate;
pub use shrink::{candidates, shrink};
pub use spec::CellSpec;

/// Where the generator's decisions come from.
#[derive(Clone, Debug)]
pub enum Entropy<'a> {
    /// SplitMix64 from a seed.
    Seeded(u64),
    /// A fuzzer's bytes, read in order; zeros once they run out (so a
    /// short input gives a small cell).
    Bytes(&'a [u8]),
}

impl Entropy<'_> {
    /// Entropy from SplitMix64 seeded with `seed`: the same seed gives the same cell.
    pub fn seeded(seed: u64) -> Entropy<'static> {
        Entropy::Seeded(seed)
    }

    /// The next draw: a SplitMix64 output, or the next two bytes big-endian
    /// (one at the very end, 0 once the bytes run out).
    pub fn next_u64(&mut self) -> u64 {
        match self {
            Entropy::Seeded(state) => {
                *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = *state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^ (z >> 31)
            }
            Entropy::Bytes(bytes) => {
                let n = bytes.len().min(2);
                let (head, rest) = bytes.split_at(n);
                *bytes = rest;
                head.iter().fold(0u64, |acc, &b| acc << 8 | b as u64)
            }
        }
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n <= 1 {
            return 0;
        }
        (self.next_u64() % n as u64) as usize
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }

    /// One element of a non-empty slice.
    pub fn pick<'s, T>(&mut self, items: &'s [T]) -> &'s T {
        &items[self.below(items.len())]
    }

    /// Shuffles `items` in place (Fisher–Yates, drawing from `self`).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::spec::Expr;
    use super::*;

    #[test]
    fn generated_cells_compile_and_cover_the_language() {
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..300 {
            let spec = generate(&mut Entropy::seeded(seed), &format!("c{seed}"));
            let text = spec.to_string();
            let compiled = crate::compile("c.cell", &text);
            assert_eq!(
                compiled.diagnostics.error_count(),
                0,
                "seed {seed}:\n{text}\n{}",
                compiled.render(false)
            );
            for word in [
                "chunk(",
                "concat(",
                "sigmoid(",
                "tanh(",
                "relu(",
                "exp(",
                "log(",
                "sqrt(",
                "rsqrt(",
                "abs(",
                "softplus(",
                "silu(",
                "min(",
                "max(",
                "sum(",
                "mean(",
                "layernorm(",
                "const ",
                "fn ",
                "zeros",
                "ones",
                "uniform(",
                "constant(",
                " / ",
                " - ",
                "(-",
                "' = ",
                "rate ",
                "dropout(",
                "variational_dropout(",
                "zoneout(",
                "dropconnect(",
                "where(",
                "logsigmoid(",
                "stop_gradient(",
                " < ",
                " <= ",
                " > ",
                " >= ",
                " == ",
                " != ",
                "transpose(",
                // `v @ W` (a vector is never named `w...`).
                " @ w",
            ] {
                if text.contains(word) {
                    seen.insert(word);
                }
            }
            // A block-diagonal parameter `[k, m, n]` of 2 or 3 heads.
            if text.contains("[2, ") || text.contains("[3, ") {
                seen.insert("heads");
            }
        }
        assert_eq!(seen.len(), 44, "{seen:?}");
    }

    #[test]
    fn about_three_cells_in_ten_have_masks_and_their_parameters_stay_masked() {
        let mut masked = 0;
        for seed in 0..300 {
            let spec = generate(&mut Entropy::seeded(seed), &format!("c{seed}"));
            if spec.rates.is_empty() {
                continue;
            }
            masked += 1;
            let compiled = crate::compile("c.cell", &spec.to_string());
            let module = compiled.module.as_ref().expect("compiles");
            assert!(!module.cells[0].masks.is_empty(), "seed {seed}: rates but no masks\n{spec}");
            // A parameter given to `dropconnect` is applied through it only (and never given to a function).
            for (param, _) in spec.dropconnected() {
                let plain = spec.stmt_values().flat_map(Expr::nodes).any(|e| match e {
                    Expr::MatVec(w, _) | Expr::Name(w) => *w == param,
                    _ => false,
                });
                assert!(!plain, "seed {seed}: `{param}` read without its mask\n{spec}");
            }
        }
        assert!((60..=120).contains(&masked), "{masked} of 300 cells have masks");
    }

    #[test]
    fn bytes_drive_the_generator_and_run_out_gracefully() {
        for bytes in [&[][..], &[1, 2, 3], &[255; 64]] {
            let spec = generate(&mut Entropy::Bytes(bytes), "b");
            let compiled = crate::compile("b.cell", &spec.to_string());
            assert_eq!(compiled.diagnostics.error_count(), 0, "{spec}");
        }
    }
}
