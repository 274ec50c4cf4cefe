//! How one call runs, beside the memory it reads and writes: the options
//! every entry point takes in one struct ([`CallOptions`]), and the same
//! options settled against the model (`Settled`), as the driver runs
//! them and a training forward keeps them for its backward.
//!
//! A new option is a field of [`CallOptions`], what it settles into in
//! `Settled` (`Model::settle` decides that once), and the driver's use
//! of it; every entry point, host or device memory, the model's own
//! passes or a caller's, then has it.

use crate::dropout::{BetweenLayers, MaskSeed};
use crate::masks::CellMasking;
use cellc::precision::Precision;

/// How a call runs; every field's default is the model's setting (or, for
/// `masks`, evaluation mode). Set fields with struct update syntax:
/// `CallOptions { masks: Some(seed), ..Default::default() }`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CallOptions<'a> {
    /// Training mode: where the call draws the masks of the model's
    /// dropout ([`crate::Model::with_dropout`]) and of the cell's own
    /// `dropout`s; give its backward the same. `None`: evaluation mode,
    /// nothing dropped (as PyTorch's `module.eval()`, with or without a
    /// reserve).
    pub masks: Option<MaskSeed>,
    /// The rate of each of the cell's `rate`s for this call, in the order
    /// of [`crate::Model::rate_names`] ([`crate::Model::rates_with`] makes
    /// one by name); `None`: the model's ([`crate::Model::rates`]). Give
    /// its backward the same.
    pub rates: Option<&'a [f32]>,
    /// The rate of dropout between layers for this call (in training
    /// mode, as `masks` says); `None`: the model's
    /// ([`crate::Model::with_dropout`]). Give its backward the same.
    pub dropout: Option<f32>,
    /// Per-step resets: one flag per row of the input's layout (a padded
    /// batch's `[B, T]` or `[T, B]`, as its input; a packed batch's `[N]`),
    /// `true` where the state restarts from the initial state before that
    /// step is computed; flags at padding and at a sequence's first step
    /// change nothing. Give its backward the same. The initial states'
    /// gradients sum every segment's (see [`crate::resets`]).
    pub resets: Option<&'a [bool]>,
    /// The precision of the products of matrix parameters for this call
    /// (an error where the device has no such products, see
    /// [`crate::backend::Device::precision`]); `None`: the model's
    /// ([`crate::Model::with_precision`]). Give its backward the same.
    pub precision: Option<Precision>,
}

/// A call's options settled against its model: what its pass runs.
#[derive(Clone, Debug)]
pub(crate) struct Settled {
    /// Training mode: the dropout between layers, if any.
    pub(crate) dropout: Option<BetweenLayers>,
    /// Training or evaluation, and the rates, of the cell's own masks.
    pub(crate) masking: CellMasking,
    /// The precision of the products, one the device computes.
    pub(crate) precision: Precision,
}
