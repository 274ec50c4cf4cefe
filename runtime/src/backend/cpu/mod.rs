//! The CPU back end: the schedule's products through weights packed once
//! per model (`panels`), its pointwise stages as compiled kernels, both
//! cores through the process's team of threads.
//!
//! Work runs on the process's one team of threads (`threads`: cellc's pool,
//! or the OpenMP team of the framework that called), a call at a time. The
//! time loop is one parallel region on those threads (`team`,
//! `step_loop`): threads own whole sequences, or split each product by
//! panels. Per-step values live in rank order, so a thread's active
//! sequences are a contiguous prefix and each per-step product is one call.

pub mod aot;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(feature = "codegen")]
pub mod codegen;
mod driver;
pub mod gemm;
mod in_place;
pub mod native;
pub(crate) mod openmp;
pub mod panels;
pub(crate) mod prepared;
pub mod roofline;
pub mod stage;
mod step_loop;
mod stream;
mod team;
pub mod threads;

use super::{Backend, BackwardJob, BackwardResult, ForwardJob, RowsMut, StepRunner, StreamJob};
use crate::cell::{CompiledCell, Layer};
use crate::error::{Result, RuntimeError};
use crate::pool;
use cellc::ir::{Graph, Op, ValueId};
use cellc::program::{Kept, ProgramKernel, Side, Storage};
use cellc::schedule::Placement;
use cellc::shapes::Shapes;
use driver::{
    constants, gemm_all_rows, locate, prepared_params, run_pointwise, Buffers, Frame, Loc, ReadyStage,
    SendTable, SharedRows,
};
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
        Ok(Cpu { threads, step_fmas_per_thread, kernels, code: Mutex::new(HashMap::new()) })
    }

    /// This back end with every step split between its threads, however
    /// small (by default a pass whose steps are too small to be worth the
    /// threads' meeting runs on fewer): for tests of the threaded paths at
    /// small sizes, and for timing the split itself.
    pub fn split_every_step(self) -> Cpu {
        Cpu { step_fmas_per_thread: 0, ..self }
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
        let fwd_step_fmas = step_fmas_per_row(&forward, &fwd_plan);
        let bwd_step_fmas = step_fmas_per_row(&backward, &bwd_plan);
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

/// What the forward keeps, per row at the layer's row layout, in the
/// tape it is given ([`Backend::forward`]), part after part as the program
/// lays it out ([`cellc::program::TapeLayout`]).
struct CpuTape {
    /// By state: `None` where the backward does not read it.
    states_before: Vec<Option<TapeBuf>>,
    states_after: Vec<Option<TapeBuf>>,
    output: Option<TapeBuf>,
    /// Saved forward values by id (the backward graph shares the ids).
    saved: HashMap<ValueId, TapeBuf>,
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
        let states = layer.state_sizes.len();
        let mut tape = CpuTape {
            states_before: (0..states).map(|_| None).collect(),
            states_after: (0..states).map(|_| None).collect(),
            output: None,
            saved: HashMap::new(),
        };
        for (part, floats) in layer.tape().ranges(rows) {
            // SAFETY: the parts' ranges end at `len` (checked above).
            let buf = TapeBuf { ptr: unsafe { memory.add(floats.start) }, len: floats.len() };
            match part.kept {
                Kept::StateBefore(i) => tape.states_before[i] = Some(buf),
                Kept::StateAfter(i) => tape.states_after[i] = Some(buf),
                Kept::Output => tape.output = Some(buf),
                Kept::Saved(v) => {
                    tape.saved.insert(v, buf);
                }
            }
        }
        Ok(tape)
    }

    /// Zeros the rows of padding, which no step writes: a tape in the
    /// caller's memory then holds nothing but what this pass computed.
    fn zero_padding(&mut self, job: &ForwardJob, rows: usize) {
        let padding = crate::sequence::padding_rows(job.order, job.input.layout, rows);
        if padding.is_empty() {
            return;
        }
        let parts = self.states_before.iter_mut().chain(&mut self.states_after).chain([&mut self.output]);
        for part in parts.flatten().chain(self.saved.values_mut()) {
            let width = part.len() / rows.max(1);
            crate::sequence::zero_rows(part, width, &padding);
        }
    }
}

/// Places the leaves the caller provides, as the program stores them.
fn leaf_locations(g: &Graph, layer: &Layer, side: Side, bufs: &mut Buffers) {
    let plan = layer.shapes(side);
    for v in g.values() {
        let loc = match layer.storage(side, v, true) {
            Some(Storage::Input(i)) => Loc::Input(i),
            Some(Storage::State(i)) => Loc::State(i),
            Some(Storage::Param(i)) => Loc::Param(i),
            Some(Storage::OutputAdjoint) => Loc::DOutput,
            Some(Storage::CarriedAdjoint(k)) => Loc::Carry(k),
            _ => continue,
        };
        bufs.place(v, loc, plan.elements(v));
    }
}

fn shape_of<'a>(plan: &'a Shapes) -> impl Fn(ValueId) -> (usize, usize) + 'a {
    move |v| plan.shape(v)
}

fn copy_row(
    bufs: &mut Buffers,
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

impl Backend for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn forward(
        &self,
        job: &ForwardJob,
        output: &mut RowsMut,
        tape: Option<&mut [f32]>,
    ) -> Result<Vec<Vec<f32>>> {
        let code = self.code(job.cell, job.layer)?;
        self.alone(code.fwd_step_fmas, job.order.batch(), |threads| {
            forward(threads, &code, job, output, tape)
        })
    }

    fn backward(&self, job: &BackwardJob, tape: &[f32], d_input: &mut RowsMut) -> Result<BackwardResult> {
        let code = self.code(job.cell, job.layer)?;
        // SAFETY: the backward only reads its tape, which borrows `tape` for this call.
        let tape = unsafe {
            CpuTape::in_caller(job.layer, job.layout_rows(), tape.as_ptr() as *mut f32, tape.len())?
        };
        self.alone(code.bwd_step_fmas, job.order.batch(), |threads| {
            backward(threads, &code, job, &tape, d_input)
        })
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

/// Multiply-adds of one row's step: the products of every stage that runs
/// each step.
fn step_fmas_per_row(stages: &[ReadyStage], plan: &Shapes) -> usize {
    stages
        .iter()
        .filter(|st| st.placement() == Placement::EachStep)
        .flat_map(|st| match st {
            ReadyStage::Gemm { products, .. } => products.as_slice(),
            _ => &[],
        })
        .map(|&(_, ref op, m, v)| match op {
            Op::MatVec | Op::MatVecT => plan.elements(m),
            _ => plan.elements(m) * plan.elements(v),
        })
        .sum()
}

fn forward(
    threads: usize,
    code: &LayerCode,
    job: &ForwardJob,
    output: &mut RowsMut,
    tape: Option<&mut [f32]>,
) -> Result<Vec<Vec<f32>>> {
    let (g, plan) = (&*code.fwd_graph, &*code.fwd_plan);
    let layer = job.layer;
    let cell = &job.cell.forward;
    let batch = job.order.batch();
    let layout_rows = job.layout_rows();
    let mut bufs = Buffers::new();
    constants(g, plan, &mut bufs);
    leaf_locations(g, layer, Side::Forward, &mut bufs);
    let training = tape.is_some();
    let mut tape = match tape {
        None => None,
        // SAFETY: the tape lives for this call, which borrows `memory` mutably.
        Some(memory) => {
            let mut t = unsafe { CpuTape::in_caller(layer, layout_rows, memory.as_mut_ptr(), memory.len())? };
            t.zero_padding(job, layout_rows);
            Some(t)
        }
    };
    // Saved values that only pointwise stages touch are written straight
    // into the tape's rows; the rest are copied there per row.
    let (direct, saved_ids): (Vec<ValueId>, Vec<ValueId>) = layer.saved().iter().copied().partition(|&v| {
        let pointwise_output = code.forward.iter().any(|st| {
            st.placement() == Placement::EachStep
                && matches!(st, ReadyStage::Pointwise { exec, .. } if exec.outputs().contains(&v))
        });
        let gemm_input = code.forward.iter().any(|st| match st {
            ReadyStage::Gemm { products, placement: Placement::EachStep } => {
                products.iter().any(|p| p.2 == v || p.3 == v)
            }
            _ => false,
        });
        tape.is_some() && pointwise_output && !gemm_input
    });
    if let Some(t) = tape.as_mut() {
        for &v in &direct {
            let rows =
                t.saved.get_mut(&v).ok_or_else(|| RuntimeError::Internal(format!("{v} not in the tape")))?;
            bufs.place(v, Loc::TapeRows(rows.as_mut_ptr()), plan.elements(v));
        }
    }
    // Layout rows, or rank rows (values kept for the backward are copied
    // into the tape's layout rows each step, or written there directly).
    for st in &code.forward {
        for &v in st.outputs().iter().filter(|v| !direct.contains(v)) {
            match (layer.storage(Side::Forward, v, training), st.placement()) {
                (Some(Storage::Layout), _) | (_, Placement::BeforeLoop) => {
                    bufs.row_buf(v, plan.elements(v), layout_rows)
                }
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
    let shape = shape_of(plan);
    let mut local = None;
    let weights =
        prepared_params(job.prepared, &mut local, g, &code.forward, job.params, &shape, job.order.rows());
    let state_rows = SharedRows::each(&mut states);
    let frame = Frame { states: &state_rows, ..Frame::new(job.input, layer, job.params, weights) };

    // Before the loop: every valid row.
    let all_rows = valid_rows(job.order);
    {
        let mut none = HashMap::new();
        let all = AllRows { order: job.order, rows: &all_rows, shape: &shape, threads };
        run_all_rows(&code.forward, Placement::BeforeLoop, &mut bufs, &frame, &all, &mut none)?;
    }

    let whole = forward_whole_sequence(
        threads,
        code,
        job,
        output,
        &mut bufs,
        weights,
        tape.as_mut().map(|t| (t, &saved_ids[..])),
    )?;
    if let Some(result) = whole {
        return Ok(result);
    }

    // The loop. Each thread writes only the rows of its ranks: their output
    // rows, their tape rows, their states and their sequences' finals.
    let out = SharedRows::of(output.data);
    let (out_width, out_offset, out_layout) = (output.width, output.offset, output.layout);
    let finals_rows = SharedRows::each(&mut finals);
    let tape_rows = tape.as_mut().map(|t| TapeRows::of(t, &saved_ids));
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
                let y = locate(&bufs, &frame, cell.output, b, t, r)?;
                std::ptr::copy_nonoverlapping(y, out_row, o);
                let row = job.input.layout.row(b, t);
                if let Some(tape) = &tape_rows {
                    if let Some(kept) = &tape.output {
                        std::ptr::copy_nonoverlapping(out_row, kept.at(row * o), o);
                    }
                    keep_row(&tape.saved, &bufs, &frame, plan, (b, t, r), row)?;
                }
                for (i, &m) in layer.state_sizes.iter().enumerate() {
                    let state = state_rows[i].at(r * m);
                    if let Some(kept) = tape_rows.as_ref().and_then(|t| t.states_before[i].as_ref()) {
                        std::ptr::copy_nonoverlapping(state, kept.at(row * m), m);
                    }
                    // The new state replaces the old in place: this row's
                    // stages have read it, and no other row reads it.
                    std::ptr::copy(locate(&bufs, &frame, cell.next_states[i], b, t, r)?, state, m);
                    if let Some(kept) = tape_rows.as_ref().and_then(|t| t.states_after[i].as_ref()) {
                        std::ptr::copy_nonoverlapping(state, kept.at(row * m), m);
                    }
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
        bufs: &bufs,
        frame: &frame,
        shape: &shape,
        order: job.order,
        reverse: job.reverse,
    };
    each_step.run(&steps, &after)?;
    Ok(finals)
}

/// The tape's buffers as addresses the loop's threads write their rows to.
struct TapeRows {
    states_before: Vec<Option<SharedRows>>,
    states_after: Vec<Option<SharedRows>>,
    output: Option<SharedRows>,
    /// Saved values copied from the step's storage into the tape's rows.
    saved: Vec<(ValueId, SharedRows)>,
}

impl TapeRows {
    fn of(t: &mut CpuTape, ids: &[ValueId]) -> TapeRows {
        let saved = ids.iter().filter_map(|&v| Some((v, SharedRows::of(t.saved.get_mut(&v)?)))).collect();
        let each = |bufs: &mut [Option<TapeBuf>]| {
            bufs.iter_mut().map(|b| b.as_deref_mut().map(SharedRows::of)).collect()
        };
        TapeRows {
            states_before: each(&mut t.states_before),
            states_after: each(&mut t.states_after),
            output: t.output.as_deref_mut().map(SharedRows::of),
            saved,
        }
    }
}

/// Copies each value's row for `(b, t)` at rank `r` into layout row `row`
/// of its buffer (the tape's saved values, the backward's kept values).
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

/// An elementwise recurrence (no per-step GEMM) runs as one kernel call
/// that walks every sequence through time: each row's state pointers point
/// at the previous step's next state, so the rows of one sequence must run
/// in order, and threads take whole sequences. Returns the final states, or
/// `None` when the layer is not of that shape.
fn forward_whole_sequence(
    threads: usize,
    code: &LayerCode,
    job: &ForwardJob,
    output: &mut RowsMut,
    bufs: &mut Buffers,
    weights: &PreparedParams,
    tape: Option<(&mut CpuTape, &[ValueId])>,
) -> Result<Option<Vec<Vec<f32>>>> {
    // The tape, and the saved values to copy into it (the rest are written there directly).
    let (mut tape, copied) = match tape {
        Some((t, copied)) => (Some(t), copied),
        None => (None, &[][..]),
    };
    // The schedule's decision: one stage that is the whole recurrence.
    let whole = code.forward.iter().find_map(|s| match s {
        ReadyStage::Pointwise { exec, whole_sequence: true, .. } => Some(exec),
        _ => None,
    });
    let Some(exec) = whole else { return Ok(None) };
    let (g, plan) = (&*code.fwd_graph, &*code.fwd_plan);
    let cell = &job.cell.forward;
    let layer = job.layer;
    if !cell.next_states.iter().chain(std::iter::once(&cell.output)).all(|v| exec.outputs().contains(v)) {
        return Ok(None);
    }
    let layout_rows = job.layout_rows();
    for &v in exec.outputs() {
        // Saved values already written straight into the tape stay there.
        if !matches!(bufs.loc(v), Some(Loc::TapeRows(_))) {
            bufs.row_buf(v, plan.elements(v), layout_rows);
        }
    }
    let state_of = |v: ValueId| match g.node(v).op {
        Op::State(i) => Some(i),
        _ => None,
    };
    let frame = Frame::new(job.input, layer, job.params, weights);
    let k = exec.inputs().len() + exec.outputs().len();
    let order = job.order.order();
    let chunks = threads.clamp(1, order.len().max(1));
    let mut tables: Vec<Vec<*mut f32>> = vec![Vec::new(); chunks];
    for s in 0..job.order.steps() {
        for (r, &b) in job.order.active(s).iter().enumerate() {
            let t = job.order.time(b, s, job.reverse);
            let table = &mut tables[r % chunks];
            for &v in exec.inputs() {
                let p = match state_of(v) {
                    Some(i) if s == 0 => {
                        let m = layer.state_sizes[i];
                        job.h0[i][b * m..].as_ptr() as *mut f32
                    }
                    Some(i) => locate(
                        bufs,
                        &frame,
                        cell.next_states[i],
                        b,
                        job.order.time(b, s - 1, job.reverse),
                        0,
                    )?,
                    None => locate(bufs, &frame, v, b, t, 0)?,
                };
                table.push(p);
            }
            for &v in exec.outputs() {
                table.push(locate(bufs, &frame, v, b, t, 0)?);
            }
        }
    }
    run_tables(exec.as_ref(), tables, k);

    let o = layer.output_size;
    let mut finals: Vec<Vec<f32>> =
        layer.state_sizes.iter().map(|&m| vec![0.0; job.order.batch() * m]).collect();
    for b in 0..job.order.batch() {
        let len = job.order.lengths()[b];
        for s in 0..len {
            let t = job.order.time(b, s, job.reverse);
            let out_row = output.layout.row(b, t) * output.width + output.offset;
            copy_row(bufs, &frame, cell.output, (b, t, 0), &mut output.data[out_row..out_row + o])?;
            if let Some(tape) = tape.as_deref_mut() {
                let row = job.input.layout.row(b, t);
                if let Some(kept) = tape.output.as_deref_mut() {
                    kept[row * o..(row + 1) * o].copy_from_slice(&output.data[out_row..out_row + o]);
                }
                for (i, &m) in layer.state_sizes.iter().enumerate() {
                    if let Some(kept) = tape.states_before[i].as_deref_mut() {
                        let before = &mut kept[row * m..(row + 1) * m];
                        if s == 0 {
                            before.copy_from_slice(&job.h0[i][b * m..(b + 1) * m]);
                        } else {
                            let previous = (b, job.order.time(b, s - 1, job.reverse), 0);
                            copy_row(bufs, &frame, cell.next_states[i], previous, before)?;
                        }
                    }
                    if let Some(kept) = tape.states_after[i].as_deref_mut() {
                        copy_row(
                            bufs,
                            &frame,
                            cell.next_states[i],
                            (b, t, 0),
                            &mut kept[row * m..(row + 1) * m],
                        )?;
                    }
                }
                for &v in copied {
                    let len = plan.elements(v);
                    let mut tmp = vec![0.0; len];
                    copy_row(bufs, &frame, v, (b, t, 0), &mut tmp)?;
                    if let Some(dst) = tape.saved.get_mut(&v) {
                        dst[row * len..(row + 1) * len].copy_from_slice(&tmp);
                    }
                }
            }
            if s + 1 == len {
                for (i, &m) in layer.state_sizes.iter().enumerate() {
                    copy_row(
                        bufs,
                        &frame,
                        cell.next_states[i],
                        (b, t, 0),
                        &mut finals[i][b * m..(b + 1) * m],
                    )?;
                }
            }
        }
    }
    Ok(Some(finals))
}

/// The backward of an elementwise recurrence as one call walking each
/// sequence backwards through time, the carried adjoints chained like the
/// forward's states. Everything the stage computes is kept per row for
/// after the loop. Returns false when the layer is not of that shape.
fn backward_whole_sequence(
    threads: usize,
    code: &LayerCode,
    job: &BackwardJob,
    bufs: &mut Buffers,
    weights: &PreparedParams,
    rank_order: &[usize],
    carry: &mut [Vec<f32>],
) -> Result<bool> {
    // The schedule's decision: one stage that is the whole recurrence.
    let whole = code.backward.iter().find_map(|s| match s {
        ReadyStage::Pointwise { exec, whole_sequence: true, .. } => Some(exec),
        _ => None,
    });
    let Some(exec) = whole else { return Ok(false) };
    let (g, plan) = (&*code.bwd_graph, &*code.bwd_plan);
    let grad = &job.cell.backward;
    let layer = job.layer;
    let d_states: Vec<ValueId> = match grad.d_states.iter().copied().collect::<Option<Vec<_>>>() {
        Some(d) if d.iter().all(|v| exec.outputs().contains(v)) => d,
        _ => return Ok(false),
    };
    let layout_rows = job.layout_rows();
    for &v in exec.outputs() {
        bufs.row_buf(v, plan.elements(v), layout_rows);
    }
    let frame = Frame {
        d_output: Some((job.d_output, layer.output_size)),
        ..Frame::new(job.input, layer, job.params, weights)
    };
    let carried = |v: ValueId| match g.node(v).op {
        Op::Seed(k) if k > 0 => Some(k - 1),
        _ => None,
    };
    let k = exec.inputs().len() + exec.outputs().len();
    let order = job.order.order();
    let chunks = threads.clamp(1, order.len().max(1));
    let mut tables: Vec<Vec<*mut f32>> = vec![Vec::new(); chunks];
    for s in (0..job.order.steps()).rev() {
        for (r, &b) in job.order.active(s).iter().enumerate() {
            let t = job.order.time(b, s, job.reverse);
            let last = s + 1 == job.order.lengths()[b];
            let table = &mut tables[r % chunks];
            for &v in exec.inputs() {
                let p = match carried(v) {
                    Some(i) if last => {
                        let m = layer.state_sizes[i];
                        job.d_final[i][b * m..].as_ptr() as *mut f32
                    }
                    Some(i) => {
                        locate(bufs, &frame, d_states[i], b, job.order.time(b, s + 1, job.reverse), 0)?
                    }
                    None => locate(bufs, &frame, v, b, t, 0)?,
                };
                table.push(p);
            }
            for &v in exec.outputs() {
                table.push(locate(bufs, &frame, v, b, t, 0)?);
            }
        }
    }
    run_tables(exec.as_ref(), tables, k);
    // The adjoints of the initial states: the carry out of each sequence's first step.
    for (r, &b) in rank_order.iter().enumerate() {
        let t = job.order.time(b, 0, job.reverse);
        for (i, &m) in layer.state_sizes.iter().enumerate() {
            copy_row(bufs, &frame, d_states[i], (b, t, 0), &mut carry[i][r * m..(r + 1) * m])?;
        }
    }
    Ok(true)
}

/// Carried adjoint `i` as each row of a whole-sequence backward saw it:
/// the state adjoint its next step computed, or the final state's adjoint
/// at a sequence's last step.
fn seeds_per_row(job: &BackwardJob, bufs: &mut Buffers, i: usize, layout_rows: usize) -> Result<Vec<f32>> {
    let layer = job.layer;
    let m = layer.state_sizes[i];
    let mut data = pool::take_zeroed(layout_rows * m);
    let no_weights = PreparedParams::new(0);
    let frame = Frame::new(job.input, layer, job.params, &no_weights);
    for b in 0..job.order.batch() {
        let len = job.order.lengths()[b];
        for s in 0..len {
            let row = job.input.layout.row(b, job.order.time(b, s, job.reverse));
            let dst = &mut data[row * m..(row + 1) * m];
            if s + 1 == len {
                dst.copy_from_slice(&job.d_final[i][b * m..(b + 1) * m]);
            } else if let Some(d) = job.cell.backward.d_states[i] {
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
        // adjoints), valid for their values; tables write disjoint sequences.
        unsafe { exec.run(table.len() / k.max(1), table) }
    });
}

/// The first float of a tape part the backward reads as `v` (which the
/// program's tape keeps wherever its backward reads one).
fn kept(part: &Option<TapeBuf>, v: ValueId) -> Result<*const f32> {
    part.as_ref().map(|p| p.as_ptr()).ok_or_else(|| {
        RuntimeError::Internal(format!("the backward reads {v}, which the tape does not keep"))
    })
}

fn backward(
    threads: usize,
    code: &LayerCode,
    job: &BackwardJob,
    tape: &CpuTape,
    d_input: &mut RowsMut,
) -> Result<BackwardResult> {
    let (g, plan) = (&*code.bwd_graph, &*code.bwd_plan);
    let grad = &job.cell.backward;
    let layer = job.layer;
    let batch = job.order.batch();
    let layout_rows = job.layout_rows();
    let mut bufs = Buffers::new();
    constants(g, plan, &mut bufs);
    leaf_locations(g, layer, Side::Backward, &mut bufs);
    // Forward values the backward reads from memory: the tape's rows.
    for v in g.values() {
        let (data, len) = match layer.storage(Side::Backward, v, true) {
            Some(Storage::State(i)) => (kept(&tape.states_before[i], v)?, layer.state_sizes[i]),
            Some(Storage::NextState(i)) => (kept(&tape.states_after[i], v)?, layer.state_sizes[i]),
            Some(Storage::Output { .. }) => (kept(&tape.output, v)?, layer.output_size),
            Some(Storage::Saved) => match tape.saved.get(&v) {
                Some(data) => (data.as_ptr(), plan.elements(v)),
                None => return Err(RuntimeError::Internal(format!("{v} is saved but not in the tape"))),
            },
            _ => continue,
        };
        bufs.place(v, Loc::TapeRows(data as *mut f32), len);
    }
    // Storage for what the stages compute; per-step values that are needed
    // after the loop are also kept per row.
    let mut persisted: Vec<ValueId> = Vec::new();
    for st in &code.backward {
        for v in st.outputs() {
            match (layer.storage(Side::Backward, v, true), st.placement()) {
                (Some(Storage::Fixed), _) => {}
                (_, Placement::EachStep) => {
                    bufs.rank_buf(v, plan.elements(v), batch);
                    // Kept per row too when the work after the loop reads it
                    // (the program's `Steps` values, and the state adjoints).
                    if layer.read_after_loop(v) {
                        persisted.push(v);
                    }
                }
                _ => bufs.row_buf(v, plan.elements(v), layout_rows),
            }
        }
    }
    // Carried adjoints read after the loop (a weight gradient `d_h' ⊗ h`, a
    // parameter whose gradient is `d_h'` itself) are kept per row too.
    let seeds_after: Vec<(ValueId, usize)> = g
        .values()
        .filter_map(|v| match layer.storage(Side::Backward, v, true) {
            Some(Storage::CarriedAdjoint(i)) if layer.read_after_loop(v) => Some((v, i)),
            _ => None,
        })
        .collect();
    persisted.extend(seeds_after.iter().map(|&(v, _)| v));
    let mut kept: HashMap<ValueId, Vec<f32>> =
        persisted.iter().map(|&v| (v, pool::take(layout_rows * plan.elements(v)))).collect();

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
    let shape = shape_of(plan);
    let mut local = None;
    let weights =
        prepared_params(job.prepared, &mut local, g, &code.backward, job.params, &shape, job.order.rows());
    let d_out = Some((job.d_output, layer.output_size));
    // Before the loop: products that read no carried adjoint, over every valid row.
    let all_rows = valid_rows(job.order);
    {
        let frame = Frame { d_output: d_out, ..Frame::new(job.input, layer, job.params, weights) };
        let mut none = HashMap::new();
        let all = AllRows { order: job.order, rows: &all_rows, shape: &shape, threads };
        run_all_rows(&code.backward, Placement::BeforeLoop, &mut bufs, &frame, &all, &mut none)?;
    }
    let whole = backward_whole_sequence(threads, code, job, &mut bufs, weights, order, &mut carry)?;
    if whole {
        // The kernel kept every value per row; the carried adjoints are
        // the next row's state adjoints, or the final ones.
        kept.clear();
        for &(v, i) in &seeds_after {
            kept.insert(v, seeds_per_row(job, &mut bufs, i, layout_rows)?);
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
            ..Frame::new(job.input, layer, job.params, weights)
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
                        match grad.d_states[i] {
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
            bufs: &bufs,
            frame: &frame,
            shape: &shape,
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
    let frame =
        Frame { carry: &carry_rows, d_output: d_out, ..Frame::new(job.input, layer, job.params, weights) };
    let mut matrices: HashMap<ValueId, Vec<f32>> = HashMap::new();
    let all = AllRows { order: job.order, rows: &all_rows, shape: &shape, threads };
    run_all_rows(&code.backward, Placement::AfterLoop, &mut bufs, &frame, &all, &mut matrices)?;
    // Parameter gradients: accumulated products, or per-row values summed over rows.
    let mut d_params = Vec::with_capacity(job.params.len());
    for (i, d) in grad.d_params.iter().enumerate() {
        let len = job.params[i].len();
        let Some(v) = d else {
            d_params.push(vec![0.0; len]);
            continue;
        };
        if let Some(m) = matrices.get(v) {
            d_params.push(m.clone());
            continue;
        }
        let rows: Vec<*const f32> = all_rows
            .iter()
            .map(|&(b, t, _)| locate(&bufs, &frame, *v, b, t, 0).map(|p| p as *const f32))
            .collect::<Result<_>>()?;
        let mut acc = vec![0.0f32; len];
        // SAFETY: each pointer is a located row of `len` floats of v.
        unsafe { sum_rows(&rows, &mut acc, threads) };
        d_params.push(acc);
    }
    for (d, &(o, l)) in grad.d_inputs.iter().zip(&layer.input_slices) {
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
    Ok(BackwardResult { d_h0, d_params })
}

/// Every valid row of a batch, for the stages run before or after the loop.
struct AllRows<'a> {
    order: &'a crate::sequence::BatchOrder,
    /// `(b, t, 0)` for every valid row.
    rows: &'a [(usize, usize, usize)],
    shape: &'a dyn Fn(ValueId) -> (usize, usize),
    threads: usize,
}

/// Runs the steps placed at `placement` (before or after the loop) over
/// every valid row: products as GEMMs over all rows (weight gradients
/// summed into `matrices`), kernels over every row.
fn run_all_rows(
    steps: &[ReadyStage],
    placement: Placement,
    bufs: &mut Buffers,
    frame: &Frame,
    all: &AllRows,
    matrices: &mut HashMap<ValueId, Vec<f32>>,
) -> Result<()> {
    for st in steps.iter().filter(|s| s.placement() == placement) {
        match st {
            ReadyStage::Gemm { products, .. } => {
                gemm_all_rows(products, bufs, frame, all.order, matrices, all.shape, all.threads)?
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
