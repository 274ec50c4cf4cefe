//! The fuzzing loop: a seed gives a cell and a case; a failure is
//! confirmed (a cell with kinks — relu, abs, min, max — gets a second draw
//! of data, since f32 and f64 may fall on either side of a kink), then
//! shrunk to a small reproducer: the cell first, then the case, then the
//! cell again.

use crate::check::{check, Case, Check, Checks, Failure, Passed};
use cellc::fuzzgen::{self, CellSpec, Entropy};
use serde::{Deserialize, Serialize};

/// The cell a seed generates.
pub fn cell_of(seed: u64) -> CellSpec {
    fuzzgen::generate(&mut Entropy::seeded(seed), &format!("fuzz{seed}"))
}

/// The size variables of a generated cell, as the compiler lists them.
pub fn variables_of(spec: &CellSpec) -> Vec<String> {
    match cellc::compile("fuzz.cell", &spec.to_string()).module {
        Some(m) => m.cells.first().map(|c| c.sizes.clone()).unwrap_or_default(),
        None => spec.size_variables(),
    }
}

/// The case a seed runs its cell on (a stream of its own, so shrinking
/// the cell does not change the case).
pub fn case_of(seed: u64, variables: &[String]) -> Case {
    Case::random(&mut Entropy::seeded(seed ^ 0x6361_7365_7365_6564), variables)
}

/// A confirmed failure, shrunk.
#[derive(Clone, Debug)]
pub struct Found {
    pub seed: u64,
    pub failure: Failure,
    pub original: CellSpec,
    pub reduced: CellSpec,
    /// The (shrunk) case the reduced cell fails on.
    pub case: Case,
    /// The reduced cell's own failure.
    pub reduced_failure: Failure,
}

/// What one seed gave.
#[derive(Clone, Debug)]
pub enum Outcome {
    Passed(Passed),
    /// Failed on one draw of data but not on another, in a cell with kinks.
    Kink(Failure),
    Failed(Box<Found>),
}

/// Runs seed `seed` through `plan`; shrinks a failure with at most
/// `budget` tries per round.
pub fn run_seed(seed: u64, plan: &Checks, budget: usize) -> Outcome {
    let spec = cell_of(seed);
    let text = spec.to_string();
    let case = case_of(seed, &variables_of(&spec));
    let failure = match check(&text, &case, plan) {
        Ok(p) => return Outcome::Passed(p),
        Err(f) => f,
    };
    if spec.has_kinks() && failure.check != Check::Compile {
        let other = Case { seed: case.seed.wrapping_add(1), ..case.clone() };
        if check(&text, &other, &Checks::only(failure.check)).is_ok() {
            return Outcome::Kink(failure);
        }
    }
    let (reduced, case, reduced_failure) = reduce(&spec, &case, &failure, budget);
    Outcome::Failed(Box::new(Found { seed, failure, original: spec, reduced, case, reduced_failure }))
}

/// Shrinks a failing cell and case while the same check keeps failing.
pub fn reduce(spec: &CellSpec, case: &Case, failure: &Failure, budget: usize) -> (CellSpec, Case, Failure) {
    let plan = Checks::only(failure.check);
    let fails =
        |text: &str, case: &Case| matches!(check(text, case, &plan), Err(f) if f.check == failure.check);
    let spec = fuzzgen::shrink(spec, budget, &mut |c| fails(&c.to_string(), case));
    let mut case = case.clone();
    'smaller: loop {
        for c in case.smaller() {
            if fails(&spec.to_string(), &c) {
                case = c;
                continue 'smaller;
            }
        }
        break;
    }
    let spec = fuzzgen::shrink(&spec, budget, &mut |c| fails(&c.to_string(), &case));
    let last = check(&spec.to_string(), &case, &plan).err().unwrap_or_else(|| failure.clone());
    (spec, case, last)
}

/// What a reproducer file records besides the cell.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub seed: u64,
    pub check: Check,
    pub case: Case,
}

/// A reproducer: the reduced cell, headed by the failure and the case.
pub fn reproducer(found: &Found) -> String {
    let header = Header { seed: found.seed, check: found.reduced_failure.check, case: found.case.clone() };
    let json = serde_json::to_string(&header).unwrap_or_default();
    let message: String = found.reduced_failure.to_string().lines().map(|l| format!("// {l}\n")).collect();
    format!(
        "// Found by `cellc fuzz` (seed {}); reduced from a cell of {} lines.\n{message}// case: {json}\n{}",
        found.seed,
        found.original.to_string().lines().count(),
        found.reduced
    )
}

/// The header of a reproducer file (its `// case: ` line).
pub fn parse_header(text: &str) -> Option<Header> {
    text.lines().find_map(|l| l.strip_prefix("// case: ")).and_then(|json| serde_json::from_str(json).ok())
}
