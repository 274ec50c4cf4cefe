//! Shrinking a failing cell: smaller variants of a [`CellSpec`], to be
//! tried in order until none keeps the failure (see [`shrink`]).
//!
//! Every variant is valid when the original is: a removed state or input
//! becomes a vector parameter of its size, an expression is replaced by a
//! subexpression or a name of its own type, and only unused declarations
//! are dropped. Guards stay with the nodes they protect. A mask call is
//! replaced by the value it masks; a parameter applied through
//! `dropconnect` loses its mask in every product at once, never in one
//! (which would read it unmasked beside its masked reads); a rate whose
//! last mask is gone is left, unused (a warning), until it is dropped.

use super::spec::{CellSpec, Expr, FnDef, Init, Param, Scale, Stmt, Ty};
use std::collections::BTreeMap;

/// Shrinks `spec` while `fails` holds for the smaller cell, trying at most
/// `budget` variants; returns the smallest failing cell found.
pub fn shrink(spec: &CellSpec, budget: usize, fails: &mut dyn FnMut(&CellSpec) -> bool) -> CellSpec {
    let mut best = spec.clone();
    let mut tried = 0;
    'outer: loop {
        for candidate in candidates(&best) {
            if tried >= budget {
                break 'outer;
            }
            tried += 1;
            if fails(&candidate) {
                best = candidate;
                continue 'outer;
            }
        }
        break;
    }
    best
}

/// Every one-step reduction of `spec`, the largest first.
pub fn candidates(spec: &CellSpec) -> Vec<CellSpec> {
    let mut out = Vec::new();
    if spec.states.len() > 1 {
        for i in 0..spec.states.len() {
            out.push(without_state(spec, i));
        }
    }
    if spec.inputs.len() > 1 {
        for i in 0..spec.inputs.len() {
            out.push(without_input(spec, i));
        }
    }
    out.extend(unused_removed(spec));
    out.extend(dropconnect_removed(spec));
    // Expressions: each node replaced by something of its type, roots first.
    for i in 0..spec.stmts.len() {
        let lets = spec.lets_before(i);
        let value = spec.stmts[i].value();
        let nodes = value.nodes().len();
        for k in 0..nodes {
            let Some(node) = value.nodes().get(k).map(|n| (*n).clone()) else { continue };
            if matches!(node, Expr::Guarded(..)) {
                continue;
            }
            for replacement in replacements(spec, &node, &lets) {
                let mut c = spec.clone();
                if let Some(slot) = c.stmts[i].value_mut().node_mut(k) {
                    *slot = replacement;
                }
                out.push(c);
            }
        }
    }
    // Function bodies: down to one of their parameters.
    for (i, f) in spec.fns.iter().enumerate() {
        let first_vector = if f.matrix { 2 } else { 0 };
        if let Some(p) = f.params.get(first_vector) {
            if f.body != Expr::name(p) || !f.lets.is_empty() {
                let mut c = spec.clone();
                c.fns[i] = FnDef { lets: Vec::new(), body: Expr::name(p), ..f.clone() };
                out.push(c);
            }
        }
    }
    // Plainer initialisers.
    for (i, p) in spec.params.iter().enumerate() {
        if p.init != Init::Default {
            let mut c = spec.clone();
            c.params[i].init = Init::Default;
            out.push(c);
        }
    }
    out
}

/// What `node` may become: a subexpression of the
/// same type, a plainer name of that type, or a number for a scalar.
fn replacements(spec: &CellSpec, node: &Expr, lets: &BTreeMap<String, Ty>) -> Vec<Expr> {
    let Some(ty) = spec.type_of(node, lets) else { return Vec::new() };
    let mut out = Vec::new();
    for child in node.children() {
        // Replacing `log(guarded(x))` or `a / guarded(b)` by what the guard
        // protects drops the guard with the node that needed it.
        let child = match child {
            Expr::Guarded(_, inner) => inner,
            c => c,
        };
        if spec.type_of(child, lets).as_ref() == Some(&ty) && child != node {
            out.push(child.clone());
        }
    }
    match &ty {
        Ty::Scalar => {
            if *node != Expr::Number(1.0) {
                out.push(Expr::Number(1.0));
            }
        }
        Ty::Vector(size) => {
            // Inputs, then states (unprimed), then earlier lets of the same size.
            let names = spec
                .inputs
                .iter()
                .chain(&spec.states)
                .filter(|(_, s)| s == size)
                .map(|(n, _)| n.clone())
                .chain(lets.iter().filter(|(_, t)| *t == &ty).map(|(n, _)| n.clone()));
            for n in names {
                let e = Expr::Name(n);
                if e != *node && !out.contains(&e) {
                    out.push(e);
                }
            }
            if let Expr::Primed(s) = node {
                out.push(Expr::Name(s.clone()));
            }
        }
    }
    out
}

/// The cell without state `i`: its reads become a vector parameter.
fn without_state(spec: &CellSpec, i: usize) -> CellSpec {
    let mut c = spec.clone();
    let (name, size) = c.states.remove(i);
    let z = fresh_param(&c, &format!("z_{name}"));
    c.params.push(Param { name: z.clone(), rows: size, cols: None, heads: 1, init: Init::Default });
    c.stmts.retain(|st| !matches!(st, Stmt::Assign { state, .. } if *state == name));
    for st in &mut c.stmts {
        let e = st.value_mut();
        e.replace_name(&name, false, &Expr::name(&z));
        e.replace_name(&name, true, &Expr::name(&z));
    }
    c
}

/// The cell without input `i` (of several): its reads become a vector parameter.
fn without_input(spec: &CellSpec, i: usize) -> CellSpec {
    let mut c = spec.clone();
    let (name, size) = c.inputs.remove(i);
    let z = fresh_param(&c, &format!("z_{name}"));
    c.params.push(Param { name: z.clone(), rows: size, cols: None, heads: 1, init: Init::Default });
    for st in &mut c.stmts {
        st.value_mut().replace_name(&name, false, &Expr::name(&z));
    }
    c
}

fn fresh_param(spec: &CellSpec, base: &str) -> String {
    let mut name = base.to_string();
    while spec.params.iter().any(|p| p.name == name) || spec.uses(&name) {
        name.push('_');
    }
    name
}

/// Variants with one parameter's `dropconnect` removed from all its products.
fn dropconnect_removed(spec: &CellSpec) -> Vec<CellSpec> {
    let mut out = Vec::new();
    for (param, _) in spec.dropconnected() {
        let mut c = spec.clone();
        for st in &mut c.stmts {
            st.value_mut().without_dropconnect(&param);
        }
        out.push(c);
    }
    out
}

/// Variants with one unused `let`, parameter, function, rate or constant removed.
fn unused_removed(spec: &CellSpec) -> Vec<CellSpec> {
    let mut out = Vec::new();
    for (k, st) in spec.stmts.iter().enumerate() {
        if let Stmt::Let { names, .. } = st {
            if names.iter().all(|n| !spec.uses(n)) {
                let mut c = spec.clone();
                c.stmts.remove(k);
                out.push(c);
            }
        }
    }
    for (k, p) in spec.params.iter().enumerate() {
        if !spec.uses(&p.name) {
            let mut c = spec.clone();
            c.params.remove(k);
            out.push(c);
        }
    }
    for (k, f) in spec.fns.iter().enumerate() {
        if !spec.uses(&f.name) {
            let mut c = spec.clone();
            c.fns.remove(k);
            out.push(c);
        }
    }
    for (k, (name, _)) in spec.rates.iter().enumerate() {
        if !spec.uses(name) {
            let mut c = spec.clone();
            c.rates.remove(k);
            out.push(c);
        }
    }
    for (k, (name, value)) in spec.consts.iter().enumerate() {
        let mut c = spec.clone();
        c.consts.remove(k);
        let number = Expr::Number(*value);
        for st in &mut c.stmts {
            st.value_mut().replace_name(name, false, &number);
        }
        for f in &mut c.fns {
            f.body.replace_name(name, false, &number);
            for (_, e) in &mut f.lets {
                e.replace_name(name, false, &number);
            }
        }
        for p in &mut c.params {
            if let Init::Uniform(s) | Init::Constant(s) = &mut p.init {
                if s.constant() == Some(name.as_str()) {
                    *s = Scale::Number(*value);
                }
            }
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzzgen::{generate, Entropy};

    /// Every `step`-th shrinking candidate of `spec` compiles (`what` names the cell).
    fn candidates_compile(spec: &CellSpec, step: usize, what: &str) {
        for (k, c) in candidates(spec).into_iter().enumerate().step_by(step) {
            let text = c.to_string();
            let compiled = crate::compile("c.cell", &text);
            assert!(
                compiled.diagnostics.error_count() == 0,
                "{what}, candidate {k}:\n{text}\n{}",
                compiled.render(false)
            );
        }
    }

    #[test]
    fn every_candidate_of_generated_cells_compiles() {
        for seed in 0..40 {
            candidates_compile(&generate(&mut Entropy::seeded(seed), "c"), 7, &format!("seed {seed}"));
        }
    }

    #[test]
    fn every_candidate_of_cells_with_masks_compiles() {
        let masked =
            (0..).map(|seed| generate(&mut Entropy::seeded(seed), "c")).filter(|s| !s.rates.is_empty());
        for (n, spec) in masked.take(6).enumerate() {
            candidates_compile(&spec, 1, &format!("cell {n} with masks"));
        }
    }

    #[test]
    fn shrinking_a_cell_with_masks_keeps_it_valid() {
        let spec = (0..)
            .map(|seed| generate(&mut Entropy::seeded(seed), "c"))
            .find(|s| !s.dropconnected().is_empty())
            .expect("some cell applies a parameter through dropconnect");
        // "Fails" while the cell still masks a parameter with `dropconnect`.
        let small = shrink(&spec, 2_000, &mut |c| {
            crate::compile("c.cell", &c.to_string()).diagnostics.error_count() == 0
                && !c.dropconnected().is_empty()
        });
        assert!(!small.dropconnected().is_empty());
        assert!(small.to_string().len() < spec.to_string().len(), "{small}");
    }

    #[test]
    fn shrinking_keeps_the_property_and_reaches_a_small_cell() {
        let spec = generate(&mut Entropy::seeded(3), "c");
        // "Fails" while the cell still has a state named h.
        let small = shrink(&spec, 10_000, &mut |c| c.states.iter().any(|(n, _)| n == "h"));
        assert!(small.states.iter().any(|(n, _)| n == "h"));
        assert!(small.to_string().len() <= spec.to_string().len());
        assert!(candidates(&small).iter().all(|c| !c.states.iter().any(|(n, _)| n == "h")));
    }
}
