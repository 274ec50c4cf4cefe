//! Text generation: the model reads `\n` and a prompt, then draws one
//! character at a time from its softmax, sharpened or flattened by a
//! temperature, until it ends the line. Several lines are drawn at once,
//! as the rows of one batch; the RNN's state is carried from one call to
//! the next through the layer's initial and final states.

use crate::lm::CharLm;
use crate::Result;
use candle_core::{Device, Tensor};
use candle_nn::Module;
use cellc_candle::Padding;
use rand::RngExt;
use rand_chacha::ChaCha8Rng;

/// What to generate.
#[derive(Clone, Debug)]
pub struct SampleOptions {
    /// Lines drawn (together, as one batch).
    pub count: usize,
    /// Characters drawn per line at most, after the prompt.
    pub max_chars: usize,
    /// Below 1 sharper, above 1 flatter; 0 always takes the likeliest character.
    pub temperature: f32,
    /// The start of every line.
    pub prompt: String,
}

/// Draws `options.count` lines; each is the prompt and its continuation,
/// without the final newline.
pub fn generate(lm: &CharLm, options: &SampleOptions, rng: &mut ChaCha8Rng) -> Result<Vec<String>> {
    let rows = options.count.max(1);
    let boundary = lm.vocab.boundary();
    let mut prompt = vec![boundary];
    prompt.extend(lm.vocab.encode(&options.prompt, "the prompt")?);
    let rnn = lm.rnn.detach();
    let embed = |ids: Vec<u32>, steps: usize| -> Result<Tensor> {
        let ids = Tensor::from_vec(ids, (rows, steps), &Device::Cpu)?;
        Ok(lm.embedding.forward(&ids)?.detach())
    };
    let logits_of = |hidden: &Tensor| -> Result<Vec<Vec<f32>>> { Ok(lm.head.forward(hidden)?.to_vec2()?) };

    // The prompt, once per row.
    let steps = prompt.len();
    let x = embed((0..rows).flat_map(|_| prompt.iter().copied()).collect(), steps)?;
    let (out, mut states) = rnn.forward_with_states(&x, &vec![steps; rows], Padding::default(), None)?;
    let mut hidden = out.narrow(1, steps - 1, 1)?.squeeze(1)?;

    let mut lines: Vec<Vec<u32>> = vec![Vec::new(); rows];
    let mut open = vec![true; rows];
    let ones = vec![1; rows];
    for _ in 0..options.max_chars {
        let logits = logits_of(&hidden)?;
        let mut next = vec![boundary; rows];
        for b in 0..rows {
            if !open[b] {
                continue;
            }
            let id = draw(&logits[b], options.temperature, rng);
            if id == boundary {
                open[b] = false;
            } else {
                lines[b].push(id);
                next[b] = id;
            }
        }
        if !open.contains(&true) {
            break;
        }
        let (out, finals) =
            rnn.forward_with_states(&embed(next, 1)?, &ones, Padding::default(), Some(&states))?;
        hidden = out.squeeze(1)?;
        states = finals;
    }
    Ok(lines.iter().map(|ids| format!("{}{}", options.prompt, lm.vocab.decode(ids))).collect())
}

/// `softmax(values)` in place, computed stably (the largest value subtracted first).
pub fn softmax_in_place(values: &mut [f32]) {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in values.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    values.iter_mut().for_each(|v| *v /= sum);
}

/// An id drawn from `softmax(logits / temperature)` (the largest logit at temperature 0).
pub fn draw(logits: &[f32], temperature: f32, rng: &mut ChaCha8Rng) -> u32 {
    if temperature <= 0.0 {
        let best =
            logits
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |acc, (i, &v)| if v > acc.1 { (i, v) } else { acc });
        return best.0 as u32;
    }
    let mut probs: Vec<f32> = logits.iter().map(|v| v / temperature).collect();
    softmax_in_place(&mut probs);
    let mut u: f32 = rng.random();
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return i as u32;
        }
        u -= p;
    }
    // Rounding left `u` just above the total: the last character with any mass.
    probs.iter().rposition(|&p| p > 0.0).unwrap_or(0) as u32
}

/// `text` broken at spaces into lines of at most `width` characters (a
/// longer word gets a line of its own), each line prefixed by `indent`.
pub fn wrap(text: &str, width: usize, indent: &str) -> String {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split(' ') {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    lines.push(line);
    lines.iter().map(|l| format!("{indent}{l}")).collect::<Vec<_>>().join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn draws_follow_the_softmax() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let logits = [0.0f32, 2f32.ln(), f32::NEG_INFINITY];
        let mut counts = [0usize; 3];
        for _ in 0..30_000 {
            counts[draw(&logits, 1.0, &mut rng) as usize] += 1;
        }
        // Probabilities 1/3, 2/3, 0.
        assert_eq!(counts[2], 0);
        let share = counts[1] as f64 / 30_000.0;
        assert!((share - 2.0 / 3.0).abs() < 0.015, "{share}");
        assert_eq!(draw(&logits, 0.0, &mut rng), 1);
    }

    #[test]
    fn wrap_breaks_at_spaces() {
        assert_eq!(wrap("and the earth was", 8, "> "), "> and the\n> earth\n> was");
        assert_eq!(wrap("", 8, "  "), "  ");
    }
}
