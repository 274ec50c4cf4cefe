//! The whole model: candle-nn's embedding → cellc's RNN of a `.cell` file
//! (a [`cellc_candle::Rnn`], run forward and backward by the runtime's CPU
//! back end inside candle's autograd) → candle-nn's linear head, its
//! weights candle `Var`s under the names PyTorch gives the `state_dict` of
//! the same module. Scores a batch, or gives its mean loss per character
//! as a candle tensor to differentiate.

use crate::batches::Batch;
use crate::text::Vocab;
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{Embedding, Linear, Module, VarBuilder, VarMap};
use cellc_candle::{Padding, Rnn};
use cellc_runtime::backend::Device as RnnDevice;
use cellc_runtime::{CompiledCell, Model, ModelConfig};
use rand::{RngExt, SeedableRng};
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
    pub sizes: cellc::dims::Bindings,
    /// The cell's rates set by name (`zh = 0.1`); the others keep their defaults.
    pub rates: Vec<(String, f32)>,
}

/// A character-level language model.
pub struct CharLm {
    pub vocab: Vocab,
    /// Every weight, under its PyTorch name.
    pub vars: VarMap,
    pub embedding: Embedding,
    pub rnn: Rnn,
    pub head: Linear,
    pub cell: CellSource,
}

impl std::fmt::Debug for CharLm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CharLm").field("model", &self.describe()).field("vocab", &self.vocab).finish()
    }
}

pub const EMBEDDING: &str = "embedding.weight";
pub const HEAD_WEIGHT: &str = "head.weight";
pub const HEAD_BIAS: &str = "head.bias";

impl CharLm {
    /// A freshly initialised model, all from `seed`: the RNN's parameters
    /// from the cell's init clauses, the embedding N(0, 1) and the head
    /// U(±1/√H), as PyTorch starts them (candle's CPU generator takes no
    /// seed, so the values are drawn here).
    pub fn new(
        cell: CellSource,
        vocab: Vocab,
        spec: &LmSpec,
        seed: u64,
        backend: Box<dyn RnnDevice>,
    ) -> Result<CharLm> {
        let compiled = Arc::new(cell.compile()?);
        let config = ModelConfig { layers: spec.layers, bidirectional: false };
        let rates: Vec<(&str, f32)> = spec.rates.iter().map(|(n, r)| (n.as_str(), *r)).collect();
        let model = Model::new(compiled, config, &spec.sizes, Some(spec.embedding), None, seed, backend)?
            .with_rates(&rates)?;
        let (v, e, h) = (vocab.len(), spec.embedding, model.output_size());
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let embedding: Vec<f32> = (0..v * e).map(|_| standard_normal(&mut rng)).collect();
        let bound = 1.0 / (h as f32).sqrt();
        let mut uniform = || (2.0 * rng.random::<f32>() - 1.0) * bound;
        let head_weight: Vec<f32> = (0..v * h).map(|_| uniform()).collect();
        let head_bias: Vec<f32> = (0..v).map(|_| uniform()).collect();
        let vars = VarMap::new();
        insert(&vars, EMBEDDING, Tensor::from_vec(embedding, (v, e), &Device::Cpu)?)?;
        insert(&vars, HEAD_WEIGHT, Tensor::from_vec(head_weight, (v, h), &Device::Cpu)?)?;
        insert(&vars, HEAD_BIAS, Tensor::from_vec(head_bias, v, &Device::Cpu)?)?;
        CharLm::assemble(vocab, vars, model, cell)
    }

    /// The model over `vars` (which hold the embedding and head, and the
    /// RNN's weights under `rnn.` or none: then the model's own).
    pub fn assemble(vocab: Vocab, vars: VarMap, model: Model, cell: CellSource) -> Result<CharLm> {
        let (v, e, h) = (vocab.len(), model.input_size(), model.output_size());
        if model.directions() != 1 {
            return Err(Error::Invalid(
                "a bidirectional RNN reads the future and cannot be a language model".into(),
            ));
        }
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
        let fits = |name: &str, shape: &[usize]| {
            let data = vars.data().lock().map_err(|_| Error::Invalid("poisoned".into()))?;
            match data.get(name) {
                Some(t) if t.dims() != shape => Err(Error::Invalid(format!(
                    "`{name}` has shape {:?}; the model (vocabulary {v}, embedding {e}, RNN output {h}) needs {shape:?}",
                    t.dims()
                ))),
                _ => Ok(()),
            }
        };
        fits(EMBEDDING, &[v, e])?;
        fits(HEAD_WEIGHT, &[v, h])?;
        fits(HEAD_BIAS, &[v])?;
        let embedding = candle_nn::embedding(v, e, vb.pp("embedding"))?;
        let rnn = Rnn::new(model, vb.pp("rnn"))?;
        let head = candle_nn::linear(h, v, vb.pp("head"))?;
        Ok(CharLm { vocab, vars, embedding, rnn, head, cell })
    }

    /// `[N, V]` logits at the batch's real positions (row by row), and the
    /// `[N]` targets there.
    fn logits(&self, batch: &Batch, train: bool) -> Result<(Tensor, Tensor)> {
        let (b, t) = (batch.size(), batch.steps);
        let ids = Tensor::from_slice(&batch.inputs, (b, t), &Device::Cpu)?;
        let real: Vec<u32> = batch.real_rows().into_iter().map(|r| r as u32).collect();
        let real = Tensor::from_vec(real, batch.tokens(), &Device::Cpu)?;
        let (embedding, rnn, head) = if train {
            (self.embedding.clone(), self.rnn.clone(), self.head.clone())
        } else {
            (
                Embedding::new(self.embedding.embeddings().detach(), self.embedding.hidden_size()),
                self.rnn.detach(),
                Linear::new(self.head.weight().detach(), self.head.bias().map(Tensor::detach)),
            )
        };
        let x = embedding.forward(&ids)?;
        // Training draws the cell's own masks (zoneout, dropout), if it has any.
        let out = rnn.forward_t(&x, &batch.lengths, Padding::default(), train)?;
        // The head runs on every row, padding too (a few rows more of a
        // small product), and the real rows are picked from its logits:
        // a quarter of the floats gathered, and scattered back in the
        // backward, that picking the RNN's outputs would move.
        let logits = head.forward(&out.reshape((b * t, out.dim(2)?))?)?.index_select(&real, 0)?;
        let targets = Tensor::from_slice(&batch.targets, b * t, &Device::Cpu)?.index_select(&real, 0)?;
        Ok((logits, targets))
    }

    /// The batch's mean loss per character, to differentiate.
    pub fn loss(&self, batch: &Batch) -> Result<Tensor> {
        let (logits, targets) = self.logits(batch, true)?;
        Ok(candle_nn::loss::cross_entropy(&logits, &targets)?)
    }

    /// Summed negative log-likelihood (nats, summed in f64) of the
    /// batch's targets, and how many there are.
    pub fn score(&self, batch: &Batch) -> Result<(f64, usize)> {
        let (logits, targets) = self.logits(batch, false)?;
        let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let picked: Vec<f32> = log_probs.gather(&targets.unsqueeze(1)?, 1)?.flatten_all()?.to_vec1()?;
        Ok((-picked.iter().map(|&l| f64::from(l)).sum::<f64>(), picked.len()))
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

    /// Every weight with its name, sorted by name.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        let data = self.vars.data().lock().map(|d| d.clone()).unwrap_or_default();
        let mut vars: Vec<(String, Var)> = data.into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        vars
    }

    /// Parameter counts: embedding, RNN, head.
    pub fn parameter_counts(&self) -> (usize, usize, usize) {
        let rnn = self.rnn.weights().iter().map(|(_, t)| t.elem_count()).sum();
        let head = self.head.weight().elem_count() + self.head.bias().map_or(0, Tensor::elem_count);
        (self.embedding.embeddings().elem_count(), rnn, head)
    }

    /// A one-line description: cell, sizes, layers.
    pub fn describe(&self) -> String {
        let model = self.rnn.model();
        // The input's own size is the embedding's: shown once, as that.
        let cell = &model.compiled().forward;
        let input_only = |k: &String| {
            cell.input_dim().variables().contains(k)
                && !cell.states.iter().any(|s| s.dim.variables().contains(k))
        };
        let sizes = model.layers()[0]
            .sizes
            .iter()
            .filter(|(k, _)| !input_only(k))
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        let layers = model.layers().len();
        let rates: String =
            model.rate_names().iter().zip(model.rates()).map(|(n, r)| format!(", {n}={r}")).collect();
        format!(
            "{} ({}), {sizes}, embedding {}, {layers} layer{}{rates}",
            cell.name,
            self.cell.name,
            model.input_size(),
            if layers == 1 { "" } else { "s" }
        )
    }
}

/// Adds `value` to `vars` as a new `Var` named `name`.
pub fn insert(vars: &VarMap, name: &str, value: Tensor) -> Result<()> {
    let var = Var::from_tensor(&value)?;
    vars.data().lock().map_err(|_| Error::Invalid("poisoned".into()))?.insert(name.to_string(), var);
    Ok(())
}

/// A draw from N(0, 1) (Box-Muller).
fn standard_normal(rng: &mut ChaCha8Rng) -> f32 {
    let u: f64 = 1.0 - rng.random::<f64>(); // (0, 1]: the log is finite
    let v: f64 = rng.random();
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}
