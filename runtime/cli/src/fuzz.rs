//! `cellc fuzz`: the differential fuzzer from the command line.
//!
//! - `cellc fuzz --seed N [--print]`: one seed's random cell, checked (or printed);
//! - `cellc fuzz --from A --count N`: a range of seeds;
//! - `cellc fuzz --time SECS`: seeds for as long as asked, in worker
//!   processes of `--batch` seeds each, so a crash costs one seed (it is
//!   reported as a failure) and memory stays bounded;
//! - `cellc fuzz --cell my.cell [--cases N]`: a cell of one's own on N random cases.
//!
//! Failures are shrunk to small reproducers, printed, and written into
//! `--out` (default `fuzz-found/`), ready to go into `tests/fuzz/`.

use cellc_difftest::fuzz::{self, Found};
use cellc_difftest::{BackendKind, Case, Checks, Outcome};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, clap::Args)]
pub struct FuzzArgs {
    /// One seed.
    #[arg(long, conflicts_with_all = ["from", "time", "cell"])]
    pub seed: Option<u64>,
    /// Print the seed's cell and case instead of checking it.
    #[arg(long, requires = "seed")]
    pub print: bool,
    /// The first seed of a range (default: 0, or the clock's with --time).
    #[arg(long)]
    pub from: Option<u64>,
    /// How many seeds.
    #[arg(long, default_value_t = 100)]
    pub count: u64,
    /// Run for this many seconds (in worker processes), however many seeds that takes.
    #[arg(long)]
    pub time: Option<u64>,
    /// Seeds per worker process with --time.
    #[arg(long, default_value_t = 200)]
    pub batch: u64,
    /// Check this .cell file (its first cell) instead of generated ones, on --cases random cases.
    #[arg(long, conflicts_with = "time")]
    pub cell: Option<PathBuf>,
    #[arg(long, default_value_t = 10)]
    pub cases: u64,
    /// Leave out the emulated CUDA device (the slowest check: g++ per cell).
    #[arg(long)]
    pub no_cuda: bool,
    /// Candidates tried per round of shrinking.
    #[arg(long, default_value_t = 300)]
    pub budget: usize,
    /// Where reproducers are written.
    #[arg(long, default_value = "fuzz-found")]
    pub out: PathBuf,
    /// Internal: run as a worker of `--time`, one result line per seed.
    #[arg(long, hide = true)]
    pub worker: bool,
}

/// Totals of a run.
#[derive(Debug, Default)]
struct Totals {
    cells: u64,
    passes: usize,
    kinks: u64,
    failures: Vec<(u64, String)>,
}

impl Totals {
    fn summary(&self, elapsed: Duration) -> String {
        format!(
            "{} cells, {} passes (forward and backward, every back end), {} kink flakes, {} failures, in {:.1} s",
            self.cells,
            self.passes,
            self.kinks,
            self.failures.len(),
            elapsed.as_secs_f64()
        )
    }
}

fn checks(args: &FuzzArgs) -> Checks {
    let mut plan = Checks::everything();
    if args.no_cuda {
        plan.backends.retain(|&b| !b.is_cuda());
    } else if !plan.backends.contains(&BackendKind::CudaEmulated) {
        eprintln!("warning: g++ not found: the CUDA kernels are not checked on the emulated device");
    }
    plan
}

pub fn fuzz(args: &FuzzArgs) -> Result<bool, String> {
    let plan = checks(args);
    if let Some(path) = &args.cell {
        return own_cell(path, args, &plan);
    }
    if let Some(seed) = args.seed {
        if args.print {
            let spec = fuzz::cell_of(seed);
            let case = fuzz::case_of(seed, &fuzz::variables_of(&spec));
            println!("// case: {}\n{spec}", serde_json::to_string(&case).unwrap_or_default());
            return Ok(true);
        }
        let mut totals = Totals::default();
        one_seed(seed, args, &plan, &mut totals)?;
        return Ok(totals.failures.is_empty());
    }
    let start = Instant::now();
    let mut totals = Totals::default();
    if let Some(secs) = args.time {
        let from = args.from.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() << 20)
        });
        workers(from, Duration::from_secs(secs), args, &mut totals)?;
    } else {
        let from = args.from.unwrap_or(0);
        for seed in from..from.saturating_add(args.count) {
            one_seed(seed, args, &plan, &mut totals)?;
            if args.worker {
                std::io::stdout().flush().map_err(|e| e.to_string())?;
            } else if totals.cells % 50 == 0 {
                eprintln!("{}", totals.summary(start.elapsed()));
            }
        }
    }
    if !args.worker {
        println!("{}", totals.summary(start.elapsed()));
        for (seed, path) in &totals.failures {
            println!("  seed {seed}: {path}");
        }
    }
    Ok(totals.failures.is_empty())
}

/// Runs one seed; a worker prints one line of result for its parent.
fn one_seed(seed: u64, args: &FuzzArgs, plan: &Checks, totals: &mut Totals) -> Result<(), String> {
    if args.worker {
        println!("start {seed}");
        std::io::stdout().flush().map_err(|e| e.to_string())?;
    }
    totals.cells += 1;
    match fuzz::run_seed(seed, plan, args.budget) {
        Outcome::Passed(p) => {
            totals.passes += p.passes;
            if args.worker {
                println!("pass {seed} {}", p.passes);
            } else if args.seed.is_some() {
                println!("seed {seed}: every check passed ({} passes)", p.passes);
            }
        }
        Outcome::Kink(f) => {
            totals.kinks += 1;
            if args.worker {
                println!("kink {seed}");
            } else {
                eprintln!("seed {seed}: not reproduced on other data (a kink): {f}");
            }
        }
        Outcome::Failed(found) => {
            let path = save(&found, &args.out)?;
            if args.worker {
                println!("fail {seed} {}", path.display());
            } else {
                eprintln!("seed {seed}: {}\n{}", found.failure, fuzz::reproducer(&found));
            }
            totals.failures.push((seed, path.display().to_string()));
        }
    }
    Ok(())
}

/// Writes a reproducer into `dir` (created if missing), atomically.
fn save(found: &Found, dir: &Path) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("seed-{}.cell", found.seed));
    cellc_runtime::write_atomically(&path, fuzz::reproducer(found).as_bytes()).map_err(|e| e.to_string())?;
    Ok(path)
}

/// Runs seeds from `from` in worker processes until `budget` is spent.
fn workers(from: u64, budget: Duration, args: &FuzzArgs, totals: &mut Totals) -> Result<(), String> {
    let start = Instant::now();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut next = from;
    eprintln!("fuzzing from seed {from} for {} s", budget.as_secs());
    while start.elapsed() < budget {
        let mut cmd = Command::new(&exe);
        cmd.args(["fuzz", "--worker", "--from", &next.to_string(), "--count", &args.batch.to_string()]);
        cmd.args(["--budget", &args.budget.to_string(), "--out"]).arg(&args.out);
        if args.no_cuda {
            cmd.arg("--no-cuda");
        }
        let mut child = cmd.stdout(Stdio::piped()).spawn().map_err(|e| format!("starting a worker: {e}"))?;
        let stdout = child.stdout.take().ok_or("a worker without output")?;
        let mut current = None;
        for line in BufReader::new(stdout).lines() {
            let line = line.map_err(|e| e.to_string())?;
            let words: Vec<&str> = line.split_whitespace().collect();
            let seed = words.get(1).and_then(|s| s.parse::<u64>().ok());
            match (words.first().copied(), seed) {
                (Some("start"), Some(s)) => current = Some(s),
                (Some("pass"), Some(_)) => {
                    totals.cells += 1;
                    totals.passes += words.get(2).and_then(|p| p.parse().ok()).unwrap_or(0);
                    current = None;
                }
                (Some("kink"), Some(_)) => {
                    totals.cells += 1;
                    totals.kinks += 1;
                    current = None;
                }
                (Some("fail"), Some(s)) => {
                    totals.cells += 1;
                    let path = words.get(2).copied().unwrap_or("?").to_string();
                    eprintln!("seed {s}: failure, reproducer in {path}");
                    totals.failures.push((s, path));
                    current = None;
                }
                _ => {}
            }
            if start.elapsed() >= budget {
                let _ = child.kill();
                break;
            }
        }
        let status = child.wait().map_err(|e| e.to_string())?;
        match current {
            // The worker died on this seed: a crash is a failure.
            Some(seed) if !status.success() && start.elapsed() < budget => {
                totals.cells += 1;
                let text = format!(
                    "// Seed {seed} crashed a worker ({status}); `cellc fuzz --seed {seed}` repeats it.\n{}",
                    fuzz::cell_of(seed)
                );
                std::fs::create_dir_all(&args.out).map_err(|e| e.to_string())?;
                let path = args.out.join(format!("seed-{seed}-crash.cell"));
                cellc_runtime::write_atomically(&path, text.as_bytes()).map_err(|e| e.to_string())?;
                eprintln!("seed {seed}: crashed the worker ({status}), cell in {}", path.display());
                totals.failures.push((seed, path.display().to_string()));
                next = seed + 1;
            }
            _ => next += args.batch,
        }
        eprintln!("{} (next seed {next})", totals.summary(start.elapsed()));
    }
    Ok(())
}

/// A user's cell on `--cases` random cases.
fn own_cell(path: &Path, args: &FuzzArgs, plan: &Checks) -> Result<bool, String> {
    let bytes = cellc_runtime::read_at_most(path, cellc_runtime::MOST_CELL_BYTES)
        .map_err(|e| format!("cannot read {e}"))?;
    let text =
        String::from_utf8(bytes).map_err(|_| format!("cannot read `{}`: not UTF-8 text", path.display()))?;
    let variables = match cellc::compile(&path.display().to_string(), &text).into_result() {
        Ok(m) => m
            .cells
            .first()
            .map(|c| c.sizes.clone())
            .ok_or_else(|| format!("{} defines no cell", path.display()))?,
        Err(e) => return Err(e.rendered),
    };
    let header = fuzz::parse_header(&text);
    let cases: Vec<Case> = match header {
        // A reproducer: its own case.
        Some(h) => vec![h.case],
        None => (0..args.cases).map(|k| fuzz::case_of(k, &variables)).collect(),
    };
    let mut ok = true;
    for (k, case) in cases.iter().enumerate() {
        match cellc_difftest::check(&text, case, plan) {
            Ok(p) => println!(
                "case {k}: ok ({} layers, lengths {:?}, {} passes)",
                p.layers, case.lengths, p.passes
            ),
            Err(f) => {
                ok = false;
                println!("case {k}: {f}\n  case: {}", serde_json::to_string(case).unwrap_or_default());
            }
        }
    }
    Ok(ok)
}
