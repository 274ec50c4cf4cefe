//! The checks every pass makes against the model before it runs: the
//! caller's batch laid out and checked ([`LaidOutBatch`]), the pass's
//! size against memory, and the initial states' and the weights' shapes,
//! each error naming the tensor and its shape.

use crate::error::{Result, RuntimeError};
use crate::input::{BatchShape, Input};
use crate::model::Model;
use crate::sequence::{check_len, BatchOrder, Floats, LaidOutBatch, RowLayout};

impl Model {
    pub(crate) fn prepare(&self, input: &Input) -> Result<LaidOutBatch> {
        let (shape, data) = input.split();
        self.lay_out(&shape, data.len())
    }

    /// A batch of `shape` with `data_len` floats of data, checked and laid out.
    pub(crate) fn lay_out(&self, shape: &BatchShape, data_len: usize) -> Result<LaidOutBatch> {
        match *shape {
            BatchShape::Padded { batch, steps, major, align, lengths } => {
                if lengths.len() != batch {
                    return Err(RuntimeError::Shape {
                        tensor: "lengths".into(),
                        expected: format!("[{batch}]"),
                        found: format!("[{}]", lengths.len()),
                    });
                }
                check_len("input", data_len, &[batch, steps, self.input_size()])?;
                let order = BatchOrder::new(lengths, steps)?;
                let layout = RowLayout::padded(&order, steps, major, align);
                Ok(LaidOutBatch {
                    order,
                    layout,
                    rows: batch * steps,
                    data_features: self.input_size(),
                    segments: None,
                })
            }
            BatchShape::Packed(p) => {
                if p.features != self.input_size() {
                    return Err(RuntimeError::Shape {
                        tensor: "input".into(),
                        expected: format!("{} features", self.input_size()),
                        found: format!("{} features", p.features),
                    });
                }
                let order = p.order(data_len)?;
                let layout = RowLayout::packed(&order);
                Ok(LaidOutBatch {
                    rows: order.rows(),
                    order,
                    layout,
                    data_features: p.features,
                    segments: None,
                })
            }
        }
    }

    /// Refuses a pass whose buffers cannot fit in memory, before allocating
    /// them. A lower bound of what the pass holds at once: every layer's
    /// output rows; each state four times per sequence (initial, final, and
    /// the back end's current and next); training, one copy of the states
    /// per row for the backward.
    pub(crate) fn ensure_pass_fits(&self, p: &LaidOutBatch, training: bool) -> Result<()> {
        let (rows, batch) = (p.rows as u128, p.order.batch() as u128);
        let dirs = self.directions() as u128;
        let mut elements = 0u128;
        for layer in &self.layers {
            let states: u128 = layer.state_sizes.iter().map(|&n| n as u128).sum::<u128>() * dirs;
            elements += rows * layer.output_size as u128 * dirs + 4 * batch * states;
            if training {
                elements += p.order.rows() as u128 * states;
            }
        }
        crate::memory::ensure_fits(
            || {
                let pass = if training { "a training pass" } else { "a forward pass" };
                let (b, r) = (p.order.batch(), p.order.rows());
                let seqs = if b == 1 { "sequence" } else { "sequences" };
                format!("{pass} of cell `{}` over {b} {seqs} ({r} steps in all)", self.compiled.forward.name)
            },
            crate::memory::f32_bytes(elements),
        )
    }

    pub(crate) fn input_data<'a>(input: &Input<'a>) -> &'a [f32] {
        match input {
            Input::Padded { data, .. } => data,
            Input::Packed(p) => p.data,
        }
    }

    /// The shape of each state tensor (initial or final) of a batch of
    /// `batch` sequences: `[layers * directions, B, size]`, as nn.LSTM's `(h, c)`.
    pub fn state_shapes(&self, batch: usize) -> Vec<[usize; 3]> {
        let ld = self.layers.len() * self.directions();
        self.layers.first().map_or(&[][..], |l| &l.state_sizes[..]).iter().map(|&n| [ld, batch, n]).collect()
    }

    /// Checks that `count` state buffers of `len(i)` floats are `[L*D, B, size]` each.
    pub(crate) fn check_states(
        &self,
        count: usize,
        len: impl Fn(usize) -> usize,
        batch: usize,
        what: &str,
    ) -> Result<()> {
        let shapes = self.state_shapes(batch);
        if count != shapes.len() {
            return Err(RuntimeError::Shape {
                tensor: what.into(),
                expected: format!("{} state tensors", shapes.len()),
                found: format!("{count}"),
            });
        }
        for (i, (shape, decl)) in shapes.iter().zip(&self.compiled.forward.states).enumerate() {
            check_len(&format!("{what}.{}", decl.name), len(i), shape)?;
        }
        Ok(())
    }

    /// Refuses a pass that would read the weights of a model that keeps none.
    pub(crate) fn ensure_owns_weights(&self) -> Result<()> {
        if self.owns_weights {
            return Ok(());
        }
        Err(RuntimeError::NoOwnWeights)
    }

    /// Zeroed buffers shaped like the model's parameters.
    pub(crate) fn zeroed_params(&self) -> Vec<Vec<Vec<f32>>> {
        self.param_lens().iter().map(|ps| ps.iter().map(|&n| vec![0.0; n]).collect()).collect()
    }

    /// Checks that `given` has the model's parameters: a list per layer and
    /// direction, in the cell's order, of the model's shapes.
    pub(crate) fn check_weights<D: Floats>(&self, given: &[Vec<D>]) -> Result<()> {
        let names = self.weight_names();
        let per = self.compiled.forward.params.len();
        if given.len() != self.params.len() || given.iter().any(|ps| ps.len() != per) {
            return Err(RuntimeError::Shape {
                tensor: "weights".into(),
                expected: format!("{} layers and directions of {per} parameters", self.params.len()),
                found: format!("{:?} parameters", given.iter().map(Vec::len).collect::<Vec<_>>()),
            });
        }
        for ((name, shape), p) in names.iter().zip(given.iter().flatten()) {
            check_len(name, p.floats(), shape)?;
        }
        Ok(())
    }
}
