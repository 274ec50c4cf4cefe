//! Helpers shared by the workspace tests (included with `mod support;`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The workspace root: where the tests were built, or `CELLC_TEST_ROOT`
/// where a test binary runs on another machine (the GPU check).
pub fn root() -> PathBuf {
    if let Some(root) = std::env::var_os("CELLC_TEST_ROOT") {
        return PathBuf::from(root);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ is inside the workspace").to_path_buf()
}

/// The GPU tests' gate: whether CUDA device 0 exists. Without one a test
/// skips, saying so in the verification log, unless `CELLC_REQUIRE_GPU`
/// is set (the GPU check sets it), where that fails. Where a GPU exists
/// nothing skips: any error opening it fails the test that opens it.
pub fn gpu_present(what: &str) -> bool {
    let count = cellc_runtime::backend::cuda::device_count();
    if matches!(count, Ok(n) if n > 0) {
        return true;
    }
    let why = match count {
        Ok(_) => "the CUDA driver sees no device".to_string(),
        Err(e) => e.to_string().lines().next().unwrap_or_default().to_string(),
    };
    assert!(
        std::env::var_os("CELLC_REQUIRE_GPU").is_none(),
        "CELLC_REQUIRE_GPU is set but {what} cannot run: {why}"
    );
    report(&format!("SKIPPED: {what}: no GPU ({why})"));
    false
}

/// The shipped cells, `cells/*.cell`, sorted by name.
pub fn shipped_cells() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("cells"))
        .expect("cells/ exists")
        .map(|e| e.expect("readable dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cell"))
        .collect();
    v.sort();
    v
}

/// True when expected outputs should be rewritten instead of compared
/// (`CELLC_BLESS=1 cargo test`).
pub fn blessing() -> bool {
    std::env::var_os("CELLC_BLESS").is_some_and(|v| v != "0")
}

/// Compares `text` with the golden file `path` (or rewrites it when
/// [`blessing`]); a difference is returned as a message showing both.
pub fn snapshot(path: &Path, text: &str) -> Option<String> {
    if blessing() {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("mkdir");
        }
        std::fs::write(path, text).expect("write snapshot");
        return None;
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    match std::fs::read_to_string(path) {
        Ok(expected) if expected == text => None,
        Ok(expected) => Some(format!("{name} changed\n--- expected\n{expected}\n+++ actual\n{text}")),
        Err(_) => Some(format!("{name}: no snapshot (run with CELLC_BLESS=1)")),
    }
}

/// A small deterministic generator (SplitMix64) for test data.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }

    pub fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

/// Compiles a shipped cell file; panics with the rendered diagnostics if it fails.
pub fn compile_shipped(path: &Path) -> cellc::Module {
    let name = path.file_name().and_then(|n| n.to_str()).expect("utf-8 name");
    let source = std::fs::read_to_string(path).expect("readable cell");
    match cellc::compile(name, &source).into_result() {
        Ok(m) => m,
        Err(e) => panic!("{name} does not compile:\n{e}"),
    }
}

/// The sizes a test gives a shipped cell: `H`, `P` (a projection) where
/// the cell has one, and `h` for any other but the input size `I` (xLSTM's
/// head size `D`).
pub fn cell_sizes(cell: &cellc_runtime::CompiledCell, h: usize, p: usize) -> cellc::dims::Bindings {
    cell.forward
        .sizes
        .iter()
        .filter(|k| *k != "I")
        .map(|k| (k.clone(), if k == "P" { p } else { h }))
        .collect()
}

/// A model of `cell` with hidden size `h`, input size `i` (or what the
/// sizes give where the cell's input has no size of its own: `x[H]`),
/// weights drawn from `seed`; `None` where the cell's input cannot read
/// such a layer (sru's `x[H]` after a bidirectional layer of `2*H` features).
pub fn try_model(
    cell: &std::sync::Arc<cellc_runtime::CompiledCell>,
    (h, p, i): (usize, usize, usize),
    config: &cellc_runtime::ModelConfig,
    seed: u64,
    backend: Box<dyn cellc_runtime::backend::Device>,
) -> Option<cellc_runtime::Model> {
    let sizes = cell_sizes(cell, h, p);
    let input = cell.forward.input_dim().eval(&sizes).map_or(i, |n| n as usize);
    match cellc_runtime::Model::new(cell.clone(), config.clone(), &sizes, Some(input), None, seed, backend) {
        Ok(m) => Some(m),
        Err(cellc_runtime::RuntimeError::Layer { .. }) => None,
        Err(e) => panic!("{}: {e}", cell.forward.name),
    }
}

/// A 2-layer bidirectional model where the cell allows it, else 2 layers
/// one way, else one layer.
pub fn two_layer_model(
    cell: &std::sync::Arc<cellc_runtime::CompiledCell>,
    sizes: (usize, usize, usize),
    seed: u64,
    backend: &dyn Fn() -> Box<dyn cellc_runtime::backend::Device>,
) -> cellc_runtime::Model {
    let config = |layers, bidirectional| cellc_runtime::ModelConfig { layers, bidirectional };
    try_model(cell, sizes, &config(2, true), seed, backend())
        .or_else(|| try_model(cell, sizes, &config(2, false), seed, backend()))
        // A layer whose output cannot feed its input (the sLSTM reads gate
        // pre-activations): one layer.
        .or_else(|| try_model(cell, sizes, &config(1, false), seed, backend()))
        .unwrap_or_else(|| panic!("{}: no model", cell.forward.name))
}

/// The shipped cells (not the prelude), compiled.
pub fn compiled_cells() -> Vec<std::sync::Arc<cellc_runtime::CompiledCell>> {
    shipped_cells()
        .iter()
        .filter(|p| p.file_stem().is_some_and(|s| s != "prelude"))
        .map(|p| std::sync::Arc::new(cellc_runtime::CompiledCell::from_file(p, None).expect("compiles")))
        .collect()
}

/// Says `line` on standard error and appends it to the verification log
/// (`CELLC_VERIFICATION_LOG`, else `verification.log` in cargo's temporary
/// folder for tests), which CI prints after the test run (what the CUDA
/// verification and the fuzzer checked, without running them twice).
pub fn report(line: &str) {
    use std::io::Write;
    eprintln!("{line}");
    let path = std::env::var_os("CELLC_VERIFICATION_LOG")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_TARGET_TMPDIR")).join("verification.log"));
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = f.write_all(format!("{line}\n").as_bytes());
    }
}

/// A fixture tensor's elements as f32 (lengths and other integers converted).
pub fn f32s(t: &cellc_runtime::Tensor) -> Vec<f32> {
    match &t.data {
        cellc_runtime::TensorData::F32(v) => v.clone(),
        cellc_runtime::TensorData::I64(v) => v.iter().map(|&x| x as f32).collect(),
    }
}

/// Tensor `name` of a fixture file, as f32; a panic naming it if absent.
pub fn fixture(map: &std::collections::BTreeMap<String, cellc_runtime::Tensor>, name: &str) -> Vec<f32> {
    f32s(map.get(name).unwrap_or_else(|| panic!("fixture has no `{name}`")))
}

/// `got` against the interpreter's `want`: the same length, and each value
/// within 2e-5 of it relative to `max(1, |want|)`, or both NaN (random
/// inputs may hand a norm's saved variance a negative value, and a kernel
/// then passes the interpreter's NaN on).
pub fn close_to_interpreter(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (j, (a, b)) in got.iter().zip(want).enumerate() {
        let err = (a - b).abs() / b.abs().max(1.0);
        assert!(err <= 2e-5 || (a.is_nan() && b.is_nan()), "{what}[{j}]: {a}, interpreter {b}");
    }
}
