//! Embeds the shipped cells (`cells/*.cell` at the repository root), so
//! that `cellc.RNN("lstm")` finds them wherever the package is installed.

use std::fmt::Write;
use std::path::Path;

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../cells");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut cells: Vec<(String, String)> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "cell"))
                .filter_map(|p| {
                    Some((p.file_stem()?.to_str()?.to_string(), p.canonicalize().ok()?.display().to_string()))
                })
                .filter(|(name, _)| name != "prelude")
                .collect()
        })
        .unwrap_or_default();
    cells.sort();
    let mut table = String::from("&[\n");
    for (name, path) in &cells {
        let _ = writeln!(table, "    ({name:?}, include_str!({path:?})),");
    }
    table.push(']');
    let out = Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("shipped_cells.rs");
    std::fs::write(out, table).expect("write the table of shipped cells");
}
