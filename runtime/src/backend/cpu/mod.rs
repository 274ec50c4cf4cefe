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
pub mod aot;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod bf16;
#[cfg(feature = "codegen")]
pub mod codegen;
mod driver;
pub mod gemm;
pub mod host;
mod in_place;
pub mod masks;
pub mod native;
pub(crate) mod openmp;
pub mod panels;
pub(crate) mod prepared;
pub mod product;
pub mod roofline;
pub mod stage;
mod step_loop;
mod stream;
mod team;
pub mod threads;

use super::{Device, StepRunner, StreamJob};
use crate::cell::{CompiledCell, Layer};
use crate::error::{Result, RuntimeError};
use crate::pass::{LayerBackward, LayerForward, Pass};
use crate::plan::{Home, ParamGradient, PassPlan, TapeSource, TimeLoop};
use crate::pool;
use cellc::ir::{Graph, Op, ValueId};
use cellc::precision::Precision;
use cellc::program::{Kept, ProgramKernel, Side, TapePart};
use cellc::schedule::Placement;
use cellc::shapes::Shapes;
use driver::{
    constants, gemm_all_rows, locate, prepared_params, run_pointwise, Buffers, Frame, Loc, ReadyStage,
    SendTable,
};
pub(crate) use host::SharedRows;
use host::{HostBackward, HostForward, HostGradients, RowsMut};
use prepared::PreparedParams;
use stage::{Interpreted, StageExec};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use step_loop::StepLoop;
use team::Team;

/// How pointwise stages are executed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Kernels {
    /// The fastest this processor runs, decided once when the back end is
    /// made: [`Kernels::Avx512`] where it has AVX-512F, else [`Kernels::Jit`].
    /// Both compute the same bits.
    #[default]
    Fastest,
    /// Compiled with Cranelift in the process (f32x4 SIMD, own
    /// exp/log/tanh polynomials); needs the `jit` feature.
    Jit,
    /// Each stage's kernel plan walked by AVX-512 code in the runtime
    /// ([`avx512`]): no code generator, 16 lanes, bitwise the results of
    /// Cranelift's code. x86-64 processors with AVX-512F only.
    Avx512,
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
    /// The precision of the products of matrix parameters.
    precision: Precision,
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
        f.debug_struct("Cpu")
            .field("threads", &self.threads)
            .field("kernels", &self.kernels)
            .field("precision", &self.precision)
            .finish()
    }
}

/// One layer's stages, ready to run.
struct LayerCode {
    fwd_graph: Arc<Graph>,
    fwd_plan: Arc<Shapes>,
    bwd_graph: Arc<Graph>,
    bwd_plan: Arc<Shapes>,
    forward: Vec<ReadyStage>,
    backward: Vec<ReadyStage>,
    /// Multiply-adds of a step's products per row, forward and backward
    /// ([`step_fmas_per_row`]).
    fwd_step_fmas: usize,
    bwd_step_fmas: usize,
}

impl Cpu {
    /// A CPU back end whose calls use up to `threads` threads (0: every
    /// usable core; never more than [`threads::usable_cores`]).
    pub fn new(threads: usize, kernels: Kernels) -> Result<Cpu> {
        let cores = threads::usable_cores();
        let threads = if threads == 0 { cores } else { threads.min(cores) };
        let kernels = match kernels {
            Kernels::Fastest if avx512_supported() => Kernels::Avx512,
            Kernels::Fastest => Kernels::Jit,
            Kernels::Avx512 if !avx512_supported() => {
                return Err(RuntimeError::Backend {
                    backend: "cpu".into(),
                    message: "Kernels::Avx512 needs a processor with AVX-512F; this one has none \
                              (Kernels::Fastest picks what it has)"
                        .into(),
                })
            }
            other => other,
        };
        let step_fmas_per_thread = STEP_FMAS_PER_THREAD;
        Ok(Cpu {
            threads,
            step_fmas_per_thread,
            kernels,
            precision: Precision::F32,
            code: Mutex::new(HashMap::new()),
        })
    }

    /// This back end with every step split between its threads, however
    /// small (by default a pass whose steps are too small to be worth the
    /// threads' meeting runs on fewer): for tests of the threaded paths at
    /// small sizes, and for timing the split itself.
    pub fn split_every_step(self) -> Cpu {
        Cpu { step_fmas_per_thread: 0, ..self }
    }

    /// This back end computing the products of the cell's matrix parameters
    /// in `precision` ([`Precision::Bf16`]: bf16 operands, f32 sums, with the
    /// kernel this processor runs fastest, see [`bf16`]).
    /// [`Precision::F16`] and [`Precision::Tf32`] are errors: no x86 unit
    /// multiplies fp16 or TF32 pairs into f32 sums, so such products would
    /// only be slower f32 ones (they run on the CUDA back end).
    pub fn with_precision(self, precision: Precision) -> Result<Cpu> {
        if matches!(precision, Precision::F16 | Precision::Tf32) {
            let what = if precision == Precision::F16 { "fp16" } else { "TF32" };
            return Err(RuntimeError::Backend {
                backend: "cpu".into(),
                message: format!(
                    "computes f32 and bf16 products; {what} products ({precision}) run on the cuda back end"
                ),
            });
        }
        Ok(Cpu { precision, ..self })
    }

    /// The precision of its products ([`Cpu::with_precision`]).
    pub fn precision(&self) -> Precision {
        self.precision
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
        let fwd_plan = Arc::new(layer.forward_shapes.clone());
        let bwd_graph = Arc::new(cell.backward.graph.clone());
        let bwd_plan = Arc::new(layer.backward_shapes.clone());
        let kernels = self.kernels;
        let make = |side: aot::Side, g: &Arc<Graph>, p: &Arc<Shapes>| {
            let (g, p) = (g.clone(), p.clone());
            move |index: usize, st: &cellc::schedule::Stage| -> Result<Arc<dyn StageExec>> {
                Ok(match kernels {
                    Kernels::Interpreted => {
                        Arc::new(Interpreted::new(g.clone(), p.clone(), &st.values, &st.inputs, &st.outputs))
                    }
                    Kernels::Jit | Kernels::Fastest => jit_stage(&p, layer.kernel(side, index), st)?,
                    Kernels::Avx512 => avx512_stage(&p, layer.kernel(side, index), st)?,
                    Kernels::Linked(linked) => Arc::new(linked.stage(cell, layer, side, index, st)?),
                })
            }
        };
        let forward = driver::ready_stages(
            &fwd_graph,
            &layer.schedule.forward,
            &mut make(aot::Side::Forward, &fwd_graph, &fwd_plan),
        )?;
        let backward = driver::ready_stages(
            &bwd_graph,
            &layer.schedule.backward,
            &mut make(aot::Side::Backward, &bwd_graph, &bwd_plan),
        )?;
        // Training or not, the forward's loop runs the same stages.
        let fwd_step_fmas = step_fmas_per_row(&forward, layer.pass(Side::Forward, false), &fwd_plan);
        let bwd_step_fmas = step_fmas_per_row(&backward, layer.pass(Side::Backward, true), &bwd_plan);
        let code = Arc::new(LayerCode {
            fwd_graph,
            fwd_plan,
            bwd_graph,
            bwd_plan,
            forward,
            backward,
            fwd_step_fmas,
            bwd_step_fmas,
        });
        cache.insert(key.clone(), Arc::downgrade(&code));
        held.insert(key, code.clone());
        Ok(code)
    }
}

/// Whether this processor runs [`Kernels::Avx512`].
pub fn avx512_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    return avx512::supported();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// A kernel stage's plan, which the program always has (else a compiler bug).
fn plan_of(kernel: Option<&ProgramKernel>) -> Result<&ProgramKernel> {
    kernel.ok_or_else(|| RuntimeError::Internal("a kernel stage without a kernel plan".into()))
}

/// A stage's kernel plan, to be walked by AVX-512 code.
fn avx512_stage(
    p: &Shapes,
    kernel: Option<&ProgramKernel>,
    st: &cellc::schedule::Stage,
) -> Result<Arc<dyn StageExec>> {
    let kernel = plan_of(kernel)?;
    #[cfg(target_arch = "x86_64")]
    return avx512::Avx512Stage::new(p, &kernel.plan, &st.inputs, &st.outputs)
        .map(|s| Arc::new(s) as Arc<dyn StageExec>)
        .map_err(|e| RuntimeError::Internal(e.to_string()));
    #[cfg(not(target_arch = "x86_64"))]
    {
        // `Cpu::new` refuses Kernels::Avx512 off x86-64: never reached.
        let _ = (p, kernel, st);
        Err(RuntimeError::Internal("AVX-512 kernels on a processor without AVX-512".into()))
    }
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

/// A tape in the caller's memory, part by part as the layer's program
/// lays it out ([`cellc::program::TapeLayout`]), in the reserve's order.
struct CpuTape {
    parts: Vec<(TapePart, TapeBuf)>,
}

/// One part of a tape: `len` floats of the caller's, borrowed for one call.
struct TapeBuf {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the caller's memory is borrowed for the one call that made the
// tape, whose threads write disjoint rows of it.
unsafe impl Send for TapeBuf {}
unsafe impl Sync for TapeBuf {}

impl std::ops::Deref for TapeBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: the caller's memory is valid for `len` floats while the tape lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for TapeBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as for `deref`; only a forward's tape (over a mutable borrow) is written.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl CpuTape {
    /// A tape laid out over the caller's `memory` (`rows` times the tape's
    /// floats per row, checked).
    ///
    /// # Safety
    /// `memory` is valid for `len` floats while the tape lives, and the
    /// tape is written only where `memory` may be.
    unsafe fn in_caller(layer: &Layer, rows: usize, memory: *mut f32, len: usize) -> Result<CpuTape> {
        super::check_tape(layer, rows, len)?;
        let parts = layer
            .tape()
            .ranges(rows)
            // SAFETY: the parts' ranges end at `len` (checked above).
            .map(|(part, floats)| {
                (part, TapeBuf { ptr: unsafe { memory.add(floats.start) }, len: floats.len() })
            })
            .collect();
        Ok(CpuTape { parts })
    }

    /// The part keeping `kept`.
    fn part(&self, kept: Kept) -> Result<&TapeBuf> {
        self.parts.iter().find(|(p, _)| p.kept == kept).map(|(_, rows)| rows).ok_or_else(|| {
            RuntimeError::Internal(format!("the backward reads {kept:?}, which the tape does not keep"))
        })
    }

    /// Zeros the rows of padding, which no step writes: a tape in the
    /// caller's memory then holds nothing but what this pass computed.
    fn zero_padding(&mut self, job: &HostForward, rows: usize) {
        let padding = crate::sequence::padding_rows(job.order, job.input.layout, rows);
        if padding.is_empty() {
            return;
        }
        for (part, data) in &mut self.parts {
            crate::sequence::zero_rows(data, part.floats, &padding);
        }
    }
}

/// Places the leaves the caller provides, where the pass's plan says.
fn leaf_locations(pass: &PassPlan, shapes: &Shapes, bufs: &mut Buffers) {
    for (v, home) in pass.homes() {
        let loc = match home {
            Home::Input(i) => Loc::Input(i),
            Home::State(i) => Loc::State(i),
            Home::Param(i) => Loc::Param(i),
            Home::Mask(i) => Loc::Mask(i),
            Home::OutputAdjoint => Loc::DOutput,
            Home::Carry(k) => Loc::Carry(k),
            _ => continue,
        };
        bufs.place(v, loc, shapes.elements(v));
    }
}

fn copy_row(
    bufs: &Buffers,
    f: &Frame,
    v: ValueId,
    (b, t, r): (usize, usize, usize),
    dst: &mut [f32],
) -> Result<()> {
    let p = locate(bufs, f, v, b, t, r)?;
    // SAFETY: `locate` points at `dst.len()` valid floats of `v` (same value, same length).
    let src = unsafe { std::slice::from_raw_parts(p, dst.len()) };
    dst.copy_from_slice(src);
    Ok(())
}

impl Device for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }

    host::host_memory!();

    fn forward(&self, pass: &Pass, job: LayerForward) -> Result<()> {
        let code = self.code(pass.cell, job.layer)?;
        // SAFETY: per the trait's contract, every span is host memory of the pass.
        unsafe {
            host::forward(pass, job, |job, output, tape| {
                self.alone(code.fwd_step_fmas, job.order.batch(), |threads| {
                    forward((threads, self.precision), &code, job, output, tape)
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
                let tape =
                    CpuTape::in_caller(job.layer, job.layout_rows(), tape.as_ptr() as *mut f32, tape.len())?;
                self.alone(code.bwd_step_fmas, job.order.batch(), |threads| {
                    backward((threads, self.precision), &code, job, &tape, d_input)
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
fn step_fmas_per_row(stages: &[ReadyStage], pass: &PassPlan, plan: &Shapes) -> usize {
    pass.stages_at(Placement::EachStep)
        .iter()
        .flat_map(|&k| match &stages[k] {
            ReadyStage::Gemm { products } => products.as_slice(),
            _ => &[],
        })
        .map(|&(_, ref op, m, v)| match op {
            Op::MatVec | Op::MatVecT => plan.elements(m),
            _ => plan.elements(m) * plan.elements(v),
        })
        .sum()
}

fn forward(
    (threads, precision): (usize, Precision),
    code: &LayerCode,
    job: &HostForward,
    output: &mut RowsMut,
    tape: Option<&mut [f32]>,
) -> Result<Vec<Vec<f32>>> {
    let (g, plan) = (&*code.fwd_graph, &*code.fwd_plan);
    let layer = job.layer;
    let pass = layer.pass(Side::Forward, tape.is_some());
    let batch = job.order.batch();
    let layout_rows = job.layout_rows();
    let mut bufs = Buffers::new();
    constants(g, plan, &mut bufs);
    leaf_locations(pass, plan, &mut bufs);
    let mut tape = match tape {
        None => None,
        // SAFETY: the tape lives for this call, which borrows `memory` mutably.
        Some(memory) => {
            let mut t = unsafe { CpuTape::in_caller(layer, layout_rows, memory.as_mut_ptr(), memory.len())? };
            t.zero_padding(job, layout_rows);
            Some(t)
        }
    };
    // Values the plan writes straight into the tape's rows.
    if let Some(t) = tape.as_mut() {
        for (write, (_, rows)) in pass.tape.iter().zip(&mut t.parts) {
            if let (true, TapeSource::Value(v)) = (write.direct, write.source) {
                bufs.place(v, Loc::TapeRows(rows.as_mut_ptr()), plan.elements(v));
            }
        }
    }
    // Layout rows for what runs before the loop and what the plan keeps by
    // layout row; rank rows for the rest (a whole-sequence kernel's outputs
    // are given layout rows below).
    for (k, st) in code.forward.iter().enumerate() {
        let hoisted = pass.before_loop.contains(&k);
        for v in st.outputs() {
            match pass.home(v) {
                Some(Home::Tape(_)) => {}
                Some(Home::Layout) => bufs.row_buf(v, plan.elements(v), layout_rows),
                _ if hoisted => bufs.row_buf(v, plan.elements(v), layout_rows),
                _ => bufs.rank_buf(v, plan.elements(v), batch),
            }
        }
    }
    let team = Team::new(job.order, threads);
    // States in the team's rank order.
    let order = team.order();
    let mut states: Vec<Vec<f32>> = layer
        .state_sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| order.iter().flat_map(|&b| job.h0[i][b * n..(b + 1) * n].iter().copied()).collect())
        .collect();
    let mut finals: Vec<Vec<f32>> = layer.state_sizes.iter().map(|&n| vec![0.0; batch * n]).collect();
    let mut local = None;
    let weights = prepared_params(
        job.prepared,
        &mut local,
        g,
        &code.forward,
        job.params,
        plan,
        (job.order.rows(), precision),
    );
    let state_rows = SharedRows::each(&mut states);
    let frame =
        Frame { states: &state_rows, ..Frame::new((job.input, job.masks), layer, job.params, weights) };

    // Before the loop: every valid row.
    let all_rows = valid_rows(job.order);
    {
        let mut none = HashMap::new();
        let all = AllRows { order: job.order, rows: &all_rows, shapes: plan, threads };
        run_all_rows(&code.forward, &pass.before_loop, &mut bufs, &frame, &all, &mut none)?;
    }
    let output_value =
        pass.output.ok_or_else(|| RuntimeError::Internal("a forward without an output".into()))?;
    let next_states: Vec<ValueId> = pass
        .carried
        .iter()
        .map(|v| v.ok_or_else(|| RuntimeError::Internal("a next state that is never computed".into())))
        .collect::<Result<_>>()?;
    if let TimeLoop::WholeSequence(k) = pass.time_loop {
        let ReadyStage::Pointwise { exec } = &code.forward[k] else {
            return Err(RuntimeError::Internal("a whole-sequence stage that is not a kernel".into()));
        };
        let walk = Walk { job, exec: exec.as_ref(), threads };
        let chained = (output_value, &next_states[..]);
        return forward_whole_sequence(&walk, chained, output, &mut bufs, weights, pass, tape.as_mut());
    }

    // The loop. Each thread writes only the rows of its ranks: their output
    // rows, their tape rows, their states and their sequences' finals.
    let out = SharedRows::of(output.data);
    let (out_width, out_offset, out_layout) = (output.width, output.offset, output.layout);
    let finals_rows = SharedRows::each(&mut finals);
    // The tape's parts that are copied each step, and what from.
    let copies: Vec<(TapeSource, SharedRows, usize)> = match tape.as_mut() {
        None => Vec::new(),
        Some(t) => pass
            .tape
            .iter()
            .zip(&mut t.parts)
            .filter(|(write, _)| !write.direct)
            .map(|(write, (part, rows))| (write.source, SharedRows::of(rows), part.floats))
            .collect(),
    };
    let after = |s: usize, ranks: std::ops::Range<usize>| -> Result<()> {
        let o = layer.output_size;
        for r in ranks {
            let b = order[r];
            let t = job.order.time(b, s, job.reverse);
            // SAFETY (block): every row written is this rank's (sequence b's
            // row at t, rank r's state), which no other thread touches; the
            // located rows are valid for their values' lengths.
            unsafe {
                let out_row = out.at(out_layout.row(b, t) * out_width + out_offset);
                std::ptr::copy_nonoverlapping(locate(&bufs, &frame, output_value, b, t, r)?, out_row, o);
                // The tape's rows, before the states move on.
                let row = job.input.layout.row(b, t);
                for &(source, dst, len) in &copies {
                    let src = match source {
                        TapeSource::StateBefore(i) => state_rows[i].at(r * len),
                        TapeSource::Value(v) => locate(&bufs, &frame, v, b, t, r)?,
                    };
                    std::ptr::copy_nonoverlapping(src, dst.at(row * len), len);
                }
                for (i, &m) in layer.state_sizes.iter().enumerate() {
                    let state = state_rows[i].at(r * m);
                    // The new state replaces the old in place: this row's
                    // stages have read it, and no other row reads it.
                    std::ptr::copy(locate(&bufs, &frame, next_states[i], b, t, r)?, state, m);
                    if s + 1 == job.order.lengths()[b] {
                        std::ptr::copy_nonoverlapping(state, finals_rows[i].at(b * m), m);
                    }
                }
            }
        }
        Ok(())
    };
    let steps: Vec<usize> = (0..job.order.steps()).collect();
    let each_step = StepLoop {
        team: &team,
        stages: &code.forward,
        each_step: pass.stages_at(Placement::EachStep),
        bufs: &bufs,
        frame: &frame,
        shapes: plan,
        order: job.order,
        reverse: job.reverse,
    };
    each_step.run(&steps, &after)?;
    Ok(finals)
}

/// Copies each value's row for `(b, t)` at rank `r` into layout row `row`
/// of its buffer (the backward's values kept for after the loop).
///
/// # Safety
/// Each buffer holds layout row `row` of its value's length, and no other
/// thread writes it.
unsafe fn keep_row(
    kept: &[(ValueId, SharedRows)],
    bufs: &Buffers,
    frame: &Frame,
    plan: &Shapes,
    (b, t, r): (usize, usize, usize),
    row: usize,
) -> Result<()> {
    for &(v, dst) in kept {
        let len = plan.elements(v);
        // SAFETY: the located row is valid for `len` floats; dst per the contract.
        unsafe { std::ptr::copy_nonoverlapping(locate(bufs, frame, v, b, t, r)?, dst.at(row * len), len) };
    }
    Ok(())
}

/// A whole-sequence kernel over a job's sequences, shared out between
/// `threads` threads.
struct Walk<'a, J> {
    job: &'a J,
    exec: &'a dyn StageExec,
    threads: usize,
}

/// The plan's whole-sequence loop: one kernel call that walks every
/// sequence through time. Each row's state pointers point at the previous
/// step's next state, so the rows of one sequence run in order, and
/// threads take whole sequences. Returns the final states.
fn forward_whole_sequence(
    walk: &Walk<HostForward>,
    (output_value, next_states): (ValueId, &[ValueId]),
    output: &mut RowsMut,
    bufs: &mut Buffers,
    weights: &PreparedParams,
    pass: &PassPlan,
    mut tape: Option<&mut CpuTape>,
) -> Result<Vec<Vec<f32>>> {
    let (job, exec) = (walk.job, walk.exec);
    let layer = job.layer;
    let layout_rows = job.layout_rows();
    for &v in exec.outputs() {
        // Values written straight into the tape stay there.
        if !matches!(pass.home(v), Some(Home::Tape(_))) {
            bufs.row_buf(v, layer.forward_shapes.elements(v), layout_rows);
        }
    }
    let frame = Frame::new((job.input, job.masks), layer, job.params, weights);
    let k = exec.inputs().len() + exec.outputs().len();
    let order = job.order.order();
    let chunks = walk.threads.clamp(1, order.len().max(1));
    let mut tables: Vec<Vec<*mut f32>> = vec![Vec::new(); chunks];
    // State `i` before step `s` of sequence `b`: the initial state, or the
    // next state of the step before (no row holds a state here).
    let state_before = |i: usize, b: usize, s: usize| -> Result<*mut f32> {
        match s {
            0 => Ok(job.h0[i][b * layer.state_sizes[i]..].as_ptr() as *mut f32),
            _ => locate(bufs, &frame, next_states[i], b, job.order.time(b, s - 1, job.reverse), 0),
        }
    };
    // Value `v`'s row at step `s` of sequence `b`.
    let row_of = |v: ValueId, b: usize, s: usize| -> Result<*mut f32> {
        match pass.home(v) {
            Some(Home::State(i)) => state_before(i, b, s),
            _ => locate(bufs, &frame, v, b, job.order.time(b, s, job.reverse), 0),
        }
    };
    let copy = |src: *mut f32, dst: &mut [f32]| {
        // SAFETY: `src` is a row (from `row_of` or `state_before`) of the
        // value `dst` has a row of: as many floats.
        dst.copy_from_slice(unsafe { std::slice::from_raw_parts(src, dst.len()) })
    };
    for s in 0..job.order.steps() {
        for (r, &b) in job.order.active(s).iter().enumerate() {
            let table = &mut tables[r % chunks];
            for &v in exec.inputs().iter().chain(exec.outputs()) {
                table.push(row_of(v, b, s)?);
            }
        }
    }
    run_tables(exec, tables, k);

    let o = layer.output_size;
    let mut finals: Vec<Vec<f32>> =
        layer.state_sizes.iter().map(|&m| vec![0.0; job.order.batch() * m]).collect();
    for b in 0..job.order.batch() {
        let len = job.order.lengths()[b];
        for s in 0..len {
            let t = job.order.time(b, s, job.reverse);
            let out_row = output.layout.row(b, t) * output.width + output.offset;
            copy(row_of(output_value, b, s)?, &mut output.data[out_row..out_row + o]);
            if let Some(tape) = tape.as_deref_mut() {
                let row = job.input.layout.row(b, t);
                for (write, (part, data)) in pass.tape.iter().zip(&mut tape.parts) {
                    let width = part.floats;
                    let dst = &mut data[row * width..(row + 1) * width];
                    match write.source {
                        _ if write.direct => {}
                        TapeSource::StateBefore(i) => copy(state_before(i, b, s)?, dst),
                        TapeSource::Value(v) => copy(row_of(v, b, s)?, dst),
                    }
                }
            }
            if s + 1 == len {
                for (i, &m) in layer.state_sizes.iter().enumerate() {
                    copy(row_of(next_states[i], b, s)?, &mut finals[i][b * m..(b + 1) * m]);
                }
            }
        }
    }
    Ok(finals)
}

/// The backward's whole-sequence loop: one call walking each sequence
/// backwards through time, the carried adjoints chained like the forward's
/// states (a state with no adjoint carries zeros). Everything the stage
/// computes is kept per row for after the loop.
fn backward_whole_sequence(
    walk: &Walk<HostBackward>,
    bufs: &mut Buffers,
    weights: &PreparedParams,
    pass: &PassPlan,
    rank_order: &[usize],
    carry: &mut [Vec<f32>],
) -> Result<()> {
    let (job, exec) = (walk.job, walk.exec);
    let layer = job.layer;
    let layout_rows = job.layout_rows();
    for &v in exec.outputs() {
        bufs.row_buf(v, layer.backward_shapes.elements(v), layout_rows);
    }
    let frame = Frame {
        d_output: Some((job.d_output, layer.output_size)),
        ..Frame::new((job.input, job.masks), layer, job.params, weights)
    };
    let zeros = vec![0.0f32; layer.state_sizes.iter().copied().max().unwrap_or(0)];
    let k = exec.inputs().len() + exec.outputs().len();
    let order = job.order.order();
    let chunks = walk.threads.clamp(1, order.len().max(1));
    let mut tables: Vec<Vec<*mut f32>> = vec![Vec::new(); chunks];
    for s in (0..job.order.steps()).rev() {
        for (r, &b) in job.order.active(s).iter().enumerate() {
            let t = job.order.time(b, s, job.reverse);
            let last = s + 1 == job.order.lengths()[b];
            let table = &mut tables[r % chunks];
            for &v in exec.inputs() {
                let p = match (pass.home(v), last) {
                    (Some(Home::Carry(i)), true) => {
                        let m = layer.state_sizes[i];
                        job.d_final[i][b * m..].as_ptr() as *mut f32
                    }
                    (Some(Home::Carry(i)), false) => match pass.carried[i] {
                        Some(d) => locate(bufs, &frame, d, b, job.order.time(b, s + 1, job.reverse), 0)?,
                        // Read only: the kernel's inputs are never written.
                        None => zeros.as_ptr() as *mut f32,
                    },
                    _ => locate(bufs, &frame, v, b, t, 0)?,
                };
                table.push(p);
            }
            for &v in exec.outputs() {
                table.push(locate(bufs, &frame, v, b, t, 0)?);
            }
        }
    }
    run_tables(exec, tables, k);
    // The adjoints of the initial states: the carry out of each sequence's first step.
    for (r, &b) in rank_order.iter().enumerate() {
        let t = job.order.time(b, 0, job.reverse);
        for (i, &m) in layer.state_sizes.iter().enumerate() {
            let dst = &mut carry[i][r * m..(r + 1) * m];
            match pass.carried[i] {
                Some(d) => copy_row(bufs, &frame, d, (b, t, 0), dst)?,
                None => dst.fill(0.0),
            }
        }
    }
    Ok(())
}

/// Carried adjoint `i` as each row of a whole-sequence backward saw it:
/// the state adjoint its next step computed, or the final state's adjoint
/// at a sequence's last step.
fn seeds_per_row(
    job: &HostBackward,
    pass: &PassPlan,
    bufs: &Buffers,
    i: usize,
    layout_rows: usize,
) -> Result<Vec<f32>> {
    let layer = job.layer;
    let m = layer.state_sizes[i];
    let mut data = pool::take_zeroed(layout_rows * m);
    let no_weights = PreparedParams::new(0, Precision::F32);
    let frame = Frame::new((job.input, job.masks), layer, job.params, &no_weights);
    for b in 0..job.order.batch() {
        let len = job.order.lengths()[b];
        for s in 0..len {
            let row = job.input.layout.row(b, job.order.time(b, s, job.reverse));
            let dst = &mut data[row * m..(row + 1) * m];
            if s + 1 == len {
                dst.copy_from_slice(&job.d_final[i][b * m..(b + 1) * m]);
            } else if let Some(d) = pass.carried[i] {
                copy_row(bufs, &frame, d, (b, job.order.time(b, s + 1, job.reverse), 0), dst)?;
            }
        }
    }
    Ok(data)
}

/// Runs one pointer table per thread (each holding whole sequences in time
/// order, so each row's chained inputs were written by an earlier row).
fn run_tables(exec: &dyn StageExec, tables: Vec<Vec<*mut f32>>, k: usize) {
    let tables: Vec<SendTable> = tables.into_iter().map(SendTable).collect();
    threads::for_each(tables.len(), &|i| {
        let table = tables[i].get();
        // SAFETY: pointers from `locate` (or the caller's h0 / final
        // adjoints, or a row of zeros), valid for their values; tables
        // write disjoint sequences.
        unsafe { exec.run(table.len() / k.max(1), table) }
    });
}

fn backward(
    (threads, precision): (usize, Precision),
    code: &LayerCode,
    job: &HostBackward,
    tape: &CpuTape,
    d_input: &mut RowsMut,
) -> Result<HostGradients> {
    let (g, plan) = (&*code.bwd_graph, &*code.bwd_plan);
    let layer = job.layer;
    let pass = layer.pass(Side::Backward, true);
    let batch = job.order.batch();
    let layout_rows = job.layout_rows();
    let mut bufs = Buffers::new();
    constants(g, plan, &mut bufs);
    leaf_locations(pass, plan, &mut bufs);
    // Forward values the backward reads: the tape's rows.
    for (v, home) in pass.homes() {
        if let Home::Tape(kept) = home {
            bufs.place(v, Loc::TapeRows(tape.part(kept)?.as_ptr() as *mut f32), plan.elements(v));
        }
    }
    // Storage for what the stages compute: per-step values in rank rows,
    // copied into layout rows each step where the plan keeps them for
    // after the loop.
    let each_step = pass.stages_at(Placement::EachStep);
    for (k, st) in code.backward.iter().enumerate() {
        for v in st.outputs() {
            match pass.home(v) {
                Some(Home::Fixed) => {}
                _ if each_step.contains(&k) => bufs.rank_buf(v, plan.elements(v), batch),
                _ => bufs.row_buf(v, plan.elements(v), layout_rows),
            }
        }
    }
    let persisted = pass.kept_for_after_loop.iter().copied();
    let persisted = persisted.chain(pass.carries_for_after_loop.iter().map(|&(v, _)| v));
    let mut kept: HashMap<ValueId, Vec<f32>> =
        persisted.map(|v| (v, pool::take(layout_rows * plan.elements(v)))).collect();

    let team = Team::new(job.order, threads);
    let order = team.order();
    let mut carry: Vec<Vec<f32>> = layer
        .state_sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            order.iter().flat_map(|&b| job.d_final[i][b * n..(b + 1) * n].iter().copied()).collect()
        })
        .collect();
    let mut local = None;
    let weights = prepared_params(
        job.prepared,
        &mut local,
        g,
        &code.backward,
        job.params,
        plan,
        (job.order.rows(), precision),
    );
    let d_out = Some((job.d_output, layer.output_size));
    // Before the loop: products that read no carried adjoint, over every valid row.
    let all_rows = valid_rows(job.order);
    {
        let frame =
            Frame { d_output: d_out, ..Frame::new((job.input, job.masks), layer, job.params, weights) };
        let mut none = HashMap::new();
        let all = AllRows { order: job.order, rows: &all_rows, shapes: plan, threads };
        run_all_rows(&code.backward, &pass.before_loop, &mut bufs, &frame, &all, &mut none)?;
    }
    if let TimeLoop::WholeSequence(k) = pass.time_loop {
        let ReadyStage::Pointwise { exec } = &code.backward[k] else {
            return Err(RuntimeError::Internal("a whole-sequence stage that is not a kernel".into()));
        };
        let walk = Walk { job, exec: exec.as_ref(), threads };
        backward_whole_sequence(&walk, &mut bufs, weights, pass, order, &mut carry)?;
        // The kernel kept every value per row; the carried adjoints are
        // the next row's state adjoints, or the final ones.
        kept.clear();
        for &(v, i) in &pass.carries_for_after_loop {
            kept.insert(v, seeds_per_row(job, pass, &bufs, i, layout_rows)?);
        }
    } else {
        // The loop, backwards in time. Each thread writes only its ranks'
        // carried adjoints and its sequences' kept rows.
        let carry_rows = SharedRows::each(&mut carry);
        let kept_rows: Vec<(ValueId, SharedRows)> =
            kept.iter_mut().map(|(&v, b)| (v, SharedRows::of(b))).collect();
        let frame = Frame {
            carry: &carry_rows,
            d_output: d_out,
            ..Frame::new((job.input, job.masks), layer, job.params, weights)
        };
        let after = |s: usize, ranks: std::ops::Range<usize>| -> Result<()> {
            for r in ranks {
                let b = order[r];
                let t = job.order.time(b, s, job.reverse);
                let row = job.input.layout.row(b, t);
                // SAFETY (block): rank r's carried adjoints and sequence b's
                // kept rows belong to this thread alone; located rows are
                // valid for their values' lengths.
                unsafe {
                    keep_row(&kept_rows, &bufs, &frame, plan, (b, t, r), row)?;
                    // The carry is replaced in place: this row's stages have
                    // read it, and the kept rows above were copied first.
                    for (i, &m) in layer.state_sizes.iter().enumerate() {
                        let dst = carry_rows[i].at(r * m);
                        match pass.carried[i] {
                            Some(v) => std::ptr::copy(locate(&bufs, &frame, v, b, t, r)?, dst, m),
                            None => std::ptr::write_bytes(dst, 0, m),
                        }
                    }
                }
            }
            Ok(())
        };
        let steps: Vec<usize> = (0..job.order.steps()).rev().collect();
        let each_step = StepLoop {
            team: &team,
            stages: &code.backward,
            each_step,
            bufs: &bufs,
            frame: &frame,
            shapes: plan,
            order: job.order,
            reverse: job.reverse,
        };
        each_step.run(&steps, &after)?;
    }

    // After the loop, over every valid row.
    for (v, data) in kept {
        bufs.row_data(v, data);
    }
    let carry_rows = SharedRows::each(&mut carry);
    let frame = Frame {
        carry: &carry_rows,
        d_output: d_out,
        ..Frame::new((job.input, job.masks), layer, job.params, weights)
    };
    let mut matrices: HashMap<ValueId, Vec<f32>> = HashMap::new();
    let all = AllRows { order: job.order, rows: &all_rows, shapes: plan, threads };
    run_all_rows(&code.backward, &pass.after_loop, &mut bufs, &frame, &all, &mut matrices)?;
    // Parameter gradients: accumulated products, or per-row values summed over rows.
    let mut d_params = Vec::with_capacity(job.params.len());
    for (i, d) in pass.d_params.iter().enumerate() {
        let len = job.params[i].len();
        match *d {
            None => d_params.push(vec![0.0; len]),
            Some(ParamGradient::Matrix(v)) => {
                // Two parameters may share one gradient (`w @ x + u @ x`): the last takes it.
                let shared = pass.d_params[i + 1..].iter().flatten().any(|g| g.value() == v);
                let matrix = if shared { matrices.get(&v).cloned() } else { matrices.remove(&v) };
                d_params.push(
                    matrix.ok_or_else(|| {
                        RuntimeError::Internal(format!("weight gradient {v} is not computed"))
                    })?,
                )
            }
            Some(ParamGradient::SumOfRows(v)) => {
                let rows: Vec<*const f32> = all_rows
                    .iter()
                    .map(|&(b, t, _)| locate(&bufs, &frame, v, b, t, 0).map(|p| p as *const f32))
                    .collect::<Result<_>>()?;
                let mut acc = vec![0.0f32; len];
                // SAFETY: each pointer is a located row of `len` floats of v.
                unsafe { sum_rows(&rows, &mut acc, threads) };
                d_params.push(acc);
            }
        }
    }
    for (d, &(o, l)) in pass.d_inputs.iter().zip(&layer.input_slices) {
        let Some(v) = d else { continue };
        for &(b, t, _) in &all_rows {
            let p = locate(&bufs, &frame, *v, b, t, 0)?;
            // SAFETY: a located row of `l` floats of v, in a buffer of this run (not d_input).
            let row = unsafe { std::slice::from_raw_parts(p, l) };
            let dst = d_input.get_mut(b, t, layer.input_size);
            dst[o..o + l].iter_mut().zip(row).for_each(|(a, x)| *a += x);
        }
    }
    let d_h0 = layer
        .state_sizes
        .iter()
        .enumerate()
        .map(|(i, &m)| {
            let mut out = vec![0.0; batch * m];
            for (r, &b) in order.iter().enumerate() {
                out[b * m..(b + 1) * m].copy_from_slice(&carry[i][r * m..(r + 1) * m]);
            }
            out
        })
        .collect();
    Ok(HostGradients { d_h0, d_params })
}

/// Every valid row of a batch, for the stages run before or after the loop.
struct AllRows<'a> {
    order: &'a crate::sequence::BatchOrder,
    /// `(b, t, 0)` for every valid row.
    rows: &'a [(usize, usize, usize)],
    shapes: &'a Shapes,
    threads: usize,
}

/// Runs the stages `which` (the plan's before or after the loop) over
/// every valid row: products as GEMMs over all rows (weight gradients
/// summed into `matrices`), kernels over every row.
fn run_all_rows(
    steps: &[ReadyStage],
    which: &[usize],
    bufs: &mut Buffers,
    frame: &Frame,
    all: &AllRows,
    matrices: &mut HashMap<ValueId, Vec<f32>>,
) -> Result<()> {
    for st in which.iter().map(|&k| &steps[k]) {
        match st {
            ReadyStage::Gemm { products, .. } => {
                gemm_all_rows(products, bufs, frame, all.order, matrices, all.shapes, all.threads)?
            }
            ReadyStage::Pointwise { exec, .. } => {
                run_pointwise(exec.as_ref(), bufs, frame, all.rows, all.threads)?
            }
            ReadyStage::Sum => {}
            ReadyStage::AddMatrices { sums } => {
                for &(out, a, b) in sums {
                    let missing = |v: ValueId| RuntimeError::Internal(format!("matrix {v} is not computed"));
                    let (x, y) = (
                        matrices.get(&a).ok_or_else(|| missing(a))?,
                        matrices.get(&b).ok_or_else(|| missing(b))?,
                    );
                    let sum = x.iter().zip(y).map(|(x, y)| x + y).collect();
                    matrices.insert(out, sum);
                }
            }
        }
    }
    Ok(())
}

/// `out[j] = Σ_rows row[j]`, rows added in order; the columns are shared
/// out between up to `threads` threads, so the result does not depend on
/// the thread count.
///
/// # Safety
/// Every pointer is valid for `out.len()` floats.
unsafe fn sum_rows(rows: &[*const f32], out: &mut [f32], threads: usize) {
    let len = out.len();
    let parts = if rows.len() * len >= 1 << 16 { threads.clamp(1, len.div_ceil(16)) } else { 1 };
    let per = len.div_ceil(parts).next_multiple_of(16).max(16);
    let rows = SendTable(rows.iter().map(|&p| p as *mut f32).collect());
    threads::for_each_chunk_mut(out, per, &|c, chunk| {
        for &p in rows.get() {
            // SAFETY: per the contract, p has `len` floats; this chunk's columns lie within.
            let row = unsafe { std::slice::from_raw_parts(p.add(c * per), chunk.len()) };
            chunk.iter_mut().zip(row).for_each(|(a, x)| *a += x);
        }
    });
}

/// Every valid `(sequence, step, 0)` of a batch, sequence by sequence: the
/// rows a stage before or after the loop runs on.
fn valid_rows(order: &crate::sequence::BatchOrder) -> Vec<(usize, usize, usize)> {
    order.lengths().iter().enumerate().flat_map(|(b, &len)| (0..len).map(move |t| (b, t, 0))).collect()
}
