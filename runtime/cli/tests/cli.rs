//! The `cellc` binary: exit codes, output streams, and the `graph` formats.

mod common;

use common::{arg, cellc, temp_file, RNN};

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
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("-D P=9 is not used: cell `rnn` has no size variable `P` (its sizes: I, H)"),
        "{err}"
    );
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
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("-D Q=5 is not used: cell `rnn` has no size variable `Q` (its sizes: I, H)"),
        "{err}"
    );
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
    // The tape, with every size bound: h before the step, c' after it, the saved values.
    assert!(lstm.contains("\n  h before the step [8], c' after the step [8], v"), "{lstm}");
    assert!(lstm.contains("\n  48 floats (192 bytes) a row\n"), "{lstm}");
}

mod run {
    use super::{cellc, temp_file};
    use cellc_runtime::backend::reference::Reference;
    use cellc_runtime::{
        read_tensors, write_tensors, Align, CompiledCell, Input, Major, Model, ModelConfig, Tensor,
        TensorData,
    };
    use std::collections::BTreeMap;
    use std::sync::Arc;

    fn f32s(t: &Tensor) -> &[f32] {
        match &t.data {
            TensorData::F32(v) => v,
            TensorData::I64(_) => &[],
        }
    }

    #[test]
    fn run_matches_the_library_forward_and_backward() {
        let cell_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../cells/lstm.cell");
        let compiled = Arc::new(CompiledCell::from_file(&cell_path, None).expect("compiles"));
        let config = ModelConfig { layers: 2, bidirectional: true };
        let model = Model::new(
            compiled,
            config,
            &[("H".to_string(), 3)].into(),
            Some(2),
            None,
            5,
            Box::new(Reference),
        )
        .expect("model");
        let weights = temp_file("run_w.safetensors", b"");
        model.weights().save(&weights).expect("save weights");

        let (b, t, f) = (3usize, 4usize, 2usize);
        let lengths = [4usize, 1, 3];
        let x: Vec<f32> = (0..b * t * f).map(|i| (i as f32 * 0.41).sin()).collect();
        let dy: Vec<f32> = (0..b * t * 6).map(|i| (i as f32 * 0.17).cos()).collect();
        let mut tensors = BTreeMap::new();
        tensors.insert("input".to_string(), Tensor::f32(vec![b, t, f], x.clone()));
        tensors
            .insert("lengths".to_string(), Tensor::i64(vec![b], lengths.iter().map(|&l| l as i64).collect()));
        tensors.insert("grad_output".to_string(), Tensor::f32(vec![b, t, 6], dy.clone()));
        let input = temp_file("run_x.safetensors", b"");
        write_tensors(&input, &tensors).expect("write input");
        let out = temp_file("run_out.safetensors", b"");

        let s = |p: &std::path::Path| p.to_str().expect("utf-8").to_string();
        let (c, w, i, o) = (s(&cell_path), s(&weights), s(&input), s(&out));
        let args = [
            "run",
            &c,
            "--weights",
            &w,
            "--input",
            &i,
            "--out",
            &o,
            "--layers",
            "2",
            "--bidirectional",
            "--align",
            "right",
            "--grad",
            "--backend",
            "reference",
        ];
        let result = cellc(&args);
        assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
        let got = read_tensors(&out).expect("read output");

        let padded = Input::Padded {
            data: &x,
            batch: b,
            steps: t,
            major: Major::BatchFirst,
            align: Align::Right,
            lengths: &lengths,
        };
        let (want, trace) = model.forward_train(padded, None).expect("forward");
        let grads = model.backward(&trace, &dy, None).expect("backward");
        assert_eq!(f32s(&got["output"]), want.data.as_slice());
        assert_eq!(got["output"].shape, vec![b, t, 6]);
        assert_eq!(f32s(&got["final.c"]), want.final_states[1].as_slice());
        assert_eq!(got["final.h"].shape, vec![4, b, 3]);
        assert_eq!(f32s(&got["grad.input"]), grads.d_input.as_slice());
        assert_eq!(f32s(&got["grad.weight_hh_l1_reverse"]), grads.d_params[3][1].as_slice());
        assert!(got.contains_key("grad.h0.h") && got.contains_key("grad.bias_ih_l0"));
    }

    #[test]
    fn run_reports_bad_files_as_errors() {
        let cell_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../cells/gru.cell");
        let junk = temp_file("junk.safetensors", b"nope");
        let out = temp_file("junk_out.safetensors", b"");
        let s = |p: &std::path::Path| p.to_str().expect("utf-8").to_string();
        let (c, j, o) = (s(&cell_path), s(&junk), s(&out));
        let result = cellc(&["run", &c, "--weights", &j, "--input", &j, "--out", &o]);
        assert_eq!(result.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&result.stderr).contains("not a safetensors file"));
        let result = cellc(&["run", &c, "--weights", &j, "--input", &j, "--out", &o, "--backend", "cuda"]);
        assert_eq!(result.status.code(), Some(1));
    }
}

#[test]
fn run_reproduces_pytorch_on_the_right_aligned_fixture() {
    // Every back end this machine can run, the CUDA kernels on the emulated device.
    for backend in ["cpu", "reference", "cuda-emulated"] {
        run_matches_the_fixture(backend, "f32", 1e-5);
    }
}

/// `--dtype bf16`: the CPU's, the (emulated) CUDA device's and the
/// reference back end's bf16 products, within bf16's rounding of PyTorch's
/// float32 values.
#[test]
fn run_with_bf16_products_is_near_the_fixture_on_every_back_end() {
    for backend in ["cpu", "cuda-emulated", "reference"] {
        run_matches_the_fixture(backend, "bf16", 3e-2);
    }
    let out = cellc(&[
        "bench",
        "../../cells/lstm.cell",
        "-D",
        "H=8",
        "--batch",
        "2",
        "--steps",
        "3",
        "--dtype",
        "bf16",
        "--json",
        "--min-time",
        "0.01",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"dtype\": \"bf16\""));
}

/// `--dtype f16` and `--dtype tf32`: the (emulated) CUDA device's and the
/// reference back end's fp16 and TF32 products, within their rounding of
/// PyTorch's float32 values; the CPU, which has neither, refuses them,
/// naming the CUDA back end.
#[test]
fn run_with_fp16_and_tf32_products_is_near_the_fixture_on_cuda_and_the_reference() {
    for (dtype, name) in [("f16", "fp16"), ("tf32", "TF32")] {
        run_matches_the_fixture("cuda-emulated", dtype, 5e-3);
        run_matches_the_fixture("reference", dtype, 5e-3);
        let out = tiny_bench(&["--backend", "cpu", "--dtype", dtype]);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(name) && err.contains("cuda"), "{err}");
    }
}

/// `cellc bench` of a one-step LSTM (H=8, B=1, T=3) with `extra` arguments.
fn tiny_bench(extra: &[&str]) -> std::process::Output {
    let mut args = vec!["bench", "../../cells/lstm.cell", "-D", "H=8", "--batch", "1", "--steps", "3"];
    args.extend_from_slice(extra);
    cellc(&args)
}

fn run_matches_the_fixture(backend: &str, dtype: &str, tolerance: f32) {
    use cellc_runtime::{read_tensors, TensorData};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let fx = root.join("tests/fixtures/runtime");
    let out = temp_file(&format!("fixture_out_{backend}_{dtype}.safetensors"), b"");
    let s = |p: std::path::PathBuf| p.to_str().expect("utf-8").to_string();
    let (cell, w, x, o) = (
        s(root.join("cells/lstm.cell")),
        s(fx.join("lstm_weights.safetensors")),
        s(fx.join("lstm_right_input.safetensors")),
        s(out.clone()),
    );
    let args = [
        "run",
        &cell,
        "--weights",
        &w,
        "--input",
        &x,
        "--out",
        &o,
        "--layers",
        "2",
        "--bidirectional",
        "--align",
        "right",
        "--grad",
        "--backend",
        backend,
        "--dtype",
        dtype,
    ];
    let result = cellc(&args);
    assert!(result.status.success(), "{backend}: {}", String::from_utf8_lossy(&result.stderr));
    let got = read_tensors(&out).expect("output");
    let want = read_tensors(&fx.join("lstm_right_expected.safetensors")).expect("expected");
    let f32s = |d: &TensorData| match d {
        TensorData::F32(v) => v.clone(),
        TensorData::I64(_) => Vec::new(),
    };
    for (name, t) in &want {
        let g = got.get(name);
        assert!(g.is_some(), "{backend}: cellc run wrote no `{name}`");
        let Some(g) = g else { continue };
        assert_eq!(g.shape, t.shape, "{name}");
        for (a, b) in f32s(&g.data).iter().zip(f32s(&t.data)) {
            assert!((a - b).abs() <= tolerance * b.abs().max(1.0), "{backend} {dtype}: {name}: {a} vs {b}");
        }
    }
}

#[test]
fn compile_writes_cuda_source_with_every_stage_and_its_source_lines() {
    let p = temp_file("rnn_compile.cell", RNN.as_bytes());
    let path = p.to_str().expect("utf-8 path");
    let out = cellc(&["compile", path, "--target", "cuda", "-D", "H=8", "-D", "I=3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cu = String::from_utf8_lossy(&out.stdout);
    assert!(cu.contains("extern \"C\" __global__ void rnn_fwd_s"), "{cu}");
    assert!(cu.contains("extern \"C\" __global__ void rnn_bwd_s"), "{cu}");
    assert!(cu.contains("rnn_compile.cell:5:"), "no source locations:\n{cu}");
    // Written to a file with -o, the same text.
    let target = p.with_extension("cu");
    let to_file = cellc(&[
        "compile",
        path,
        "--target",
        "cuda",
        "-D",
        "H=8",
        "-D",
        "I=3",
        "-o",
        target.to_str().expect("utf-8"),
    ]);
    assert!(to_file.status.success());
    assert_eq!(std::fs::read_to_string(&target).expect("written"), cu);
}

#[test]
fn compile_writes_cpu_objects_with_a_manifest_and_their_ir() {
    let p = temp_file("rnn_compile_cpu.cell", RNN.as_bytes());
    let path = p.to_str().expect("utf-8 path");
    let object = p.with_extension("o");
    // I is free: no kernel of this cell depends on it.
    let out = cellc(&[
        "compile",
        path,
        "--target",
        "cpu",
        "--emit",
        "obj",
        "-D",
        "H=8",
        "-o",
        object.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("free at run time: I"), "{said}");
    let bytes = std::fs::read(&object).expect("the object");
    assert_eq!(&bytes[..4], b"\x7fELF", "an ELF object");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p.with_extension("json")).expect("the manifest"))
            .expect("json");
    let kernels = manifest["kernels"].as_array().expect("kernels");
    assert!(
        kernels.iter().any(|k| k["side"] == "forward") && kernels.iter().any(|k| k["side"] == "backward")
    );
    for k in kernels {
        let symbol = k["symbol"].as_str().expect("symbol");
        assert!(symbol.starts_with("cellc_rnn_") && symbol.ends_with("_H8"), "{symbol}");
        assert!(bytes.windows(symbol.len()).any(|w| w == symbol.as_bytes()), "{symbol} is in the object");
    }
    let clif = cellc(&["compile", path, "--target", "cpu", "--emit", "clif", "-D", "H=8"]);
    assert!(String::from_utf8_lossy(&clif.stdout).contains("function u0:0(i64, i64, i64)"));
    let asm = cellc(&["compile", path, "--target", "cpu", "--emit", "asm", "-D", "H=8"]);
    assert!(String::from_utf8_lossy(&asm.stdout).contains("_fwd_s"));
}

#[test]
fn compile_explains_what_it_cannot_do() {
    let p = temp_file("rnn_compile_errors.cell", RNN.as_bytes());
    let path = p.to_str().expect("utf-8 path");
    let unbound = cellc(&["compile", path, "--target", "cuda", "-D", "H=8"]);
    assert_eq!(unbound.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&unbound.stderr).contains("I"),
        "{}",
        String::from_utf8_lossy(&unbound.stderr)
    );
    let cpu_without_o = cellc(&["compile", path, "--target", "cpu", "--emit", "obj", "-D", "H=8"]);
    assert_eq!(cpu_without_o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&cpu_without_o.stderr).contains("-o"));
    let mixed = cellc(&["compile", path, "--target", "cpu", "--emit", "ptx", "-D", "H=8"]);
    assert_eq!(mixed.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&mixed.stderr).contains("obj, clif or asm"));
    let cubin = cellc(&["compile", path, "--target", "cuda", "--emit", "cubin", "-D", "H=8", "-D", "I=3"]);
    assert_eq!(cubin.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&cubin.stderr).contains("-o"));
}

#[test]
fn cuda_backend_without_a_driver_is_a_clear_error() {
    if cellc_runtime::backend::cuda::driver_available() {
        eprintln!("SKIPPED: a CUDA driver is present, the no-driver path cannot be exercised here");
        return;
    }
    let out = tiny_bench(&["--backend", "cuda"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the CUDA driver (libcuda) not found"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `cellc run` of a cell with masks: evaluation by default, training with
/// `--train` (masks from `--seed`/`--offset` at the `-R` rates), every
/// mask written with `--masks`; an unknown rate is a clear error.
#[test]
fn run_trains_with_the_cells_masks_and_writes_them() {
    use cellc_runtime::{read_tensors, write_tensors, Tensor};
    let cell = temp_file(
        "masked.cell",
        b"cell masked {\n    input x[I]\n    state h[H]\n    param w[H, I], u[H, H], b[H] = zeros\n    rate p = 0.5\n    h' = tanh(w @ dropout(x, p) + u @ h + b)\n    output h'\n}\n",
    );
    let weights = temp_file("masked_w.safetensors", b"");
    let tensors = [
        ("w_l0".to_string(), Tensor::f32(vec![4, 3], vec![0.3; 12])),
        ("u_l0".to_string(), Tensor::f32(vec![4, 4], vec![0.1; 16])),
        ("b_l0".to_string(), Tensor::f32(vec![4], vec![0.0; 4])),
    ];
    write_tensors(&weights, &tensors.into_iter().collect()).expect("weights");
    let input = temp_file("masked_x.safetensors", b"");
    let x = [("input".to_string(), Tensor::f32(vec![2, 5, 3], vec![1.0; 30]))];
    write_tensors(&input, &x.into_iter().collect()).expect("input");
    let run = |name: &str, extra: &[&str]| {
        let out = temp_file(name, b"");
        let mut args =
            vec!["run", arg(&cell), "--weights", arg(&weights), "--input", arg(&input), "--out", arg(&out)];
        args.extend(extra);
        let result = cellc(&args);
        (result, out)
    };
    let (result, out) = run("masked_eval.safetensors", &["--masks"]);
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    let eval = read_tensors(&out).expect("output");
    assert!(eval["mask.dropout#0_l0"].data == cellc_runtime::TensorData::F32(vec![1.0; 30]));
    let (result, out) =
        run("masked_train.safetensors", &["--train", "--seed", "5", "-R", "p=0.25", "--masks"]);
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    let train = read_tensors(&out).expect("output");
    let mask = &train["mask.dropout#0_l0"];
    assert_eq!(mask.shape, vec![2, 5, 3]);
    let cellc_runtime::TensorData::F32(values) = &mask.data else { panic!("f32 mask") };
    assert!(values.iter().all(|&v| v == 0.0 || v == 1.0 / 0.75), "{values:?}");
    assert!(values.contains(&0.0) && values.contains(&(1.0 / 0.75)));
    assert_ne!(train["output"].data, eval["output"].data);
    let (again, out) = run("masked_again.safetensors", &["--train", "--seed", "5", "-R", "p=0.25"]);
    assert!(again.status.success());
    assert_eq!(read_tensors(&out).expect("output")["output"].data, train["output"].data);
    let (bad, _) = run("masked_bad.safetensors", &["-R", "q=0.1"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("rate `q` is not a rate of cell `masked`"));
    // A rate given twice is refused, not the last one taken.
    let (twice, _) = run("masked_twice.safetensors", &["-R", "p=0.2", "-R", "p=0.3"]);
    assert_eq!(twice.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&twice.stderr).contains("rate `p` is given twice"));
}

#[test]
fn run_restarts_the_state_where_the_input_resets_it() {
    // A reset at step 3 of sequence 0: its steps 3..6 give what the same
    // steps give as a sequence of their own (sequence 1, from the same h0).
    use cellc_runtime::{read_tensors, write_tensors, Tensor, TensorData};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cell = root.join("cells/gru.cell");
    let (h, i, steps) = (4usize, 3usize, 6usize);
    let weights = temp_file("resets_w.safetensors", b"");
    let values = |n: usize, k: f32| (0..n).map(|j| ((j as f32 * 0.37 + k).sin()) * 0.5).collect::<Vec<f32>>();
    let tensors = [
        ("weight_ih_l0".to_string(), Tensor::f32(vec![3 * h, i], values(3 * h * i, 1.0))),
        ("weight_hh_l0".to_string(), Tensor::f32(vec![3 * h, h], values(3 * h * h, 2.0))),
        ("bias_ih_l0".to_string(), Tensor::f32(vec![3 * h], values(3 * h, 3.0))),
        ("bias_hh_l0".to_string(), Tensor::f32(vec![3 * h], values(3 * h, 4.0))),
    ];
    write_tensors(&weights, &tensors.into_iter().collect()).expect("weights");
    let seq = values(steps * i, 5.0);
    let mut x = seq.clone();
    x.extend_from_slice(&seq[3 * i..]);
    x.extend(std::iter::repeat_n(0.0, 3 * i));
    let mut resets = vec![0i64; 2 * steps];
    resets[3] = 1;
    let input = temp_file("resets_x.safetensors", b"");
    let h0 = values(2 * h, 6.0);
    let h0 = [h0[..h].to_vec(), h0[..h].to_vec()].concat();
    let batch = [
        ("input".to_string(), Tensor::f32(vec![2, steps, i], x)),
        ("lengths".to_string(), Tensor { shape: vec![2], data: TensorData::I64(vec![6, 3]) }),
        ("resets".to_string(), Tensor { shape: vec![2, steps], data: TensorData::I64(resets) }),
        ("h0.h".to_string(), Tensor::f32(vec![1, 2, h], h0)),
    ];
    write_tensors(&input, &batch.into_iter().collect()).expect("input");
    let out = temp_file("resets_out.safetensors", b"");
    let args = [
        "run",
        arg(&cell),
        "-D",
        "H=4",
        "--weights",
        arg(&weights),
        "--input",
        arg(&input),
        "--out",
        arg(&out),
    ];
    let result = cellc(&args);
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    let got = read_tensors(&out).expect("output");
    let TensorData::F32(y) = &got["output"].data else { panic!("f32 output") };
    let row = |b: usize, t: usize| &y[(b * steps + t) * h..(b * steps + t + 1) * h];
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-6);
    for t in 0..3 {
        assert!(close(row(0, 3 + t), row(1, t)), "step {}: {:?} vs {:?}", 3 + t, row(0, 3 + t), row(1, t));
    }
    let TensorData::F32(finals) = &got["final.h"].data else { panic!("f32 finals") };
    assert!(close(&finals[..h], &finals[h..]), "{finals:?}");
}

/// `cellc compile -o` and `cellc run --out` never replace what is not a
/// file: a symbolic link stays a link (its target gets the bytes, made if
/// missing), a FIFO with no reader is an error at once and stays a FIFO,
/// a device is written through (a full one is an error, exit 1) and stays
/// a device.
#[cfg(target_os = "linux")]
#[test]
fn outputs_never_replace_links_fifos_or_devices() {
    use std::os::unix::fs::{symlink, FileTypeExt};
    let dir = std::env::temp_dir().join(format!("cellc-cli-special-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let fx = root.join("tests/fixtures/runtime");
    let s = |p: &std::path::Path| p.to_str().expect("utf-8").to_string();
    let cell = temp_file("special_rnn.cell", RNN.as_bytes());
    let write_to = |out: &std::path::Path, run: bool| {
        let out = s(out);
        if run {
            let (c, w, x) = (
                s(&root.join("cells/lstm.cell")),
                s(&fx.join("lstm_weights.safetensors")),
                s(&fx.join("lstm_left_input.safetensors")),
            );
            cellc(&[
                "run",
                &c,
                "--weights",
                &w,
                "--input",
                &x,
                "--layers",
                "2",
                "--bidirectional",
                "--out",
                &out,
            ])
        } else {
            cellc(&["compile", &s(&cell), "--target", "cuda", "-D", "H=8", "-D", "I=3", "-o", &out])
        }
    };
    let kind = |p: &std::path::Path| std::fs::symlink_metadata(p).expect("exists").file_type();
    for run in [false, true] {
        let what = if run { "cellc run --out" } else { "cellc compile -o" };
        // A link to a file, and a link to nothing yet.
        let (file, link, missing, dangling) =
            (dir.join("file"), dir.join("link"), dir.join("missing"), dir.join("dangling"));
        let _ = std::fs::remove_file(&missing);
        std::fs::write(&file, b"old").expect("file");
        let _ = symlink(&file, &link);
        let _ = symlink(&missing, &dangling);
        for (l, target) in [(&link, &file), (&dangling, &missing)] {
            let out = write_to(l, run);
            assert!(out.status.success(), "{what} {l:?}: {}", String::from_utf8_lossy(&out.stderr));
            assert!(kind(l).is_symlink(), "{what} replaced the link {l:?}");
            assert!(std::fs::metadata(target).expect("target").len() > 3, "{what}: {target:?} not written");
        }
        // A FIFO no process reads: an error at once, the FIFO kept.
        let fifo = dir.join("fifo");
        if !fifo.exists() {
            assert!(std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo").success());
        }
        let out = write_to(&fifo, run);
        assert_eq!(out.status.code(), Some(1), "{what} to a FIFO without a reader");
        assert!(String::from_utf8_lossy(&out.stderr).contains("no process reads"), "{what}");
        assert!(kind(&fifo).is_fifo(), "{what} replaced the FIFO");
        // A full device: exit 1, the device kept; the null device takes the bytes.
        let out = write_to(std::path::Path::new("/dev/full"), run);
        assert_eq!(out.status.code(), Some(1), "{what} /dev/full: {}", String::from_utf8_lossy(&out.stderr));
        assert!(kind(std::path::Path::new("/dev/full")).is_char_device());
        // Device nodes of our own (root only, as CI runs): the same.
        let null = dir.join("null");
        let made = null.exists()
            || std::process::Command::new("mknod")
                .arg(&null)
                .args(["c", "1", "3"])
                .status()
                .is_ok_and(|s| s.success());
        if made {
            let out = write_to(&null, run);
            assert!(
                out.status.success(),
                "{what} to a null device: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(kind(&null).is_char_device(), "{what} replaced the device node");
        } else {
            eprintln!("skipped: mknod needs root");
        }
    }
    std::fs::remove_dir_all(&dir).expect("clean up");
}

/// Endless or random streams given as a cell, weights or input are errors
/// within a few bytes, not all the machine's memory: a cell file is read up
/// to a cap, a safetensors file up to what its header declares.
#[cfg(target_os = "linux")]
#[test]
fn endless_streams_as_cells_weights_or_inputs_are_errors_at_once() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let fx = root.join("tests/fixtures/runtime");
    let s = |p: std::path::PathBuf| p.to_str().expect("utf-8").to_string();
    let (cell, w, x) = (
        s(root.join("cells/lstm.cell")),
        s(fx.join("lstm_weights.safetensors")),
        s(fx.join("lstm_left_input.safetensors")),
    );
    let out = temp_file("endless_out.safetensors", b"");
    let out = out.to_str().expect("utf-8");
    for stream in ["/dev/zero", "/dev/urandom"] {
        let started = std::time::Instant::now();
        let check = cellc(&["check", stream]);
        assert_eq!(check.status.code(), Some(1), "check {stream}");
        assert!(String::from_utf8_lossy(&check.stderr).contains("more than"), "check {stream}");
        for args in [
            ["run", cell.as_str(), "--weights", stream, "--input", x.as_str(), "--out", out],
            ["run", cell.as_str(), "--weights", w.as_str(), "--input", stream, "--out", out],
        ] {
            let result = cellc(&args);
            assert_eq!(result.status.code(), Some(1), "{args:?}");
            let err = String::from_utf8_lossy(&result.stderr);
            assert!(err.contains(stream) && err.contains("not a safetensors file"), "{args:?}: {err}");
        }
        assert!(started.elapsed().as_secs() < 10, "{stream}: {:?}", started.elapsed());
    }
}

/// `cellc peak` measures the f32 FMA peak on one thread and on every
/// usable core (bf16 dot products too where the processor has them), and
/// `cellc bench` gives the CPU's rate as a fraction of the peak at its
/// thread count.
#[test]
fn peak_measures_the_machine_and_bench_reports_a_fraction_of_it() {
    let out = cellc(&["peak", "--json", "--min-time", "0.05", "--threads", "1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let peaks = v["peaks"].as_array().expect("peaks");
    let f32_fma = peaks.iter().find(|p| p["kind"] == "f32_fma").expect("an f32 peak on x86-64");
    assert_eq!(f32_fma["threads"], 1);
    assert!(f32_fma["gflops"].as_f64().expect("a rate") > 1.0, "{v}");
    let out = tiny_bench(&["--threads", "1", "--json", "--min-time", "0.01"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let (rate, peak) = (v["gflops"].as_f64().expect("a rate"), v["peak_gflops"].as_f64().expect("the peak"));
    assert_eq!(v["peak_threads"], 1);
    let fraction = v["peak_fraction"].as_f64().expect("a fraction");
    assert!((fraction - rate / peak).abs() < 1e-3 && fraction > 0.0 && fraction < 1.5, "{v}");
}

/// `cellc bench --profile` says where a CPU pass's time goes, phase by
/// phase, from passes of its own: a training pass has a loop and work
/// after it, and the phases add up to no more than the pass.
#[test]
fn bench_profiles_a_cpu_pass_by_phase() {
    let out = tiny_bench(&["--mode", "train", "--json", "--min-time", "0.01", "--profile"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let phases = v["profile"].as_object().expect("a profile");
    let seconds = |name: &str| phases[name].as_f64().expect("seconds");
    assert!(seconds("loop: products") + seconds("loop: whole-sequence kernel") > 0.0, "{v}");
    assert!(seconds("after the loop") > 0.0, "{v}");
    let total: f64 = phases.values().map(|s| s.as_f64().expect("seconds")).sum();
    assert!(total > 0.0 && total <= 1.5 * v["median_s"].as_f64().expect("a time"), "{v}");
    let out = tiny_bench(&["--json", "--min-time", "0.01"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert!(v.get("profile").is_none(), "profiled only when asked: {v}");
}
