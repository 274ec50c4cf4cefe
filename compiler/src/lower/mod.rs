//! Lowering: the AST of a file to one checked [`ir::Cell`] per `cell`.
//!
//! This is where the language's rules are enforced: names resolve, `fn`s
//! are inlined (recursion is an error), `const`s are substituted, `chunk`
//! and `concat` become slices and joins, scalars are broadcast explicitly,
//! and every dimension is checked symbolically ([`Dim`]). Errors carry
//! source spans and are all collected, so one run reports every problem in
//! a file; a part that failed yields no value and is skipped silently
//! downstream, so one mistake gives one message. An error inside a function
//! from another file (the prelude) is reported at the call in the user's
//! file, where it can be fixed.

mod decls;
mod expr;
mod masks;
mod names;

use crate::diag::{Diagnostic, Diagnostics, Label, Span};
use crate::dims::Dim;
use crate::ir::{self, Type, ValueId};
use crate::syntax::ast;
use std::collections::HashMap;

/// The checked cells of one file.
#[derive(Clone, Debug, Default)]
pub struct Module {
    /// The file's cells, in source order.
    pub cells: Vec<ir::Cell>,
}

impl Module {
    /// The cell called `name`, if the file defines one.
    pub fn cell(&self, name: &str) -> Option<&ir::Cell> {
        self.cells.iter().find(|c| c.name == name)
    }
}

/// Largest graph a cell may grow to while inlining functions.
const MAX_VALUES: usize = 100_000;
/// Deepest chain of function calls being inlined.
const MAX_CALL_DEPTH: usize = 64;

/// Built-ins the front end lowers itself rather than naming an op of
/// theirs: `chunk` and `concat` (which shape vectors), `where` (a select
/// of three operands), and `logsigmoid` (`-softplus(-x)`, as stable as
/// softplus).
const LOWERED_BUILTINS: [&str; 5] = ["chunk", "concat", "where", "logsigmoid", "transpose"];

/// Every built-in function name (which no `fn` may take): the ops' own
/// lists, so a new op's name is reserved the moment it is added.
pub(crate) fn builtin_names<'a>() -> impl Iterator<Item = &'a str> {
    ir::UnaryOp::BUILTINS
        .iter()
        .map(|op| op.name())
        .chain(ir::BinaryOp::BUILTINS.iter().map(|op| op.name()))
        .chain(ir::ReduceOp::ALL.iter().map(|op| op.name()))
        .chain(ir::MaskFn::ALL.iter().map(|f| f.name()))
        .chain(LOWERED_BUILTINS)
}

fn is_builtin(name: &str) -> bool {
    builtin_names().any(|b| b == name)
}

/// Lowers every cell of `file`. `prelude` supplies functions (and
/// constants) visible to every cell; the file's own definitions take
/// precedence over the prelude's.
pub fn lower(file: &ast::File, prelude: Option<&ast::File>) -> (Module, Diagnostics) {
    let mut diags = Diagnostics::default();
    let globals = Globals::collect(file, prelude, &mut diags);
    let mut module = Module::default();
    let mut cell_names: HashMap<&str, Span> = HashMap::new();
    // A mistake in a function body is met at every call; report it once.
    let mut seen: std::collections::HashSet<(Span, String)> = Default::default();
    for item in &file.items {
        let ast::Item::Cell(def) = item else { continue };
        if let Some(first) = cell_names.insert(&def.name.name, def.name.span) {
            diags.push(
                Diagnostic::error(def.name.span, format!("cell `{}` is defined twice", def.name.name))
                    .with_secondary(first, "first defined here"),
            );
            continue;
        }
        let mut lowerer = CellLowerer::new(&globals, def);
        let ok = lowerer.run(def);
        for d in std::mem::take(&mut lowerer.diags).0 {
            if seen.insert((d.primary.span, d.message.clone())) {
                diags.push(d);
            }
        }
        if ok {
            let mut cell = lowerer.cell;
            cell.remove_dead_values();
            if let Err(errors) = ir::verify::verify(&cell) {
                for e in errors {
                    diags.push(
                        Diagnostic::error(def.name.span, format!("internal compiler error: {e}"))
                            .with_note("this is a bug in cellc; please report it with this file"),
                    );
                }
                continue;
            }
            module.cells.push(cell);
        }
    }
    names::warn_unused_items(file, &globals, &mut diags);
    (module, diags)
}

/// File-level definitions: constants and functions.
pub(crate) struct Globals<'a> {
    consts: HashMap<&'a str, &'a ast::ConstDef>,
    fns: HashMap<&'a str, &'a ast::FnDef>,
    /// Names of the file's cells (for messages: a cell is not a value).
    cells: Vec<&'a str>,
    /// Names of constants and functions some cell or function used.
    used: std::cell::RefCell<std::collections::HashSet<String>>,
}

impl<'a> Globals<'a> {
    fn collect(file: &'a ast::File, prelude: Option<&'a ast::File>, diags: &mut Diagnostics) -> Globals<'a> {
        let mut g = Globals {
            consts: HashMap::new(),
            fns: HashMap::new(),
            cells: Vec::new(),
            used: Default::default(),
        };
        if let Some(p) = prelude {
            for item in &p.items {
                g.define(item);
            }
        }
        let mut own: HashMap<&str, Span> = HashMap::new();
        for item in &file.items {
            let (name, span) = match item {
                ast::Item::Fn(f) => (&f.name, f.name.span),
                ast::Item::Const(c) => (&c.name, c.name.span),
                ast::Item::Cell(c) => {
                    g.cells.push(&c.name.name);
                    continue;
                }
            };
            if is_builtin(&name.name) {
                diags.push(
                    Diagnostic::error(
                        span,
                        format!("`{}` is a built-in function and cannot be redefined", name.name),
                    )
                    .with_label("choose another name"),
                );
                continue;
            }
            if let Some(first) = own.insert(&name.name, span) {
                diags.push(
                    Diagnostic::error(span, format!("`{}` is defined twice", name.name))
                        .with_secondary(first, "first defined here"),
                );
                continue;
            }
            g.define(item);
        }
        g
    }

    /// Makes a function or constant visible (a later definition wins).
    fn define(&mut self, item: &'a ast::Item) {
        match item {
            ast::Item::Fn(f) => {
                self.fns.insert(&f.name.name, f);
            }
            ast::Item::Const(c) => {
                self.consts.insert(&c.name.name, c);
            }
            ast::Item::Cell(_) => {}
        }
    }

    fn mark_used(&self, name: &str) {
        self.used.borrow_mut().insert(name.to_string());
    }
}

/// What a name in scope refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BindingKind {
    Input,
    State,
    Param,
    Let,
    FnParam,
    /// A `rate`: not a value, only a mask function's argument.
    Rate,
}

impl BindingKind {
    fn word(self) -> &'static str {
        match self {
            BindingKind::Input => "input",
            BindingKind::State => "state",
            BindingKind::Param => "parameter",
            BindingKind::Let => "`let` binding",
            BindingKind::FnParam => "function parameter",
            BindingKind::Rate => "rate",
        }
    }

    /// The word with its article: "an input", "a state".
    fn a_word(self) -> String {
        match self {
            BindingKind::Input => "an input".into(),
            kind => format!("a {}", kind.word()),
        }
    }
}

#[derive(Clone, Debug)]
struct Binding {
    kind: BindingKind,
    /// `None` when the binding's value failed to lower (already reported).
    value: Option<ValueId>,
    span: Span,
    used: bool,
}

/// The names visible in a cell body or in one inlined function body.
#[derive(Default)]
struct Frame {
    names: HashMap<String, Binding>,
    /// Names in binding order, for deterministic warnings.
    order: Vec<String>,
    /// The call being inlined (none for the cell's own frame).
    call: Option<Call>,
}

/// A function call being inlined.
struct Call {
    name: String,
    span: Span,
    /// What the arguments are, as `v: [4*H], gain: [H]`.
    args: String,
}

/// Lowers one cell.
struct CellLowerer<'a> {
    globals: &'a Globals<'a>,
    cell: ir::Cell,
    diags: Diagnostics,
    frames: Vec<Frame>,
    /// Size variables declared by this cell, with where each first appears.
    sizes: HashMap<String, Span>,
    /// Value of each state at the end of the step, once assigned (`None`
    /// when its expression failed to lower).
    next: HashMap<String, (Option<ValueId>, Span)>,
    /// Where each state is assigned, from a pre-scan (for "read before assigned").
    assigned_at: HashMap<String, Span>,
    /// Constants already materialised as nodes.
    consts: HashMap<u64, ValueId>,
    /// The graph grew past [`MAX_VALUES`]; stop lowering.
    too_large: bool,
    /// The cell's body had syntax errors: statements may be missing.
    recovered: bool,
    /// Where `NAME'` of a state that is never assigned is first read.
    unassigned_reads: HashMap<String, Span>,
    /// Each read of a parameter by its name, outside `dropconnect`.
    plain_param_reads: Vec<(usize, Span)>,
}

impl<'a> CellLowerer<'a> {
    fn new(globals: &'a Globals<'a>, def: &ast::CellDef) -> CellLowerer<'a> {
        CellLowerer {
            globals,
            cell: ir::Cell::new(def.name.name.clone(), def.name.span),
            diags: Diagnostics::default(),
            frames: vec![Frame::default()],
            sizes: HashMap::new(),
            next: HashMap::new(),
            assigned_at: HashMap::new(),
            consts: HashMap::new(),
            too_large: false,
            recovered: def.recovered,
            unassigned_reads: HashMap::new(),
            plain_param_reads: Vec::new(),
        }
    }

    /// Reports an error, annotated with the calls being inlined. An error
    /// inside a function of another file (the prelude) is moved to the
    /// innermost call in the cell's file, the place the user can change,
    /// and told in terms of that call's arguments; the prelude's own lines
    /// are left out.
    fn error(&mut self, mut d: Diagnostic) {
        let home = self.cell.span.file;
        for frame in self.frames.iter().rev() {
            if let Some(call) = &frame.call {
                d = d.with_secondary(call.span, format!("in this call to `{}`", call.name));
            }
        }
        if d.primary.span.file != home {
            let anchor =
                self.frames.iter().rev().filter_map(|f| f.call.as_ref()).find(|c| c.span.file == home);
            if let Some(call) = anchor {
                d.primary = Label { span: call.span, message: format!("in this call to `{}`", call.name) };
                d.secondary.retain(|l| l.span.file == home && l.span != call.span);
                d.notes
                    .insert(0, format!("`{}` (from the prelude) was called with {}", call.name, call.args));
            }
        }
        self.diags.push(d);
    }

    fn frame(&mut self) -> &mut Frame {
        // The cell's own frame is never popped.
        let last = self.frames.len() - 1;
        &mut self.frames[last]
    }

    fn in_function(&self) -> bool {
        self.frames.len() > 1
    }

    /// Binds `name` in the current frame; a second binding is an error.
    fn bind(&mut self, name: &ast::Ident, kind: BindingKind, value: Option<ValueId>) {
        if let Some(prev) = self.frame().names.get(&name.name) {
            let (pk, ps) = (prev.kind, prev.span);
            self.error(
                Diagnostic::error(name.span, format!("`{}` is already defined", name.name))
                    .with_label("defined again here")
                    .with_secondary(ps, format!("first defined here, as {}", pk.a_word()))
                    .with_note("`let` bindings are immutable: bind a new name instead"),
            );
            return;
        }
        if !self.in_function() {
            if let Some(c) = self.globals.consts.get(name.name.as_str()) {
                if c.span.file == name.span.file {
                    self.error(
                        Diagnostic::error(
                            name.span,
                            format!("`{}` is already defined as a constant", name.name),
                        )
                        .with_secondary(c.name.span, "constant defined here"),
                    );
                    return;
                }
            }
        }
        let frame = self.frame();
        frame.order.push(name.name.clone());
        frame.names.insert(name.name.clone(), Binding { kind, value, span: name.span, used: false });
    }

    /// Adds a node, failing (once) if the graph grows beyond reason.
    fn add(&mut self, op: ir::Op, ty: Type, operands: &[ValueId], span: Span) -> Option<ValueId> {
        if self.cell.value_count() >= MAX_VALUES {
            if !self.too_large {
                self.too_large = true;
                self.error(
                    Diagnostic::error(span, format!("cell `{}` is too large: more than {MAX_VALUES} values", self.cell.name))
                        .with_note("function calls are inlined; a function calling another twice, many levels deep, grows exponentially"),
                );
            }
            return None;
        }
        Some(self.cell.add(op, ty, operands, Some(span)))
    }

    fn constant(&mut self, v: f64, span: Span) -> Option<ValueId> {
        if let Some(id) = self.consts.get(&v.to_bits()) {
            return Some(*id);
        }
        let id = self.add(ir::Op::Const(v), Type::Scalar, &[], span)?;
        self.consts.insert(v.to_bits(), id);
        Some(id)
    }

    /// Lowers the whole cell; false if it had errors.
    fn run(&mut self, def: &ast::CellDef) -> bool {
        let errors_before = self.diags.error_count();
        self.declarations(def);
        self.rate_declarations(def);
        if !def.decls.iter().any(|d| d.kind == ast::DeclKind::Input) && !self.recovered {
            self.error(
                Diagnostic::error(def.name.span, format!("cell `{}` has no `input`", def.name.name))
                    .with_note(
                        "a step reads one element of its sequence: declare it, as `input x[I]` \
                         (a cell that ignores its input can declare `input _x[1]` and be fed zeros)",
                    ),
            );
        }
        for stmt in &def.stmts {
            if let ast::Stmt::Assign { state, span, .. } = stmt {
                self.assigned_at.entry(state.name.clone()).or_insert(*span);
            }
        }
        let mut output: Option<(Option<ValueId>, Span)> = None;
        for stmt in &def.stmts {
            if self.too_large {
                break;
            }
            match stmt {
                ast::Stmt::Let(l) => self.let_binding(l),
                ast::Stmt::Assign { state, value, span } => self.assign(state, value, *span),
                ast::Stmt::Output { value, span } => {
                    if let Some((_, first)) = output {
                        self.error(
                            Diagnostic::error(*span, "`output` appears twice")
                                .with_secondary(first, "first `output` here")
                                .with_note("a cell has exactly one output per step"),
                        );
                        continue;
                    }
                    let v = self.expr(value).and_then(|v| self.as_output(v, value.span));
                    output = Some((v, *span));
                }
            }
        }
        // After a syntax error, a missing assignment or output may just be
        // in the part that did not parse: that was reported already.
        for s in def.decls.iter().filter(|d| d.kind == ast::DeclKind::State) {
            // A state whose declaration failed was reported there.
            let declared = self.cell.state_index(&s.name.name).is_some();
            match self.next.get(&s.name.name) {
                Some((Some(v), _)) if declared => self.cell.next_states.push(*v),
                Some(_) => {}
                None if self.recovered || !declared => {}
                None => {
                    // One message for the state: not also "never read".
                    let read = self.frames[0]
                        .names
                        .get_mut(&s.name.name)
                        .map(|b| std::mem::replace(&mut b.used, true));
                    let note = if read == Some(false) && !self.unassigned_reads.contains_key(&s.name.name) {
                        format!(
                            "`{0}` is neither read nor updated: remove it, or add `{0}' = ...`",
                            s.name.name
                        )
                    } else {
                        format!("every state is updated once per step: add `{}' = ...`", s.name.name)
                    };
                    let mut d =
                        Diagnostic::error(s.name.span, format!("state `{}` is never assigned", s.name.name))
                            .with_label("declared here")
                            .with_note(note);
                    if let Some(read) = self.unassigned_reads.get(&s.name.name) {
                        d = d.with_secondary(*read, format!("`{}'` is read here", s.name.name));
                    }
                    self.error(d)
                }
            }
        }
        match output {
            Some((Some(v), _)) => self.cell.output = v,
            Some((None, _)) => {}
            None if self.recovered => {}
            None => self.error(
                Diagnostic::error(def.name.span, format!("cell `{}` has no `output`", def.name.name))
                    .with_note("add `output EXPR`, the value the step emits (usually `output h'`)"),
            ),
        }
        self.check_dropconnect_reads();
        if !self.recovered {
            names::warn_unused_bindings(&self.frames[0], &mut self.diags);
            self.warn_unused_rates();
        }
        self.diags.error_count() == errors_before && output.is_some_and(|(v, _)| v.is_some())
    }

    fn as_output(&mut self, v: ValueId, span: Span) -> Option<ValueId> {
        match self.cell.ty(v).clone() {
            Type::Vector(_) => Some(v),
            t => {
                self.error(
                    Diagnostic::error(span, "the output must be a vector")
                        .with_label(format!("this is {}", describe(&t)))
                        .with_note(
                            "a step's output feeds the next layer, so it has a size, as in `output h'`",
                        ),
                );
                None
            }
        }
    }

    fn assign(&mut self, state: &ast::Ident, value: &ast::Expr, span: Span) {
        let v = self.expr(value);
        let failed_state = self.frames[0]
            .names
            .get(&state.name)
            .is_some_and(|b| b.kind == BindingKind::State && b.value.is_none());
        if failed_state {
            // Its declaration was reported; one message is enough.
            return;
        }
        let Some(idx) = self.cell.state_index(&state.name) else {
            let what = match self.frames[0].names.get(&state.name) {
                Some(b) => format!("`{}` is {}, not a state", state.name, b.kind.a_word()),
                None => format!("`{}` is not a declared state", state.name),
            };
            let mut d = Diagnostic::error(state.span, format!("cannot assign `{}'`: {what}", state.name))
                .with_label("not a state");
            let states = self.cell.states.iter().map(|s| s.name.as_str());
            d = match names::did_you_mean(&state.name, states) {
                Some(s) if !self.frames[0].names.contains_key(&state.name) => {
                    d.with_note(format!("did you mean `{s}'`?"))
                }
                _ => d.with_note(
                    "only states have a value at the end of the step; bind other values with `let`",
                ),
            };
            self.error(d);
            return;
        };
        if let Some((_, first)) = self.next.get(&state.name) {
            self.error(
                Diagnostic::error(span, format!("state `{}` is assigned twice", state.name))
                    .with_secondary(*first, "first assigned here")
                    .with_note("every state is assigned exactly once per step"),
            );
            return;
        }
        let Some(v) = v else {
            self.next.insert(state.name.clone(), (None, span));
            return;
        };
        let dim = self.cell.states[idx].dim.clone();
        let decl_span = self.cell.states[idx].span;
        let v = match self.cell.ty(v).clone() {
            Type::Vector(d) if d == dim => Some(v),
            Type::Scalar => self.add(ir::Op::Broadcast, Type::Vector(dim.clone()), &[v], value.span),
            t => {
                self.error(
                    Diagnostic::error(
                        value.span,
                        format!("`{}'` must be [{dim}], the state's size", state.name),
                    )
                    .with_label(format!("this is {}", describe(&t)))
                    .with_secondary(decl_span, format!("`{}` declared as [{dim}] here", state.name)),
                );
                None
            }
        };
        self.next.insert(state.name.clone(), (v, span));
    }
}

/// "a vector [H]", "a scalar", "a matrix [4*H, I]".
fn describe(t: &Type) -> String {
    match t {
        Type::Scalar => "a scalar".into(),
        Type::Vector(d) => format!("a vector [{d}]"),
        Type::Matrix(h, m, n) if h.as_constant() != Some(1) => {
            format!("a block-diagonal matrix of {h} heads [{m}, {n}]")
        }
        Type::Matrix(..) => format!("a matrix {t}"),
    }
}

/// The dims of a `Type::Vector`, for error messages.
fn dim_of(t: &Type) -> Option<Dim> {
    t.vector_dim().cloned()
}
