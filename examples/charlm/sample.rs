//! Text generation: the model reads `\n` and a prompt, then draws one
//! character at a time from its softmax, sharpened or flattened by a
//! temperature, until it ends the line. Several lines are drawn at once,
//! as the rows of one batch; the RNN's state is carried from one call to
//! the next through the runtime's initial and final states.

use crate::head::softmax_in_place;
use crate::lm::CharLm;
use crate::Result;
use cellc_runtime::{Align, Input, Major};
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
    let (dim, width) = (lm.embedding.dim, lm.rnn.output_size());
    let embed = |ids: &[u32]| -> Vec<f32> {
        ids.iter()
            .flat_map(|&id| &lm.embedding.weight[id as usize * dim..(id as usize + 1) * dim])
            .copied()
            .collect()
    };

    // The prompt, once per row.
    let steps = prompt.len();
    let x: Vec<f32> = (0..rows).flat_map(|_| embed(&prompt)).collect();
    let lengths = vec![steps; rows];
    let input = Input::Padded {
        data: &x,
        batch: rows,
        steps,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &lengths,
    };
    let out = lm.rnn.forward(input, None)?;
    let mut states = out.final_states;
    let mut hidden: Vec<f32> = (0..rows)
        .flat_map(|b| &out.data[((b + 1) * steps - 1) * width..(b + 1) * steps * width])
        .copied()
        .collect();

    let mut lines: Vec<Vec<u32>> = vec![Vec::new(); rows];
    let mut open = vec![true; rows];
    let ones = vec![1; rows];
    for _ in 0..options.max_chars {
        let logits = lm.head.logits(&hidden, rows);
        let mut next = vec![boundary; rows];
        for b in 0..rows {
            if !open[b] {
                continue;
            }
            let id = draw(&logits[b * lm.vocab.len()..(b + 1) * lm.vocab.len()], options.temperature, rng);
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
        let x = embed(&next);
        let input = Input::Padded {
            data: &x,
            batch: rows,
            steps: 1,
            major: Major::BatchFirst,
            align: Align::Left,
            lengths: &ones,
        };
        let out = lm.rnn.forward(input, Some(&states))?;
        hidden = out.data;
        states = out.final_states;
    }
    Ok(lines.iter().map(|ids| format!("{}{}", options.prompt, lm.vocab.decode(ids))).collect())
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
