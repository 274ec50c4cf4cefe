//! The schedule as text: what `cellc graph --stage schedule` prints and the
//! snapshot tests compare.

use super::{Placement, Schedule, Stage, StageKind};
use crate::autodiff::Gradient;
use crate::dims::Bindings;
use crate::ir::print::LeafNames;
use crate::ir::{Cell, Graph, Op, ValueId};
use std::collections::HashMap;
use std::fmt::Write;

/// Roles of values to annotate: `h'`, `output`, `saved`, `d_weight_hh`.
fn roles(
    cell: &Cell,
    grad: &Gradient,
    sched: &Schedule,
) -> (HashMap<ValueId, Vec<String>>, HashMap<ValueId, Vec<String>>) {
    let mut fwd: HashMap<ValueId, Vec<String>> = HashMap::new();
    for (s, v) in cell.states.iter().zip(&cell.next_states) {
        fwd.entry(*v).or_default().push(format!("{}'", s.name));
    }
    fwd.entry(cell.output).or_default().push("output".into());
    for v in &sched.saved.saved {
        fwd.entry(*v).or_default().push("saved".into());
    }
    let mut bwd: HashMap<ValueId, Vec<String>> = HashMap::new();
    let named = [
        (cell.inputs.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), &grad.d_inputs),
        (cell.states.iter().map(|d| d.name.as_str()).collect(), &grad.d_states),
        (cell.params.iter().map(|d| d.name.as_str()).collect(), &grad.d_params),
    ];
    for (names, results) in named {
        for (n, r) in names.iter().zip(results.iter()) {
            if let Some(v) = r {
                bwd.entry(*v).or_default().push(format!("d_{n}"));
            }
        }
    }
    (fwd, bwd)
}

fn value_name(g: &Graph, names: &LeafNames, v: ValueId) -> String {
    let pick = |list: &[&str], i: usize| list.get(i).copied().unwrap_or("?").to_string();
    match g.node(v).op {
        Op::Input(i) => pick(&names.inputs, i),
        Op::State(i) => pick(&names.states, i),
        Op::Param(i) => pick(&names.params, i),
        Op::Seed(i) => pick(&names.seeds, i),
        Op::Mask(i) => names.masks.get(i).cloned().unwrap_or_else(|| "?".into()),
        _ => v.to_string(),
    }
}

fn list(
    g: &Graph,
    names: &LeafNames,
    values: &[ValueId],
    roles: &HashMap<ValueId, Vec<String>>,
    typed: bool,
) -> String {
    let items: Vec<String> = values
        .iter()
        .filter(|v| !matches!(g.node(**v).op, Op::Const(_) | Op::DimValue(_)))
        .map(|&v| {
            let mut s = value_name(g, names, v);
            if typed {
                let _ = write!(s, " {}", g.ty(v));
            }
            if let Some(r) = roles.get(&v) {
                let _ = write!(s, " ({})", r.join(", "));
            }
            s
        })
        .collect();
    if items.is_empty() {
        "-".into()
    } else {
        items.join(", ")
    }
}

fn kind_word(k: StageKind) -> &'static str {
    match k {
        StageKind::Gemm => "gemm",
        StageKind::Pointwise { reductions: false } => "pointwise",
        StageKind::Pointwise { reductions: true } => "pointwise+rowreduce",
        StageKind::WholeSequence { reductions: false } => "whole-sequence",
        StageKind::WholeSequence { reductions: true } => "whole-sequence+rowreduce",
        StageKind::SumOverSteps => "sum over steps",
        StageKind::AddMatrices => "add matrices",
    }
}

fn stages_text(
    out: &mut String,
    g: &Graph,
    names: &LeafNames,
    stages: &[Stage],
    roles: &HashMap<ValueId, Vec<String>>,
    reverse: bool,
) {
    let mut current = None;
    for (i, st) in stages.iter().enumerate() {
        if current != Some(st.placement) {
            current = Some(st.placement);
            let heading = match (st.placement, reverse) {
                (Placement::BeforeLoop, _) => "before the loop, once over all steps:",
                (Placement::EachStep, false) => "each step:",
                (Placement::EachStep, true) => "each step, in reverse time:",
                (Placement::AfterLoop, _) => "after the loop, once over all steps:",
            };
            let _ = writeln!(out, "  {heading}");
        }
        let _ = writeln!(out, "    [{i}] {}", kind_word(st.kind));
        if st.kind == StageKind::SumOverSteps {
            for v in &st.outputs {
                let _ = writeln!(
                    out,
                    "        {} = sum over steps of {v} {}",
                    roles.get(v).map(|r| r.join(", ")).unwrap_or_default(),
                    g.ty(*v)
                );
            }
            continue;
        }
        if matches!(st.kind, StageKind::Gemm | StageKind::AddMatrices) {
            for v in &st.values {
                let ops = g.operands(*v);
                let args: Vec<String> = ops.iter().map(|o| value_name(g, names, *o)).collect();
                let role = roles.get(v).map(|r| format!("  -> {}", r.join(", "))).unwrap_or_default();
                let _ = writeln!(
                    out,
                    "        {v} {} = {} {}{role}",
                    g.ty(*v),
                    g.node(*v).op.mnemonic(),
                    args.join(", ")
                );
            }
            continue;
        }
        let _ = writeln!(
            out,
            "        computes {} values: {}",
            st.values.len(),
            list(g, names, &st.values, &HashMap::new(), false)
        );
        let _ = writeln!(out, "        reads    {}", list(g, names, &st.inputs, roles, false));
        let _ = writeln!(out, "        writes   {}", list(g, names, &st.outputs, roles, true));
    }
}

/// The schedule as text; `sizes` (if all bound) turn saved elements into bytes.
pub fn to_text(cell: &Cell, grad: &Gradient, sched: &Schedule, sizes: &Bindings) -> String {
    let mut out = String::new();
    let (fwd_roles, bwd_roles) = roles(cell, grad, sched);
    let sizes_text = if cell.sizes.is_empty() {
        "no sizes".to_string()
    } else {
        format!("sizes {}", cell.sizes.join(", "))
    };
    let _ = writeln!(out, "schedule {} ({sizes_text})", cell.name);
    if sched.elementwise_recurrence {
        let _ = writeln!(
            out,
            "  the recurrence is elementwise: the step loop runs inside one whole-sequence kernel"
        );
    }
    let _ = writeln!(out, "\nforward");
    let names = LeafNames::of(cell, &[]);
    stages_text(&mut out, cell, &names, &sched.forward, &fwd_roles, false);
    if !sched.sinkable.is_empty() {
        let stages: Vec<String> = sched.sinkable.iter().map(|k| format!("[{k}]")).collect();
        let _ =
            writeln!(out, "  {} may run in the step instead, on a thread's own sequences", stages.join(", "));
    }
    for f in &sched.fusion {
        let ordered = match f.tile_ordered.len() {
            0 => "every vector is one block".to_string(),
            _ => format!("in tile order: {}", list(cell, &names, &f.tile_ordered, &HashMap::new(), false)),
        };
        let _ = writeln!(
            out,
            "  fused: [{}] and [{}] run on tiles of {} units ({ordered})",
            f.gemm, f.pointwise, f.unit
        );
        if !f.hoisted.is_empty() {
            let stages: Vec<String> = f.hoisted.iter().map(|k| format!("[{k}]")).collect();
            let _ = writeln!(out, "  {} may run with them, tile by tile, in the step", stages.join(", "));
        }
    }

    let _ = writeln!(out, "\nsaved for the backward, per step and sequence:");
    let saved: Vec<String> = sched.saved.saved.iter().map(|v| format!("{v} {}", grad.graph.ty(*v))).collect();
    let _ =
        writeln!(out, "  values:        {}", if saved.is_empty() { "none".into() } else { saved.join(", ") });
    let states: Vec<String> = cell.states.iter().map(|s| format!("{}[{}]", s.name, s.dim)).collect();
    let _ = writeln!(
        out,
        "  state history: {} (kept by the runtime)",
        if states.is_empty() { "none".into() } else { states.join(", ") }
    );
    let bytes = match sched.saved_bytes(sizes) {
        Some(b) if cell.sizes.iter().all(|s| sizes.contains_key(s)) => format!(" = {b} bytes"),
        _ => String::new(),
    };
    if sched.saved_elements.is_zero() {
        let _ = writeln!(out, "  saved f32 elements: 0");
    } else {
        let _ = writeln!(out, "  saved f32 elements: [{}]{bytes}", sched.saved_elements);
    }
    let recomputed: Vec<String> = sched.saved.recomputed.iter().map(|v| v.to_string()).collect();
    let _ = writeln!(
        out,
        "  recomputed in the backward: {}",
        if recomputed.is_empty() { "nothing".into() } else { recomputed.join(", ") }
    );

    let _ = writeln!(out, "\nbackward");
    let bnames = LeafNames::of(cell, &grad.seeds);
    stages_text(&mut out, &grad.graph, &bnames, &sched.backward, &bwd_roles, true);
    if let Some(split) = &sched.backward_units {
        let stages: Vec<String> = split.stages.iter().map(|k| format!("[{k}]")).collect();
        let _ = writeln!(
            out,
            "  split by units: {} run on each thread's own units of {}",
            stages.join(", "),
            split.unit
        );
    }
    out
}
