//! A fused loop's traces ([`super::trace`]) as machine code for AVX-512
//! or AVX2 ([`Target`]): the loop over a row's vectors, several vectors an
//! iteration (the wide trace), then one at a time (the narrow trace), then
//! a masked last one; every value in a register. On AVX-512 constants and
//! scalars are read by embedded broadcast and comparisons go to mask
//! registers; on AVX2 they are read whole from pools of eight copies, and
//! comparisons are vectors. Encoded by `iced-x86`.
//!
//! Registers are given out over the iteration's straight line of
//! operations as it goes: an operand that dies frees its register for the
//! result, and when all are taken the value needed furthest ahead
//! leaves: a loop's input or a constant is read again from memory, a
//! computed value is spilled to the caller's spill area (and read from
//! there as a memory operand where an instruction takes one).
//!
//! The function's ABI (System V):
//! `fn(pointers, whole_bytes, constants, scalars, spill)`, where
//! `pointers` holds the vector inputs' then the stores' row pointers,
//! `whole_bytes` is the bytes of the row's whole vectors, and `spill`
//! (64-byte aligned) begins with a [`Header`]. Every store of an iteration comes after
//! its loads, so an output may lie exactly where an input does.

use super::target::Target;
use super::trace::{Binary, Node, Op, Unary};
use iced_x86::code_asm::*;
use iced_x86::IcedError;

/// Where a loop's input comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A vector, through this row pointer.
    Vector(usize),
    /// One float for every lane, this one of the scalars.
    Scalar(usize),
}

/// The first 64 bytes of the spill area, which the caller writes; the
/// code reads its fields at these offsets.
#[repr(C, align(64))]
pub struct Header {
    /// Byte 0: the last, partial vector's lanes as mask bits (AVX-512).
    tail_bits: u64,
    /// Byte 8: the bytes of the row the wide iterations cover.
    wide_bytes: u64,
    /// Byte 16: floats in the last, partial vector (zero when there is none).
    tail_lanes: u64,
    unused: u64,
    /// Byte 32: the last, partial vector's lanes as all-ones integers (AVX2).
    tail_vector: [i32; 8],
}

impl Header {
    /// The header of a row of `len` floats whose wide iterations take
    /// `width` vectors of `target`'s.
    pub fn new(target: Target, width: usize, len: usize) -> Header {
        let (lanes, step) = (target.lanes(), target.lanes() * width);
        let tail = len % lanes;
        Header {
            tail_bits: (1 << tail) - 1,
            wide_bytes: (len / step * step * 4) as u64,
            tail_lanes: tail as u64,
            unused: 0,
            tail_vector: std::array::from_fn(|i| if i < tail { -1 } else { 0 }),
        }
    }
}

/// A loop's operations on an iteration's vectors, and what it stores:
/// `(node, row pointer, vector of the iteration)`.
#[derive(Debug)]
pub struct Trace {
    pub ops: Vec<Op>,
    pub stores: Vec<(Node, usize, usize)>,
}

/// The code of a loop, and what it reads besides its arguments.
#[derive(Debug)]
pub struct Emitted {
    pub code: Vec<u8>,
    /// The bits of each constant the code reads.
    pub constants: Vec<u32>,
    /// Bytes of spill area the code needs (64-byte aligned).
    pub spill_bytes: usize,
    /// The values it spills (the most of any iteration's).
    pub spill_slots: usize,
}

/// The `target` code of the loop that computes `wide` for each `width`
/// vectors of a row, then `narrow` for each vector left, reading input
/// slot `i` from `sources[i]`.
pub fn emit(
    target: Target,
    (wide, width): (&Trace, usize),
    narrow: &Trace,
    sources: &[Source],
) -> Result<Emitted, String> {
    let (wide_live, narrow_live) = (live_ops(wide), live_ops(narrow));
    let mut constants: Vec<u32> = Vec::new();
    for (t, live) in [(wide, &wide_live), (narrow, &narrow_live)] {
        for op in t.ops.iter().zip(live).filter(|(_, &l)| l).map(|(op, _)| op) {
            if let Op::Const(bits) = *op {
                if !constants.contains(&bits) {
                    constants.push(bits);
                }
            }
        }
    }
    let fail = |e: IcedError| e.to_string();
    let mut a = CodeAssembler::new(64).map_err(fail)?;
    for &r in &SAVED {
        a.push(r).map_err(fail)?;
    }
    let pointers = narrow.stores.iter().map(|&(_, p, _)| p + 1).chain(sources.iter().map(|s| match s {
        Source::Vector(p) => p + 1,
        Source::Scalar(_) => 0,
    }));
    let pointers = pointers.max().unwrap_or(0);
    for (i, &r) in PINNED.iter().enumerate().take(pointers) {
        a.mov(r, qword_ptr(POINTERS + 8 * i as i32)).map_err(fail)?;
    }
    let mut labels = [(); 5].map(|_| a.create_label());
    let [wide_top, narrow_start, narrow_top, tail, done] = &mut labels;
    let wide_bytes = qword_ptr(SPILL + 8);
    let wide = Body {
        target,
        ops: &wide.ops,
        live: &wide_live,
        sources,
        stores: &wide.stores,
        constants: &constants,
    };
    let narrow = Body {
        target,
        ops: &narrow.ops,
        live: &narrow_live,
        sources,
        stores: &narrow.stores,
        constants: &constants,
    };
    let bytes = target.bytes() as i32;
    a.xor(rax, rax).map_err(fail)?;
    a.cmp(wide_bytes, 0).map_err(fail)?;
    a.je(*narrow_start).map_err(fail)?;
    a.set_label(wide_top).map_err(fail)?;
    let mut spill_slots = wide.emit(&mut a, false)?;
    a.add(rax, bytes * width as i32).map_err(fail)?;
    a.cmp(rax, wide_bytes).map_err(fail)?;
    a.jb(*wide_top).map_err(fail)?;
    a.set_label(narrow_start).map_err(fail)?;
    a.cmp(rax, WHOLE_BYTES).map_err(fail)?;
    a.jae(*tail).map_err(fail)?;
    a.set_label(narrow_top).map_err(fail)?;
    spill_slots = spill_slots.max(narrow.emit(&mut a, false)?);
    a.add(rax, bytes).map_err(fail)?;
    a.cmp(rax, WHOLE_BYTES).map_err(fail)?;
    a.jb(*narrow_top).map_err(fail)?;
    a.set_label(tail).map_err(fail)?;
    a.cmp(qword_ptr(SPILL + 16), 0).map_err(fail)?;
    a.je(*done).map_err(fail)?;
    match target {
        Target::Avx512 => a.kmovw(k1, word_ptr(SPILL)),
        Target::Avx2 => a.vmovdqa(YMM[TAIL_MASK], ymmword_ptr(SPILL + 32)),
    }
    .map_err(fail)?;
    spill_slots = spill_slots.max(narrow.emit(&mut a, true)?);
    a.set_label(done).map_err(fail)?;
    a.vzeroupper().map_err(fail)?;
    for &r in SAVED.iter().rev() {
        a.pop(r).map_err(fail)?;
    }
    a.ret().map_err(fail)?;
    let code = a.assemble(0).map_err(fail)?;
    Ok(Emitted { code, constants, spill_bytes: 64 * (1 + spill_slots), spill_slots })
}

/// The arguments' registers.
const POINTERS: AsmRegister64 = rdi;
const WHOLE_BYTES: AsmRegister64 = rsi;
const CONSTANTS: AsmRegister64 = rdx;
const SCALARS: AsmRegister64 = rcx;
const SPILL: AsmRegister64 = r8;
/// The byte offset of the current vector in every row (`rax`), and where
/// a row pointer that has no register of its own is read into.
const SCRATCH: AsmRegister64 = r11;
/// The registers that hold the first row pointers for the whole loop.
const PINNED: [AsmRegister64; 8] = [r9, r10, rbx, rbp, r12, r13, r14, r15];
/// The callee-saved ones among them, pushed on entry.
const SAVED: [AsmRegister64; 6] = [rbx, rbp, r12, r13, r14, r15];

const ZMM: [AsmRegisterZmm; 32] = [
    zmm0, zmm1, zmm2, zmm3, zmm4, zmm5, zmm6, zmm7, zmm8, zmm9, zmm10, zmm11, zmm12, zmm13, zmm14, zmm15,
    zmm16, zmm17, zmm18, zmm19, zmm20, zmm21, zmm22, zmm23, zmm24, zmm25, zmm26, zmm27, zmm28, zmm29, zmm30,
    zmm31,
];
const YMM: [AsmRegisterYmm; 16] =
    [ymm0, ymm1, ymm2, ymm3, ymm4, ymm5, ymm6, ymm7, ymm8, ymm9, ymm10, ymm11, ymm12, ymm13, ymm14, ymm15];
/// On AVX2, the register that holds the last vector's lanes in the masked
/// iteration (which gives out the others only).
const TAIL_MASK: usize = 15;
const K: [AsmRegisterK; 8] = [k0, k1, k2, k3, k4, k5, k6, k7];
/// The mask registers comparisons get (`k0` masks nothing; `k1` is the
/// last vector's lanes).
const COMPARISONS: std::ops::Range<usize> = 2..8;

/// Which operations the stores need.
fn live_ops(t: &Trace) -> Vec<bool> {
    let ops = &t.ops;
    let mut live = vec![false; ops.len()];
    for &(n, _, _) in &t.stores {
        live[n.index()] = true;
    }
    for i in (0..ops.len()).rev() {
        if live[i] {
            for n in operands(&ops[i]) {
                live[n.index()] = true;
            }
        }
    }
    live
}

/// The nodes an operation reads.
fn operands(op: &Op) -> Vec<Node> {
    match *op {
        Op::Input { .. } | Op::Const(_) => vec![],
        Op::Unary(_, x) => vec![x],
        Op::Binary(_, x, y) | Op::Cmp(_, x, y) => vec![x, y],
        Op::Fma(x, y, z) | Op::Blend(x, y, z) => vec![x, y, z],
    }
}

/// One iteration's code, emitted for whole vectors or for the masked last one.
struct Body<'a> {
    target: Target,
    ops: &'a [Op],
    live: &'a [bool],
    sources: &'a [Source],
    stores: &'a [(Node, usize, usize)],
    constants: &'a [u32],
}

impl Body<'_> {
    /// Emits the iteration; returns the spill slots it used.
    fn emit(&self, a: &mut CodeAssembler, masked: bool) -> Result<usize, String> {
        let mut uses: Vec<Vec<usize>> = vec![Vec::new(); self.ops.len()];
        let order: Vec<usize> = (0..self.ops.len()).filter(|&i| self.live[i]).collect();
        for (at, &i) in order.iter().enumerate() {
            for n in operands(&self.ops[i]) {
                uses[n.index()].push(at);
            }
        }
        for (j, &(n, _, _)) in self.stores.iter().enumerate() {
            uses[n.index()].push(order.len() + j);
        }
        let registers = match (self.target, masked) {
            (Target::Avx2, true) => TAIL_MASK,
            (target, _) => target.registers(),
        };
        let mut r = Registers {
            a,
            body: self,
            masked,
            registers,
            uses,
            at: 0,
            regs: [None; 32],
            k: [None; 8],
            home: vec![Home::Nowhere; self.ops.len()],
            spilled: vec![None; self.ops.len()],
            slots: 0,
        };
        for (at, &i) in order.iter().enumerate() {
            r.at = at;
            r.op(Node(i as u32))?;
        }
        for (j, &(n, pointer, group)) in self.stores.iter().enumerate() {
            r.at = order.len() + j;
            let x = r.reg(n, &[])?;
            let to = r.row(pointer, group)?;
            match (self.target, masked) {
                (Target::Avx512, false) => r.a.vmovups(zmmword_ptr(to), ZMM[x]),
                (Target::Avx512, true) => r.a.vmovups(zmmword_ptr(to).k1(), ZMM[x]),
                (Target::Avx2, false) => r.a.vmovups(ymmword_ptr(to), YMM[x]),
                (Target::Avx2, true) => r.a.vmaskmovps(ymmword_ptr(to), YMM[TAIL_MASK], YMM[x]),
            }
            .map_err(asm)?;
        }
        Ok(r.slots)
    }
}

fn asm(e: IcedError) -> String {
    e.to_string()
}

/// Where a node's value is now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Home {
    Nowhere,
    /// A vector register.
    Reg(usize),
    /// A mask register (AVX-512's comparisons).
    K(usize),
}

/// An operand an instruction reads: a register, or memory it reads directly.
enum Operand {
    Reg(usize),
    Mem(AsmMemoryOperand),
}

/// `$i d, a, b` on the target's registers (`$i2` the AVX2 name), `b` a
/// register or memory.
macro_rules! three {
    ($r:ident, $i:ident / $i2:ident, $d:expr, $a:expr, $b:expr $(, $imm:expr)?) => {
        match ($r.body.target, $b) {
            (Target::Avx512, Operand::Reg(x)) => $r.a.$i(ZMM[$d], ZMM[$a], ZMM[x] $(, $imm)?),
            (Target::Avx512, Operand::Mem(m)) => $r.a.$i(ZMM[$d], ZMM[$a], m $(, $imm)?),
            (Target::Avx2, Operand::Reg(x)) => $r.a.$i2(YMM[$d], YMM[$a], YMM[x] $(, $imm)?),
            (Target::Avx2, Operand::Mem(m)) => $r.a.$i2(YMM[$d], YMM[$a], m $(, $imm)?),
        }
    };
}

/// `$i d, a` on the target's registers, `a` a register or memory.
macro_rules! two {
    ($r:ident, $i:ident, $d:expr, $a:expr $(, $imm:expr)?) => {
        match ($r.body.target, $a) {
            (Target::Avx512, Operand::Reg(x)) => $r.a.$i(ZMM[$d], ZMM[x] $(, $imm)?),
            (Target::Avx512, Operand::Mem(m)) => $r.a.$i(ZMM[$d], m $(, $imm)?),
            (Target::Avx2, Operand::Reg(x)) => $r.a.$i(YMM[$d], YMM[x] $(, $imm)?),
            (Target::Avx2, Operand::Mem(m)) => $r.a.$i(YMM[$d], m $(, $imm)?),
        }
    };
}

/// The register allocator of one iteration, emitting as it goes.
struct Registers<'a, 'b> {
    a: &'a mut CodeAssembler,
    body: &'a Body<'b>,
    masked: bool,
    /// Vector registers it gives out: `0..registers`.
    registers: usize,
    /// Each node's uses, by position in the iteration.
    uses: Vec<Vec<usize>>,
    /// The position being emitted.
    at: usize,
    regs: [Option<Node>; 32],
    k: [Option<Node>; 8],
    home: Vec<Home>,
    /// Each computed node's spill slot, once it has one.
    spilled: Vec<Option<usize>>,
    slots: usize,
}

impl Registers<'_, '_> {
    fn op_of(&self, n: Node) -> Op {
        self.body.ops[n.index()]
    }

    fn target(&self) -> Target {
        self.body.target
    }

    /// A whole vector at `m`.
    fn vector_at(&self, m: AsmMemoryOperand) -> AsmMemoryOperand {
        match self.target() {
            Target::Avx512 => zmmword_ptr(m),
            Target::Avx2 => ymmword_ptr(m),
        }
    }

    /// Float `i` of a pool at `base` as an operand: broadcast on AVX-512,
    /// the vector of its copies on AVX2.
    fn pooled(&self, base: AsmRegister64, i: usize) -> AsmMemoryOperand {
        match self.target() {
            Target::Avx512 => dword_bcst(base + 4 * i as i32),
            Target::Avx2 => ymmword_ptr(base + 32 * i as i32),
        }
    }

    /// The position of `n`'s next use after the current one (`usize::MAX` if none).
    fn next_use(&self, n: Node) -> usize {
        let uses = &self.uses[n.index()];
        let i = uses.partition_point(|&u| u <= self.at);
        uses.get(i).copied().unwrap_or(usize::MAX)
    }

    /// Whether `n` is read after the current position.
    fn dies_here(&self, n: Node) -> bool {
        self.next_use(n) == usize::MAX
    }

    /// Vector `group` of the iteration through a row pointer (read into
    /// the scratch register if it has no register of its own).
    fn row(&mut self, pointer: usize, group: usize) -> Result<AsmMemoryOperand, String> {
        let base = match PINNED.get(pointer) {
            Some(&r) => r,
            None => {
                self.a.mov(SCRATCH, qword_ptr(POINTERS + 8 * pointer as i32)).map_err(asm)?;
                SCRATCH
            }
        };
        Ok(base + rax + (self.target().bytes() * group) as i32)
    }

    /// `n` as an instruction's memory operand, if it can be read from
    /// memory where it is: a vector input (but in the masked iteration), a
    /// scalar or constant, or a spilled value.
    fn memory(&mut self, n: Node) -> Result<Option<AsmMemoryOperand>, String> {
        Ok(match self.op_of(n) {
            Op::Input { slot, group } => match self.body.sources[slot] {
                Source::Vector(p) if !self.masked => {
                    let at = self.row(p, group)?;
                    Some(self.vector_at(at))
                }
                Source::Vector(_) => None,
                Source::Scalar(j) => Some(self.pooled(SCALARS, j)),
            },
            Op::Const(bits) => Some(self.pooled(CONSTANTS, self.constant(bits))),
            _ => self.spilled[n.index()].map(|s| self.vector_at(spill_slot(s))),
        })
    }

    fn constant(&self, bits: u32) -> usize {
        self.body.constants.iter().position(|&c| c == bits).unwrap_or(0)
    }

    /// `n` where the instruction reads it, its register or its memory:
    /// in a register already (loaded, if it cannot be read from memory).
    /// Call [`Registers::operand`] for its operand, after every other load
    /// of the instruction (a memory operand may take the scratch register).
    fn prepare(&mut self, n: Node, keep: &[Node]) -> Result<Option<usize>, String> {
        if let Home::Reg(r) = self.home[n.index()] {
            return Ok(Some(r));
        }
        if self.reads_from_memory(n) {
            return Ok(None);
        }
        self.reg(n, keep).map(Some)
    }

    /// The operand [`Registers::prepare`] made ready: its register, or memory.
    fn operand(&mut self, n: Node, prepared: Option<usize>) -> Result<Operand, String> {
        match prepared {
            Some(r) => Ok(Operand::Reg(r)),
            None => self.memory(n)?.map(Operand::Mem).ok_or_else(|| format!("node {} has no memory", n.0)),
        }
    }

    /// Whether `n` would be read from memory as an operand.
    fn reads_from_memory(&self, n: Node) -> bool {
        if matches!(self.home[n.index()], Home::Reg(_)) {
            return false;
        }
        match self.op_of(n) {
            Op::Input { slot, .. } => !(self.masked && matches!(self.body.sources[slot], Source::Vector(_))),
            Op::Const(_) => true,
            _ => self.spilled[n.index()].is_some(),
        }
    }

    /// `n` in a vector register, loaded into one if it is not (never evicting `keep`).
    fn reg(&mut self, n: Node, keep: &[Node]) -> Result<usize, String> {
        if let Home::Reg(r) = self.home[n.index()] {
            return Ok(r);
        }
        let r = self.free_reg(keep)?;
        self.load(n, r)?;
        self.settle(n, r);
        Ok(r)
    }

    /// Makes register `r` the home of `n`'s value.
    fn settle(&mut self, n: Node, r: usize) {
        self.regs[r] = Some(n);
        self.home[n.index()] = Home::Reg(r);
    }

    /// Loads `n`'s value into register `r` (which does not become its home).
    fn load(&mut self, n: Node, r: usize) -> Result<(), String> {
        let t = self.target();
        if let Home::Reg(from) = self.home[n.index()] {
            return match t {
                Target::Avx512 => self.a.vmovaps(ZMM[r], ZMM[from]),
                Target::Avx2 => self.a.vmovaps(YMM[r], YMM[from]),
            }
            .map_err(asm);
        }
        let whole = match self.op_of(n) {
            Op::Input { slot, group } => match self.body.sources[slot] {
                Source::Vector(p) => {
                    let at = self.row(p, group)?;
                    let m = self.vector_at(at);
                    return match (t, self.masked) {
                        (Target::Avx512, false) => self.a.vmovups(ZMM[r], m),
                        (Target::Avx512, true) => self.a.vmovups(ZMM[r].k1().z(), m),
                        (Target::Avx2, false) => self.a.vmovups(YMM[r], m),
                        (Target::Avx2, true) => self.a.vmaskmovps(YMM[r], YMM[TAIL_MASK], m),
                    }
                    .map_err(asm);
                }
                Source::Scalar(j) => self.pooled(SCALARS, j),
            },
            Op::Const(bits) => self.pooled(CONSTANTS, self.constant(bits)),
            _ => match self.spilled[n.index()] {
                Some(s) => self.vector_at(spill_slot(s)),
                None => return Err(format!("node {} read before it is computed", n.0)),
            },
        };
        // A broadcast operand loads as a broadcast; a whole vector as itself.
        match (t, self.op_of(n)) {
            (Target::Avx512, Op::Input { .. } | Op::Const(_)) => {
                self.a.vbroadcastss(ZMM[r], dword_ptr(whole))
            }
            (Target::Avx512, _) => self.a.vmovaps(ZMM[r], whole),
            (Target::Avx2, _) => self.a.vmovups(YMM[r], whole),
        }
        .map_err(asm)
    }

    /// A free vector register, evicting the value needed furthest ahead
    /// (never one of `keep`).
    fn free_reg(&mut self, keep: &[Node]) -> Result<usize, String> {
        if let Some(r) = self.regs[..self.registers].iter().position(Option::is_none) {
            return Ok(r);
        }
        let victim =
            self.furthest(&self.regs, 0..self.registers, keep).ok_or("every register holds an operand")?;
        let n = self.regs[victim].take().ok_or("no victim")?;
        if let Some(s) = self.evicted(n) {
            let to = self.vector_at(spill_slot(s));
            match self.target() {
                Target::Avx512 => self.a.vmovaps(to, ZMM[victim]),
                Target::Avx2 => self.a.vmovaps(to, YMM[victim]),
            }
            .map_err(asm)?;
        }
        Ok(victim)
    }

    /// Of registers `range` of a file whose values are `owners`, the one
    /// whose value is needed furthest ahead, but for those of `keep`.
    fn furthest(
        &self,
        owners: &[Option<Node>],
        range: std::ops::Range<usize>,
        keep: &[Node],
    ) -> Option<usize> {
        range
            .filter(|&r| owners[r].is_some_and(|n| !keep.contains(&n)))
            .max_by_key(|&r| owners[r].map_or(0, |n| self.next_use(n)))
    }

    /// Notes that `n` left its register: the spill slot to store it to,
    /// if it is computed (inputs and constants are read again from where
    /// they lie), read later, and has none yet (then it has this one).
    fn evicted(&mut self, n: Node) -> Option<usize> {
        self.home[n.index()] = Home::Nowhere;
        let computed = !matches!(self.op_of(n), Op::Input { .. } | Op::Const(_));
        if !computed || self.spilled[n.index()].is_some() || self.dies_here(n) {
            return None;
        }
        let s = self.slots;
        self.slots += 1;
        self.spilled[n.index()] = Some(s);
        Some(s)
    }

    /// A free mask register for a comparison, spilling the mask needed
    /// furthest ahead if none is.
    fn free_k(&mut self, keep: &[Node]) -> Result<usize, String> {
        if let Some(r) = COMPARISONS.clone().find(|&r| self.k[r].is_none()) {
            return Ok(r);
        }
        let victim =
            self.furthest(&self.k, COMPARISONS, keep).ok_or("every mask register holds an operand")?;
        let n = self.k[victim].take().ok_or("no victim")?;
        if let Some(s) = self.evicted(n) {
            self.a.kmovw(word_ptr(spill_slot(s)), K[victim]).map_err(asm)?;
        }
        Ok(victim)
    }

    /// `n`, a comparison, in a mask register (AVX-512).
    fn mask(&mut self, n: Node, keep: &[Node]) -> Result<usize, String> {
        match self.home[n.index()] {
            Home::K(r) => Ok(r),
            Home::Reg(_) => Err(format!("node {} is a vector, read as a comparison", n.0)),
            Home::Nowhere => {
                let s = self.spilled[n.index()].ok_or_else(|| format!("comparison {} not computed", n.0))?;
                let r = self.free_k(keep)?;
                self.a.kmovw(K[r], word_ptr(spill_slot(s))).map_err(asm)?;
                self.k[r] = Some(n);
                self.home[n.index()] = Home::K(r);
                Ok(r)
            }
        }
    }

    /// Frees the registers of the operands that die at this position.
    fn release_dying(&mut self, operands: &[Node]) {
        for &n in operands {
            if self.dies_here(n) {
                match self.home[n.index()] {
                    Home::Reg(r) => self.regs[r] = None,
                    Home::K(r) => self.k[r] = None,
                    Home::Nowhere => {}
                }
                self.home[n.index()] = Home::Nowhere;
            }
        }
    }

    /// A register for the result `v`.
    fn result(&mut self, v: Node, keep: &[Node]) -> Result<usize, String> {
        let r = self.free_reg(keep)?;
        self.settle(v, r);
        Ok(r)
    }

    /// The register a destructive instruction writes `v` to, holding `n`'s
    /// value first: `n`'s own if it dies here, else a copy.
    fn overwrite(&mut self, n: Node, v: Node, keep: &[Node]) -> Result<usize, String> {
        let r = match (self.home[n.index()], self.dies_here(n)) {
            (Home::Reg(r), true) => {
                self.home[n.index()] = Home::Nowhere;
                r
            }
            _ => {
                let r = self.free_reg(keep)?;
                self.load(n, r)?;
                r
            }
        };
        self.settle(v, r);
        Ok(r)
    }

    /// Emits the operation that computes `v`.
    fn op(&mut self, v: Node) -> Result<(), String> {
        match self.op_of(v) {
            // Read where they are used.
            Op::Input { .. } | Op::Const(_) => Ok(()),
            Op::Unary(u, x) => {
                // AVX2's shifts by a constant take a register only.
                let px = match (self.target(), u) {
                    (Target::Avx2, Unary::Shl23 | Unary::Shr23) => Some(self.reg(x, &[x])?),
                    _ => self.prepare(x, &[x])?,
                };
                self.release_dying(&[x]);
                let d = self.result(v, &[x])?;
                let b = self.operand(x, px)?;
                match u {
                    Unary::Sqrt => two!(self, vsqrtps, d, b),
                    Unary::IntToFloat => two!(self, vcvtdq2ps, d, b),
                    Unary::Shl23 => two!(self, vpslld, d, b, 23),
                    Unary::Shr23 => two!(self, vpsrld, d, b, 23),
                }
                .map_err(asm)
            }
            Op::Binary(o, x, y) => {
                let commutes = matches!(
                    o,
                    Binary::Add | Binary::Mul | Binary::IntAdd | Binary::And | Binary::Or | Binary::Xor
                );
                let (x, y) = if commutes && self.reads_from_memory(x) && !self.reads_from_memory(y) {
                    (y, x)
                } else {
                    (x, y)
                };
                let keep = [x, y];
                let a = self.reg(x, &keep)?;
                let py = self.prepare(y, &keep)?;
                self.release_dying(&keep);
                let d = self.result(v, &keep)?;
                let b = self.operand(y, py)?;
                match o {
                    Binary::Add => three!(self, vaddps / vaddps, d, a, b),
                    Binary::Sub => three!(self, vsubps / vsubps, d, a, b),
                    Binary::Mul => three!(self, vmulps / vmulps, d, a, b),
                    Binary::Div => three!(self, vdivps / vdivps, d, a, b),
                    Binary::Min => three!(self, vminps / vminps, d, a, b),
                    Binary::Max => three!(self, vmaxps / vmaxps, d, a, b),
                    Binary::IntAdd => three!(self, vpaddd / vpaddd, d, a, b),
                    Binary::IntSub => three!(self, vpsubd / vpsubd, d, a, b),
                    Binary::And => three!(self, vpandd / vpand, d, a, b),
                    Binary::Or => three!(self, vpord / vpor, d, a, b),
                    Binary::Xor => three!(self, vpxord / vpxor, d, a, b),
                }
                .map_err(asm)
            }
            Op::Cmp(p, x, y) => {
                let keep = [x, y];
                let a = self.reg(x, &keep)?;
                let py = self.prepare(y, &keep)?;
                self.release_dying(&keep);
                if self.target() == Target::Avx2 {
                    let d = self.result(v, &keep)?;
                    let b = self.operand(y, py)?;
                    return match b {
                        Operand::Reg(r) => self.a.vcmpps(YMM[d], YMM[a], YMM[r], p),
                        Operand::Mem(m) => self.a.vcmpps(YMM[d], YMM[a], m, p),
                    }
                    .map_err(asm);
                }
                let d = self.free_k(&keep)?;
                self.k[d] = Some(v);
                self.home[v.index()] = Home::K(d);
                match self.operand(y, py)? {
                    Operand::Reg(r) => self.a.vcmpps(K[d], ZMM[a], ZMM[r], p),
                    Operand::Mem(m) => self.a.vcmpps(K[d], ZMM[a], m, p),
                }
                .map_err(asm)
            }
            Op::Blend(c, no, yes) => {
                let keep = [c, no, yes];
                let mask = match self.target() {
                    Target::Avx512 => self.mask(c, &keep)?,
                    Target::Avx2 => self.reg(c, &keep)?,
                };
                let a = self.reg(no, &keep)?;
                let py = self.prepare(yes, &keep)?;
                self.release_dying(&keep);
                let d = self.result(v, &keep)?;
                match (self.target(), self.operand(yes, py)?) {
                    (Target::Avx512, Operand::Reg(r)) => {
                        self.a.vblendmps(with_mask(ZMM[d], mask), ZMM[a], ZMM[r])
                    }
                    (Target::Avx512, Operand::Mem(m)) => self.a.vblendmps(with_mask(ZMM[d], mask), ZMM[a], m),
                    (Target::Avx2, Operand::Reg(r)) => self.a.vblendvps(YMM[d], YMM[a], YMM[r], YMM[mask]),
                    (Target::Avx2, Operand::Mem(m)) => self.a.vblendvps(YMM[d], YMM[a], m, YMM[mask]),
                }
                .map_err(asm)
            }
            Op::Fma(x, y, z) => self.fma(v, x, y, z),
        }
    }

    /// `v = x · y + z`, in whichever of the three destructive forms reads
    /// an operand from memory and overwrites one that dies.
    fn fma(&mut self, v: Node, x: Node, y: Node, z: Node) -> Result<(), String> {
        let keep = [x, y, z, v];
        // Products commute (exactly, but for which NaN), so x and y may swap.
        let (x, y) = if self.reads_from_memory(x) && !self.reads_from_memory(y) { (y, x) } else { (x, y) };
        if self.reads_from_memory(z) || !self.reads_from_memory(y) {
            // 213: d = y · d + z, d holding x (or y, the other then in a register).
            let (x, y) = if !self.dies_here(x) && self.dies_here(y) { (y, x) } else { (x, y) };
            let ry = self.reg(y, &keep)?;
            let pz = self.prepare(z, &keep)?;
            let d = self.overwrite(x, v, &keep)?;
            self.release_dying(&[y, z]);
            let b = self.operand(z, pz)?;
            three!(self, vfmadd213ps / vfmadd213ps, d, ry, b).map_err(asm)
        } else if self.dies_here(z) && !self.dies_here(x) {
            // 231: d = x · y + d, d holding z, y from memory.
            let rx = self.reg(x, &keep)?;
            let d = self.overwrite(z, v, &keep)?;
            self.release_dying(&[x, y]);
            let b = self.operand(y, None)?;
            three!(self, vfmadd231ps / vfmadd231ps, d, rx, b).map_err(asm)
        } else {
            // 132: d = d · y + z, d holding x, y from memory.
            let rz = self.reg(z, &keep)?;
            let d = self.overwrite(x, v, &keep)?;
            self.release_dying(&[y, z]);
            let b = self.operand(y, None)?;
            three!(self, vfmadd132ps / vfmadd132ps, d, rz, b).map_err(asm)
        }
    }
}

/// Spill slot `s`: 64 bytes each, past the header's line.
fn spill_slot(s: usize) -> AsmMemoryOperand {
    SPILL + 64 * (1 + s as i32)
}

/// `z` written only in the lanes of mask register `k` (2 to 7).
fn with_mask(z: AsmRegisterZmm, k: usize) -> AsmRegisterZmm {
    match k {
        1 => z.k1(),
        2 => z.k2(),
        3 => z.k3(),
        4 => z.k4(),
        5 => z.k5(),
        6 => z.k6(),
        _ => z.k7(),
    }
}
