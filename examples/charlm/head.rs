//! The softmax head: a linear map from the RNN's output to one logit per
//! character, and the cross-entropy against the next character, masked to
//! the real lengths.
//!
//! Only the real positions count: their rows of the RNN's padded output are
//! gathered into one `[N, H]` matrix, so padding costs neither products
//! nor exponentials, and the gradient is scattered back into the padded
//! layout, zeros at padding. The two products of the forward and the three
//! of the backward go through [`crate::linalg`]; the softmax rows run in
//! parallel and the loss is summed in row order, so results do not depend
//! on the thread count.

use crate::linalg::{matmul, Mat};
use rand::RngExt;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

/// `logits = W · h + b`, PyTorch's `nn.Linear` layout: `W` is `[vocab, input]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Head {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub vocab: usize,
    pub input: usize,
}

/// Gradients of the head's parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadGrads {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

/// What a forward over a batch keeps for the backward.
#[derive(Debug)]
pub struct HeadPass {
    /// Summed negative log-likelihood over the real positions, in nats.
    pub nll: f64,
    /// Real positions scored.
    pub count: usize,
    /// `[N, input]`: the gathered RNN outputs.
    hidden: Vec<f32>,
    /// `[N, vocab]`: the softmax of each row.
    probs: Vec<f32>,
}

impl Head {
    /// Uniform in `±1/sqrt(input)`, as `nn.Linear` starts.
    pub fn init(vocab: usize, input: usize, rng: &mut ChaCha8Rng) -> Head {
        let bound = 1.0 / (input as f32).sqrt();
        let mut uniform = || (2.0 * rng.random::<f32>() - 1.0) * bound;
        let weight = (0..vocab * input).map(|_| uniform()).collect();
        let bias = (0..vocab).map(|_| uniform()).collect();
        Head { weight, bias, vocab, input }
    }

    pub fn zero_grads(&self) -> HeadGrads {
        HeadGrads { weight: vec![0.0; self.weight.len()], bias: vec![0.0; self.bias.len()] }
    }

    /// `[rows, vocab]` logits of `[rows, input]` hidden vectors.
    pub fn logits(&self, hidden: &[f32], rows: usize) -> Vec<f32> {
        let mut logits: Vec<f32> = self.bias.iter().copied().cycle().take(rows * self.vocab).collect();
        matmul(
            &mut logits,
            Mat::new(hidden, rows, self.input),
            Mat::new(&self.weight, self.vocab, self.input).t(),
            true,
        );
        logits
    }

    /// Scores the real rows of `output` (`[B * T, input]`, padded) against
    /// `targets` (`[B * T]`).
    pub fn forward(&self, output: &[f32], real_rows: &[usize], targets: &[u32]) -> HeadPass {
        let n = real_rows.len();
        let mut hidden = vec![0.0; n * self.input];
        for (dst, &r) in hidden.chunks_exact_mut(self.input).zip(real_rows) {
            dst.copy_from_slice(&output[r * self.input..(r + 1) * self.input]);
        }
        let mut probs = self.logits(&hidden, n);
        let mut nll = vec![0.0f64; n];
        probs
            .par_chunks_mut(self.vocab)
            .zip(nll.par_iter_mut())
            .zip(real_rows.par_iter())
            .with_min_len(64)
            .for_each(|((row, loss), &r)| {
                let target_logit = f64::from(row[targets[r] as usize]);
                *loss = softmax_in_place(row) - target_logit;
            });
        HeadPass { nll: nll.iter().sum(), count: n, hidden, probs }
    }

    /// Backward of `scale * nll`: adds the parameters' gradients into
    /// `grads` and writes the gradient of the RNN's output into `d_output`
    /// (`[B * T, input]`, left zero at padding).
    pub fn backward(
        &self,
        pass: HeadPass,
        real_rows: &[usize],
        targets: &[u32],
        scale: f32,
        d_output: &mut [f32],
        grads: &mut HeadGrads,
    ) {
        let n = pass.count;
        let mut d_logits = pass.probs;
        d_logits.par_chunks_mut(self.vocab).zip(real_rows.par_iter()).with_min_len(64).for_each(
            |(row, &r)| {
                row[targets[r] as usize] -= 1.0;
                row.iter_mut().for_each(|v| *v *= scale);
            },
        );
        for row in d_logits.chunks_exact(self.vocab) {
            grads.bias.iter_mut().zip(row).for_each(|(g, d)| *g += d);
        }
        let d_logits_mat = Mat::new(&d_logits, n, self.vocab);
        matmul(&mut grads.weight, d_logits_mat.t(), Mat::new(&pass.hidden, n, self.input), true);
        let mut d_hidden = vec![0.0; n * self.input];
        matmul(&mut d_hidden, d_logits_mat, Mat::new(&self.weight, self.vocab, self.input), false);
        for (src, &r) in d_hidden.chunks_exact(self.input).zip(real_rows) {
            d_output[r * self.input..(r + 1) * self.input].copy_from_slice(src);
        }
    }
}

/// Replaces `row` by its softmax; returns the log of the normaliser
/// (`log sum exp row`).
pub fn softmax_in_place(row: &mut [f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    row.iter_mut().for_each(|v| *v /= sum);
    f64::from(max) + f64::from(sum).ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// The masked loss and its gradients against central differences, in f64 terms.
    #[test]
    fn gradients_match_finite_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (vocab, input) = (5, 4);
        let mut head = Head::init(vocab, input, &mut rng);
        // Two sequences of lengths 3 and 1, padded to 3 steps.
        let real_rows = [0usize, 1, 2, 3];
        let targets = [1u32, 4, 0, 2, 0, 0];
        let output: Vec<f32> =
            (0..6 * input).map(|i| if i < 4 * input { (i as f32 * 0.7).sin() } else { 0.0 }).collect();
        let scale = 1.0 / 4.0;
        let loss = |h: &Head, out: &[f32]| h.forward(out, &real_rows, &targets).nll * scale as f64;

        let mut grads = head.zero_grads();
        let mut d_output = vec![0.0; output.len()];
        let pass = head.forward(&output, &real_rows, &targets);
        head.backward(pass, &real_rows, &targets, scale, &mut d_output, &mut grads);
        assert!(d_output[4 * input..].iter().all(|&v| v == 0.0), "padding gets no gradient");

        let eps = 1e-2f32;
        let check = |analytic: f32, plus: f64, minus: f64| {
            let numeric = (plus - minus) / (2.0 * eps as f64);
            assert!((analytic as f64 - numeric).abs() < 2e-3, "analytic {analytic}, numeric {numeric}");
        };
        for i in 0..head.weight.len() {
            let w = head.weight[i];
            head.weight[i] = w + eps;
            let plus = loss(&head, &output);
            head.weight[i] = w - eps;
            let minus = loss(&head, &output);
            head.weight[i] = w;
            check(grads.weight[i], plus, minus);
        }
        for i in 0..vocab {
            let b = head.bias[i];
            head.bias[i] = b + eps;
            let plus = loss(&head, &output);
            head.bias[i] = b - eps;
            let minus = loss(&head, &output);
            head.bias[i] = b;
            check(grads.bias[i], plus, minus);
        }
        for i in 0..4 * input {
            let mut o = output.clone();
            o[i] += eps;
            let plus = loss(&head, &o);
            o[i] -= 2.0 * eps;
            check(d_output[i], plus, loss(&head, &o));
        }
    }

    #[test]
    fn softmax_survives_large_logits() {
        let mut row = [1000.0f32, 0.0, -1000.0];
        let log_z = softmax_in_place(&mut row);
        assert!((row[0] - 1.0).abs() < 1e-6 && row[2] == 0.0);
        assert!((log_z - 1000.0).abs() < 1e-3);
    }
}
