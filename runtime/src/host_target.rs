//! Passes over host memory (the runtime's own buffers, or a caller's): the
//! [`PassTarget`] on which the model's back end runs each layer and
//! direction the driver hands it, its spans read as slices.

use crate::backend::{BackwardJob, ForwardJob, PreparedWeights, Rows, RowsMut};
use crate::dropout::LayerMasks;
use crate::error::Result;
use crate::masks::{MaskFill, MaskRows};
use crate::model::Model;
use crate::pass::{LayerBackward, LayerForward, PassTarget, RowSpan, Span};
use crate::sequence::LaidOutBatch;
use crate::sequence::{check_len, zero_rows};

/// A model's parameters for one pass: its own (with the back end's forms
/// kept across calls), or the caller's (prepared afresh for the pass).
pub(crate) struct PassParams<'a> {
    /// `[layer * directions + direction][param]`.
    params: Vec<Vec<&'a [f32]>>,
    prepared: Prepared<'a>,
}

enum Prepared<'a> {
    Model(&'a [PreparedWeights]),
    Pass(Vec<PreparedWeights>),
}

impl PassParams<'_> {
    pub(crate) fn slot(&self, slot: usize) -> (&[&[f32]], &PreparedWeights) {
        let prepared = match &self.prepared {
            Prepared::Model(p) => &p[slot],
            Prepared::Pass(p) => &p[slot],
        };
        (&self.params[slot], prepared)
    }
}

impl Model {
    /// The model's own parameters, as a pass reads them.
    pub(crate) fn own_params(&self) -> Result<PassParams<'_>> {
        self.ensure_owns_weights()?;
        Ok(PassParams {
            params: self.params.iter().map(|ps| ps.iter().map(Vec::as_slice).collect()).collect(),
            prepared: Prepared::Model(&self.prepared),
        })
    }

    /// The caller's parameters (`[layer * directions + direction][param]`,
    /// the model's shapes), checked.
    pub(crate) fn caller_params<'a>(&self, given: &[Vec<&'a [f32]>]) -> Result<PassParams<'a>> {
        self.check_weights(given)?;
        Ok(PassParams {
            params: given.to_vec(),
            prepared: Prepared::Pass(given.iter().map(|_| PreparedWeights::for_one_pass()).collect()),
        })
    }
}

/// A layer and direction's parameters with its DropConnect masks applied
/// (copies, prepared afresh for the pass), where it has any.
struct MaskedParams {
    params: Vec<Vec<f32>>,
    prepared: PreparedWeights,
}

impl MaskedParams {
    fn new(params: &[&[f32]], drop_connect: &[(usize, MaskFill)]) -> Option<MaskedParams> {
        if drop_connect.is_empty() {
            return None;
        }
        let mut params: Vec<Vec<f32>> = params.iter().map(|p| p.to_vec()).collect();
        for (param, fill) in drop_connect {
            crate::backend::cpu::host::drop_connect(&mut params[*param], fill);
        }
        Some(MaskedParams { params, prepared: PreparedWeights::for_one_pass() })
    }
}

/// The masked parameters if there are any, else `params` and `prepared`.
fn masked_or<'s>(
    masked: &'s Option<MaskedParams>,
    params: &'s [&'s [f32]],
    prepared: &'s PreparedWeights,
) -> (Vec<&'s [f32]>, &'s PreparedWeights) {
    match masked {
        Some(m) => (m.params.iter().map(Vec::as_slice).collect(), &m.prepared),
        None => (params.to_vec(), prepared),
    }
}

/// A pass of `model` over host memory, with `params`; its scratch memory
/// comes from the [`crate::pool`] and goes back there when it ends.
pub(crate) struct HostTarget<'a> {
    model: &'a Model,
    batch: &'a LaidOutBatch,
    params: &'a PassParams<'a>,
    scratch: Vec<Vec<f32>>,
}

impl<'a> HostTarget<'a> {
    /// # Safety
    /// Every span the driver is given for this pass is host memory that
    /// lives, and that nothing else reads or writes, while the pass runs;
    /// spans written are not read through another span at the same time.
    pub(crate) unsafe fn new(model: &'a Model, batch: &'a LaidOutBatch, params: &'a PassParams<'a>) -> Self {
        HostTarget { model, batch, params, scratch: Vec::new() }
    }

    /// Rows as the layers read them (laid out as the batch they run).
    fn rows(&self, rows: RowSpan) -> Rows<'a> {
        // SAFETY: per `new`'s contract.
        let data = unsafe { floats(rows.span) };
        let layout: &'a crate::sequence::RowLayout = &self.batch.running().layout;
        Rows { data, layout, width: rows.width, offset: rows.offset }
    }

    /// Rows to write.
    ///
    /// # Safety
    /// Per `new`'s contract, and nothing else reads or writes `rows` while
    /// the result lives.
    unsafe fn rows_mut(&self, rows: RowSpan) -> RowsMut<'a> {
        // SAFETY: per the contract.
        let data = unsafe { floats_mut(rows.span) };
        let layout: &'a crate::sequence::RowLayout = &self.batch.running().layout;
        RowsMut { data, layout, width: rows.width, offset: rows.offset }
    }
}

impl Drop for HostTarget<'_> {
    fn drop(&mut self) {
        self.scratch.drain(..).for_each(crate::pool::give);
    }
}

/// The floats of a host span.
///
/// # Safety
/// `span` is host memory, valid for `'s` and not written meanwhile.
unsafe fn floats<'s>(span: Span) -> &'s [f32] {
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
unsafe fn floats_mut<'s>(span: Span) -> &'s mut [f32] {
    if span.len == 0 {
        return &mut [];
    }
    // SAFETY: per the contract.
    unsafe { std::slice::from_raw_parts_mut(span.addr as *mut f32, span.len) }
}

/// Copies each of `from` into the span of `to` at the same index.
fn write_each(to: &[Span], from: &[Vec<f32>], what: &str) -> Result<()> {
    for (&to, from) in to.iter().zip(from) {
        check_len(what, to.len, &[from.len()])?;
        // SAFETY: per `HostTarget::new`'s contract, a span written is this pass's alone.
        unsafe { floats_mut(to) }.copy_from_slice(from);
    }
    Ok(())
}

impl PassTarget for HostTarget<'_> {
    fn scratch(&mut self, floats: usize, zeroed: bool) -> Result<Span> {
        let buf = if zeroed { crate::pool::take_zeroed(floats) } else { crate::pool::take(floats) };
        let span = Span::of(&buf);
        self.scratch.push(buf);
        Ok(span)
    }

    fn zero_padding(&mut self, rows: RowSpan, padding: &[usize]) -> Result<()> {
        // SAFETY: per `new`'s contract.
        zero_rows(unsafe { floats_mut(rows.span) }, rows.width, padding);
        Ok(())
    }

    fn zero(&mut self, span: Span) -> Result<()> {
        // SAFETY: per `new`'s contract.
        unsafe { floats_mut(span) }.fill(0.0);
        Ok(())
    }

    fn copy(&mut self, to: Span, from: Span) -> Result<()> {
        // SAFETY: per `new`'s contract (two spans of a pass never overlap).
        unsafe { floats_mut(to) }.copy_from_slice(unsafe { floats(from) });
        Ok(())
    }

    fn copy_rows(&mut self, to: Span, from: Span, width: usize, pairs: &[(usize, usize)]) -> Result<()> {
        // SAFETY: per `new`'s contract (two spans of a pass never overlap).
        let (to, from) = unsafe { (floats_mut(to), floats(from)) };
        for &(i, j) in pairs {
            to[i * width..(i + 1) * width].copy_from_slice(&from[j * width..(j + 1) * width]);
        }
        Ok(())
    }

    fn add_rows(&mut self, to: Span, from: Span, width: usize, pairs: &[(usize, usize)]) -> Result<()> {
        // SAFETY: as in `copy_rows`.
        let (to, from) = unsafe { (floats_mut(to), floats(from)) };
        for &(i, j) in pairs {
            let row = &from[j * width..(j + 1) * width];
            to[i * width..(i + 1) * width].iter_mut().zip(row).for_each(|(t, f)| *t += f);
        }
        Ok(())
    }

    fn drop_out(&mut self, rows: RowSpan, masks: &LayerMasks) -> Result<()> {
        // SAFETY: per `new`'s contract, `rows` is host memory of this pass's alone.
        unsafe {
            crate::backend::cpu::host::apply_on_host(
                rows.span.addr as *mut f32,
                (rows.width, rows.offset),
                self.batch,
                masks,
            )
        };
        Ok(())
    }

    fn fill_masks(&mut self, rows: RowSpan, masks: &MaskRows) -> Result<()> {
        if rows.width == 0 {
            // SAFETY: per `new`'s contract.
            crate::backend::cpu::host::fill_shared_row(unsafe { floats_mut(rows.span) }, masks);
            return Ok(());
        }
        // SAFETY: per `new`'s contract, `rows` is host memory of this pass's alone.
        unsafe { crate::backend::cpu::host::fill_on_host(rows.span.addr as *mut f32, self.batch, masks) };
        Ok(())
    }

    fn forward(&mut self, job: LayerForward) -> Result<()> {
        let (params, prepared) = self.params.slot(job.slot);
        let masked = MaskedParams::new(params, &job.drop_connect);
        let (params, prepared) = masked_or(&masked, params, prepared);
        // SAFETY (block): per `new`'s contract; the output, the tape and the
        // final states are spans of their own, read by nothing else here.
        let (h0, mut output, tape) = unsafe {
            let h0: Vec<&[f32]> = job.h0.iter().map(|&s| floats(s)).collect();
            (h0, self.rows_mut(job.output), job.tape.map(|t| floats_mut(t)))
        };
        let forward = ForwardJob {
            cell: &self.model.compiled,
            layer: job.layer,
            params: &params,
            order: &self.batch.running().order,
            reverse: job.reverse,
            input: self.rows(job.input),
            h0: &h0,
            prepared,
            masks: job.masks.map(|m| self.rows(m)),
        };
        let finals = self.model.backend.forward(&forward, &mut output, tape)?;
        write_each(&job.finals, &finals, "final states")
    }

    fn backward(&mut self, job: LayerBackward) -> Result<()> {
        let (params, prepared) = self.params.slot(job.slot);
        let masked = MaskedParams::new(params, &job.drop_connect);
        let (params, prepared) = masked_or(&masked, params, prepared);
        // SAFETY (block): per `new`'s contract; the input's adjoint is a span of its own.
        let (d_final, tape, mut d_input) = unsafe {
            let d_final: Vec<&[f32]> = job.d_final.iter().map(|&s| floats(s)).collect();
            (d_final, floats(job.tape), self.rows_mut(job.d_input))
        };
        let backward = BackwardJob {
            cell: &self.model.compiled,
            layer: job.layer,
            params: &params,
            order: &self.batch.running().order,
            reverse: job.reverse,
            input: self.rows(job.input),
            d_output: self.rows(job.d_output),
            d_final: &d_final,
            prepared,
            masks: job.masks.map(|m| self.rows(m)),
        };
        let mut r = self.model.backend.backward(&backward, tape, &mut d_input)?;
        for (param, fill) in &job.drop_connect {
            crate::backend::cpu::host::drop_connect(&mut r.d_params[*param], fill);
        }
        write_each(&job.d_h0, &r.d_h0, "initial-state gradient")?;
        write_each(&job.d_params, &r.d_params, "parameter gradient")
    }
}
