//! A layer's schedule stages ready to run on the CPU ([`ReadyStage`]), and
//! how each kind runs over rows: the products (through packed panels, or
//! `gemm` for weight gradients and computed matrices) and the pointwise
//! kernels ([`StageExec`], the kernels' ABI in [`super::stage`]), every row
//! found through [`super::buffers::locate`]. When each stage runs is the
//! pass's plan's decision.

use super::buffers::{locate, Buffers, Frame, Loc};
use super::gemm::{column_share, matmul, matmul_split, View};
use super::prepared::PreparedParams;
use super::stage::StageExec;
use super::threads;
use crate::error::{Result, RuntimeError};
use crate::pass::PreparedWeights;
use crate::plan::PassPlan;
use crate::sequence::{BatchOrder, RowLayout};
use cellc::ir::{Graph, Op, ValueId};
use cellc::precision::Precision;
use cellc::schedule::{Placement, Stage, StageKind};
use cellc::shapes::Shapes;
use std::collections::HashMap;
use std::sync::Arc;

/// A product as a GEMM stage holds it: `(out, op, matrix, vector)` or, for
/// `outer`, `(out, Outer, left, right)`.
pub type Product = (ValueId, Op, ValueId, ValueId);

/// Bytes of the distinct weights of `products`, packed at `precision`.
pub fn weight_bytes<'a>(
    products: impl Iterator<Item = &'a Product>,
    (shapes, precision): (&Shapes, Precision),
) -> usize {
    let mut weights: Vec<ValueId> = products.map(|p| p.2).collect();
    weights.sort();
    weights.dedup();
    let elements: usize = weights.iter().map(|&w| shapes.elements(w)).sum();
    elements * super::product::packed_bytes(precision)
}

/// Bytes of the weights a pass's per-step products read at every step,
/// packed at `precision` (`stages` and `shapes` of the pass's side).
pub fn step_weight_bytes(
    pass: &PassPlan,
    stages: &[ReadyStage],
    (shapes, precision): (&Shapes, Precision),
) -> usize {
    let each_step = pass.stages_at(Placement::EachStep).iter().filter_map(|&k| match &stages[k] {
        ReadyStage::Gemm { products } => Some(products),
        _ => None,
    });
    weight_bytes(each_step.flatten(), (shapes, precision))
}

/// A schedule stage ready to run. When it runs (before, in or after the
/// time loop, and whether the loop is one whole-sequence kernel) is the
/// pass's plan's decision ([`crate::plan::PassPlan`]).
pub enum ReadyStage {
    /// Products sharing an operand.
    Gemm { products: Vec<Product> },
    /// A generated kernel: a pointwise stage, or a whole recurrence.
    Pointwise { exec: Arc<dyn StageExec> },
    /// Vector parameters' gradients, summed over rows as the results are read.
    Sum,
    /// Weight-gradient matrices added once after the loop: `(out, a, b)`.
    AddMatrices { sums: Vec<(ValueId, ValueId, ValueId)> },
}

impl ReadyStage {
    /// The values this step writes.
    pub fn outputs(&self) -> Vec<ValueId> {
        match self {
            ReadyStage::Gemm { products } => products.iter().map(|p| p.0).collect(),
            ReadyStage::Pointwise { exec } => exec.outputs().to_vec(),
            ReadyStage::Sum | ReadyStage::AddMatrices { .. } => Vec::new(),
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
                    ReadyStage::Pointwise { exec: pointwise(index, st)? }
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
    let table = SendTable(table);
    threads::for_each(chunks, &|c| {
        let (lo, hi) = (c * per, ((c + 1) * per).min(rows.len()));
        if lo < hi {
            // SAFETY: as above; chunks cover disjoint rows, so disjoint outputs.
            unsafe { exec.run(hi - lo, &table.get()[lo * k..hi * k]) }
        }
    });
    Ok(())
}

/// One run's (or one piece of a run's) and head's share of a weight
/// gradient: the float offset of its head's block in the gradient, `Dᵀ`
/// and `X`.
type OuterJob = (usize, View, View);

/// Pointers each handed to one thread (or read by all), which write disjoint memory.
pub struct SendTable(pub Vec<*mut f32>);
// SAFETY: per the type's contract.
unsafe impl Send for SendTable {}
unsafe impl Sync for SendTable {}

impl SendTable {
    /// The pointers (a method, so that a closure captures the whole table, which is `Sync`).
    pub fn get(&self) -> &[*mut f32] {
        &self.0
    }
}

/// Contiguous or evenly strided runs of rows, so one GEMM covers a run:
/// `(b, t)` of the run's first row, its length, and the layout-row step.
pub fn runs(order: &BatchOrder, layout: &RowLayout) -> Vec<(usize, usize, usize, usize)> {
    match layout {
        // Packed rows are all valid and contiguous: one run, from the
        // sequence (or segment) whose first step is row 0.
        RowLayout::Packed { .. } => vec![(order.order()[0], 0, order.rows(), 1)],
        RowLayout::Segments { within, .. } if matches!(**within, RowLayout::Packed { .. }) => {
            let first = (0..order.batch()).find(|&j| layout.row(j, 0) == 0).unwrap_or(0);
            vec![(first, 0, order.rows(), 1)]
        }
        // Segments of padded sequences: a product over rows does not see
        // where a sequence restarts, so one run per sequence of the
        // caller's, from its first segment, as for the padded batch.
        RowLayout::Segments { start, within } => {
            let mut lengths = vec![0; start.iter().map(|&(b, _)| b + 1).max().unwrap_or(0)];
            for (&(b, _), &len) in start.iter().zip(order.lengths()) {
                lengths[b] += len;
            }
            let strided = |b: usize| if lengths[b] > 1 { within.row(b, 1) - within.row(b, 0) } else { 1 };
            (start.iter().enumerate())
                .filter(|(_, &(_, first))| first == 0)
                .map(|(j, &(b, _))| (j, 0, lengths[b], strided(b)))
                .collect()
        }
        // A full grid (every sequence as long as the padding, none
        // shifted): its rows are all valid and contiguous, one run from row
        // 0 (sequence 0's first step, in either major), so the weight
        // gradients are one long product instead of one per sequence.
        RowLayout::Padded { steps, shift, .. }
            if order.lengths().iter().all(|l| l == steps) && shift.iter().all(|&s| s == 0) =>
        {
            vec![(0, 0, order.batch() * steps, 1)]
        }
        // Padded rows: one evenly strided run per sequence.
        RowLayout::Padded { .. } => (0..order.batch())
            .map(|b| {
                let first = layout.row(b, 0);
                let step = if order.lengths()[b] > 1 { layout.row(b, 1) - first } else { 1 };
                (b, 0, order.lengths()[b], step)
            })
            .collect(),
    }
}

/// Runs GEMM products over every valid row (before or after the loop).
/// `MatVec`: `Y = X · Wᵀ`; `MatVecT`: `Y = D · W`; `Outer`: `dW += Dᵀ · X`
/// summed over rows. The runs (a long one cut into pieces,
/// [`pieces_per_run`]) are shared out between `threads` tasks;
/// weight gradients are summed per task and the partial sums added in task
/// order, so results are the same run to run for a given thread count.
pub fn gemm_all_rows(
    products: &[Product],
    bufs: &mut Buffers,
    f: &Frame,
    order: &BatchOrder,
    matrices: &mut HashMap<ValueId, Vec<f32>>,
    shapes: &Shapes,
    threads: usize,
) -> Result<()> {
    let runs = runs(order, f.layout);
    for &(out, ref op, m, x) in products {
        if let Op::MatVec | Op::MatVecT = op {
            let product = (out, op.clone(), m, x);
            let calls = runs
                .iter()
                .map(|&(b0, t0, count, step)| {
                    ProductCall::locate(&product, bufs, f, (b0, t0, 0), count, step, shapes)
                })
                .collect::<Result<Vec<_>>>()?;
            packed_all_rows(&calls, threads);
            continue;
        }
        if *op != Op::Outer {
            return Err(RuntimeError::Internal(format!("{op:?} in a GEMM stage")));
        }
        // `dW += Dᵀ · X`, per head: head h's block of dW (`[rows_d, cols_d]`,
        // `h * rows_d * cols_d` floats in) from its columns of D and X.
        let (heads, rows_d, cols_d) = shapes.block(out);
        let rows_all = heads * rows_d;
        let pieces = pieces_per_run(&runs, threads);
        // (block offset, dᵀ, x) per piece of a run and head, gathered first: `locate` needs the buffers.
        let mut jobs: Vec<OuterJob> = Vec::with_capacity(runs.len() * pieces * heads);
        for &(b0, t0, count, step) in &runs {
            let d = locate(bufs, f, m, b0, t0, 0)?;
            let xin = locate(bufs, f, x, b0, t0, 0)?;
            let (dstride, xstride) = (row_stride(bufs, f, m, step), row_stride(bufs, f, x, step));
            for piece in 0..pieces {
                let (from, to) = (count * piece / pieces, count * (piece + 1) / pieces);
                let (d, xin) = (d.wrapping_add(from * dstride), xin.wrapping_add(from * xstride));
                for h in 0..heads {
                    jobs.push((
                        h * rows_d * cols_d,
                        View::rows(d.wrapping_add(h * rows_d), to - from, rows_d, dstride).t(),
                        View::rows(xin.wrapping_add(h * cols_d), to - from, cols_d, xstride),
                    ));
                }
            }
        }
        let block = |base: *mut f32, at: usize| View::rows(base.wrapping_add(at), rows_d, cols_d, cols_d);
        let all_pieces = runs.len() * pieces;
        if all_pieces < threads {
            // Fewer runs than cores, too short to split by rows: split each
            // product by output columns instead; runs still add up in order.
            let acc = matrices.entry(out).or_insert_with(|| crate::pool::take_zeroed(rows_all * cols_d));
            for &(at, a, b) in &jobs {
                // SAFETY: acc is [rows_all, cols_d], the block at `at` is one
                // head's; a and b describe the run's rows of that head.
                unsafe { matmul_split(block(acc.as_mut_ptr(), at), a, b, true, threads) };
            }
            continue;
        }
        // Whole pieces per task (each one's heads together), in run order.
        let tasks = threads.clamp(1, all_pieces.max(1));
        let per = all_pieces.div_ceil(tasks).max(1) * heads;
        let chunks: Vec<&[OuterJob]> = jobs.chunks(per).collect();
        let mut partials: Vec<Vec<f32>> =
            (0..chunks.len()).map(|_| crate::pool::take_zeroed(rows_all * cols_d)).collect();
        let parts = SendTable(partials.iter_mut().map(|p| p.as_mut_ptr()).collect());
        threads::for_each(chunks.len(), &|c| {
            for &(at, a, b) in chunks[c] {
                // SAFETY: each task accumulates into its own partial
                // [rows_all, cols_d]; a and b describe the run's rows.
                unsafe { matmul(block(parts.get()[c], at), a, b, true) };
            }
        });
        let acc = matrices.entry(out).or_insert_with(|| crate::pool::take_zeroed(rows_all * cols_d));
        for part in partials {
            acc.iter_mut().zip(&part).for_each(|(a, p)| *a += p);
            crate::pool::give(part);
        }
    }
    Ok(())
}

/// Rows below which a run's share of a weight gradient is not worth its own
/// partial sum: a long run split by rows into pieces of at least this many
/// runs as fast as split by output columns or faster (given a thread's
/// narrow share of the columns, the gemm crate reads `Dᵀ` unpacked, a row
/// of `D` apart: `[1024, 256]` over 1600 rows, 2 threads, an Intel Xeon:
/// 1.35x faster by rows).
const ROWS_PER_PIECE: usize = 512;

/// Into how many pieces by rows each run of a weight gradient is split, so
/// that every thread sums its own rows: 1 where there are as many runs as
/// threads, or where pieces would be shorter than [`ROWS_PER_PIECE`] (the
/// product is then split by output columns instead).
fn pieces_per_run(runs: &[(usize, usize, usize, usize)], threads: usize) -> usize {
    if runs.is_empty() || runs.len() >= threads {
        return 1;
    }
    let pieces = threads.div_ceil(runs.len());
    let shortest = runs.iter().map(|r| r.2).min().unwrap_or(0);
    if shortest / pieces >= ROWS_PER_PIECE {
        pieces
    } else {
        1
    }
}

/// Rows below which a run of a product over rows is not cut into pieces
/// by rows, one a thread, but split by output columns: the row tile of
/// the microkernel, many times over, so that each piece still streams its
/// share of the weight's panels for many rows.
const PRODUCT_ROWS_PER_PIECE: usize = 256;

/// Products over runs of rows: runs shared out between `threads` tasks;
/// with fewer runs than threads, long runs (a full batch as one run of
/// every row) cut into pieces by rows, one a thread, and short ones (one
/// short sequence) split by columns. Each result row is computed alike
/// either way: the same bits.
fn packed_all_rows(calls: &[ProductCall], threads: usize) {
    let longest = calls.iter().map(ProductCall::rows).max().unwrap_or(0);
    let pieces: Vec<ProductCall> = match calls.len() < threads && longest / threads >= PRODUCT_ROWS_PER_PIECE
    {
        true => calls.iter().flat_map(|call| call.pieces(threads.div_ceil(calls.len()))).collect(),
        false => calls.to_vec(),
    };
    if pieces.len() >= threads || threads == 1 {
        let chunks: Vec<&[ProductCall]> = pieces.chunks(pieces.len().div_ceil(threads).max(1)).collect();
        threads::for_each(chunks.len(), &|c| {
            for call in chunks[c] {
                // SAFETY: runs write disjoint rows; each was located for its values.
                unsafe { call.run((0, 1)) };
            }
        });
        return;
    }
    for call in calls {
        threads::for_each(threads, &|part| {
            // SAFETY: as above; the parts write disjoint columns.
            unsafe { call.run((part, threads)) };
        });
    }
}

/// Floats between consecutive rows of a run, for a value's storage: 0
/// for a parameter or a constant, the same for every row.
fn row_stride(bufs: &Buffers, f: &Frame, v: ValueId, step: usize) -> usize {
    match bufs.loc(v) {
        Some(Loc::Input(_)) => step * f.input.width,
        Some(Loc::Mask(_)) => step * f.masks.map_or(0, |m| m.width),
        Some(Loc::DOutput) => step * f.d_output.map_or(0, |(r, _)| r.width),
        Some(Loc::Param(_) | Loc::Const) => 0,
        _ => step * bufs.len(v),
    }
}

/// `Wᵀ` as a row-major `[cols, rows]` view of a computed matrix (products
/// of parameters read their packed panels).
fn weight_t(bufs: &Buffers, f: &Frame, m: ValueId, rows_w: usize, cols_w: usize) -> Result<View> {
    let w = locate(bufs, f, m, 0, 0, 0)?;
    Ok(View::rows(w, rows_w, cols_w, cols_w).t())
}

/// This layer-direction's prepared weights for a pass over `rows` valid
/// rows whose products compute in `precision`, from the model's slot for
/// that precision (or, if another device's form is there, `local`), with
/// nothing made yet: [`pack_products`] makes what the pass's products read.
pub fn prepared_params<'a>(
    slot: &'a PreparedWeights,
    local: &'a mut Option<PreparedParams>,
    params: usize,
    (rows, precision): (usize, cellc::precision::Precision),
) -> &'a PreparedParams {
    if slot.is_for_one_pass()
        && rows <= super::in_place::ROWS
        && precision == cellc::precision::Precision::F32
    {
        // Weights for this pass alone, met by a few rows in all (a step
        // or two of a few sequences): packing them would cost more than
        // the products. Longer passes pack: read in place, `X · Wᵀ`
        // transposes the weight at every step (see `in_place`). bf16
        // products always read bf16 panels, so that a pass's results do not
        // depend on how many rows it has.
        return local.insert(PreparedParams::in_place());
    }
    match slot.get_or_init(precision, || PreparedParams::new(params, precision)) {
        Some(w) => w,
        None => local.insert(PreparedParams::new(params, precision)),
    }
}

/// Makes the forms of `weights` that the products of `steps` read, before
/// any thread needs them (see [`super::prepared`]): every product of a
/// parameter, per step or over all rows, reads it packed into panels (`Wᵀ`
/// for `X · Wᵀ`, `W` for `D · W`), but those a fused step reads in tile
/// order (`tiled`, packed already): a weight that comes with each call (a
/// framework's tensors) is packed on every call, and only in the forms
/// the pass reads.
pub fn pack_products(
    weights: &PreparedParams,
    (graph, steps, shapes): (&Graph, &[ReadyStage], &Shapes),
    params: &[&[f32]],
    tiled: Option<&super::prepared::TiledProducts>,
) {
    if weights.reads_in_place() {
        return;
    }
    for st in steps {
        let ReadyStage::Gemm { products, .. } = st else { continue };
        for &(out, ref op, m, _) in products {
            let Op::Param(i) = graph.node(m).op else { continue };
            match op {
                Op::MatVec if tiled.is_some_and(|t| t.panels_of(out).is_some()) => {}
                Op::MatVec => {
                    weights.t_panels(i, params[i], shapes.block(m));
                }
                Op::MatVecT => {
                    weights.panels(i, params[i], shapes.block(m));
                }
                _ => {}
            }
        }
    }
}

/// Which columns of a per-step product a thread computes.
#[derive(Clone, Debug)]
pub enum Columns {
    /// Share `part` of `parts` (the whole product with one part).
    Share((usize, usize)),
    /// These columns: whole panels of a packed weight, the last one
    /// perhaps partial ([`ProductCall::run_columns`]).
    Units(std::ops::Range<usize>),
}

/// A per-step product on ranks `rows`: `Y = X · Wᵀ` (or `X · W`), the
/// columns `columns` says.
/// `X` may be held at the layout's rows (`at_layout` gives each rank's
/// sequence and time) where the ranks' rows lie evenly spaced there
/// ([`super::team::Team::products_read_evenly`]).
pub fn product_rows(
    product: &Product,
    (bufs, f): (&Buffers, &Frame),
    (rows, at_layout): (std::ops::Range<usize>, &dyn Fn(usize) -> (usize, usize)),
    columns: Columns,
    shapes: &Shapes,
) -> Result<()> {
    // The step's rows are ranks of rank-ordered storage; the schedule puts
    // products of anything else before the loop.
    let &(out, _, _, x) = product;
    let in_layout = bufs.loc(x) == Some(Loc::RowBuf);
    let readable = |v: ValueId| match bufs.loc(v) {
        Some(Loc::RankBuf | Loc::State(_) | Loc::NextState(_) | Loc::Carry(_)) => true,
        _ => v == x && in_layout,
    };
    for v in [x, out] {
        if !readable(v) {
            return Err(RuntimeError::Internal(format!(
                "per-step product {out} reads or writes {v}, which is not held per rank ({:?})",
                bufs.loc(v)
            )));
        }
    }
    if rows.is_empty() {
        return Ok(());
    }
    let mut call = ProductCall::locate(product, bufs, f, (0, 0, rows.start), rows.len(), 1, shapes)?;
    if in_layout {
        let row = |r: usize| {
            let (b, t) = at_layout(r);
            (f.layout.row(b, t), locate(bufs, f, x, b, t, r))
        };
        let (first, a) = row(rows.start);
        let stride = if rows.len() > 1 { row(rows.start + 1).0 - first } else { 0 };
        call.rows.a = a?;
        call.rows.lda = stride * bufs.len(x);
    }
    // SAFETY: rank buffers hold a row of their length for every rank, so
    // `rows` of y exist; x's rows, where held at the layout, lie `lda`
    // apart (the placement checked that they do at every step).
    unsafe {
        match columns {
            Columns::Share(share) => call.run(share),
            Columns::Units(units) => call.run_columns(units)?,
        }
    };
    Ok(())
}

/// The right operand of a product: a parameter packed into panels, or a
/// computed matrix read in place by `gemm`.
#[derive(Clone, Copy, Debug)]
pub enum RightOperand {
    /// Owned by the run's [`PreparedParams`]: one panel set per head, in order.
    Packed(*const super::panels::PackedB),
    /// `[k, n]`.
    Matrix(View),
    /// A parameter `W: [n, k]` read in place as `Wᵀ` ([`super::in_place`]).
    InPlaceT { w: *const f32, n: usize, k: usize },
    /// A parameter `W: [k, n]` read in place.
    InPlace { w: *const f32, k: usize, n: usize },
}

impl RightOperand {
    /// Head `h`'s operand, the weight's heads `step` floats apart.
    fn head(self, h: usize, step: usize) -> RightOperand {
        match self {
            // The panel sets of a parameter's heads are consecutive.
            RightOperand::Packed(p) => RightOperand::Packed(p.wrapping_add(h)),
            RightOperand::Matrix(v) => RightOperand::Matrix(View { ptr: v.ptr.wrapping_add(h * step), ..v }),
            RightOperand::InPlaceT { w, n, k } => {
                RightOperand::InPlaceT { w: w.wrapping_add(h * step), n, k }
            }
            RightOperand::InPlace { w, k, n } => RightOperand::InPlace { w: w.wrapping_add(h * step), k, n },
        }
    }
}

/// Where a block-diagonal product's heads lie: head `h` reads `a` from
/// `h * a` floats into a row of the left operand, writes `y` from `h * y`
/// into a row of the result, and takes the weight's block `h * w` floats in.
#[derive(Clone, Copy, Debug)]
struct Heads {
    count: usize,
    a: usize,
    y: usize,
    w: usize,
}

/// One product `Y = X · Wᵀ` (or `X · W`) located on `m` consecutive rows of
/// its left operand and result: what a per-step product and a stream's
/// step call. A block-diagonal `W` runs as one product per head, each on
/// its columns of `X` and `Y`, in the same call.
#[derive(Clone, Copy, Debug)]
pub struct ProductCall {
    /// Head 0's rows.
    rows: super::panels::Rows,
    /// Head 0's right operand.
    right: RightOperand,
    heads: Heads,
}

// SAFETY: a description of memory; [`ProductCall::run`] states what must
// hold, and threads that share calls write disjoint rows or columns.
unsafe impl Send for ProductCall {}
unsafe impl Sync for ProductCall {}

impl ProductCall {
    /// Locates `(out, op, matrix, x)` on `count` rows from `(b, t, r)`,
    /// consecutive rows `step` rows of each value's storage apart.
    pub fn locate(
        &(out, ref op, m, x): &Product,
        bufs: &Buffers,
        f: &Frame,
        (b, t, r): (usize, usize, usize),
        count: usize,
        step: usize,
        shapes: &Shapes,
    ) -> Result<ProductCall> {
        // One head's block: `[rows_w, cols_w]`.
        let block = shapes.block(m);
        let (heads, rows_w, cols_w) = block;
        let rows = super::panels::Rows {
            y: locate(bufs, f, out, b, t, r)?,
            ldy: row_stride(bufs, f, out, step),
            a: locate(bufs, f, x, b, t, r)?,
            lda: row_stride(bufs, f, x, step),
            m: count,
        };
        let (a, y) = if *op == Op::MatVec { (cols_w, rows_w) } else { (rows_w, cols_w) };
        let heads = Heads { count: heads, a, y, w: rows_w * cols_w };
        let right = match (op, bufs.loc(m)) {
            (Op::MatVec, Some(Loc::Param(i))) if f.weights.reads_in_place() => {
                RightOperand::InPlaceT { w: f.params[i].as_ptr(), n: rows_w, k: cols_w }
            }
            (Op::MatVecT, Some(Loc::Param(i))) if f.weights.reads_in_place() => {
                RightOperand::InPlace { w: f.params[i].as_ptr(), k: rows_w, n: cols_w }
            }
            (Op::MatVec, Some(Loc::Param(i))) => match f.tiles.and_then(|t| t.panels_of(out)) {
                // A fused step's product, in tile order.
                Some(tiled) => RightOperand::Packed(tiled),
                None => RightOperand::Packed(f.weights.t_panels(i, f.params[i], block).as_ptr()),
            },
            (Op::MatVecT, Some(Loc::Param(i))) => {
                RightOperand::Packed(f.weights.panels(i, f.params[i], block).as_ptr())
            }
            (Op::MatVec, _) => RightOperand::Matrix(weight_t(bufs, f, m, rows_w, cols_w)?),
            (Op::MatVecT, _) => {
                RightOperand::Matrix(View::rows(locate(bufs, f, m, 0, 0, 0)?, rows_w, cols_w, cols_w))
            }
            (other, _) => return Err(RuntimeError::Internal(format!("{other:?} in a per-row product"))),
        };
        Ok(ProductCall { rows, right, heads })
    }

    /// Computes the columns of share `part` of `parts` of every head (all
    /// of them with one part).
    ///
    /// # Safety
    /// The rows located and the right operand are still valid, and no
    /// other thread writes this share's columns of them.
    pub unsafe fn run(&self, share: (usize, usize)) {
        let Heads { count, a, y, w } = self.heads;
        for h in 0..count {
            let rows = super::panels::Rows {
                y: self.rows.y.wrapping_add(h * y),
                a: self.rows.a.wrapping_add(h * a),
                ..self.rows
            };
            // SAFETY: per the contract; head `h`'s columns of the rows and
            // its block of the weight lie inside the located values.
            unsafe { run_one(rows, self.right.head(h, w), share) };
        }
    }
}

impl ProductCall {
    /// Rows of the call.
    pub fn rows(&self) -> usize {
        self.rows.m
    }

    /// The call cut into `count` pieces of consecutive rows (as even as
    /// they come, none empty), each the same product on its rows.
    pub fn pieces(self, count: usize) -> impl Iterator<Item = ProductCall> {
        let m = self.rows.m;
        let count = count.clamp(1, m.max(1));
        (0..count).map(move |piece| {
            let (from, to) = (m * piece / count, m * (piece + 1) / count);
            let rows = super::panels::Rows {
                y: self.rows.y.wrapping_add(from * self.rows.ldy),
                a: self.rows.a.wrapping_add(from * self.rows.lda),
                m: to - from,
                ..self.rows
            };
            ProductCall { rows, ..self }
        })
    }

    /// The same product with its left operand's rows at `a`, `lda` floats apart.
    pub fn with_left(self, a: *const f32, lda: usize) -> ProductCall {
        ProductCall { rows: super::panels::Rows { a, lda, ..self.rows }, ..self }
    }

    /// Computes columns `columns` of a product of one head with a packed
    /// weight (a fused step's: see [`super::tiles`]); `columns.start` on a
    /// panel's first column.
    ///
    /// # Safety
    /// As [`ProductCall::run`], for these columns.
    pub unsafe fn run_columns(&self, columns: std::ops::Range<usize>) -> Result<()> {
        let RightOperand::Packed(packed) = self.right else {
            return Err(RuntimeError::Internal("a fused product whose weight is not packed".into()));
        };
        if self.heads.count != 1 || !columns.start.is_multiple_of(super::panels::PANEL) {
            return Err(RuntimeError::Internal(format!("fused product columns {columns:?}")));
        }
        let panels = columns.start / super::panels::PANEL..columns.end.div_ceil(super::panels::PANEL);
        // SAFETY: per the contract; the packed weight is [k, n] of the product.
        unsafe { super::product::multiply(self.rows, &*packed, panels, false) };
        Ok(())
    }
}

/// One head of a [`ProductCall`]: the columns of share `part` of `parts`.
///
/// # Safety
/// As [`ProductCall::run`].
unsafe fn run_one(rows: super::panels::Rows, right: RightOperand, (part, parts): (usize, usize)) {
    let (y, a, m) = (rows.y, rows.a, rows.m);
    match right {
        // SAFETY: per the contract; the packed weight is [k, n] of the product.
        RightOperand::Packed(packed) => unsafe {
            let packed = &*packed;
            super::product::multiply(rows, packed, packed.share(part, parts), false)
        },
        RightOperand::InPlaceT { w, n, k } => {
            let (from, count) = column_share(n, part, parts);
            // SAFETY: per the contract; the parameter is [n, k].
            unsafe { super::in_place::times_transpose(rows, w, k, from..from + count) }
        }
        RightOperand::InPlace { w, k, n } => {
            let (from, count) = column_share(n, part, parts);
            // SAFETY: per the contract; the parameter is [k, n].
            unsafe { super::in_place::times(rows, w, k, n, from..from + count) }
        }
        RightOperand::Matrix(w) => {
            let (from, count) = column_share(w.cols, part, parts);
            if count > 0 {
                let dst = View::rows(y, m, w.cols, rows.ldy);
                let a = View::rows(a, m, w.rows, rows.lda);
                // SAFETY: per the contract; this share writes only its columns of y.
                unsafe { matmul(dst.columns(from, count), a, w.columns(from, count), false) };
            }
        }
    }
}
