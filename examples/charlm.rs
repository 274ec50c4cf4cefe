//! Trains a character-level language model on Genesis and Exodus (King
//! James Version), with the RNN a `.cell` file compiled by cellc and run
//! forward and backward by the CPU back end as a candle layer
//! (`cellc-candle`); the embedding, head, cross-entropy and AdamW are
//! candle-nn's.
//!
//! ```text
//! cargo run --release -p cellc-examples --example charlm
//! cargo run --release -p cellc-examples --example charlm -- --cell gru --steps 300
//! cargo run --release -p cellc-examples --example charlm -- --cell path/to/my.cell -D P=64
//! cargo run --release -p cellc-examples --example charlm -- --load target/charlm/charlm-lstm.safetensors --prompt "And Moses"
//! ```
//!
//! Prints the unigram baseline, a progress bar (loss, characters per
//! second), the validation loss and perplexity, generated verses, and
//! where it saved the weights (safetensors) and the loss curve (SVG).

mod sampling;

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::Metadata;
use charlm::checkpoint;
use charlm::lm::{CellSource, CharLm, LmSpec};
use charlm::paths::{self, shown};
use charlm::plot::loss_curve_svg;
use charlm::text::Corpus;
use charlm::train::{self, Progress, TrainConfig};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Train a character-level language model whose RNN is a .cell file.
#[derive(Parser, Debug)]
#[command(name = "charlm")]
struct Args {
    /// The RNN: a cell of cells/ by name (lstm, gru, layernorm_lstm, ...) or a path to a .cell file.
    #[arg(long, default_value = "lstm")]
    cell: String,
    /// Hidden size (the cell's `H`).
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Another size variable of the cell, e.g. `-D P=64` for lstmp.
    #[arg(short = 'D', value_name = "NAME=VALUE")]
    sizes: Vec<String>,
    /// Set one of the cell's rates (zoneout, dropout: its `rate`s), e.g. `-R zh=0.1`.
    #[arg(short = 'R', value_name = "NAME=RATE")]
    rates: Vec<String>,
    /// Width of the character embedding (the cell's input size).
    #[arg(long, default_value_t = 64)]
    embedding: usize,
    /// Stacked RNN layers.
    #[arg(long, default_value_t = 1)]
    layers: usize,
    /// Optimiser steps, one batch each.
    #[arg(long, default_value_t = 1000)]
    steps: usize,
    /// Verses per batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Peak learning rate (Adam).
    #[arg(long, default_value_t = 4e-3)]
    lr: f32,
    /// Warm-up steps (default: 3% of the steps).
    #[arg(long)]
    warmup: Option<usize>,
    /// Largest global gradient norm.
    #[arg(long, default_value_t = 1.0)]
    clip: f32,
    /// Validation loss every this many steps (default: 10 times per run).
    #[arg(long)]
    eval_every: Option<usize>,
    /// Threads (0: every core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Seed of the initial weights, the batch order and the samples.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Training text, one sequence per line.
    #[arg(long)]
    data: Option<PathBuf>,
    /// One line in this many is held out for validation.
    #[arg(long, default_value_t = 10)]
    valid_every: usize,
    /// Directory for the weights and the loss curve (default: target/charlm).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write each training step's batch (its verses' indices in the training set) here, as JSON
    /// (for `benches/charlm_side_by_side.py`, which trains PyTorch on the same batches).
    #[arg(long, value_name = "JSON")]
    write_batches: Option<PathBuf>,
    /// Evaluate and sample from saved weights instead of training.
    #[arg(long, value_name = "SAFETENSORS")]
    load: Option<PathBuf>,
    #[command(flatten)]
    sampling: sampling::Sampling,
}

fn main() -> Result<(), Box<dyn Error + Send + Sync>> {
    let args = Args::parse();
    let cpu = Arc::new(Cpu::new(args.threads, Kernels::Fastest)?);
    // candle's products and element-wise ops (rayon) and the RNN share
    // the back end's threads: with a pool of its own beside them, the
    // main job ran 13% slower here (two pools taking turns on two cores).
    cpu.install(|| run(&args, &cpu))
}

fn run(args: &Args, cpu: &Arc<Cpu>) -> Result<(), Box<dyn Error + Send + Sync>> {
    let threads = cpu.threads();
    let backend = Box::new(cpu.clone());
    let data = args.data.clone().unwrap_or_else(paths::default_corpus);
    let (lm, corpus) = match &args.load {
        Some(path) => {
            let loaded = checkpoint::load(path, None, backend)?;
            println!("loaded {}", shown(path));
            let corpus = Corpus::load(&data, Some(loaded.lm.vocab.clone()), args.valid_every)?;
            (loaded.lm, corpus)
        }
        None => {
            let cell = CellSource::find(&args.cell)?;
            let corpus = Corpus::load(&data, None, args.valid_every)?;
            let mut sizes: cellc::dims::Bindings = [("H".to_string(), args.hidden)].into();
            for binding in &args.sizes {
                let (name, value) = binding
                    .split_once('=')
                    .ok_or_else(|| format!("expected NAME=VALUE, found `{binding}`"))?;
                sizes.insert(name.trim().to_string(), value.trim().parse()?);
            }
            let mut rates = Vec::new();
            for binding in &args.rates {
                let (name, value) = binding
                    .split_once('=')
                    .ok_or_else(|| format!("expected NAME=RATE, found `{binding}`"))?;
                rates.push((name.trim().to_string(), value.trim().parse()?));
            }
            let spec = LmSpec { embedding: args.embedding, layers: args.layers, sizes, rates };
            let lm = CharLm::new(cell, corpus.vocab.clone(), &spec, args.seed, backend)?;
            (lm, corpus)
        }
    };
    print_setup(&lm, &corpus, &data, threads);
    let unigram = corpus.unigram_baseline();
    println!("unigram baseline:  {unigram:.3} nats/char (perplexity {:.2})", unigram.exp());

    let (valid, saved) = match &args.load {
        Some(_) => (lm.evaluate(&train::validation_batches(&corpus))?, None),
        None => {
            let (valid, weights, curve) = train_and_save(&lm, &corpus, args, unigram, &data)?;
            (valid, Some((weights, curve)))
        }
    };
    let (gap, side) = if valid <= unigram { (unigram - valid, "below") } else { (valid - unigram, "above") };
    println!(
        "validation loss:   {valid:.3} nats/char (perplexity {:.2}), {gap:.3} {side} the unigram baseline",
        valid.exp()
    );

    args.sampling.print(&lm, args.seed)?;
    if let Some((weights, curve)) = saved {
        println!("weights:    {} (reload with --load {})", shown(&weights), shown(&weights));
        println!("loss curve: {}", shown(&curve));
    }
    Ok(())
}

fn print_setup(lm: &CharLm, corpus: &Corpus, data: &std::path::Path, threads: usize) {
    let (embedding, rnn, head) = lm.parameter_counts();
    println!("model: {}", lm.describe());
    println!(
        "       {} parameters (embedding {embedding}, RNN {rnn}, head {head}); {} backend, {threads} thread{}",
        embedding + rnn + head,
        lm.rnn.model().backend_name(),
        if threads == 1 { "" } else { "s" }
    );
    println!(
        "text:  {}: {} verses, {} distinct characters",
        shown(data),
        corpus.train.len() + corpus.valid.len(),
        corpus.vocab.len()
    );
    println!(
        "       training on {} verses ({} characters), validating on {} ({})",
        corpus.train.len(),
        corpus.train_steps(),
        corpus.valid.len(),
        corpus.valid_steps()
    );
}

/// Trains with a progress bar, saves the weights and the loss curve;
/// returns the final validation loss and where the two files are.
fn train_and_save(
    lm: &CharLm,
    corpus: &Corpus,
    args: &Args,
    unigram: f64,
    data: &std::path::Path,
) -> Result<(f64, PathBuf, PathBuf), Box<dyn Error + Send + Sync>> {
    let config = TrainConfig {
        steps: args.steps,
        batch_size: args.batch,
        lr: args.lr,
        warmup: args.warmup.unwrap_or(args.steps * 3 / 100),
        final_lr_fraction: 0.1,
        clip: args.clip,
        eval_every: args.eval_every.unwrap_or((args.steps / 10).max(1)),
        seed: args.seed,
    };
    println!(
        "training: {} steps of {} verses; AdamW (no weight decay), learning rate {:.1e} after {} warm-up steps, cosine to {:.1e}; clip {}",
        config.steps,
        config.batch_size,
        config.lr,
        config.warmup,
        config.lr * config.final_lr_fraction,
        config.clip
    );
    let started = Instant::now();
    let bar = ProgressBar::new(config.steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:32}] {pos}/{len} {msg}")?.progress_chars("=> "),
    );
    // Where no terminal shows the bar (a log, CI), a line per evaluation instead.
    let log = bar.is_hidden();
    let (mut smoothed, mut last_valid, mut rate) = (None::<f64>, f64::NAN, 0.0);
    let history = train::train(lm, corpus, &config, &mut |p: &Progress| match *p {
        Progress::Step { step, loss, epoch, tokens, seconds, .. } => {
            let s = smoothed.map_or(loss, |s| 0.95 * s + 0.05 * loss);
            smoothed = Some(s);
            rate = tokens as f64 / seconds.max(1e-9);
            bar.set_position(step as u64);
            bar.set_message(format!(
                "loss {s:.3} | val {last_valid:.3} | {:.1}k tok/s | epoch {epoch}",
                rate / 1e3
            ));
        }
        Progress::Eval { step, loss } => {
            last_valid = loss;
            if log {
                let seconds = started.elapsed().as_secs_f64();
                match smoothed {
                    None => println!("step {step:>5}/{}: val {loss:.3}", config.steps),
                    Some(s) => println!(
                        "step {step:>5}/{}: train {s:.3} | val {loss:.3} | {:.1}k tok/s | {seconds:.0} s",
                        config.steps,
                        rate / 1e3
                    ),
                }
            }
        }
    })?;
    bar.finish_and_clear();
    if let Some(path) = &args.write_batches {
        let json = serde_json::to_string(&history.batches)?;
        cellc_runtime::write_atomically(path, json.as_bytes())?;
    }
    let valid = history.final_valid().unwrap_or(f64::NAN);
    println!(
        "trained {} steps ({} epochs, {:.2}M tokens) in {:.1} s: {:.1}k tokens/s (a token is a character)",
        history.train.len(),
        history.epochs,
        history.tokens as f64 / 1e6,
        history.train_seconds,
        history.tokens_per_second() / 1e3
    );

    let out = args.out.clone().unwrap_or_else(paths::default_output_dir);
    let name = &lm.rnn.model().compiled().forward.name;
    let weights = out.join(format!("charlm-{name}.safetensors"));
    let metadata: Metadata = [
        ("trained_on", shown(data)),
        ("steps", config.steps.to_string()),
        ("batch", config.batch_size.to_string()),
        ("lr", config.lr.to_string()),
        ("seed", config.seed.to_string()),
        ("valid_every", args.valid_every.to_string()),
        ("valid_loss", valid.to_string()),
        ("unigram_baseline", unigram.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    checkpoint::save(lm, &weights, &metadata)?;
    let curve = out.join(format!("charlm-{name}-loss.svg"));
    let title = format!(
        "{name}, H={}: validation {valid:.3} nats/char after {} steps",
        lm.rnn.model().layers()[0].sizes.get("H").copied().unwrap_or(0),
        config.steps
    );
    loss_curve_svg(&curve, &history, unigram, &title)?;
    Ok((valid, weights, curve))
}
