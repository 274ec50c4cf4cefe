//! `cellc compile`: a cell's kernels for a target, written out.
//!
//! `--target cuda` writes the generated CUDA C++ (`--emit cu`), or compiles
//! it with NVRTC (`--emit ptx|cubin`, for `--arch`). Every size the cell
//! uses must be bound with `-D`: the kernels are specialised to them.
//!
//! `--target cpu` compiles the kernels the CPU back end's JIT would build,
//! ahead of time: an object file (`--emit obj`, with its manifest beside
//! it as `.json`), their Cranelift IR (`--emit clif`) or their disassembly
//! (`--emit asm`). Sizes no kernel depends on may stay unbound.

use crate::{bind_all, compile_file, select_cells};
use cellc::dims::Bindings;
use cellc_runtime::backend::cuda::nvrtc;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// CUDA C++ compiled with NVRTC.
    Cuda,
    /// The CPU back end's kernels, compiled ahead of time with Cranelift.
    Cpu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Emit {
    /// The generated source.
    Cu,
    /// PTX from NVRTC.
    Ptx,
    /// SASS for `--arch` from NVRTC (binary: needs `-o`).
    Cubin,
    /// CPU: an object file (needs `-o`; the manifest goes beside it as `.json`).
    Obj,
    /// CPU: the kernels' Cranelift IR.
    Clif,
    /// CPU: the kernels' machine code after register allocation (Cranelift's listing).
    Asm,
}

#[derive(Debug, clap::Args)]
pub struct CompileArgs {
    pub file: PathBuf,
    /// Only this cell (default: every cell in the file).
    #[arg(long)]
    pub cell: Option<String>,
    #[arg(long, value_enum)]
    pub target: Target,
    #[arg(long, value_enum, default_value_t = Emit::Cu)]
    pub emit: Emit,
    /// GPU architecture for ptx/cubin, e.g. sm_80, sm_90.
    #[arg(long, default_value = "sm_80")]
    pub arch: String,
    /// Bind a size variable, e.g. -D H=256 (every size the cell uses).
    #[arg(short = 'D', value_name = "NAME=VALUE", value_parser = crate::parse_binding)]
    pub define: Vec<(String, usize)>,
    /// CPU: layers of the model the kernels are for (layers after the first may need other sizes).
    #[arg(long, default_value_t = 1)]
    pub layers: usize,
    /// CPU: the model is bidirectional.
    #[arg(long)]
    pub bidirectional: bool,
    /// Write here instead of standard output.
    #[arg(short = 'o', long = "output")]
    pub out: Option<PathBuf>,
}

pub fn compile(args: &CompileArgs, color: bool) -> bool {
    if let Some(out) = &args.out {
        if let Err(message) = crate::refuse_overwriting_inputs(out, &[&args.file]) {
            eprintln!("error: -o: {message}");
            return false;
        }
    }
    let cpu_emit = matches!(args.emit, Emit::Obj | Emit::Clif | Emit::Asm);
    if (args.target == Target::Cpu) != cpu_emit {
        let wanted = if args.target == Target::Cpu { "obj, clif or asm" } else { "cu, ptx or cubin" };
        eprintln!("error: --target {:?} emits {wanted}", args.target);
        return false;
    }
    if args.target == Target::Cpu {
        return compile_cpu(args, color);
    }
    if args.emit == Emit::Cubin && args.out.is_none() {
        eprintln!("error: --emit cubin writes a binary: give a file with -o");
        return false;
    }
    let Some(c) = compile_file(&args.file, color) else { return false };
    let file = args.file.display().to_string();
    if !bind_all(&c, &args.define, &file) {
        return false;
    }
    let Some(module) = &c.module else { return false };
    let Some(cells) = select_cells(module, args.cell.as_deref(), &file) else { return false };
    let sizes: Bindings = args.define.iter().cloned().collect();
    let mut kernels = Vec::new();
    for cell in cells {
        let Some(steps) = crate::steps_or_report(cell) else { return false };
        let program = match steps.program(&sizes) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("error: {file}: cell `{}`: {e}", cell.name);
                return false;
            }
        };
        match cellc::cuda::emit_cell(&steps.forward, &steps.backward, &program, Some(&c.sources)) {
            Ok(k) => kernels.extend(k),
            Err(e) => {
                eprintln!("error: {file}: cell `{}`: {e}", cell.name);
                return false;
            }
        }
    }
    let source = cellc::cuda::translation_unit(&kernels);
    let bytes: Vec<u8> = match args.emit {
        Emit::Cu | Emit::Obj | Emit::Clif | Emit::Asm => source.into_bytes(),
        Emit::Ptx | Emit::Cubin => {
            let mut options: Vec<String> = cellc::cuda::NVRTC_OPTIONS.iter().map(|o| o.to_string()).collect();
            options.push(format!("--gpu-architecture={}", args.arch));
            match nvrtc::compile(&source, &format!("{file}.cu"), &options) {
                Ok(out) if args.emit == Emit::Ptx => out.ptx.into_bytes(),
                Ok(out) if out.cubin.is_empty() => {
                    eprintln!(
                        "error: no SASS for `{}`: --emit cubin needs a real architecture (sm_XX)",
                        args.arch
                    );
                    return false;
                }
                Ok(out) => out.cubin,
                Err(e) => {
                    eprintln!("error: {e}");
                    return false;
                }
            }
        }
    };
    write_out(args.out.as_deref(), &bytes)
}

/// Writes `bytes` to `out` (atomically: a crash leaves the old file), or to standard output.
fn write_out(out: Option<&std::path::Path>, bytes: &[u8]) -> bool {
    match out {
        Some(path) => {
            if let Err(e) = cellc_runtime::write_atomically(path, bytes) {
                eprintln!("error: cannot write {e}");
                return false;
            }
            true
        }
        None => {
            use std::io::Write;
            std::io::stdout().write_all(bytes).is_ok()
        }
    }
}

/// `--target cpu`: one cell's kernels for a model of `--layers` (and `--bidirectional`).
fn compile_cpu(args: &CompileArgs, color: bool) -> bool {
    match (args.emit, &args.out) {
        (Emit::Obj, None) => {
            eprintln!("error: --emit obj writes an object file: give its path with -o");
            return false;
        }
        (Emit::Obj, Some(out)) if out.extension().is_some_and(|e| e == "json") => {
            eprintln!(
                "error: -o {}: the manifest is written beside the object as `.json`, so the object cannot be a `.json` file (name it e.g. `{}`)",
                out.display(),
                out.with_extension("o").display()
            );
            return false;
        }
        _ => {}
    }
    let Some(c) = compile_file(&args.file, color) else { return false };
    let file = args.file.display().to_string();
    let Some(module) = &c.module else { return false };
    let Some(cells) = select_cells(module, args.cell.as_deref(), &file) else { return false };
    let [cell] = cells[..] else {
        eprintln!(
            "error: {file} defines {} cells: choose one with --cell (one object per cell)",
            cells.len()
        );
        return false;
    };
    let compiled = match cellc_runtime::CompiledCell::from_cell((*cell).clone()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return false;
        }
    };
    let config = cellc_runtime::ModelConfig { layers: args.layers, bidirectional: args.bidirectional };
    crate::warn_unused_defines(&args.define, &[cell], &file);
    let sizes: Bindings = args.define.iter().filter(|(name, _)| cell.sizes.contains(name)).cloned().collect();
    let text = args.emit != Emit::Obj;
    let built =
        match cellc_runtime::backend::cpu::codegen::object::compile_model(&compiled, &config, &sizes, text) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("error: {file}: {e}");
                return false;
            }
        };
    let a = &built.artifacts;
    match (args.emit, args.out.as_deref()) {
        (Emit::Obj, Some(out)) => {
            let manifest_path = out.with_extension("json");
            let manifest = match serde_json::to_string_pretty(&a.manifest) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("error: the manifest: {e}");
                    return false;
                }
            };
            if !write_out(Some(out), &a.object) || !write_out(Some(&manifest_path), manifest.as_bytes()) {
                return false;
            }
            let free = if built.free_sizes.is_empty() {
                String::new()
            } else {
                format!("; free at run time: {}", built.free_sizes.join(", "))
            };
            eprintln!(
                "wrote {} ({} kernels, {} bytes) and {}{free}",
                out.display(),
                a.manifest.kernels.len(),
                a.object.len(),
                manifest_path.display()
            );
            true
        }
        (Emit::Clif, out) => write_out(out, a.clif.as_bytes()),
        (_, out) => write_out(out, a.asm.as_bytes()),
    }
}
