//! Turning gradients into an update: global-norm gradient clipping and
//! Adam (Kingma & Ba 2015), both as PyTorch's `clip_grad_norm_` and
//! `torch.optim.Adam` (no weight decay) compute them.
//!
//! Parameters and gradients are lists of flat slices in one fixed order
//! (see `CharLm::params_mut` and `LmGrads::tensors`); Adam keeps its two
//! moments per slice and checks that the list keeps its shapes.

use crate::{Error, Result};

/// The L2 norm of all gradients together (accumulated in f64).
pub fn global_norm(grads: &[&[f32]]) -> f64 {
    grads.iter().flat_map(|g| g.iter()).map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt()
}

/// The factor that brings a gradient of norm `norm` down to `max_norm`
/// (1 when it is already within it), as `clip_grad_norm_` computes it.
pub fn clip_factor(norm: f64, max_norm: f64) -> f32 {
    (max_norm / (norm + 1e-6)).min(1.0) as f32
}

/// Adam's state: the step count and the moments of every parameter.
#[derive(Clone, Debug)]
pub struct Adam {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    steps: i32,
    /// First and second moments, one pair per parameter slice.
    moments: Vec<(Vec<f32>, Vec<f32>)>,
}

impl Default for Adam {
    /// PyTorch's defaults: betas (0.9, 0.999), eps 1e-8.
    fn default() -> Adam {
        Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, steps: 0, moments: Vec::new() }
    }
}

impl Adam {
    /// One update with learning rate `lr`, on the gradients multiplied by
    /// `grad_scale` (the clipping factor).
    pub fn step(
        &mut self,
        params: &mut [&mut [f32]],
        grads: &[&[f32]],
        grad_scale: f32,
        lr: f32,
    ) -> Result<()> {
        if self.moments.is_empty() {
            self.moments = params.iter().map(|p| (vec![0.0; p.len()], vec![0.0; p.len()])).collect();
        }
        let shapes_agree = params.len() == grads.len()
            && params.len() == self.moments.len()
            && params
                .iter()
                .zip(grads)
                .zip(&self.moments)
                .all(|((p, g), (m, _))| p.len() == g.len() && p.len() == m.len());
        if !shapes_agree {
            return Err(Error::Invalid(
                "Adam: the parameters and gradients changed shape between steps".into(),
            ));
        }
        self.steps += 1;
        let (b1, b2) = (self.beta1, self.beta2);
        let correction1 = 1.0 - b1.powi(self.steps);
        let correction2 = 1.0 - b2.powi(self.steps);
        let step_size = lr / correction1;
        let eps = self.eps;
        for ((p, g), (m, v)) in params.iter_mut().zip(grads).zip(&mut self.moments) {
            for (((p, &g), m), v) in p.iter_mut().zip(g.iter()).zip(m.iter_mut()).zip(v.iter_mut()) {
                let g = g * grad_scale;
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                *p -= step_size * *m / ((*v / correction2).sqrt() + eps);
            }
        }
        Ok(())
    }

    /// Updates taken so far.
    pub fn steps(&self) -> i32 {
        self.steps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_scales_the_global_norm_down_to_the_limit() {
        let (a, b) = ([3.0f32, 0.0], [4.0f32]);
        let norm = global_norm(&[&a, &b]);
        assert_eq!(norm, 5.0);
        assert!((clip_factor(norm, 1.0) - 0.2).abs() < 1e-6);
        assert_eq!(clip_factor(norm, 10.0), 1.0);
    }

    #[test]
    fn first_adam_step_moves_each_weight_by_the_learning_rate() {
        // With bias correction, step 1 is lr * g / (|g| + eps): a signed step of lr.
        let mut adam = Adam::default();
        let mut w = [1.0f32, -2.0, 0.5];
        let g = [0.3f32, -7.0, 0.0];
        adam.step(&mut [&mut w], &[&g], 1.0, 0.1).expect("step");
        assert!((w[0] - 0.9).abs() < 1e-6 && (w[1] + 1.9).abs() < 1e-6 && w[2] == 0.5, "{w:?}");
    }

    #[test]
    fn adam_matches_the_recurrence_over_several_steps() {
        let mut adam = Adam::default();
        let mut w = [0.0f32];
        let grads = [1.0f32, -0.5, 2.0];
        let (mut m, mut v) = (0.0f64, 0.0f64);
        let mut want = 0.0f64;
        for (t, &g) in grads.iter().enumerate() {
            adam.step(&mut [&mut w], &[&[g]], 0.5, 0.01).expect("step");
            let g = f64::from(g) * 0.5;
            m = 0.9 * m + 0.1 * g;
            v = 0.999 * v + 0.001 * g * g;
            let t = t as i32 + 1;
            want -= 0.01 * (m / (1.0 - 0.9f64.powi(t))) / ((v / (1.0 - 0.999f64.powi(t))).sqrt() + 1e-8);
        }
        assert!((f64::from(w[0]) - want).abs() < 1e-6, "{} vs {want}", w[0]);
        assert_eq!(adam.steps(), 3);
        assert!(adam.step(&mut [&mut w, &mut [0.0]], &[&[1.0], &[1.0]], 1.0, 0.1).is_err());
    }
}
