//! The differential fuzzer's fixed seed set (see `cellc-difftest`): each
//! seed's random cell checked by gradcheck and run on every back end
//! against the interpreter; and every reproducer the fuzzer has found
//! (`tests/fuzz/*.cell`), run on everything.
//!
//! The emulated CUDA device builds each cell's kernels with g++, nine
//! tenths of a seed's time; it checks every third seed
//! (`CELLC_FUZZ_CUDA_EVERY=n`: every n-th), through its step loops and
//! step by step in turn; the other back ends every seed.

mod support;

use cellc_difftest::{check, fuzz, BackendKind, Checks, Outcome};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Seeds CI runs; `CELLC_FUZZ_SEEDS=a..b` runs others.
fn seeds() -> std::ops::Range<u64> {
    let parse = |s: &str| -> Option<std::ops::Range<u64>> {
        let (a, b) = s.split_once("..")?;
        Some(a.parse().ok()?..b.parse().ok()?)
    };
    std::env::var("CELLC_FUZZ_SEEDS").ok().and_then(|s| parse(&s)).unwrap_or(0..300)
}

/// Every how many seeds the emulated CUDA device checks one.
fn cuda_every() -> u64 {
    std::env::var("CELLC_FUZZ_CUDA_EVERY").ok().and_then(|s| s.parse().ok()).filter(|&n| n > 0).unwrap_or(3)
}

#[test]
fn fixed_seeds_pass_every_check() {
    let plan = Checks::everything();
    let without_cuda =
        plan.clone().without(BackendKind::CudaEmulated).without(BackendKind::CudaEmulatedSteps);
    // The CUDA seeds alternate between its two routes: step loops, then step by step.
    let step_loops = plan.clone().without(BackendKind::CudaEmulatedSteps);
    let step_by_step = plan.clone().without(BackendKind::CudaEmulated);
    let every = cuda_every();
    let plan_of = |seed: u64| match (seed.is_multiple_of(every), (seed / every).is_multiple_of(2)) {
        (false, _) => &without_cuda,
        (true, true) => &step_loops,
        (true, false) => &step_by_step,
    };
    let seeds: Vec<u64> = seeds().collect();
    // The seeds are independent: one worker per core, each taking the next seed.
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut outcomes: Vec<(u64, Outcome)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    while let Some(&seed) = seeds.get(next.fetch_add(1, Ordering::Relaxed)) {
                        mine.push((seed, fuzz::run_seed(seed, plan_of(seed), 200)));
                    }
                    mine
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("a fuzz worker panicked")).collect()
    });
    outcomes.sort_by_key(|(seed, _)| *seed);
    let (mut passes, mut kinks, mut failures) = (0, 0, Vec::new());
    for (seed, outcome) in &outcomes {
        match outcome {
            Outcome::Passed(p) => passes += p.passes,
            Outcome::Kink(f) => {
                kinks += 1;
                eprintln!("seed {seed}: not reproduced on other data (a kink): {f}");
            }
            Outcome::Failed(found) => {
                eprintln!("seed {seed}: {}\n{}", found.failure, fuzz::reproducer(found));
                failures.push(*seed);
            }
        }
    }
    support::report(&format!(
        "fuzzer: {} cells, {passes} passes on {} back ends, {kinks} kink flakes, failing seeds {failures:?}",
        outcomes.len(),
        plan.backends.len()
    ));
    assert!(failures.is_empty(), "failing seeds: {failures:?}");
}

#[test]
fn reproducers_pass_every_check() {
    let dir = support::root().join("tests/fuzz");
    let mut files: Vec<_> =
        std::fs::read_dir(&dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    files.retain(|p| p.extension().is_some_and(|e| e == "cell"));
    files.sort();
    for path in files {
        let text = std::fs::read_to_string(&path).expect("readable reproducer");
        let header =
            fuzz::parse_header(&text).unwrap_or_else(|| panic!("{}: no `// case:` line", path.display()));
        if let Err(f) = check(&text, &header.case, &Checks::everything()) {
            panic!("{}: {f}", path.display());
        }
    }
}
