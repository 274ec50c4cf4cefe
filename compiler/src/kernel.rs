//! Decisions every kernel generator makes the same way, whatever it emits
//! (Cranelift IR for the CPU, CUDA C++): where a slice starts, and which
//! values join a fused elementwise loop.

use crate::interp::Plan;
use crate::ir::{Graph, Op, ValueId};

/// Where a slice starts in its operand, or a pad's operand in its result.
pub fn slice_offset(graph: &Graph, plan: &Plan, v: ValueId) -> usize {
    let src = graph.operands(v)[0];
    match graph.node(v).op {
        Op::Slice { .. } => {
            // A slice of [0, 1, 2, ...] gives its own offset as the first element.
            let iota: Vec<f32> = (0..plan.elements(src)).map(|i| i as f32).collect();
            plan.compute(graph, v, &[&iota]).first().map_or(0, |x| *x as usize)
        }
        Op::Pad { .. } => {
            let ones = vec![1.0f32; plan.elements(src)];
            plan.compute(graph, v, &[&ones]).iter().position(|x| *x == 1.0).unwrap_or(0)
        }
        _ => 0,
    }
}

/// Whether `v` is an elementwise op over a vector that can join the fused
/// loop of `group`: at least one operand is in the group or is a vector
/// held in memory (`in_memory`), so there is a loop to run at all.
pub fn fusable(graph: &Graph, v: ValueId, group: &[ValueId], in_memory: impl Fn(ValueId) -> bool) -> bool {
    if !matches!(graph.node(v).op, Op::Unary(_) | Op::Binary(_)) || graph.ty(v).vector_dim().is_none() {
        return false;
    }
    graph.operands(v).iter().any(|&o| group.contains(&o) || in_memory(o))
}
