//! The Cranelift emitter: a pointwise stage's [`KernelPlan`] printed as
//! one Cranelift IR function (compiled to machine code by the runtime, in
//! the process or into an object file).
//!
//! One function per stage, with the runtime's pointer-table ABI:
//! `fn(rows, args, scratch)`, where `args` holds each row's input and
//! output pointers. For each row the function
//! walks the plan's items in order: scalars (literals, reductions) stay
//! in registers, broadcasts are splats, slices are pointers into their
//! source, and each fused loop is one loop of `f32x4` operations with a
//! scalar tail, writing the members the plan stores into their output or
//! into scratch. It reads nothing of the graph: every decision is the plan's. Row reductions (LayerNorm's `mean`) accumulate in four lanes and
//! add them in a fixed order, so results are the same run to run.
//!
//! [`define_stage`] builds the function; the runtime's `jit` compiles it
//! into the process, its `object` into an object file ahead of time, both
//! with the same ISA settings, so the machine code, and every result, is
//! the same.

pub mod math;

use crate::ir::{BinaryOp, Op, ReduceOp, UnaryOp, ValueId};
use crate::kernel::cpu_math::SUM_CHAINS;
use crate::kernel::{FusedLoop, Item, KernelPlan, Kind, Literal, Operand};
use crate::shapes::Shapes;
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{types, AbiParam, InstBuilder, MemFlagsData, Type, Value};
use cranelift_codegen::isa::TargetFrontendConfig;
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use math::fc;
use std::collections::HashMap;

/// Why a stage could not be compiled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodegenError(pub String);

impl std::fmt::Display for CodegenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cranelift: {}", self.0)
    }
}

impl std::error::Error for CodegenError {}

/// How a value is held while one row is computed.
#[derive(Clone, Copy, Debug)]
enum Held {
    /// A scalar in a register.
    Scalar(Value),
    /// A vector whose every element is this scalar.
    Splat(Value),
    /// A vector in memory at this address (a pointer value).
    Mem(Value),
}

/// Builds the kernel `plan` (a stage at `shapes`) into `func`,
/// reading its inputs and writing its outputs through the row pointer
/// table. Returns the floats of scratch the function needs.
pub fn define_stage(
    func: &mut cranelift_codegen::ir::Function,
    target: TargetFrontendConfig,
    shapes: &Shapes,
    plan: &KernelPlan,
) -> Result<usize, CodegenError> {
    let ptr = target.pointer_type();
    func.signature.params.clear();
    func.signature.returns.clear();
    for _ in 0..3 {
        func.signature.params.push(AbiParam::new(ptr));
    }
    let mut fctx = FunctionBuilderContext::new();
    let mut b = FunctionBuilder::new(func, &mut fctx);
    let mut g = Gen { b: &mut b, shapes, ptr, held: HashMap::new(), plan };
    g.body()?;
    b.seal_all_blocks();
    b.finalize(target);
    Ok(plan.scratch_floats)
}

struct Gen<'a, 'b> {
    b: &'a mut FunctionBuilder<'b>,
    shapes: &'a Shapes,
    ptr: Type,
    held: HashMap<ValueId, Held>,
    /// What the kernel computes, decided by the compiler's kernel plan.
    plan: &'a KernelPlan,
}

fn flags() -> MemFlagsData {
    MemFlagsData::trusted()
}

impl Gen<'_, '_> {
    fn len(&self, v: ValueId) -> usize {
        self.shapes.elements(v)
    }

    fn body(&mut self) -> Result<(), CodegenError> {
        let plan = self.plan;
        let entry = self.b.create_block();
        let head = self.b.create_block();
        let body = self.b.create_block();
        let exit = self.b.create_block();
        self.b.append_block_params_for_function_params(entry);
        self.b.append_block_param(head, self.ptr);
        self.b.switch_to_block(entry);
        let p = self.b.block_params(entry).to_vec();
        let (rows, args, scratch) = (p[0], p[1], p[2]);
        let zero = self.b.ins().iconst(self.ptr, 0);
        self.b.ins().jump(head, &[zero.into()]);

        self.b.switch_to_block(head);
        let r = self.b.block_params(head)[0];
        let more = self.b.ins().icmp(IntCC::UnsignedLessThan, r, rows);
        self.b.ins().brif(more, body, &[], exit, &[]);

        self.b.switch_to_block(body);
        let k = (plan.input_count + plan.outputs.len()) as i64;
        let row_bytes = self.b.ins().imul_imm_s(r, k * 8);
        let base = self.b.ins().iadd(args, row_bytes);
        self.held.clear();
        // Literals first, even where they are also inputs.
        for &(v, literal) in &plan.literals {
            let h = match literal {
                Literal::Scalar(x) => Held::Scalar(self.b.ins().f32const(x)),
                Literal::Splat(x) => Held::Splat(self.b.ins().f32const(x)),
            };
            self.held.insert(v, h);
        }
        for &(i, v, kind) in &plan.inputs {
            let p = self.b.ins().load(self.ptr, flags(), base, (i * 8) as i32);
            let h = match kind {
                Kind::Vector => Held::Mem(p),
                Kind::Scalar | Kind::Splat => Held::Scalar(self.b.ins().load(types::F32, flags(), p, 0)),
            };
            self.held.insert(v, h);
        }
        let slot = |i: usize| ((plan.input_count + i) * 8) as i32;
        let mut out_ptr: HashMap<ValueId, Value> = HashMap::new();
        for (i, out) in plan.outputs.iter().enumerate() {
            let p = self.b.ins().load(self.ptr, flags(), base, slot(i));
            out_ptr.entry(out.value).or_insert(p);
        }
        for item in &plan.items {
            match item {
                Item::Fused(l) => self.fused(l, &out_ptr, scratch)?,
                other => self.single(other, &out_ptr, scratch)?,
            }
        }
        // Outputs not written in place.
        for (i, out) in plan.outputs.iter().enumerate() {
            let p = self.b.ins().load(self.ptr, flags(), base, slot(i));
            if !out.in_place {
                let h = self.get(out.value, out.value)?;
                self.copy(h, p, self.len(out.value));
            }
        }
        let next = self.b.ins().iadd_imm_s(r, 1);
        self.b.ins().jump(head, &[next.into()]);
        self.b.switch_to_block(exit);
        self.b.ins().return_(&[]);
        Ok(())
    }

    fn get(&self, reader: ValueId, v: ValueId) -> Result<Held, CodegenError> {
        self.held.get(&v).copied().ok_or_else(|| CodegenError(format!("{reader} reads {v}, not available")))
    }

    /// Emits a fused loop: every member each iteration, in registers; a
    /// stored member is also written to its output or to scratch.
    fn fused(
        &mut self,
        l: &FusedLoop,
        out_ptr: &HashMap<ValueId, Value>,
        scratch: Value,
    ) -> Result<(), CodegenError> {
        let mut keep: Vec<Option<Value>> = Vec::with_capacity(l.members.len());
        for m in &l.members {
            let kept = match m.stored {
                true => Some(self.storage(m.value, out_ptr.get(&m.value).copied(), scratch)?),
                false => None,
            };
            keep.push(kept);
        }
        let outside: Vec<Held> =
            l.outside.iter().map(|&o| self.get(l.members[0].value, o)).collect::<Result<_, _>>()?;
        self.each(l.len, |g, ty, off| {
            let loaded: Vec<Value> = outside.iter().map(|&h| g.load(h, ty, off)).collect();
            let mut results: Vec<Value> = Vec::with_capacity(l.members.len());
            for (m, kept) in l.members.iter().zip(&keep) {
                let args: Vec<Value> = m
                    .operands
                    .iter()
                    .map(|a| match *a {
                        Operand::Outside(i) => loaded[i],
                        Operand::Member(j) => results[j],
                    })
                    .collect();
                let r = g.op(&m.op, ty, &args);
                if let Some(addr) = kept {
                    let at = g.b.ins().iadd(*addr, off);
                    g.b.ins().store(flags(), r, at, 0);
                }
                results.push(r);
            }
        });
        for (m, kept) in l.members.iter().zip(&keep) {
            if let Some(addr) = kept {
                self.held.insert(m.value, Held::Mem(*addr));
            }
        }
        Ok(())
    }

    /// Storage for a computed vector: its output, or its place in scratch.
    fn storage(&mut self, v: ValueId, dst: Option<Value>, scratch: Value) -> Result<Value, CodegenError> {
        if let Some(d) = dst {
            return Ok(d);
        }
        let at = self.plan.scratch.get(&v).ok_or_else(|| CodegenError(format!("{v} has no storage")))?;
        Ok(self.b.ins().iadd_imm_s(scratch, (at * 4) as i64))
    }

    /// An item other than a fused loop.
    fn single(
        &mut self,
        item: &Item,
        out_ptr: &HashMap<ValueId, Value>,
        scratch: Value,
    ) -> Result<(), CodegenError> {
        let Some(v) = item.value() else { return Err(CodegenError("a loop is not a single value".into())) };
        let n = self.len(v);
        let h = match item {
            Item::Fused(_) => return Err(CodegenError(format!("{v}: a loop is not a single value"))),
            Item::Broadcast { src, .. } => match self.get(v, *src)? {
                Held::Scalar(s) | Held::Splat(s) => Held::Splat(s),
                Held::Mem(p) => Held::Splat(self.b.ins().load(types::F32, flags(), p, 0)),
            },
            Item::Slice { src, offset, .. } => match self.get(v, *src)? {
                Held::Mem(p) => Held::Mem(self.b.ins().iadd_imm_s(p, (offset * 4) as i64)),
                other => other,
            },
            Item::Scalar { op, args, splat, .. } => {
                let mut values = Vec::with_capacity(args.len());
                for &o in args {
                    values.push(match self.get(v, o)? {
                        Held::Scalar(s) | Held::Splat(s) => s,
                        Held::Mem(p) => self.b.ins().load(types::F32, flags(), p, 0),
                    });
                }
                let r = self.op(op, types::F32, &values);
                if *splat {
                    Held::Splat(r)
                } else {
                    Held::Scalar(r)
                }
            }
            Item::Reduce { src, op, len, .. } => {
                let m = *len;
                let sum = match self.get(v, *src)? {
                    Held::Scalar(s) | Held::Splat(s) => {
                        let k = self.b.ins().f32const(m as f32);
                        self.b.ins().fmul(s, k)
                    }
                    Held::Mem(p) => self.sum(p, m),
                };
                Held::Scalar(match op {
                    ReduceOp::Sum => sum,
                    ReduceOp::Mean => {
                        let k = self.b.ins().f32const(m as f32);
                        self.b.ins().fdiv(sum, k)
                    }
                })
            }
            Item::Pad { src, offset, .. } => {
                let out = self.storage(v, out_ptr.get(&v).copied(), scratch)?;
                let zero = self.b.ins().f32const(0.0);
                self.copy(Held::Splat(zero), out, n);
                let at = self.b.ins().iadd_imm_s(out, (offset * 4) as i64);
                let h = self.get(v, *src)?;
                self.copy(h, at, self.len(*src));
                Held::Mem(out)
            }
            Item::Concat { parts, .. } => {
                let out = self.storage(v, out_ptr.get(&v).copied(), scratch)?;
                let mut at = 0usize;
                for &o in parts {
                    let h = self.get(v, o)?;
                    let p = self.b.ins().iadd_imm_s(out, (at * 4) as i64);
                    let l = self.len(o);
                    self.copy(h, p, l);
                    at += l;
                }
                Held::Mem(out)
            }
        };
        self.held.insert(v, h);
        Ok(())
    }

    /// Loads element(s) at byte offset `off` of a held value.
    fn load(&mut self, h: Held, ty: Type, off: Value) -> Value {
        match h {
            Held::Scalar(s) | Held::Splat(s) => {
                if ty.is_vector() {
                    self.b.ins().splat(ty, s)
                } else {
                    s
                }
            }
            Held::Mem(p) => {
                let addr = self.b.ins().iadd(p, off);
                self.b.ins().load(ty, flags(), addr, 0)
            }
        }
    }

    /// Emits `body(ty, byte_offset)` over `n` elements: f32x4 steps, then a scalar tail.
    ///
    /// The f32x4 loop does four vectors per iteration (`UNROLL`): the
    /// bodies are independent chains of polynomial arithmetic that the core
    /// overlaps, where one long chain per iteration left it waiting (the
    /// LSTM's stages: 6-35% faster than one vector, 0-20% than two).
    fn each(&mut self, n: usize, mut body: impl FnMut(&mut Self, Type, Value)) {
        const UNROLL: usize = 4;
        let wide_n = n / (4 * UNROLL) * (4 * UNROLL);
        let vec_n = n / 4 * 4;
        for (ty, from, to, step) in [
            (types::F32X4, 0, wide_n, 4 * UNROLL),
            (types::F32X4, wide_n, vec_n, 4),
            (types::F32, vec_n, n, 1),
        ] {
            if from >= to {
                continue;
            }
            let head = self.b.create_block();
            let blk = self.b.create_block();
            let done = self.b.create_block();
            self.b.append_block_param(head, self.ptr);
            let start = self.b.ins().iconst(self.ptr, (from * 4) as i64);
            self.b.ins().jump(head, &[start.into()]);
            self.b.switch_to_block(head);
            let off = self.b.block_params(head)[0];
            let more = self.b.ins().icmp_imm_s(IntCC::UnsignedLessThan, off, (to * 4) as i64);
            self.b.ins().brif(more, blk, &[], done, &[]);
            self.b.switch_to_block(blk);
            body(self, ty, off);
            for u in 1..step / 4 {
                let at = self.b.ins().iadd_imm_s(off, (u * 16) as i64);
                body(self, ty, at);
            }
            let next = self.b.ins().iadd_imm_s(off, (step * 4) as i64);
            self.b.ins().jump(head, &[next.into()]);
            self.b.switch_to_block(done);
        }
    }

    /// Writes `n` elements of a held value to `dst`.
    fn copy(&mut self, src: Held, dst: Value, n: usize) {
        self.each(n, |g, ty, off| {
            let x = g.load(src, ty, off);
            let addr = g.b.ins().iadd(dst, off);
            g.b.ins().store(flags(), x, addr, 0);
        });
    }

    /// Sum of `n` floats at `p`: [`SUM_CHAINS`] `f32x4` accumulators over
    /// blocks of `4 * SUM_CHAINS` floats (independent chains, so the adds
    /// overlap rather than wait on each other's latency: the walker's
    /// AVX-512 runs them as four `zmm` and its AVX2 as eight `ymm`, at the
    /// same bits), folded in halves (chain `c` plus chain `c + 8`, then
    /// `c + 4`, ...: whole vectors of the walker's); then one vector over
    /// the rest in fours; then its lanes in a fixed order; then the tail.
    /// The order is fixed, so results are the same run to run.
    fn sum(&mut self, p: Value, n: usize) -> Value {
        let wide_n = n / (4 * SUM_CHAINS) * (4 * SUM_CHAINS);
        let vec_n = n / 4 * 4;
        let zero_s = self.b.ins().f32const(0.0);
        let mut total = zero_s;
        if vec_n > 0 {
            let zero_v = self.b.ins().splat(types::F32X4, zero_s);
            let mut acc = zero_v;
            if wide_n > 0 {
                let mut accs = self.sum_loop(p, 0, wide_n, &[zero_v; SUM_CHAINS]);
                while accs.len() > 1 {
                    let half = accs.len() / 2;
                    accs = (0..half).map(|c| self.b.ins().fadd(accs[c], accs[c + half])).collect();
                }
                acc = accs[0];
            }
            if vec_n > wide_n {
                acc = self.sum_loop(p, wide_n, vec_n, &[acc])[0];
            }
            let lanes: Vec<Value> = (0..4).map(|i| self.b.ins().extractlane(acc, i as u8)).collect();
            total = self.pairwise_sum(lanes);
        }
        for i in vec_n..n {
            let x = self.b.ins().load(types::F32, flags(), p, (i * 4) as i32);
            total = self.b.ins().fadd(total, x);
        }
        total
    }

    /// `(v0 + v1) + (v2 + v3) ...` of one or more values: neighbours added
    /// in pairs, level by level.
    fn pairwise_sum(&mut self, mut values: Vec<Value>) -> Value {
        while values.len() > 1 {
            values = values
                .chunks(2)
                .map(|pair| match *pair {
                    [x, y] => self.b.ins().fadd(x, y),
                    _ => pair[0],
                })
                .collect();
        }
        values[0]
    }

    /// Adds floats `[from, to)` at `p` into the `f32x4` accumulators
    /// `init`, each taking every `init.len()`-th vector; returns them.
    fn sum_loop(&mut self, p: Value, from: usize, to: usize, init: &[Value]) -> Vec<Value> {
        let chains = init.len();
        let head = self.b.create_block();
        let blk = self.b.create_block();
        let done = self.b.create_block();
        self.b.append_block_param(head, self.ptr);
        for _ in 0..chains {
            self.b.append_block_param(head, types::F32X4);
            self.b.append_block_param(done, types::F32X4);
        }
        let start = self.b.ins().iconst(self.ptr, (from * 4) as i64);
        let args: Vec<_> = std::iter::once(start).chain(init.iter().copied()).map(Into::into).collect();
        self.b.ins().jump(head, &args);
        self.b.switch_to_block(head);
        let params = self.b.block_params(head).to_vec();
        let (off, accs) = (params[0], &params[1..]);
        let more = self.b.ins().icmp_imm_s(IntCC::UnsignedLessThan, off, (to * 4) as i64);
        let carried: Vec<_> = accs.iter().map(|&a| a.into()).collect();
        self.b.ins().brif(more, blk, &[], done, &carried);
        self.b.switch_to_block(blk);
        let addr = self.b.ins().iadd(p, off);
        let mut next: Vec<_> = Vec::with_capacity(chains + 1);
        next.push(self.b.ins().iadd_imm_s(off, (chains * 16) as i64).into());
        for (c, &a) in accs.iter().enumerate() {
            let x = self.b.ins().load(types::F32X4, flags(), addr, (c * 16) as i32);
            next.push(self.b.ins().fadd(a, x).into());
        }
        self.b.ins().jump(head, &next);
        self.b.switch_to_block(done);
        self.b.block_params(done).to_vec()
    }

    /// One elementwise op at type `ty` (f32 or f32x4).
    fn op(&mut self, op: &Op, ty: Type, a: &[Value]) -> Value {
        let b = &mut *self.b;
        match op {
            Op::Unary(u) => {
                let x = a[0];
                match u {
                    UnaryOp::Neg => b.ins().fneg(x),
                    UnaryOp::Copy | UnaryOp::StopGradient => x,
                    UnaryOp::Sigmoid => math::sigmoid(b, ty, x),
                    UnaryOp::Tanh => math::tanh(b, ty, x),
                    UnaryOp::Relu => {
                        // `x < 0 ? 0 : x`: NaN stays NaN.
                        let z = fc(b, ty, 0.0);
                        let neg = b.ins().fcmp(FloatCC::LessThan, x, z);
                        math::choose(b, ty, neg, z, x)
                    }
                    UnaryOp::Exp => math::exp(b, ty, x),
                    UnaryOp::Log => math::log(b, ty, x),
                    UnaryOp::Sqrt => b.ins().sqrt(x),
                    UnaryOp::Rsqrt => {
                        let s = b.ins().sqrt(x);
                        let one = fc(b, ty, 1.0);
                        b.ins().fdiv(one, s)
                    }
                    UnaryOp::Abs => b.ins().fabs(x),
                    UnaryOp::Softplus => {
                        // max(x, 0) + log(1 + exp(-|x|))
                        let z = fc(b, ty, 0.0);
                        let m = math::max(b, ty, x, z);
                        let ax = b.ins().fabs(x);
                        let nax = b.ins().fneg(ax);
                        let e = math::exp(b, ty, nax);
                        let one = fc(b, ty, 1.0);
                        let e1 = b.ins().fadd(one, e);
                        let l = math::log(b, ty, e1);
                        b.ins().fadd(m, l)
                    }
                    UnaryOp::Silu => {
                        let s = math::sigmoid(b, ty, x);
                        b.ins().fmul(x, s)
                    }
                    UnaryOp::Step => {
                        let z = fc(b, ty, 0.0);
                        math::indicator(b, ty, FloatCC::GreaterThan, x, z)
                    }
                    UnaryOp::Sign => {
                        // Each indicator is NaN for NaN, and so is their difference.
                        let z = fc(b, ty, 0.0);
                        let p = math::indicator(b, ty, FloatCC::GreaterThan, x, z);
                        let n = math::indicator(b, ty, FloatCC::LessThan, x, z);
                        b.ins().fsub(p, n)
                    }
                }
            }
            Op::Binary(o) => {
                let (x, y) = (a[0], a[1]);
                match o {
                    BinaryOp::Add => b.ins().fadd(x, y),
                    BinaryOp::Sub => b.ins().fsub(x, y),
                    BinaryOp::Mul => b.ins().fmul(x, y),
                    BinaryOp::Div => b.ins().fdiv(x, y),
                    BinaryOp::Min => math::min(b, ty, x, y),
                    BinaryOp::Max => math::max(b, ty, x, y),
                    BinaryOp::Ge => math::indicator(b, ty, FloatCC::GreaterThanOrEqual, x, y),
                    BinaryOp::Gt => math::indicator(b, ty, FloatCC::GreaterThan, x, y),
                }
            }
            Op::Select => {
                // `NotEqual` is unordered-or-not-equal: a NaN condition picks
                // `x`, and `keep_nan` then makes the result that NaN.
                let (cond, x, y) = (a[0], a[1], a[2]);
                let z = fc(b, ty, 0.0);
                let nonzero = b.ins().fcmp(FloatCC::NotEqual, cond, z);
                let r = math::choose(b, ty, nonzero, x, y);
                math::keep_nan(b, ty, cond, cond, r)
            }
            // Only elementwise ops reach here.
            _ => a[0],
        }
    }
}
