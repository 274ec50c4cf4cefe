//! The CPU back end: executes a pass's plan ([`crate::plan::PassPlan`]),
//! the schedule's products through weights packed once per model
//! (`panels`), its pointwise stages as compiled kernels, both cores
//! through the process's team of threads.
//!
//! Work runs on the process's one team of threads (`threads`: cellc's pool,
//! or the OpenMP team of the framework that called), a call at a time. The
//! time loop is one parallel region on those threads (`team`,
//! `step_loop`): threads own whole sequences, or split each product by
//! panels. Per-step values live in rank order, so a thread's active
//! sequences are a contiguous prefix and each per-step product is one call.

pub(crate) mod aligned;
mod all_rows;
pub mod amx;
pub mod aot;
mod backward;
pub mod bf16;
mod buffers;
mod cache;
#[cfg(feature = "codegen")]
pub mod codegen;
mod forward;
pub mod gemm;
pub mod host;
mod in_place;
pub mod masks;
pub mod native;
pub(crate) mod openmp;
pub mod panels;
pub mod peak;
pub(crate) mod prepared;
pub mod product;
pub mod profile;
pub mod roofline;
mod row_sums;
mod sink;
pub mod stage;
mod stages;
mod step_loop;
mod stream;
mod tape;
mod team;
pub mod threads;
mod tiles;
mod unit_split;
#[cfg(target_arch = "x86_64")]
pub mod walker;
mod whole_sequence;

use super::{Device, StepRunner, StreamJob};
use crate::cell::{CompiledCell, Layer};
use crate::error::{Result, RuntimeError};
use crate::pass::{LayerBackward, LayerForward, Pass};
use crate::plan::PassPlan;
use cellc::ir::{Graph, Op};
use cellc::precision::Precision;
use cellc::program::{ProgramKernel, Side};
use cellc::schedule::Placement;
use cellc::shapes::Shapes;
use stage::{Interpreted, StageExec};
use stages::ReadyStage;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

/// How pointwise stages are executed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Kernels {
    /// The fastest this processor runs, decided once when the back end is
    /// made: [`Kernels::Avx512`] where it has AVX-512F, else
    /// [`Kernels::Avx2`] where it has AVX2 and FMA, else [`Kernels::Jit`].
    /// All three compute the same bits.
    #[default]
    Fastest,
    /// Compiled with Cranelift in the process (f32x4 SIMD, own
    /// exp/log/tanh polynomials); needs the `jit` feature.
    Jit,
    /// Each stage's kernel plan walked by AVX-512 code in the runtime
    /// ([`walker`]): no code generator, 16 lanes, bitwise the results of
    /// Cranelift's code. x86-64 processors with AVX-512F only.
    Avx512,
    /// The same walker on AVX2 with FMA, 8 lanes, the same bits: for
    /// x86-64 processors with AVX2 but not AVX-512 (AMD Zen 1 to 3, most
    /// Intel desktop and laptop parts).
    Avx2,
    /// The interpreter's op semantics, value by value (a check on the driver and the JIT).
    Interpreted,
    /// The same machine code, compiled ahead of time by `cellc-build` and
    /// linked into the program: no code generator at run time.
    Linked(&'static aot::LinkedKernels),
}

/// The CPU back end: its calls run on the process's team of threads
/// ([`threads`]), shared by every back end and model of the process.
pub struct Cpu {
    /// The most threads a call uses.
    threads: usize,
    /// A step's multiply-adds per thread below which a pass uses fewer
    /// threads ([`STEP_FMAS_PER_THREAD`]; 0: every step is split).
    step_fmas_per_thread: usize,
    kernels: Kernels,
    /// Whether a step runs fused where the compiler fused it and the
    /// batch is worth it ([`tiles`]).
    fuse: bool,
    /// The compiled layers this back end has run, kept while it lives.
    code: Mutex<HashMap<String, Arc<LayerCode>>>,
}

/// Compiled layers for the whole process, keyed by the kernels' kind, the
/// cell's forward and backward IR, the layer's sizes and the host's
/// features: a layer compiles once for every back end that runs it at the
/// same time, and is freed with the last of them.
fn program_cache() -> &'static Mutex<HashMap<String, Weak<LayerCode>>> {
    static CACHE: std::sync::OnceLock<Mutex<HashMap<String, Weak<LayerCode>>>> = std::sync::OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

impl std::fmt::Debug for Cpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cpu").field("threads", &self.threads).field("kernels", &self.kernels).finish()
    }
}

/// One layer's stages, ready to run.
struct LayerCode {
    fwd_graph: Arc<Graph>,
    fwd_shapes: Arc<Shapes>,
    bwd_graph: Arc<Graph>,
    bwd_shapes: Arc<Shapes>,
    forward: Vec<ReadyStage>,
    backward: Vec<ReadyStage>,
    /// Multiply-adds of a step's products per row, forward and backward
    /// ([`step_fmas_per_row`]).
    fwd_step_fmas: usize,
    bwd_step_fmas: usize,
    /// The forward's last per-step stage fused with its products, where
    /// the compiler found it may be and these kernels can be planned per tile.
    fused: Option<tiles::FusedStep>,
    /// The backward's step split by units, where the compiler found it may
    /// be and these kernels can be planned per width.
    bwd_units: Option<unit_split::UnitKernels>,
}

impl Cpu {
    /// A CPU back end whose calls use up to `threads` threads (0: every
    /// usable core; never more than [`threads::usable_cores`]).
    pub fn new(threads: usize, kernels: Kernels) -> Result<Cpu> {
        let cores = threads::usable_cores();
        let threads = if threads == 0 { cores } else { threads.min(cores) };
        let kernels = match kernels {
            Kernels::Fastest if avx512_supported() => Kernels::Avx512,
            Kernels::Fastest if avx2_supported() => Kernels::Avx2,
            Kernels::Fastest => Kernels::Jit,
            Kernels::Avx512 if !avx512_supported() => return Err(unsupported("Kernels::Avx512", "AVX-512F")),
            Kernels::Avx2 if !avx2_supported() => return Err(unsupported("Kernels::Avx2", "AVX2 and FMA")),
            other => other,
        };
        let step_fmas_per_thread = STEP_FMAS_PER_THREAD;
        Ok(Cpu { threads, step_fmas_per_thread, kernels, fuse: true, code: Mutex::new(HashMap::new()) })
    }

    /// This back end with every step split between its threads, however
    /// small (by default a pass whose steps are too small to be worth the
    /// threads' meeting runs on fewer): for tests of the threaded paths at
    /// small sizes, and for timing the split itself.
    pub fn split_every_step(self) -> Cpu {
        Cpu { step_fmas_per_thread: 0, ..self }
    }

    /// This back end with no step fused: a step's products, then its
    /// pointwise stages, on whole rows, and the input projections before
    /// the loop (by default, where the batch is small or large enough,
    /// each thread runs the compiler's fused stage on its own tiles, and
    /// below two sequences a thread the backward step on its own units:
    /// see [`cellc::schedule::tiles`]). The results are the same bits; for
    /// tests of the fused and split steps and for timing them.
    pub fn unfused(self) -> Cpu {
        Cpu { fuse: false, ..self }
    }

    /// The most threads one of its calls uses ([`Cpu::new`]'s `threads`,
    /// 0 meaning every usable core, capped at [`threads::usable_cores`]).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The kernels this back end runs ([`Kernels::Fastest`] resolved).
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// Runs one pass's `op(threads)` on the process's team ([`threads::run_call`]),
    /// on as many threads as its steps' work is worth: one per
    /// `step_fmas_per_thread` multiply-adds of a step (`step_fmas_per_row` at
    /// each of `batch` rows), at most [`Cpu::threads`], or all of them when
    /// every step is split.
    fn alone<R: Send>(
        &self,
        step_fmas_per_row: usize,
        batch: usize,
        op: impl FnOnce(usize) -> Result<R> + Send,
    ) -> Result<R> {
        let threads = match self.step_fmas_per_thread {
            0 => self.threads,
            per_thread => (step_fmas_per_row * batch / per_thread).clamp(1, self.threads.max(1)),
        };
        threads::run_call(threads, op)
    }

    /// Runs `op` on cellc's own pool's threads. A program whose other work
    /// is parallel too (a framework's tensor ops on rayon, as candle's)
    /// runs it in here, so that cellc's threads and its own do not take
    /// turns on the same cores: a pass called from inside starts without
    /// crossing pools, and no idle pool spins beside a busy one.
    pub fn install<R: Send>(&self, op: impl FnOnce() -> R + Send) -> R {
        threads::install(op)
    }

    fn code(&self, cell: &CompiledCell, layer: &Layer) -> Result<Arc<LayerCode>> {
        let kernels = match self.kernels {
            // Tables are told apart by address (they are statics).
            Kernels::Linked(linked) => format!("linked@{:p}", linked),
            other => format!("{other:?}"),
        };
        let key = format!("{kernels}|{:?}|{}|{}", layer.sizes, aot::host_target().join(" "), cell.identity());
        fn poisoned<T>(_: T) -> RuntimeError {
            RuntimeError::Internal("kernel cache poisoned".into())
        }
        let mut held = self.code.lock().map_err(poisoned)?;
        if let Some(c) = held.get(&key) {
            return Ok(c.clone());
        }
        let mut cache = program_cache().lock().map_err(poisoned)?;
        cache.retain(|_, c| c.strong_count() > 0);
        if let Some(c) = cache.get(&key).and_then(Weak::upgrade) {
            held.insert(key, c.clone());
            return Ok(c);
        }
        let fwd_graph: Arc<Graph> = Arc::new((*cell.forward).clone());
        let fwd_shapes = Arc::new(layer.forward_shapes.clone());
        let bwd_graph = Arc::new(cell.backward.graph.clone());
        let bwd_shapes = Arc::new(layer.backward_shapes.clone());
        let kernels = self.kernels;
        let make = |side: aot::Side, g: &Arc<Graph>, p: &Arc<Shapes>| {
            let (g, p) = (g.clone(), p.clone());
            move |index: usize, st: &cellc::schedule::Stage| -> Result<Arc<dyn StageExec>> {
                match kernels {
                    Kernels::Linked(linked) => Ok(Arc::new(linked.stage(cell, layer, side, index, st)?)),
                    _ => planned_stage(kernels, (&g, &p), layer.kernel(side, index), st),
                }
            }
        };
        let forward = stages::ready_stages(
            &fwd_graph,
            &layer.schedule.forward,
            &mut make(aot::Side::Forward, &fwd_graph, &fwd_shapes),
        )?;
        let backward = stages::ready_stages(
            &bwd_graph,
            &layer.schedule.backward,
            &mut make(aot::Side::Backward, &bwd_graph, &bwd_shapes),
        )?;
        // Training or not, the forward's loop runs the same stages.
        let fwd_step_fmas = step_fmas_per_row(&forward, layer.pass(Side::Forward, false), &fwd_shapes);
        let bwd_step_fmas = step_fmas_per_row(&backward, layer.pass(Side::Backward, true), &bwd_shapes);
        let fused = fused_step(kernels, layer, &fwd_graph);
        let bwd_units = backward_units(kernels, layer, &bwd_graph);
        let code = Arc::new(LayerCode {
            fwd_graph,
            fwd_shapes,
            bwd_graph,
            bwd_shapes,
            forward,
            backward,
            fwd_step_fmas,
            bwd_step_fmas,
            fused,
            bwd_units,
        });
        cache.insert(key.clone(), Arc::downgrade(&code));
        held.insert(key, code.clone());
        Ok(code)
    }
}

/// Whether this processor runs [`Kernels::Avx512`].
pub fn avx512_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    return <walker::Avx512 as walker::Lanes>::detect().is_some();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this processor runs [`Kernels::Avx2`].
pub fn avx2_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    return <walker::Avx2 as walker::Lanes>::detect().is_some();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The error for kernels `kind` on a processor without instruction set `set`.
fn unsupported(kind: &str, set: &str) -> RuntimeError {
    RuntimeError::Backend {
        backend: "cpu".into(),
        message: format!(
            "{kind} needs a processor with {set}; this one has none (Kernels::Fastest picks what it has)"
        ),
    }
}

/// A kernel stage's plan, which the program always has (else a compiler bug).
fn plan_of(kernel: Option<&ProgramKernel>) -> Result<&ProgramKernel> {
    kernel.ok_or_else(|| RuntimeError::Internal("a kernel stage without a kernel plan".into()))
}

/// A stage's kernel plan, to be walked by the vector code of `kernels`
/// (AVX-512 or AVX2).
fn walked_stage(
    kernels: Kernels,
    p: &Shapes,
    kernel: Option<&ProgramKernel>,
    st: &cellc::schedule::Stage,
) -> Result<Arc<dyn StageExec>> {
    let kernel = plan_of(kernel)?;
    #[cfg(target_arch = "x86_64")]
    {
        fn walked<S: walker::Lanes>(
            p: &Shapes,
            kernel: &ProgramKernel,
            st: &cellc::schedule::Stage,
        ) -> Result<Arc<dyn StageExec>> {
            walker::WalkedStage::<S>::new(p, &kernel.plan, &st.inputs, &st.outputs)
                .map(|s| Arc::new(s) as Arc<dyn StageExec>)
                .map_err(|e| RuntimeError::Internal(e.to_string()))
        }
        match kernels {
            Kernels::Avx512 => walked::<walker::Avx512>(p, kernel, st),
            Kernels::Avx2 => walked::<walker::Avx2>(p, kernel, st),
            other => Err(RuntimeError::Internal(format!("{other:?} kernels do not walk plans"))),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // `Cpu::new` refuses walked kernels off x86-64: never reached.
        let _ = (kernels, p, kernel, st);
        Err(RuntimeError::Internal("walked kernels on a processor without AVX-512 or AVX2".into()))
    }
}

/// A stage's kernel of the `kernels` kind, from its plan at `shapes` (linked kernels are
/// looked up instead, by the stage's name).
fn planned_stage(
    kernels: Kernels,
    (g, p): (&Arc<Graph>, &Arc<Shapes>),
    kernel: Option<&ProgramKernel>,
    st: &cellc::schedule::Stage,
) -> Result<Arc<dyn StageExec>> {
    match kernels {
        Kernels::Interpreted => {
            Ok(Arc::new(Interpreted::new(g.clone(), p.clone(), &st.values, &st.inputs, &st.outputs)))
        }
        Kernels::Jit | Kernels::Fastest => jit_stage(p, kernel, st),
        Kernels::Avx512 | Kernels::Avx2 => walked_stage(kernels, p, kernel, st),
        Kernels::Linked(_) => Err(RuntimeError::Internal("a linked kernel has no plan to build".into())),
    }
}

/// The layer's fused step, if the compiler fused its forward's last per-step
/// stage with the products before it and these kernels are built from
/// plans (a tile's kernel is planned at the tile's width, on first use).
fn fused_step(kernels: Kernels, layer: &Layer, graph: &Arc<Graph>) -> Option<tiles::FusedStep> {
    let last = layer.pass(Side::Forward, false).stages_at(Placement::EachStep).last().copied();
    let fusion = layer.schedule.fusion.iter().find(|f| Some(f.pointwise) == last)?.clone();
    if matches!(kernels, Kernels::Linked(_)) {
        return None;
    }
    let units = *layer.sizes.get(&fusion.unit)?;
    let (program, graph, for_tile) = (Arc::new(layer.program.clone()), graph.clone(), fusion.clone());
    let build = move |width: usize| -> Result<Arc<dyn StageExec>> {
        let (shapes, kernel) = program
            .tile_kernel(&graph, &for_tile, width)
            .map_err(|e| RuntimeError::Internal(format!("a tile of {width} units: {e}")))?;
        let st = kernel.stage(&program);
        planned_stage(kernels, (&graph, &Arc::new(shapes)), Some(&kernel), st)
    };
    Some(tiles::FusedStep::new(fusion, units, Box::new(build)))
}

/// The layer's backward step split by units, if the compiler found it
/// may be and these kernels are built from plans (a kernel is planned at a
/// thread's width, on first use).
fn backward_units(kernels: Kernels, layer: &Layer, graph: &Arc<Graph>) -> Option<unit_split::UnitKernels> {
    let split = layer.schedule.backward_units.clone()?;
    if matches!(kernels, Kernels::Linked(_)) {
        return None;
    }
    let units = *layer.sizes.get(&split.unit)?;
    let (program, graph, for_stage) = (Arc::new(layer.program.clone()), graph.clone(), split.clone());
    let build = move |stage: usize, width: usize| -> Result<Arc<dyn StageExec>> {
        let (shapes, kernel) = program
            .units_kernel(&graph, &for_stage, stage, width)
            .map_err(|e| RuntimeError::Internal(format!("{width} units: {e}")))?;
        let st = kernel.stage(&program);
        planned_stage(kernels, (&graph, &Arc::new(shapes)), Some(&kernel), st)
    };
    Some(unit_split::UnitKernels::new(split, units, Box::new(build)))
}

/// A stage's kernel plan compiled by the JIT.
#[cfg(feature = "jit")]
fn jit_stage(
    p: &Shapes,
    kernel: Option<&ProgramKernel>,
    st: &cellc::schedule::Stage,
) -> Result<Arc<dyn StageExec>> {
    let kernel = plan_of(kernel)?;
    codegen::jit::compile_stage(p, &kernel.plan, &st.inputs, &st.outputs)
        .map(|s| Arc::new(s) as Arc<dyn StageExec>)
        .map_err(|e| RuntimeError::Backend { backend: "cpu".into(), message: e.to_string() })
}

#[cfg(not(feature = "jit"))]
fn jit_stage(
    _: &Shapes,
    _: Option<&ProgramKernel>,
    _: &cellc::schedule::Stage,
) -> Result<Arc<dyn StageExec>> {
    Err(RuntimeError::Backend {
        backend: "cpu".into(),
        message: "this build of cellc-runtime has no JIT (feature `jit`): use kernels linked by \
                  cellc-build (Kernels::Linked) or Kernels::Interpreted"
            .into(),
    })
}

// SAFETY: the caller's memory is borrowed for the one call that made the
// tape, whose threads write disjoint rows of it.

impl Device for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }

    host::host_memory!();

    /// f32 and bf16 products (bf16 operands, f32 sums, with the kernel this
    /// processor runs fastest, see [`bf16`]). fp16 and TF32 are errors: no
    /// x86 unit multiplies fp16 or TF32 pairs into f32 sums, so such
    /// products would only be slower f32 ones (they run on the CUDA device).
    fn precision(&self, asked: Precision) -> Result<Precision> {
        let what = match asked {
            Precision::F32 | Precision::Bf16 => return Ok(asked),
            Precision::F16 => "fp16",
            Precision::Tf32 => "TF32",
        };
        Err(RuntimeError::Backend {
            backend: "cpu".into(),
            message: format!(
                "computes f32 and bf16 products; {what} products ({asked}) run on the cuda back end"
            ),
        })
    }

    fn forward(&self, pass: &Pass, job: LayerForward) -> Result<()> {
        let code = self.code(pass.cell, job.layer)?;
        // SAFETY: per the trait's contract, every span is host memory of the pass.
        unsafe {
            host::forward(pass, job, |job, output, tape| {
                self.alone(code.fwd_step_fmas, job.order.batch(), |threads| {
                    forward::forward((threads, pass.precision, self.fuse), &code, job, output, tape)
                })
            })
        }
    }

    fn backward(&self, pass: &Pass, job: LayerBackward) -> Result<()> {
        let code = self.code(pass.cell, job.layer)?;
        // SAFETY: per the trait's contract, every span is host memory of the pass.
        unsafe {
            host::backward(pass, job, |job, tape, d_input| {
                // SAFETY: the backward only reads its tape, which borrows `tape` for this call.
                let tape = tape::CpuTape::in_caller(
                    job.layer,
                    job.layout_rows(),
                    tape.as_ptr() as *mut f32,
                    tape.len(),
                )?;
                self.alone(code.bwd_step_fmas, job.order.batch(), |threads| {
                    backward::backward((threads, pass.precision, self.fuse), &code, job, &tape, d_input)
                })
            })
        }
    }

    fn stream<'a>(&'a self, job: StreamJob<'a>) -> Result<Option<Box<dyn StepRunner + 'a>>> {
        Ok(Some(Box::new(self.make_stream(job)?)))
    }
}

/// Multiply-adds of a step's products that each thread should get before a
/// step is split between threads ([`Cpu::alone`]). Split by units, the threads meet at a
/// barrier after each stage, and handing a call to the team wakes them: a
/// step smaller than this runs faster on one thread. Measured (`cellc
/// bench`, LSTM, T=100, AMD EPYC Zen 3, 2 cores): B=1 H=64 (16k a step) 3.7
/// µs a step on one thread, 6.1 on two; B=1 H=128 (65k) 9.3 and 7.6; B=4
/// H=64 (65k) 11.1 and 6.6.
const STEP_FMAS_PER_THREAD: usize = 24_000;

/// Multiply-adds of one row's step: the products of every stage the
/// pass's time loop runs.
fn step_fmas_per_row(stages: &[ReadyStage], pass: &PassPlan, shapes: &Shapes) -> usize {
    pass.stages_at(Placement::EachStep)
        .iter()
        .flat_map(|&k| match &stages[k] {
            ReadyStage::Gemm { products } => products.as_slice(),
            _ => &[],
        })
        .map(|&(_, ref op, m, v)| match op {
            Op::MatVec | Op::MatVecT => shapes.elements(m),
            _ => shapes.elements(m) * shapes.elements(v),
        })
        .sum()
}
