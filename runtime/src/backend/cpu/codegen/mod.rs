//! Pointwise stages compiled to native code with Cranelift: the emitter
//! lives with the compiler ([`cellc::clif`]); here its functions are
//! compiled, into the process ([`jit`]) or an object file (`object`, with the `object` feature),
//! with the same ISA settings ([`isa`]), so the machine code, and every
//! result, is the same either way.

#[cfg(feature = "jit")]
pub mod jit;
#[cfg(feature = "object")]
pub mod object;

pub use cellc::clif::{define_stage, math, CodegenError};
#[cfg(all(test, feature = "jit"))]
use cellc::{
    ir::{Op, UnaryOp},
    shapes::Shapes,
};
use cranelift_codegen::settings::{self, Configurable};

/// The host's ISA with the settings every kernel is compiled with.
pub fn isa() -> Result<cranelift_codegen::isa::OwnedTargetIsa, CodegenError> {
    let mut flags = settings::builder();
    flags.set("opt_level", "speed").map_err(|e| CodegenError(e.to_string()))?;
    flags.set("is_pic", "false").map_err(|e| CodegenError(e.to_string()))?;
    flags.set("use_colocated_libcalls", "false").map_err(|e| CodegenError(e.to_string()))?;
    let native = cranelift_native::builder().map_err(|e| CodegenError(e.to_string()))?;
    native.finish(settings::Flags::new(flags)).map_err(|e| CodegenError(e.to_string()))
}

/// A compiled one-op kernel over `n` elements, for the accuracy tests.
#[cfg(all(test, feature = "jit"))]
pub fn compile_unary_for_test(op: UnaryOp, n: usize) -> impl Fn(&[f32]) -> Vec<f32> {
    let src =
        format!("cell t {{ input x[N] state h[N] h' = {}(x) + 0 * h\n output {}(x) }}", op.name(), op.name());
    let module = cellc::compile("t.cell", &src).into_result().expect("test cell compiles");
    let cell = module.cells.into_iter().next().expect("one cell");
    let cell = cellc::program::Steps::compile(&cell).expect("verifies").forward;
    let sizes = [("N".to_string(), n)].into();
    let plan = Shapes::new(&cell, &sizes, "t").expect("plan");
    let x = cell.values().find(|&v| matches!(cell.node(v).op, Op::Input(0))).expect("x");
    let out = cell.output;
    let stage = jit::compile_values(&cell, &plan, &[out], &[x], &[out]).expect("compiles");
    move |xs: &[f32]| {
        let mut input = xs.to_vec();
        let mut y = vec![0.0f32; xs.len()];
        // SAFETY: one row, both pointers valid for n floats.
        unsafe {
            crate::backend::cpu::stage::StageExec::run(&stage, 1, &[input.as_mut_ptr(), y.as_mut_ptr()])
        };
        y
    }
}

#[cfg(all(test, feature = "jit"))]
pub(crate) mod tests {
    use super::*;
    use crate::backend::cpu::native::NativeStage;
    use crate::backend::cpu::stage::{Interpreted, StageExec};
    use std::sync::Arc;

    /// Every shipped cell's file name and source, in name order.
    pub(crate) fn shipped_cells() -> Vec<(String, String)> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../cells");
        let mut files: Vec<_> =
            std::fs::read_dir(&dir).expect("cells/").map(|e| e.expect("entry").path()).collect();
        files.sort();
        files
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "cell"))
            .map(|path| {
                let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                (name, std::fs::read_to_string(path).expect("readable"))
            })
            .collect()
    }

    /// Every pointwise stage of every shipped cell, forward and backward,
    /// compiled and run against the interpreted stage on random rows.
    #[test]
    fn every_stage_of_every_cell_matches_the_interpreter() {
        let mut compiled = 0;
        for (_, src) in shipped_cells() {
            let module = cellc::compile("c.cell", &src).into_result().expect("compiles");
            for cell in &module.cells {
                let steps = cellc::program::Steps::compile(cell).expect("verifies");
                for h in [1usize, 5, 13] {
                    let sizes: cellc::dims::Bindings =
                        cell.sizes.iter().map(|s| (s.clone(), if s == "I" { 3 } else { h })).collect();
                    let program = steps.program(&sizes).expect("sizes");
                    for side in cellc::program::Side::BOTH {
                        let (graph, stages, plan) =
                            (steps.graph(side), program.stages(side), program.shapes(side));
                        let g = Arc::new(graph.clone());
                        let p = Arc::new(plan.clone());
                        for (i, st) in stages.iter().enumerate().filter(|(_, s)| s.kind.is_kernel()) {
                            let kernel = program.kernel(side, i).expect("a kernel stage has a plan");
                            let jit = jit::compile_stage(plan, &kernel.plan, &st.inputs, &st.outputs)
                                .unwrap_or_else(|e| panic!("{} H={h}: {e}", cell.name));
                            let reference =
                                Interpreted::new(g.clone(), p.clone(), &st.values, &st.inputs, &st.outputs);
                            compare(&jit, &reference, plan, &format!("{} H={h}", cell.name));
                            compiled += 1;
                        }
                    }
                }
            }
        }
        assert!(compiled > 50, "only {compiled} stages compiled");
    }

    fn compare(jit: &NativeStage, reference: &Interpreted, plan: &Shapes, name: &str) {
        let rows = 3;
        let mut seed = 1u64;
        let mut rand = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let mut inputs: Vec<Vec<f32>> = Vec::new();
        for _ in 0..rows {
            for &v in jit.inputs() {
                // Positive values keep log/sqrt inputs in their domain where a stage takes them directly.
                inputs.push((0..plan.elements(v)).map(|_| rand() * 0.5 + 0.6).collect());
            }
        }
        let mut out_a: Vec<Vec<f32>> =
            (0..rows).flat_map(|_| jit.outputs().iter().map(|&v| vec![0.0; plan.elements(v)])).collect();
        let mut out_b = out_a.clone();
        let table = |inputs: &mut Vec<Vec<f32>>, outs: &mut Vec<Vec<f32>>| -> Vec<*mut f32> {
            let (ni, no) = (jit.inputs().len(), jit.outputs().len());
            let mut t = Vec::new();
            for r in 0..rows {
                for i in 0..ni {
                    t.push(inputs[r * ni + i].as_mut_ptr());
                }
                for o in 0..no {
                    t.push(outs[r * no + o].as_mut_ptr());
                }
            }
            t
        };
        let ta = table(&mut inputs, &mut out_a);
        // SAFETY: every pointer is a live buffer of its value's length.
        unsafe { jit.run(rows, &ta) };
        let tb = table(&mut inputs, &mut out_b);
        // SAFETY: as above.
        unsafe { reference.run(rows, &tb) };
        let no = jit.outputs().len();
        for (k, (a, b)) in out_a.iter().zip(&out_b).enumerate() {
            for (x, y) in a.iter().zip(b) {
                let ok = (x - y).abs() <= 2e-5 * y.abs().max(1.0) || (x.is_nan() && y.is_nan());
                assert!(
                    ok,
                    "{name}: output {} of {:?} (inputs {:?}): jit {x} vs interpreter {y}",
                    jit.outputs()[k % no],
                    jit.outputs(),
                    jit.inputs()
                );
            }
        }
    }
}

#[cfg(all(test, feature = "jit"))]
mod math_accuracy {
    //! Accuracy over a sweep of f32 inputs, against f64 std math.
    use super::compile_unary_for_test;
    use cellc::clif::math::MAX_ULP;
    use cellc::ir::UnaryOp;

    /// Units in the last place between an f32 result and the exact f64 value.
    fn ulps(got: f32, exact: f64) -> f64 {
        if exact == 0.0 {
            return (got as f64).abs() / f32::MIN_POSITIVE as f64;
        }
        let e = exact as f32;
        let ulp = (f32::from_bits(e.abs().to_bits() + 1) - e.abs()) as f64;
        (got as f64 - exact).abs() / ulp
    }

    fn sweep(op: UnaryOp, lo: f32, hi: f32, exact: fn(f64) -> f64) -> (f64, f64, f32) {
        // Every 37th bit pattern of the finite floats in [lo, hi], both signs as given.
        let mut xs: Vec<f32> = Vec::new();
        for sign in [0u32, 0x8000_0000] {
            let mut bits = 0u32;
            while bits < 0x7f80_0000 {
                let x = f32::from_bits(bits | sign);
                if x >= lo && x <= hi {
                    xs.push(x);
                }
                bits += 37;
            }
        }
        let f = compile_unary_for_test(op, xs.len());
        let got = f(&xs);
        let (mut worst_ulp, mut worst_rel, mut at) = (0.0f64, 0.0f64, 0.0f32);
        for (&x, &y) in xs.iter().zip(&got) {
            let e = exact(x as f64);
            if !e.is_finite() || (e as f32).abs() < f32::MIN_POSITIVE {
                continue;
            }
            let u = ulps(y, e);
            if u > worst_ulp {
                worst_ulp = u;
                at = x;
            }
            worst_rel = worst_rel.max((y as f64 - e).abs() / e.abs());
        }
        (worst_ulp, worst_rel, at)
    }

    #[test]
    fn accuracy_sweep() {
        type Case = (UnaryOp, f32, f32, fn(f64) -> f64, f64);
        let cases: [Case; 5] = [
            (UnaryOp::Exp, -87.0, 88.0, f64::exp, 4.0),
            (UnaryOp::Sigmoid, -80.0, 80.0, |x| 1.0 / (1.0 + (-x).exp()), 4.0),
            // Eigen's rational tanh (PyTorch's CPU tanh): 5.2 ulp just
            // below ±1 (relative 3.1e-7), for half the instructions of
            // the exp-based form, which held 4.
            (UnaryOp::Tanh, -20.0, 20.0, f64::tanh, MAX_ULP),
            (UnaryOp::Log, 0.0, f32::MAX, f64::ln, 4.0),
            (UnaryOp::Silu, -80.0, 80.0, |x| x / (1.0 + (-x).exp()), MAX_ULP),
        ];
        for (op, lo, hi, exact, limit) in cases {
            let (u, r, at) = sweep(op, lo, hi, exact);
            eprintln!("{op:?}: max {u:.2} ulp (relative {r:.2e}) at x = {at:e}");
            assert!(u <= limit, "{op:?}: {u} ulp at {at}");
        }
    }

    /// NaN in, NaN out, in the vector body (the first four lanes) and the
    /// scalar tail (the fifth): the clamps inside `exp` must not turn it
    /// into a bound, nor a comparison in `relu` into 0.
    #[test]
    fn every_builtin_propagates_nan() {
        let xs = [f32::NAN, 1.5, 0.25, f32::NAN, f32::NAN];
        for op in UnaryOp::BUILTINS {
            let f = compile_unary_for_test(op, xs.len());
            let ys = f(&xs);
            for (x, y) in xs.iter().zip(&ys) {
                assert_eq!(x.is_nan(), y.is_nan(), "{op:?}({x}) = {y}");
            }
        }
    }
}
