//! A [`KernelPlan`] as text, one line a decision: the golden files of
//! `tests/kernel_snapshots.rs`.

use super::{Item, KernelPlan};
use crate::ir::print::{value_line, LeafNames};
use crate::ir::Graph;
use std::fmt::Write;

pub(super) fn plan(plan: &KernelPlan, graph: &Graph) -> String {
    let names = LeafNames::default();
    let line = |v| value_line(graph, &names, v);
    let mut out = String::new();
    let form = match &plan.lanes {
        Some(l) => format!("lanes of {} units", l.units),
        None => "block".to_string(),
    };
    let rows = if plan.whole_sequence { "sequences" } else { "rows" };
    let _ = writeln!(out, "form {form}, over {rows}");
    for (v, literal) in &plan.literals {
        let _ = writeln!(out, "literal {v} = {literal:?}");
    }
    for (slot, v, kind) in &plan.inputs {
        let _ = writeln!(out, "in a[{slot}] {v}: {kind:?}");
    }
    for c in plan.lanes.iter().flat_map(|l| &l.chained) {
        let _ = writeln!(out, "chain a[{}] <- a[{}]", c.input, plan.input_count + c.output);
    }
    for item in &plan.items {
        match item {
            Item::Fused(l) => {
                let _ = writeln!(out, "loop over {}:", l.len);
                for m in &l.members {
                    let mark = if m.stored { "*" } else { " " };
                    let _ = writeln!(out, "  {mark} {}", line(m.value));
                }
            }
            Item::Scalar { value, splat, .. } => {
                let what = if *splat { "splat" } else { "scalar" };
                let _ = writeln!(out, "{what} {}", line(*value));
            }
            Item::Reduce { value, .. } => {
                let _ = writeln!(out, "reduce {}", line(*value));
            }
            Item::Broadcast { value, .. }
            | Item::Slice { value, .. }
            | Item::Pad { value, .. }
            | Item::Concat { value, .. } => {
                let _ = writeln!(out, "single {}", line(*value));
            }
        }
    }
    let mut scratch: Vec<_> = plan.scratch.iter().map(|(&v, &at)| (at, v)).collect();
    scratch.sort();
    for (at, v) in scratch {
        let _ = writeln!(out, "scratch {v} at {at}");
    }
    for (i, o) in plan.outputs.iter().enumerate() {
        let how = if o.in_place { "" } else { " (copy)" };
        let _ = writeln!(out, "out a[{}] {}{how}", plan.input_count + i, o.value);
    }
    out
}
