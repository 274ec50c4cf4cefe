//! Rates and random masks: what a cell's `rate` declarations and its calls
//! of `dropout`, `variational_dropout`, `zoneout` and `dropconnect` mean.
//!
//! A rate is a probability named in the cell, with a default, that a
//! caller may change per model and per call. Each call of a mask function
//! in a cell is one [`MaskDecl`]: its own random stream, drawn by the
//! runtime from the call's seed (see [`crate::random`]) with a new mask
//!
//! - every step of every sequence ([`MaskFn::Dropout`], [`MaskFn::Zoneout`]),
//! - once per sequence, shared by its steps ([`MaskFn::VariationalDropout`]),
//! - once per call, shared by every row ([`MaskFn::DropConnect`]).
//!
//! In the step graph a mask of the first two kinds is a leaf,
//! [`super::Op::Mask`], a vector the runtime fills: in training each unit
//! is [`MaskFn::kept`] with probability `1 - p` and [`MaskFn::dropped`]
//! with probability `p`; in evaluation every unit is [`MaskFn::evaluation`].
//! The functions are ordinary arithmetic on that leaf, so autodiff,
//! scheduling and every back end handle them as they handle an input:
//!
//! - `dropout(v, p)` and `variational_dropout(v, p)` are `v * m`, with
//!   `m` `1/(1-p)` or `0` in training and `1` in evaluation;
//! - `zoneout(old, new, p)` is `m * new + (1 - m) * old`, with `m` `1`
//!   (the new value) or `0` (the old one) in training and `1 - p` in
//!   evaluation, the expectation `p * old + (1 - p) * new`.
//!
//! A DropConnect mask has no leaf: it masks a parameter matrix itself,
//! which the runtime replaces for the call by `W * m` (`m` `1/(1-p)` or `0`
//! in training, `1` in evaluation), and whose gradient it masks the same way.

use crate::diag::Span;

/// A `rate NAME = default` declaration.
#[derive(Clone, Debug, PartialEq)]
pub struct RateDecl {
    /// The rate's name, by which callers set it.
    pub name: String,
    /// Its value unless a caller sets another: in `[0, 1)`.
    pub default: f64,
    /// Where it is declared.
    pub span: Span,
}

/// Which mask function a call is: how often its mask is drawn and what a
/// unit of it is worth (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MaskFn {
    /// `dropout(v, p)`: a new mask every step.
    Dropout,
    /// `variational_dropout(v, p)`: one mask per sequence.
    VariationalDropout,
    /// `zoneout(old, new, p)`: a new mask every step, choosing between two values.
    Zoneout,
    /// `dropconnect(W, p)`: one mask per call over a parameter matrix.
    DropConnect,
}

/// How often a mask is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MaskPeriod {
    /// Every step of every sequence.
    Step,
    /// Once per sequence, shared by its steps.
    Sequence,
    /// Once per call, shared by every sequence and step.
    Call,
}

impl MaskFn {
    /// Every mask function.
    pub const ALL: [MaskFn; 4] =
        [MaskFn::Dropout, MaskFn::VariationalDropout, MaskFn::Zoneout, MaskFn::DropConnect];

    /// The function's source name.
    pub fn name(self) -> &'static str {
        match self {
            MaskFn::Dropout => "dropout",
            MaskFn::VariationalDropout => "variational_dropout",
            MaskFn::Zoneout => "zoneout",
            MaskFn::DropConnect => "dropconnect",
        }
    }

    /// The mask function called `name`, if it is one.
    pub fn from_builtin(name: &str) -> Option<MaskFn> {
        MaskFn::ALL.into_iter().find(|f| f.name() == name)
    }

    /// How often its mask is drawn.
    pub fn period(self) -> MaskPeriod {
        match self {
            MaskFn::Dropout | MaskFn::Zoneout => MaskPeriod::Step,
            MaskFn::VariationalDropout => MaskPeriod::Sequence,
            MaskFn::DropConnect => MaskPeriod::Call,
        }
    }

    /// A kept unit's value at rate `p` in training.
    /// (Computed in f32, as every back end and PyTorch's dropout scale it.)
    pub fn kept(self, p: f32) -> f32 {
        match self {
            MaskFn::Zoneout => 1.0,
            _ => 1.0 / (1.0 - p),
        }
    }

    /// A dropped unit's value in training.
    pub fn dropped(self) -> f32 {
        0.0
    }

    /// Every unit's value at rate `p` in evaluation.
    pub fn evaluation(self, p: f32) -> f32 {
        match self {
            MaskFn::Zoneout => 1.0 - p,
            _ => 1.0,
        }
    }
}

/// The most mask calls a cell may make: a mask's id is 15 bits of the
/// generator's key, and the last id is dropout between layers'.
pub const MAX_MASKS: usize = 0x7FFF;

/// One call of a mask function in a cell: one random stream, whose id is
/// its index in the cell's masks.
#[derive(Clone, Debug, PartialEq)]
pub struct MaskDecl {
    /// Which function.
    pub function: MaskFn,
    /// The index of its rate in the cell's rates.
    pub rate: usize,
    /// For `dropconnect`, the index of the parameter it masks.
    pub param: Option<usize>,
    /// The mask's type: the vector it masks, or the parameter's matrix.
    pub ty: super::Type,
    /// Where the call is.
    pub span: Span,
}
