//! Drives one layer and direction over a batch on the CPU: the schedule's
//! stages as GEMMs (the `gemm` crate) and pointwise kernels behind
//! [`StageExec`], with every row found through pointers.
//!
//! Where values live:
//! - hoisted values (before the loop), values kept for the backward, and
//!   backward values needed after the loop: one row per `(sequence, step)`
//!   at the caller's row layout (`RowBuf`);
//! - per-step values and states: one row per sequence in *rank* order
//!   (longest first), so the active sequences of a step are a contiguous
//!   prefix and a per-step GEMM is one call on `n` rows (`RankBuf`).

use super::gemm::{matmul, matmul_split, View};
use super::prepared::{transpose, AlignedBuf, PackedMatrix};
use super::stage::StageExec;
use crate::backend::Rows;
use crate::error::{Result, RuntimeError};
use crate::sequence::{BatchOrder, RowLayout};
use cellc::interp::Shapes;
use cellc::ir::{Graph, Op, ValueId};
use cellc::schedule::{Placement, Stage, StageKind};
use std::collections::HashMap;
use std::sync::Arc;

/// A schedule stage ready to run.
pub enum ReadyStage {
    /// Products sharing an operand; each `(out, op, matrix, vector)` or, for
    /// `outer`, `(out, Outer, left, right)`.
    Gemm {
        placement: Placement,
        products: Vec<(ValueId, Op, ValueId, ValueId)>,
    },
    Pointwise {
        placement: Placement,
        exec: Arc<dyn StageExec>,
    },
    /// Vector parameters' gradients, summed over rows as the results are read.
    Sum,
    /// Weight-gradient matrices added once after the loop: `(out, a, b)`.
    AddMatrices {
        sums: Vec<(ValueId, ValueId, ValueId)>,
    },
}

impl ReadyStage {
    /// The values this step writes.
    pub fn outputs(&self) -> Vec<ValueId> {
        match self {
            ReadyStage::Gemm { products, .. } => products.iter().map(|p| p.0).collect(),
            ReadyStage::Pointwise { exec, .. } => exec.outputs().to_vec(),
            ReadyStage::Sum | ReadyStage::AddMatrices { .. } => Vec::new(),
        }
    }

    pub fn placement(&self) -> Placement {
        match self {
            ReadyStage::Gemm { placement, .. } | ReadyStage::Pointwise { placement, .. } => *placement,
            ReadyStage::Sum | ReadyStage::AddMatrices { .. } => Placement::AfterLoop,
        }
    }
}

/// Builds the kernel of a stage, given its index in the schedule.
pub type StageBuilder<'a> = dyn FnMut(usize, &Stage) -> Result<Arc<dyn StageExec>> + 'a;

/// Turns schedule stages into steps; `pointwise` builds each kernel.
pub fn ready_stages(
    graph: &Graph,
    stages: &[Stage],
    pointwise: &mut StageBuilder,
) -> Result<Vec<ReadyStage>> {
    stages
        .iter()
        .enumerate()
        .map(|(index, st)| {
            Ok(match st.kind {
                StageKind::Gemm => ReadyStage::Gemm {
                    placement: st.placement,
                    products: st
                        .values
                        .iter()
                        .map(|&v| {
                            let ops = graph.operands(v);
                            (v, graph.node(v).op.clone(), ops[0], ops[1])
                        })
                        .collect(),
                },
                StageKind::Pointwise { .. } | StageKind::WholeSequence { .. } => {
                    ReadyStage::Pointwise { placement: st.placement, exec: pointwise(index, st)? }
                }
                StageKind::SumOverSteps => ReadyStage::Sum,
                StageKind::AddMatrices => ReadyStage::AddMatrices {
                    sums: st
                        .values
                        .iter()
                        .map(|&v| match (&graph.node(v).op, &graph.operands(v)[..]) {
                            (Op::Binary(cellc::ir::BinaryOp::Add), &[a, b]) => Ok((v, a, b)),
                            (op, _) => {
                                Err(RuntimeError::Internal(format!("{v}: {op:?} in a matrix sum stage")))
                            }
                        })
                        .collect::<Result<_>>()?,
                },
            })
        })
        .collect()
}

/// Where a value is found for row `(b, t)` with rank `r`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    /// Features `[offset, offset + len)` of the layer input's row.
    Input(usize),
    /// The current state `i`, rank-ordered.
    State(usize),
    Param(usize),
    /// This direction's output adjoint (backward).
    DOutput,
    /// The carried adjoint of state `i`, rank-ordered (backward).
    Carry(usize),
    /// A computed constant.
    Const,
    /// One row per `(b, t)` at the layer's row layout.
    RowBuf,
    /// One row per sequence, rank-ordered.
    RankBuf,
    /// One row per `(b, t)` at the layer's row layout, in a buffer owned
    /// elsewhere (the forward's tape) that outlives the run and is only read.
    Borrowed(*const f32),
}

/// One value's storage.
#[derive(Default)]
struct Slot {
    loc: Option<Loc>,
    /// Floats per row.
    len: usize,
    data: Vec<f32>,
}

/// Value buffers of one run, indexed by value (a lookup is an array index:
/// the driver resolves several pointers per row and step). Row and rank
/// buffers come from the [`super::pool`] unzeroed: every row a stage reads
/// was written by an earlier stage, step or run.
#[derive(Default)]
pub struct Buffers {
    slots: Vec<Slot>,
}

impl Drop for Buffers {
    fn drop(&mut self) {
        for s in &mut self.slots {
            super::pool::give(std::mem::take(&mut s.data));
        }
    }
}

impl Buffers {
    pub fn new() -> Buffers {
        Buffers::default()
    }

    fn slot(&mut self, v: ValueId) -> &mut Slot {
        if self.slots.len() <= v.index() {
            self.slots.resize_with(v.index() + 1, Slot::default);
        }
        &mut self.slots[v.index()]
    }

    /// Where `v` lives, if it has storage.
    pub fn loc(&self, v: ValueId) -> Option<Loc> {
        self.slots.get(v.index()).and_then(|s| s.loc)
    }

    /// Floats per row of `v` (0 without storage).
    pub fn len(&self, v: ValueId) -> usize {
        self.slots.get(v.index()).map_or(0, |s| s.len)
    }

    /// Places `v` somewhere that needs no buffer of its own.
    pub fn place(&mut self, v: ValueId, loc: Loc, len: usize) {
        let s = self.slot(v);
        s.loc = Some(loc);
        s.len = len;
    }

    /// A layout-row buffer for `v` (kept if it already has one).
    pub fn row_buf(&mut self, v: ValueId, len: usize, rows: usize) {
        let s = self.slot(v);
        if s.loc != Some(Loc::RowBuf) || s.len != len {
            super::pool::give(std::mem::replace(&mut s.data, super::pool::take(rows * len)));
        }
        s.loc = Some(Loc::RowBuf);
        s.len = len;
    }

    /// Layout rows of `v` in `data`, which becomes its storage.
    pub fn row_data(&mut self, v: ValueId, data: Vec<f32>) {
        let s = self.slot(v);
        s.loc = Some(Loc::RowBuf);
        super::pool::give(std::mem::replace(&mut s.data, data));
    }

    /// A rank-ordered buffer for `v`, unless `v` already lives elsewhere.
    pub fn rank_buf(&mut self, v: ValueId, len: usize, batch: usize) {
        let s = self.slot(v);
        if s.loc.is_none() {
            s.loc = Some(Loc::RankBuf);
            super::pool::give(std::mem::replace(&mut s.data, super::pool::take(batch * len)));
        }
        s.len = len;
    }

    /// Moves `v`'s buffer out (its storage is gone afterwards).
    pub fn take_data(&mut self, v: ValueId) -> Vec<f32> {
        let s = self.slot(v);
        s.loc = None;
        std::mem::take(&mut s.data)
    }

    pub fn constant(&mut self, v: ValueId, value: Vec<f32>) {
        let s = self.slot(v);
        s.loc = Some(Loc::Const);
        s.len = value.len();
        s.data = value;
    }
}

/// Everything a pointer lookup needs for one step.
pub struct Frame<'a> {
    pub input: Rows<'a>,
    pub input_slices: &'a [(usize, usize)],
    pub params: &'a [Vec<f32>],
    /// Matrix parameters prepared for the products that read them.
    pub prepared: &'a HashMap<usize, PackedMatrix>,
    pub states: &'a [Vec<f32>],
    pub state_sizes: &'a [usize],
    pub carry: &'a [Vec<f32>],
    pub d_output: Option<(Rows<'a>, usize)>,
    pub layout: &'a RowLayout,
}

/// The pointer to value `v` for `(b, t)` at rank `r`. Inputs are only read.
pub fn locate(bufs: &mut Buffers, f: &Frame, v: ValueId, b: usize, t: usize, r: usize) -> Result<*mut f32> {
    let missing = || RuntimeError::Internal(format!("cpu backend: no storage for {v}"));
    let slot = bufs.slots.get_mut(v.index()).ok_or_else(missing)?;
    let len = slot.len;
    Ok(match slot.loc.ok_or_else(missing)? {
        Loc::Input(i) => {
            let (o, l) = f.input_slices[i];
            f.input.get(b, t, o + l)[o..].as_ptr() as *mut f32
        }
        Loc::State(i) => f.states[i][r * f.state_sizes[i]..].as_ptr() as *mut f32,
        Loc::Param(i) => f.params[i].as_ptr() as *mut f32,
        Loc::Carry(i) => f.carry[i][r * f.state_sizes[i]..].as_ptr() as *mut f32,
        Loc::DOutput => {
            let (rows, n) = f.d_output.ok_or_else(missing)?;
            rows.get(b, t, n).as_ptr() as *mut f32
        }
        Loc::Const => slot.data.as_mut_ptr(),
        Loc::RowBuf => slot.data[f.layout.row(b, t) * len..].as_mut_ptr(),
        Loc::RankBuf => slot.data[r * len..].as_mut_ptr(),
        // SAFETY: the owner holds a row of `len` floats for every (b, t) of the layout.
        Loc::Borrowed(p) => unsafe { p.add(f.layout.row(b, t) * len) as *mut f32 },
    })
}

/// Constants (and values of constants only) as tiny buffers.
pub fn constants(graph: &Graph, plan: &Shapes, bufs: &mut Buffers) {
    for (v, value) in plan.constant_values(graph) {
        bufs.constant(v, value);
    }
}

/// Runs a pointwise kernel over `rows`: `(b, t, rank)` per row.
pub fn run_pointwise(
    exec: &dyn StageExec,
    bufs: &mut Buffers,
    f: &Frame,
    rows: &[(usize, usize, usize)],
    threads: usize,
) -> Result<()> {
    let k = exec.inputs().len() + exec.outputs().len();
    let mut table: Vec<*mut f32> = Vec::with_capacity(rows.len() * k);
    for &(b, t, r) in rows {
        for &v in exec.inputs().iter().chain(exec.outputs()) {
            table.push(locate(bufs, f, v, b, t, r)?);
        }
    }
    let chunks = if threads > 1 && rows.len() >= 8 { threads.min(rows.len()) } else { 1 };
    if chunks == 1 {
        // SAFETY: every pointer comes from `locate`, valid for its value's
        // length; outputs are distinct buffers from the inputs.
        unsafe { exec.run(rows.len(), &table) };
        return Ok(());
    }
    let per = rows.len().div_ceil(chunks);
    let table = PtrTable(&table);
    rayon::scope(|s| {
        for c in 0..chunks {
            let lo = c * per;
            let hi = ((c + 1) * per).min(rows.len());
            if lo >= hi {
                continue;
            }
            let table = &table;
            s.spawn(move |_| {
                // SAFETY: as above; chunks cover disjoint rows, so disjoint outputs.
                unsafe { exec.run(hi - lo, &table.0[lo * k..hi * k]) }
            });
        }
    });
    Ok(())
}

/// A pointer table shared by the threads that each run a disjoint part of it.
struct PtrTable<'a>(&'a [*mut f32]);
// SAFETY: the rows given to different threads write disjoint memory.
unsafe impl Sync for PtrTable<'_> {}

/// Contiguous or evenly strided runs of rows, so one GEMM covers a run:
/// `(b, t)` of the run's first row, its length, and the layout-row step.
pub fn runs(order: &BatchOrder, layout: &RowLayout) -> Vec<(usize, usize, usize, usize)> {
    match layout {
        RowLayout::Padded { .. } => (0..order.batch())
            .map(|b| {
                let first = layout.row(b, 0);
                let step = if order.lengths()[b] > 1 { layout.row(b, 1) - first } else { 1 };
                (b, 0, order.lengths()[b], step)
            })
            .collect(),
        // Packed rows are all valid and contiguous: one run.
        RowLayout::Packed { .. } => vec![(order.order()[0], 0, order.rows(), 1)],
    }
}

/// Runs GEMM products over every valid row (before or after the loop).
/// `MatVec`: `Y = X · Wᵀ`; `MatVecT`: `Y = D · W`; `Outer`: `dW += Dᵀ · X`
/// summed over rows. The runs are shared out between `threads` tasks;
/// weight gradients are summed per task and the partial sums added in task
/// order, so results are the same run to run for a given thread count.
pub fn gemm_all_rows(
    products: &[(ValueId, Op, ValueId, ValueId)],
    bufs: &mut Buffers,
    f: &Frame,
    order: &BatchOrder,
    matrices: &mut HashMap<ValueId, Vec<f32>>,
    shape: &dyn Fn(ValueId) -> (usize, usize),
    threads: usize,
) -> Result<()> {
    let runs = runs(order, f.layout);
    let tasks = threads.clamp(1, runs.len().max(1));
    for &(out, ref op, m, x) in products {
        // (dst, a, b) per run, gathered first: `locate` needs the buffers.
        let mut jobs: Vec<(View, View, View)> = Vec::with_capacity(runs.len());
        for &(b0, t0, count, step) in &runs {
            match op {
                Op::MatVec | Op::MatVecT => {
                    let (rows_w, cols_w) = shape(m);
                    let w = locate(bufs, f, m, b0, t0, 0)?;
                    let xin = locate(bufs, f, x, b0, t0, 0)?;
                    let (xstride, ystride) = (row_stride(bufs, f, x, step), row_stride(bufs, f, out, step));
                    let y = locate(bufs, f, out, b0, t0, 0)?;
                    let (wv, k, n) = if *op == Op::MatVec {
                        (weight_t(bufs, f, m, rows_w, cols_w)?, cols_w, rows_w)
                    } else {
                        (View::rows(w, rows_w, cols_w, cols_w), rows_w, cols_w)
                    };
                    jobs.push((View::rows(y, count, n, ystride), View::rows(xin, count, k, xstride), wv));
                }
                Op::Outer => {
                    let (rows_d, cols_d) = shape(out);
                    let d = locate(bufs, f, m, b0, t0, 0)?;
                    let xin = locate(bufs, f, x, b0, t0, 0)?;
                    let (dstride, xstride) = (row_stride(bufs, f, m, step), row_stride(bufs, f, x, step));
                    let acc = View::rows(std::ptr::null(), rows_d, cols_d, cols_d);
                    jobs.push((
                        acc,
                        View::rows(d, count, rows_d, dstride).t(),
                        View::rows(xin, count, cols_d, xstride),
                    ));
                }
                other => return Err(RuntimeError::Internal(format!("{other:?} in a GEMM stage"))),
            }
        }
        if jobs.len() < threads {
            // Fewer runs than cores (one long sequence): split each product
            // by output columns instead; runs still add up in order.
            if *op == Op::Outer {
                let (rows_d, cols_d) = shape(out);
                let acc = matrices.entry(out).or_insert_with(|| vec![0.0; rows_d * cols_d]);
                for &(_, a, b) in &jobs {
                    // SAFETY: acc is [rows_d, cols_d]; a and b describe the run's rows.
                    unsafe {
                        matmul_split(
                            View::rows(acc.as_mut_ptr(), rows_d, cols_d, cols_d),
                            a,
                            b,
                            true,
                            threads,
                        )
                    };
                }
            } else {
                for &(dst, a, b) in &jobs {
                    // SAFETY: every view was located for its run.
                    unsafe { matmul_split(dst, a, b, false, threads) };
                }
            }
            continue;
        }
        let per = jobs.len().div_ceil(tasks).max(1);
        if *op == Op::Outer {
            let (rows_d, cols_d) = shape(out);
            let mut partials: Vec<Vec<f32>> =
                (0..tasks).map(|_| super::pool::take_zeroed(rows_d * cols_d)).collect();
            rayon::scope(|sc| {
                for (chunk, part) in jobs.chunks(per).zip(partials.iter_mut()) {
                    sc.spawn(move |_| {
                        for &(_, a, b) in chunk {
                            // SAFETY: each task accumulates into its own partial
                            // [rows_d, cols_d]; a and b describe the run's rows.
                            unsafe {
                                matmul(View::rows(part.as_mut_ptr(), rows_d, cols_d, cols_d), a, b, true)
                            };
                        }
                    });
                }
            });
            let acc = matrices.entry(out).or_insert_with(|| vec![0.0; rows_d * cols_d]);
            for part in partials {
                acc.iter_mut().zip(&part).for_each(|(a, p)| *a += p);
                super::pool::give(part);
            }
        } else {
            rayon::scope(|sc| {
                for chunk in jobs.chunks(per) {
                    sc.spawn(move |_| {
                        for &(dst, a, b) in chunk {
                            // SAFETY: runs write disjoint rows of the output;
                            // every view was located for its run.
                            unsafe { matmul(dst, a, b, false) };
                        }
                    });
                }
            });
        }
    }
    Ok(())
}

/// Floats between consecutive rows of a run, for a value's storage: 0
/// for a parameter or a constant, the same for every row.
fn row_stride(bufs: &Buffers, f: &Frame, v: ValueId, step: usize) -> usize {
    match bufs.loc(v) {
        Some(Loc::Input(_)) => step * f.input.width,
        Some(Loc::DOutput) => step * f.d_output.map_or(0, |(r, _)| r.width),
        Some(Loc::Param(_) | Loc::Const) => 0,
        _ => step * bufs.len(v),
    }
}

/// `Wᵀ` as a row-major `[cols, rows]` view: the transposed copy if the
/// parameter has one, else a strided view of `W`.
fn weight_t(bufs: &mut Buffers, f: &Frame, m: ValueId, rows_w: usize, cols_w: usize) -> Result<View> {
    if let Some(Loc::Param(i)) = bufs.loc(m) {
        if let Some(p) = f.prepared.get(&i).filter(|p| p.transposed) {
            return Ok(View::rows(p.data.as_ptr(), cols_w, rows_w, rows_w));
        }
    }
    let w = locate(bufs, f, m, 0, 0, 0)?;
    Ok(View::rows(w, rows_w, cols_w, cols_w).t())
}

/// The matrix parameters that products read, prepared once per call
/// (see [`super::prepared`]):
/// - per-step products read a copy of `W` (transposed for a `matvec`
///   through `gemm`, as is for the GEMV paths and `D · W`), in huge-page
///   aligned memory: the same bytes are streamed every step;
/// - hoisted `matvec`s over several sequences read a transposed copy:
///   `gemm` packs its right operand on every call, and packing a strided
///   transposed view of `W` is a cache-hostile gather (for one sequence, a
///   single packing of the view costs what the transpose would).
pub fn prepare_params(
    graph: &Graph,
    steps: &[ReadyStage],
    params: &[Vec<f32>],
    shape: &dyn Fn(ValueId) -> (usize, usize),
    batch: usize,
) -> HashMap<usize, PackedMatrix> {
    let mut out = HashMap::new();
    for st in steps {
        let ReadyStage::Gemm { products, placement } = st else { continue };
        let per_step = *placement == Placement::EachStep;
        for &(_, ref op, m, _) in products {
            let Op::Param(i) = graph.node(m).op else { continue };
            if out.contains_key(&i) {
                continue;
            }
            let transposed = *op == Op::MatVec && (!per_step || batch > super::gemv::MAX_ROWS);
            let wanted = per_step || (*op == Op::MatVec && batch > 1);
            if !wanted || !matches!(op, Op::MatVec | Op::MatVecT) {
                continue;
            }
            let (r, c) = shape(m);
            let data = if transposed {
                AlignedBuf::copy_of(&transpose(&params[i], r, c))
            } else {
                AlignedBuf::copy_of(&params[i])
            };
            out.insert(i, PackedMatrix { data, transposed });
        }
    }
    out
}

/// A per-step GEMM on the first `n` ranks: `Y[0..n] = X[0..n] · Wᵀ` (or `· W`).
pub fn gemm_step(
    products: &[(ValueId, Op, ValueId, ValueId)],
    bufs: &mut Buffers,
    f: &Frame,
    n: usize,
    shape: &dyn Fn(ValueId) -> (usize, usize),
    threads: usize,
) -> Result<()> {
    for &(out, ref op, m, x) in products {
        let (rows_w, cols_w) = shape(m);
        // W as is: its prepared copy if there is one.
        let w = match bufs.loc(m) {
            Some(Loc::Param(i)) => match f.prepared.get(&i) {
                Some(p) if !p.transposed => p.data.as_ptr() as *mut f32,
                _ => locate(bufs, f, m, 0, 0, 0)?,
            },
            _ => locate(bufs, f, m, 0, 0, 0)?,
        };
        // The step's rows are the first `n` ranks of rank-ordered storage;
        // the schedule puts products of anything else before the loop.
        for v in [x, out] {
            if !matches!(bufs.loc(v), Some(Loc::RankBuf | Loc::State(_) | Loc::Carry(_))) {
                return Err(RuntimeError::Internal(format!(
                    "per-step product {out} reads or writes {v}, which is not held per rank ({:?})",
                    bufs.loc(v)
                )));
            }
        }
        let xin = locate(bufs, f, x, 0, 0, 0)?;
        let y = locate(bufs, f, out, 0, 0, 0)?;
        let (xlen, ylen) = (bufs.len(x), bufs.len(out));
        if matches!(op, Op::MatVec | Op::MatVecT) && n <= super::gemv::MAX_ROWS {
            // A few rows: stream W's rows directly (memory bound), split across cores.
            // SAFETY: rank buffers hold `batch >= n` rows of their length; W is [rows_w, cols_w].
            let (ys, xs, ws) = unsafe {
                (
                    std::slice::from_raw_parts_mut(y, n * ylen),
                    std::slice::from_raw_parts(xin, n * xlen),
                    std::slice::from_raw_parts(w, rows_w * cols_w),
                )
            };
            if *op == Op::MatVec {
                super::gemv::gemv(ys, xs, ws, n, rows_w, cols_w, threads);
            } else {
                // `D · W`: one axpy per row of W.
                super::gemv::gemv_adjoint(ys, xs, ws, n, rows_w, cols_w, threads);
            }
            continue;
        }
        let wv = match op {
            Op::MatVec => weight_t(bufs, f, m, rows_w, cols_w)?,
            Op::MatVecT => View::rows(w, rows_w, cols_w, cols_w),
            other => return Err(RuntimeError::Internal(format!("{other:?} in a per-step GEMM"))),
        };
        // Split the output columns across cores when the product is big enough to pay.
        let parts = if threads > 1 && ylen * xlen >= 64 * 64 { threads } else { 1 };
        // SAFETY: rank buffers and states hold `batch` rows of their length; n <= batch.
        unsafe {
            matmul_split(View::rows(y, n, ylen, ylen), View::rows(xin, n, xlen, xlen), wv, false, parts)
        };
    }
    Ok(())
}
