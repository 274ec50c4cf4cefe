//! The CPU back end's building blocks, one at a time: the LSTM's and the
//! LayerNorm-LSTM's pointwise stages (forward and backward step) JIT-compiled, walked on
//! AVX-512 and on AVX2 where the processor has them, and interpreted, the
//! kernels' own exp/tanh/sigmoid polynomials against the standard library's, and `gemm` and the packed-panel kernel on
//! the shapes an RNN runs. Everything is built through the public API, the way the back
//! end builds it, so a change inside the back end shows up here unchanged.
//!
//! `cargo bench -p cellc-benches --bench kernels`

use cellc::ir::{Op, ValueId};
use cellc::kernel::KernelPlan;
use cellc::schedule::StageKind;
use cellc::shapes::Shapes;
use cellc_runtime::backend::cpu::codegen::jit::compile_stage;
use cellc_runtime::backend::cpu::gemm::{matmul, View};
use cellc_runtime::backend::cpu::panels::{PackedB, Rows};
use cellc_runtime::backend::cpu::product::multiply;
use cellc_runtime::backend::cpu::stage::{Interpreted, StageExec};
use cellc_runtime::backend::cpu::walker::{Avx2, Avx512, Lanes, WalkedStage};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::{CompiledCell, Model, ModelConfig};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The shipped cell `name` at `H = I = h`, one layer.
fn shipped(name: &str, h: usize) -> Model {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../cells/{name}.cell"));
    let cell = Arc::new(CompiledCell::from_file(&path, None).expect("the cell compiles"));
    let sizes = [("H".to_string(), h), ("I".to_string(), h)].into();
    let config = ModelConfig { layers: 1, bidirectional: false };
    Model::new(cell, config, &sizes, Some(h), None, 1, Box::new(Reference)).expect("model")
}

/// Buffers for `rows` rows of a stage's inputs and outputs, and the pointer table.
struct Table {
    _buffers: Vec<Vec<f32>>,
    ptrs: Vec<*mut f32>,
}

fn table(exec: &dyn StageExec, plan: &Shapes, rows: usize) -> Table {
    let mut buffers = Vec::new();
    let mut ptrs = Vec::new();
    for _ in 0..rows {
        for &v in exec.inputs().iter().chain(exec.outputs()) {
            let n = plan.elements(v);
            let mut b: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
            ptrs.push(b.as_mut_ptr());
            buffers.push(b);
        }
    }
    Table { _buffers: buffers, ptrs }
}

/// A stage's plan walked on each instruction set this processor has, by
/// name: its fused loops compiled, then walked.
fn walked(
    shapes: &Shapes,
    plan: &KernelPlan,
    inputs: &[ValueId],
    outputs: &[ValueId],
) -> Vec<(&'static str, Box<dyn StageExec>)> {
    fn on<S: Lanes>(
        name: &'static str,
        (shapes, plan, inputs, outputs): (&Shapes, &KernelPlan, &[ValueId], &[ValueId]),
        walk_loops: bool,
    ) -> Option<(&'static str, Box<dyn StageExec>)> {
        S::detect()?;
        let stage = WalkedStage::<S>::new(shapes, plan, inputs, outputs).expect("a walked stage");
        let stage = if walk_loops { stage.walking_every_loop() } else { stage };
        Some((name, Box::new(stage)))
    }
    let stage = (shapes, plan, inputs, outputs);
    [
        on::<Avx512>("avx512", stage, false),
        on::<Avx512>("avx512 walked", stage, true),
        on::<Avx2>("avx2", stage, false),
        on::<Avx2>("avx2 walked", stage, true),
    ]
    .into_iter()
    .flatten()
    .collect()
}

fn pointwise(c: &mut Criterion) {
    for (name, sizes) in [("lstm", &[128, 512][..]), ("layernorm_lstm", &[256][..])] {
        pointwise_stages(c, name, sizes);
    }
}

/// The per-step pointwise stages of the shipped cell `name`, forward and backward, at each `H`.
fn pointwise_stages(c: &mut Criterion, name: &str, sizes: &[usize]) {
    let mut g = c.benchmark_group(format!("{name} pointwise stage"));
    g.measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    for &h in sizes {
        let model = shipped(name, h);
        let layer = &model.layers()[0];
        let compiled = model.compiled();
        let sides = [
            (
                "forward",
                Arc::new((*compiled.forward).clone()),
                &layer.schedule.forward,
                &layer.forward_shapes,
            ),
            (
                "backward",
                Arc::new(compiled.backward.graph.clone()),
                &layer.schedule.backward,
                &layer.backward_shapes,
            ),
        ];
        for (side, graph, stages, plan) in sides {
            let st = stages
                .iter()
                .find(|s| matches!(s.kind, StageKind::Pointwise { .. }))
                .expect("a pointwise stage");
            let plan_arc = Arc::new(plan.clone());
            let kernel_plan = KernelPlan::new(&graph, plan, st, &[]).expect("a kernel plan");
            let jit = compile_stage(plan, &kernel_plan, &st.inputs, &st.outputs).expect("compiles");
            let interp = Interpreted::new(graph.clone(), plan_arc, &st.values, &st.inputs, &st.outputs);
            let mut kinds: Vec<(&str, Box<dyn StageExec>)> = vec![("jit", Box::new(jit))];
            kinds.extend(walked(plan, &kernel_plan, &st.inputs, &st.outputs));
            kinds.push(("interpreted", Box::new(interp)));
            for rows in [1, 16, 64] {
                g.throughput(Throughput::Elements((rows * h) as u64));
                for (kind, exec) in &kinds {
                    let exec = exec.as_ref();
                    let t = table(exec, plan, rows);
                    g.bench_function(BenchmarkId::new(format!("{side} {kind} H={h}"), rows), |b| {
                        // SAFETY: the table holds `rows` rows of valid buffers at the plan's sizes.
                        b.iter(|| unsafe { exec.run(black_box(rows), &t.ptrs) })
                    });
                }
            }
        }
    }
    g.finish();
}

/// `y = op(x)` over `n` floats as one stage, through the same pipeline as a
/// cell's kernels (the math module itself only emits IR): JIT-compiled,
/// and walked on each instruction set the processor has.
fn unary_kernel(op: &str, n: usize) -> Vec<(&'static str, Box<dyn StageExec>)> {
    let src = format!("cell t {{ input x[N] state h[N] h' = {op}(x) + 0 * h\n output {op}(x) }}");
    let module = cellc::compile("t.cell", &src).into_result().expect("the one-op cell compiles");
    let cell = module.cells.into_iter().next().expect("one cell");
    let cell = cellc::program::Steps::compile(&cell).expect("verifies").forward;
    let plan = Shapes::new(&cell, &[("N".to_string(), n)].into(), "t").expect("plan");
    let x = cell.values().find(|&v| matches!(cell.node(v).op, Op::Input(0))).expect("the input x");
    let (inputs, outputs) = ([x], [cell.output]);
    let kernel_plan =
        KernelPlan::of_values(&cell, &plan, &outputs, &inputs, &outputs).expect("a kernel plan");
    let jit = compile_stage(&plan, &kernel_plan, &inputs, &outputs).expect("compiles");
    let mut kinds: Vec<(&str, Box<dyn StageExec>)> = vec![("jit", Box::new(jit))];
    kinds.extend(walked(&plan, &kernel_plan, &inputs, &outputs));
    kinds
}

fn math(c: &mut Criterion) {
    const N: usize = 4096;
    let mut g = c.benchmark_group("math over 4096 floats");
    g.measurement_time(Duration::from_secs(1)).warm_up_time(Duration::from_millis(300));
    g.throughput(Throughput::Elements(N as u64));
    let mut x: Vec<f32> = (0..N).map(|i| (i as f32 / N as f32 - 0.5) * 16.0).collect();
    let mut y = vec![0.0f32; N];
    let sigmoid = |v: f32| 1.0 / (1.0 + (-v).exp());
    let libm = [("exp", f32::exp as fn(f32) -> f32), ("tanh", f32::tanh), ("sigmoid", sigmoid)];
    for (op, std_fn) in libm {
        let ptrs = [x.as_mut_ptr(), y.as_mut_ptr()];
        for (kind, exec) in unary_kernel(op, N) {
            // SAFETY: one row; both pointers are valid for N floats and outlive the closure.
            g.bench_function(BenchmarkId::new(op, kind), |b| {
                b.iter(|| unsafe { exec.run(1, black_box(&ptrs)) })
            });
        }
        g.bench_function(BenchmarkId::new(op, "std"), |b| {
            b.iter(|| y.iter_mut().zip(black_box(&x)).for_each(|(o, &v)| *o = std_fn(v)))
        });
    }
    g.finish();
}

fn products(c: &mut Criterion) {
    let mut g = c.benchmark_group("matrix products");
    g.measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    for h in [256, 512] {
        let (k, m) = (h, 4 * h);
        let w: Vec<f32> = (0..k * m).map(|i| ((i % 17) as f32) * 0.01).collect();
        let packed = PackedB::of(&w, k, m);
        // A step's rows against Wᵀ ([k, m] row-major, as `gemm` reads it, packing it on
        // every call) and against the same weight packed once into panels; and the
        // hoisted projection of every row of a T=100 batch of 64.
        for rows in [1usize, 8, 16, 32, 64, 6400] {
            let x: Vec<f32> = (0..rows * k).map(|i| ((i % 7) as f32) * 0.1).collect();
            let mut y = vec![0.0f32; rows * m];
            g.throughput(Throughput::Elements((2 * rows * k * m) as u64));
            g.bench_function(BenchmarkId::new(format!("gemm [B, {k}] x [{k}, {m}] (flops)"), rows), |b| {
                b.iter(|| {
                    // SAFETY: x, w and y have exactly the viewed shapes.
                    unsafe {
                        matmul(
                            View::rows(y.as_mut_ptr(), rows, m, m),
                            View::rows(x.as_ptr(), rows, k, k),
                            View::rows(w.as_ptr(), k, m, m),
                            false,
                        )
                    }
                })
            });
            g.bench_function(BenchmarkId::new(format!("panels [B, {k}] x [{k}, {m}] (flops)"), rows), |b| {
                // SAFETY: x is [rows, k], y is [rows, m], packed is [k, m].
                b.iter(|| unsafe {
                    multiply(
                        Rows { y: y.as_mut_ptr(), ldy: m, a: black_box(x.as_ptr()), lda: k, m: rows },
                        &packed,
                        0..packed.panels(),
                        false,
                    )
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, pointwise, math, products);
criterion_main!(benches);
