//! `cellc-build`: compiles `.cell` files ahead of time from a build
//! script, the way `prost-build` turns `.proto` files into Rust.
//!
//! ```no_run
//! // build.rs, in `fn main` (not run here: only cargo gives a build script
//! // its `OUT_DIR`; the example of `CellBuild::build` runs it in a folder of its own)
//! cellc_build::cell("cells/lstm.cell").size("H", 128).build();
//! ```
//!
//! ```ignore
//! // src/main.rs: the module the build script wrote (this block cannot be
//! // compiled on its own: the module exists only in a build's `OUT_DIR`)
//! mod lstm {
//!     include!(concat!(env!("OUT_DIR"), "/cellc_lstm.rs"));
//! }
//! let model = lstm::Lstm::load(ModelConfig::default(), "weights.safetensors".as_ref(), 0)?;
//! let (output, finals) = model.forward(input, None)?; // finals: lstm::LstmStates { h, c }
//! ```
//!
//! For each cell, [`CellBuild::build`] compiles the CPU back end's kernels
//! with Cranelift (the same machine code its JIT would make), archives them
//! into a static library that cargo links, and writes a Rust module with
//! typed bindings: a parameter struct with one field per `param`, a state
//! struct with one field per `state`, and a model type whose forward and
//! backward run the linked kernels. The program needs `cellc-runtime`
//! without its `jit` feature: no code generator at run time. Sizes left
//! unbound that no kernel depends on (an LSTM's input size) stay arguments
//! of the model's constructor.
//!
//! Errors (a `.cell` file that does not compile, a size a kernel needs left
//! unbound) are reported to cargo with the diagnostics rendered, and the
//! build script exits with status 1: no panic, no backtrace.

#![warn(missing_docs)]

mod bindings;

use cellc::dims::Bindings;
use cellc_runtime::backend::cpu::codegen::object::compile_model;
use cellc_runtime::{CompiledCell, ModelConfig};
use std::path::{Path, PathBuf};

/// One `.cell` file to compile (see the crate documentation).
#[derive(Clone, Debug)]
pub struct CellBuild {
    path: PathBuf,
    cell: Option<String>,
    name: Option<String>,
    sizes: Bindings,
    config: ModelConfig,
}

/// Starts the build of the `.cell` file at `path` (relative to the crate's `Cargo.toml`).
pub fn cell(path: impl AsRef<Path>) -> CellBuild {
    CellBuild {
        path: path.as_ref().to_path_buf(),
        cell: None,
        name: None,
        sizes: Bindings::new(),
        config: ModelConfig::default(),
    }
}

/// Why a build failed: the message, rendered diagnostics included.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error(pub String);

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// What [`CellBuild::generate`] makes.
#[derive(Clone, Debug)]
pub struct Generated {
    /// The module's name: files are `cellc_<name>.{o,json,rs}`.
    pub name: String,
    /// The object file: the cell's kernels, to link (`cellc_<name>.o`).
    pub object: Vec<u8>,
    /// The manifest, JSON: the kernels and the sizes they were built for (`cellc_<name>.json`).
    pub manifest: String,
    /// The Rust bindings.
    pub rust: String,
    /// The `.cell` file's warnings, rendered.
    pub warnings: String,
}

impl CellBuild {
    /// Which cell of the file (default: its first).
    pub fn cell(mut self, name: &str) -> Self {
        self.cell = Some(name.to_string());
        self
    }

    /// The module's name: `cellc_<name>.rs` in `OUT_DIR`, and the model
    /// type is its CamelCase (default: the cell's name).
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_string());
        self
    }

    /// Binds a size variable (every size a kernel depends on must be bound).
    pub fn size(mut self, variable: &str, value: usize) -> Self {
        self.sizes.insert(variable.to_string(), value);
        self
    }

    /// The model's layers (default 1): layers after the first read the one
    /// before, so their kernels may need other sizes.
    pub fn layers(mut self, layers: usize) -> Self {
        self.config.layers = layers;
        self
    }

    /// Builds the kernels for a bidirectional model (both directions share them; a second
    /// layer then reads twice the output's features, so its input size may differ).
    pub fn bidirectional(mut self, bidirectional: bool) -> Self {
        self.config.bidirectional = bidirectional;
        self
    }

    /// Compiles the cell: the object, its manifest and the bindings, in
    /// memory (no cargo involved).
    pub fn generate(&self) -> Result<Generated, Error> {
        let file = self.path.display().to_string();
        let source =
            std::fs::read_to_string(&self.path).map_err(|e| Error(format!("cannot read {file}: {e}")))?;
        let checked = cellc::compile(&file, &source);
        let warnings = checked.render(false);
        let module = checked.into_result().map_err(|e| Error(e.rendered))?;
        let cell = match &self.cell {
            Some(n) => module
                .cells
                .into_iter()
                .find(|c| &c.name == n)
                .ok_or_else(|| Error(format!("{file} defines no cell named `{n}`")))?,
            None => {
                module.cells.into_iter().next().ok_or_else(|| Error(format!("{file} defines no cell")))?
            }
        };
        let cell_name = cell.name.clone();
        let compiled = CompiledCell::from_cell(cell).map_err(|e| Error(e.to_string()))?;
        let built = compile_model(&compiled, &self.config, &self.sizes, false)
            .map_err(|e| Error(format!("{file}: {e}")))?;
        let name = self.name.clone().unwrap_or_else(|| cell_name.clone());
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(Error(format!("module name `{name}`: use letters, digits and `_`")));
        }
        let manifest =
            serde_json::to_string_pretty(&built.artifacts.manifest).map_err(|e| Error(e.to_string()))?;
        let file_name = self.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or(file);
        let rust = bindings::module(&bindings::Input {
            type_name: bindings::camel(&name),
            file_name: &file_name,
            source: &source,
            cell: &compiled,
            sizes: &self.sizes,
            free_sizes: &built.free_sizes,
            manifest: &manifest,
            symbols: built.artifacts.manifest.kernels.iter().map(|k| k.symbol.as_str()).collect(),
        });
        let warnings = if warnings.trim().is_empty() { String::new() } else { warnings };
        Ok(Generated { name, object: built.artifacts.object, manifest, rust, warnings })
    }

    /// Compiles the cell from a build script: writes `cellc_<name>.rs` (and
    /// the object and manifest) to `OUT_DIR` and has cargo link the
    /// kernels. On failure, reports to cargo and exits with status 1.
    ///
    /// Here a temporary folder stands for the `OUT_DIR` cargo would give;
    /// the generated module's model type is `Lstm`, with `LstmParams`,
    /// `LstmStates` and `LstmGradients`:
    ///
    /// ```
    /// # // What cargo gives a build script: where to write, and the machine it builds for.
    /// # let dir = std::env::temp_dir().join(format!("cellc_build_doc_{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir)?;
    /// # let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    /// # let version = String::from_utf8(std::process::Command::new(rustc).arg("-vV").output()?.stdout)?;
    /// # let host = version.lines().find_map(|l| l.strip_prefix("host: ")).ok_or("no host in rustc -vV")?;
    /// # for (key, value) in [("OUT_DIR", dir.to_str().ok_or("a path")?), ("TARGET", host), ("HOST", host)] {
    /// #     std::env::set_var(key, value);
    /// # }
    /// cellc_build::cell("../../cells/lstm.cell").size("H", 8).build();
    ///
    /// let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    /// for file in ["cellc_lstm.rs", "cellc_lstm.o", "cellc_lstm.json", "libcellc_lstm_kernels.a"] {
    ///     assert!(out_dir.join(file).is_file(), "{file}");
    /// }
    /// let module = std::fs::read_to_string(out_dir.join("cellc_lstm.rs"))?;
    /// assert!(module.contains("pub struct LstmParams") && module.contains("pub weight_hh: Vec<f32>"));
    /// assert!(module.contains("pub fn new(config: ::cellc_runtime::ModelConfig, input_size: usize, seed: u64"));
    /// # std::fs::remove_dir_all(&dir)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn build(self) {
        if let Err(e) = self.try_build() {
            report_error(&e);
            std::process::exit(1);
        }
    }

    /// [`CellBuild::build`], returning the error instead of reporting it.
    pub fn try_build(self) -> Result<Generated, Error> {
        println!("cargo::rerun-if-changed={}", self.path.display());
        let env = |k: &str| {
            std::env::var(k).map_err(|_| Error(format!("{k} is not set: call this from a build script")))
        };
        let (target, host) = (env("TARGET")?, env("HOST")?);
        if target != host {
            return Err(Error(format!(
                "cellc-build compiles kernels for the machine it runs on ({host}); cross-compiling to {target} is not supported"
            )));
        }
        let out = PathBuf::from(env("OUT_DIR")?);
        let generated = self.generate()?;
        for line in generated.warnings.lines().filter(|l| !l.trim().is_empty()) {
            println!("cargo::warning={line}");
        }
        let stem = format!("cellc_{}", generated.name);
        let write = |ext: &str, bytes: &[u8]| {
            let path = out.join(format!("{stem}.{ext}"));
            cellc_runtime::write_atomically(&path, bytes)
                .map_err(|e| Error(format!("cannot write {e}")))
                .map(|_| path)
        };
        let object = write("o", &generated.object)?;
        write("json", generated.manifest.as_bytes())?;
        write("rs", generated.rust.as_bytes())?;
        cc::Build::new()
            .object(&object)
            .cargo_warnings(false)
            .try_compile(&format!("{stem}_kernels"))
            .map_err(|e| Error(format!("archiving the kernels: {e}")))?;
        Ok(generated)
    }
}

/// Reports `e` to cargo: the headline as an error, every line of the
/// rendered diagnostics on standard error (cargo shows it when the script fails).
fn report_error(e: &Error) {
    let text = e.to_string();
    let headline = text
        .lines()
        .find(|l| l.starts_with("error"))
        .or_else(|| text.lines().find(|l| !l.trim().is_empty()))
        .unwrap_or("cellc-build failed");
    let headline = headline.strip_prefix("error: ").unwrap_or(headline);
    println!("cargo::error=cellc-build: {} (the diagnostics are below, under stderr)", headline.trim());
    eprintln!("{text}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_cell(name: &str, source: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cellc-build-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join(name);
        std::fs::write(&path, source).expect("write");
        path
    }

    const RNN: &str = "cell rnn {\n    input x[I]\n    state h[H]\n    param w[H, I], u[H, H], b[H]\n    \
                       let unused = h\n    h' = tanh(w @ x + u @ h + b)\n    output h'\n}\n";

    #[test]
    fn generates_bindings_with_a_field_per_param_and_state() {
        let g = cell(temp_cell("rnn.cell", RNN)).size("H", 4).generate().expect("generates");
        assert_eq!(g.name, "rnn");
        for needle in [
            "pub struct RnnParams",
            "pub w: Vec<f32>",
            "pub struct RnnStates",
            "pub h: Vec<f32>",
            "pub struct Rnn {",
        ] {
            assert!(g.rust.contains(needle), "no `{needle}` in\n{}", g.rust);
        }
        // I is free: the constructor takes the input size.
        assert!(g.rust.contains("input_size: usize"), "{}", g.rust);
        assert!(g.warnings.contains("unused"), "the .cell file's warning is passed on: {}", g.warnings);
        assert_eq!(&g.object[..4], b"\x7fELF");
    }

    #[test]
    fn errors_carry_the_rendered_diagnostics() {
        let broken = RNN.replace("u @ h", "u @ x");
        let e = cell(temp_cell("broken.cell", &broken)).size("H", 4).generate().expect_err("does not check");
        assert!(e.0.contains("cannot multiply") && e.0.contains("broken.cell:6"), "{e}");
        let e = cell(temp_cell("rnn2.cell", RNN)).generate().expect_err("H unbound");
        assert!(e.0.contains("size `H`"), "{e}");
        let e = cell(temp_cell("rnn3.cell", RNN)).size("Q", 1).size("H", 4).generate().expect_err("no Q");
        assert!(e.0.contains("no size variable `Q`"), "{e}");
        let e = cell("no/such.cell").generate().expect_err("no file");
        assert!(e.0.contains("cannot read no/such.cell"), "{e}");
    }

    #[test]
    fn outside_a_build_script_it_says_so() {
        if std::env::var_os("OUT_DIR").is_some() {
            return;
        }
        let e = cell(temp_cell("rnn4.cell", RNN)).size("H", 4).try_build().expect_err("no cargo");
        assert!(e.0.contains("build script"), "{e}");
    }
}
