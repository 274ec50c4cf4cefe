//! The whole model: embedding → the cell's RNN (a runtime `Model`, on
//! whichever backend it was given) → softmax head. Scores a batch, or
//! gives its mean loss per character and the gradient of that loss with
//! respect to every parameter.

use crate::batches::Batch;
use crate::embedding::Embedding;
use crate::head::{Head, HeadGrads};
use crate::text::Vocab;
use crate::{Error, Result};
use cellc::dims::Bindings;
use cellc_runtime::backend::Backend;
use cellc_runtime::{Align, CompiledCell, Input, Major, Model, ModelConfig};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::path::Path;
use std::sync::Arc;

/// A `.cell` program: where it came from, and its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellSource {
    /// A file name for diagnostics and reports (`cells/lstm.cell`).
    pub name: String,
    pub text: String,
}

impl CellSource {
    pub fn read(path: &Path) -> Result<CellSource> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Ok(CellSource { name: path.display().to_string(), text })
    }

    /// A cell of `cells/` by name (`lstm`) or any `.cell` file by path,
    /// named relative to the repository when inside it (`cells/lstm.cell`).
    pub fn find(name_or_path: &str) -> Result<CellSource> {
        let file = crate::paths::cell_file(name_or_path)?;
        Ok(CellSource { name: crate::paths::from_repo(&file), ..CellSource::read(&file)? })
    }

    pub fn compile(&self) -> Result<CompiledCell> {
        Ok(CompiledCell::from_source(&self.name, &self.text, None)?)
    }
}

/// The shape of a new model: embedding width, RNN layers, and the cell's
/// size variables (`H`, and any other the cell declares, e.g. `P`).
#[derive(Clone, Debug)]
pub struct LmSpec {
    pub embedding: usize,
    pub layers: usize,
    pub sizes: Bindings,
}

/// A character-level language model.
#[derive(Debug)]
pub struct CharLm {
    pub vocab: Vocab,
    pub embedding: Embedding,
    pub rnn: Model,
    pub head: Head,
    pub cell: CellSource,
}

/// Gradients of every parameter, in the model's layout.
#[derive(Clone, Debug)]
pub struct LmGrads {
    pub embedding: Vec<f32>,
    /// `[layer][param]`, as `Model::params_mut`.
    pub rnn: Vec<Vec<Vec<f32>>>,
    pub head: HeadGrads,
}

impl LmGrads {
    /// Every gradient as a flat slice, in [`CharLm::params_mut`]'s order.
    pub fn tensors(&self) -> Vec<&[f32]> {
        let mut out: Vec<&[f32]> = vec![&self.embedding];
        out.extend(self.rnn.iter().flatten().map(Vec::as_slice));
        out.push(&self.head.weight);
        out.push(&self.head.bias);
        out
    }
}

impl CharLm {
    /// A freshly initialised model: the RNN's parameters from the cell's
    /// init clauses, the embedding and head as PyTorch starts them; all
    /// from `seed`.
    pub fn new(
        cell: CellSource,
        vocab: Vocab,
        spec: &LmSpec,
        seed: u64,
        backend: Box<dyn Backend>,
    ) -> Result<CharLm> {
        let compiled = Arc::new(cell.compile()?);
        let config = ModelConfig { layers: spec.layers, bidirectional: false };
        let rnn = Model::new(compiled, config, &spec.sizes, Some(spec.embedding), None, seed, backend)?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let embedding = Embedding::init(vocab.len(), spec.embedding, &mut rng);
        let head = Head::init(vocab.len(), rnn.output_size(), &mut rng);
        CharLm::from_parts(vocab, embedding, rnn, head, cell)
    }

    /// Assembles a model from its parts, checking that they fit together.
    pub fn from_parts(
        vocab: Vocab,
        embedding: Embedding,
        rnn: Model,
        head: Head,
        cell: CellSource,
    ) -> Result<CharLm> {
        let fits = embedding.vocab == vocab.len()
            && head.vocab == vocab.len()
            && embedding.dim == rnn.input_size()
            && head.input == rnn.output_size()
            && embedding.weight.len() == embedding.vocab * embedding.dim
            && head.weight.len() == head.vocab * head.input
            && head.bias.len() == head.vocab;
        if !fits || rnn.directions() != 1 {
            return Err(Error::Invalid(format!(
                "the parts do not fit: vocabulary {}, embedding [{}, {}], RNN {} -> {} features ({} directions), head [{}, {}]",
                vocab.len(),
                embedding.vocab,
                embedding.dim,
                rnn.input_size(),
                rnn.output_size(),
                rnn.directions(),
                head.vocab,
                head.input
            )));
        }
        Ok(CharLm { vocab, embedding, rnn, head, cell })
    }

    /// The batch's embedded inputs as the runtime reads them: padded,
    /// batch-first, padding at the end.
    fn rnn_input<'a>(batch: &'a Batch, x: &'a [f32]) -> Input<'a> {
        Input::Padded {
            data: x,
            batch: batch.size(),
            steps: batch.steps,
            major: Major::BatchFirst,
            align: Align::Left,
            lengths: &batch.lengths,
        }
    }

    /// Summed negative log-likelihood (nats) of the batch's targets, and
    /// how many there are.
    pub fn score(&self, batch: &Batch) -> Result<(f64, usize)> {
        let rows = batch.real_rows();
        let x = self.embedding.forward(batch, &rows);
        let out = self.rnn.forward(Self::rnn_input(batch, &x), None)?;
        let pass = self.head.forward(&out.data, &rows, &batch.targets);
        Ok((pass.nll, pass.count))
    }

    /// Mean loss in nats per character over `batches`.
    pub fn evaluate(&self, batches: &[Batch]) -> Result<f64> {
        let (mut nll, mut count) = (0.0, 0);
        for b in batches {
            let (l, n) = self.score(b)?;
            nll += l;
            count += n;
        }
        Ok(nll / count.max(1) as f64)
    }

    /// The batch's mean loss per character and its gradients.
    pub fn loss_and_grads(&self, batch: &Batch) -> Result<(f64, LmGrads)> {
        let rows = batch.real_rows();
        let x = self.embedding.forward(batch, &rows);
        let (out, trace) = self.rnn.forward_train(Self::rnn_input(batch, &x), None)?;
        let pass = self.head.forward(&out.data, &rows, &batch.targets);
        let (nll, count) = (pass.nll, pass.count.max(1));
        let mut head = self.head.zero_grads();
        let mut d_out = vec![0.0; out.data.len()];
        self.head.backward(pass, &rows, &batch.targets, 1.0 / count as f32, &mut d_out, &mut head);
        let rnn = self.rnn.backward(&trace, &d_out, None)?;
        let mut embedding = vec![0.0; self.embedding.weight.len()];
        self.embedding.backward(batch, &rows, &rnn.d_input, &mut embedding);
        Ok((nll / count as f64, LmGrads { embedding, rnn: rnn.d_params, head }))
    }

    /// Every parameter as a flat mutable slice: embedding, the RNN's
    /// (layer by layer, in the cell's order), head weight, head bias.
    pub fn params_mut(&mut self) -> Vec<&mut [f32]> {
        let mut out: Vec<&mut [f32]> = vec![&mut self.embedding.weight];
        out.extend(self.rnn.params_mut().iter_mut().flatten().map(Vec::as_mut_slice));
        out.push(&mut self.head.weight);
        out.push(&mut self.head.bias);
        out
    }

    /// Parameter counts: embedding, RNN, head.
    pub fn parameter_counts(&self) -> (usize, usize, usize) {
        let rnn = self.rnn.weight_names().iter().map(|(_, shape)| shape.iter().product::<usize>()).sum();
        (self.embedding.weight.len(), rnn, self.head.weight.len() + self.head.bias.len())
    }

    /// A one-line description: cell, sizes, layers.
    pub fn describe(&self) -> String {
        // The input's own size is the embedding's: shown once, as that.
        let cell = &self.rnn.compiled().forward;
        let input_only = |k: &String| {
            cell.input_dim().variables().contains(k)
                && !cell.states.iter().any(|s| s.dim.variables().contains(k))
        };
        let sizes = self.rnn.layers()[0]
            .sizes
            .iter()
            .filter(|(k, _)| !input_only(k))
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        let layers = self.rnn.layers().len();
        format!(
            "{} ({}), {sizes}, embedding {}, {layers} layer{}",
            self.rnn.compiled().forward.name,
            self.cell.name,
            self.embedding.dim,
            if layers == 1 { "" } else { "s" }
        )
    }
}
