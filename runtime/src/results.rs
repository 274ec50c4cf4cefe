//! What a pass gives back: a forward's [`Output`] and a backward's
//! [`Gradients`] in buffers the runtime makes, and where passes over the
//! caller's memory write ([`ForwardOut`], [`BackwardOut`]). The passes
//! themselves are the model's ([`crate::model::passes`]).

use crate::error::{Result, RuntimeError};

/// A forward pass's results.
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    /// Laid out like the input, `output_size` features per row, zeros at padding.
    pub data: Vec<f32>,
    /// One buffer per state, `[layers * directions, B, size]`, in PyTorch's order.
    pub final_states: Vec<Vec<f32>>,
}

/// Gradients of a backward pass.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients {
    /// Laid out like the input, zeros at padding.
    pub d_input: Vec<f32>,
    /// One buffer per state, `[layers * directions, B, size]`.
    pub d_h0: Vec<Vec<f32>>,
    /// Same structure as the model's parameters: `[layer * directions + direction][param]`.
    pub d_params: Vec<Vec<Vec<f32>>>,
}

/// Where a forward pass writes, laid out as [`Output`]'s fields.
#[derive(Debug)]
pub struct ForwardOut<'o> {
    /// Laid out like the input, `output_size` features per row; the
    /// padding rows are set to zero.
    pub output: &'o mut [f32],
    /// One buffer per state, `[layers * directions, B, size]`.
    pub final_states: Vec<&'o mut [f32]>,
}

/// Where a backward pass writes, laid out as [`Gradients`]' fields; every
/// buffer is overwritten (zeros at padding).
#[derive(Debug)]
pub struct BackwardOut<'o> {
    /// The input's gradient, laid out like the input.
    pub d_input: &'o mut [f32],
    /// One buffer per state, or none: the initial states' gradients are not wanted.
    pub d_h0: Vec<&'o mut [f32]>,
    /// The parameters' gradients, `[layer * directions + direction][param]`,
    /// each shaped as its parameter.
    pub d_params: Vec<Vec<&'o mut [f32]>>,
}

impl Gradients {
    /// Adds these gradients into `acc` (same structure), for accumulation over batches.
    pub fn accumulate_into(&self, acc: &mut Gradients) -> Result<()> {
        let same = acc.d_params.len() == self.d_params.len()
            && acc
                .d_params
                .iter()
                .zip(&self.d_params)
                .all(|(a, b)| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.len() == y.len()));
        if !same {
            return Err(RuntimeError::Shape {
                tensor: "gradient accumulator".into(),
                expected: "the model's parameter shapes".into(),
                found: "other shapes".into(),
            });
        }
        for (a, b) in acc.d_params.iter_mut().flatten().zip(self.d_params.iter().flatten()) {
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
        // Input and state gradients belong to one batch: added when the
        // shapes match (the same batch again), else replaced.
        if acc.d_h0.len() == self.d_h0.len()
            && acc.d_h0.iter().zip(&self.d_h0).all(|(a, b)| a.len() == b.len())
        {
            for (a, b) in acc.d_h0.iter_mut().zip(&self.d_h0) {
                a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
            }
        } else {
            acc.d_h0 = self.d_h0.clone();
        }
        if acc.d_input.len() == self.d_input.len() {
            acc.d_input.iter_mut().zip(&self.d_input).for_each(|(x, y)| *x += y);
        } else {
            acc.d_input = self.d_input.clone();
        }
        Ok(())
    }
}
