//! Which forward values the backward step reads from memory (saved during
//! the forward pass) and which it recomputes.
//!
//! The choice is a minimum cut, as in functorch's rematerialising
//! partitioner: every forward value the backward needs must be either saved
//! or recomputable from saved values; saving a value costs its size;
//! leaves (inputs, states, parameters, constants) and the step's output and
//! next states cost nothing, because the runtime keeps them anyway (the
//! input and output sequences, the state history). Matrix products are never
//! recomputed, nor are reductions (a LayerNorm's mean and variance): one
//! float to save against a pass over the operand to redo, functorch's rule
//! for reductions. Among all cuts, the smallest total size is taken, so
//! cheap pointwise work (a sigmoid, a tanh) is redone rather than stored.

use crate::autodiff::Gradient;
use crate::dims::Bindings;
use crate::ir::{Graph, Op, Type, ValueId};
use std::collections::{HashMap, HashSet, VecDeque};

/// The forward part of a backward step, split into saved and recomputed values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SavedValues {
    /// Read from memory: stored once per step by the forward pass.
    pub saved: Vec<ValueId>,
    /// Leaves, output and next states the backward reads: kept by the runtime anyway.
    pub free: Vec<ValueId>,
    /// Forward values the backward step computes again.
    pub recomputed: Vec<ValueId>,
}

/// Whether `v` depends on a seed (is backward work) or not (forward work).
pub(crate) fn backward_values(graph: &Graph) -> HashSet<ValueId> {
    let mut out = HashSet::new();
    for v in graph.topo_order().unwrap_or_default() {
        if matches!(graph.node(v).op, Op::Seed(_)) || graph.operands(v).iter().any(|o| out.contains(o)) {
            out.insert(v);
        }
    }
    out
}

fn is_free(grad: &Gradient, v: ValueId) -> bool {
    matches!(
        grad.graph.node(v).op,
        Op::Input(_) | Op::State(_) | Op::Param(_) | Op::Mask(_) | Op::Const(_) | Op::DimValue(_)
    ) || grad.primal_output == Some(v)
        || grad.primal_next_states.contains(&Some(v))
}

/// A value computed from constants only (`broadcast(const 1)`): recomputing it is free.
fn constant_only(graph: &Graph, v: ValueId) -> bool {
    match graph.node(v).op {
        Op::Const(_) | Op::DimValue(_) => true,
        Op::Input(_) | Op::State(_) | Op::Param(_) | Op::Mask(_) | Op::Seed(_) => false,
        _ => graph.operands(v).iter().all(|o| constant_only(graph, *o)),
    }
}

/// Matrix products, and reductions: a LayerNorm-LSTM's backward that reads
/// its three norms' statistics runs 3.4-4.4 µs a row at H=256 instead of
/// 4.6-4.8 (an Intel Xeon, one thread, AVX-512 walker): four floats of tape
/// a row against two passes over `4H` and three reductions.
fn never_recomputed(graph: &Graph, v: ValueId) -> bool {
    matches!(graph.node(v).op, Op::MatVec | Op::MatVecT | Op::Outer | Op::Reduce(_))
}

/// Elements of `v` at `sizes`, for weighing the cut; unbound sizes count as 64.
fn weight(graph: &Graph, v: ValueId, sizes: &Bindings) -> f64 {
    let eval = |d: &crate::dims::Dim| {
        let mut b = sizes.clone();
        for var in d.variables() {
            b.entry(var).or_insert(64);
        }
        d.eval(&b).map(|x| x.max(1) as f64).unwrap_or(1e12)
    };
    match graph.ty(v) {
        Type::Scalar => 1.0,
        Type::Vector(d) => eval(d),
        Type::Matrix(h, m, n) => eval(h) * eval(m) * eval(n),
    }
}

/// Splits the forward values of `grad` into saved, free and recomputed ones.
/// `sizes` weigh the values (unbound sizes count as 64).
pub fn choose_saved(grad: &Gradient, sizes: &Bindings) -> SavedValues {
    let g = &grad.graph;
    let backward = backward_values(g);
    let forward: Vec<ValueId> =
        g.topo_order().unwrap_or_default().into_iter().filter(|v| !backward.contains(v)).collect();
    // Forward values the backward reads directly.
    let needed: HashSet<ValueId> =
        backward.iter().flat_map(|&b| g.operands(b)).filter(|o| !backward.contains(o)).collect();

    // Flow network: each forward value v is split into v_in -> v_out with
    // capacity = its size (0 when free); operand edges and the source/sink
    // edges are unbounded.
    const INF: f64 = 1e30;
    let index: HashMap<ValueId, usize> = forward.iter().enumerate().map(|(i, v)| (*v, i)).collect();
    let (source, sink) = (2 * forward.len(), 2 * forward.len() + 1);
    let mut net = FlowNetwork::new(2 * forward.len() + 2);
    let n = forward.len() as f64;
    let free: HashSet<ValueId> =
        forward.iter().copied().filter(|&v| is_free(grad, v) || constant_only(g, v)).collect();
    for (i, &v) in forward.iter().enumerate() {
        // Free values are a cut point of cost 0. Others cost their size, a
        // hair more for earlier values, so that among equal cuts the one
        // closest to the backward (least recomputation) wins.
        let cost = if free.contains(&v) {
            0.0
        } else if !grad.is_primal(v) {
            // Derived in the backward only: the forward never has it to save.
            INF
        } else {
            weight(g, v, sizes) * (1.0 + 1e-6 * (n - i as f64) / n)
        };
        net.add_edge(2 * i, 2 * i + 1, cost);
        for o in g.operands(v) {
            if let Some(&j) = index.get(&o) {
                net.add_edge(2 * j + 1, 2 * i, INF);
            }
        }
        if g.operands(v).is_empty() || never_recomputed(g, v) {
            net.add_edge(source, 2 * i, INF);
        }
        if needed.contains(&v) {
            net.add_edge(2 * i + 1, sink, INF);
        }
    }
    let reachable = net.min_cut_source_side(source, sink);

    let mut out = SavedValues::default();
    for (i, &v) in forward.iter().enumerate() {
        if free.contains(&v) {
            if needed.contains(&v) && !constant_only(g, v) {
                out.free.push(v);
            }
        } else if reachable[2 * i] && !reachable[2 * i + 1] {
            out.saved.push(v);
        }
    }
    // Recomputed: what the backward needs behind the saved and free values.
    let stop: HashSet<ValueId> = out.saved.iter().chain(&out.free).copied().collect();
    let mut seen: HashSet<ValueId> = HashSet::new();
    let mut stack: Vec<ValueId> = needed.iter().copied().filter(|v| !stop.contains(v)).collect();
    while let Some(v) = stack.pop() {
        if stop.contains(&v) || free.contains(&v) || !seen.insert(v) {
            continue;
        }
        stack.extend(g.operands(v));
    }
    out.recomputed = forward.iter().copied().filter(|v| seen.contains(v)).collect();
    out
}

/// A small max-flow network (Edmonds–Karp); graphs here have a few hundred nodes.
struct FlowNetwork {
    /// `(to, capacity, reverse edge index)` per node.
    edges: Vec<Vec<(usize, f64, usize)>>,
}

impl FlowNetwork {
    fn new(n: usize) -> FlowNetwork {
        FlowNetwork { edges: vec![Vec::new(); n] }
    }

    fn add_edge(&mut self, from: usize, to: usize, cap: f64) {
        let rev_from = self.edges[to].len();
        let rev_to = self.edges[from].len();
        self.edges[from].push((to, cap, rev_from));
        self.edges[to].push((from, 0.0, rev_to));
    }

    /// Saturates the network, then returns which nodes the source still reaches.
    fn min_cut_source_side(&mut self, source: usize, sink: usize) -> Vec<bool> {
        loop {
            // Breadth-first search for an augmenting path.
            let mut prev: Vec<Option<(usize, usize)>> = vec![None; self.edges.len()];
            let mut queue = VecDeque::from([source]);
            let mut seen = vec![false; self.edges.len()];
            seen[source] = true;
            while let Some(u) = queue.pop_front() {
                for (k, &(to, cap, _)) in self.edges[u].iter().enumerate() {
                    if cap > 1e-9 && !seen[to] {
                        seen[to] = true;
                        prev[to] = Some((u, k));
                        queue.push_back(to);
                    }
                }
            }
            if !seen[sink] {
                return seen;
            }
            let mut bottleneck = f64::INFINITY;
            let mut at = sink;
            while let Some((u, k)) = prev[at] {
                bottleneck = bottleneck.min(self.edges[u][k].1);
                at = u;
            }
            let mut at = sink;
            while let Some((u, k)) = prev[at] {
                let (to, _, rev) = self.edges[u][k];
                self.edges[u][k].1 -= bottleneck;
                self.edges[to][rev].1 += bottleneck;
                at = u;
            }
        }
    }
}
