//! The training loop: bucketed batches, the loss and its gradients
//! (candle's autograd), global-norm clipping, AdamW (candle-nn's, weight
//! decay 0: Adam) under a warm-up and cosine learning-rate schedule, and
//! the validation loss at regular steps. Progress goes to a
//! callback (a progress bar, a log, or nothing in a test); the losses come
//! back as a [`History`].

use crate::batches::{self, Batch, Epochs};
use crate::lm::CharLm;
use crate::text::Corpus;
use crate::Result;
use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

/// How to train.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Optimiser steps (one batch each).
    pub steps: usize,
    /// Sequences per batch.
    pub batch_size: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// Steps of linear warm-up from 0 to `lr`.
    pub warmup: usize,
    /// The learning rate at the last step, as a fraction of `lr` (cosine decay in between).
    pub final_lr_fraction: f32,
    /// Largest global gradient norm; larger gradients are scaled down to it.
    pub clip: f32,
    /// Validation loss every this many steps (and before the first and after the last).
    pub eval_every: usize,
    /// Seed of the batch order.
    pub seed: u64,
}

impl TrainConfig {
    /// The learning rate at `step` (0-based).
    pub fn lr_at(&self, step: usize) -> f32 {
        if step < self.warmup {
            return self.lr * (step + 1) as f32 / self.warmup as f32;
        }
        let span = self.steps.saturating_sub(self.warmup).max(1) as f32;
        let progress = ((step - self.warmup) as f32 / span).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f32::consts::PI * progress).cos());
        self.lr * (self.final_lr_fraction + (1.0 - self.final_lr_fraction) * cosine)
    }
}

/// What the loop reports.
#[derive(Clone, Debug)]
pub enum Progress {
    /// A step was taken: its batch's loss, gradient norm (before
    /// clipping) and learning rate; characters and seconds of training so far.
    Step { step: usize, loss: f64, grad_norm: f64, lr: f32, epoch: usize, tokens: usize, seconds: f64 },
    /// The validation loss after `step` steps.
    Eval { step: usize, loss: f64 },
}

/// Losses over a run, in nats per character.
#[derive(Clone, Debug, Default)]
pub struct History {
    /// `(step, loss of that step's batch)`, steps counted from 1.
    pub train: Vec<(usize, f64)>,
    /// `(steps taken, validation loss)`, from step 0.
    pub valid: Vec<(usize, f64)>,
    /// Characters trained on.
    pub tokens: usize,
    /// Seconds spent in training steps (validation excluded).
    pub train_seconds: f64,
    /// Epochs started.
    pub epochs: usize,
    /// Each step's batch: its sequences' indices in the training set.
    pub batches: Vec<Vec<usize>>,
}

impl History {
    /// Characters per second of the training steps.
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.train_seconds.max(1e-9)
    }

    /// The last validation loss.
    pub fn final_valid(&self) -> Option<f64> {
        self.valid.last().map(|&(_, l)| l)
    }
}

/// Sequences per validation batch.
pub const VALID_BATCH: usize = 64;

/// Validation batches: fixed, sorted by length, the same for every run and
/// every reload (so a validation loss is reproduced to the last bit).
pub fn validation_batches(corpus: &Corpus) -> Vec<Batch> {
    batches::in_order(&corpus.valid, VALID_BATCH)
}

/// Trains `lm` on `corpus.train`, validating on `corpus.valid`.
pub fn train(
    lm: &CharLm,
    corpus: &Corpus,
    config: &TrainConfig,
    on_progress: &mut dyn FnMut(&Progress),
) -> Result<History> {
    let valid = validation_batches(corpus);
    let mut history = History::default();
    let evaluate =
        |lm: &CharLm, step: usize, history: &mut History, on_progress: &mut dyn FnMut(&Progress)| {
            lm.evaluate(&valid).map(|loss| {
                history.valid.push((step, loss));
                on_progress(&Progress::Eval { step, loss });
            })
        };
    evaluate(lm, 0, &mut history, on_progress)?;

    let mut epochs = Epochs::new(&corpus.train, config.batch_size, ChaCha8Rng::seed_from_u64(config.seed));
    let vars: Vec<Var> = lm.named_vars().into_iter().map(|(_, v)| v).collect();
    let mut adam = AdamW::new(
        vars.clone(),
        ParamsAdamW { lr: f64::from(config.lr), weight_decay: 0.0, ..Default::default() },
    )?;
    for step in 0..config.steps {
        let Some(batch) = epochs.next() else { break };
        let started = Instant::now();
        let loss_tensor = lm.loss(&batch)?;
        let loss = f64::from(loss_tensor.to_scalar::<f32>()?);
        let mut grads = loss_tensor.backward()?;
        let grad_norm = clip(&mut grads, &vars, f64::from(config.clip))?;
        let lr = config.lr_at(step);
        adam.set_learning_rate(f64::from(lr));
        adam.step(&grads)?;
        history.train_seconds += started.elapsed().as_secs_f64();
        history.tokens += batch.tokens();
        history.train.push((step + 1, loss));
        history.batches.push(batch.ids.clone());
        on_progress(&Progress::Step {
            step: step + 1,
            loss,
            grad_norm,
            lr,
            epoch: epochs.epoch,
            tokens: history.tokens,
            seconds: history.train_seconds,
        });
        let last = step + 1 == config.steps;
        if last || (config.eval_every > 0 && (step + 1) % config.eval_every == 0) {
            evaluate(lm, step + 1, &mut history, on_progress)?;
        }
    }
    history.epochs = epochs.epoch;
    Ok(history)
}

/// Scales the gradients of `vars` down to a global norm of `max_norm`
/// when above it (PyTorch's `clip_grad_norm_`); returns the norm before.
pub fn clip(grads: &mut GradStore, vars: &[Var], max_norm: f64) -> Result<f64> {
    let mut sum = 0.0f64;
    for var in vars {
        if let Some(g) = grads.get(var) {
            sum += f64::from(g.sqr()?.sum_all()?.to_scalar::<f32>()?);
        }
    }
    let norm = sum.sqrt();
    if norm > max_norm {
        let factor = max_norm / (norm + 1e-6);
        for var in vars {
            if let Some(g) = grads.remove(var) {
                grads.insert(var, g.affine(factor, 0.0)?);
            }
        }
    }
    Ok(norm)
}
