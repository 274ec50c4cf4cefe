//! The corpus: a text file of one sequence per line (here a verse), its
//! character vocabulary, the train/validation split, and the unigram
//! baseline a model has to beat.
//!
//! A line becomes the tokens `\n line \n`: the newline both opens and ends
//! every sequence, so the model learns how verses begin and where they end,
//! and sampling starts from a newline alone. The model reads every token
//! but the last and predicts every token but the first, so a line of `n`
//! characters is a sequence of `n + 1` steps.

use crate::{Error, Result};
use std::collections::HashMap;
use std::path::Path;

/// The characters a model knows, in id order. Always holds `\n`, the
/// sequence boundary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vocab {
    chars: Vec<char>,
    ids: HashMap<char, u32>,
}

impl Vocab {
    /// Every character of `text` (and `\n`), sorted.
    pub fn from_text(text: &str) -> Vocab {
        let mut chars: Vec<char> = text.chars().chain(['\n']).collect();
        chars.sort_unstable();
        chars.dedup();
        Vocab::from_sorted(chars)
    }

    /// The characters of `chars` in that order (a saved vocabulary).
    pub fn from_chars(chars: &str) -> Result<Vocab> {
        let list: Vec<char> = chars.chars().collect();
        let vocab = Vocab::from_sorted(list.clone());
        if vocab.ids.len() != list.len() {
            return Err(Error::Invalid("the vocabulary lists a character twice".into()));
        }
        if !vocab.ids.contains_key(&'\n') {
            return Err(Error::Invalid("the vocabulary has no newline (the sequence boundary)".into()));
        }
        Ok(vocab)
    }

    fn from_sorted(chars: Vec<char>) -> Vocab {
        let ids = chars.iter().enumerate().map(|(i, &c)| (c, i as u32)).collect();
        Vocab { chars, ids }
    }

    pub fn len(&self) -> usize {
        self.chars.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The characters in id order, as one string (how checkpoints store it).
    pub fn as_string(&self) -> String {
        self.chars.iter().collect()
    }

    /// The id of `\n`, which opens and ends every sequence.
    pub fn boundary(&self) -> u32 {
        self.ids.get(&'\n').copied().unwrap_or(0)
    }

    /// Ids of `text`; `context` names it in the error for an unknown character.
    pub fn encode(&self, text: &str, context: &str) -> Result<Vec<u32>> {
        text.chars()
            .map(|c| {
                self.ids
                    .get(&c)
                    .copied()
                    .ok_or_else(|| Error::UnknownChar { ch: c, context: context.to_string() })
            })
            .collect()
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|&i| self.chars.get(i as usize).copied().unwrap_or('\u{fffd}')).collect()
    }
}

/// One line as tokens: `\n line \n`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sequence {
    tokens: Vec<u32>,
}

impl Sequence {
    /// Steps of the sequence: the line's characters plus one.
    pub fn len(&self) -> usize {
        self.tokens.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the model reads at each step.
    pub fn inputs(&self) -> &[u32] {
        &self.tokens[..self.tokens.len() - 1]
    }

    /// What it must predict at each step (the next character).
    pub fn targets(&self) -> &[u32] {
        &self.tokens[1..]
    }
}

/// A text split into training and validation sequences.
#[derive(Clone, Debug)]
pub struct Corpus {
    pub vocab: Vocab,
    pub train: Vec<Sequence>,
    pub valid: Vec<Sequence>,
}

impl Corpus {
    /// Reads a file of one sequence per line (blank lines skipped). Every
    /// `valid_every`-th line (the 10th, 20th, ... for 10) is held out for
    /// validation, so both parts sample the whole text. Without `vocab`,
    /// the text's own characters are the vocabulary.
    pub fn load(path: &Path, vocab: Option<Vocab>, valid_every: usize) -> Result<Corpus> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Corpus::from_text(&text, vocab, valid_every)
            .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))
    }

    /// As [`Corpus::load`], from the text itself.
    pub fn from_text(text: &str, vocab: Option<Vocab>, valid_every: usize) -> Result<Corpus> {
        if valid_every < 2 {
            return Err(Error::Invalid(format!(
                "one line in {valid_every} for validation leaves nothing to train on"
            )));
        }
        let vocab = vocab.unwrap_or_else(|| Vocab::from_text(text));
        let newline = vocab.boundary();
        let (mut train, mut valid) = (Vec::new(), Vec::new());
        let lines = text.lines().map(|l| l.trim_end_matches('\r')).filter(|l| !l.trim().is_empty());
        for (i, line) in lines.enumerate() {
            let mut tokens = vec![newline];
            tokens.extend(vocab.encode(line, &format!("line {}", i + 1))?);
            tokens.push(newline);
            let part = if (i + 1) % valid_every == 0 { &mut valid } else { &mut train };
            part.push(Sequence { tokens });
        }
        if train.is_empty() || valid.is_empty() {
            return Err(Error::Invalid(format!(
                "{} lines are too few to hold out one in {valid_every} for validation",
                train.len() + valid.len()
            )));
        }
        Ok(Corpus { vocab, train, valid })
    }

    /// Characters predicted over the training sequences (steps, newlines included).
    pub fn train_steps(&self) -> usize {
        self.train.iter().map(Sequence::len).sum()
    }

    pub fn valid_steps(&self) -> usize {
        self.valid.iter().map(Sequence::len).sum()
    }

    /// The unigram baseline in nats per character: the cross-entropy on the
    /// validation targets of each character's frequency among the training
    /// targets (add-one smoothed, so a character unseen in training costs
    /// a finite amount). A model that ignores context does no better.
    pub fn unigram_baseline(&self) -> f64 {
        let mut counts = vec![1.0f64; self.vocab.len()];
        for s in &self.train {
            for &t in s.targets() {
                counts[t as usize] += 1.0;
            }
        }
        let total: f64 = counts.iter().sum();
        let (mut nll, mut n) = (0.0, 0usize);
        for s in &self.valid {
            for &t in s.targets() {
                nll -= (counts[t as usize] / total).ln();
                n += 1;
            }
        }
        nll / n as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_become_sequences_framed_by_newlines() {
        let corpus = Corpus::from_text("ab\nc\n\nba\nab\n", None, 2).expect("corpus");
        assert_eq!(corpus.vocab.as_string(), "\nabc");
        // Lines 2 and 4 ("c", "ab") are held out.
        assert_eq!(corpus.train.len(), 2);
        assert_eq!(corpus.valid.len(), 2);
        let s = &corpus.train[0];
        assert_eq!(corpus.vocab.decode(s.inputs()), "\nab");
        assert_eq!(corpus.vocab.decode(s.targets()), "ab\n");
        assert_eq!(s.len(), 3);
    }

    #[test]
    fn unigram_baseline_is_the_cross_entropy_of_training_frequencies() {
        // Train targets: "a\n" twice; with add-one over {\n, a}: p = 3/6 each.
        let corpus = Corpus::from_text("a\na\na\na\n", None, 2).expect("corpus");
        assert!((corpus.unigram_baseline() - 2f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn unknown_characters_are_named() {
        let vocab = Vocab::from_text("ab");
        let err = Corpus::from_text("ab\nax\nab\n", Some(vocab), 2).expect_err("x is unknown");
        assert!(err.to_string().contains("'x'"), "{err}");
        assert!(Vocab::from_chars("aa\n").is_err());
        assert!(Vocab::from_chars("ab").is_err());
    }
}
