//! The hostile inputs of issue 13 §5, through the `cellc` binary: each one
//! exits with a clear error (or does the right thing), never a panic, an
//! abort, a hang or a destroyed file.

mod common;

use cellc_runtime::{read_tensors, write_tensors, Tensor};
use common::{arg, cellc, temp_file, RNN};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A safetensors file of `tensors` in the temporary folder.
fn tensors_file(name: &str, tensors: &[(&str, Tensor)]) -> PathBuf {
    let path = temp_file(name, b"");
    let map: BTreeMap<String, Tensor> = tensors.iter().map(|(n, t)| (n.to_string(), t.clone())).collect();
    write_tensors(&path, &map).expect("write tensors");
    path
}

/// `rnn` weights for H=4, I=3.
fn rnn_weights() -> PathBuf {
    tensors_file(
        "bad_rnn_w.safetensors",
        &[
            ("w_l0", Tensor::f32(vec![4, 3], vec![0.1; 12])),
            ("u_l0", Tensor::f32(vec![4, 4], vec![0.1; 16])),
            ("b_l0", Tensor::f32(vec![4], vec![0.0; 4])),
        ],
    )
}

/// `cellc run` of `cell` (an `rnn`) with [`rnn_weights`] on `input`, writing `out`.
fn run_rnn(cell: &Path, input: &Path, out: &Path) -> std::process::Output {
    cellc(&["run", arg(cell), "--weights", arg(&rnn_weights()), "--input", arg(input), "--out", arg(out)])
}

#[test]
fn an_empty_batch_runs_on_every_backend() {
    let cell = temp_file("empty_rnn.cell", RNN.as_bytes());
    let weights = rnn_weights();
    let input = tensors_file(
        "empty_x.safetensors",
        &[("input", Tensor::f32(vec![0, 5, 3], vec![])), ("grad_output", Tensor::f32(vec![0, 5, 4], vec![]))],
    );
    for backend in ["cpu", "reference", "cuda-emulated"] {
        for grad in [false, true] {
            let out = temp_file(&format!("empty_out_{backend}_{grad}.safetensors"), b"");
            let mut args = vec!["run", arg(&cell), "--weights", arg(&weights), "--input", arg(&input)];
            args.extend(["--out", arg(&out), "--backend", backend]);
            if grad {
                args.push("--grad");
            }
            let result = cellc(&args);
            assert!(result.status.success(), "{backend} grad {grad}: {}", stderr(&result));
            let got = read_tensors(&out).expect("output");
            assert_eq!(got["output"].shape, vec![0, 5, 4], "{backend}");
            assert_eq!(got["final.h"].shape, vec![1, 0, 4], "{backend}");
            if grad {
                assert_eq!(got["grad.input"].shape, vec![0, 5, 3], "{backend}");
                assert_eq!(got["grad.h0.h"].shape, vec![1, 0, 4], "{backend}");
            }
        }
    }
}

#[test]
fn a_negative_length_is_reported_as_it_is() {
    let cell = temp_file("neg_rnn.cell", RNN.as_bytes());
    let input = tensors_file(
        "neg_x.safetensors",
        &[
            ("input", Tensor::f32(vec![2, 4, 3], vec![0.1; 24])),
            ("lengths", Tensor::i64(vec![2], vec![4, -3])),
        ],
    );
    let out = temp_file("neg_out.safetensors", b"");
    let result = run_rnn(&cell, &input, &out);
    assert_eq!(result.status.code(), Some(1));
    assert!(stderr(&result).contains("sequence 1 has negative length -3"), "{}", stderr(&result));
}

#[test]
fn cells_without_parameters_run_and_cells_without_input_are_refused() {
    let free = temp_file(
        "free.cell",
        b"cell free {\n input x[H]\n state h[H]\n h' = tanh(x + 0.5 * h)\n output h'\n}\n",
    );
    let none = tensors_file("free_w.safetensors", &[]);
    let input = tensors_file("free_x.safetensors", &[("input", Tensor::f32(vec![2, 3, 4], vec![0.25; 24]))]);
    let out = temp_file("free_out.safetensors", b"");
    let result =
        cellc(&["run", arg(&free), "--weights", arg(&none), "--input", arg(&input), "--out", arg(&out)]);
    assert!(result.status.success(), "{}", stderr(&result));

    let deaf =
        temp_file("deaf.cell", b"cell deaf {\n state h[H]\n param w[H]\n h' = tanh(h * w)\n output h'\n}\n");
    for args in [
        vec!["check", arg(&deaf)],
        vec!["run", arg(&deaf), "--weights", arg(&none), "--input", arg(&input), "--out", arg(&out)],
        vec!["bench", arg(&deaf), "-D", "H=4", "--batch", "2", "--steps", "3"],
    ] {
        let result = cellc(&args);
        assert_eq!(result.status.code(), Some(1), "{args:?}");
        assert!(stderr(&result).contains("cell `deaf` has no `input`"), "{args:?}: {}", stderr(&result));
    }
}

#[test]
fn huge_sizes_are_refused_up_front_with_the_bytes_they_need() {
    let lstm = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../cells/lstm.cell");
    let big = temp_file(
        "big_state.cell",
        b"cell big {\n input x[I]\n state h[H], s[H*H*H*H]\n param w[H, I]\n h' = tanh(w @ x + h)\n s' = tanh(s)\n output h'\n}\n",
    );
    let obj = temp_file("big.o", b"");
    let cases: [(Vec<&str>, &str); 4] = [
        (vec!["bench", arg(&lstm), "-D", "H=1000000000", "--batch", "2", "--steps", "3"], "16.0 EB"),
        (vec!["gradcheck", arg(&lstm), "-D", "H=100000"], "160.0 GB"),
        (vec!["compile", arg(&big), "--target", "cuda", "-D", "H=1000", "-D", "I=3"], "4.0 TB"),
        (
            vec![
                "compile",
                arg(&big),
                "--target",
                "cpu",
                "--emit",
                "obj",
                "-o",
                arg(&obj),
                "-D",
                "H=1000",
                "-D",
                "I=3",
            ],
            "4.0 TB",
        ),
    ];
    for (args, bytes) in cases {
        let result = cellc(&args);
        assert_eq!(result.status.code(), Some(1), "{args:?}: {}", stderr(&result));
        let err = stderr(&result);
        assert!(err.contains(bytes) && err.contains("elements"), "{args:?}: {err}");
        assert!(!err.contains("panicked") && !err.contains("memory allocation"), "{err}");
    }

    // A state of 10^9 floats fits one tensor, but 16 sequences of it need
    // at least 256 GB: refused before the states are allocated.
    let wide = temp_file(
        "wide.cell",
        b"cell wide {\n input x[I]\n state h[H], s[P]\n param w[H, I], u[H, H], b[H]\n h' = tanh(w @ x + u @ h + b)\n s' = 0.5 * s\n output h'\n}\n",
    );
    let weights = tensors_file(
        "wide_w.safetensors",
        &[
            ("w_l0", Tensor::f32(vec![4, 3], vec![0.1; 12])),
            ("u_l0", Tensor::f32(vec![4, 4], vec![0.1; 16])),
            ("b_l0", Tensor::f32(vec![4], vec![0.0; 4])),
        ],
    );
    let input = tensors_file("wide_x.safetensors", &[("input", Tensor::f32(vec![16, 2, 3], vec![0.1; 96]))]);
    let out = temp_file("wide_out.safetensors", b"");
    let args = ["run", arg(&wide), "--weights", arg(&weights), "--input", arg(&input), "--out", arg(&out)];
    let result = cellc(&[&args[..], &["-D", "P=1000000000"]].concat());
    assert_eq!(result.status.code(), Some(1), "{}", stderr(&result));
    assert!(
        stderr(&result).contains("a forward pass of cell `wide` over 16 sequences"),
        "{}",
        stderr(&result)
    );
}

#[test]
fn outputs_never_overwrite_inputs_or_each_other() {
    let cell = temp_file("own_rnn.cell", RNN.as_bytes());
    let weights = rnn_weights();
    let before = std::fs::read(&weights).expect("weights");
    let input = tensors_file("own_x.safetensors", &[("input", Tensor::f32(vec![1, 2, 3], vec![0.1; 6]))]);
    let result = cellc(&[
        "run",
        arg(&cell),
        "--weights",
        arg(&weights),
        "--input",
        arg(&input),
        "--out",
        arg(&weights),
    ]);
    assert_eq!(result.status.code(), Some(1));
    assert!(stderr(&result).contains("is also this command's input"), "{}", stderr(&result));
    assert_eq!(std::fs::read(&weights).expect("weights"), before, "the weights were overwritten");

    let source = std::fs::read(&cell).expect("cell");
    let result =
        cellc(&["compile", arg(&cell), "--target", "cuda", "-D", "H=4", "-D", "I=3", "-o", arg(&cell)]);
    assert_eq!(result.status.code(), Some(1));
    assert_eq!(std::fs::read(&cell).expect("cell"), source);

    // The object's manifest goes to `.json` beside it: an object named `.json` would be overwritten by it.
    let json = temp_file("k.json", b"keep");
    let result = cellc(&[
        "compile",
        arg(&cell),
        "--target",
        "cpu",
        "--emit",
        "obj",
        "-D",
        "H=4",
        "-D",
        "I=3",
        "-o",
        arg(&json),
    ]);
    assert_eq!(result.status.code(), Some(1));
    assert!(stderr(&result).contains("cannot be a `.json` file"), "{}", stderr(&result));
    assert_eq!(std::fs::read(&json).expect("json"), b"keep");
}

/// `ulimit -f` kills a process that writes past the limit: the file it was
/// replacing must still hold its old contents.
#[test]
#[cfg(unix)]
fn a_write_cut_short_leaves_the_old_file_whole() {
    let cell = temp_file("cut_rnn.cell", RNN.as_bytes());
    let input = tensors_file("cut_x.safetensors", &[("input", Tensor::f32(vec![4, 64, 3], vec![0.1; 768]))]);
    let out = temp_file("cut_out.safetensors", b"the previous result");
    let script = format!(
        "ulimit -f 1; exec \"$0\" run {} --weights {} --input {} --out {}",
        arg(&cell),
        arg(&rnn_weights()),
        arg(&input),
        arg(&out)
    );
    let result = std::process::Command::new("sh")
        .args(["-c", &script, env!("CARGO_BIN_EXE_cellc")])
        .output()
        .expect("sh runs");
    assert!(!result.status.success(), "a 4 KB output under a 512-byte limit cannot succeed");
    assert_eq!(std::fs::read(&out).expect("out"), b"the previous result");
}

#[test]
fn size_bindings_are_treated_alike_in_every_subcommand() {
    let cell = temp_file("d_rnn.cell", RNN.as_bytes());
    let obj = temp_file("d_rnn.o", b"");
    let runs: [Vec<&str>; 5] = [
        vec!["check", arg(&cell), "-D", "H=4"],
        vec!["gradcheck", arg(&cell), "-D", "H=3"],
        vec!["compile", arg(&cell), "--target", "cuda", "-D", "H=4", "-D", "I=3"],
        vec![
            "compile",
            arg(&cell),
            "--target",
            "cpu",
            "--emit",
            "obj",
            "-o",
            arg(&obj),
            "-D",
            "H=4",
            "-D",
            "I=3",
        ],
        vec!["bench", arg(&cell), "-D", "H=4", "--batch", "2", "--steps", "3", "--min-time", "0.01"],
    ];
    for args in &runs {
        let unknown = cellc(&[&args[..], &["-D", "Z=7"]].concat());
        assert!(unknown.status.success(), "{args:?}: {}", stderr(&unknown));
        assert!(
            stderr(&unknown)
                .contains("-D Z=7 is not used: cell `rnn` has no size variable `Z` (its sizes: I, H)"),
            "{args:?}: {}",
            stderr(&unknown)
        );
        let twice = cellc(&[&args[..], &["-D", "H=5"]].concat());
        assert_eq!(twice.status.code(), Some(1), "{args:?}");
        assert!(
            stderr(&twice).contains("-D H is given twice (H=4 and H=5)")
                || stderr(&twice).contains("(H=3 and H=5)"),
            "{args:?}: {}",
            stderr(&twice)
        );
    }
}

#[test]
fn safetensors_header_errors_name_the_tensor() {
    let cell = temp_file("st_rnn.cell", RNN.as_bytes());
    let header = br#"{"input":{"dtype":"F32","shape":[1,4,3],"data_offsets":[0,4000]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0; 48]);
    let input = temp_file("st_bad.safetensors", &bytes);
    let out = temp_file("st_out.safetensors", b"");
    let result = run_rnn(&cell, &input, &out);
    assert_eq!(result.status.code(), Some(1));
    assert!(
        stderr(&result).contains(
            "tensor `input` (F32 [1, 4, 3]) needs 48 bytes, but its data_offsets [0, 4000] hold 4000"
        ),
        "{}",
        stderr(&result)
    );
}

/// Code generation is linear in the number of values: 20,000 chained
/// `let`s once took minutes (each fused value scanned the whole stage).
#[test]
fn long_chains_of_lets_compile_for_both_targets() {
    let mut src =
        String::from("cell chain {\n input x[I]\n state h[H]\n param w[H, I]\n let a0 = tanh(w @ x + h)\n");
    for i in 1..20_000 {
        src.push_str(&format!(" let a{i} = a{} * 0.999 + 0.001\n", i - 1));
    }
    src.push_str(" h' = a19999\n output h'\n}\n");
    let cell = temp_file("chain.cell", src.as_bytes());
    for target in [&["--target", "cuda"][..], &["--target", "cpu", "--emit", "clif"]] {
        let result = cellc(&[&["compile", arg(&cell), "-D", "H=8", "-D", "I=4"][..], target].concat());
        assert!(result.status.success(), "{target:?}: {}", stderr(&result));
    }
}
