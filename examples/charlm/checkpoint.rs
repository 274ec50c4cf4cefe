//! Saving and loading a model: one safetensors file holding the weights
//! under the names PyTorch gives the `state_dict` of
//!
//! ```python
//! class CharLM(nn.Module):          # examples/pytorch/train_export.py
//!     embedding = nn.Embedding(V, E)
//!     rnn = nn.LSTM(E, H)           # any cell: its parameters' names
//!     head = nn.Linear(H, V)
//! ```
//!
//! (`embedding.weight`, `rnn.weight_ih_l0`, ..., `head.weight`,
//! `head.bias`), and in its metadata the vocabulary (`vocab`: the
//! characters in id order), the `.cell` program (`cell`, so a checkpoint
//! runs without the file it was trained from; a PyTorch export has none
//! and is given one) and free-form entries on how it was trained.

use crate::lm::{insert, CellSource, CharLm, EMBEDDING, HEAD_BIAS, HEAD_WEIGHT};
use crate::text::Vocab;
use crate::{Error, Result};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use cellc::dims::Bindings;
use cellc_runtime::backend::Device as RnnDevice;
use cellc_runtime::{Metadata, Model, ModelConfig, Weights};
use std::path::Path;
use std::sync::Arc;

const RNN_PREFIX: &str = "rnn.";

/// A loaded model and the metadata saved with it.
#[derive(Debug)]
pub struct Checkpoint {
    pub lm: CharLm,
    pub metadata: Metadata,
}

/// Saves `lm` (written to a temporary file and renamed: a crash leaves no
/// truncated checkpoint); `extra` adds metadata entries (how it was trained).
pub fn save(lm: &CharLm, path: &Path, extra: &Metadata) -> Result<()> {
    let mut w = Weights::default();
    for (name, var) in lm.named_vars() {
        w.insert(name, var.dims().to_vec(), var.flatten_all()?.to_vec1()?);
    }
    let mut metadata = extra.clone();
    metadata.insert("vocab".into(), lm.vocab.as_string());
    metadata.insert("cell".into(), lm.cell.text.clone());
    metadata.insert("cell_file".into(), lm.cell.name.clone());
    let model = lm.rnn.model();
    let rates: Vec<String> =
        model.rate_names().iter().zip(model.rates()).map(|(n, r)| format!("{n}={r}")).collect();
    metadata.insert("rates".into(), rates.join(","));
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    Ok(w.save_with_metadata(path, &metadata)?)
}

/// Loads a model saved by [`save`] or exported from PyTorch. `cell`
/// overrides the program saved in the file (and is required when it has none).
pub fn load(path: &Path, cell: Option<CellSource>, backend: Box<dyn RnnDevice>) -> Result<Checkpoint> {
    let (weights, metadata) = Weights::load_with_metadata(path)?;
    let invalid = |m: String| Error::Invalid(format!("{}: {m}", path.display()));
    let vocab =
        Vocab::from_chars(metadata.get("vocab").ok_or_else(|| invalid("no `vocab` in the metadata".into()))?)
            .map_err(|e| invalid(e.to_string()))?;
    let cell = match cell {
        Some(c) => c,
        None => CellSource {
            name: metadata.get("cell_file").cloned().unwrap_or_else(|| format!("{} (cell)", path.display())),
            text: metadata
                .get("cell")
                .cloned()
                .ok_or_else(|| invalid("no `cell` in the metadata: name the .cell file it runs".into()))?,
        },
    };

    let vars = VarMap::new();
    let mut rnn_weights = Weights::default();
    let mut layers = 0;
    for name in weights.names() {
        let Some(t) = weights.get(name) else { continue };
        if [EMBEDDING, HEAD_WEIGHT, HEAD_BIAS].contains(&name) {
            if t.shape.first() != Some(&vocab.len()) {
                return Err(invalid(format!(
                    "`{name}` has shape {:?}; its first dimension must be the vocabulary's {}",
                    t.shape,
                    vocab.len()
                )));
            }
        } else {
            let Some(own) = name.strip_prefix(RNN_PREFIX) else {
                return Err(invalid(format!("unexpected tensor `{name}` (neither embedding, rnn nor head)")));
            };
            layers = layers.max(layer_of(own).map_err(invalid)? + 1);
            rnn_weights.insert(own.to_string(), t.shape.clone(), t.data.clone());
        }
        insert(&vars, name, Tensor::from_slice(&t.data, t.shape.as_slice(), &Device::Cpu)?)?;
    }
    for name in [EMBEDDING, HEAD_WEIGHT, HEAD_BIAS] {
        if weights.get(name).is_none() {
            return Err(invalid(format!("no tensor `{name}`")));
        }
    }
    if layers == 0 {
        return Err(invalid("no RNN weights (`rnn.<param>_l0`)".into()));
    }
    let embedding_dim = weights.get(EMBEDDING).and_then(|t| t.shape.get(1).copied()).unwrap_or(0);
    let compiled = Arc::new(cell.compile()?);
    let config = ModelConfig { layers, bidirectional: false };
    let rates = match metadata.get("rates").filter(|r| !r.is_empty()) {
        None => Vec::new(),
        Some(text) => text
            .split(',')
            .map(|pair| {
                let (name, rate) = pair
                    .split_once('=')
                    .ok_or_else(|| invalid(format!("rates: `{pair}` is not NAME=RATE")))?;
                let rate: f32 =
                    rate.parse().map_err(|_| invalid(format!("rates: `{pair}` is not NAME=RATE")))?;
                Ok((name.to_string(), rate))
            })
            .collect::<Result<Vec<_>>>()?,
    };
    let rates: Vec<(&str, f32)> = rates.iter().map(|(n, r)| (n.as_str(), *r)).collect();
    let model =
        Model::new(compiled, config, &Bindings::new(), Some(embedding_dim), Some(&rnn_weights), 0, backend)?
            .with_rates(&rates)?;
    let lm = CharLm::assemble(vocab, vars, model, cell).map_err(|e| invalid(e.to_string()))?;
    Ok(Checkpoint { lm, metadata })
}

/// The layer `k` of a weight named `<param>_l<k>`.
fn layer_of(name: &str) -> std::result::Result<usize, String> {
    if name.ends_with("_reverse") {
        return Err(format!(
            "`{name}` belongs to a reverse direction: a bidirectional RNN reads the future and cannot be a language model"
        ));
    }
    name.rsplit_once("_l")
        .and_then(|(_, k)| k.parse().ok())
        .ok_or_else(|| format!("`rnn.{name}` is not named `<param>_l<layer>`"))
}
