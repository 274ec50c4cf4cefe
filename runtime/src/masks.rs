//! The masks of a cell's own mask functions (`dropout`,
//! `variational_dropout`, `zoneout`, `dropconnect`: see
//! [`cellc::ir::masks`]) in one pass of one layer and direction.
//!
//! A pass's masks come from the call's [`MaskSeed`] (training) or from
//! none (evaluation), and from the rates the call runs at: the cell's
//! defaults, the model's ([`Model::with_rates`]) or the call's own. Mask
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

use crate::backend::cpu::masks::{fill, MaskRow};
use crate::backend::cpu::threads;
use crate::backend::cpu::SharedRows;
use crate::cell::Layer;
use crate::dropout::{check_rate, MaskSeed};
use crate::error::{Result, RuntimeError};
use crate::model::Model;
use crate::sequence::LaidOutBatch;
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
    /// Units `0..out.len()` of the mask of the sequence at index
    /// `sequence` of the caller's batch at its step `step` (either ignored
    /// where the mask is shared over it).
    pub fn row(&self, sequence: usize, step: usize, out: &mut [f32]) {
        let Some(d) = self.drawn else { return out.fill(self.evaluation) };
        let (sequence, step) = self.coordinates(sequence, step);
        fill(MaskRow { key: d.key, sequence, step, threshold: d.threshold, scale: d.kept }, 0, out);
    }

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

/// Fills `row` (`rows.width` floats) with the masks of every row where
/// they are the same for every row (evaluation).
pub(crate) fn fill_shared_row(row: &mut [f32], rows: &MaskRows) {
    for m in &rows.fills {
        m.row(0, 0, &mut row[m.offset..m.offset + m.units]);
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
                    _ => m.row(b, t, out),
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
    fill.row(0, 0, &mut mask);
    weights.iter_mut().zip(&mask).for_each(|(w, m)| *w *= m);
}

impl Model {
    /// The names of the cell's rates, in the order [`Model::rates`] and a
    /// call's rates list them.
    pub fn rate_names(&self) -> Vec<&str> {
        self.compiled.forward.rates.iter().map(|r| r.name.as_str()).collect()
    }

    /// The rate of each of the cell's `rate`s that the model's passes run
    /// at (unless a call gives its own): the cell's defaults, or as
    /// [`Model::with_rates`] set them.
    pub fn rates(&self) -> &[f32] {
        &self.rates
    }

    /// The model with the rates named in `rates` set (others keep theirs):
    /// each must be a `rate` of the cell and in `[0, 1)`.
    pub fn with_rates(mut self, rates: &[(&str, f32)]) -> Result<Model> {
        self.rates = self.rates_with(rates)?;
        Ok(self)
    }

    /// The model's rates with those named in `rates` changed, checked: a
    /// call's own rates ([`crate::Call::rates`]).
    pub fn rates_with(&self, rates: &[(&str, f32)]) -> Result<Vec<f32>> {
        self.change_rates(&self.rates, rates)
    }

    /// Whether a training pass draws masks: the cell has mask calls of its
    /// own, or the model drops out between layers.
    pub fn draws_masks(&self) -> bool {
        !self.compiled.forward.masks.is_empty() || (self.dropout > 0.0 && self.layers.len() > 1)
    }

    /// `base` (one rate per rate of the cell) with those named in `rates`
    /// changed, checked: each name once, a rate of the cell, in `[0, 1)`.
    pub fn change_rates(&self, base: &[f32], rates: &[(&str, f32)]) -> Result<Vec<f32>> {
        let mut out = base.to_vec();
        for (k, &(name, p)) in rates.iter().enumerate() {
            if rates[..k].iter().any(|&(earlier, _)| earlier == name) {
                return Err(RuntimeError::Rate {
                    name: name.into(),
                    message: "is given twice: give each rate once".into(),
                });
            }
            let Some(i) = self.compiled.forward.rate_index(name) else {
                let known = self.rate_names().iter().map(|n| format!("`{n}`")).collect::<Vec<_>>();
                let known = if known.is_empty() { "none".to_string() } else { known.join(", ") };
                return Err(RuntimeError::Rate {
                    name: name.into(),
                    message: format!(
                        "is not a rate of cell `{}` (its rates: {known})",
                        self.compiled.forward.name
                    ),
                });
            };
            check_rate(name, p)?;
            out[i] = p;
        }
        Ok(out)
    }

    /// The masking of a caller's pass: training if it gives `seed`, at
    /// its own `rates` (one per rate of the cell, checked) or the model's.
    pub(crate) fn caller_masking(
        &self,
        seed: Option<MaskSeed>,
        rates: Option<&[f32]>,
    ) -> Result<CellMasking> {
        let rates = match rates {
            None => self.rates.clone(),
            Some(r) => {
                let names = self.rate_names();
                if r.len() != names.len() {
                    return Err(RuntimeError::Shape {
                        tensor: "rates".into(),
                        expected: format!(
                            "[{}] (one per rate of the cell: {})",
                            names.len(),
                            names.join(", ")
                        ),
                        found: format!("[{}]", r.len()),
                    });
                }
                for (name, &p) in names.iter().zip(r) {
                    check_rate(name, p)?;
                }
                r.to_vec()
            }
        };
        Ok(CellMasking { seed, rates })
    }
}

/// The masks of one of a cell's mask calls in one layer and direction, as
/// a call drew them ([`Model::cell_masks`]).
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

impl Model {
    /// The masks of the cell's own mask calls that a call over `input` in
    /// training mode drawing from `seed` (or in evaluation, `None`) at
    /// `rates` (`None`: the model's) uses, in every layer and direction,
    /// so that the same computation can be rebuilt elsewhere. With
    /// [`Model::dropout_masks`], every random number a call uses.
    pub fn cell_masks(
        &self,
        input: crate::exec::Input,
        seed: Option<MaskSeed>,
        rates: Option<&[f32]>,
    ) -> Result<Vec<SeenMask>> {
        let (shape, data) = input.split();
        let batch = self.lay_out(&shape, data.len())?;
        let masking = self.caller_masking(seed, rates)?;
        let cell = &self.compiled.forward;
        let mut out = Vec::new();
        for (k, layer) in self.layers.iter().enumerate() {
            for d in 0..self.directions() {
                let suffix = format!("_l{k}{}", if d == 1 { "_reverse" } else { "" });
                let name = |mask: usize| format!("{}#{mask}{suffix}", cell.masks[mask].function.name());
                let (rows, connect) = masking.of_layer(cell, layer, k, d);
                if let Some(rows) = rows {
                    let mut all = vec![0.0f32; batch.rows * rows.width];
                    // SAFETY: `all` is this function's, of the batch's layout rows of `rows.width` floats.
                    unsafe { fill_on_host(all.as_mut_ptr(), &batch, &rows) };
                    let valid = crate::sequence::padding_rows(&batch.order, &batch.layout, batch.rows);
                    crate::sequence::zero_rows(&mut all, rows.width, &valid);
                    for m in &rows.fills {
                        let values = all
                            .chunks(rows.width)
                            .flat_map(|r| &r[m.offset..m.offset + m.units])
                            .copied()
                            .collect();
                        out.push(SeenMask { name: name(m.mask), shape: vec![batch.rows, m.units], values });
                    }
                }
                for (param, m) in connect {
                    let (r, c) = layer.param_shapes[param];
                    let mut values = vec![0.0f32; r * c];
                    m.row(0, 0, &mut values);
                    let shape = if c == 1 { vec![r] } else { vec![r, c] };
                    out.push(SeenMask { name: name(m.mask), shape, values });
                }
            }
        }
        Ok(out)
    }
}
