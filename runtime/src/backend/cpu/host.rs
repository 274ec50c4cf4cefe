//! Host memory as a pass's memory, the half of [`crate::backend::Device`]
//! that the devices on the host (the CPU and the reference) share: scratch
//! from the [`crate::pool`], spans read as slices, rows copied and added,
//! the masks of a pass filled into host rows and host rows multiplied by
//! masks (dropout between layers, DropConnect), and a layer's spans as the
//! rows and slices its host code reads ([`HostForward`], [`HostBackward`]).
//! Masks are drawn with the CPU's generator ([`super::masks`]); a pass's
//! sequences are shared out between the process's threads where the masks
//! are large enough to pay for waking them.

use super::masks::{fill, MaskRow};
use super::threads;
use crate::cell::{CompiledCell, Layer};
use crate::dropout::LayerMasks;
use crate::error::Result;
use crate::masks::{MaskFill, MaskRows};
use crate::pass::{
    Buf, Dropping, LayerBackward, LayerForward, Pass, PreparedWeights, RowPairs, RowSpan, Span,
};
use crate::sequence::{check_len, zero_rows, BatchOrder, LaidOutBatch, RowLayout};
use cellc::ir::MaskPeriod;

/// Units `0..out.len()` of mask `m` of the sequence at index `sequence`
/// of the caller's batch at its step `step` (either ignored where the
/// mask is shared over it).
pub fn mask_row(m: &MaskFill, sequence: usize, step: usize, out: &mut [f32]) {
    let Some(d) = m.drawn else { return out.fill(m.evaluation) };
    let (sequence, step) = m.coordinates(sequence, step);
    fill(MaskRow { key: d.key, sequence, step, threshold: d.threshold, scale: d.kept }, 0, out);
}

/// Fills `row` (`rows.width` floats) with the masks of every row where
/// they are the same for every row (evaluation).
pub(crate) fn fill_shared_row(row: &mut [f32], rows: &MaskRows) {
    for m in &rows.fills {
        mask_row(m, 0, 0, &mut row[m.offset..m.offset + m.units]);
    }
}

/// Fills every valid row of `batch` in host rows at `base` (`rows.width`
/// floats a row) with its masks. Sequences are shared out between the
/// process's threads where the masks are large enough to pay for waking them.
///
/// # Safety
/// `base` holds the batch's layout rows of `rows.width` floats, which
/// nothing else reads or writes meanwhile.
pub(crate) unsafe fn fill_on_host(base: *mut f32, batch: &LaidOutBatch, rows: &MaskRows) {
    let (order, layout, width) = (&batch.order, &batch.layout, rows.width);
    let base = SharedRows(base);
    let sequence = |b: usize| {
        for t in 0..order.lengths()[b] {
            let row = layout.row(b, t) * width;
            for m in &rows.fills {
                // SAFETY: per the contract; each sequence's rows are its own, written by one task.
                let out = unsafe { std::slice::from_raw_parts_mut(base.at(row + m.offset), m.units) };
                match (m.period, t) {
                    // A mask shared over the sequence's steps is drawn once.
                    (MaskPeriod::Sequence, 1..) => {
                        // SAFETY: as above; row 0 of the sequence was written at t = 0.
                        let first = unsafe { base.at(layout.row(b, 0) * width + m.offset) };
                        // SAFETY: distinct rows of the buffer.
                        out.copy_from_slice(unsafe { std::slice::from_raw_parts(first, m.units) });
                    }
                    _ => mask_row(m, b, t, out),
                }
            }
        }
    };
    let floats = order.rows() * width;
    let threads = if floats >= 1 << 16 { threads::usable_cores() } else { 1 };
    threads::run_call(threads, |_| threads::for_each(order.batch(), &sequence));
}

/// Multiplies a parameter (`weights`) by its DropConnect mask `fill`, or
/// a gradient of the masked parameter by the same mask (the chain rule:
/// the masked parameter is `W * m`, so `dW = dW_masked * m`).
pub(crate) fn drop_connect(weights: &mut [f32], fill: &MaskFill) {
    let mut mask = vec![0.0f32; weights.len()];
    mask_row(fill, 0, 0, &mut mask);
    weights.iter_mut().zip(&mask).for_each(|(w, m)| *w *= m);
}

/// Multiplies every valid row of `batch` in host rows at `base` (`width`
/// floats a row, the masked features from `offset`) by its masks.
/// Sequences are shared out between the process's threads where the masks
/// are large enough to pay for waking them.
///
/// # Safety
/// `base` holds the batch's layout rows of `width` floats, which nothing
/// else reads or writes meanwhile.
pub(crate) unsafe fn apply_on_host(
    base: *mut f32,
    (width, offset): (usize, usize),
    batch: &LaidOutBatch,
    masks: &LayerMasks,
) {
    let (order, layout, units) = (&batch.order, &batch.layout, masks.units);
    let (threshold, scale) = (masks.threshold, masks.scale);
    let base = SharedRows(base);
    let sequence = |b: usize| {
        let mut mask = vec![0.0f32; units];
        for t in 0..order.lengths()[b] {
            let row = layout.row(b, t) * width + offset;
            for (d, &key) in masks.keys.iter().enumerate() {
                fill(MaskRow { key, sequence: b as u32, step: t as u32, threshold, scale }, 0, &mut mask);
                // SAFETY: per the contract; each sequence's rows are its own, written by one task.
                let at = unsafe { std::slice::from_raw_parts_mut(base.at(row + d * units), units) };
                at.iter_mut().zip(&mask).for_each(|(x, m)| *x *= m);
            }
        }
    };
    let features = order.rows() * units * masks.keys.len();
    let threads = if features >= 1 << 16 { threads::usable_cores() } else { 1 };
    threads::run_call(threads, |_| threads::for_each(order.batch(), &sequence));
}

/// Host memory from the [`crate::pool`], given back when dropped.
struct Pooled(Vec<f32>);

impl Drop for Pooled {
    fn drop(&mut self) {
        crate::pool::give(std::mem::take(&mut self.0));
    }
}

/// `floats` floats of host memory from the pool, zeroed if `zeroed`.
pub fn scratch(floats: usize, zeroed: bool) -> Buf {
    let data = if zeroed { crate::pool::take_zeroed(floats) } else { crate::pool::take(floats) };
    let (addr, len) = (data.as_ptr() as u64, data.len());
    Buf::new(addr, len, Box::new(Pooled(data)))
}

/// A copy of `data` in host memory.
pub fn upload(data: &[f32]) -> Buf {
    let buf = scratch(data.len(), false);
    // SAFETY: the buffer is new, `data.len()` floats, and only this function's.
    unsafe { floats_mut(buf.span()) }.copy_from_slice(data);
    buf
}

/// The floats of a host span.
///
/// # Safety
/// `span` is host memory, valid for `'s` and not written meanwhile.
pub unsafe fn floats<'s>(span: Span) -> &'s [f32] {
    if span.len == 0 {
        return &[];
    }
    // SAFETY: per the contract.
    unsafe { std::slice::from_raw_parts(span.addr as *const f32, span.len) }
}

/// The floats of a host span, to write.
///
/// # Safety
/// `span` is host memory, valid for `'s` and not read or written through
/// anything else meanwhile.
pub unsafe fn floats_mut<'s>(span: Span) -> &'s mut [f32] {
    if span.len == 0 {
        return &mut [];
    }
    // SAFETY: per the contract.
    unsafe { std::slice::from_raw_parts_mut(span.addr as *mut f32, span.len) }
}

/// The operations of [`crate::backend::Device`] on host memory, for a
/// device's `impl Device` (the CPU's, the reference's): every span is
/// host memory, per the trait's contract.
macro_rules! host_memory {
    () => {
        fn memory(&self) -> $crate::pass::Memory {
            $crate::pass::Memory::Host
        }

        fn scratch(
            &self,
            _: &$crate::pass::Pass,
            floats: usize,
            zeroed: bool,
        ) -> $crate::error::Result<$crate::pass::Buf> {
            Ok($crate::backend::cpu::host::scratch(floats, zeroed))
        }

        fn zero(
            &self,
            _: &$crate::pass::Pass,
            span: $crate::pass::Span,
            rows: Option<(usize, &[usize])>,
        ) -> $crate::error::Result<()> {
            // SAFETY: per the trait's contract, `span` is host memory of this operation's alone.
            unsafe { $crate::backend::cpu::host::zero(span, rows) };
            Ok(())
        }

        fn move_rows(
            &self,
            _: &$crate::pass::Pass,
            rows: $crate::pass::RowPairs,
        ) -> $crate::error::Result<()> {
            // SAFETY: per the trait's contract.
            unsafe { $crate::backend::cpu::host::move_rows(rows) };
            Ok(())
        }

        fn upload(&self, data: &[f32]) -> $crate::error::Result<$crate::pass::Buf> {
            Ok($crate::backend::cpu::host::upload(data))
        }

        fn download(
            &self,
            _: &$crate::pass::Pass,
            from: $crate::pass::Span,
            to: &mut [f32],
        ) -> $crate::error::Result<()> {
            $crate::sequence::check_len("download", to.len(), &[from.len])?;
            // SAFETY: per the trait's contract, `from` is host memory that lives.
            to.copy_from_slice(unsafe { $crate::backend::cpu::host::floats(from) });
            Ok(())
        }

        fn fill_masks(
            &self,
            pass: &$crate::pass::Pass,
            rows: $crate::pass::RowSpan,
            masks: &$crate::masks::MaskRows,
        ) -> $crate::error::Result<()> {
            // SAFETY: per the trait's contract.
            unsafe { $crate::backend::cpu::host::fill_masks(pass, rows, masks) };
            Ok(())
        }

        fn drop_out(
            &self,
            pass: &$crate::pass::Pass,
            rows: $crate::pass::RowSpan,
            masks: $crate::pass::Dropping,
        ) -> $crate::error::Result<()> {
            // SAFETY: per the trait's contract.
            unsafe { $crate::backend::cpu::host::drop_out(pass, rows, masks) };
            Ok(())
        }
    };
}
pub(crate) use host_memory;

/// Sets `span` to zero, or with `rows` only those rows of `width` floats.
///
/// # Safety
/// `span` is host memory of the caller's alone.
pub unsafe fn zero(span: Span, rows: Option<(usize, &[usize])>) {
    // SAFETY: per the contract.
    let data = unsafe { floats_mut(span) };
    match rows {
        Some((width, which)) => zero_rows(data, width, which),
        None => data.fill(0.0),
    }
}

/// Copies or adds rows ([`RowPairs`]).
///
/// # Safety
/// `rows.to` and `rows.from` are host memory, `to` the caller's alone.
pub unsafe fn move_rows(rows: RowPairs) {
    let RowPairs { to, from, width, pairs, add } = rows;
    // SAFETY: per the contract (two spans of a pass never overlap).
    let (to, from) = unsafe { (floats_mut(to), floats(from)) };
    for &(i, j) in pairs {
        let (to, from) = (&mut to[i * width..(i + 1) * width], &from[j * width..(j + 1) * width]);
        match add {
            true => to.iter_mut().zip(from).for_each(|(t, f)| *t += f),
            false => to.copy_from_slice(from),
        }
    }
}

/// Fills the valid rows of `rows` with `masks`, or its one row where
/// `rows.width == 0` (evaluation).
///
/// # Safety
/// `rows` is host memory of the caller's alone, laid out as the pass's batch.
pub unsafe fn fill_masks(pass: &Pass, rows: RowSpan, masks: &MaskRows) {
    if rows.width == 0 {
        // SAFETY: per the contract.
        return fill_shared_row(unsafe { floats_mut(rows.span) }, masks);
    }
    // SAFETY: per the contract.
    unsafe { fill_on_host(rows.span.addr as *mut f32, pass.batch, masks) }
}

/// Multiplies `rows` by masks.
///
/// # Safety
/// `rows` is host memory of the caller's alone, laid out as the pass's batch.
pub unsafe fn drop_out(pass: &Pass, rows: RowSpan, masks: Dropping) {
    match masks {
        // SAFETY: per the contract.
        Dropping::Rows(m) => unsafe {
            apply_on_host(rows.span.addr as *mut f32, (rows.width, rows.offset), pass.batch, m)
        },
        // SAFETY: per the contract.
        Dropping::Parameter(fill) => drop_connect(unsafe { floats_mut(rows.span) }, fill),
    }
}

/// Rows of host memory laid out as the batch the layers run.
///
/// # Safety
/// `rows` is host memory that lives for `'a`, not written meanwhile.
unsafe fn rows_of<'a>(pass: &Pass<'a>, rows: RowSpan) -> Rows<'a> {
    // SAFETY: per the contract.
    let data = unsafe { floats(rows.span) };
    Rows { data, layout: &pass.batch.running().layout, width: rows.width, offset: rows.offset }
}

/// Rows of host memory to write, laid out as the batch the layers run.
///
/// # Safety
/// `rows` is host memory that lives for `'a`, the caller's alone.
unsafe fn rows_mut_of<'a>(pass: &Pass<'a>, rows: RowSpan) -> RowsMut<'a> {
    // SAFETY: per the contract.
    let data = unsafe { floats_mut(rows.span) };
    RowsMut { data, layout: &pass.batch.running().layout, width: rows.width, offset: rows.offset }
}

/// Copies each of `from` into the span of `to` at the same index.
///
/// # Safety
/// Every span of `to` is host memory of the caller's alone.
unsafe fn write_each(to: &[Span], from: &[Vec<f32>], what: &str) -> Result<()> {
    for (&to, from) in to.iter().zip(from) {
        check_len(what, to.len, &[from.len()])?;
        // SAFETY: per the contract.
        unsafe { floats_mut(to) }.copy_from_slice(from);
    }
    Ok(())
}

/// Runs `job` with `run`, a host device's forward over host rows, and
/// writes the final states it returns.
///
/// # Safety
/// Every span of `job` is host memory that lives while this runs, the
/// written ones (output, final states, tape) the caller's alone.
pub unsafe fn forward(
    pass: &Pass,
    job: LayerForward,
    run: impl FnOnce(&HostForward, &mut RowsMut, Option<&mut [f32]>) -> Result<Vec<Vec<f32>>>,
) -> Result<()> {
    // SAFETY (block): per the contract.
    let (params, h0, mut output, tape, input, masks) = unsafe {
        let params: Vec<&[f32]> = job.params.iter().map(|&s| floats(s)).collect();
        let h0: Vec<&[f32]> = job.h0.iter().map(|&s| floats(s)).collect();
        let masks = job.masks.map(|m| rows_of(pass, m));
        (
            params,
            h0,
            rows_mut_of(pass, job.output),
            job.tape.map(|t| floats_mut(t)),
            rows_of(pass, job.input),
            masks,
        )
    };
    let shared = HostLayer {
        cell: pass.cell,
        layer: job.layer,
        params: &params,
        order: &pass.batch.running().order,
        reverse: job.reverse,
        input,
        prepared: job.prepared,
        masks,
    };
    let view = HostForward { shared, h0: &h0 };
    let finals = run(&view, &mut output, tape)?;
    // SAFETY: per the contract.
    unsafe { write_each(&job.finals, &finals, "final states") }
}

/// Runs `job` with `run`, a host device's backward over host rows, and
/// writes the gradients it returns.
///
/// # Safety
/// As [`forward`]; the written spans are the input's adjoint, the initial
/// states' and the parameters'.
pub unsafe fn backward(
    pass: &Pass,
    job: LayerBackward,
    run: impl FnOnce(&HostBackward, &[f32], &mut RowsMut) -> Result<HostGradients>,
) -> Result<()> {
    // SAFETY (block): per the contract.
    let (params, (d_final, h0), tape, mut d_input, input, d_output, masks) = unsafe {
        let params: Vec<&[f32]> = job.params.iter().map(|&s| floats(s)).collect();
        let d_final: Vec<&[f32]> = job.d_final.iter().map(|&s| floats(s)).collect();
        let h0: Vec<&[f32]> = job.h0.iter().map(|&s| floats(s)).collect();
        let masks = job.masks.map(|m| rows_of(pass, m));
        let (input, d_output) = (rows_of(pass, job.input), rows_of(pass, job.d_output));
        (params, (d_final, h0), floats(job.tape), rows_mut_of(pass, job.d_input), input, d_output, masks)
    };
    let shared = HostLayer {
        cell: pass.cell,
        layer: job.layer,
        params: &params,
        order: &pass.batch.running().order,
        reverse: job.reverse,
        input,
        prepared: job.prepared,
        masks,
    };
    let view = HostBackward { shared, d_output, d_final: &d_final, h0: &h0 };
    let r = run(&view, tape, &mut d_input)?;
    // SAFETY: per the contract.
    unsafe {
        write_each(&job.d_h0, &r.d_h0, "initial-state gradient")?;
        write_each(&job.d_params, &r.d_params, "parameter gradient")?;
    }
    // The next call's weight gradients sum into these pages, already faulted in.
    r.d_h0.into_iter().chain(r.d_params).for_each(crate::pool::give);
    Ok(())
}

/// A buffer of rows shared by the threads of a run, each writing only the
/// rows it owns (the ranks of its sequences, their layout rows): states,
/// carried adjoints, the output, the tape. The owner keeps the buffer alive
/// and unmoved while the address is in use.
#[derive(Clone, Copy, Debug)]
pub struct SharedRows(pub *mut f32);

// SAFETY: a plain address; the threads that share it write disjoint rows.
unsafe impl Send for SharedRows {}
unsafe impl Sync for SharedRows {}

impl SharedRows {
    /// The rows of `buffer`.
    pub fn of(buffer: &mut [f32]) -> SharedRows {
        SharedRows(buffer.as_mut_ptr())
    }

    /// One for each of `buffers`.
    pub fn each(buffers: &mut [Vec<f32>]) -> Vec<SharedRows> {
        buffers.iter_mut().map(|b| SharedRows::of(b)).collect()
    }

    /// The float `offset` places on.
    ///
    /// # Safety
    /// The offset is inside the buffer.
    pub unsafe fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: per the contract.
        unsafe { self.0.add(offset) }
    }
}

/// Rows of a flat buffer: row `r`'s features are `data[r*width + offset ..]`.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    /// The whole buffer, every row of the layout.
    pub data: &'a [f32],
    /// Which row each `(b, t)` is.
    pub layout: &'a RowLayout,
    /// Floats per row of `data`.
    pub width: usize,
    /// Where in a row these features start.
    pub offset: usize,
}

impl<'a> Rows<'a> {
    /// The `len` features of `(b, t)`.
    pub fn get(&self, b: usize, t: usize, len: usize) -> &'a [f32] {
        let start = self.layout.row(b, t) * self.width + self.offset;
        &self.data[start..start + len]
    }
}

/// Writable rows, laid out as [`Rows`].
#[derive(Debug)]
pub struct RowsMut<'a> {
    /// The whole buffer, every row of the layout.
    pub data: &'a mut [f32],
    /// Which row each `(b, t)` is.
    pub layout: &'a RowLayout,
    /// Floats per row of `data`.
    pub width: usize,
    /// Where in a row these features start.
    pub offset: usize,
}

impl RowsMut<'_> {
    /// The `len` features of `(b, t)`, writable.
    pub fn get_mut(&mut self, b: usize, t: usize, len: usize) -> &mut [f32] {
        let start = self.layout.row(b, t) * self.width + self.offset;
        &mut self.data[start..start + len]
    }
}

/// One layer and direction as a host device reads it, forwards or
/// backwards: a [`LayerForward`]'s or [`LayerBackward`]'s spans as slices
/// and rows of host memory, what both directions read. [`HostForward`]
/// and [`HostBackward`] add their own, and read through to these.
#[derive(Clone, Copy, Debug)]
pub struct HostLayer<'a> {
    /// The cell the layer runs.
    pub cell: &'a CompiledCell,
    /// The cell's program at this layer's sizes.
    pub layer: &'a Layer,
    /// This layer-direction's parameters, in the cell's order, each row-major.
    pub params: &'a [&'a [f32]],
    /// The batch's sequences by decreasing length, and how many run at each step.
    pub order: &'a BatchOrder,
    /// Runs each sequence from its last step to its first (a bidirectional layer's second direction).
    pub reverse: bool,
    /// The layer's input rows (the batch's input, or the previous layer's output).
    pub input: Rows<'a>,
    /// The device's own form of `params`, kept across calls.
    pub prepared: &'a PreparedWeights,
    /// The masks the (forward's) steps read, mask `i` at the layer's
    /// `mask_slices[i]`; `None` for a cell without.
    pub masks: Option<Rows<'a>>,
}

impl HostLayer<'_> {
    /// Rows of the batch's layout (a padded batch's `B * T`, a packed one's `N`).
    pub fn layout_rows(&self) -> usize {
        self.input.data.len() / self.input.width.max(1)
    }
}

/// One layer, one direction, forwards, as a host device reads it.
#[derive(Clone, Copy, Debug)]
pub struct HostForward<'a> {
    /// What both directions read.
    pub shared: HostLayer<'a>,
    /// Initial states, one `[B * size]` buffer per state.
    pub h0: &'a [&'a [f32]],
}

/// One layer, one direction, backwards, as a host device reads it.
#[derive(Clone, Copy, Debug)]
pub struct HostBackward<'a> {
    /// What both directions read (the input as the forward read it).
    pub shared: HostLayer<'a>,
    /// The adjoint of this direction's output rows.
    pub d_output: Rows<'a>,
    /// The adjoints of the final states, one `[B * size]` buffer per state.
    pub d_final: &'a [&'a [f32]],
    /// The initial states the forward read, one `[B * size]` buffer per
    /// state: a state the tape keeps only after each step
    /// ([`crate::plan::Home::StateBeforeFromTape`]) is this before a
    /// sequence's first step.
    pub h0: &'a [&'a [f32]],
}

/// Where a state lies as a step read it, for a state the tape keeps only
/// after each step ([`crate::plan::Home::StateBeforeFromTape`]).
#[derive(Clone, Copy, Debug)]
pub enum StateBefore<'a> {
    /// The state after the sequence's step before: the tape's row at this layout row.
    AfterRow(usize),
    /// The sequence's initial state, at its first step.
    Initial(&'a [f32]),
}

impl HostBackward<'_> {
    /// Where state `i` (`len` floats) lies as step `t` of sequence `b` read
    /// it, for a state the tape keeps only after each step.
    pub fn state_before(&self, (i, len): (usize, usize), (b, t): (usize, usize)) -> StateBefore<'_> {
        match self.order.previous(b, t, self.reverse) {
            Some(before) => StateBefore::AfterRow(self.input.layout.row(b, before)),
            None => StateBefore::Initial(&self.h0[i][b * len..(b + 1) * len]),
        }
    }
}

impl<'a> std::ops::Deref for HostForward<'a> {
    type Target = HostLayer<'a>;

    fn deref(&self) -> &HostLayer<'a> {
        &self.shared
    }
}

impl<'a> std::ops::Deref for HostBackward<'a> {
    type Target = HostLayer<'a>;

    fn deref(&self) -> &HostLayer<'a> {
        &self.shared
    }
}

/// What a host device's backward of one layer and direction returns (the
/// input's adjoint is added into the caller's rows instead).
#[derive(Debug)]
pub struct HostGradients {
    /// Adjoints of the initial states, one `[B * size]` buffer per state.
    pub d_h0: Vec<Vec<f32>>,
    /// Adjoints of the parameters, in the cell's order.
    pub d_params: Vec<Vec<f32>>,
}
