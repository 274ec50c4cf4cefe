//! Where a layer's values live on the device during one pass, and the
//! address of any value's row.
//!
//! A value has one [`Home`]; its row for `(sequence b, time t)`, taken at
//! step `s` by the sequence of rank `r` (rank order: longest first, so a
//! step's active sequences are a prefix), is found arithmetically:
//!
//! - [`Home::Layout`]: one row per row of the caller's layout (the input,
//!   the output, the output's adjoint, values computed before the loop);
//! - [`Home::Steps`]: one row per `(step, rank)`, step-major: state
//!   histories (slot `s` holds the states before step `s`, so a step's
//!   next state is slot `s + 1` of the same buffer), values kept for the
//!   backward, and the backward's carried adjoints, likewise;
//! - [`Home::Rank`]: one row per rank, rewritten every step;
//! - [`Home::Fixed`]: the same memory for every row (parameters, constants);
//! - [`Home::StateBefore`]: a state before the step that the tape keeps
//!   only after each step, read by kernels row by row: the tape's row of
//!   the sequence's step before, or its initial state at step 0.
//!
//! A step's rows of a `Steps` or `Rank` home are contiguous, so a per-step
//! GEMM is one call; all rows of a `Steps` home are one matrix with zeros
//! where a sequence had ended, so a weight gradient over all steps is one
//! GEMM too.

pub(super) use super::device::error;
use super::device::{Buf, Device};
use crate::cell::Layer;
use crate::error::Result;
use crate::plan::{Home as PlanHome, PassPlan};
use crate::sequence::{time_before, BatchOrder, RowLayout};
use cellc::ir::{Graph, ValueId};
use cellc::program::Kept;
use cellc::shapes::Shapes;
use std::collections::HashMap;

/// One row of a pass: sequence `b` at time `t`, its step `s` and rank `r`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub b: usize,
    pub t: usize,
    pub s: usize,
    pub r: usize,
}

/// Where a value lives (see the module documentation). Addresses in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Home {
    Layout {
        base: u64,
        width: usize,
    },
    Steps {
        base: u64,
        len: usize,
    },
    Rank {
        base: u64,
        len: usize,
    },
    Fixed(u64),
    /// Rows of `width` floats: `after`, a `Layout` home's base, at the
    /// time of the step before (`t + 1` in `reverse`), or `initial`'s row
    /// `b` (`[batch, width]` in batch order) at a sequence's step 0.
    StateBefore {
        after: u64,
        initial: u64,
        width: usize,
        reverse: bool,
    },
}

/// How a matrix of rows is laid out for a GEMM over all rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// One row per layout row (padding rows hold anything).
    Layout,
    /// One row per `(step, rank)` (rows of ended sequences hold zeros).
    Steps,
}

impl Home {
    /// The address of `row`.
    pub fn addr(self, row: Row, layout: &RowLayout, batch: usize) -> u64 {
        let floats = |base: u64, at: usize| base + 4 * at as u64;
        match self {
            Home::Layout { base, width } => floats(base, layout.row(row.b, row.t) * width),
            Home::Steps { base, len } => floats(base, (row.s * batch + row.r) * len),
            Home::Rank { base, len } => floats(base, row.r * len),
            Home::Fixed(base) => base,
            Home::StateBefore { initial, width, .. } if row.s == 0 => floats(initial, row.b * width),
            Home::StateBefore { after, width, reverse, .. } => {
                floats(after, layout.row(row.b, time_before(row.t, reverse)) * width)
            }
        }
    }

    /// A `Steps` home one slot on: in a history, what step `s` writes
    /// (a next state, or an adjoint the step before reads).
    pub fn next_slot(self, batch: usize) -> Home {
        match self {
            Home::Steps { base, len } => Home::Steps { base: base + 4 * (batch * len) as u64, len },
            other => other,
        }
    }

    /// Step `s`'s rows, contiguous from rank 0: their address and stride.
    pub fn step_rows(self, s: usize, batch: usize) -> Option<(u64, usize)> {
        match self {
            Home::Steps { base, len } => Some((base + 4 * (s * batch * len) as u64, len)),
            Home::Rank { base, len } => Some((base, len)),
            _ => None,
        }
    }

    /// Floats of one row of a `Layout` home (its width); a `Steps` or
    /// `Rank` home's row length; 0 for a `Fixed` one.
    pub fn width(self) -> usize {
        match self {
            Home::Layout { width, .. } => width,
            Home::Steps { len, .. } | Home::Rank { len, .. } => len,
            Home::StateBefore { width, .. } => width,
            Home::Fixed(_) => 0,
        }
    }

    /// Every row as one matrix: its order, address and stride.
    pub fn all_rows(self) -> Option<(Order, u64, usize)> {
        match self {
            Home::Layout { base, width } => Some((Order::Layout, base, width)),
            Home::Steps { base, len } => Some((Order::Steps, base, len)),
            _ => None,
        }
    }
}

/// Where each part of a layer's tape lies in device memory from `base`
/// (a tape of `rows` layout rows, laid out as the layer's program says):
/// a `Layout` home each.
pub fn tape_homes(layer: &Layer, rows: usize, base: u64) -> Vec<(Kept, Home)> {
    let parts = layer.tape().ranges(rows);
    parts
        .map(|(part, at)| (part.kept, Home::Layout { base: base + 4 * at.start as u64, width: part.floats }))
        .collect()
}

/// Device buffers, freed last-allocated first (so the device's pool hands
/// the same addresses to the next pass that allocates the same way).
#[derive(Debug, Default)]
pub struct Arena(Vec<Buf>);

impl Arena {
    pub fn keep(&mut self, buf: Buf) -> u64 {
        let addr = buf.addr;
        self.0.push(buf);
        addr
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        while let Some(b) = self.0.pop() {
            drop(b);
        }
    }
}

/// One pass (a layer and direction, forwards or backwards) on a device:
/// its buffers, the homes of its values, and the batch's rows.
pub struct LayerRun<'a> {
    pub device: &'a dyn Device,
    pub layout: &'a RowLayout,
    pub order: &'a BatchOrder,
    pub reverse: bool,
    /// Rows of the caller's layout (padding included).
    pub layout_rows: usize,
    /// The precision of the products of matrix parameters ([`LayerRun::in_precision`]).
    pub precision: cellc::precision::Precision,
    /// Which route the time loop takes ([`LayerRun::with_step_loops`]).
    pub step_loops: super::step_loop::StepLoops,
    /// Time loops of this pass that ran as one step-loop launch.
    pub step_loops_taken: usize,
    homes: HashMap<ValueId, Home>,
    arena: Arena,
}

impl std::fmt::Debug for LayerRun<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerRun")
            .field("device", &self.device.name())
            .field("values", &self.homes.len())
            .finish()
    }
}

impl<'a> LayerRun<'a> {
    /// A pass over a batch of `layout_rows` rows laid out by `layout`.
    pub fn new(
        device: &'a dyn Device,
        layout: &'a RowLayout,
        layout_rows: usize,
        order: &'a BatchOrder,
        reverse: bool,
    ) -> LayerRun<'a> {
        LayerRun {
            device,
            layout,
            order,
            reverse,
            layout_rows,
            precision: cellc::precision::Precision::F32,
            step_loops: Default::default(),
            step_loops_taken: 0,
            homes: HashMap::new(),
            arena: Arena::default(),
        }
    }

    /// This pass with the products of matrix parameters in `precision`.
    pub fn in_precision(self, precision: cellc::precision::Precision) -> LayerRun<'a> {
        LayerRun { precision, ..self }
    }

    /// This pass with its time loop taking the route `step_loops` allows.
    pub fn with_step_loops(self, step_loops: super::step_loop::StepLoops) -> LayerRun<'a> {
        LayerRun { step_loops, ..self }
    }

    /// Places the pass's input leaves (features of the layer input at
    /// `input`) and mask leaves (units of the masks at `masks`), as its
    /// plan says, and uploads the graph's constants.
    pub fn place_leaves(
        &mut self,
        (graph, plan): (&Graph, &Shapes),
        pass: &PassPlan,
        (input, masks): (Home, Option<Home>),
        layer: &crate::cell::Layer,
    ) -> Result<()> {
        let Home::Layout { base, width } = input else {
            return Err(error("the layer input is not in the caller's layout"));
        };
        for (v, home) in pass.homes() {
            match home {
                PlanHome::Input(i) => {
                    self.place(v, Home::Layout { base: base + 4 * layer.input_slices[i].0 as u64, width })
                }
                PlanHome::Mask(i) => {
                    let missing = || error(format!("the pass reads mask {i}, which it was not given"));
                    let Some(Home::Layout { base, width }) = masks else { return Err(missing()) };
                    let (offset, _) = layer.mask_slices.get(i).copied().flatten().ok_or_else(missing)?;
                    self.place(v, Home::Layout { base: base + 4 * offset as u64, width });
                }
                _ => {}
            }
        }
        for (v, value) in plan.constant_values::<f32>(graph) {
            let at = self.upload(&value)?;
            self.place(v, Home::Fixed(at));
        }
        Ok(())
    }

    pub fn batch(&self) -> usize {
        self.order.batch()
    }

    pub fn steps(&self) -> usize {
        self.order.steps()
    }

    /// Rows of a `Steps` home: every `(step, rank)`.
    pub fn step_major_rows(&self) -> usize {
        self.steps() * self.batch()
    }

    /// `len` zeroed floats, kept for the pass.
    pub fn zeros(&mut self, len: usize) -> Result<u64> {
        let buf = self.device.zeros(len)?;
        Ok(self.arena.keep(buf))
    }

    pub fn upload(&mut self, data: &[f32]) -> Result<u64> {
        let buf = self.device.upload(data)?;
        Ok(self.arena.keep(buf))
    }

    pub fn upload_addresses(&mut self, addresses: &[u64]) -> Result<u64> {
        let buf = self.device.upload_addresses(addresses)?;
        Ok(self.arena.keep(buf))
    }

    pub fn upload_i32(&mut self, data: &[i32]) -> Result<u64> {
        let buf = self.device.upload_i32(data)?;
        Ok(self.arena.keep(buf))
    }

    pub fn place(&mut self, v: ValueId, home: Home) {
        self.homes.insert(v, home);
    }

    pub fn has_home(&self, v: ValueId) -> bool {
        self.homes.contains_key(&v)
    }

    pub fn home(&self, v: ValueId) -> Result<Home> {
        self.homes.get(&v).copied().ok_or_else(|| error(format!("no storage for {v}")))
    }

    /// A `Steps` home of `len` floats per row, zeroed, for `v`.
    pub fn place_steps(&mut self, v: ValueId, len: usize) -> Result<Home> {
        let home = Home::Steps { base: self.zeros(self.step_major_rows() * len)?, len };
        self.place(v, home);
        Ok(home)
    }

    /// A `Layout` home of `len` floats per row for `v`.
    pub fn place_layout(&mut self, v: ValueId, len: usize) -> Result<Home> {
        let home = Home::Layout { base: self.zeros(self.layout_rows * len)?, width: len };
        self.place(v, home);
        Ok(home)
    }

    /// A `Rank` home of `len` floats per row for `v`.
    pub fn place_rank(&mut self, v: ValueId, len: usize) -> Result<Home> {
        let home = Home::Rank { base: self.zeros(self.batch() * len)?, len };
        self.place(v, home);
        Ok(home)
    }

    /// The active rows of step `s`, in rank order.
    pub fn rows_at(&self, s: usize) -> Vec<Row> {
        let order = self.order.order();
        (0..self.order.batch_sizes()[s])
            .map(|r| Row { b: order[r], t: self.order.time(order[r], s, self.reverse), s, r })
            .collect()
    }

    /// Sequence `r`'s rows (by rank), in step order.
    pub fn sequence(&self, r: usize) -> Vec<Row> {
        let b = self.order.order()[r];
        (0..self.order.lengths()[b])
            .map(|s| Row { b, t: self.order.time(b, s, self.reverse), s, r })
            .collect()
    }

    /// Every valid row, sequence by sequence in rank order.
    pub fn valid_rows(&self) -> Vec<Row> {
        (0..self.batch()).flat_map(|r| self.sequence(r)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sequence::{Align, Major};

    #[test]
    fn rows_are_found_by_arithmetic() {
        let plan = BatchOrder::new(&[2, 3], 3).expect("plan");
        let layout = RowLayout::padded(&plan, 3, Major::BatchFirst, Align::Left);
        // Sequence 1 is the longer: rank 0.
        let row = Row { b: 1, t: 2, s: 2, r: 0 };
        assert_eq!(Home::Layout { base: 1000, width: 5 }.addr(row, &layout, 2), 1000 + 4 * (5 * 5));
        assert_eq!(Home::Steps { base: 1000, len: 3 }.addr(row, &layout, 2), 1000 + 4 * (2 * 2 * 3));
        assert_eq!(Home::Rank { base: 1000, len: 3 }.addr(Row { r: 1, ..row }, &layout, 2), 1000 + 12);
        assert_eq!(Home::Fixed(1000).addr(row, &layout, 2), 1000);
        assert_eq!(Home::Steps { base: 0, len: 3 }.step_rows(1, 2), Some((24, 3)));
        assert_eq!(Home::Fixed(8).step_rows(1, 2), None);
        // Slot s of the next slot is slot s + 1 of the history.
        let history = Home::Steps { base: 1000, len: 3 };
        assert_eq!(history.next_slot(2).addr(row, &layout, 2), history.addr(Row { s: 3, ..row }, &layout, 2));
    }
}
