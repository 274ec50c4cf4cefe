//! Passes over memory the caller owns. A framework (PyTorch, candle) hands
//! its own tensors: the input, the weights (each call, so that weight swaps
//! such as FSDP's or weight-drop's are seen), the outputs, and the reserve
//! in which a training forward keeps what the backward reads, which the
//! framework's autograd holds between the two as one of its tensors
//! (cuDNN's "reserve space"). Nothing is copied but what the layout needs.

use crate::error::{Result, RuntimeError};
use crate::exec::{BackwardOut, BatchShape, ForwardOut, Input, Keep, Kept, LaidOutBatch, PassParams};
use crate::model::Model;

/// The inputs of a pass on the caller's memory.
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    pub input: Input<'a>,
    /// `[layer * directions + direction][param]`, in the cell's order and
    /// the model's shapes ([`Model::weight_names`]); `None`: the model's own.
    pub weights: Option<&'a [Vec<&'a [f32]>]>,
    /// Initial states, `[layers * directions, B, size]` each; `None`: zeros.
    pub h0: Option<&'a [&'a [f32]]>,
}

impl Model {
    /// Checks a batch of `shape` with `data_len` floats of input against
    /// the model without running it: the errors a pass would give.
    pub fn check_batch(&self, shape: &BatchShape, data_len: usize) -> Result<()> {
        self.lay_out(shape, data_len).map(|_| ())
    }

    /// The call's batch laid out and checked to fit in memory, and its weights.
    fn laid_out<'a>(&'a self, call: &Call<'a>, training: bool) -> Result<(LaidOutBatch, PassParams<'a>)> {
        let p = self.prepare(&call.input)?;
        self.ensure_pass_fits(&p, training)?;
        let params = match call.weights {
            Some(w) => self.caller_params(w)?,
            None => self.own_params()?,
        };
        Ok((p, params))
    }

    /// A forward pass writing `out`. With a `reserve` of
    /// [`Model::reserve_floats_per_row`] floats per layout row, it keeps
    /// there what [`Model::backward_from`] reads (where the back end keeps
    /// its tapes itself, the reserve is empty and the backward runs the
    /// forward again).
    pub fn forward_into(&self, call: &Call, out: ForwardOut, reserve: Option<&mut [f32]>) -> Result<()> {
        let (p, params) = self.laid_out(call, reserve.is_some())?;
        let batch = p.order.batch();
        let h0 = self.states_or_zeros(call.h0, batch, "h0")?;
        self.check_states(out.final_states.len(), |i| out.final_states[i].len(), batch, "final_states")?;
        let keep = match reserve {
            None => Keep::Nothing,
            Some(r) if r.is_empty() && self.reserve_floats_per_row().is_none() => Keep::Nothing,
            Some(r) => Keep::Reserve(r),
        };
        self.run_forward(&call.input, &p, &params, &h0, out, keep)?;
        Ok(())
    }

    /// The backward of a [`Model::forward_into`] with the same `call` and
    /// its `reserve`: `d_output` is laid out like the output, `d_final`
    /// (optional) like the final states.
    pub fn backward_from(
        &self,
        call: &Call,
        reserve: &[f32],
        d_output: &[f32],
        d_final: Option<&[&[f32]]>,
        out: BackwardOut,
    ) -> Result<()> {
        let (p, params) = self.laid_out(call, true)?;
        let batch = p.order.batch();
        let d_final = self.states_or_zeros(d_final, batch, "grad_final")?;
        if !out.d_h0.is_empty() {
            self.check_states(out.d_h0.len(), |i| out.d_h0[i].len(), batch, "grad_h0")?;
        }
        if self.reserve_floats_per_row().is_some() {
            let kept = Kept::Reserve(reserve);
            return self.run_backward(&call.input, &p, &params, &kept, d_output, &d_final, out);
        }
        if !reserve.is_empty() {
            return Err(RuntimeError::Shape {
                tensor: "reserve".into(),
                expected: format!("0 floats (the {} back end keeps its tapes itself)", self.backend_name()),
                found: format!("{} floats", reserve.len()),
            });
        }
        // The back end keeps its tapes itself: run the forward again for them.
        let h0 = self.states_or_zeros(call.h0, batch, "h0")?;
        let mut output = vec![0.0f32; p.rows * self.output_size()];
        let mut finals: Vec<Vec<f32>> = h0.iter().map(|b| vec![0.0; b.len()]).collect();
        let scratch = ForwardOut {
            output: &mut output,
            final_states: finals.iter_mut().map(Vec::as_mut_slice).collect(),
        };
        let kept = self
            .run_forward(&call.input, &p, &params, &h0, scratch, Keep::Tapes)?
            .ok_or_else(|| RuntimeError::Internal("training forward kept no tapes".into()))?;
        self.run_backward(&call.input, &p, &params, &kept, d_output, &d_final, out)
    }
}
