//! Decisions every kernel generator makes the same way, whatever it emits
//! (Cranelift IR for the CPU, CUDA C++): which values join a fused
//! elementwise loop, and which members of it are read outside. (Where a
//! slice starts is [`crate::interp::Shapes::offset`].)

use crate::ir::{Graph, Op, ValueId};
use std::collections::HashMap;

/// The members of a fused elementwise loop, in order, with constant-time
/// membership and position (a stage may fuse thousands of values).
#[derive(Clone, Debug, Default)]
pub struct FusedGroup {
    members: Vec<ValueId>,
    index: HashMap<ValueId, usize>,
}

impl FusedGroup {
    pub fn push(&mut self, v: ValueId) {
        self.index.insert(v, self.members.len());
        self.members.push(v);
    }

    pub fn contains(&self, v: ValueId) -> bool {
        self.index.contains_key(&v)
    }

    /// Where `v` is among the members.
    pub fn position(&self, v: ValueId) -> Option<usize> {
        self.index.get(&v).copied()
    }

    pub fn members(&self) -> &[ValueId] {
        &self.members
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The members so far, leaving the group empty.
    pub fn take(&mut self) -> FusedGroup {
        std::mem::take(self)
    }
}

/// Who reads each value within a stage, so that a fused loop can tell in
/// time linear in the stage which members a value outside the loop reads.
#[derive(Clone, Debug, Default)]
pub struct Readers(HashMap<ValueId, Vec<ValueId>>);

impl Readers {
    /// The readers among `values` of each of their operands.
    pub fn of(graph: &Graph, values: &[ValueId]) -> Readers {
        let mut readers: HashMap<ValueId, Vec<ValueId>> = HashMap::new();
        for &u in values {
            for o in graph.operands(u) {
                readers.entry(o).or_default().push(u);
            }
        }
        Readers(readers)
    }

    /// Whether a value outside `group` reads `v`.
    pub fn outside(&self, v: ValueId, group: &FusedGroup) -> bool {
        self.0.get(&v).is_some_and(|users| users.iter().any(|&u| !group.contains(u)))
    }
}

/// Whether `v` is an elementwise op over a vector that can join the fused
/// loop of `group`: at least one operand is in the group or is a vector
/// held in memory (`in_memory`), so there is a loop to run at all.
pub fn fusable(graph: &Graph, v: ValueId, group: &FusedGroup, in_memory: impl Fn(ValueId) -> bool) -> bool {
    if !matches!(graph.node(v).op, Op::Unary(_) | Op::Binary(_)) || graph.ty(v).vector_dim().is_none() {
        return false;
    }
    graph.operands(v).iter().any(|&o| group.contains(o) || in_memory(o))
}
