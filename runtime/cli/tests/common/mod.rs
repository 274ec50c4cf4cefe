//! What the `cellc` binary's test files share: running it, and files to run it on.

#![allow(dead_code)] // each test file uses its own part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs `cellc` with `args`, without colour, from the crate's folder.
pub fn cellc(args: &[&str]) -> Output {
    cellc_in(Path::new(env!("CARGO_MANIFEST_DIR")), args)
}

/// Runs `cellc` with `args`, without colour, from `dir`.
pub fn cellc_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cellc"))
        .args(args)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .output()
        .expect("cellc runs")
}

/// A file with `contents` in this test process's own temporary folder.
pub fn temp_file(name: &str, contents: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cellc-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let p = dir.join(name);
    std::fs::write(&p, contents).expect("write temp file");
    p
}

/// A path as a `&str` argument.
pub fn arg(p: &std::path::Path) -> &str {
    p.to_str().expect("utf-8 path")
}

pub const RNN: &str = "cell rnn {\n    input x[I]\n    state h[H]\n    param w[H, I], u[H, H], b[H] = zeros\n    h' = tanh(w @ x + u @ h + b)\n    output h'\n}\n";
