//! Runs a character-level language model trained by PyTorch: the
//! `state_dict` of `nn.Embedding` + `nn.LSTM` + `nn.Linear` exported to
//! safetensors by `examples/pytorch/train_export.py`, its `nn.LSTM`
//! weights loaded unchanged into `cells/lstm.cell` and run by cellc's CPU
//! back end.
//!
//! ```text
//! cargo run --release -p cellc-examples --example charlm_pytorch
//! cargo run --release -p cellc-examples --example charlm_pytorch -- --prompt "And Pharaoh"
//! ```
//!
//! Computes the validation loss of the exported weights on the same
//! verses and compares it with the one PyTorch recorded in the file's
//! metadata (an error if they differ by more than `--tolerance`), then
//! generates verses.

mod sampling;

use cellc_runtime::backend::cpu::{Cpu, Kernels};
use charlm::checkpoint;
use charlm::lm::CellSource;
use charlm::paths::{self, shown};
use charlm::text::Corpus;
use charlm::train::validation_batches;
use clap::Parser;
use std::error::Error;
use std::path::PathBuf;

/// Evaluate and sample from a PyTorch-trained nn.LSTM language model with cellc.
#[derive(Parser, Debug)]
#[command(name = "charlm_pytorch")]
struct Args {
    /// The exported state_dict (default: examples/pytorch/charlm_lstm.safetensors).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// The cell its `rnn.*` weights run in.
    #[arg(long, default_value = "lstm")]
    cell: String,
    /// Largest accepted difference from PyTorch's validation loss, in nats per character.
    #[arg(long, default_value_t = 1e-4)]
    tolerance: f64,
    /// Threads (0: every core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    #[command(flatten)]
    sampling: sampling::Sampling,
    /// Seed of the samples.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    let path = args.weights.clone().unwrap_or_else(paths::pytorch_export);
    let loaded = checkpoint::load(
        &path,
        Some(CellSource::find(&args.cell)?),
        Box::new(Cpu::new(args.threads, Kernels::Fastest)?),
    )?;
    let (lm, metadata) = (loaded.lm, loaded.metadata);
    println!(
        "weights: {} ({})",
        shown(&path),
        metadata.get("trainer").map_or("no trainer recorded", String::as_str)
    );
    println!("model:   {}", lm.describe());

    let valid_every = metadata.get("valid_every").map_or(Ok(10), |v| v.parse())?;
    let corpus = Corpus::load(&paths::default_corpus(), Some(lm.vocab.clone()), valid_every)?;
    let valid = lm.evaluate(&validation_batches(&corpus))?;
    let unigram = corpus.unigram_baseline();
    println!("validation verses: {} ({} characters)", corpus.valid.len(), corpus.valid_steps());
    println!("unigram baseline:  {unigram:.4} nats/char (perplexity {:.2})", unigram.exp());
    println!("cellc:             {valid:.6} nats/char (perplexity {:.3})", valid.exp());
    let recorded: f64 =
        metadata.get("valid_loss").ok_or("the file records no `valid_loss` to compare with")?.parse()?;
    let difference = valid - recorded;
    println!("PyTorch recorded:  {recorded:.6} nats/char (difference {difference:+.2e})");
    if difference.abs() > args.tolerance {
        return Err(format!(
            "cellc's validation loss differs from PyTorch's by {difference:+.2e}, more than {}",
            args.tolerance
        )
        .into());
    }

    args.sampling.print(&lm, args.seed)?;
    Ok(())
}
