//! The reference interpreter against PyTorch: one step and a short
//! sequence of `cells/lstm.cell`, `gru.cell`, `rnn_tanh.cell`,
//! `rnn_relu.cell` and `lstmp.cell` must equal `nn.LSTMCell` / `nn.GRUCell`
//! / `nn.RNNCell` / `nn.LSTM(proj_size=..)` on the fixtures that
//! `tests/fixtures/gen_pytorch.py` wrote (float64, so f64 agreement is to
//! ~1e-12; the f32 interpreter agrees to ~1e-6).

mod support;

use serde_json::Value;
use std::collections::BTreeMap;

struct Fixture {
    json: Value,
}

impl Fixture {
    fn load(name: &str) -> Fixture {
        let path = support::root().join("tests/fixtures/pytorch").join(format!("{name}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Fixture { json: serde_json::from_str(&text).expect("fixture is JSON") }
    }

    fn tensor(v: &Value) -> Vec<f64> {
        v["data"].as_array().expect("tensor data").iter().map(|x| x.as_f64().expect("number")).collect()
    }

    fn get(&self, path: &[&str]) -> Vec<f64> {
        let mut v = &self.json;
        for p in path {
            v = &v[*p];
        }
        assert!(!v.is_null(), "fixture has no {path:?}");
        Fixture::tensor(v)
    }

    fn sizes(&self) -> cellc::dims::Bindings {
        self.json["sizes"]
            .as_object()
            .expect("sizes")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().expect("size") as usize))
            .collect()
    }
}

fn max_rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f64::max)
}

/// Runs the fixture's cell on the interpreter in f64 and in f32 and
/// compares outputs, per-step states and final states.
fn check(fixture_name: &str) {
    let fx = Fixture::load(fixture_name);
    let cell_name = fx.json["cell"].as_str().expect("cell name");
    let path = support::root().join("cells").join(format!("{cell_name}.cell"));
    let source = std::fs::read_to_string(&path).expect("shipped cell exists");
    let module =
        cellc::compile(&format!("{cell_name}.cell"), &source).into_result().expect("shipped cell compiles");
    let cell = module.cell(cell_name).expect("cell named like its file");
    let bound = cell.bind(&fx.sizes()).expect("fixture sizes bind");

    let params: BTreeMap<String, Vec<f64>> =
        cell.params.iter().map(|p| (p.name.clone(), fx.get(&["params", &p.name]))).collect();
    let params = bound.params_from_map(params).expect("fixture has every parameter, with the right shape");
    let h0: Vec<Vec<f64>> = cell.states.iter().map(|s| fx.get(&["initial_states", &s.name])).collect();
    let xs = fx.get(&["input"]);

    let run = bound.run(&xs, &h0, &params).expect("runs");
    let err = max_rel_err(&run.outputs, &fx.get(&["outputs"]));
    assert!(err < 1e-12, "{fixture_name}: f64 outputs differ from PyTorch by {err:e}");
    for (i, s) in cell.states.iter().enumerate() {
        let ours: Vec<f64> = run.states.iter().flat_map(|step| step[i].iter().copied()).collect();
        let err = max_rel_err(&ours, &fx.get(&["step_states", &s.name]));
        assert!(err < 1e-12, "{fixture_name}: f64 state `{}` per step differs by {err:e}", s.name);
        let err = max_rel_err(&run.final_states[i], &fx.get(&["final_states", &s.name]));
        assert!(err < 1e-12, "{fixture_name}: f64 final `{}` differs by {err:e}", s.name);
    }

    // The same in f32: what a kernel is expected to reach.
    let to32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let params32: Vec<Vec<f32>> = params.iter().map(|p| to32(p)).collect();
    let h032: Vec<Vec<f32>> = h0.iter().map(|s| to32(s)).collect();
    let run32 = bound.run(&to32(&xs), &h032, &params32).expect("runs in f32");
    let out32: Vec<f64> = run32.outputs.iter().map(|&x| x as f64).collect();
    let err = max_rel_err(&out32, &fx.get(&["outputs"]));
    assert!(err < 2e-6, "{fixture_name}: f32 outputs differ from PyTorch by {err:e}");
}

/// Gradients through the derived backward step (BPTT on the interpreter)
/// against PyTorch autograd, for `L = Σ outputs·grad_output + Σ final·grad_final`.
fn check_gradients(fixture_name: &str) {
    let fx = Fixture::load(fixture_name);
    let cell_name = fx.json["cell"].as_str().expect("cell name");
    let path = support::root().join("cells").join(format!("{cell_name}.cell"));
    let module = support::compile_shipped(&path);
    let cell = module.cell(cell_name).expect("cell named like its file");
    let bound = cell.bind(&fx.sizes()).expect("fixture sizes bind");
    let grad = cellc::autodiff::backward_step(cell).expect("backward step verifies");

    let params: BTreeMap<String, Vec<f64>> =
        cell.params.iter().map(|p| (p.name.clone(), fx.get(&["params", &p.name]))).collect();
    let params = bound.params_from_map(params).expect("parameters");
    let h0: Vec<Vec<f64>> = cell.states.iter().map(|s| fx.get(&["initial_states", &s.name])).collect();
    let g_final: Vec<Vec<f64>> =
        cell.states.iter().map(|s| fx.get(&["grad_final_states", &s.name])).collect();
    let grads = bound
        .backward(&grad, &fx.get(&["input"]), &h0, &params, &fx.get(&["grad_output"]), &g_final)
        .expect("backward runs");

    let mut worst = 0.0f64;
    let mut check = |what: String, ours: &[f64], theirs: Vec<f64>| {
        let err = max_rel_err(ours, &theirs);
        worst = worst.max(err);
        assert!(err < 1e-10, "{fixture_name}: gradient of {what} differs from PyTorch by {err:e}");
    };
    check("input".into(), &grads.d_inputs, fx.get(&["grads", "input"]));
    for (i, s) in cell.states.iter().enumerate() {
        check(
            format!("initial state {}", s.name),
            &grads.d_initial_states[i],
            fx.get(&["grads", "initial_states", &s.name]),
        );
    }
    for (i, p) in cell.params.iter().enumerate() {
        check(format!("param {}", p.name), &grads.d_params[i], fx.get(&["grads", "params", &p.name]));
    }
    eprintln!("{fixture_name}: worst gradient relative error vs PyTorch {worst:.1e}");
}

#[test]
fn lstm_gradients_match_autograd() {
    check_gradients("lstm_seq");
    check_gradients("lstm_step");
}

#[test]
fn gru_gradients_match_autograd() {
    check_gradients("gru_seq");
    check_gradients("gru_step");
}

#[test]
fn rnn_gradients_match_autograd() {
    check_gradients("rnn_tanh_seq");
    check_gradients("rnn_relu_seq");
    check_gradients("rnn_tanh_step");
    check_gradients("rnn_relu_step");
}

#[test]
fn lstmp_gradients_match_autograd() {
    check_gradients("lstmp_seq");
}

#[test]
fn lstm_step_matches_lstmcell() {
    check("lstm_step");
}

#[test]
fn lstm_sequence_matches_nn_lstm() {
    check("lstm_seq");
}

#[test]
fn gru_step_matches_grucell() {
    check("gru_step");
}

#[test]
fn gru_sequence_matches_nn_gru() {
    check("gru_seq");
}

#[test]
fn rnn_tanh_step_matches_rnncell() {
    check("rnn_tanh_step");
}

#[test]
fn rnn_tanh_sequence_matches_nn_rnn() {
    check("rnn_tanh_seq");
}

#[test]
fn rnn_relu_step_matches_rnncell() {
    check("rnn_relu_step");
}

#[test]
fn rnn_relu_sequence_matches_nn_rnn() {
    check("rnn_relu_seq");
}

#[test]
fn lstmp_sequence_matches_nn_lstm_with_projection() {
    check("lstmp_seq");
}
