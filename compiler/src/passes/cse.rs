//! Common-subexpression elimination: two values with the same op, type and
//! operands are one value. Operands of commutative ops are compared as a
//! set, so `a * b` and `b * a` merge. This is also what makes the backward
//! step reuse forward values, e.g. `1 - z` of a GRU in `sigmoid'(z)`.

use super::Remap;
use crate::ir::{BinaryOp, Graph, Op, Type, ValueId};
use std::collections::HashMap;

/// A hashable identity for a value: op (with constants by bit pattern), type, operands.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    op: String,
    ty: Type,
    operands: Vec<ValueId>,
}

/// Replaces each value by the first earlier value with the same op, type and
/// operands (recorded in `remap`); returns how many were replaced. The
/// replaced values stay in the graph, unused, until dead values are removed.
pub fn eliminate_common_subexpressions(graph: &mut Graph, remap: &mut Remap) -> usize {
    let mut seen: HashMap<Key, ValueId> = HashMap::new();
    let mut count = 0;
    for v in graph.topo_order().unwrap_or_default() {
        let node = graph.node(v).clone();
        let mut operands = graph.operands(v);
        if is_commutative(&node.op) {
            operands.sort();
        }
        let op = match &node.op {
            Op::Const(c) => format!("const {:x}", c.to_bits()),
            other => format!("{other:?}"),
        };
        let key = Key { op, ty: node.ty, operands };
        match seen.get(&key) {
            Some(&first) => {
                remap.replace(graph, v, first);
                count += 1;
            }
            None => {
                seen.insert(key, v);
            }
        }
    }
    count
}

fn is_commutative(op: &Op) -> bool {
    matches!(op, Op::Binary(BinaryOp::Add | BinaryOp::Mul | BinaryOp::Min | BinaryOp::Max))
}
