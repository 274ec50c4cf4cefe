//! Printing the IR: a readable text dump and Graphviz dot.
//!
//! The text form lists declarations, then one line per value in
//! topological order, `v12: [4*H] = add v10, v11`, with the source location
//! it came from, then the next states and the output. It is what
//! `cellc graph` prints and what snapshot tests compare.

use super::{Cell, Graph, Op, Type, ValueId};
use crate::diag::SourceMap;
use std::fmt::Write;

/// The text dump; with `sources`, each value names its source location.
pub fn to_text(cell: &Cell, sources: Option<&SourceMap>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "cell {} ({})", cell.name, sizes_list(cell));
    for i in &cell.inputs {
        let _ = writeln!(out, "  input  {}: [{}]", i.name, i.dim);
    }
    for s in &cell.states {
        let _ = writeln!(out, "  state  {}: [{}]", s.name, s.dim);
    }
    for p in &cell.params {
        let _ = writeln!(out, "  param  {}: {} = {}", p.name, p.ty, p.init);
    }
    out.push('\n');
    out.push_str(&values_text(cell, &LeafNames::of(cell, &[]), sources));
    out.push('\n');
    for (s, v) in cell.states.iter().zip(&cell.next_states) {
        let _ = writeln!(out, "  next   {}' = {v}", s.name);
    }
    let _ = writeln!(out, "  output {}", cell.output);
    out
}

fn sizes_list(cell: &Cell) -> String {
    if cell.sizes.is_empty() {
        "no sizes".into()
    } else {
        format!("sizes {}", cell.sizes.join(", "))
    }
}

/// The names of a graph's leaves, for printing.
#[derive(Clone, Debug, Default)]
pub struct LeafNames<'a> {
    /// The cell's inputs' names, by input index.
    pub inputs: Vec<&'a str>,
    /// The cell's states' names, by state index.
    pub states: Vec<&'a str>,
    /// The cell's parameters' names, by parameter index.
    pub params: Vec<&'a str>,
    /// The backward step's seeds' names (`d_output`, `d_h'`), by seed index; empty for a forward graph.
    pub seeds: Vec<&'a str>,
    /// The cell's masks' names (`zoneout#1`: the function, and the mask's
    /// index), by mask index.
    pub masks: Vec<String>,
}

impl<'a> LeafNames<'a> {
    /// A cell's leaf names, plus the seeds of its backward step.
    pub fn of(cell: &'a Cell, seeds: &'a [crate::autodiff::Seed]) -> LeafNames<'a> {
        LeafNames {
            inputs: cell.inputs.iter().map(|d| d.name.as_str()).collect(),
            states: cell.states.iter().map(|d| d.name.as_str()).collect(),
            params: cell.params.iter().map(|d| d.name.as_str()).collect(),
            seeds: seeds.iter().map(|d| d.name.as_str()).collect(),
            masks: cell.masks.iter().enumerate().map(|(i, m)| format!("{}#{i}", m.function.name())).collect(),
        }
    }
}

/// One line per value in topological order, with source locations if known.
pub fn values_text(graph: &Graph, names: &LeafNames, sources: Option<&SourceMap>) -> String {
    let mut out = String::new();
    for v in graph.topo_order().unwrap_or_else(|_| graph.values().collect()) {
        let line = value_line(graph, names, v);
        match (sources, graph.span(v)) {
            (Some(src), Some(span)) => {
                let _ = writeln!(out, "  {line:<44} ; {}", src.location(span));
            }
            _ => {
                let _ = writeln!(out, "  {line}");
            }
        }
    }
    out
}

/// A backward step: seeds, values, and the adjoint of every leaf.
pub fn gradient_to_text(
    cell: &Cell,
    grad: &crate::autodiff::Gradient,
    sources: Option<&SourceMap>,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "backward {} ({})", cell.name, sizes_list(cell));
    for s in &grad.seeds {
        let _ = writeln!(out, "  seed   {}: {}", s.name, s.ty);
    }
    out.push('\n');
    let names = LeafNames::of(cell, &grad.seeds);
    out.push_str(&values_text(&grad.graph, &names, sources));
    out.push('\n');
    let groups = [
        ("input", &names.inputs, &grad.d_inputs),
        ("state", &names.states, &grad.d_states),
        ("param", &names.params, &grad.d_params),
    ];
    for (what, names, results) in groups {
        for (n, r) in names.iter().zip(results.iter()) {
            match r {
                Some(v) => {
                    let _ = writeln!(out, "  d_{n:<12} = {v}    ; {what}");
                }
                None => {
                    let _ = writeln!(out, "  d_{n:<12} = 0     ; {what}, does not affect the step");
                }
            }
        }
    }
    out
}

/// `v12: [4*H] = add v10, v11`
pub fn value_line(graph: &Graph, names: &LeafNames, v: ValueId) -> String {
    let node = graph.node(v);
    let args: Vec<String> = graph.operands(v).iter().map(|o| o.to_string()).collect();
    let name = |list: &[&str], i: usize| list.get(i).copied().unwrap_or("?").to_string();
    let rhs = match &node.op {
        Op::Input(i) => format!("input {}", name(&names.inputs, *i)),
        Op::State(i) => format!("state {}", name(&names.states, *i)),
        Op::Param(i) => format!("param {}", name(&names.params, *i)),
        Op::Seed(i) => format!("seed {}", name(&names.seeds, *i)),
        Op::Mask(i) => format!("mask {}", names.masks.get(*i).map_or("?", String::as_str)),
        Op::Const(c) => format!("const {c}"),
        Op::DimValue(d) => format!("dimvalue {d}"),
        Op::Slice { offset } | Op::Pad { offset } => {
            format!("{} {}, offset {offset}", node.op.mnemonic(), args.join(", "))
        }
        op => format!("{} {}", op.mnemonic(), args.join(", ")),
    };
    format!("{v}: {} = {rhs}", short_type(&node.ty))
}

fn short_type(t: &Type) -> String {
    match t {
        Type::Scalar => "f32".into(),
        t => t.to_string(),
    }
}

/// Graphviz dot: values as nodes, operand edges labelled with their slot
/// where order matters.
pub fn to_dot(cell: &Cell) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "digraph \"{}\" {{", escape(&cell.name));
    let _ = writeln!(out, "  rankdir=TB;\n  node [fontname=\"monospace\", fontsize=10];");
    for v in cell.topo_order().unwrap_or_else(|_| cell.values().collect()) {
        let node = cell.node(v);
        let (label, shape) = match &node.op {
            Op::Input(i) => (format!("input {}", cell.inputs[*i].name), "invhouse"),
            Op::State(i) => (format!("state {}", cell.states[*i].name), "invhouse"),
            Op::Param(i) => (format!("param {}", cell.params[*i].name), "box3d"),
            Op::Mask(i) => (format!("mask {}#{i}", cell.masks[*i].function.name()), "invhouse"),
            Op::Const(c) => (format!("{c}"), "plaintext"),
            Op::MatVec => ("matvec".to_string(), "box"),
            Op::Slice { offset } => (format!("slice @{offset}"), "ellipse"),
            op => (op.mnemonic().to_string(), "ellipse"),
        };
        let _ = writeln!(
            out,
            "  {v} [label=\"{v}: {}\\n{}\", shape={shape}];",
            escape(&label),
            escape(&short_type(&node.ty))
        );
        let ordered = matches!(
            node.op,
            Op::MatVec | Op::Concat | Op::Binary(super::BinaryOp::Sub) | Op::Binary(super::BinaryOp::Div)
        );
        for (slot, o) in cell.operands(v).iter().enumerate() {
            if ordered {
                let _ = writeln!(out, "  {o} -> {v} [label=\"{slot}\"];");
            } else {
                let _ = writeln!(out, "  {o} -> {v};");
            }
        }
    }
    for (s, v) in cell.states.iter().zip(&cell.next_states) {
        let _ =
            writeln!(out, "  \"{0}'\" [label=\"{0}'\", shape=house];\n  {v} -> \"{0}'\";", escape(&s.name));
    }
    let _ = writeln!(out, "  \"output\" [shape=house];\n  {} -> \"output\";", cell.output);
    out.push_str("}\n");
    out
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}
