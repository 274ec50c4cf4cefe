//! The kernel IR: what one generated kernel (a pointwise or whole-sequence
//! stage) computes for a row, with every decision a generator makes taken
//! once, here, whatever it emits (Cranelift IR for the CPU, CUDA C++):
//!
//! - which values are literals, and how each input slot is read ([`Kind`]);
//! - which elementwise ops run together in one fused loop, which of their
//!   results are written out ([`Member::stored`]) and which stay in
//!   registers;
//! - every other value lowered to one instruction ([`Item`]): a scalar op,
//!   a broadcast, a slice at its offset, a row reduction, a pad, a concat;
//! - where each vector kept between loops lives in a row's scratch;
//! - which outputs are written in place and which are copied at the end;
//! - for CUDA, whether the stage fits the lane form ([`lanes::Lanes`]).
//!
//! The emitters only print a [`KernelPlan`]; [`eval`] runs one with the
//! interpreter's semantics (the reference back end and the CPU's
//! interpreted kernels), so the plan itself is tested against the oracle.

pub mod cpu_math;
pub mod eval;
pub mod lanes;
mod text;

use crate::ir::{Graph, Op, ReduceOp, ValueId};
use crate::schedule::{Stage, StageKind};
use crate::shapes::Shapes;
use lanes::Lanes;
use std::collections::{HashMap, HashSet};

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
    /// A single float.
    Scalar(f32),
    /// A vector whose elements are all this.
    Splat(f32),
}

/// Where an operand of a fused loop's member comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    /// The `i`-th of the loop's [`FusedLoop::outside`] values (held before the loop).
    Outside(usize),
    /// The `j`-th member's result in this iteration.
    Member(usize),
}

/// One elementwise op of a fused loop.
#[derive(Clone, Debug)]
pub struct Member {
    /// The value the member computes.
    pub value: ValueId,
    /// Its elementwise op.
    pub op: Op,
    /// Where each of its operands comes from, in slot order.
    pub operands: Vec<Operand>,
    /// Written out (to its output, or to scratch): an output, or a value
    /// outside the loop reads it. The others live in registers only.
    pub stored: bool,
}

/// Elementwise ops over vectors of one length, run as one loop.
#[derive(Clone, Debug)]
pub struct FusedLoop {
    /// Elements of every member.
    pub len: usize,
    /// The values held before the loop that members read, in first-read order.
    pub outside: Vec<ValueId>,
    /// The loop's ops, in evaluation order.
    pub members: Vec<Member>,
}

/// One step of a kernel's body, in order.
#[derive(Clone, Debug)]
pub enum Item {
    /// Elementwise ops over vectors of one length, run as one loop.
    Fused(FusedLoop),
    /// `value = op(args)` on single floats (an argument held in memory is
    /// read at element 0); the result stands for a whole vector when `splat`.
    Scalar {
        /// The value computed.
        value: ValueId,
        /// Its op.
        op: Op,
        /// Its operands, in slot order.
        args: Vec<ValueId>,
        /// Whether the result is a vector all of whose elements are the one float.
        splat: bool,
    },
    /// A vector of `src`'s (only or first) element.
    Broadcast {
        /// The vector computed.
        value: ValueId,
        /// The scalar (or splat) repeated.
        src: ValueId,
    },
    /// A view of `src`'s elements from `offset` on (no copy).
    Slice {
        /// The slice.
        value: ValueId,
        /// The vector sliced.
        src: ValueId,
        /// Index of the first element taken.
        offset: usize,
    },
    /// A row reduction over the `len` elements of `src`, in the fixed order
    /// each emitter documents.
    Reduce {
        /// The scalar computed.
        value: ValueId,
        /// The vector reduced.
        src: ValueId,
        /// Sum or mean.
        op: ReduceOp,
        /// Elements of `src`.
        len: usize,
    },
    /// Zeros, with `src` written from `offset` on.
    Pad {
        /// The padded vector.
        value: ValueId,
        /// The vector placed inside it.
        src: ValueId,
        /// Index in `value` of `src`'s first element.
        offset: usize,
    },
    /// The `parts` one after the other.
    Concat {
        /// The joined vector.
        value: ValueId,
        /// The vectors joined, in order.
        parts: Vec<ValueId>,
    },
}

impl Item {
    /// The value an item other than a loop computes (`None` for a loop,
    /// whose members say theirs).
    pub fn value(&self) -> Option<ValueId> {
        match self {
            Item::Fused(_) => None,
            Item::Scalar { value, .. }
            | Item::Broadcast { value, .. }
            | Item::Slice { value, .. }
            | Item::Reduce { value, .. }
            | Item::Pad { value, .. }
            | Item::Concat { value, .. } => Some(*value),
        }
    }

    /// The values an item reads that something before it holds: a loop's
    /// outside values, another item's operands.
    pub fn reads(&self) -> &[ValueId] {
        match self {
            Item::Fused(l) => &l.outside,
            Item::Scalar { args, .. } => args,
            Item::Concat { parts, .. } => parts,
            Item::Broadcast { src, .. }
            | Item::Slice { src, .. }
            | Item::Reduce { src, .. }
            | Item::Pad { src, .. } => std::slice::from_ref(src),
        }
    }
}

/// One output slot of a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Output {
    /// The value written to the slot.
    pub value: ValueId,
    /// The item computing `value` wrote it here already; otherwise the
    /// kernel copies it at the row's end.
    pub in_place: bool,
}

/// Why a stage has no kernel plan: the schedule handed the generator
/// something no kernel computes (a compiler bug).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelError(pub String);

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "kernel plan: {}", self.0)
    }
}

impl std::error::Error for KernelError {}

/// A state chain of a whole-sequence stage: a row's `input` is the
/// previous row's `output` (a state and its next state).
pub type Chain = (ValueId, ValueId);

/// How the kernel of one pointwise or whole-sequence stage computes its values.
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
    /// The output slots, in order (slot `input_count + i` holds `outputs[i]`).
    pub outputs: Vec<Output>,
    /// The kernel's body, in execution order.
    pub items: Vec<Item>,
    /// Where in a row's scratch each vector that is written out but is not
    /// an output lives (in floats), and the floats of scratch a row needs.
    /// (A lane-form CUDA kernel keeps these in registers instead.)
    pub scratch: HashMap<ValueId, usize>,
    /// Floats of scratch one row needs.
    pub scratch_floats: usize,
    /// The rows are one sequence's steps in time order (a whole-sequence stage).
    pub whole_sequence: bool,
    /// The CUDA lane form, when the stage fits it; `None`: the block form.
    pub lanes: Option<Lanes>,
    /// The first output slot of each output value.
    first_output: HashMap<ValueId, usize>,
}

impl KernelPlan {
    /// The plan for a pointwise or whole-sequence `stage` of `graph` at
    /// `shapes`; `chains` are the step's state chains (see [`Chain`]).
    pub fn new(
        graph: &Graph,
        shapes: &Shapes,
        stage: &Stage,
        chains: &[Chain],
    ) -> Result<KernelPlan, KernelError> {
        let whole_sequence = match stage.kind {
            StageKind::Pointwise { .. } => false,
            StageKind::WholeSequence { .. } => true,
            other => return Err(KernelError(format!("a {other:?} stage is not a kernel"))),
        };
        let mut builder = Builder::new(graph, shapes, stage, whole_sequence);
        builder.items(&stage.values)?;
        let mut plan = builder.finish();
        plan.lanes = lanes::decide(graph, shapes, stage, &plan, chains);
        Ok(plan)
    }

    /// The plan for `values` of `graph` as one pointwise stage reading
    /// `inputs` and writing `outputs`: a stage outside any program (tests,
    /// benches).
    pub fn of_values(
        graph: &Graph,
        shapes: &Shapes,
        values: &[ValueId],
        inputs: &[ValueId],
        outputs: &[ValueId],
    ) -> Result<KernelPlan, KernelError> {
        let stage = Stage {
            kind: StageKind::Pointwise { reductions: false },
            placement: crate::schedule::Placement::EachStep,
            values: values.to_vec(),
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
        };
        KernelPlan::new(graph, shapes, &stage, &[])
    }

    /// The first output slot (counted from the first output) of `v`, if it is an output.
    pub fn output_slot(&self, v: ValueId) -> Option<usize> {
        self.first_output.get(&v).copied()
    }

    /// The plan as text (the golden files of `tests/kernel_snapshots.rs`):
    /// the form, literals, input slots, then each item (in a loop, `*`
    /// marks a member written out), where the vectors kept in scratch
    /// live, and the output slots (`copy`: written at the row's end).
    pub fn to_text(&self, graph: &Graph) -> String {
        text::plan(self, graph)
    }
}

/// Builds a [`KernelPlan`]: greedy fusion over the stage's values in order.
struct Builder<'a> {
    graph: &'a Graph,
    shapes: &'a Shapes,
    kinds: HashMap<ValueId, Kind>,
    /// Who reads each value within the stage.
    readers: HashMap<ValueId, Vec<ValueId>>,
    plan: KernelPlan,
    /// The loop being built: its members, and where each is among them.
    open: Vec<ValueId>,
    open_at: HashMap<ValueId, usize>,
}

impl<'a> Builder<'a> {
    fn new(graph: &'a Graph, shapes: &'a Shapes, stage: &Stage, whole_sequence: bool) -> Builder<'a> {
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
        let mut inputs = Vec::new();
        for (i, &v) in stage.inputs.iter().enumerate() {
            if kinds.contains_key(&v) {
                continue;
            }
            let vector = graph.ty(v).vector_dim().is_some() || shapes.elements(v) != 1;
            let kind = if vector { Kind::Vector } else { Kind::Scalar };
            kinds.insert(v, kind);
            inputs.push((i, v, kind));
        }
        let mut first_output = HashMap::new();
        for (i, &v) in stage.outputs.iter().enumerate() {
            first_output.entry(v).or_insert(i);
        }
        let mut readers: HashMap<ValueId, Vec<ValueId>> = HashMap::new();
        for &u in &stage.values {
            for o in graph.operands(u) {
                readers.entry(o).or_default().push(u);
            }
        }
        let outputs = stage.outputs.iter().map(|&value| Output { value, in_place: false }).collect();
        Builder {
            graph,
            shapes,
            kinds,
            readers,
            plan: KernelPlan {
                literals,
                inputs,
                input_count: stage.inputs.len(),
                outputs,
                items: Vec::new(),
                scratch: HashMap::new(),
                scratch_floats: 0,
                whole_sequence,
                lanes: None,
                first_output,
            },
            open: Vec::new(),
            open_at: HashMap::new(),
        }
    }

    /// Elementwise vector ops of one length join the open loop; anything
    /// else, or another length, closes it.
    fn items(&mut self, values: &[ValueId]) -> Result<(), KernelError> {
        for &v in values {
            if self.kinds.contains_key(&v) {
                continue;
            }
            if let Some(o) = self
                .graph
                .operands(v)
                .into_iter()
                .find(|o| !self.open_at.contains_key(o) && self.kind(*o).is_none())
            {
                return Err(KernelError(format!(
                    "{v} reads {o}, which the stage neither reads nor computes before it"
                )));
            }
            if self.fusable(v) {
                if self.open.first().is_some_and(|&first| self.len(first) != self.len(v)) {
                    self.close();
                }
                self.open_at.insert(v, self.open.len());
                self.open.push(v);
                continue;
            }
            if self.graph.operands(v).iter().any(|o| self.open_at.contains_key(o)) {
                self.close();
            }
            let item = self.single(v)?;
            if matches!(item, Item::Pad { .. } | Item::Concat { .. }) {
                self.place(v);
            }
            self.plan.items.push(item);
        }
        self.close();
        Ok(())
    }

    fn finish(mut self) -> KernelPlan {
        // Outputs written in place: by a loop member or a pad/concat, at the value's first slot.
        let mut written: HashSet<ValueId> = HashSet::new();
        for item in &self.plan.items {
            match item {
                Item::Fused(l) => written.extend(l.members.iter().map(|m| m.value)),
                Item::Pad { value, .. } | Item::Concat { value, .. } => {
                    written.insert(*value);
                }
                _ => {}
            }
        }
        for (i, out) in self.plan.outputs.iter_mut().enumerate() {
            out.in_place = written.contains(&out.value) && self.plan.first_output.get(&out.value) == Some(&i);
        }
        self.plan
    }

    fn len(&self, v: ValueId) -> usize {
        self.shapes.elements(v)
    }

    fn kind(&self, v: ValueId) -> Option<Kind> {
        self.kinds.get(&v).copied()
    }

    /// Whether `v` is an elementwise op over a vector that can join the
    /// open loop: at least one operand is in the loop or is a vector held
    /// in memory, so there is a loop to run at all.
    fn fusable(&self, v: ValueId) -> bool {
        if !self.graph.node(v).op.is_elementwise() || self.graph.ty(v).vector_dim().is_none() {
            return false;
        }
        self.graph
            .operands(v)
            .iter()
            .any(|o| self.open_at.contains_key(o) || self.kind(*o) == Some(Kind::Vector))
    }

    /// Ends the open loop: its stored members are vectors from now on, in
    /// their output or in scratch.
    fn close(&mut self) {
        if self.open.is_empty() {
            return;
        }
        let open = std::mem::take(&mut self.open);
        let open_at = std::mem::take(&mut self.open_at);
        // The values read from before the loop, and where each is among them
        // (a loop may have thousands of members).
        let mut outside: Vec<ValueId> = Vec::new();
        let mut outside_at: HashMap<ValueId, usize> = HashMap::new();
        let mut members = Vec::with_capacity(open.len());
        for (i, &v) in open.iter().enumerate() {
            let operands = self
                .graph
                .operands(v)
                .iter()
                .map(|&o| match open_at.get(&o).filter(|&&j| j < i) {
                    Some(&j) => Operand::Member(j),
                    None => Operand::Outside(*outside_at.entry(o).or_insert_with(|| {
                        outside.push(o);
                        outside.len() - 1
                    })),
                })
                .collect();
            let read_outside =
                self.readers.get(&v).is_some_and(|users| users.iter().any(|u| !open_at.contains_key(u)));
            let stored = self.plan.first_output.contains_key(&v) || read_outside;
            members.push(Member { value: v, op: self.graph.node(v).op.clone(), operands, stored });
        }
        for m in members.iter().filter(|m| m.stored) {
            self.kinds.insert(m.value, Kind::Vector);
            self.place(m.value);
        }
        let len = self.len(open[0]);
        self.plan.items.push(Item::Fused(FusedLoop { len, outside, members }));
    }

    /// Gives vector `v` its scratch, unless it is an output (written in place).
    fn place(&mut self, v: ValueId) {
        if !self.plan.first_output.contains_key(&v) {
            self.plan.scratch.insert(v, self.plan.scratch_floats);
            self.plan.scratch_floats += self.len(v);
        }
    }

    /// The item computing `v` on its own, and how it holds the result.
    fn single(&mut self, v: ValueId) -> Result<Item, KernelError> {
        let node = self.graph.node(v);
        let ops = self.graph.operands(v);
        let first = || ops.first().copied().ok_or_else(|| KernelError(format!("{v} has no operand")));
        let (item, kind) = match &node.op {
            Op::Input(_) | Op::State(_) | Op::Param(_) | Op::Mask(_) | Op::Seed(_) => {
                return Err(KernelError(format!("leaf {v} is not among the stage's inputs")))
            }
            Op::Const(_) | Op::DimValue(_) => {
                return Err(KernelError(format!("constant {v} is neither a literal nor an input")))
            }
            Op::MatVec | Op::MatVecT | Op::Outer => {
                return Err(KernelError(format!("{v}: a matrix product in a pointwise stage")))
            }
            Op::Broadcast => (Item::Broadcast { value: v, src: first()? }, Kind::Splat),
            Op::Slice { .. } => {
                let src = first()?;
                let kind = self.kind(src).unwrap_or(Kind::Vector);
                (Item::Slice { value: v, src, offset: self.shapes.offset(v) }, kind)
            }
            Op::Pad { .. } => {
                (Item::Pad { value: v, src: first()?, offset: self.shapes.offset(v) }, Kind::Vector)
            }
            Op::Concat => (Item::Concat { value: v, parts: ops.clone() }, Kind::Vector),
            Op::Reduce(op) => {
                let src = first()?;
                (Item::Reduce { value: v, src, op: *op, len: self.len(src) }, Kind::Scalar)
            }
            // A vector op reaches here only when every operand is a scalar or a splat.
            Op::Unary(_) | Op::Binary(_) | Op::Select => {
                let splat = self.graph.ty(v).vector_dim().is_some();
                let item = Item::Scalar { value: v, op: node.op.clone(), args: ops.clone(), splat };
                (item, if splat { Kind::Splat } else { Kind::Scalar })
            }
        };
        self.kinds.insert(v, kind);
        Ok(item)
    }
}
