//! The math as a trace: a [`Math`] whose vectors are the nodes of a list
//! of operations, recorded as the walker's own math functions call them,
//! for the compiler of fused loops ([`super::compiled`]) to turn into
//! machine code. Each recorded operation is one of [`Math`]'s methods, so
//! the compiled code runs the instructions the walker's set runs, in the
//! same order on the same operands, and computes the same bits.
//!
//! A traced vector is `U` vectors side by side (`[Node; U]`), each method
//! recording its operation on each in turn: the compiled loop works on
//! `U` vectors an iteration with their chains of operations interleaved,
//! as the walker's passes do with eight.
//!
//! Equal operations on equal operands are recorded once (all of them are
//! pure), so a constant that the math splats a hundred times is one node.

use super::lanes::Math;
use std::cell::RefCell;
use std::collections::HashMap;

/// A value of the trace: the index of the operation that computes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Node(pub u32);

impl Node {
    /// The node's index in its trace.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// An operation on two vectors, lane by lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    /// `minps`'s rule.
    Min,
    /// `maxps`'s rule.
    Max,
    IntAdd,
    IntSub,
    And,
    Or,
    Xor,
}

/// An operation on one vector, lane by lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unary {
    Sqrt,
    /// `x << 23` as integers.
    Shl23,
    /// `x >> 23` as integers, zeros shifted in.
    Shr23,
    /// Integers to floats, rounded to nearest.
    IntToFloat,
}

/// One recorded operation. Floats and their bits are the same node (the
/// bit casts record nothing), as they are the same register.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// The loop's outside value in this slot, the vector this many after
    /// the iteration's first.
    Input {
        slot: usize,
        group: usize,
    },
    /// These bits in every lane.
    Const(u32),
    Unary(Unary, Node),
    Binary(Binary, Node, Node),
    /// `x · y + z`, rounded once.
    Fma(Node, Node, Node),
    /// Where `x P y` holds, for a `_CMP_*` predicate `P`.
    Cmp(i32, Node, Node),
    /// `yes` where the comparison holds, else `no`: `(comparison, no, yes)`.
    Blend(Node, Node, Node),
}

/// The operations recorded so far, each once.
#[derive(Default)]
struct Recording {
    ops: Vec<Op>,
    seen: HashMap<Op, Node>,
}

thread_local! {
    static RECORDING: RefCell<Option<Recording>> = const { RefCell::new(None) };
}

/// The [`Math`] that records, on `U` vectors at a time: each method adds
/// its operation on each to the recording that [`record`] runs, and
/// returns their nodes.
#[derive(Clone, Copy, Debug)]
pub struct Traced<const U: usize>(());

impl<const U: usize> Traced<U> {
    /// The loop's outside value in `slot`, its iteration's `U` vectors.
    pub fn input(self, slot: usize) -> [Node; U] {
        std::array::from_fn(|group| push(Op::Input { slot, group }))
    }
}

/// The operations `f` records, in order, and what it returns.
pub fn record<const U: usize, R>(f: impl FnOnce(Traced<U>) -> R) -> (Vec<Op>, R) {
    RECORDING.with(|r| *r.borrow_mut() = Some(Recording::default()));
    let result = f(Traced(()));
    let recording = RECORDING.with(|r| r.borrow_mut().take()).unwrap_or_default();
    (recording.ops, result)
}

/// Records `op` (once), and returns its node.
fn push(op: Op) -> Node {
    RECORDING.with(|r| {
        let mut r = r.borrow_mut();
        // Outside `record`, a throwaway recording: nothing reads it.
        let r = r.get_or_insert_with(Recording::default);
        if let Some(&node) = r.seen.get(&op) {
            return node;
        }
        let node = Node(r.ops.len() as u32);
        r.ops.push(op);
        r.seen.insert(op, node);
        node
    })
}

/// Each of the `U` vectors' nodes of `f` on them.
fn each<const U: usize>(f: impl Fn(usize) -> Op) -> [Node; U] {
    std::array::from_fn(|g| push(f(g)))
}

impl<const U: usize> Math for Traced<U> {
    type V = [Node; U];
    type Int = [Node; U];
    type Cmp = [Node; U];

    fn splat(self, x: f32) -> [Node; U] {
        [push(Op::Const(x.to_bits())); U]
    }
    fn add(self, x: Self::V, y: Self::V) -> Self::V {
        each(|g| Op::Binary(Binary::Add, x[g], y[g]))
    }
    fn sub(self, x: Self::V, y: Self::V) -> Self::V {
        each(|g| Op::Binary(Binary::Sub, x[g], y[g]))
    }
    fn mul(self, x: Self::V, y: Self::V) -> Self::V {
        each(|g| Op::Binary(Binary::Mul, x[g], y[g]))
    }
    fn div(self, x: Self::V, y: Self::V) -> Self::V {
        each(|g| Op::Binary(Binary::Div, x[g], y[g]))
    }
    fn fma(self, x: Self::V, y: Self::V, z: Self::V) -> Self::V {
        each(|g| Op::Fma(x[g], y[g], z[g]))
    }
    fn sqrt(self, x: Self::V) -> Self::V {
        each(|g| Op::Unary(Unary::Sqrt, x[g]))
    }
    fn min(self, x: Self::V, y: Self::V) -> Self::V {
        each(|g| Op::Binary(Binary::Min, x[g], y[g]))
    }
    fn max(self, x: Self::V, y: Self::V) -> Self::V {
        each(|g| Op::Binary(Binary::Max, x[g], y[g]))
    }
    fn cmp<const P: i32>(self, x: Self::V, y: Self::V) -> Self::Cmp {
        each(|g| Op::Cmp(P, x[g], y[g]))
    }
    fn blend(self, c: Self::Cmp, no: Self::V, yes: Self::V) -> Self::V {
        each(|g| Op::Blend(c[g], no[g], yes[g]))
    }
    fn bits(self, x: Self::V) -> Self::Int {
        x
    }
    fn float(self, x: Self::Int) -> Self::V {
        x
    }
    fn splat_int(self, x: i32) -> Self::Int {
        [push(Op::Const(x as u32)); U]
    }
    fn int_add(self, x: Self::Int, y: Self::Int) -> Self::Int {
        each(|g| Op::Binary(Binary::IntAdd, x[g], y[g]))
    }
    fn int_sub(self, x: Self::Int, y: Self::Int) -> Self::Int {
        each(|g| Op::Binary(Binary::IntSub, x[g], y[g]))
    }
    fn and(self, x: Self::Int, y: Self::Int) -> Self::Int {
        each(|g| Op::Binary(Binary::And, x[g], y[g]))
    }
    fn or(self, x: Self::Int, y: Self::Int) -> Self::Int {
        each(|g| Op::Binary(Binary::Or, x[g], y[g]))
    }
    fn xor(self, x: Self::Int, y: Self::Int) -> Self::Int {
        each(|g| Op::Binary(Binary::Xor, x[g], y[g]))
    }
    fn shl_23(self, x: Self::Int) -> Self::Int {
        each(|g| Op::Unary(Unary::Shl23, x[g]))
    }
    fn shr_23(self, x: Self::Int) -> Self::Int {
        each(|g| Op::Unary(Unary::Shr23, x[g]))
    }
    fn int_to_float(self, x: Self::Int) -> Self::V {
        each(|g| Op::Unary(Unary::IntToFloat, x[g]))
    }
}
