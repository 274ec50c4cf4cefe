//! The decisions every kernel generator makes the same way, whatever it
//! emits (Cranelift IR for the CPU, CUDA C++), made once: a
//! [`KernelPlan`] says which values are literals, how each input slot is
//! read, which values run together in one fused elementwise loop (and
//! which of those are written out), and in what order. The emitters only
//! print it. (Where a slice starts is [`crate::interp::Shapes::offset`].)

use crate::interp::Shapes;
use crate::ir::{Graph, Op, ValueId};
use std::collections::HashMap;

/// How a kernel holds a value, as far as its structure is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// One float.
    Scalar,
    /// One float standing for every element of a vector.
    Splat,
    /// Elements of its own (in memory, or one per thread in registers).
    Vector,
}

/// A value known when the kernel is generated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Literal {
    Scalar(f32),
    /// A vector whose elements are all this.
    Splat(f32),
}

/// One step of a kernel's body, in order.
#[derive(Clone, Debug)]
pub enum Item {
    /// Elementwise ops over vectors of one length, as one loop; intermediate
    /// results stay in registers (see [`KernelPlan::stored`]).
    Fused(FusedGroup),
    /// A value computed on its own (a reduction, a slice, a scalar op, ...).
    Single(ValueId),
}

/// How the kernel of one pointwise stage computes its values.
#[derive(Clone, Debug)]
pub struct KernelPlan {
    /// Values computed from constants only that the kernel writes as literals
    /// (even where they are also inputs).
    pub literals: Vec<(ValueId, Literal)>,
    /// Each input slot not shadowed by a literal: `(slot, value, kind)`,
    /// `kind` [`Kind::Vector`] or [`Kind::Scalar`].
    pub inputs: Vec<(usize, ValueId, Kind)>,
    /// Slots before the outputs (the stage's inputs, literals included).
    pub input_count: usize,
    /// The first output slot of each output value (0 is the first after the inputs).
    pub outputs: HashMap<ValueId, usize>,
    pub items: Vec<Item>,
    /// Where in a row's scratch each vector that is written out but is not
    /// an output lives (in floats), and the floats of scratch a row needs.
    /// (A lane-form CUDA kernel keeps these in registers instead.)
    pub scratch: HashMap<ValueId, usize>,
    pub scratch_floats: usize,
    readers: Readers,
}

impl KernelPlan {
    /// The plan for the stage computing `values` from `inputs` into `outputs`.
    pub fn new(
        graph: &Graph,
        shapes: &Shapes,
        values: &[ValueId],
        inputs: &[ValueId],
        outputs: &[ValueId],
    ) -> KernelPlan {
        let mut kinds: HashMap<ValueId, Kind> = HashMap::new();
        let mut literals = Vec::new();
        for (v, value) in shapes.constant_values::<f32>(graph) {
            let literal = match (value.len(), &graph.node(v).op) {
                (1, Op::Const(_) | Op::DimValue(_)) => Literal::Scalar(value[0]),
                (n, Op::Broadcast) if n > 0 && value.iter().all(|x| x.to_bits() == value[0].to_bits()) => {
                    Literal::Splat(value[0])
                }
                _ => continue, // a vector constant: read through its input pointer
            };
            kinds.insert(v, if matches!(literal, Literal::Scalar(_)) { Kind::Scalar } else { Kind::Splat });
            literals.push((v, literal));
        }
        let mut slots = Vec::new();
        for (i, &v) in inputs.iter().enumerate() {
            if kinds.contains_key(&v) {
                continue;
            }
            let vector = graph.ty(v).vector_dim().is_some() || shapes.elements(v) != 1;
            let kind = if vector { Kind::Vector } else { Kind::Scalar };
            kinds.insert(v, kind);
            slots.push((i, v, kind));
        }
        let mut output_slots = HashMap::new();
        for (i, &v) in outputs.iter().enumerate() {
            output_slots.entry(v).or_insert(i);
        }
        let readers = Readers::of(graph, values);
        let mut plan = KernelPlan {
            literals,
            inputs: slots,
            input_count: inputs.len(),
            outputs: output_slots,
            items: Vec::new(),
            scratch: HashMap::new(),
            scratch_floats: 0,
            readers,
        };
        // Greedy fusion: elementwise vector ops of one length join the open
        // loop; anything else, or another length, closes it.
        let mut group = FusedGroup::default();
        for &v in values {
            if kinds.contains_key(&v) {
                continue;
            }
            let reads_group = graph.operands(v).iter().any(|&o| group.contains(o));
            if fusable(graph, v, &group, |o| kinds.get(&o) == Some(&Kind::Vector)) {
                if group.members().first().is_some_and(|&first| shapes.elements(first) != shapes.elements(v))
                {
                    plan.close(&mut group, &mut kinds, shapes);
                }
                group.push(v);
                continue;
            }
            if reads_group {
                plan.close(&mut group, &mut kinds, shapes);
            }
            kinds.insert(v, single_kind(graph, v, &kinds));
            if matches!(graph.node(v).op, Op::Pad { .. } | Op::Concat) {
                plan.place(v, shapes);
            }
            plan.items.push(Item::Single(v));
        }
        plan.close(&mut group, &mut kinds, shapes);
        plan
    }

    /// Ends the open loop: its stored members are vectors from now on, in
    /// their output or in scratch.
    fn close(&mut self, group: &mut FusedGroup, kinds: &mut HashMap<ValueId, Kind>, shapes: &Shapes) {
        if group.is_empty() {
            return;
        }
        let group = group.take();
        for &v in group.members() {
            if self.stored(&group, v) {
                kinds.insert(v, Kind::Vector);
                self.place(v, shapes);
            }
        }
        self.items.push(Item::Fused(group));
    }

    /// Gives vector `v` its scratch, unless it is an output (written in place).
    fn place(&mut self, v: ValueId, shapes: &Shapes) {
        if !self.outputs.contains_key(&v) {
            self.scratch.insert(v, self.scratch_floats);
            self.scratch_floats += shapes.elements(v);
        }
    }

    /// Whether member `v` of `group` is written out: it is an output, or a
    /// value outside the loop reads it. The others live in registers only.
    pub fn stored(&self, group: &FusedGroup, v: ValueId) -> bool {
        self.outputs.contains_key(&v) || self.readers.outside(v, group)
    }

    /// The plan as text (the golden files of `tests/kernel_snapshots.rs`):
    /// literals, input slots, then each loop with its members (`*` marks
    /// one written out) and each value computed on its own, then where the
    /// vectors kept in scratch live, and the output slots.
    pub fn to_text(&self, graph: &Graph, shapes: &Shapes) -> String {
        use std::fmt::Write;
        let names = crate::ir::print::LeafNames::default();
        let line = |v: ValueId| crate::ir::print::value_line(graph, &names, v);
        let mut out = String::new();
        for (v, literal) in &self.literals {
            let _ = writeln!(out, "literal {v} = {literal:?}");
        }
        for (slot, v, kind) in &self.inputs {
            let _ = writeln!(out, "in a[{slot}] {v}: {kind:?}");
        }
        for item in &self.items {
            match item {
                Item::Fused(group) => {
                    let len = group.members().first().map_or(0, |&v| shapes.elements(v));
                    let _ = writeln!(out, "loop over {len}:");
                    for &v in group.members() {
                        let mark = if self.stored(group, v) { "*" } else { " " };
                        let _ = writeln!(out, "  {mark} {}", line(v));
                    }
                }
                Item::Single(v) => {
                    let _ = writeln!(out, "single {}", line(*v));
                }
            }
        }
        let mut scratch: Vec<(usize, ValueId)> = self.scratch.iter().map(|(&v, &at)| (at, v)).collect();
        scratch.sort();
        for (at, v) in scratch {
            let _ = writeln!(out, "scratch {v} at {at}");
        }
        let mut outputs: Vec<(usize, ValueId)> = self.outputs.iter().map(|(&v, &slot)| (slot, v)).collect();
        outputs.sort();
        for (slot, v) in outputs {
            let _ = writeln!(out, "out a[{}] {v}", self.input_count + slot);
        }
        out
    }
}

/// How a value computed on its own is held, given its operands'.
fn single_kind(graph: &Graph, v: ValueId, kinds: &HashMap<ValueId, Kind>) -> Kind {
    let operand = |i: usize| graph.operands(v).get(i).and_then(|o| kinds.get(o).copied());
    match graph.node(v).op {
        Op::Broadcast => Kind::Splat,
        Op::Slice { .. } => operand(0).unwrap_or(Kind::Vector),
        Op::Pad { .. } | Op::Concat => Kind::Vector,
        // Vector ops reach here only when every operand is a scalar or a splat.
        Op::Unary(_) | Op::Binary(_) if graph.ty(v).vector_dim().is_some() => Kind::Splat,
        _ => Kind::Scalar,
    }
}

/// The members of a fused elementwise loop, in order, with constant-time
/// membership and position (a stage may fuse thousands of values).
#[derive(Clone, Debug, Default)]
pub struct FusedGroup {
    members: Vec<ValueId>,
    index: HashMap<ValueId, usize>,
}

impl FusedGroup {
    fn push(&mut self, v: ValueId) {
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

    fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The members so far, leaving the group empty.
    fn take(&mut self) -> FusedGroup {
        std::mem::take(self)
    }
}

/// Who reads each value within a stage, so that a fused loop can tell in
/// time linear in the stage which members a value outside the loop reads.
#[derive(Clone, Debug, Default)]
struct Readers(HashMap<ValueId, Vec<ValueId>>);

impl Readers {
    /// The readers among `values` of each of their operands.
    fn of(graph: &Graph, values: &[ValueId]) -> Readers {
        let mut readers: HashMap<ValueId, Vec<ValueId>> = HashMap::new();
        for &u in values {
            for o in graph.operands(u) {
                readers.entry(o).or_default().push(u);
            }
        }
        Readers(readers)
    }

    /// Whether a value outside `group` reads `v`.
    fn outside(&self, v: ValueId, group: &FusedGroup) -> bool {
        self.0.get(&v).is_some_and(|users| users.iter().any(|&u| !group.contains(u)))
    }
}

/// Whether `v` is an elementwise op over a vector that can join the fused
/// loop of `group`: at least one operand is in the group or is a vector
/// held in memory (`in_memory`), so there is a loop to run at all.
fn fusable(graph: &Graph, v: ValueId, group: &FusedGroup, in_memory: impl Fn(ValueId) -> bool) -> bool {
    if !matches!(graph.node(v).op, Op::Unary(_) | Op::Binary(_)) || graph.ty(v).vector_dim().is_none() {
        return false;
    }
    graph.operands(v).iter().any(|&o| group.contains(o) || in_memory(o))
}
