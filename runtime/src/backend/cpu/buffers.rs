//! Where a layer's values live during one pass on the CPU, and the
//! pointer to any value's row ([`locate`]):
//! - hoisted values (before the loop), values kept for the backward, and
//!   backward values needed after the loop: one row per `(sequence, step)`
//!   at the caller's row layout (`RowBuf`);
//! - per-step values and states: one row per sequence in *rank* order
//!   (longest first), so the active sequences of a step are a contiguous
//!   prefix and a per-step GEMM is one call on `n` rows (`RankBuf`);
//! - inputs, parameters, masks, states and adjoints where the caller's
//!   rows lie, read through a [`Frame`].

use super::host::{Rows, SharedRows, StateBefore};
use super::prepared::PreparedParams;
use crate::error::{Result, RuntimeError};
use crate::plan::{Home, PassPlan};
use crate::sequence::RowLayout;
use cellc::ir::{Graph, ValueId};
use cellc::shapes::Shapes;

/// Where a value is found for row `(b, t)` with rank `r`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    /// Features `[offset, offset + len)` of the layer input's row.
    Input(usize),
    /// The current state `i`, rank-ordered.
    State(usize),
    /// State `i` as the next step reads it, rank-ordered: a fused step's
    /// kernel writes its next states straight into the frame of the step
    /// after ([`super::step_loop::Frames`]), so nothing copies them.
    NextState(usize),
    Param(usize),
    /// Mask `i`'s units of the row `(b, t)` of the pass's masks.
    Mask(usize),
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
    /// One row per `(b, t)` at the layer's row layout, in the forward's
    /// tape (owned elsewhere, outliving the run): written by the forward's
    /// kernels that save straight into it, only read by the backward.
    TapeRows(*mut f32),
    /// State `i` as the step read it, from the tape's rows of the state
    /// after each step (`*mut f32`, owned as [`Loc::TapeRows`]): the row of
    /// the sequence's step before, or its initial state at its first step
    /// ([`super::host::HostBackward::state_before`]; backward).
    StateBeforeFromTape(*mut f32, usize),
}

/// One value's storage.
struct Slot {
    loc: Option<Loc>,
    /// Floats per row.
    len: usize,
    data: Vec<f32>,
    /// `data`'s first float, taken when the buffer is set, so that threads
    /// holding the buffers shared can write the rows they own.
    ptr: *mut f32,
}

impl Default for Slot {
    fn default() -> Slot {
        Slot { loc: None, len: 0, data: Vec::new(), ptr: std::ptr::null_mut() }
    }
}

impl Slot {
    fn set_data(&mut self, mut data: Vec<f32>) {
        self.ptr = data.as_mut_ptr();
        crate::pool::give(std::mem::replace(&mut self.data, data));
    }
}

/// Value buffers of one run, indexed by value (a lookup is an array index:
/// the driver resolves several pointers per row and step). Row and rank
/// buffers come from the [`super::pool`] unzeroed: every row a stage reads
/// was written by an earlier stage, step or run.
#[derive(Default)]
pub struct Buffers {
    slots: Vec<Slot>,
}

// SAFETY: the buffers are owned; threads that share them write disjoint rows
// (each thread the ranks or layout rows it owns), through the pointers taken
// when each buffer was set.
unsafe impl Send for Buffers {}
unsafe impl Sync for Buffers {}

impl Drop for Buffers {
    fn drop(&mut self) {
        for s in &mut self.slots {
            crate::pool::give(std::mem::take(&mut s.data));
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
            s.set_data(crate::pool::take(rows * len));
        }
        s.loc = Some(Loc::RowBuf);
        s.len = len;
    }

    /// Layout rows of `v` in `data`, which becomes its storage.
    pub fn row_data(&mut self, v: ValueId, data: Vec<f32>) {
        let s = self.slot(v);
        s.loc = Some(Loc::RowBuf);
        s.set_data(data);
    }

    /// A rank-ordered buffer for `v`, unless `v` already lives elsewhere.
    pub fn rank_buf(&mut self, v: ValueId, len: usize, batch: usize) {
        let s = self.slot(v);
        if s.loc.is_none() {
            s.loc = Some(Loc::RankBuf);
            s.set_data(crate::pool::take(batch * len));
        }
        s.len = len;
    }

    pub fn constant(&mut self, v: ValueId, value: Vec<f32>) {
        let s = self.slot(v);
        s.loc = Some(Loc::Const);
        s.len = value.len();
        s.set_data(value);
    }
}

/// Everything a pointer lookup needs for one step.
#[derive(Clone, Copy)]
pub struct Frame<'a> {
    pub input: Rows<'a>,
    pub input_slices: &'a [(usize, usize)],
    /// The masks the steps read (mask `i` at `mask_slices[i]`), if any.
    pub masks: Option<Rows<'a>>,
    pub mask_slices: &'a [Option<(usize, usize)>],
    pub params: &'a [&'a [f32]],
    /// Matrix parameters prepared for the products that read them.
    pub weights: &'a PreparedParams,
    pub states: &'a [SharedRows],
    /// The states the next step reads, where this step writes them
    /// ([`Loc::NextState`]; empty where states are updated in place).
    pub next_states: &'a [SharedRows],
    pub state_sizes: &'a [usize],
    pub carry: &'a [SharedRows],
    pub d_output: Option<(Rows<'a>, usize)>,
    pub layout: &'a RowLayout,
    /// A fused step's products that come out in tile order ([`super::tiles`]).
    pub tiles: Option<&'a super::prepared::TiledProducts>,
    /// The backward's job, where a state before the step is read from the
    /// tape's state after the step before ([`Loc::StateBeforeFromTape`]).
    pub backward: Option<&'a super::host::HostBackward<'a>>,
}

impl<'a> Frame<'a> {
    /// A layer's frame over `input` (rows at its layout) and `masks`
    /// (rows at the same layout) with no states, carried adjoints or
    /// output adjoint: callers add those they have.
    pub fn new(
        (input, masks): (Rows<'a>, Option<Rows<'a>>),
        layer: &'a crate::cell::Layer,
        params: &'a [&'a [f32]],
        weights: &'a PreparedParams,
    ) -> Frame<'a> {
        Frame {
            input,
            input_slices: &layer.input_slices,
            masks,
            mask_slices: &layer.mask_slices,
            params,
            weights,
            states: &[],
            next_states: &[],
            state_sizes: &layer.state_sizes,
            carry: &[],
            d_output: None,
            layout: input.layout,
            tiles: None,
            backward: None,
        }
    }
}

/// The pointer to value `v` for `(b, t)` at rank `r`. Inputs are only read.
pub fn locate(bufs: &Buffers, f: &Frame, v: ValueId, b: usize, t: usize, r: usize) -> Result<*mut f32> {
    let missing = || RuntimeError::Internal(format!("cpu backend: no storage for {v}"));
    let slot = bufs.slots.get(v.index()).ok_or_else(missing)?;
    let len = slot.len;
    let within = |row: usize| {
        if (row + 1) * len <= slot.data.len() {
            // SAFETY: in bounds of the slot's buffer, checked just above.
            Ok(unsafe { slot.ptr.add(row * len) })
        } else {
            Err(RuntimeError::Internal(format!("cpu backend: row {row} of {v} is out of its buffer")))
        }
    };
    Ok(match slot.loc.ok_or_else(missing)? {
        Loc::Input(i) => {
            let (o, l) = f.input_slices[i];
            f.input.get(b, t, o + l)[o..].as_ptr() as *mut f32
        }
        // SAFETY: state and carry buffers hold a row of their size for every rank.
        Loc::State(i) => unsafe { f.states.get(i).ok_or_else(missing)?.at(r * f.state_sizes[i]) },
        // SAFETY: as for states.
        Loc::NextState(i) => unsafe { f.next_states.get(i).ok_or_else(missing)?.at(r * f.state_sizes[i]) },
        Loc::Param(i) => f.params[i].as_ptr() as *mut f32,
        Loc::Mask(i) => {
            let (o, l) = f.mask_slices.get(i).copied().flatten().ok_or_else(missing)?;
            f.masks.ok_or_else(missing)?.get(b, t, o + l)[o..].as_ptr() as *mut f32
        }
        // SAFETY: as for states.
        Loc::Carry(i) => unsafe { f.carry.get(i).ok_or_else(missing)?.at(r * f.state_sizes[i]) },
        Loc::DOutput => {
            let (rows, n) = f.d_output.ok_or_else(missing)?;
            rows.get(b, t, n).as_ptr() as *mut f32
        }
        Loc::Const => slot.ptr,
        Loc::RowBuf => within(f.layout.row(b, t))?,
        Loc::RankBuf => within(r)?,
        // SAFETY: the owner holds a row of `len` floats for every (b, t) of the layout.
        Loc::TapeRows(p) => unsafe { p.add(f.layout.row(b, t) * len) },
        Loc::StateBeforeFromTape(p, i) => {
            match f.backward.ok_or_else(missing)?.state_before((i, len), (b, t)) {
                // SAFETY: as for TapeRows.
                StateBefore::AfterRow(row) => unsafe { p.add(row * len) },
                StateBefore::Initial(initial) => initial.as_ptr() as *mut f32,
            }
        }
    })
}

/// Constants (and values of constants only) as tiny buffers.
pub fn constants(graph: &Graph, shapes: &Shapes, bufs: &mut Buffers) {
    for (v, value) in shapes.constant_values(graph) {
        bufs.constant(v, value);
    }
}

/// Places the leaves the caller provides, where the pass's plan says.
pub(super) fn leaf_locations(pass: &PassPlan, shapes: &Shapes, bufs: &mut Buffers) {
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

pub(super) fn copy_row(
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
