//! Constant folding: elementwise ops whose operands are all constants
//! (scalars, or broadcast scalars) become one constant.

use super::{constant_value, make_constant, Remap};
use crate::ir::op::{apply_binary, apply_unary};
use crate::ir::{Graph, Op};

/// Replaces each unary or binary op whose operands are constants by the
/// constant it computes, when that is finite (recorded in `remap`); returns
/// how many were replaced. The replaced values stay in the graph, unused.
pub fn fold_constants(graph: &mut Graph, remap: &mut Remap) -> usize {
    let mut count = 0;
    for v in graph.topo_order().unwrap_or_default() {
        let node = graph.node(v).clone();
        let ops = graph.operands(v);
        let folded = match node.op {
            Op::Unary(op) => constant_value(graph, ops[0]).map(|a| apply_unary(op, a)),
            Op::Binary(op) => match (constant_value(graph, ops[0]), constant_value(graph, ops[1])) {
                (Some(a), Some(b)) => Some(apply_binary(op, a, b)),
                _ => None,
            },
            _ => None,
        };
        if let Some(c) = folded.filter(|c| c.is_finite()) {
            let k = make_constant(graph, c, &node.ty, v);
            remap.replace(graph, v, k);
            count += 1;
        }
    }
    count
}
