//! The `cellc` binary: exit codes, output streams, and the `graph` formats.

use std::path::PathBuf;
use std::process::{Command, Output};

fn cellc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cellc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NO_COLOR", "1")
        .output()
        .expect("cellc runs")
}

fn temp_file(name: &str, contents: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cellc-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let p = dir.join(name);
    std::fs::write(&p, contents).expect("write temp file");
    p
}

const RNN: &str = "cell rnn {\n    input x[I]\n    state h[H]\n    param w[H, I], u[H, H], b[H] = zeros\n    h' = tanh(w @ x + u @ h + b)\n    output h'\n}\n";

#[test]
fn check_clean_file_exits_zero() {
    let p = temp_file("ok.cell", RNN.as_bytes());
    let out = cellc(&["check", p.to_str().expect("utf-8 path")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok: cell rnn"));
    assert!(out.stderr.is_empty());
}

#[test]
fn check_with_errors_exits_one_and_renders_location() {
    let p = temp_file("bad.cell", RNN.replace("u @ h", "u @ x").as_bytes());
    let out = cellc(&["check", p.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot multiply a [H, H] matrix by a [I] vector"), "{err}");
    assert!(err.contains("bad.cell:5:"), "{err}");
    assert!(!err.contains("\u{1b}["), "NO_COLOR must disable colour");
}

#[test]
fn warnings_alone_exit_zero() {
    let src = RNN.replace("output h'", "let unused = h'\n    output h'");
    let p = temp_file("warn.cell", src.as_bytes());
    let out = cellc(&["check", p.to_str().expect("utf-8 path")]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("warning: unused `let` binding `unused`"));
}

#[test]
fn missing_file_and_bad_utf8_exit_one() {
    assert_eq!(cellc(&["check", "no/such/file.cell"]).status.code(), Some(1));
    let p = temp_file("bin.cell", b"cell c { \xff }");
    let out = cellc(&["check", p.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not valid UTF-8"));
}

#[test]
fn usage_errors_exit_two() {
    assert_eq!(cellc(&[]).status.code(), Some(2));
    assert_eq!(cellc(&["check"]).status.code(), Some(2));
    assert_eq!(cellc(&["check", "-D", "H=zero", "x.cell"]).status.code(), Some(2));
}

#[test]
fn unused_size_binding_is_a_warning() {
    let p = temp_file("d.cell", RNN.as_bytes());
    let out = cellc(&["check", "-D", "H=4", "-D", "I=3", "-D", "P=9", p.to_str().expect("utf-8 path")]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no cell uses a size variable `P`"));
}

#[test]
fn graph_prints_text_and_dot() {
    let p = temp_file("g.cell", RNN.as_bytes());
    let path = p.to_str().expect("utf-8 path");
    let text = cellc(&["graph", path]);
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.starts_with("cell rnn (sizes I, H)"), "{text}");
    assert!(text.contains("= matvec v"), "{text}");
    assert!(text.contains("next   h' = v"), "{text}");

    let dot = cellc(&["graph", "--dot", path]);
    assert!(dot.status.success());
    let dot = String::from_utf8_lossy(&dot.stdout);
    assert!(dot.starts_with("digraph \"rnn\" {") && dot.trim_end().ends_with('}'), "{dot}");
    assert_eq!(dot.matches('{').count(), dot.matches('}').count());

    assert_eq!(cellc(&["graph", "--cell", "nope", path]).status.code(), Some(1));
}

#[test]
fn gradcheck_passes_and_reports_every_tensor() {
    let p = temp_file("gc.cell", RNN.as_bytes());
    let out = cellc(&["gradcheck", p.to_str().expect("utf-8 path"), "-D", "H=3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    for tensor in ["input x", "initial state h", "param w", "param u", "param b"] {
        assert!(text.contains(tensor), "{text}");
    }
    assert!(text.contains("H=3") && text.contains("passed"), "{text}");
}

#[test]
fn gradcheck_rejects_short_sequences_and_binds_unknown_sizes_with_a_warning() {
    let p = temp_file("gc2.cell", RNN.as_bytes());
    let path = p.to_str().expect("utf-8 path");
    assert_eq!(cellc(&["gradcheck", path, "--steps", "3"]).status.code(), Some(2));
    let out = cellc(&["gradcheck", path, "-D", "Q=5"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no cell uses a size variable `Q`"));
}

#[test]
fn graph_stages_print() {
    let p = temp_file("st.cell", RNN.as_bytes());
    let path = p.to_str().expect("utf-8 path");
    let fwd = cellc(&["graph", "--stage", "forward", path]);
    assert!(fwd.status.success());
    let bwd = String::from_utf8_lossy(&cellc(&["graph", "--stage", "backward", path]).stdout).to_string();
    assert!(
        bwd.starts_with("backward rnn") && bwd.contains("seed d_output") && bwd.contains("= matvect "),
        "{bwd}"
    );
    let sched = String::from_utf8_lossy(
        &cellc(&["graph", "--stage", "schedule", path, "-D", "H=8", "-D", "I=4"]).stdout,
    )
    .to_string();
    assert!(sched.contains("before the loop") && sched.contains("after the loop"), "{sched}");
    // tanh' = 1 - h'^2 reads h' from the state history: nothing else is saved.
    assert!(sched.contains("saved f32 elements: 0"), "{sched}");
    let lstm = cellc(&["graph", "--stage", "schedule", "../../cells/lstm.cell", "-D", "H=8", "-D", "I=4"]);
    let lstm = String::from_utf8_lossy(&lstm.stdout).to_string();
    assert!(lstm.contains("saved f32 elements: [4*H] = 128 bytes"), "{lstm}");
}
