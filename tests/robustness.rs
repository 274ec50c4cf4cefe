//! Whatever the input, the compiler answers with diagnostics, never a
//! panic or a stack overflow: random token soup, random mutations of the
//! shipped cells, and the classic hostile files (deep nesting, a 400 KB
//! line, invalid UTF-8, an empty file). Mutants that still compile are
//! also bound to sizes and run on the interpreter, which must not panic
//! either.

mod support;

use proptest::prelude::*;
use std::sync::OnceLock;

const TOKENS: &[&str] = &[
    "cell",
    "fn",
    "const",
    "let",
    "input",
    "state",
    "param",
    "output",
    "x",
    "h",
    "c",
    "W",
    "H",
    "I",
    "4",
    "0.5",
    "1e-5",
    "'",
    "{",
    "}",
    "(",
    ")",
    "[",
    "]",
    ",",
    "=",
    "+",
    "-",
    "*",
    "/",
    "@",
    ";",
    "\n",
    "sigmoid",
    "tanh",
    "chunk",
    "concat",
    "sum",
    "mean",
    "layernorm",
    "zeros",
    "uniform",
    "relu",
    "min",
    "$",
    ".",
    "1.",
    "é",
];

fn shipped_sources() -> &'static Vec<(String, String)> {
    static SOURCES: OnceLock<Vec<(String, String)>> = OnceLock::new();
    SOURCES.get_or_init(|| {
        support::shipped_cells()
            .into_iter()
            .map(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("cell").to_string();
                (name, std::fs::read_to_string(&p).expect("readable"))
            })
            .collect()
    })
}

/// Compiles, then runs every resulting cell for two steps at small sizes.
fn compile_and_maybe_run(bytes: &[u8]) {
    let c = cellc::compile_bytes("fuzz.cell", bytes);
    let _ = c.render(false);
    let Some(module) = c.module else { return };
    for cell in &module.cells {
        let sizes = cell.sizes.iter().map(|s| (s.clone(), 3usize)).collect();
        let Ok(bound) = cell.bind(&sizes) else { continue };
        let params: Vec<Vec<f32>> = bound.param_shapes().iter().map(|&(r, c)| vec![0.1; r * c]).collect();
        let h0: Vec<Vec<f32>> = bound.state_sizes().iter().map(|&n| vec![0.2; n]).collect();
        let xs = vec![0.3f32; 2 * bound.input_size()];
        let _ = bound.run(&xs, &h0, &params);
        let _ = cellc::ir::print::to_dot(cell);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn token_soup_never_panics(tokens in prop::collection::vec(prop::sample::select(TOKENS), 0..200)) {
        compile_and_maybe_run(tokens.join(" ").as_bytes());
    }

    #[test]
    fn mutated_cells_never_panic(
        file in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), 0usize..12, 0u8..5, prop::sample::select(TOKENS)), 1..6),
    ) {
        let sources = shipped_sources();
        let (_, src) = &sources[file.index(sources.len())];
        let mut bytes = src.as_bytes().to_vec();
        for (at, len, kind, token) in edits {
            let i = at.index(bytes.len() + 1);
            let j = (i + len).min(bytes.len());
            match kind {
                0 => { bytes.drain(i..j); }                                          // delete a range
                1 => { bytes.splice(i..i, token.bytes()); }                          // insert a token
                2 => { let dup = bytes[i..j].to_vec(); bytes.splice(i..i, dup); }    // duplicate a range
                3 => { bytes.splice(i..j, token.bytes()); }                          // replace a range
                _ => { if i < bytes.len() { bytes[i] = bytes[i].wrapping_add(1); } } // flip a byte
            }
        }
        compile_and_maybe_run(&bytes);
    }
}

#[test]
fn hostile_files_get_diagnostics() {
    let deep_parens = format!(
        "cell c {{ input x[I] state h[H] h' = {}x{} output h' }}",
        "(".repeat(50_000),
        ")".repeat(50_000)
    );
    let deep_dims = format!(
        "cell c {{ input x[{}I{}] state h[H] h' = h output h' }}",
        "(".repeat(50_000),
        ")".repeat(50_000)
    );
    let long_line = format!("cell c {{ input x[I] state h[H] h' = h{} output h' }}", " + h".repeat(100_000));
    assert!(long_line.len() > 400_000);
    let long_neg = format!("cell c {{ input x[I] state h[H] h' = {}h output h' }}", "-".repeat(100_000));
    let many_errors = "let = ;\n".repeat(20_000);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("deep parentheses", deep_parens.into_bytes()),
        ("deep dimension", deep_dims.into_bytes()),
        ("400 KB line", long_line.into_bytes()),
        ("100k unary minus", long_neg.into_bytes()),
        ("invalid UTF-8", b"cell c { input x[I] \xff\xfe }".to_vec()),
        ("many errors", many_errors.into_bytes()),
        ("unclosed cell", b"cell c { input x[I]".to_vec()),
    ];
    for (what, bytes) in cases {
        let c = cellc::compile_bytes("hostile.cell", &bytes);
        assert!(c.diagnostics.has_errors(), "{what}: expected an error");
        assert!(
            c.diagnostics.error_count() <= cellc::Diagnostics::MAX_ERRORS,
            "{what}: too many errors listed"
        );
        assert!(!c.render(false).is_empty());
    }
    // An empty file, or one with only a comment, is valid: it defines nothing.
    for text in [&b""[..], b"// nothing here", b"\n\n   \t"] {
        let c = cellc::compile_bytes("empty.cell", text);
        assert!(c.diagnostics.is_empty() && c.module.is_some_and(|m| m.cells.is_empty()));
    }
}

#[test]
fn exponential_inlining_is_an_error() {
    let mut src = String::from("fn f0(x) { x + x }\n");
    for i in 1..40 {
        src.push_str(&format!("fn f{i}(x) {{ f{}(x) * f{}(x) }}\n", i - 1, i - 1));
    }
    src.push_str("cell c { input x[H] state h[H] h' = f39(x) + h output h' }");
    let c = cellc::compile("blowup.cell", &src);
    assert!(c.diagnostics.iter().any(|d| d.message.contains("too large")), "{}", c.render(false));
}

#[test]
fn recursion_is_an_error() {
    let src = "fn f(x) { g(x) }\nfn g(x) { f(x) }\ncell c { input x[H] state h[H] h' = f(x) + h output h' }";
    let c = cellc::compile("rec.cell", src);
    assert!(c.diagnostics.iter().any(|d| d.message.contains("calls itself")), "{}", c.render(false));
}

/// A long flat chain (`h + h + ...`) is as deep a tree as it is long, but
/// only nesting counts toward the parser's depth limit: 2,000 terms compile
/// and run (the passes grow their stack as they need, here on a thread
/// with a small one), and the length limit is a diagnostic of its own.
#[test]
fn long_flat_chains_compile_and_only_nesting_is_limited() {
    let chain = |terms: usize, op: &str| {
        format!(
            "cell c {{ input x[H] state h[H] h' = tanh(h{} + x) output h' }}",
            format!(" {op} h").repeat(terms - 1)
        )
    };
    let compiled = std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(move || {
            for op in ["+", "-", "*"] {
                let c = cellc::compile("chain.cell", &chain(2_000, op));
                assert!(!c.diagnostics.has_errors(), "{op}: {}", c.render(false));
            }
            let c = cellc::compile(
                "chain.cell",
                &chain(cellc::syntax::parser::MAX_TREE_DEPTH as usize - 10, "+"),
            );
            assert!(!c.diagnostics.has_errors(), "{}", c.render(false));
            let c =
                cellc::compile("chain.cell", &chain(cellc::syntax::parser::MAX_TREE_DEPTH as usize + 2, "+"));
            assert!(c.diagnostics.iter().any(|d| d.message.contains("too long")), "{}", c.render(false));
        })
        .expect("thread");
    compiled.join().expect("no stack overflow");
    // And it runs: the interpreter's value is the chain's.
    compile_and_maybe_run(chain(2_000, "+").as_bytes());
}
