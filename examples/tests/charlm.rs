//! The character-level language model end to end: a short training run
//! beats the unigram baseline, saved weights reload to the same loss, the
//! PyTorch-trained export scores what PyTorch recorded, the gradients of
//! embedding + RNN + head through candle's autograd match finite
//! differences, and padding or batch composition never changes the loss.

use candle_core::{Device, Tensor};
use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::Metadata;
use charlm::batches::{self, Batch};
use charlm::checkpoint;
use charlm::lm::{CellSource, CharLm, LmSpec};
use charlm::paths;
use charlm::sample::{generate, SampleOptions};
use charlm::text::Corpus;
use charlm::train::{self, TrainConfig};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn cpu() -> Box<Cpu> {
    Box::new(Cpu::new(2, Kernels::Fastest).expect("cpu backend"))
}

fn cell(name: &str) -> CellSource {
    CellSource::find(name).expect("a shipped cell")
}

fn corpus() -> Corpus {
    Corpus::load(&paths::default_corpus(), None, 10).expect("corpus")
}

fn small_lm(corpus: &Corpus, cell_name: &str, hidden: usize, embedding: usize, seed: u64) -> CharLm {
    let spec = LmSpec { embedding, layers: 1, sizes: [("H".to_string(), hidden)].into(), rates: Vec::new() };
    CharLm::new(cell(cell_name), corpus.vocab.clone(), &spec, seed, cpu()).expect("model")
}

fn short_config(steps: usize) -> TrainConfig {
    TrainConfig {
        steps,
        batch_size: 16,
        lr: 1e-2,
        warmup: 5,
        final_lr_fraction: 0.1,
        clip: 1.0,
        eval_every: 0,
        seed: 3,
    }
}

#[test]
fn short_training_falls_well_below_the_unigram_baseline() {
    let corpus = corpus();
    let unigram = corpus.unigram_baseline();
    assert!((2.9..3.2).contains(&unigram), "unigram baseline {unigram}");
    let lm = small_lm(&corpus, "lstm", 64, 32, 5);
    let mut steps_seen = 0;
    let history = train::train(&lm, &corpus, &short_config(120), &mut |p| {
        if let train::Progress::Step { loss, .. } = p {
            assert!(loss.is_finite());
            steps_seen += 1;
        }
    })
    .expect("trains");
    assert_eq!(steps_seen, 120);
    let (initial, last) = (history.valid[0].1, history.final_valid().expect("evaluated"));
    println!(
        "validation {initial:.3} -> {last:.3} nats/char (unigram {unigram:.3}), {:.0} chars/s",
        history.tokens_per_second()
    );
    // Untrained: about ln(vocabulary). Trained: clearly below the unigram baseline.
    assert!((initial - (corpus.vocab.len() as f64).ln()).abs() < 0.3, "initial loss {initial}");
    assert!(last < unigram - 0.5, "after 120 steps {last:.3}, unigram {unigram:.3}");
    assert!(last < initial - 1.5);
    // The batches' own losses fell too.
    let first: f64 = history.train[..10].iter().map(|p| p.1).sum::<f64>() / 10.0;
    let final_: f64 = history.train[110..].iter().map(|p| p.1).sum::<f64>() / 10.0;
    assert!(final_ < first - 1.0, "training loss {first:.3} -> {final_:.3}");
}

#[test]
fn saved_weights_reload_to_the_same_validation_loss_and_samples() {
    let corpus = corpus();
    let lm = small_lm(&corpus, "gru", 24, 16, 9);
    let history = train::train(&lm, &corpus, &short_config(8), &mut |_| {}).expect("trains");
    let valid = train::validation_batches(&corpus);
    let before = lm.evaluate(&valid).expect("evaluates");
    assert_eq!(history.final_valid(), Some(before), "the loss training reports is the model's");

    let path = std::env::temp_dir().join(format!("charlm_reload_{}.safetensors", std::process::id()));
    let extra: Metadata = [("valid_loss".to_string(), before.to_string())].into();
    checkpoint::save(&lm, &path, &extra).expect("saves");
    // No cell given: the checkpoint carries its own.
    let loaded = checkpoint::load(&path, None, cpu()).expect("loads");
    std::fs::remove_file(&path).ok();
    assert_eq!(loaded.metadata.get("valid_loss"), Some(&before.to_string()));
    assert_eq!(loaded.metadata.get("cell_file").map(String::as_str), Some("cells/gru.cell"));
    assert_eq!(loaded.lm.vocab, lm.vocab);
    let values = |lm: &CharLm| -> Vec<(String, Vec<f32>)> {
        lm.named_vars()
            .into_iter()
            .map(|(n, v)| (n, v.flatten_all().and_then(|t| t.to_vec1()).expect("f32")))
            .collect()
    };
    assert_eq!(values(&loaded.lm), values(&lm), "every weight, bit for bit");
    assert_eq!(loaded.lm.named_vars().len(), 7);
    assert_eq!(loaded.lm.evaluate(&valid).expect("evaluates"), before);

    let options = SampleOptions { count: 3, max_chars: 60, temperature: 0.8, prompt: "And ".into() };
    let a = generate(&lm, &options, &mut ChaCha8Rng::seed_from_u64(4)).expect("samples");
    let b = generate(&loaded.lm, &options, &mut ChaCha8Rng::seed_from_u64(4)).expect("samples");
    assert_eq!(a, b);
    assert!(a.iter().all(|s| s.starts_with("And ") && !s.contains('\n')));
}

#[test]
fn pytorch_export_scores_what_pytorch_recorded() {
    let path = paths::pytorch_export();
    let loaded = checkpoint::load(&path, Some(cell("lstm")), cpu())
        .expect("the committed export loads into lstm.cell");
    let recorded: f64 = loaded.metadata.get("valid_loss").expect("recorded loss").parse().expect("a number");
    let corpus = Corpus::load(&paths::default_corpus(), Some(loaded.lm.vocab.clone()), 10).expect("corpus");
    let valid = loaded.lm.evaluate(&train::validation_batches(&corpus)).expect("evaluates");
    println!("cellc {valid:.6}, PyTorch {recorded:.6} nats/char");
    assert!((valid - recorded).abs() < 1e-5, "cellc {valid}, PyTorch {recorded}");
    assert!(valid < corpus.unigram_baseline() - 1.0);
}

#[test]
fn model_gradients_match_finite_differences() {
    let corpus = Corpus::from_text("abba cab\nbad\ncabbage a\nab\ndab cab\n", None, 2).expect("corpus");
    let lm = small_lm(&corpus, "lstm", 3, 2, 11);
    let rows: Vec<_> = corpus.train.iter().collect();
    let batch = Batch::new(&rows);
    assert!(batch.lengths.iter().any(|&n| n < batch.steps), "the batch has padding");
    let grads = lm.loss(&batch).and_then(|l| Ok(l.backward()?)).expect("gradients");
    let vars = lm.named_vars();
    let loss = |lm: &CharLm| {
        let (nll, n) = lm.score(&batch).expect("scores");
        nll / n as f64
    };

    let eps = 1e-2f32;
    let mut checked = 0;
    let mut analytic_count = 0;
    for (name, var) in &vars {
        let grad: Vec<f32> =
            grads.get(var).expect("a gradient").flatten_all().and_then(|t| t.to_vec1()).expect("f32");
        analytic_count += 1;
        let original: Vec<f32> = var.flatten_all().and_then(|t| t.to_vec1()).expect("f32");
        let set = |values: &[f32]| {
            let t = Tensor::from_slice(values, var.shape(), &Device::Cpu).expect("tensor");
            var.set(&t).expect("set");
        };
        for (i, &a) in grad.iter().enumerate() {
            let mut shifted = original.clone();
            shifted[i] = original[i] + eps;
            set(&shifted);
            let plus = loss(&lm);
            shifted[i] = original[i] - eps;
            set(&shifted);
            let minus = loss(&lm);
            set(&original);
            let numeric = (plus - minus) / (2.0 * f64::from(eps));
            let a = f64::from(a);
            assert!(
                (a - numeric).abs() <= 2e-3 + 2e-2 * numeric.abs(),
                "{name} element {i}: analytic {a:.6}, numeric {numeric:.6}"
            );
            checked += 1;
        }
    }
    // Embedding, four LSTM tensors, head weight and bias.
    assert_eq!(analytic_count, 7);
    assert!(checked > 100);
}

#[test]
fn padding_and_batch_composition_do_not_change_the_loss() {
    let corpus = corpus();
    let lm = small_lm(&corpus, "lstm", 32, 16, 2);
    let total = |batches: &[Batch]| {
        batches.iter().map(|b| lm.score(b).expect("scores")).fold((0.0, 0), |(l, n), (a, b)| (l + a, n + b))
    };
    let sorted = total(&batches::in_order(&corpus.valid, 64));
    // Unsorted batches of 7 mixing short and long verses: much padding.
    let mixed: Vec<Batch> =
        corpus.valid.chunks(7).map(|c| Batch::new(&c.iter().collect::<Vec<_>>())).collect();
    let one_by_one: Vec<Batch> = corpus.valid.iter().map(|s| Batch::new(&[s])).collect();
    let (mixed, alone) = (total(&mixed), total(&one_by_one));
    assert_eq!(sorted.1, corpus.valid_steps());
    assert_eq!((mixed.1, alone.1), (sorted.1, sorted.1));
    for other in [mixed.0, alone.0] {
        assert!((other - sorted.0).abs() < 1e-5 * sorted.0, "{other} vs {}", sorted.0);
    }
}

#[test]
fn malformed_checkpoints_are_errors_that_say_what_is_wrong() {
    let corpus = Corpus::from_text("abc\ncab\nbca\nacb\n", None, 2).expect("corpus");
    let lm = small_lm(&corpus, "lstm", 4, 3, 1);
    let dir = std::env::temp_dir();
    let path = dir.join(format!("charlm_malformed_{}.safetensors", std::process::id()));
    checkpoint::save(&lm, &path, &Metadata::new()).expect("saves");
    let (weights, metadata) = cellc_runtime::Weights::load_with_metadata(&path).expect("loads");

    let broken = |edit: &dyn Fn(&mut cellc_runtime::Weights, &mut Metadata)| {
        let (mut w, mut m) = (weights.clone(), metadata.clone());
        edit(&mut w, &mut m);
        w.save_with_metadata(&path, &m).expect("saves");
        checkpoint::load(&path, None, cpu()).expect_err("malformed").to_string()
    };
    let no_vocab = broken(&|_, m| {
        m.remove("vocab");
    });
    assert!(no_vocab.contains("no `vocab`"), "{no_vocab}");
    let no_cell = broken(&|_, m| {
        m.remove("cell");
    });
    assert!(no_cell.contains("no `cell`"), "{no_cell}");
    let reverse = broken(&|w, _| w.insert("rnn.bias_ih_l0_reverse".into(), vec![16], vec![0.0; 16]));
    assert!(reverse.contains("bidirectional"), "{reverse}");
    let stranger = broken(&|w, _| w.insert("decoder.weight".into(), vec![1], vec![0.0]));
    assert!(stranger.contains("unexpected tensor `decoder.weight`"), "{stranger}");
    let wrong_vocab = broken(&|w, _| w.insert("head.bias".into(), vec![3], vec![0.0; 3]));
    assert!(wrong_vocab.contains("`head.bias`"), "{wrong_vocab}");
    std::fs::remove_file(&path).ok();
}
