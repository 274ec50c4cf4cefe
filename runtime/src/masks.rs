//! The masks of a cell's own mask functions (`dropout`,
//! `variational_dropout`, `zoneout`, `dropconnect`: see
//! [`cellc::ir::masks`]) in one pass of one layer and direction.
//!
//! A pass's masks come from the call's [`MaskSeed`] (training) or from
//! none (evaluation), and from the rates the call runs at: the cell's
//! defaults, the model's ([`crate::Model::with_rates`]) or the call's own. Mask
//! `i`'s unit `u` of the sequence at index `b` of the caller's batch at its
//! step `t` is kept by `draw(MaskStream { seed, offset, layer, direction,
//! mask: i }.key(), b, t, u)`, where a per-sequence mask draws at step
//! [`SHARED`] and a per-call (DropConnect) one at sequence and step
//! [`SHARED`]. So, as for dropout between layers, a mask does not depend
//! on the batch's order, alignment, padding or packing, the threads or the
//! device, and a backward draws again what its forward drew: nothing of a
//! mask is kept between them.
//!
//! The masks a step reads (all but DropConnect's) are filled before a
//! layer and direction runs, side by side in rows laid out like the
//! layer's input ([`MaskRows`]), which the devices read as they read an
//! input. DropConnect's mask multiplies the parameter itself for the pass
//! and, in the backward, its gradient.

use crate::cell::Layer;
use crate::dropout::MaskSeed;
use cellc::ir::{Cell, MaskPeriod};
use cellc::random::{threshold, MaskStream, SHARED};

/// The masking of a caller's pass: training (with the seed its masks are
/// drawn from) or evaluation, and the rate of each of the cell's `rate`s.
#[derive(Clone, Debug, PartialEq)]
pub struct CellMasking {
    /// Training mode: the call's seed; `None`: evaluation.
    pub seed: Option<MaskSeed>,
    /// One per `rate` of the cell, in declaration order.
    pub rates: Vec<f32>,
}

/// Where a training pass draws one mask from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Drawn {
    /// The mask's key ([`MaskStream::key`]).
    pub key: [u32; 2],
    /// A unit is kept where its bits reach this ([`cellc::random::threshold`]).
    pub threshold: u32,
    /// A kept unit's value ([`cellc::ir::MaskFn::kept`]); a dropped one is 0.
    pub kept: f32,
}

/// How one mask of one pass of one layer and direction is filled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MaskFill {
    /// Which of the cell's masks.
    pub mask: usize,
    /// How often it is drawn.
    pub period: MaskPeriod,
    /// Its units: a row's (or, for DropConnect, its parameter's floats).
    pub units: usize,
    /// Where its units start in a row of [`MaskRows`] (0 for DropConnect).
    pub offset: usize,
    /// Training: where it is drawn from; `None`: evaluation, every unit
    /// [`MaskFill::evaluation`].
    pub drawn: Option<Drawn>,
    /// Every unit's value in evaluation ([`cellc::ir::MaskFn::evaluation`]).
    pub evaluation: f32,
}

impl MaskFill {
    /// The generator's sequence and step for the mask of the sequence at
    /// index `sequence` of the caller's batch at its step `step`:
    /// [`SHARED`] where the mask is shared over them.
    pub fn coordinates(&self, sequence: usize, step: usize) -> (u32, u32) {
        match self.period {
            MaskPeriod::Step => (sequence as u32, step as u32),
            MaskPeriod::Sequence => (sequence as u32, SHARED),
            MaskPeriod::Call => (SHARED, SHARED),
        }
    }
}

/// A layer and direction's DropConnect masks: each masked parameter's
/// index and its mask.
pub type DropConnect = Vec<(usize, MaskFill)>;

/// The masks a layer and direction's steps read, one row per layout row
/// of the batch: `width` floats, each mask's units from its
/// [`MaskFill::offset`] (the layer's [`cellc::program::Program::mask_slices`]).
#[derive(Clone, Debug, PartialEq)]
pub struct MaskRows {
    /// Each mask a step reads (none of DropConnect's).
    pub fills: Vec<MaskFill>,
    /// Floats per row.
    pub width: usize,
}

impl CellMasking {
    /// The masks of layer `index` (running `layer`) in `direction`: those
    /// its steps read, and its DropConnect masks. `None` for a cell
    /// without masks.
    pub(crate) fn of_layer(
        &self,
        cell: &Cell,
        layer: &Layer,
        index: usize,
        direction: usize,
    ) -> (Option<MaskRows>, DropConnect) {
        let mut steps = Vec::new();
        let mut connect = Vec::new();
        for (i, decl) in cell.masks.iter().enumerate() {
            let p = self.rates.get(decl.rate).copied().unwrap_or(0.0);
            let drawn = self.seed.map(|MaskSeed { seed, offset }| {
                let (layer, direction, mask) = (index as u32, direction as u32, i as u32);
                Drawn {
                    key: MaskStream { seed, offset, layer, direction, mask }.key(),
                    threshold: threshold(p),
                    kept: decl.function.kept(p),
                }
            });
            let (offset, units) = match (decl.param, layer.mask_slices.get(i).copied().flatten()) {
                (Some(param), _) => {
                    let (r, c) = layer.param_shapes[param];
                    (0, r * c)
                }
                (None, Some(slice)) => slice,
                (None, None) => continue,
            };
            let fill = MaskFill {
                mask: i,
                period: decl.function.period(),
                units,
                offset,
                drawn,
                evaluation: decl.function.evaluation(p),
            };
            match decl.param {
                Some(param) => connect.push((param, fill)),
                None => steps.push(fill),
            }
        }
        let rows = (!steps.is_empty()).then(|| MaskRows { fills: steps, width: layer.mask_width });
        (rows, connect)
    }
}

/// The masks of one of a cell's mask calls in one layer and direction, as
/// a call drew them ([`crate::Model::cell_masks`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SeenMask {
    /// `<function>#<mask>_l<layer>` (`_reverse` for the reverse
    /// direction), as `zoneout#0_l0`.
    pub name: String,
    /// Its shape: `[rows of the input's layout, units]` for a mask a step
    /// reads (laid out like the input, zeros at padding), the parameter's
    /// shape for a DropConnect mask.
    pub shape: Vec<usize>,
    /// Its values: what each unit multiplies (see [`cellc::ir::masks`]).
    pub values: Vec<f32>,
}
