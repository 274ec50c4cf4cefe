//! Fuzz target: the differential fuzzer driven by libFuzzer. The input's
//! bytes are the generator's decisions (`Entropy::Bytes`), so libFuzzer's
//! mutations are mutations of a valid random cell, and its coverage
//! feedback steers them into the compiler's and back ends' less-visited
//! paths. Each cell runs through every check of `cellc-difftest`
//! (gradcheck; reference, CPU JIT, interpreted and linked kernels, and the
//! emulated CUDA device where g++ is installed, against the interpreter);
//! a failed check is a crash, reported with the cell and its case.
//!
//! Run: `cd runtime/difftest && RUSTC_BOOTSTRAP=1 cargo fuzz run cells -- -max_total_time=3600`.
//! `cellc fuzz --time 3600` does the same over seeds, and shrinks what it finds.

#![no_main]

use cellc::fuzzgen::{generate, Entropy};
use cellc_difftest::{check, Case, Checks};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fuzz_target!(|data: &[u8]| {
    static CHECKS: OnceLock<Checks> = OnceLock::new();
    let plan = CHECKS.get_or_init(Checks::everything);
    // The first bytes choose the case, the rest the cell.
    let (head, rest) = data.split_at(data.len().min(16));
    let spec = generate(&mut Entropy::Bytes(rest), "fuzz");
    let text = spec.to_string();
    let variables = cellc_difftest::fuzz::variables_of(&spec);
    let case = Case::random(&mut Entropy::Bytes(head), &variables);
    if let Err(f) = check(&text, &case, plan) {
        // Kinks (relu, abs, min, max) may fall either side in f32 and f64:
        // only a failure that another draw of data repeats is a bug.
        let other = Case { seed: case.seed.wrapping_add(1), ..case.clone() };
        if spec.has_kinks() && check(&text, &other, &Checks::only(f.check)).is_ok() {
            return;
        }
        panic!("{f}\ncase: {}\n{text}", serde_json::to_string(&case).unwrap_or_default());
    }
});
