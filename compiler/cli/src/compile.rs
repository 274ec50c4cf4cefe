//! `cellc compile`: a cell's kernels for a target, written out.
//!
//! `--target cuda` writes the generated CUDA C++ (`--emit cu`), or compiles
//! it with NVRTC (`--emit ptx|cubin`, for `--arch`). Every size the cell
//! uses must be bound with `-D`: the kernels are specialised to them.

use crate::{bind_all, compile_file, select_cells};
use cellc::dims::Bindings;
use cellc_runtime::backend::cuda::nvrtc;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// CUDA C++ compiled with NVRTC.
    Cuda,
    /// Object files of the CPU kernels (ahead-of-time; not built yet).
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
    /// Write here instead of standard output.
    #[arg(short = 'o', long = "output")]
    pub out: Option<PathBuf>,
}

pub fn compile(args: &CompileArgs, color: bool) -> bool {
    if args.target == Target::Cpu {
        eprintln!("error: --target cpu (ahead-of-time object files) is not built yet (issue 8); the CPU back end compiles its kernels at run time");
        return false;
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
        let mut forward = cell.clone();
        cellc::passes::optimize_cell(&mut forward);
        let Some(grad) = crate::backward_or_report(&forward) else { return false };
        match cellc::cuda::emit_cell(&forward, &grad, &sizes, Some(&c.sources)) {
            Ok(k) => kernels.extend(k),
            Err(e) => {
                eprintln!("error: {file}: cell `{}`: {e}", cell.name);
                return false;
            }
        }
    }
    let source = cellc::cuda::translation_unit(&kernels);
    let bytes: Vec<u8> = match args.emit {
        Emit::Cu => source.into_bytes(),
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
    match &args.out {
        Some(path) => {
            if let Err(e) = std::fs::write(path, &bytes) {
                eprintln!("error: cannot write `{}`: {e}", path.display());
                return false;
            }
            true
        }
        None => {
            use std::io::Write;
            std::io::stdout().write_all(&bytes).is_ok()
        }
    }
}
