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

#[derive(Subcommand, Debug)]
enum Command {
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
        /// Bind a size variable, e.g. -D H=256.
        #[arg(short = 'D', value_name = "NAME=VALUE", value_parser = parse_binding)]
        define: Vec<(String, usize)>,
    },
}

fn parse_binding(s: &str) -> Result<(String, usize), String> {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let color = match cli.color {
        Color::Always => true,
        Color::Never => false,
        Color::Auto => std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
    };
    let ok = match cli.command {
        Command::Check { files, define } => check(&files, &define, color),
        Command::Graph { file, cell, dot, define } => graph(&file, cell.as_deref(), dot, &define, color),
    };
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Reads and compiles one file; prints its diagnostics. `None` on errors.
fn compile_file(path: &Path, color: bool) -> Option<Compilation> {
    let name = path.display().to_string();
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: cannot read `{name}`: {e}");
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
    for (name, _) in define {
        if !module.cells.iter().any(|cell| cell.sizes.contains(name)) {
            eprintln!("warning: {file}: -D {name}: no cell uses a size variable `{name}`");
        }
    }
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

fn graph(path: &Path, only: Option<&str>, dot: bool, define: &[(String, usize)], color: bool) -> bool {
    let Some(c) = compile_file(path, color) else { return false };
    let file = path.display().to_string();
    if !bind_all(&c, define, &file) {
        return false;
    }
    let Some(module) = &c.module else { return false };
    let cells: Vec<&cellc::Cell> =
        module.cells.iter().filter(|cell| only.is_none_or(|n| cell.name == n)).collect();
    if cells.is_empty() {
        let d = match only {
            Some(n) => format!("{file} has no cell named `{n}`"),
            None => format!("{file} defines no cell"),
        };
        eprintln!("error: {d}");
        return false;
    }
    for (i, cell) in cells.iter().enumerate() {
        if i > 0 {
            println!();
        }
        if dot {
            print!("{}", cellc::ir::print::to_dot(cell));
        } else {
            print!("{}", cellc::ir::print::to_text(cell, Some(&c.sources)));
        }
    }
    true
}
