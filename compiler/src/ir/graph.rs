//! The value graph itself: nodes, operand edges, spans, and the queries
//! every pass needs. [`super::Cell`] (a forward step) and
//! [`crate::autodiff::Gradient`] (its backward step) both hold one.

use super::{Node, Op, Type, ValueId};
use crate::diag::Span;
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::collections::HashMap;

impl ValueId {
    fn node(self) -> NodeIndex<u32> {
        NodeIndex::new(self.0 as usize)
    }
    fn from_node(n: NodeIndex<u32>) -> ValueId {
        ValueId(n.index() as u32)
    }
}

/// A dataflow graph of values. Edges run from operand to user and carry
/// the operand's slot; spans live in a side table.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    graph: StableDiGraph<Node, u32, u32>,
    spans: HashMap<ValueId, Span>,
}

impl Graph {
    /// Adds a value computed by `op` from `operands` (in slot order).
    pub fn add(&mut self, op: Op, ty: Type, operands: &[ValueId], span: Option<Span>) -> ValueId {
        let n = self.graph.add_node(Node { op, ty });
        for (slot, o) in operands.iter().enumerate() {
            self.graph.add_edge(o.node(), n, slot as u32);
        }
        let id = ValueId::from_node(n);
        if let Some(s) = span {
            self.spans.insert(id, s);
        }
        id
    }

    /// The value's op and type. Panics if `v` is not in the graph.
    pub fn node(&self, v: ValueId) -> &Node {
        &self.graph[v.node()]
    }

    /// Whether `v` is a value of this graph (not removed).
    pub fn contains(&self, v: ValueId) -> bool {
        self.graph.contains_node(v.node())
    }

    /// The value's type. Panics if `v` is not in the graph.
    pub fn ty(&self, v: ValueId) -> &Type {
        &self.node(v).ty
    }

    /// Where the value comes from in the source, when known.
    pub fn span(&self, v: ValueId) -> Option<Span> {
        self.spans.get(&v).copied()
    }

    /// The value's operands, in slot order.
    pub fn operands(&self, v: ValueId) -> Vec<ValueId> {
        let mut e: Vec<(u32, ValueId)> = self
            .graph
            .edges_directed(v.node(), Direction::Incoming)
            .map(|e| (*e.weight(), ValueId::from_node(e.source())))
            .collect();
        e.sort_unstable_by_key(|(slot, _)| *slot);
        e.into_iter().map(|(_, v)| v).collect()
    }

    /// Operand slots as stored (for the verifier).
    pub(crate) fn operand_slots(&self, v: ValueId) -> Vec<u32> {
        let mut s: Vec<u32> =
            self.graph.edges_directed(v.node(), Direction::Incoming).map(|e| *e.weight()).collect();
        s.sort_unstable();
        s
    }

    /// The values that read `v` (once per use).
    pub fn users(&self, v: ValueId) -> Vec<ValueId> {
        self.graph
            .edges_directed(v.node(), Direction::Outgoing)
            .map(|e| ValueId::from_node(e.target()))
            .collect()
    }

    /// Every value, in index order.
    pub fn values(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.graph.node_indices().map(ValueId::from_node)
    }

    /// Number of values (removed ones not counted).
    pub fn value_count(&self) -> usize {
        self.graph.node_count()
    }

    /// One past the largest value index (for dense side tables).
    pub fn value_bound(&self) -> usize {
        petgraph::visit::NodeIndexable::node_bound(&self.graph)
    }

    /// Values in an order where operands come before users, lowest index
    /// first among the ready ones (so dumps follow the source); `Err` names
    /// a value on a cycle, which only a broken pass can make.
    pub fn topo_order(&self) -> Result<Vec<ValueId>, ValueId> {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let mut pending = vec![0usize; self.value_bound()];
        let mut ready = BinaryHeap::new();
        for v in self.values() {
            pending[v.index()] = self.graph.edges_directed(v.node(), Direction::Incoming).count();
            if pending[v.index()] == 0 {
                ready.push(Reverse(v));
            }
        }
        let mut order = Vec::with_capacity(self.value_count());
        while let Some(Reverse(v)) = ready.pop() {
            order.push(v);
            for e in self.graph.edges_directed(v.node(), Direction::Outgoing) {
                let u = ValueId::from_node(e.target());
                pending[u.index()] -= 1;
                if pending[u.index()] == 0 {
                    ready.push(Reverse(u));
                }
            }
        }
        if order.len() == self.value_count() {
            Ok(order)
        } else {
            Err(self.values().find(|v| pending[v.index()] > 0).unwrap_or(ValueId(0)))
        }
    }

    /// Removes values none of `roots` depends on; returns how many.
    pub fn remove_dead_values(&mut self, roots: &[ValueId]) -> usize {
        let mut live = vec![false; self.value_bound()];
        let mut stack: Vec<ValueId> = roots.to_vec();
        while let Some(v) = stack.pop() {
            if !self.contains(v) || std::mem::replace(&mut live[v.index()], true) {
                continue;
            }
            stack.extend(self.operands(v));
        }
        let dead = self.values().filter(|v| !live[v.index()]).count();
        if dead > 0 {
            // One rebuild (indices preserved), not a `remove_node` each:
            // unlinking an edge walks its source's list of uses, so removing
            // the users of a value read thousands of times (a shared
            // constant) one by one would take quadratic time.
            self.graph =
                self.graph.filter_map(|n, node| live[n.index()].then(|| node.clone()), |_, &slot| Some(slot));
            self.spans.retain(|v, _| live[v.index()]);
        }
        dead
    }

    /// Makes every user of `old` read `new` instead (same slots).
    pub(crate) fn replace_uses(&mut self, old: ValueId, new: ValueId) {
        let uses: Vec<(ValueId, u32)> = self
            .graph
            .edges_directed(old.node(), Direction::Outgoing)
            .map(|e| (ValueId::from_node(e.target()), *e.weight()))
            .collect();
        let edges: Vec<_> =
            self.graph.edges_directed(old.node(), Direction::Outgoing).map(|e| e.id()).collect();
        for e in edges {
            self.graph.remove_edge(e);
        }
        for (user, slot) in uses {
            self.graph.add_edge(new.node(), user.node(), slot);
        }
    }

    /// Replaces a value's op and type in place (operands unchanged).
    pub(crate) fn set_node(&mut self, v: ValueId, node: Node) {
        self.graph[v.node()] = node;
    }

    /// Replaces a value's operands.
    pub(crate) fn set_operands(&mut self, v: ValueId, operands: &[ValueId]) {
        let edges: Vec<_> =
            self.graph.edges_directed(v.node(), Direction::Incoming).map(|e| e.id()).collect();
        for e in edges {
            self.graph.remove_edge(e);
        }
        for (slot, o) in operands.iter().enumerate() {
            self.graph.add_edge(o.node(), v.node(), slot as u32);
        }
    }
}
