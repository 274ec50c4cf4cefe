//! Diagnostics: what the compiler tells the user about their `.cell` files.
//!
//! Library code never prints. Every stage returns [`Diagnostic`]s that carry
//! byte spans into a [`SourceMap`]; only the edge (the CLI, the tests) renders
//! them, through `codespan-reporting`, as `file:line:col` headers with the
//! source line underlined. Keeping spans as plain `(file, start, end)` triples
//! lets the IR store them in a side table, as naga does.

use codespan_reporting::diagnostic::{Diagnostic as CsDiagnostic, Label as CsLabel, Severity as CsSeverity};
use codespan_reporting::files::SimpleFiles;
use codespan_reporting::term;
use std::fmt;
use std::ops::Range;

/// Index of a file in a [`SourceMap`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct FileId(pub u32);

/// A byte range in one source file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Span {
    /// The file the range lies in.
    pub file: FileId,
    /// Byte offset of the first byte.
    pub start: u32,
    /// Byte offset one past the last byte.
    pub end: u32,
}

impl Span {
    /// The span of byte range `range` of `file` (offsets past `u32::MAX` are clamped).
    pub fn new(file: FileId, range: Range<usize>) -> Span {
        let clamp = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        Span { file, start: clamp(range.start), end: clamp(range.end) }
    }

    /// The smallest span covering both (they must be in the same file).
    pub fn to(self, other: Span) -> Span {
        if self.file != other.file {
            return self;
        }
        Span { file: self.file, start: self.start.min(other.start), end: self.end.max(other.end) }
    }

    /// The span's bytes as a `usize` range, for slicing the source text.
    pub fn range(self) -> Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// How serious a [`Diagnostic`] is: an error stops compilation, a warning does not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Severity {
    /// Reported, but the file still compiles (e.g. an unused name).
    Warning,
    /// The file does not compile; no module is produced.
    Error,
}

/// A secondary span with its own message (`declared here`, `expected [H]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Label {
    /// The source range the label underlines.
    pub span: Span,
    /// Text shown next to the underline (may be empty).
    pub message: String,
}

/// One problem found in the user's source.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Diagnostic {
    /// Whether this is an error or a warning.
    pub severity: Severity,
    /// The headline, printed after `error:` or `warning:`.
    pub message: String,
    /// Where the problem is; its message is shown under the underline.
    pub primary: Label,
    /// Further spans with their own messages, e.g. where a name was declared.
    pub secondary: Vec<Label>,
    /// Free-text notes printed after the source snippet (`= note: ...`).
    pub notes: Vec<String>,
}

impl Diagnostic {
    /// An error at `span` with headline `message` and no label text yet.
    pub fn error(span: Span, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            severity: Severity::Error,
            message: message.into(),
            primary: Label { span, message: String::new() },
            secondary: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// A warning at `span` with headline `message` and no label text yet.
    pub fn warning(span: Span, message: impl Into<String>) -> Diagnostic {
        Diagnostic { severity: Severity::Warning, ..Diagnostic::error(span, message) }
    }

    /// Text shown under the primary underline.
    pub fn with_label(mut self, message: impl Into<String>) -> Diagnostic {
        self.primary.message = message.into();
        self
    }

    /// Adds a secondary label: `span` underlined with `message`.
    pub fn with_secondary(mut self, span: Span, message: impl Into<String>) -> Diagnostic {
        self.secondary.push(Label { span, message: message.into() });
        self
    }

    /// Adds a note printed after the source snippet.
    pub fn with_note(mut self, note: impl Into<String>) -> Diagnostic {
        self.notes.push(note.into());
        self
    }

    /// Whether the severity is [`Severity::Error`].
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

/// A list of diagnostics, as every stage returns them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl Diagnostics {
    /// Most errors a single file reports before the compiler stops listing them.
    pub const MAX_ERRORS: usize = 50;

    /// Appends `d`, unless an identical diagnostic is already listed or `d`
    /// is an error and [`Diagnostics::MAX_ERRORS`] errors already are.
    pub fn push(&mut self, d: Diagnostic) {
        if d.is_error() && self.error_count() >= Self::MAX_ERRORS {
            return;
        }
        if !self.0.contains(&d) {
            self.0.push(d);
        }
    }

    /// Appends every diagnostic of `other`, with the same rules as [`Diagnostics::push`].
    pub fn extend(&mut self, other: Diagnostics) {
        for d in other.0 {
            self.push(d);
        }
    }

    /// Whether any diagnostic is an error.
    pub fn has_errors(&self) -> bool {
        self.0.iter().any(Diagnostic::is_error)
    }

    /// Number of errors.
    pub fn error_count(&self) -> usize {
        self.0.iter().filter(|d| d.is_error()).count()
    }

    /// Number of warnings.
    pub fn warning_count(&self) -> usize {
        self.0.len() - self.error_count()
    }

    /// Whether there are no diagnostics at all.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The diagnostics, in list order.
    pub fn iter(&self) -> impl Iterator<Item = &Diagnostic> {
        self.0.iter()
    }

    /// Diagnostics in source order (errors and warnings interleaved), so
    /// that output reads top to bottom like the file.
    pub fn sorted(mut self) -> Diagnostics {
        self.0.sort_by_key(|d| (d.primary.span.file, d.primary.span.start, d.severity));
        self
    }
}

/// Source files known to one compilation: the user's file(s) and the prelude.
#[derive(Clone, Debug, Default)]
pub struct SourceMap {
    files: SimpleFiles<String, String>,
    count: u32,
}

impl SourceMap {
    /// An empty source map.
    pub fn new() -> SourceMap {
        SourceMap::default()
    }

    /// Adds a file with display name `name` and text `source`, and returns its id.
    pub fn add(&mut self, name: impl Into<String>, source: impl Into<String>) -> FileId {
        self.files.add(name.into(), source.into());
        self.count += 1;
        FileId(self.count - 1)
    }

    /// The text of `file` (empty for an unknown id).
    pub fn source(&self, file: FileId) -> &str {
        self.files.get(file.0 as usize).map(|f| f.source().as_str()).unwrap_or("")
    }

    /// The display name of `file` (`<unknown>` for an unknown id).
    pub fn name(&self, file: FileId) -> &str {
        self.files.get(file.0 as usize).map(|f| f.name().as_str()).unwrap_or("<unknown>")
    }

    /// 1-based line and column of a byte offset (the line by binary search
    /// over the file's line starts, so quoting every value stays linear).
    pub fn line_col(&self, file: FileId, offset: u32) -> (usize, usize) {
        use codespan_reporting::files::Files;
        let src = self.source(file);
        let offset = floor_char_boundary(src, (offset as usize).min(src.len()));
        let id = file.0 as usize;
        let line = self.files.line_index(id, offset).unwrap_or(0);
        let start = self.files.line_range(id, line).map_or(0, |r| r.start.min(offset));
        (line + 1, src[start..offset].chars().count() + 1)
    }

    /// The text of 1-based line `line` of `file`, without its line break.
    pub fn line_text(&self, file: FileId, line: usize) -> &str {
        use codespan_reporting::files::Files;
        let src = self.source(file);
        let range = self.files.line_range(file.0 as usize, line.saturating_sub(1)).unwrap_or(0..0);
        src.get(range).unwrap_or("").trim_end_matches(['\n', '\r'])
    }

    /// `file:line:col` of a span's start.
    pub fn location(&self, span: Span) -> String {
        let (line, col) = self.line_col(span.file, span.start);
        format!("{}:{}:{}", self.name(span.file), line, col)
    }

    /// Renders diagnostics as text, with colour when `color` is set.
    pub fn render(&self, diagnostics: &Diagnostics, color: bool) -> String {
        let mut out = Vec::new();
        {
            let mut writer: Box<dyn term::termcolor::WriteColor> = if color {
                Box::new(term::termcolor::Ansi::new(&mut out))
            } else {
                Box::new(term::termcolor::NoColor::new(&mut out))
            };
            let config = term::Config::default();
            for d in diagnostics.iter() {
                let cs = self.to_codespan(d);
                if term::emit_to_write_style(&mut writer, &config, &self.files, &cs).is_err() {
                    // A span outside its file can only come from a compiler bug;
                    // still say what the problem was rather than nothing.
                    let _ = writeln!(writer, "{}: {}", severity_word(d.severity), d.message);
                }
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    fn to_codespan(&self, d: &Diagnostic) -> CsDiagnostic<usize> {
        let severity = match d.severity {
            Severity::Error => CsSeverity::Error,
            Severity::Warning => CsSeverity::Warning,
        };
        let clamp = |s: Span| {
            let src = self.source(s.file);
            let start = floor_char_boundary(src, (s.start as usize).min(src.len()));
            let end = floor_char_boundary(src, (s.end as usize).min(src.len())).max(start);
            start..end
        };
        let mut labels = vec![CsLabel::primary(d.primary.span.file.0 as usize, clamp(d.primary.span))
            .with_message(&d.primary.message)];
        for l in &d.secondary {
            labels.push(CsLabel::secondary(l.span.file.0 as usize, clamp(l.span)).with_message(&l.message));
        }
        CsDiagnostic::new(severity).with_message(&d.message).with_labels(labels).with_notes(d.notes.clone())
    }
}

use std::io::Write as _;

fn severity_word(s: Severity) -> &'static str {
    match s {
        Severity::Error => "error",
        Severity::Warning => "warning",
    }
}

/// The largest char boundary not after `i` (str::floor_char_boundary is unstable).
fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(severity_word(*self))
    }
}
