//! A model's masks: the rates of its cell's `rate`s (the model's, and a
//! call's own), and every mask a call draws (the cell's and the dropout
//! between layers), so that the same computation can be rebuilt elsewhere.

use super::Model;
use crate::backend::cpu::host::{apply_on_host, fill_on_host, mask_row};
use crate::dropout::{check_rate, BetweenLayers, MaskSeed};
use crate::error::{Result, RuntimeError};
use crate::input::Input;
use crate::masks::{CellMasking, SeenMask};

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
    /// call's own rates ([`crate::CallOptions::rates`]).
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

    /// The masks of the cell's own mask calls that a call over `input` in
    /// training mode drawing from `seed` (or in evaluation, `None`) at
    /// `rates` (`None`: the model's) uses, in every layer and direction,
    /// so that the same computation can be rebuilt elsewhere. With
    /// [`Model::dropout_masks`], every random number a call uses.
    pub fn cell_masks(
        &self,
        input: Input,
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
                    mask_row(&m, 0, 0, &mut values);
                    let shape = if c == 1 { vec![r] } else { vec![r, c] };
                    out.push(SeenMask { name: name(m.mask), shape, values });
                }
            }
        }
        Ok(out)
    }

    /// The masks a call in training mode drawing from `masks` multiplies
    /// each layer's output by (every layer's but the last), so that the
    /// same computation can be rebuilt elsewhere: one buffer per layer
    /// boundary, laid out like `input` with the layer's output features
    /// (`output_size * directions`) per row, each value 0 (dropped) or
    /// `1 / (1 - rate)` (kept), zeros at padding. Empty without dropout.
    /// `rate`: the call's rate ([`crate::CallOptions::dropout`]); `None`: the model's.
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
