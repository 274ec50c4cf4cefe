//! `cellc`, the command-line driver: reads files, calls the library,
//! renders diagnostics. The only place that prints.

use cellc::dims::Bindings;
use cellc::{Compilation, Diagnostics};
use clap::{Parser, Subcommand, ValueEnum};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(name = "cellc", version, about = "Compiler for fused recurrent-network cells")]
struct Cli {
    /// When to colour diagnostics.
    #[arg(long, value_enum, default_value_t = Color::Auto, global = true)]
    color: Color,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Color {
    Auto,
    Always,
    Never,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Stage {
    Checked,
    Forward,
    Backward,
    Schedule,
}

mod bench;
mod compile;
mod fuzz;
mod peak;
mod run;

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a model over a batch (safetensors in, safetensors out); --grad adds the backward.
    Run(run::RunArgs),
    /// Time a model on synthetic data (compilation reported apart).
    Bench(bench::BenchArgs),
    /// Measure this machine's arithmetic peak: every speed is a fraction of it.
    Peak(peak::PeakArgs),
    /// Write a cell's kernels for a target: CUDA C++, or PTX / SASS through NVRTC.
    Compile(compile::CompileArgs),
    /// Differential fuzzing: random cells (or your own) on every back end against the interpreter.
    Fuzz(fuzz::FuzzArgs),
    /// Check .cell files: exit 0 when clean (warnings allowed), 1 on errors.
    Check {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Bind a size variable, e.g. -D H=256 (checks the cell at those sizes).
        #[arg(short = 'D', value_name = "NAME=VALUE", value_parser = parse_binding)]
        define: Vec<(String, usize)>,
    },
    /// Print a cell's IR as text, or as Graphviz dot.
    Graph {
        file: PathBuf,
        /// Only this cell (default: every cell in the file).
        #[arg(long)]
        cell: Option<String>,
        /// Print Graphviz dot instead of text.
        #[arg(long)]
        dot: bool,
        /// Which form: the checked IR as lowered, the simplified forward
        /// step, the derived backward step, or the schedule.
        #[arg(long, value_enum, default_value_t = Stage::Checked)]
        stage: Stage,
        /// Bind a size variable, e.g. -D H=256.
        #[arg(short = 'D', value_name = "NAME=VALUE", value_parser = parse_binding)]
        define: Vec<(String, usize)>,
    },
    /// Where CUDA's libraries were found, and the GPUs the driver sees: exit 1 when none can run.
    Devices,
    /// Check the derived backward step against finite differences (f64, interpreter).
    Gradcheck {
        file: PathBuf,
        /// Only this cell (default: every cell in the file).
        #[arg(long)]
        cell: Option<String>,
        /// Bind a size variable; unbound ones get small defaults.
        #[arg(short = 'D', value_name = "NAME=VALUE", value_parser = parse_binding)]
        define: Vec<(String, usize)>,
        /// Sequence length (at least 5).
        #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(5..=1000))]
        steps: u64,
        /// Seed of the random inputs, weights and initial states.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Largest allowed |analytic - numeric| / max(1, |numeric|).
        #[arg(long, default_value_t = 1e-6)]
        tolerance: f64,
    },
}

/// `NAME=RATE`: one of a cell's rates (checked against the cell when the model is made).
pub(crate) fn parse_rate(s: &str) -> Result<(String, f32), String> {
    let (name, value) = s.split_once('=').ok_or_else(|| format!("expected NAME=RATE, found `{s}`"))?;
    let name = name.trim();
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!("`{name}` is not a rate name"));
    }
    let v: f32 =
        value.trim().parse().map_err(|_| format!("rate `{name}` must be a number, found `{value}`"))?;
    Ok((name.to_string(), v))
}

pub(crate) fn parse_binding(s: &str) -> Result<(String, usize), String> {
    let (name, value) = s.split_once('=').ok_or_else(|| format!("expected NAME=VALUE, found `{s}`"))?;
    let name = name.trim();
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!("`{name}` is not a size variable name"));
    }
    let v: usize = value
        .trim()
        .parse()
        .map_err(|_| format!("size `{name}` must be a positive whole number, found `{value}`"))?;
    if v == 0 {
        return Err(format!("size `{name}` must be at least 1"));
    }
    Ok((name.to_string(), v))
}

impl Command {
    /// The command's `-D` bindings, for those that take them.
    fn defines(&self) -> &[(String, usize)] {
        match self {
            Command::Check { define, .. }
            | Command::Graph { define, .. }
            | Command::Gradcheck { define, .. } => define,
            Command::Run(args) => &args.define,
            Command::Bench(args) => &args.define,
            Command::Compile(args) => &args.define,
            Command::Fuzz(_) | Command::Peak(_) | Command::Devices => &[],
        }
    }
}

/// A size bound twice (`-D H=4 -D H=5`) is an error, not last-wins.
fn reject_duplicate_defines(define: &[(String, usize)]) -> Result<(), String> {
    for (i, (name, value)) in define.iter().enumerate() {
        if let Some((_, first)) = define[..i].iter().find(|(n, _)| n == name) {
            return Err(format!("-D {name} is given twice ({name}={first} and {name}={value})"));
        }
    }
    Ok(())
}

/// Warns about every `-D` name that none of `cells` uses, naming the sizes
/// they do have. The same warning in every subcommand.
pub(crate) fn warn_unused_defines(define: &[(String, usize)], cells: &[&cellc::Cell], file: &str) {
    let sizes_of = |cell: &cellc::Cell| {
        if cell.sizes.is_empty() {
            "no size variables".to_string()
        } else {
            cell.sizes.join(", ")
        }
    };
    for (name, value) in define {
        if cells.iter().any(|cell| cell.sizes.contains(name)) {
            continue;
        }
        let what = match cells {
            [cell] => {
                format!("cell `{}` has no size variable `{name}` (its sizes: {})", cell.name, sizes_of(cell))
            }
            _ => {
                let each: Vec<String> =
                    cells.iter().map(|cell| format!("`{}`: {}", cell.name, sizes_of(cell))).collect();
                format!("no cell has a size variable `{name}` (sizes of {})", each.join("; "))
            }
        };
        eprintln!("warning: {file}: -D {name}={value} is not used: {what}");
    }
}

/// Refuses an output path that names one of the command's own input files
/// (a typo that would destroy the input it reads).
pub(crate) fn refuse_overwriting_inputs(out: &Path, inputs: &[&Path]) -> Result<(), String> {
    let Ok(out_real) = out.canonicalize() else { return Ok(()) }; // does not exist yet
    for input in inputs {
        if input.canonicalize().is_ok_and(|i| i == out_real) {
            return Err(format!(
                "`{}` is also this command's input `{}`: writing it would destroy the input",
                out.display(),
                input.display()
            ));
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    // Output piped into a reader that stops early (`cellc devices | head`)
    // ends the process quietly, as other command-line tools do, instead of
    // a panic at the next print (Rust ignores SIGPIPE by default).
    #[cfg(unix)]
    // SAFETY: restores the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    if let Err(message) = reject_duplicate_defines(cli.command.defines()) {
        eprintln!("error: {message}");
        return ExitCode::FAILURE;
    }
    let color = match cli.color {
        Color::Always => true,
        Color::Never => false,
        Color::Auto => std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
    };
    let ok = match cli.command {
        Command::Check { files, define } => check(&files, &define, color),
        Command::Graph { file, cell, dot, stage, define } => {
            graph(&file, cell.as_deref(), dot, stage, &define, color)
        }
        Command::Bench(args) => match bench::bench(&args) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("error: {e}");
                false
            }
        },
        Command::Peak(args) => match peak::peak(&args) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("error: {e}");
                false
            }
        },
        Command::Compile(args) => compile::compile(&args, color),
        Command::Fuzz(args) => match fuzz::fuzz(&args) {
            Ok(ok) => ok,
            Err(e) => {
                eprintln!("error: {e}");
                false
            }
        },
        Command::Run(args) => match run::run(&args) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("error: {e}");
                false
            }
        },
        Command::Devices => devices(),
        Command::Gradcheck { file, cell, define, steps, seed, tolerance } => {
            let opts =
                cellc::gradcheck::Options { steps: steps as usize, seed, tolerance, ..Default::default() };
            gradcheck(&file, cell.as_deref(), &define, &opts, color)
        }
    };
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `cellc devices`: each CUDA library's place (or every place searched),
/// NVRTC's version, and each device the driver sees, opened as the CUDA
/// back end opens it.
fn devices() -> bool {
    use cellc_runtime::backend::cuda::{self, libraries, nvrtc};
    for library in libraries::Library::ALL {
        match libraries::load(library) {
            Ok(found) => println!("{}: {} ({:?})", library.describe(), found.path, found.place),
            Err(missing) => println!("{missing}"),
        }
    }
    if let Ok((major, minor)) = nvrtc::version() {
        println!("NVRTC version: {major}.{minor}");
    }
    let count = match cuda::device_count() {
        Ok(n) => n,
        Err(e) => {
            println!("no GPU: {e}");
            return false;
        }
    };
    println!("devices: {count}");
    let mut usable = 0;
    for ordinal in 0..count {
        match cuda::Cuda::gpu(ordinal) {
            Ok(device) => {
                usable += 1;
                println!("device {ordinal}: {}", device.device_name());
            }
            Err(e) => println!("device {ordinal}: cannot be used: {e}"),
        }
    }
    usable > 0
}

/// A checked cell's steps ([`cellc::program::Steps::compile`]); failures
/// (compiler bugs) are printed.
pub(crate) fn steps_or_report(cell: &cellc::Cell) -> Option<cellc::program::Steps> {
    match cellc::program::Steps::compile(cell) {
        Ok(steps) => Some(steps),
        Err(errors) => {
            for e in errors {
                eprintln!("error: internal compiler error in cell `{}`: {e}", cell.name);
            }
            None
        }
    }
}

/// Reads and compiles one file; prints its diagnostics. `None` on errors.
fn compile_file(path: &Path, color: bool) -> Option<Compilation> {
    let name = path.display().to_string();
    let bytes = match cellc_runtime::read_at_most(path, cellc_runtime::MOST_CELL_BYTES) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: cannot read {e}");
            return None;
        }
    };
    let c = cellc::compile_bytes(&name, &bytes);
    eprint!("{}", c.render(color));
    Some(c)
}

/// Binds every cell of the module to `define`, reporting unbound or unusable sizes.
fn bind_all(c: &Compilation, define: &[(String, usize)], file: &str) -> bool {
    let Some(module) = &c.module else { return false };
    let bindings: Bindings = define.iter().cloned().collect();
    let mut ok = true;
    warn_unused_defines(define, &module.cells.iter().collect::<Vec<_>>(), file);
    for cell in &module.cells {
        let unbound: Vec<&String> = cell.sizes.iter().filter(|s| !bindings.contains_key(*s)).collect();
        if !unbound.is_empty() {
            continue; // symbolic check only
        }
        if let Err(e) = cell.bind(&bindings).and_then(|b| b.param_inits().map(|_| ())) {
            eprintln!("error: {file}: cell `{}`: {e}", cell.name);
            ok = false;
        }
    }
    ok
}

fn check(files: &[PathBuf], define: &[(String, usize)], color: bool) -> bool {
    let mut all_ok = true;
    for path in files {
        let Some(c) = compile_file(path, color) else {
            all_ok = false;
            continue;
        };
        let file = path.display().to_string();
        let ok = c.module.is_some() && bind_all(&c, define, &file);
        all_ok &= ok;
        let summary = summary(&c.diagnostics);
        match (&c.module, ok) {
            (Some(m), true) => {
                let cells: Vec<String> = m.cells.iter().map(describe_cell).collect();
                let what = if cells.is_empty() { "no cells".to_string() } else { cells.join("; ") };
                println!("{file}: ok{summary}: {what}");
            }
            _ => println!("{file}: failed{summary}"),
        }
    }
    all_ok
}

fn describe_cell(cell: &cellc::Cell) -> String {
    let states: Vec<String> = cell.states.iter().map(|s| format!("{}[{}]", s.name, s.dim)).collect();
    format!(
        "cell {} (input [{}], states {}, output [{}], {} params, {} values)",
        cell.name,
        cell.input_dim(),
        if states.is_empty() { "none".into() } else { states.join(" ") },
        cell.output_dim(),
        cell.params.len(),
        cell.value_count()
    )
}

fn summary(d: &Diagnostics) -> String {
    let (e, w) = (d.error_count(), d.warning_count());
    let plural = |n: usize, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
    match (e, w) {
        (0, 0) => String::new(),
        (0, w) => format!(" ({})", plural(w, "warning")),
        (e, 0) => format!(" ({})", plural(e, "error")),
        (e, w) => format!(" ({}, {})", plural(e, "error"), plural(w, "warning")),
    }
}

/// The module's cells, or only the one named; an error if none match.
fn select_cells<'m>(
    module: &'m cellc::Module,
    only: Option<&str>,
    file: &str,
) -> Option<Vec<&'m cellc::Cell>> {
    let cells: Vec<&cellc::Cell> =
        module.cells.iter().filter(|cell| only.is_none_or(|n| cell.name == n)).collect();
    if cells.is_empty() {
        match only {
            Some(n) => eprintln!("error: {file} has no cell named `{n}`"),
            None => eprintln!("error: {file} defines no cell"),
        }
        return None;
    }
    Some(cells)
}

fn gradcheck(
    path: &Path,
    only: Option<&str>,
    define: &[(String, usize)],
    opts: &cellc::gradcheck::Options,
    color: bool,
) -> bool {
    let Some(c) = compile_file(path, color) else { return false };
    let file = path.display().to_string();
    let Some(module) = &c.module else { return false };
    if !bind_all(&c, define, &file) {
        return false;
    }
    let Some(cells) = select_cells(module, only, &file) else { return false };
    let given: Bindings = define.iter().cloned().collect();
    let mut ok = true;
    for cell in cells {
        let report = match cellc::gradcheck::gradcheck(cell, &given, opts) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: cell `{}`: {e}", cell.name);
                ok = false;
                continue;
            }
        };
        let sizes: Vec<String> = report.sizes.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "gradcheck {} ({}, {} steps, f64, eps {:e})",
            cell.name,
            sizes.join(" "),
            report.steps,
            opts.eps
        );
        for t in &report.tensors {
            let mark = if t.error <= report.tolerance { "ok  " } else { "FAIL" };
            let kinks = match t.kinks {
                0 => String::new(),
                n => format!("; {n} at a kink or a tie, unchecked"),
            };
            println!(
                "  {mark} {:<28} {:>6} elements   max error {:.2e}   (element {}: analytic {:+.9e}, numeric {:+.9e}{kinks})",
                t.tensor, t.elements, t.error, t.worst_index, t.analytic, t.numeric
            );
        }
        if report.passed() {
            println!("  passed: every gradient within {:e}", report.tolerance);
        } else if let Some(w) = report.worst() {
            eprintln!(
                "error: cell `{}`: gradient of {} element {} is {:+.9e}, finite differences give {:+.9e} (error {:.2e} > {:e})",
                cell.name, w.tensor, w.worst_index, w.analytic, w.numeric, w.error, report.tolerance
            );
            ok = false;
        }
    }
    ok
}

fn graph(
    path: &Path,
    only: Option<&str>,
    dot: bool,
    stage: Stage,
    define: &[(String, usize)],
    color: bool,
) -> bool {
    let Some(c) = compile_file(path, color) else { return false };
    let file = path.display().to_string();
    if !bind_all(&c, define, &file) {
        return false;
    }
    let Some(module) = &c.module else { return false };
    let Some(cells) = select_cells(module, only, &file) else { return false };
    for (i, cell) in cells.iter().enumerate() {
        if i > 0 {
            println!();
        }
        let steps = match stage {
            Stage::Checked => None,
            _ => match steps_or_report(cell) {
                Some(steps) => Some(steps),
                None => return false,
            },
        };
        let text = match (&steps, stage, dot) {
            (None, _, true) => cellc::ir::print::to_dot(cell),
            (None, _, false) => cellc::ir::print::to_text(cell, Some(&c.sources)),
            (Some(s), Stage::Forward, true) => cellc::ir::print::to_dot(&s.forward),
            (Some(s), Stage::Forward, false) => cellc::ir::print::to_text(&s.forward, Some(&c.sources)),
            (Some(s), Stage::Backward, _) => {
                cellc::ir::print::gradient_to_text(&s.forward, &s.backward, Some(&c.sources))
            }
            (Some(s), _, _) => {
                let sizes: Bindings = define.iter().cloned().collect();
                let mut text = cellc::schedule::to_text(&s.forward, &s.backward, &s.schedule(&sizes), &sizes);
                // With every size bound, the tape a training forward keeps.
                if cell.sizes.iter().all(|n| sizes.contains_key(n)) {
                    if let Ok(program) = s.program(&sizes) {
                        let states: Vec<&str> = s.forward.states.iter().map(|d| d.name.as_str()).collect();
                        text += "\n";
                        text += &program.tape().to_text(&states);
                    }
                }
                text
            }
        };
        print!("{text}");
    }
    true
}
