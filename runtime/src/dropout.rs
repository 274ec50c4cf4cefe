//! Dropout between layers, as PyTorch's `nn.LSTM(dropout=p)`: in a
//! training pass, every layer's output but the last is multiplied by a
//! mask of zeros and `1 / (1 - p)` before the next layer reads it, and the
//! backward multiplies the adjoint reaching that output by the same mask,
//! drawn again (nothing of the mask is stored). Inference passes and
//! streams never drop.
//!
//! Masks come from cellc's one generator ([`cellc::random`]): unit `u` of
//! direction `d`'s features of layer `k`'s output, for the sequence at
//! index `b` of the caller's batch at its step `t`, is kept by
//! `draw(MaskStream { seed, offset, layer: k, direction: d, mask:
//! BETWEEN_LAYERS }.key(), b, t, u)`. So a mask does not depend on the
//! batch's order, alignment, padding or packing, the thread count or the
//! device; the call's [`MaskSeed`] chooses it.

use crate::backend::cpu::masks::{fill, MaskRow};
use crate::backend::cpu::threads;
use crate::backend::cpu::SharedRows;
use crate::error::{Result, RuntimeError};
use crate::exec::Input;
use crate::model::Model;
use crate::sequence::LaidOutBatch;
use cellc::random::{threshold, MaskStream};

/// The seed and offset a training call draws its masks from (a
/// framework's generator gives both; consecutive calls use new offsets).
/// The same seed and offset give the same masks, in the forward and in its
/// backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MaskSeed {
    /// The generator's seed.
    pub seed: u64,
    /// The call's offset in the generator's stream.
    pub offset: u64,
}

/// The index of between-layer dropout among a layer's masks (a cell's own
/// masks are numbered from 0, in declaration order).
pub const BETWEEN_LAYERS: u32 = 0x7FFF;

/// The between-layer dropout of one training pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct BetweenLayers {
    pub(crate) rate: f32,
    pub(crate) seed: MaskSeed,
}

impl BetweenLayers {
    /// The dropout of a training pass of a model with `rate` drawing from
    /// `seed`: none at rate 0.
    pub(crate) fn of(rate: f32, seed: MaskSeed) -> Option<BetweenLayers> {
        (rate > 0.0).then_some(BetweenLayers { rate, seed })
    }

    /// The masks over layer `layer`'s output: `directions` side by side,
    /// `units` features each.
    pub(crate) fn after(&self, layer: usize, directions: usize, units: usize) -> LayerMasks {
        let key = |direction: usize| {
            let MaskSeed { seed, offset } = self.seed;
            let (layer, direction) = (layer as u32, direction as u32);
            MaskStream { seed, offset, layer, direction, mask: BETWEEN_LAYERS }.key()
        };
        LayerMasks {
            keys: (0..directions).map(key).collect(),
            threshold: threshold(self.rate),
            scale: 1.0 / (1.0 - self.rate),
            units,
        }
    }
}

/// The masks a device multiplies one layer's output rows by (or the
/// adjoint of those rows): each direction's key, side by side in a row.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerMasks {
    /// Each direction's key ([`cellc::random::MaskStream::key`]).
    pub keys: Vec<[u32; 2]>,
    /// A unit is kept where its bits reach this ([`cellc::random::threshold`]).
    pub threshold: u32,
    /// What a kept unit is multiplied by: `1 / (1 - rate)`.
    pub scale: f32,
    /// Features of one direction (its units).
    pub units: usize,
}

/// Checks a dropout rate: in `[0, 1)`.
pub(crate) fn check_rate(name: &str, rate: f32) -> Result<()> {
    if (0.0..1.0).contains(&rate) {
        return Ok(());
    }
    Err(RuntimeError::Rate { name: name.into(), message: format!("is {rate}; a rate must be in [0, 1)") })
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

impl Model {
    /// The masks a call in training mode drawing from `masks` multiplies
    /// each layer's output by (every layer's but the last), so that the
    /// same computation can be rebuilt elsewhere: one buffer per layer
    /// boundary, laid out like `input` with the layer's output features
    /// (`output_size * directions`) per row, each value 0 (dropped) or
    /// `1 / (1 - rate)` (kept), zeros at padding. Empty without dropout.
    /// `rate`: the call's rate ([`crate::Call::dropout`]); `None`: the model's.
    pub fn dropout_masks(&self, input: Input, masks: MaskSeed, rate: Option<f32>) -> Result<Vec<Vec<f32>>> {
        let (shape, data) = input.split();
        let batch = self.lay_out(&shape, data.len())?;
        let Some(dropout) = BetweenLayers::of(self.dropout_rate(rate)?, masks) else { return Ok(Vec::new()) };
        let dirs = self.directions();
        let boundaries = &self.layers[..self.layers.len().saturating_sub(1)];
        Ok(boundaries
            .iter()
            .enumerate()
            .map(|(k, layer)| {
                let width = layer.output_size * dirs;
                let mut rows = vec![0.0f32; batch.rows * width];
                for b in 0..batch.order.batch() {
                    for t in 0..batch.order.lengths()[b] {
                        let at = batch.layout.row(b, t) * width;
                        rows[at..at + width].fill(1.0);
                    }
                }
                // SAFETY: `rows` is this function's, of the batch's layout rows.
                unsafe {
                    apply_on_host(
                        rows.as_mut_ptr(),
                        (width, 0),
                        &batch,
                        &dropout.after(k, dirs, layer.output_size),
                    )
                };
                rows
            })
            .collect())
    }
}
