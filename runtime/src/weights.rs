//! Named tensors in safetensors files: weights (`weight_ih_l0`, ...), and
//! the inputs and outputs of `cellc run`.
//!
//! A PyTorch `nn.LSTM`/`nn.GRU`/`nn.RNN` `state_dict` saved with
//! `safetensors.torch.save_file` loads unchanged: its names are the
//! cell's parameter names with `_lK` / `_lK_reverse`. A file may also carry
//! string [`Metadata`] (safetensors' `__metadata__`, what `save_file(...,
//! metadata=...)` writes): a model's vocabulary, how it was trained.

use crate::error::{Result, RuntimeError};
use safetensors::tensor::{Dtype, TensorInfo, TensorView};
use safetensors::SafeTensors;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// The element data of a tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    /// Floats (a file's f32, f64, bf16 or f16 tensors).
    F32(Vec<f32>),
    /// Integers (a file's integer tensors, of any width).
    I64(Vec<i64>),
}

/// A named tensor read from or written to a file.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// The dimensions, outermost first.
    pub shape: Vec<usize>,
    /// The elements, row-major.
    pub data: TensorData,
}

impl Tensor {
    /// A float tensor of `shape`, `data` row-major.
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        Tensor { shape, data: TensorData::F32(data) }
    }

    /// An integer tensor of `shape`, `data` row-major.
    pub fn i64(shape: Vec<usize>, data: Vec<i64>) -> Tensor {
        Tensor { shape, data: TensorData::I64(data) }
    }
}

/// A safetensors file's string metadata, by key.
pub type Metadata = BTreeMap<String, String>;

/// Reads every tensor of a safetensors file. f32 and f64 become f32;
/// integer types become i64; anything else is an error naming the tensor.
pub fn read_tensors(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    read_file(path).map(|(tensors, _)| tensors)
}

/// Reads a safetensors file's metadata (empty when it has none).
pub fn read_metadata(path: &Path) -> Result<Metadata> {
    metadata_of(path, &read_bytes(path)?)
}

fn io_error(path: &Path, message: String) -> RuntimeError {
    RuntimeError::Io { path: path.display().to_string(), message }
}

/// The safetensors format's own bound on a header (100 MB).
const MOST_HEADER_BYTES: u64 = 100_000_000;

/// A safetensors file's bytes, read no further than it declares: its
/// 8-byte header length first, checked against the format's bound and the
/// file's size, then the header, then the data the header describes. A
/// stream that is no such file (`/dev/zero`, `/dev/urandom`) is an error
/// after a few bytes, not all the machine's memory.
fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    let io = |e: std::io::Error| io_error(path, e.to_string());
    let not_safetensors = |why: String| io_error(path, format!("not a safetensors file: {why}"));
    let mut file = std::fs::File::open(path).map_err(io)?;
    let size = file.metadata().ok().filter(|m| m.is_file()).map(|m| m.len());
    let mut bytes = vec![0u8; 8];
    file.read_exact(&mut bytes)
        .map_err(|_| not_safetensors("shorter than the 8 bytes of its header's length".into()))?;
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if n > MOST_HEADER_BYTES {
        return Err(not_safetensors(format!(
            "its header would be {n} bytes long; the format allows {MOST_HEADER_BYTES}"
        )));
    }
    if let Some(size) = size.filter(|&size| 8 + n > size) {
        return Err(not_safetensors(format!(
            "its header is {n} bytes long, but the file has {} bytes after the length (truncated?)",
            size - 8
        )));
    }
    bytes.resize(8 + n as usize, 0);
    file.read_exact(&mut bytes[8..])
        .map_err(|_| not_safetensors(format!("its {n}-byte header ends early")))?;
    // A regular file: the rest of it (the crate checks it against the header). A stream: the
    // data its header describes, and no more.
    let rest = match size {
        Some(size) => size - 8 - n,
        None => declared_data_bytes(&bytes[8..]),
    };
    (&mut file).take(rest).read_to_end(&mut bytes).map_err(io)?;
    Ok(bytes)
}

/// The bytes of data a safetensors header describes: the largest end of its
/// tensors' `data_offsets` (0 where the header does not parse; the reader
/// then reports why).
fn declared_data_bytes(header: &[u8]) -> u64 {
    let Ok(map) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(header) else {
        return 0;
    };
    map.iter()
        .filter(|(name, _)| name.as_str() != "__metadata__")
        .filter_map(|(_, entry)| entry.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0)
}

/// The metadata in the header of a safetensors file's `bytes`.
fn metadata_of(path: &Path, bytes: &[u8]) -> Result<Metadata> {
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| {
        let why = explain_bad_tensor(bytes).unwrap_or_else(|| e.to_string());
        io_error(path, format!("not a safetensors file: {why}"))
    })?;
    Ok(header.metadata().iter().flatten().map(|(k, v)| (k.clone(), v.clone())).collect())
}

/// Which tensor of a header the safetensors crate rejected, and why: its
/// errors for a tensor whose bytes do not match its shape, or data that
/// runs past the end of the file, name no tensor. `None` when the header
/// itself cannot be read (the crate's message says enough then).
fn explain_bad_tensor(bytes: &[u8]) -> Option<String> {
    // A header longer than the file was reported as the file was read (`read_bytes`).
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header = bytes.get(8..8usize.checked_add(n)?)?;
    let data_len = bytes.len() - 8 - n;
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    // Each entry as the safetensors crate reads it (its dtypes and their sizes).
    let mut entries = Vec::new();
    for (name, entry) in map.iter().filter(|(name, _)| name.as_str() != "__metadata__") {
        match serde_json::from_value::<TensorInfo>(entry.clone()) {
            Ok(info) => entries.push((name, info)),
            Err(e) => return Some(format!("tensor `{name}` has an unreadable entry: {e}")),
        }
    }
    entries.sort_by_key(|(_, info)| info.data_offsets);
    let mut expected_start = 0usize;
    for (name, info) in entries {
        let (start, end) = info.data_offsets;
        let needed =
            info.shape.iter().map(|&d| d as u128).product::<u128>() * info.dtype.bitsize() as u128 / 8;
        let shape_text = format!("{:?} {:?}", info.dtype, info.shape);
        if end < start || start != expected_start {
            return Some(format!(
                "tensor `{name}` ({shape_text}) has data_offsets [{start}, {end}]; the previous tensor ends at {expected_start}"
            ));
        }
        if (end - start) as u128 != needed {
            return Some(format!(
                "tensor `{name}` ({shape_text}) needs {needed} bytes, but its data_offsets [{start}, {end}] hold {}",
                end - start
            ));
        }
        if end > data_len {
            return Some(format!(
                "tensor `{name}` ({shape_text}) ends at byte {end} of the data, but the file has {data_len} bytes of data (truncated?)"
            ));
        }
        expected_start = end;
    }
    None
}

/// Tensors and metadata of a safetensors file, read once.
fn read_file(path: &Path) -> Result<(BTreeMap<String, Tensor>, Metadata)> {
    let io = |e: String| io_error(path, e);
    let bytes = read_bytes(path)?;
    let metadata = metadata_of(path, &bytes)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| io(format!("not a safetensors file: {e}")))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let raw = view.data();
        let data = match view.dtype() {
            Dtype::F32 => TensorData::F32(
                raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            ),
            Dtype::F64 => TensorData::F32(
                raw.chunks_exact(8)
                    .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
                    .collect(),
            ),
            Dtype::I64 => TensorData::I64(
                raw.chunks_exact(8)
                    .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect(),
            ),
            Dtype::I32 => TensorData::I64(
                raw.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect(),
            ),
            // Half-precision checkpoints (a bf16 or fp16 model's state_dict): exact in f32.
            Dtype::BF16 => TensorData::F32(
                raw.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            ),
            Dtype::F16 => TensorData::F32(
                raw.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            ),
            // Flags (per-step resets): one byte each.
            Dtype::BOOL | Dtype::U8 => TensorData::I64(raw.iter().map(|&b| i64::from(b)).collect()),
            other => {
                return Err(io(format!(
                    "tensor `{name}` has dtype {other:?}; f32, f64, bf16, f16, i32, i64, u8 or bool expected"
                )))
            }
        };
        out.insert(name, Tensor { shape: view.shape().to_vec(), data });
    }
    Ok((out, metadata))
}

/// Writes tensors to a safetensors file (f32 as F32, i64 as I64).
pub fn write_tensors(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    write_tensors_with_metadata(path, tensors, &Metadata::new())
}

/// Writes tensors and string metadata to a safetensors file.
pub fn write_tensors_with_metadata(
    path: &Path,
    tensors: &BTreeMap<String, Tensor>,
    metadata: &Metadata,
) -> Result<()> {
    let io = |e: String| RuntimeError::Io { path: path.display().to_string(), message: e };
    let bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, t)| match &t.data {
            TensorData::F32(v) => {
                (n.clone(), Dtype::F32, t.shape.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            TensorData::I64(v) => {
                (n.clone(), Dtype::I64, t.shape.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(n, d, s, b)| TensorView::new(*d, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| io(e.to_string()))?;
    let metadata = (!metadata.is_empty()).then(|| metadata.clone().into_iter().collect());
    let data = safetensors::serialize(views, metadata).map_err(|e| io(e.to_string()))?;
    crate::files::write_atomically(path, &data)
}

/// A model's weights by name (f32), as a PyTorch `state_dict` names them:
/// the cell's parameter name, then `_l<layer>`, then `_reverse` for a
/// second direction (`weight_ih_l0`, `bias_hh_l1_reverse`).
///
/// [`Model::weights`](crate::Model::weights) gives a model's;
/// [`Model::new`](crate::Model::new) takes them, binding the sizes the
/// shapes say. Saved and loaded as safetensors files, optionally with
/// string [`Metadata`].
///
/// ```
/// use cellc_runtime::{Metadata, Weights};
///
/// // An LSTM layer at H = 2, I = 3: weight_ih is [4*H, I].
/// let mut weights = Weights::default();
/// weights.insert("weight_ih_l0".into(), vec![8, 3], (0..24).map(|i| i as f32 * 0.1).collect());
/// weights.insert("bias_ih_l0".into(), vec![8], vec![0.5; 8]);
///
/// let path = std::env::temp_dir().join(format!("cellc_weights_doc_{}.safetensors", std::process::id()));
/// let metadata: Metadata = [("trained_by".to_string(), "a doctest".to_string())].into();
/// weights.save_with_metadata(&path, &metadata)?;
///
/// let (loaded, read) = Weights::load_with_metadata(&path)?;   // or Weights::load(&path)
/// assert_eq!(loaded, weights);
/// assert_eq!(read["trained_by"], "a doctest");
/// assert_eq!(loaded.names().collect::<Vec<_>>(), ["bias_ih_l0", "weight_ih_l0"]); // sorted
/// assert_eq!(loaded.get("weight_ih_l0").map(|w| w.shape.as_slice()), Some(&[8, 3][..]));
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), cellc_runtime::RuntimeError>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Weights {
    tensors: BTreeMap<String, WeightTensor>,
}

/// One weight of a [`Weights`].
#[derive(Clone, Debug, PartialEq)]
pub struct WeightTensor {
    /// The dimensions, outermost first (`[4*H, I]` for an LSTM's `weight_ih_l0`).
    pub shape: Vec<usize>,
    /// The elements, row-major.
    pub data: Vec<f32>,
}

impl Weights {
    /// Adds weight `name` of `shape` (`data` row-major), replacing any of that name.
    pub fn insert(&mut self, name: String, shape: Vec<usize>, data: Vec<f32>) {
        self.tensors.insert(name, WeightTensor { shape, data });
    }

    /// The weight called `name`, if there is one.
    pub fn get(&self, name: &str) -> Option<&WeightTensor> {
        self.tensors.get(name)
    }

    /// Every weight's name, in sorted order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// How many weights there are.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there are no weights.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Loads a safetensors file of f32 (or f64) tensors.
    pub fn load(path: &Path) -> Result<Weights> {
        Weights::load_with_metadata(path).map(|(w, _)| w)
    }

    /// Loads a safetensors file of f32 (or f64) tensors and its metadata.
    pub fn load_with_metadata(path: &Path) -> Result<(Weights, Metadata)> {
        let (tensors, metadata) = read_file(path)?;
        let mut w = Weights::default();
        for (name, t) in tensors {
            match t.data {
                TensorData::F32(data) => w.insert(name, t.shape, data),
                TensorData::I64(_) => {
                    return Err(RuntimeError::Io {
                        path: path.display().to_string(),
                        message: format!("weight `{name}` holds integers, not floats"),
                    })
                }
            }
        }
        Ok((w, metadata))
    }

    /// Saves as a safetensors file.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.save_with_metadata(path, &Metadata::new())
    }

    /// Saves as a safetensors file with string metadata.
    pub fn save_with_metadata(&self, path: &Path, metadata: &Metadata) -> Result<()> {
        let map = self
            .tensors
            .iter()
            .map(|(n, t)| (n.clone(), Tensor::f32(t.shape.clone(), t.data.clone())))
            .collect();
        write_tensors_with_metadata(path, &map, metadata)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_with_the_weights() {
        let path =
            std::env::temp_dir().join(format!("cellc_weights_metadata_{}.safetensors", std::process::id()));
        let mut w = Weights::default();
        w.insert("weight_ih_l0".into(), vec![2, 3], (0..6).map(|i| i as f32 * 0.5).collect());
        w.insert("bias_ih_l0".into(), vec![2], vec![-1.0, 1.0]);
        let metadata: Metadata =
            [("vocab".to_string(), "\n ab\"c".to_string()), ("layers".to_string(), "1".to_string())].into();
        w.save_with_metadata(&path, &metadata).expect("saves");
        let (loaded, read) = Weights::load_with_metadata(&path).expect("loads");
        assert_eq!(loaded, w);
        assert_eq!(read, metadata);
        assert_eq!(read_metadata(&path).expect("reads"), metadata);

        // Without metadata: an empty map, and the same tensors.
        w.save(&path).expect("saves");
        assert!(read_metadata(&path).expect("reads").is_empty());
        assert_eq!(Weights::load(&path).expect("loads"), w);
        std::fs::remove_file(&path).ok();
    }

    #[test]
    fn flags_read_as_integers() {
        let path =
            std::env::temp_dir().join(format!("cellc_weights_flags_{}.safetensors", std::process::id()));
        let bytes = [1u8, 0, 0, 1, 1, 0];
        let views = [("resets", TensorView::new(Dtype::BOOL, vec![2, 3], &bytes).expect("a view"))];
        std::fs::write(&path, safetensors::serialize(views, None).expect("serialises")).expect("writes");
        let read = read_tensors(&path).expect("reads");
        assert_eq!(read["resets"].shape, vec![2, 3]);
        assert_eq!(read["resets"].data, TensorData::I64(vec![1, 0, 0, 1, 1, 0]));
        std::fs::remove_file(&path).ok();
    }

    #[test]
    fn half_precision_tensors_read_as_their_exact_floats() {
        let path =
            std::env::temp_dir().join(format!("cellc_weights_half_{}.safetensors", std::process::id()));
        let values = [1.0f32, -0.5, 3.140625, 65504.0];
        let bf16: Vec<u8> = values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
        let f16: Vec<u8> = values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
        let views = [
            ("weight_ih_l0", TensorView::new(Dtype::BF16, vec![2, 2], &bf16).expect("a view")),
            ("weight_hh_l0", TensorView::new(Dtype::F16, vec![4], &f16).expect("a view")),
        ];
        std::fs::write(&path, safetensors::serialize(views, None).expect("serialises")).expect("writes");
        let w = Weights::load(&path).expect("loads");
        let rounded: Vec<f32> = values.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        assert_eq!(w.get("weight_ih_l0").expect("bf16").data, rounded);
        assert_eq!(w.get("weight_hh_l0").expect("f16").data, values.to_vec());
        std::fs::remove_file(&path).ok();
    }
}
