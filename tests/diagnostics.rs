//! File tests for diagnostics: every `tests/diagnostics/NAME.cell` is
//! compiled and its rendered diagnostics compared with `NAME.stderr` next
//! to it. `CELLC_BLESS=1 cargo test --test diagnostics` rewrites the
//! expected files; review the diff before committing.

mod support;

use std::fmt::Write;

#[test]
fn diagnostics_match_expected_output() {
    let dir = support::root().join("tests/diagnostics");
    let mut cases: Vec<_> = std::fs::read_dir(&dir)
        .expect("tests/diagnostics exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cell"))
        .collect();
    cases.sort();
    assert!(cases.len() >= 25, "expected at least 25 diagnostic cases, found {}", cases.len());

    let mut failures = String::new();
    for case in &cases {
        let name = case.file_name().and_then(|n| n.to_str()).expect("utf-8 file name");
        let bytes = std::fs::read(case).expect("readable case");
        let compilation = cellc::compile_bytes(name, &bytes);
        let rendered = compilation.render(false);
        if compilation.diagnostics.is_empty() {
            let _ = writeln!(failures, "{name}: produced no diagnostics; every case must show one");
            continue;
        }
        let expected_path = case.with_extension("stderr");
        if support::blessing() {
            std::fs::write(&expected_path, &rendered).expect("write expected output");
            continue;
        }
        match std::fs::read_to_string(&expected_path) {
            Ok(expected) if expected == rendered => {}
            Ok(expected) => {
                let _ = writeln!(
                    failures,
                    "{name}: diagnostics differ\n--- expected\n{expected}\n+++ actual\n{rendered}"
                );
            }
            Err(_) => {
                let _ = writeln!(failures, "{name}: no {name}.stderr (run with CELLC_BLESS=1)\n{rendered}");
            }
        }
    }
    assert!(failures.is_empty(), "{failures}");
}
