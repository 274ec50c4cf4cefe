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

use crate::error::{Result, RuntimeError};
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
