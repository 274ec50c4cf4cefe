//! Where the repository keeps what the examples and tests read: the cell
//! library, the training text, the PyTorch export. Resolved from this
//! crate's own directory, so the programs run from any working directory.

use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR"));
    examples.parent().unwrap_or(examples).to_path_buf()
}

/// The training text: Genesis and Exodus, one verse per line.
pub fn default_corpus() -> PathBuf {
    repo_root().join("examples/data/genesis_exodus_kjv.txt")
}

/// The model trained and exported by `examples/pytorch/train_export.py`.
pub fn pytorch_export() -> PathBuf {
    repo_root().join("examples/pytorch/charlm_lstm.safetensors")
}

/// Where the examples write weights and plots unless told otherwise.
pub fn default_output_dir() -> PathBuf {
    repo_root().join("target/charlm")
}

/// A cell by name from `cells/` (`lstm`, `gru`, `layernorm_lstm`, ...) or
/// a path to any `.cell` file.
pub fn cell_file(name_or_path: &str) -> Result<PathBuf> {
    let as_path = Path::new(name_or_path);
    if name_or_path.contains(std::path::MAIN_SEPARATOR) || name_or_path.ends_with(".cell") || as_path.exists()
    {
        return Ok(as_path.to_path_buf());
    }
    let cells = repo_root().join("cells");
    let file = cells.join(format!("{name_or_path}.cell"));
    if file.exists() {
        return Ok(file);
    }
    let mut known: Vec<String> = std::fs::read_dir(&cells)
        .map_err(|e| Error::io(&cells, e))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".cell").map(str::to_string))
        .filter(|n| n != "prelude")
        .collect();
    known.sort();
    Err(Error::Invalid(format!(
        "no cell `{name_or_path}` in cells/ (known: {}); or give a path to a .cell file",
        known.join(", ")
    )))
}

/// `path` relative to the repository when it is inside it (`cells/lstm.cell`,
/// as a checkpoint records its cell).
pub fn from_repo(path: &Path) -> String {
    let absolute = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let root = std::fs::canonicalize(repo_root()).unwrap_or_else(|_| repo_root());
    absolute.strip_prefix(&root).map_or_else(|_| path.display().to_string(), |p| p.display().to_string())
}

/// `path` relative to the working directory when it is inside it (for messages).
pub fn shown(path: &Path) -> String {
    let relative =
        std::env::current_dir().ok().and_then(|cwd| path.strip_prefix(cwd).ok().map(Path::to_path_buf));
    relative.unwrap_or_else(|| path.to_path_buf()).display().to_string()
}
