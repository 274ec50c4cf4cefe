//! Name hygiene: warnings for names that are never used, and
//! "did you mean" suggestions for names that are not defined.
//!
//! A leading underscore (`_f`) marks a name as deliberately unused.

use super::{BindingKind, Frame, Globals};
use crate::diag::{Diagnostic, Diagnostics};
use crate::syntax::ast;
use std::collections::HashSet;

/// Warns about the cell's inputs, states, parameters and `let`s that nothing reads.
pub(super) fn warn_unused_bindings(frame: &Frame, diags: &mut Diagnostics) {
    for name in &frame.order {
        let Some(b) = frame.names.get(name) else { continue };
        // A binding whose value failed to lower already has an error.
        if b.used || b.value.is_none() || name.starts_with('_') {
            continue;
        }
        let (message, note) = match b.kind {
            BindingKind::Let => {
                (format!("unused `let` binding `{name}`"), "remove it, or prefix the name with `_`")
            }
            BindingKind::Param => (
                format!("unused parameter `{name}`"),
                "it still has weights to load and save; remove it if it is not needed",
            ),
            BindingKind::Input => {
                (format!("unused input `{name}`"), "its features are read from the sequence and ignored")
            }
            BindingKind::State => (
                format!("state `{name}` is never read"),
                "its value at the start of the step has no effect; only its update is kept",
            ),
            BindingKind::FnParam => {
                (format!("unused function parameter `{name}`"), "remove it, or prefix the name with `_`")
            }
            // Rates have no value; their own check warns.
            BindingKind::Rate => continue,
        };
        diags.push(Diagnostic::warning(b.span, message).with_note(note));
    }
}

/// Warns about the file's own functions and constants that no cell uses,
/// and about unused parameters and `let`s inside function bodies.
pub(super) fn warn_unused_items(file: &ast::File, globals: &Globals, diags: &mut Diagnostics) {
    let has_cells = file.items.iter().any(|i| matches!(i, ast::Item::Cell(_)));
    let used = globals.used.borrow();
    for item in &file.items {
        match item {
            // A built-in's name is an error already, and a broken body's
            // names may be read in the part that did not parse.
            ast::Item::Fn(f) if super::is_builtin(&f.name.name) || f.recovered => {}
            ast::Item::Fn(f) => {
                if has_cells && !used.contains(&f.name.name) && !f.name.name.starts_with('_') {
                    diags.push(
                        Diagnostic::warning(
                            f.name.span,
                            format!("function `{}` is never called", f.name.name),
                        )
                        .with_note("remove it, or prefix the name with `_`"),
                    );
                }
                warn_unused_in_fn(f, diags);
            }
            ast::Item::Const(c) => {
                if has_cells && !used.contains(&c.name.name) && !c.name.name.starts_with('_') {
                    diags.push(
                        Diagnostic::warning(c.name.span, format!("constant `{}` is never used", c.name.name))
                            .with_note("remove it, or prefix the name with `_`"),
                    );
                }
            }
            ast::Item::Cell(_) => {}
        }
    }
}

/// Syntactic check: a function is checked once, however often it is inlined.
fn warn_unused_in_fn(f: &ast::FnDef, diags: &mut Diagnostics) {
    let mut read: HashSet<&str> = HashSet::new();
    let collect = |e: &ast::Expr| {
        let mut names = Vec::new();
        e.for_each_name(&mut |id, _| names.push(id.name.clone()));
        names
    };
    let mut all: Vec<String> = collect(&f.result);
    for l in &f.lets {
        all.extend(collect(&l.value));
    }
    read.extend(all.iter().map(String::as_str));
    for p in &f.params {
        if !read.contains(p.name.as_str()) && !p.name.starts_with('_') {
            diags.push(
                Diagnostic::warning(p.span, format!("unused function parameter `{}`", p.name))
                    .with_note("remove it, or prefix the name with `_`"),
            );
        }
    }
    for l in &f.lets {
        for n in &l.names {
            if !read.contains(n.name.as_str()) && !n.name.starts_with('_') {
                diags.push(
                    Diagnostic::warning(n.span, format!("unused `let` binding `{}`", n.name))
                        .with_note("remove it, or prefix the name with `_`"),
                );
            }
        }
    }
}

/// The candidate closest to `name`, if close enough to be a likely typo.
pub(super) fn did_you_mean<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> Option<String> {
    let limit = (name.chars().count() / 3).clamp(1, 3);
    let mut best: Option<(usize, &str)> = None;
    for c in candidates {
        let d = edit_distance(name, c);
        if d <= limit && best.is_none_or(|(bd, bc)| (d, c) < (bd, bc)) {
            best = Some((d, c));
        }
    }
    best.map(|(_, c)| c.to_string())
}

fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    if a.len().abs_diff(b.len()) > 3 || a.len() > 64 || b.len() > 64 {
        return usize::MAX;
    }
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_close_names_only() {
        let names = ["weight_ih", "weight_hh", "bias_ih"];
        assert_eq!(did_you_mean("weight_hi", names.into_iter()), Some("weight_hh".into()));
        assert_eq!(did_you_mean("zzz", names.into_iter()), None);
        assert_eq!(did_you_mean("sigmod", ["sigmoid", "tanh"].into_iter()), Some("sigmoid".into()));
    }
}
