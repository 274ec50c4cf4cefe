//! Compiled loops against the same programs run on their instruction set
//! (AVX-512 and AVX2, where the processor has them), bit for bit, where
//! the emitter must spill: more values alive than vector registers, more
//! comparisons alive than mask registers; over rows that take the wide
//! iterations, the narrow ones and the masked last vector; with a store
//! exactly over its input.

use super::super::lanes::{Avx2, Avx512, Lanes, Math};
use super::{CompiledLoop, Program};
use std::arch::x86_64::{_CMP_LT_OQ, _CMP_NEQ_UQ};

/// Inputs `0..VECTORS` are vectors, the last a scalar.
const VECTORS: usize = 40;

/// Forty tanh alive at once, summed; ten comparisons alive at once, then
/// their blends; stores the sum, the last tanh and the blends' product.
struct Crowded;

impl Program for Crowded {
    fn run<S: Math>(&self, s: S, inputs: Vec<S::V>) -> Vec<S::V> {
        let scalar = inputs[VECTORS];
        let t: Vec<S::V> = inputs[..VECTORS].iter().map(|&x| crate_tanh(s, s.mul(x, scalar))).collect();
        let mut sum = t[0];
        for &x in &t[1..] {
            sum = s.add(sum, x);
        }
        let c: Vec<S::Cmp> = (0..10).map(|i| s.cmp::<_CMP_LT_OQ>(inputs[i], inputs[i + 10])).collect();
        let mut product = s.splat(1.0);
        for (i, &c) in c.iter().enumerate() {
            product = s.mul(product, s.blend(c, inputs[i + 20], s.splat(i as f32)));
        }
        let ne = s.cmp::<_CMP_NEQ_UQ>(sum, product);
        vec![sum, t[VECTORS - 1], s.blend(ne, product, s.sqrt(s.fma(sum, sum, product)))]
    }
}

/// Tanh as the walker computes it.
fn crate_tanh<S: Math>(s: S, x: S::V) -> S::V {
    super::math::unary_vector(s, cellc::ir::UnaryOp::Tanh, x)
}

/// `y = 2x + 1`, stored where `x` lies.
struct InPlace;

impl Program for InPlace {
    fn run<S: Math>(&self, s: S, inputs: Vec<S::V>) -> Vec<S::V> {
        vec![s.fma(inputs[0], s.splat(2.0), s.splat(1.0))]
    }
}

/// The values of the test rows: ordinary numbers and specials.
fn row(seed: u64, len: usize) -> Vec<f32> {
    let special = [f32::NAN, f32::INFINITY, -0.0, 1e-40, 88.5, -9.0];
    (0..len as u64)
        .map(|i| {
            let r = (seed * 7919 + i * 104_729) % 1000;
            if r.is_multiple_of(13) {
                special[(r as usize / 13) % special.len()]
            } else {
                r as f32 / 100.0 - 5.0
            }
        })
        .collect()
}

/// `program` on the set, a vector at a time (the last one masked).
fn reference<S: Lanes>(
    s: S,
    program: &impl Program,
    vectors: &[Vec<f32>],
    scalars: &[f32],
    len: usize,
) -> Vec<Vec<f32>> {
    let mut outs: Vec<Vec<f32>> = Vec::new();
    s.enter(|| {
        for off in (0..len).step_by(S::LANES) {
            let lanes = (len - off).min(S::LANES);
            let mask = s.mask(lanes);
            // SAFETY: each row holds `len` floats; the mask stops at them.
            let mut inputs: Vec<_> =
                vectors.iter().map(|v| unsafe { s.load_masked(v.as_ptr().add(off), mask) }).collect();
            inputs.extend(scalars.iter().map(|&x| s.splat(x)));
            let stored = program.run(s, inputs);
            outs.resize(stored.len(), vec![0.0; len]);
            for (out, v) in outs.iter_mut().zip(stored) {
                // SAFETY: as above.
                unsafe { s.store_masked(out.as_mut_ptr().add(off), mask, v) };
            }
        }
    });
    outs
}

fn same(what: &str, a: &[f32], b: &[f32]) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
            "{what} [{i}]: {x:e} against {y:e}"
        );
    }
}

/// Rows that end in the wide iterations, the narrow ones and the masked vector.
const LENGTHS: [usize; 9] = [1, 15, 16, 17, 33, 63, 64, 65, 130];

/// A compiled loop's run over rows of `len` floats: `vectors` then
/// `outs` through the pointer table, `scalars` copied for the target.
fn run_compiled(compiled: &CompiledLoop, table: &[*mut f32], scalars: &[f32], len: usize) {
    let scalars: Vec<f32> =
        scalars.iter().flat_map(|&x| std::iter::repeat_n(x, compiled.target.copies())).collect();
    let mut spill = vec![[0u8; 64]; compiled.spill_bytes / 64 + 1];
    let spill = spill.as_mut_ptr().cast::<u8>().wrapping_add(64 - spill.as_ptr() as usize % 64);
    // SAFETY: every pointer holds `len` floats (the callers'); the spill
    // area is aligned and long enough.
    unsafe { compiled.run(table, &scalars, spill, len) };
}

fn crowded<S: Lanes>(s: S) {
    let target = S::COMPILED.expect("a compiled set");
    let mut vector = vec![true; VECTORS];
    vector.push(false);
    let compiled = CompiledLoop::new(target, &Crowded, &vector).expect("compiles");
    assert!(compiled.spill_bytes > 64, "the program must spill to test spilling");
    for len in LENGTHS {
        let vectors: Vec<Vec<f32>> = (0..VECTORS as u64).map(|i| row(i + 1, len)).collect();
        let scalars = [0.37f32];
        let expected = reference(s, &Crowded, &vectors, &scalars, len);
        let mut outs = vec![vec![f32::NAN; len]; expected.len()];
        let mut table: Vec<*mut f32> = vectors.iter().map(|v| v.as_ptr().cast_mut()).collect();
        table.extend(outs.iter_mut().map(|o| o.as_mut_ptr()));
        run_compiled(&compiled, &table, &scalars, len);
        for (k, (o, e)) in outs.iter().zip(&expected).enumerate() {
            same(&format!("{} store {k}, {len} floats", S::NAME), o, e);
        }
    }
}

fn in_place<S: Lanes>(s: S) {
    let compiled =
        CompiledLoop::new(S::COMPILED.expect("a compiled set"), &InPlace, &[true]).expect("compiles");
    for len in LENGTHS {
        let mut x = row(3, len);
        let expected = reference(s, &InPlace, std::slice::from_ref(&x), &[], len);
        let p = x.as_mut_ptr();
        run_compiled(&compiled, &[p, p], &[], len);
        same(&format!("{} {len} floats", S::NAME), &x, &expected[0]);
    }
}

/// `check` on each set this processor has.
fn each_set(check: fn(Avx512), check2: fn(Avx2)) {
    match Avx512::detect() {
        Some(s) => check(s),
        None => eprintln!("skipped on AVX-512: this processor lacks it"),
    }
    match Avx2::detect() {
        Some(s) => check2(s),
        None => eprintln!("skipped on AVX2: this processor lacks it"),
    }
}

#[test]
fn values_beyond_the_registers_spill_and_stay_exact() {
    each_set(crowded::<Avx512>, crowded::<Avx2>);
}

#[test]
fn a_store_over_its_input_reads_it_first() {
    each_set(in_place::<Avx512>, in_place::<Avx2>);
}
