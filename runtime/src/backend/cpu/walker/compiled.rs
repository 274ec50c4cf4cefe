//! A fused loop compiled to machine code for the walker's instruction set
//! (AVX-512 or AVX2) instead of walked: the walker's own math traced once
//! ([`super::trace`]), register-allocated and encoded ([`super::emit`])
//! into a function that runs the whole loop of a row with every value in
//! registers. The same instructions on the same operands as the walker's
//! set, so the same bits (tested on every stage of every shipped cell and
//! of random cells); the pointwise stages take about 0.5-0.85x the
//! walker's time (`benches/kernels.rs`).
//!
//! A loop's inputs must be held as the walker's plan says they will be
//! (vectors in memory, or floats for every lane), and a store may lie
//! exactly where an input does or apart from it; a row where either does
//! not hold is walked instead.

use super::emit::{emit, Header, Source, Trace};
use super::lanes::Math;
use super::math;
use super::target::Target;
use super::trace::{record, Traced};
use super::{Code, Fused};

/// A loop's compiled code.
pub struct CompiledLoop {
    /// Owns the executable memory `func` points into.
    _code: memmap2::Mmap,
    func: LoopFn,
    /// How each outside value is read.
    pub sources: Vec<Source>,
    /// Row pointers the code reads (vector inputs, then stores).
    pub pointers: usize,
    /// Scalars it reads.
    pub scalars: usize,
    constants: Vec<u32>,
    /// Bytes of spill area it needs.
    pub spill_bytes: usize,
    /// Vectors of its wide iterations.
    width: usize,
    /// The instruction set it runs on: its scalars are given in
    /// [`Target::copies`] copies each.
    pub target: Target,
}

/// The compiled loop's ABI (see [`super::emit`]).
type LoopFn = unsafe extern "sysv64" fn(*const *mut f32, usize, *const u32, *const f32, *mut u8);

impl std::fmt::Debug for CompiledLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledLoop")
            .field("sources", &self.sources)
            .field("pointers", &self.pointers)
            .finish()
    }
}

/// What a compiled loop computes: its stored values from its inputs, on
/// any [`Math`] (traced to compile it; on an instruction set to check it).
pub trait Program {
    /// The stored values, in store order, from the inputs, in slot order.
    fn run<S: Math>(&self, s: S, inputs: Vec<S::V>) -> Vec<S::V>;
}

impl Program for Fused {
    fn run<S: Math>(&self, s: S, inputs: Vec<S::V>) -> Vec<S::V> {
        let mut values = inputs;
        let mut stored = Vec::new();
        for m in &self.members {
            let (a, b, c) = (values[m.a], values[m.b], values[m.c]);
            let v = match m.op {
                Code::Unary(u) => math::unary_vector(s, u, a),
                Code::Binary(o) => math::binary_vector(s, o, a, b),
                Code::Select => math::select_one(s, a, b, c),
                Code::First => a,
            };
            values.push(v);
            if m.store.is_some() {
                stored.push(v);
            }
        }
        stored
    }
}

impl CompiledLoop {
    /// `program` compiled, its inputs read as `vector` says (`true`: a
    /// vector in memory; `false`: one float for every lane). An error
    /// names what the emitter could not do.
    pub fn new(target: Target, program: &impl Program, vector: &[bool]) -> Result<CompiledLoop, String> {
        let mut sources = Vec::with_capacity(vector.len());
        let (mut pointers, mut scalars) = (0, 0);
        for &v in vector {
            if v {
                sources.push(Source::Vector(pointers));
                pointers += 1;
            } else {
                sources.push(Source::Scalar(scalars));
                scalars += 1;
            }
        }
        let inputs = vector.len();
        let narrow = trace::<1>(program, inputs, pointers);
        // The widest iteration, of 4 vectors or 2, that spills nothing;
        // else 2. (The narrow iteration runs the row's last vectors.)
        let mut emitted = None;
        for width in [4, 2] {
            let wide = if width == 4 {
                trace::<4>(program, inputs, pointers)
            } else {
                trace::<2>(program, inputs, pointers)
            };
            let e = emit(target, (&wide, width), &narrow, &sources)?;
            let spills = e.spill_slots > 0;
            emitted = Some((width, e));
            if !spills {
                break;
            }
        }
        let (width, emitted) = emitted.ok_or("no iteration was emitted")?;
        let stores = narrow.stores.len();
        let mut map = memmap2::MmapMut::map_anon(emitted.code.len().max(1)).map_err(|e| e.to_string())?;
        map[..emitted.code.len()].copy_from_slice(&emitted.code);
        let code = map.make_exec().map_err(|e| e.to_string())?;
        // SAFETY: the code is a function of this ABI (`emit`'s contract).
        let func = unsafe { std::mem::transmute::<*const u8, LoopFn>(code.as_ptr()) };
        Ok(CompiledLoop {
            _code: code,
            func,
            sources,
            pointers: pointers + stores,
            scalars,
            constants: emitted
                .constants
                .iter()
                .flat_map(|&c| std::iter::repeat_n(c, target.copies()))
                .collect(),
            spill_bytes: emitted.spill_bytes,
            width,
            target,
        })
    }

    /// Runs the loop over `len` floats of a row.
    ///
    /// # Safety
    /// `pointers` holds the loop's row pointers, each valid for `len`
    /// floats (stores apart from the inputs or exactly on one); `scalars`
    /// its scalars; `spill` is 64-byte aligned, writable for
    /// [`CompiledLoop::spill_bytes`].
    pub unsafe fn run(&self, pointers: &[*mut f32], scalars: &[f32], spill: *mut u8, len: usize) {
        debug_assert!(
            pointers.len() >= self.pointers && scalars.len() >= self.scalars * self.target.copies()
        );
        let header = Header::new(self.target, self.width, len);
        // SAFETY: per the contract; the header is the spill area's first bytes.
        unsafe {
            spill.cast::<Header>().write(header);
            (self.func)(
                pointers.as_ptr(),
                len / self.target.lanes() * self.target.bytes(),
                self.constants.as_ptr(),
                scalars.as_ptr(),
                spill,
            )
        }
    }
}

/// `program` traced on `U` vectors at a time, from `inputs` inputs, its
/// stores through row pointers from `first_store` on.
fn trace<const U: usize>(program: &impl Program, inputs: usize, first_store: usize) -> Trace {
    let (ops, stored) = record(|s: Traced<U>| program.run(s, (0..inputs).map(|i| s.input(i)).collect()));
    let stores = stored
        .into_iter()
        .enumerate()
        .flat_map(|(j, v)| v.into_iter().enumerate().map(move |(g, n)| (n, first_store + j, g)))
        .collect();
    Trace { ops, stores }
}

#[cfg(test)]
mod tests;
