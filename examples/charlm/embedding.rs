//! The embedding: one learned vector per character, looked up for every
//! real position of a batch (padding stays zero; the runtime never reads it).

use crate::batches::Batch;
use rand::RngExt;
use rand_chacha::ChaCha8Rng;

/// A `[vocab, dim]` table, PyTorch's `nn.Embedding` layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Embedding {
    pub weight: Vec<f32>,
    pub vocab: usize,
    pub dim: usize,
}

impl Embedding {
    /// Standard normal entries, as `nn.Embedding` starts.
    pub fn init(vocab: usize, dim: usize, rng: &mut ChaCha8Rng) -> Embedding {
        let weight = (0..vocab * dim).map(|_| standard_normal(rng)).collect();
        Embedding { weight, vocab, dim }
    }

    /// `[B, T, dim]` vectors of the batch's inputs, zeros at padding.
    pub fn forward(&self, batch: &Batch, real_rows: &[usize]) -> Vec<f32> {
        let mut out = vec![0.0; batch.inputs.len() * self.dim];
        for &r in real_rows {
            let id = batch.inputs[r] as usize;
            out[r * self.dim..(r + 1) * self.dim]
                .copy_from_slice(&self.weight[id * self.dim..(id + 1) * self.dim]);
        }
        out
    }

    /// Adds the gradient of the table, given the gradient of
    /// [`Embedding::forward`]'s output, into `grad` (`[vocab, dim]`).
    pub fn backward(&self, batch: &Batch, real_rows: &[usize], d_out: &[f32], grad: &mut [f32]) {
        for &r in real_rows {
            let id = batch.inputs[r] as usize;
            let row = &mut grad[id * self.dim..(id + 1) * self.dim];
            row.iter_mut().zip(&d_out[r * self.dim..(r + 1) * self.dim]).for_each(|(g, d)| *g += d);
        }
    }
}

/// A standard normal sample (Box-Muller).
pub fn standard_normal(rng: &mut ChaCha8Rng) -> f32 {
    let u: f64 = 1.0 - rng.random::<f64>(); // (0, 1]: the log is finite
    let v: f64 = rng.random();
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}
