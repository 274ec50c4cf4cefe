//! What both language-model examples end with: generated verses, chosen by
//! the same flags.

use charlm::lm::CharLm;
use charlm::sample::{generate, wrap, SampleOptions};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The sampling flags.
#[derive(clap::Args, Debug)]
pub struct Sampling {
    /// Verses to generate.
    #[arg(long, default_value_t = 4)]
    pub samples: usize,
    /// Sampling temperature (0: always the likeliest character).
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f32,
    /// Start of every generated verse.
    #[arg(long, default_value = "")]
    pub prompt: String,
    /// Characters generated per verse at most.
    #[arg(long, default_value_t = 500)]
    pub max_chars: usize,
}

impl Sampling {
    /// Generates the verses from `seed` and prints them, wrapped.
    pub fn print(&self, lm: &CharLm, seed: u64) -> charlm::Result<()> {
        let options = SampleOptions {
            count: self.samples,
            max_chars: self.max_chars,
            temperature: self.temperature,
            prompt: self.prompt.clone(),
        };
        if options.count == 0 {
            return Ok(());
        }
        println!("\nsampled verses (temperature {}):", self.temperature);
        for verse in generate(lm, &options, &mut ChaCha8Rng::seed_from_u64(seed))? {
            println!("{}\n", wrap(&verse, 92, "  "));
        }
        Ok(())
    }
}
