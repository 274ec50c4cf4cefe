//! Pointwise stages run by vector code that walks their kernel plans, on
//! AVX-512 or on AVX2 with FMA: one walker, generic over the instruction
//! set ([`Lanes`]).
//!
//! Cranelift's x86-64 back end stops at 128-bit vectors and sixteen `xmm`
//! registers: an LSTM's step spent as long in its `f32x4` kernels, mostly
//! spilling polynomial constants, as in its products. Here a stage's
//! [`KernelPlan`] is turned once into a list of steps, and each row walks
//! it: a fused loop runs 128 floats at a time (eight `zmm` registers, or
//! sixteen `ymm`), each member's op on all of them at once (its `math`),
//! its result kept in a small register file in L1 for the members after
//! it. The per-op dispatch is paid once per 128 elements (measured on
//! AVX-512 against 64 and 256: 13% and 20% faster on the LSTM's forward
//! stage at H=128). The vectors a loop reads from before it are read where
//! they lie in whole passes, not copied into the register file first
//! (unless one of the loop's members stores over them): on a Xeon, the LSTM's
//! forward stage took 10-17% less time on AVX-512 and 5-30% less on AVX2.
//!
//! Every decision is the plan's, as for the emitter ([`cellc::clif`]): the
//! same items in the same order, the same literals, stores, scratch and
//! copies, and row sums added in the emitter's order. Each lane computes
//! what the emitter's instruction computes, so the results are bitwise
//! those of Cranelift's code (tested against the JIT on every stage of
//! every shipped cell and on random cells, for both sets); which of the
//! three runs a stage never changes a number.
//!
//! The walker and its math are written once, `#[inline(always)]`, and a
//! stage's rows run inside [`Lanes::enter`]: each set gets its own copy,
//! compiled for it, with every operation one of its instructions.
//!
//! On either set ([`Lanes::COMPILED`]) each fused loop is also compiled to
//! machine code (`compiled.rs`): the same math traced once (`trace.rs`)
//! and emitted with every value in registers (`emit.rs`), several vectors an
//! iteration, instead of a pass's values going through the register file
//! op by op. Same instructions, same bits; the pointwise stages take about
//! 0.5-0.85x the walked time. A row whose loop cannot run compiled (an
//! input held otherwise than the plan said, a store overlapping an input
//! but exactly) is walked.

mod compiled;
mod emit;
mod lanes;
mod math;
mod target;
mod trace;

pub use lanes::{Avx2, Avx512, Lanes, Math};
pub use target::Target;

use super::stage::StageExec;
use cellc::ir::{Op, ReduceOp, ValueId};
use cellc::kernel::cpu_math::SUM_CHAINS;
use cellc::kernel::{Item, KernelPlan, Kind, Literal, Operand};
use cellc::shapes::Shapes;

/// Why a plan cannot run here: the processor lacks the set, or the plan
/// reads a value before it holds it (a compiler bug).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanError {
    /// The instruction set's name ([`Lanes::NAME`]).
    pub set: &'static str,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} kernel: {}", self.set, self.message)
    }
}

/// How a value is held while one row is computed (the emitter's `Held`).
#[derive(Clone, Copy, Debug)]
enum Held {
    /// Not (yet) computed in this row.
    Absent,
    Scalar(f32),
    /// A vector whose every element is this.
    Splat(f32),
    /// A vector in memory.
    Mem(*mut f32),
}

/// Where a vector that an item writes lives in a row.
#[derive(Clone, Copy, Debug)]
enum Place {
    /// The output slot (counted from the first output).
    Output(usize),
    /// Floats into the row's scratch.
    Scratch(usize),
}

/// One elementwise op of a fused loop, with its operands as register-file slots.
#[derive(Clone, Copy, Debug)]
struct Member {
    op: Code,
    a: usize,
    b: usize,
    /// The third operand's slot (a select's), else `b`'s.
    c: usize,
    value: ValueId,
    store: Option<Place>,
}

#[derive(Clone, Copy, Debug)]
enum Code {
    Unary(cellc::ir::UnaryOp),
    Binary(cellc::ir::BinaryOp),
    /// `where(a, b, c)`.
    Select,
    /// The first operand (the emitter's rule for anything else).
    First,
}

impl Code {
    fn of(op: &Op) -> Code {
        match op {
            Op::Unary(u) => Code::Unary(*u),
            Op::Binary(b) => Code::Binary(*b),
            Op::Select => Code::Select,
            _ => Code::First,
        }
    }
}

/// A fused loop: register slots `0..outside.len()` hold the values read
/// from before it, the next ones its members.
#[derive(Debug)]
struct Fused {
    len: usize,
    outside: Vec<ValueId>,
    members: Vec<Member>,
    /// The loop as machine code, where the set compiles loops ([`Lanes::COMPILED`]).
    compiled: Option<compiled::CompiledLoop>,
}

#[derive(Debug)]
enum Step {
    Fused(Fused),
    /// Any other item, run as the emitter runs it; `place` where a pad or
    /// a concat writes.
    Single {
        item: Item,
        place: Option<Place>,
    },
}

/// A stage's plan, ready to be walked on instruction set `S`.
#[derive(Debug)]
pub struct WalkedStage<S> {
    set: S,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
    literals: Vec<(ValueId, Literal)>,
    reads: Vec<(usize, ValueId, Kind)>,
    /// Output slots the row's end copies: `(slot, value)`.
    copies: Vec<(usize, ValueId)>,
    steps: Vec<Step>,
    /// Elements of each value, by value index.
    lens: Vec<usize>,
    scratch: usize,
    /// Register-file slots the widest loop needs.
    registers: usize,
    /// Fused loops the set would compile that did not compile.
    uncompiled: usize,
}

// SAFETY: the `Item`s it keeps are descriptions (ids and numbers); a run's
// pointers live in the thread's own workspace.
unsafe impl<S: Lanes> Send for WalkedStage<S> {}
unsafe impl<S: Lanes> Sync for WalkedStage<S> {}

impl<S: Lanes> WalkedStage<S> {
    /// The plan of a stage at `shapes` that reads `inputs` and writes
    /// `outputs` through the row pointer table. Fails on a processor
    /// without the set, or if the plan reads a value before it holds it.
    pub fn new(
        shapes: &Shapes,
        plan: &KernelPlan,
        inputs: &[ValueId],
        outputs: &[ValueId],
    ) -> Result<WalkedStage<S>, PlanError> {
        let fail = |message: String| PlanError { set: S::NAME, message };
        let set = S::detect().ok_or_else(|| fail("this processor has none".into()))?;
        let named: Vec<ValueId> = inputs
            .iter()
            .chain(outputs)
            .copied()
            .chain(plan.literals.iter().map(|&(v, _)| v))
            .chain(plan.items.iter().flat_map(item_values))
            .collect();
        let mut lens = vec![0; named.iter().map(|v| v.index() + 1).max().unwrap_or(0)];
        for v in named {
            lens[v.index()] = shapes.elements(v);
        }
        let place = |v: ValueId| -> Result<Place, PlanError> {
            if let Some(slot) = plan.output_slot(v) {
                return Ok(Place::Output(slot));
            }
            plan.scratch
                .get(&v)
                .map(|&at| Place::Scratch(at))
                .ok_or_else(|| fail(format!("{v} has no storage")))
        };
        let mut held: std::collections::HashSet<ValueId> =
            plan.literals.iter().map(|&(v, _)| v).chain(plan.inputs.iter().map(|&(_, v, _)| v)).collect();
        let need = |held: &std::collections::HashSet<ValueId>, reader: ValueId, v: ValueId| {
            if held.contains(&v) {
                Ok(())
            } else {
                Err(fail(format!("{reader} reads {v}, not available")))
            }
        };
        // The values held as vectors in memory (the others as floats for every lane).
        let mut vectors: std::collections::HashSet<ValueId> =
            plan.inputs.iter().filter(|&&(_, _, k)| k == Kind::Vector).map(|&(_, v, _)| v).collect();
        let mut steps = Vec::with_capacity(plan.items.len());
        let mut registers = 0;
        let mut uncompiled = 0;
        for item in &plan.items {
            // The reader an error names: the item's value, or a loop's first member.
            let reader = item.value().or_else(|| match item {
                Item::Fused(l) => l.members.first().map(|m| m.value),
                _ => None,
            });
            for &r in item.reads() {
                need(&held, reader.unwrap_or(r), r)?;
            }
            match item {
                Item::Fused(l) => {
                    let slot = |a: &Operand| match *a {
                        Operand::Outside(i) => i,
                        Operand::Member(j) => l.outside.len() + j,
                    };
                    let members = l
                        .members
                        .iter()
                        .map(|m| {
                            let (a, b, c) = match m.operands.as_slice() {
                                [] => return Err(fail(format!("{} has no operands", m.value))),
                                [a] => (slot(a), slot(a), slot(a)),
                                [a, b] => (slot(a), slot(b), slot(b)),
                                [a, b, c, ..] => (slot(a), slot(b), slot(c)),
                            };
                            let store = if m.stored { Some(place(m.value)?) } else { None };
                            Ok(Member { op: Code::of(&m.op), a, b, c, value: m.value, store })
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    held.extend(members.iter().filter(|m| m.store.is_some()).map(|m| m.value));
                    registers = registers.max(l.outside.len() + members.len());
                    let mut fused = Fused { len: l.len, outside: l.outside.clone(), members, compiled: None };
                    if let Some(target) = S::COMPILED {
                        // A loop that does not compile (a bug, or a process
                        // refused executable memory) is walked, and counted.
                        let vector: Vec<bool> = l.outside.iter().map(|v| vectors.contains(v)).collect();
                        fused.compiled = compiled::CompiledLoop::new(target, &fused, &vector).ok();
                        uncompiled += usize::from(fused.compiled.is_none());
                    }
                    vectors.extend(fused.members.iter().filter(|m| m.store.is_some()).map(|m| m.value));
                    steps.push(Step::Fused(fused));
                }
                single => {
                    let v = single.value().ok_or_else(|| fail("a loop is not a single value".into()))?;
                    let place = match single {
                        Item::Pad { .. } | Item::Concat { .. } => Some(place(v)?),
                        _ => None,
                    };
                    let vector = match single {
                        Item::Pad { .. } | Item::Concat { .. } => true,
                        Item::Slice { src, .. } => vectors.contains(src),
                        _ => false,
                    };
                    if vector {
                        vectors.insert(v);
                    }
                    held.insert(v);
                    steps.push(Step::Single { item: single.clone(), place });
                }
            }
        }
        let mut copies = Vec::new();
        for (i, out) in plan.outputs.iter().enumerate() {
            need(&held, out.value, out.value)?;
            if !out.in_place {
                copies.push((i, out.value));
            }
        }
        Ok(WalkedStage {
            set,
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
            literals: plan.literals.clone(),
            reads: plan.inputs.clone(),
            copies,
            steps,
            lens,
            scratch: plan.scratch_floats,
            registers,
            uncompiled,
        })
    }

    /// Fused loops that the set compiles ([`Lanes::COMPILED`]) but that
    /// did not compile, and are walked (zero but for a bug, or where the
    /// process may not map executable memory).
    pub fn uncompiled_loops(&self) -> usize {
        self.uncompiled
    }

    /// The same stage with every fused loop walked, none compiled (to
    /// compare the two).
    pub fn walking_every_loop(mut self) -> WalkedStage<S> {
        for step in &mut self.steps {
            if let Step::Fused(l) = step {
                l.compiled = None;
            }
        }
        self
    }

    /// One row: `row` holds its input then output pointers.
    ///
    /// # Safety
    /// As [`StageExec::run`] for this row; `w` sized for this stage.
    #[inline(always)]
    unsafe fn row(&self, row: &[*mut f32], w: &mut Workspace) {
        let outs = &row[self.inputs.len()..];
        let scratch = w.scratch.as_mut_ptr();
        // SAFETY: scratch holds the plan's floats; an output slot's pointer
        // its value's length (the caller's contract).
        let at = |p: Place| unsafe {
            match p {
                Place::Output(slot) => outs[slot],
                Place::Scratch(f) => scratch.add(f),
            }
        };
        for &(v, literal) in &self.literals {
            w.held[v.index()] = match literal {
                Literal::Scalar(x) => Held::Scalar(x),
                Literal::Splat(x) => Held::Splat(x),
            };
        }
        for &(slot, v, kind) in &self.reads {
            w.held[v.index()] = match kind {
                Kind::Vector => Held::Mem(row[slot]),
                // SAFETY: a scalar input's pointer holds its float.
                Kind::Scalar | Kind::Splat => Held::Scalar(unsafe { *row[slot] }),
            };
        }
        for step in &self.steps {
            match step {
                // SAFETY: the plan's pointers and places, per the contract.
                Step::Fused(l) => unsafe { self.fused(l, &at, w) },
                Step::Single { item, place } => {
                    let Some(v) = item.value() else { continue };
                    // SAFETY: as above.
                    let h = unsafe { self.single(item, place.map(at), &w.held) };
                    w.held[v.index()] = h;
                }
            }
        }
        for &(slot, v) in &self.copies {
            // SAFETY: the output slot holds its value's length.
            unsafe { copy(w.held[v.index()], outs[slot], self.lens[v.index()]) };
        }
    }

    /// # Safety
    /// As [`WalkedStage::row`].
    #[inline(always)]
    unsafe fn fused(&self, l: &Fused, at: &dyn Fn(Place) -> *mut f32, w: &mut Workspace) {
        let s = self.set;
        let Workspace { regs, held, stores, sources, in_place, table, scalars, spill, .. } = w;
        stores.clear();
        stores.extend(l.members.iter().map(|m| m.store.map(at)));
        if let Some(c) = &l.compiled {
            // SAFETY: the plan's pointers, per the contract.
            if unsafe { run_compiled(c, l, held, stores, (table, scalars, spill)) } {
                return;
            }
        }
        let regs = regs.as_mut_ptr().cast::<S::V>();
        let slot = |i: usize| regs.wrapping_add(i * S::REGISTERS);
        let base = l.outside.len();
        // Each operand's floats at the pass: a vector in memory is read in
        // place in whole passes, unless a member of the loop stores where
        // it lies (then every pass copies it first, as the last one does).
        let direct = |v: &ValueId| match held[v.index()] {
            Held::Mem(p) => !stores.iter().flatten().any(|&q| overlap(p, q, l.len)),
            _ => false,
        };
        in_place.clear();
        in_place.extend(l.outside.iter().map(direct));
        sources.clear();
        sources.extend((0..base + l.members.len()).map(|i| slot(i).cast::<f32>().cast_const()));
        // Splats fill their registers once.
        for (i, v) in l.outside.iter().enumerate() {
            if !matches!(held[v.index()], Held::Mem(_)) {
                // SAFETY: the slot has a pass's registers.
                unsafe { load_pass(s, &held[v.index()], 0, l.len, slot(i)) };
            }
        }
        for off in (0..l.len).step_by(chunk::<S>()) {
            let left = l.len - off;
            let live = left.min(chunk::<S>()).div_ceil(S::LANES);
            let whole = left >= chunk::<S>();
            // SAFETY (block): the register file has a slot per outside value
            // and member (`registers`); a held vector and a member's storage
            // have `len` floats, and the pass's masks stop at them.
            unsafe {
                for (i, v) in l.outside.iter().enumerate() {
                    let Held::Mem(p) = held[v.index()] else { continue };
                    if whole && in_place[i] {
                        sources[i] = p.add(off);
                    } else {
                        // By reference: the value was just written field by
                        // field, and a copy reads it whole, which waits for the
                        // stores to retire instead of forwarding them.
                        load_pass(s, &held[v.index()], off, left, slot(i));
                        sources[i] = slot(i).cast::<f32>();
                    }
                }
                for (j, (m, store)) in l.members.iter().zip(stores.iter()).enumerate() {
                    let out = slot(base + j);
                    let (a, b, c) = (sources[m.a], sources[m.b], sources[m.c]);
                    match m.op {
                        Code::Unary(u) => math::unary(s, u, a, out, live),
                        Code::Binary(o) => math::binary(s, o, [a, b], out, live),
                        Code::Select => math::select(s, [a, b, c], out, live),
                        Code::First => math::unary(s, cellc::ir::UnaryOp::Copy, a, out, live),
                    }
                    if let Some(p) = store {
                        store_pass(s, out, p.add(off), left);
                    }
                }
            }
        }
        hold_stores(l, stores, held);
    }

    /// The value of an item other than a loop.
    ///
    /// # Safety
    /// As [`WalkedStage::row`]; `place` holds the item's value.
    #[inline(always)]
    unsafe fn single(&self, item: &Item, place: Option<*mut f32>, held: &[Held]) -> Held {
        let s = self.set;
        let get = |v: ValueId| held[v.index()];
        // SAFETY (block): held vectors hold their lengths; `place` the item's.
        unsafe {
            match item {
                Item::Broadcast { src, .. } => match get(*src) {
                    Held::Scalar(x) | Held::Splat(x) => Held::Splat(x),
                    Held::Mem(p) => Held::Splat(*p),
                    Held::Absent => Held::Absent,
                },
                Item::Slice { src, offset, .. } => match get(*src) {
                    Held::Mem(p) => Held::Mem(p.add(*offset)),
                    other => other,
                },
                Item::Scalar { op, args, splat, .. } => {
                    // Lane 0 of the op on splats: each lane is the scalar op.
                    let a = args.first().map_or(0.0, |&v| first(get(v)));
                    let b = args.get(1).map_or(a, |&v| first(get(v)));
                    let c = args.get(2).map_or(b, |&v| first(get(v)));
                    let (a, b, c) = (s.splat(a), s.splat(b), s.splat(c));
                    let mut r = a;
                    match Code::of(op) {
                        Code::Unary(u) => math::unary(s, u, lanes_of(&a), &mut r, 1),
                        Code::Binary(o) => math::binary(s, o, [lanes_of(&a), lanes_of(&b)], &mut r, 1),
                        Code::Select => math::select(s, [&a, &b, &c].map(lanes_of), &mut r, 1),
                        Code::First => {}
                    }
                    let r = s.first(r);
                    if *splat {
                        Held::Splat(r)
                    } else {
                        Held::Scalar(r)
                    }
                }
                Item::Reduce { src, op, len, .. } => {
                    let sum = match get(*src) {
                        Held::Scalar(x) | Held::Splat(x) => x * *len as f32,
                        Held::Mem(p) => sum(s, p, *len),
                        Held::Absent => 0.0,
                    };
                    Held::Scalar(match op {
                        ReduceOp::Sum => sum,
                        ReduceOp::Mean => sum / *len as f32,
                    })
                }
                Item::Pad { value, src, offset } => {
                    let out = place.unwrap_or(std::ptr::null_mut());
                    copy(Held::Splat(0.0), out, self.lens[value.index()]);
                    copy(get(*src), out.add(*offset), self.lens[src.index()]);
                    Held::Mem(out)
                }
                Item::Concat { parts, .. } => {
                    let out = place.unwrap_or(std::ptr::null_mut());
                    let mut at = 0;
                    for &o in parts {
                        copy(get(o), out.add(at), self.lens[o.index()]);
                        at += self.lens[o.index()];
                    }
                    Held::Mem(out)
                }
                Item::Fused(_) => Held::Absent,
            }
        }
    }
}

/// Runs loop `l` of a row as its compiled code, if its inputs are held as
/// the code reads them and no store overlaps an input but exactly; then
/// notes where its stored members are. Returns whether it ran.
///
/// # Safety
/// As [`WalkedStage::row`]; `stores` are the loop's members' places.
unsafe fn run_compiled(
    c: &compiled::CompiledLoop,
    l: &Fused,
    held: &mut [Held],
    stores: &[Option<*mut f32>],
    (table, scalars, spill): (&mut Vec<*mut f32>, &mut Vec<f32>, &mut Vec<Line>),
) -> bool {
    table.clear();
    scalars.clear();
    for (v, source) in l.outside.iter().zip(&c.sources) {
        match (held[v.index()], source) {
            (Held::Mem(p), emit::Source::Vector(_)) => table.push(p),
            (Held::Scalar(x) | Held::Splat(x), emit::Source::Scalar(_)) => {
                scalars.extend(std::iter::repeat_n(x, c.target.copies()))
            }
            _ => return false,
        }
    }
    let inputs = table.len();
    for &q in stores.iter().flatten() {
        if table[..inputs].iter().any(|&p| p != q && overlap(p, q, l.len)) {
            return false;
        }
        table.push(q);
    }
    let lines = c.spill_bytes / 64;
    if spill.len() < lines {
        spill.resize(lines, Line([0.0; 16]));
    }
    // SAFETY: the pointers hold `len` floats (the caller's contract), and
    // were checked to lie apart or together; the spill area is whole lines.
    unsafe { c.run(table, scalars, spill.as_mut_ptr().cast(), l.len) };
    hold_stores(l, stores, held);
    true
}

/// Whether `len` floats from `p` and from `q` share any.
fn overlap(p: *const f32, q: *const f32, len: usize) -> bool {
    let (p, q) = (p as usize, q as usize);
    p < q + 4 * len && q < p + 4 * len
}

/// Notes that loop `l`'s stored members are held where they were stored.
fn hold_stores(l: &Fused, stores: &[Option<*mut f32>], held: &mut [Held]) {
    for (m, store) in l.members.iter().zip(stores) {
        if let Some(p) = store {
            held[m.value.index()] = Held::Mem(*p);
        }
    }
}

/// The values an item names: what it reads and what it computes.
fn item_values(item: &Item) -> Vec<ValueId> {
    let computed: Vec<ValueId> = match item {
        Item::Fused(l) => l.members.iter().map(|m| m.value).collect(),
        other => other.value().into_iter().collect(),
    };
    item.reads().iter().copied().chain(computed).collect()
}

/// A held value's first element (a scalar's only one).
///
/// # Safety
/// A held vector has at least one float.
unsafe fn first(h: Held) -> f32 {
    match h {
        Held::Scalar(s) | Held::Splat(s) => s,
        // SAFETY: per the contract.
        Held::Mem(p) => unsafe { *p },
        Held::Absent => 0.0,
    }
}

/// Floats of a fused loop per pass.
const fn chunk<S: Lanes>() -> usize {
    S::REGISTERS * S::LANES
}

/// Floats `off..` of a held value, `left` of them still to go, into a
/// pass's registers at `to` (zeros past the end): whole registers but in
/// the loop's last pass, which is masked.
///
/// Here and in [`store_pass`], loops rather than a closure handed to one: a
/// closure is a function of its own, compiled for the set only if inlined.
///
/// # Safety
/// A held vector has those floats; `to` writable for the pass's registers.
#[inline(always)]
unsafe fn load_pass<S: Lanes>(s: S, h: &Held, off: usize, left: usize, to: *mut S::V) {
    let live = left.min(chunk::<S>()).div_ceil(S::LANES);
    // SAFETY (block): per the contract.
    unsafe {
        match *h {
            Held::Mem(p) if left >= chunk::<S>() => {
                for k in 0..S::REGISTERS {
                    *to.add(k) = s.load(p.add(off + k * S::LANES));
                }
            }
            Held::Mem(p) => {
                for k in 0..live {
                    *to.add(k) = s.load_masked(p.add(off + k * S::LANES), lanes(s, left, k));
                }
            }
            Held::Scalar(x) | Held::Splat(x) => {
                for k in 0..live {
                    *to.add(k) = s.splat(x);
                }
            }
            Held::Absent => {
                for k in 0..live {
                    *to.add(k) = s.splat(0.0);
                }
            }
        }
    }
}

/// A pass's registers at `from` to `to`, `left` floats still to go (see [`load_pass`]).
///
/// # Safety
/// `to` writable for the floats of the pass; `from` readable for its registers.
#[inline(always)]
unsafe fn store_pass<S: Lanes>(s: S, from: *const S::V, to: *mut f32, left: usize) {
    // SAFETY (block): per the contract.
    unsafe {
        if left >= chunk::<S>() {
            for k in 0..S::REGISTERS {
                s.store(to.add(k * S::LANES), *from.add(k));
            }
        } else {
            for k in 0..left.div_ceil(S::LANES) {
                s.store_masked(to.add(k * S::LANES), lanes(s, left, k), *from.add(k));
            }
        }
    }
}

/// A register's lanes, as the floats they hold.
fn lanes_of<V>(v: &V) -> *const f32 {
    (v as *const V).cast()
}

/// The lanes of register `k` of the loop's last pass that its `left` floats fill.
#[inline(always)]
fn lanes<S: Lanes>(s: S, left: usize, k: usize) -> S::Mask {
    s.mask((left - k * S::LANES).min(S::LANES))
}

/// Writes `n` floats of a held value to `dst`.
///
/// # Safety
/// `dst` writable for `n` floats; a held vector readable for them.
unsafe fn copy(src: Held, dst: *mut f32, n: usize) {
    // SAFETY: per the contract.
    unsafe {
        match src {
            Held::Scalar(s) | Held::Splat(s) => std::slice::from_raw_parts_mut(dst, n).fill(s),
            Held::Mem(p) => std::ptr::copy(p, dst, n),
            Held::Absent => {}
        }
    }
}

/// The sum of `n` floats at `p`, added in the emitter's order
/// ([`cellc::clif`]'s `sum`): [`SUM_CHAINS`] `f32x4` chains over blocks of
/// [`SUM_BLOCK`] floats (chain `c` takes floats `4c..4c + 4` of each
/// block), the chains folded in halves (chain `c` plus chain `c + 8`, then
/// `c + 4`, `c + 2`, `c + 1`), one `f32x4` over the rest in fours, its
/// lanes pairwise, then the tail one float at a time. A block is one pass
/// of the set's vectors (four `zmm` or eight `ymm`), each holding its
/// chains side by side, so every lane adds the same floats in the same
/// order as the emitter's `f32x4` chains; a sum waits on a chain's
/// additions every sixteenth vector instead of every fourth, and the
/// first folds are whole vectors.
///
/// # Safety
/// `p` readable for `n` floats.
#[inline(always)]
unsafe fn sum<S: Lanes>(s: S, p: *const f32, n: usize) -> f32 {
    let (wide_n, vec_n) = (n / SUM_BLOCK * SUM_BLOCK, n / 4 * 4);
    let mut total = 0.0f32;
    // SAFETY (block): every load is below n; `chains` holds a vector's floats.
    unsafe {
        if vec_n > 0 {
            let mut acc = [0.0f32; 4];
            if wide_n > 0 {
                // A block is two to eight of the set's vectors (`sums`), a vector at most four chains.
                assert!((8..=16).contains(&S::LANES), "row sums need 8 or 16 lanes, not {}", S::LANES);
                let mut vectors = SUM_BLOCK / S::LANES;
                let mut sums = [s.splat(0.0); SUM_BLOCK / 8];
                for i in (0..wide_n).step_by(SUM_BLOCK) {
                    for (v, sum) in sums.iter_mut().enumerate().take(vectors) {
                        *sum = s.add(*sum, s.load(p.add(i + v * S::LANES)));
                    }
                }
                // Folds of whole vectors, then within the last one.
                while vectors > 1 {
                    vectors /= 2;
                    for v in 0..vectors {
                        sums[v] = s.add(sums[v], sums[v + vectors]);
                    }
                }
                let mut chains = [0.0f32; 16];
                s.store(chains.as_mut_ptr(), sums[0]);
                let mut count = S::LANES / 4;
                while count > 1 {
                    count /= 2;
                    for f in 0..4 * count {
                        chains[f] += chains[f + 4 * count];
                    }
                }
                acc.copy_from_slice(&chains[..4]);
            }
            for i in (wide_n..vec_n).step_by(4) {
                for (l, a) in acc.iter_mut().enumerate() {
                    *a += *p.add(i + l);
                }
            }
            total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
        for i in vec_n..n {
            total += *p.add(i);
        }
    }
    total
}

/// Floats of one block of a row sum: [`SUM_CHAINS`] `f32x4` chains ([`sum`]).
const SUM_BLOCK: usize = 4 * SUM_CHAINS;

/// A 64-byte line of the register file: a slot is [`chunk`] floats of
/// these, aligned for either set's vectors.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// What one thread reuses from run to run, whichever set it walks with:
/// scratch, the register file and the held values.
struct Workspace {
    scratch: Vec<f32>,
    /// A slot per register-file value, [`chunk`] floats each.
    regs: Vec<Line>,
    held: Vec<Held>,
    /// Where the current loop's members are stored.
    stores: Vec<Option<*mut f32>>,
    /// Where each register-file value of the current pass is read from.
    sources: Vec<*const f32>,
    /// Which of the current loop's outside values its whole passes read in place.
    in_place: Vec<bool>,
    /// A compiled loop's row pointers, scalars and spill area.
    table: Vec<*mut f32>,
    scalars: Vec<f32>,
    spill: Vec<Line>,
}

impl<S: Lanes> StageExec for WalkedStage<S> {
    fn inputs(&self) -> &[ValueId] {
        &self.inputs
    }

    fn outputs(&self) -> &[ValueId] {
        &self.outputs
    }

    unsafe fn run(&self, rows: usize, args: &[*mut f32]) {
        thread_local! {
            static WORKSPACE: std::cell::RefCell<Workspace> =
                const { std::cell::RefCell::new(Workspace {
                    scratch: Vec::new(),
                    regs: Vec::new(),
                    held: Vec::new(),
                    stores: Vec::new(),
                    sources: Vec::new(),
                    in_place: Vec::new(),
                    table: Vec::new(),
                    scalars: Vec::new(),
                    spill: Vec::new(),
                }) };
        }
        const { assert!(chunk::<S>().is_multiple_of(16), "a slot is whole lines") };
        let k = self.inputs.len() + self.outputs.len();
        WORKSPACE.with(|w| {
            let mut w = w.borrow_mut();
            let w = &mut *w;
            if w.scratch.len() < self.scratch.max(1) {
                w.scratch.resize(self.scratch.max(1), 0.0);
            }
            let lines = self.registers * chunk::<S>() / 16;
            if w.regs.len() < lines {
                w.regs.resize(lines, Line([0.0; 16]));
            }
            w.held.clear();
            w.held.resize(self.lens.len(), Held::Absent);
            // Inlined into the set's function, and everything it calls with it.
            self.set.enter(
                #[inline(always)]
                || {
                    for row in args.chunks_exact(k).take(rows) {
                        // SAFETY: the caller's contract for each row; the
                        // workspace is sized for this stage.
                        unsafe { self.row(row, w) };
                    }
                },
            );
        });
    }
}

#[cfg(test)]
mod tests;
