//! Algebraic identities that occur in cells and, above all, in derived
//! backward steps: `x * 1`, `x + 0`, `x - 0`, `x / 1`, `-(-x)`,
//! `x + (-y)` as `x - y`, `x - (-y)` as `x + y`, `sum(-x)` as `-sum(x)`
//! (and `mean`), and a slice of a `concat` or `pad` that picks out exactly
//! one operand.

use super::{constant_value, Remap};
use crate::dims::Dim;
use crate::ir::{BinaryOp, Graph, Node, Op, UnaryOp, ValueId};

/// Applies the algebraic identities (`x * 1`, `x + 0`, `-(-x)`, `x + (-y)`,
/// a slice of a `concat` or `pad`, ...) once over the graph in topological
/// order, replacements recorded in `remap`; returns how many values changed.
pub fn simplify_algebra(graph: &mut Graph, remap: &mut Remap) -> usize {
    let mut count = 0;
    for v in graph.topo_order().unwrap_or_default() {
        if !graph.contains(v) {
            continue;
        }
        let node = graph.node(v).clone();
        let ops = graph.operands(v);
        let is = |i: usize, c: f64| constant_value(graph, ops[i]) == Some(c);
        let negated = |i: usize| match graph.node(ops[i]).op {
            Op::Unary(UnaryOp::Neg) => graph.operands(ops[i]).first().copied(),
            _ => None,
        };
        let same_type = |i: usize| graph.ty(ops[i]) == &node.ty;
        let replacement: Option<ValueId> = match node.op {
            Op::Binary(BinaryOp::Mul) if is(1, 1.0) && same_type(0) => Some(ops[0]),
            Op::Binary(BinaryOp::Mul) if is(0, 1.0) && same_type(1) => Some(ops[1]),
            Op::Binary(BinaryOp::Add) if is(1, 0.0) && same_type(0) => Some(ops[0]),
            Op::Binary(BinaryOp::Add) if is(0, 0.0) && same_type(1) => Some(ops[1]),
            Op::Binary(BinaryOp::Sub | BinaryOp::Div)
                if is(1, if node.op == Op::Binary(BinaryOp::Sub) { 0.0 } else { 1.0 }) && same_type(0) =>
            {
                Some(ops[0])
            }
            Op::Unary(UnaryOp::Neg) => negated(0),
            Op::Binary(BinaryOp::Add) if negated(1).is_some() => {
                rewrite(graph, v, &node, BinaryOp::Sub, &[ops[0], negated(1).unwrap_or(ops[1])]);
                count += 1;
                None
            }
            Op::Binary(BinaryOp::Sub) if negated(1).is_some() => {
                rewrite(graph, v, &node, BinaryOp::Add, &[ops[0], negated(1).unwrap_or(ops[1])]);
                count += 1;
                None
            }
            // The negation moves past the reduction: one scalar instead of a
            // vector (a LayerNorm's backward sums `-x`), the same bits (negation
            // is exact and rounding symmetric).
            Op::Reduce(reduce) if negated(0).is_some() => {
                let inner = negated(0).unwrap_or(ops[0]);
                let total = graph.add(Op::Reduce(reduce), node.ty.clone(), &[inner], graph.span(v));
                graph.set_node(v, Node { op: Op::Unary(UnaryOp::Neg), ty: node.ty.clone() });
                graph.set_operands(v, &[total]);
                count += 1;
                None
            }
            Op::Slice { ref offset } => slice_of_join(graph, ops[0], offset, &node),
            _ => None,
        };
        if let Some(r) = replacement {
            remap.replace(graph, v, r);
            count += 1;
        }
    }
    count
}

fn rewrite(graph: &mut Graph, v: ValueId, node: &Node, op: BinaryOp, operands: &[ValueId]) {
    graph.set_node(v, Node { op: Op::Binary(op), ty: node.ty.clone() });
    graph.set_operands(v, operands);
}

/// `slice(concat(a, b, c), offset of b)` is `b` when the lengths match;
/// `slice(pad(a, o), o)` is `a`.
fn slice_of_join(graph: &Graph, source: ValueId, offset: &Dim, node: &Node) -> Option<ValueId> {
    match &graph.node(source).op {
        Op::Concat => {
            let mut at = Dim::default();
            for o in graph.operands(source) {
                let ty = graph.ty(o);
                if &at == offset && ty == &node.ty {
                    return Some(o);
                }
                at = at.checked_add(ty.vector_dim()?)?;
            }
            None
        }
        Op::Pad { offset: o } if o == offset => {
            let inner = *graph.operands(source).first()?;
            (graph.ty(inner) == &node.ty).then_some(inner)
        }
        _ => None,
    }
}
