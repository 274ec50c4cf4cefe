//! cellc: a compiler for fused recurrent-network cells.
//!
//! A `.cell` file describes one time step of one sequence. This crate reads
//! it and produces a checked graph IR per cell:
//!
//! ```text
//! .cell text -> tokens (logos) -> AST -> checked IR (petgraph) -> interpreter
//! ```
//!
//! ```
//! let source = "
//!     cell rnn {
//!         input x[I]
//!         state h[H]
//!         param w_ih[H, I], w_hh[H, H], b[H] = zeros
//!         h' = tanh(w_ih @ x + w_hh @ h + b)
//!         output h'
//!     }";
//! let module = cellc::compile("rnn.cell", source).into_result()?;
//! let cell = module.cell("rnn").expect("the file defines `rnn`");
//! let bound = cell.bind(&[("I".to_string(), 2), ("H".to_string(), 3)].into())?;
//! let params = vec![vec![0.1f64; 6], vec![0.2; 9], vec![0.0; 3]];
//! let step = bound.step(&[1.0, -1.0], &[vec![0.5; 3]], &params)?;
//! assert!((step.output[0] - (0.3f64).tanh()).abs() < 1e-12);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]

pub mod autodiff;
#[cfg(feature = "cranelift")]
pub mod clif;
pub mod cuda;
mod deep;
pub mod diag;
pub mod dims;
pub mod fuzzgen;
pub mod gradcheck;
pub mod interp;
pub mod ir;
pub mod kernel;
pub mod lower;
pub mod passes;
pub mod precision;
pub mod program;
pub mod random;
pub mod schedule;
pub mod shapes;
pub mod syntax;

pub use diag::{Diagnostic, Diagnostics, SourceMap};
pub use interp::{BoundCell, InterpError};
pub use ir::Cell;
pub use lower::Module;

/// The prelude: functions written in the language itself, visible to every cell.
pub const PRELUDE: &str = include_str!("../../cells/prelude.cell");

/// The name the prelude's spans are reported under.
pub const PRELUDE_NAME: &str = "<prelude>";

/// The outcome of compiling one file: the sources (to render diagnostics
/// against), every diagnostic, and the module when there were no errors.
#[derive(Debug)]
pub struct Compilation {
    /// The compiled file and the prelude, which the diagnostics' spans point into.
    pub sources: SourceMap,
    /// Every error and warning, in source order.
    pub diagnostics: Diagnostics,
    /// The compiled cells; `None` when there was any error.
    pub module: Option<Module>,
}

impl Compilation {
    /// The diagnostics as text (`file:line:col`, source line, underline).
    pub fn render(&self, color: bool) -> String {
        self.sources.render(&self.diagnostics, color)
    }

    /// The module, or the errors (typed, with the sources to render them against).
    pub fn into_result(self) -> Result<Module, CompileError> {
        match self.module {
            Some(m) => Ok(m),
            None => Err(CompileError {
                rendered: self.sources.render(&self.diagnostics, false),
                diagnostics: self.diagnostics,
                sources: self.sources,
            }),
        }
    }
}

/// A file that did not compile: its diagnostics, typed (each with its
/// spans), the sources they point into (so a caller can render them its
/// own way, e.g. in colour with [`SourceMap::render`]), and the plain
/// rendering.
#[derive(Debug, Clone)]
pub struct CompileError {
    /// The diagnostics rendered as plain text, without colour.
    pub rendered: String,
    /// The diagnostics, at least one of them an error.
    pub diagnostics: Diagnostics,
    /// The sources the diagnostics' spans point into.
    pub sources: SourceMap,
}

impl PartialEq for CompileError {
    /// The same diagnostics on the same text.
    fn eq(&self, other: &CompileError) -> bool {
        self.diagnostics == other.diagnostics && self.rendered == other.rendered
    }
}

impl std::fmt::Display for CompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.rendered.trim_end())
    }
}

impl std::error::Error for CompileError {}

/// Compiles `source` (named `name` in diagnostics) with the prelude.
pub fn compile(name: &str, source: &str) -> Compilation {
    let mut sources = SourceMap::new();
    let file = sources.add(name, source);
    let prelude_id = sources.add(PRELUDE_NAME, PRELUDE);
    let (ast, mut diagnostics) = syntax::parse(file, source);
    let (prelude, prelude_diags) = syntax::parse(prelude_id, PRELUDE);
    diagnostics.extend(prelude_diags);
    let (module, lower_diags) = lower::lower(&ast, Some(&prelude));
    diagnostics.extend(lower_diags);
    let diagnostics = diagnostics.sorted();
    let module = (!diagnostics.has_errors()).then_some(module);
    Compilation { sources, diagnostics, module }
}

/// Compiles a file's raw bytes: invalid UTF-8 is reported as a diagnostic.
pub fn compile_bytes(name: &str, bytes: &[u8]) -> Compilation {
    match std::str::from_utf8(bytes) {
        Ok(s) => compile(name, s),
        Err(e) => {
            let lossy = String::from_utf8_lossy(bytes).into_owned();
            let mut sources = SourceMap::new();
            let file = sources.add(name, lossy);
            let at = e.valid_up_to();
            let bad = bytes.get(at).copied().unwrap_or(0);
            // U+FFFD stands in for the bad bytes in the lossy text: 3 bytes long.
            let span = diag::Span::new(file, at..at + 3);
            let mut diagnostics = Diagnostics::default();
            diagnostics.push(
                Diagnostic::error(span, format!("file is not valid UTF-8 (byte 0x{bad:02x} at offset {at})"))
                    .with_label("invalid byte here")
                    .with_note(".cell files are UTF-8 text"),
            );
            Compilation { sources, diagnostics, module: None }
        }
    }
}
