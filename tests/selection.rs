//! `where`, the comparisons, `logsigmoid` and `stop_gradient` as the
//! interpreter defines them (the oracle every back end is held to, see
//! `tests/fuzz/stabilised-exponential-gates.cell` and the fuzzer): values
//! at the edges (NaN, ties, large magnitudes) and what flows backwards.

use cellc::dims::Bindings;
use cellc::program::Steps;

/// `cell`'s single cell, compiled.
fn cell(source: &str) -> cellc::ir::Cell {
    let compiled = cellc::compile("t.cell", source);
    let rendered = compiled.render(false);
    let module = compiled.module.unwrap_or_else(|| panic!("{rendered}"));
    module.cells.into_iter().next().expect("one cell")
}

/// The output of one step of a stateless-looking cell over `x` (its state `h` zero).
fn step(cell: &cellc::ir::Cell, x: &[f64]) -> Vec<f64> {
    let sizes = Bindings::from([("H".to_string(), x.len())]);
    let bound = cell.bind(&sizes).expect("binds");
    let h = vec![0.0; x.len()];
    bound.step(x, &[h], &[]).expect("steps").output
}

#[test]
fn comparisons_are_one_or_zero_and_nan_for_nan() {
    let nan = f64::NAN;
    let x = [-1.0, 0.0, 2.0, nan];
    for (op, want) in [
        ("<", [1.0, 0.0, 0.0, nan]),
        ("<=", [1.0, 1.0, 0.0, nan]),
        (">", [0.0, 0.0, 1.0, nan]),
        (">=", [0.0, 1.0, 1.0, nan]),
        ("==", [0.0, 1.0, 0.0, nan]),
        ("!=", [1.0, 0.0, 1.0, nan]),
    ] {
        let c = cell(&format!("cell c {{ input x[H]\n state h[H]\n h' = x {op} 0 + h\n output h' }}"));
        let got = step(&c, &x);
        for (g, w) in got.iter().zip(want) {
            assert!(g == &w || g.is_nan() && w.is_nan(), "x {op} 0: {got:?}, want {want:?}");
        }
    }
}

#[test]
fn where_chooses_by_element_and_keeps_a_nan_condition() {
    let c = cell("cell c { input x[H]\n state h[H]\n h' = where(x, x + 10, h - 1)\n output h' }");
    let got = step(&c, &[2.0, 0.0, -0.0, f64::NAN, f64::INFINITY]);
    assert_eq!(&got[..3], &[12.0, -1.0, -1.0]);
    assert!(got[3].is_nan());
    assert_eq!(got[4], f64::INFINITY);
    // A NaN in the value not chosen does not show.
    let c = cell("cell c { input x[H]\n state h[H]\n h' = where(x > 0, log(x), h)\n output h' }");
    assert_eq!(step(&c, &[-1.0, std::f64::consts::E]), vec![0.0, 1.0]);
}

#[test]
fn logsigmoid_is_stable_at_every_magnitude() {
    let c = cell("cell c { input x[H]\n state h[H]\n h' = logsigmoid(x) + h\n output h' }");
    let x = [-1000.0, -30.0, -1.0, 0.0, 1.0, 30.0, 1000.0];
    let got = step(&c, &x);
    for (&x, g) in x.iter().zip(&got) {
        // log(sigmoid(x)) = -log1p(e^-x), or x - log1p(e^x) for x < 0.
        let want = if x < 0.0 { x - x.exp().ln_1p() } else { -(-x).exp().ln_1p() };
        assert!((g - want).abs() <= 1e-15 * want.abs().max(1e-300), "logsigmoid({x}) = {g}, want {want}");
    }
}

#[test]
fn no_gradient_flows_through_stop_gradient_or_a_condition() {
    // h' = stop_gradient(x) * h + where(x > h, h, 0): dx is zero, dh is not.
    let c = cell(
        "cell c { input x[H]\n state h[H]\n h' = stop_gradient(x) * h + where(x > h, h, 0)\n output h' }",
    );
    let steps = Steps::compile(&c).expect("compiles");
    let sizes = Bindings::from([("H".to_string(), 3)]);
    let bound = steps.forward.bind(&sizes).expect("binds");
    let (x, h0) = ([0.5, -2.0, 3.0], vec![vec![1.0, 1.0, 1.0]]);
    let grads =
        bound.backward(&steps.backward, &x, &h0, &[], &[1.0, 1.0, 1.0], &[vec![0.0; 3]]).expect("backward");
    assert_eq!(grads.d_inputs, vec![0.0; 3]);
    // d h'/d h = x + [x > h]: 0.5 + 0, -2 + 0, 3 + 1.
    assert_eq!(grads.d_initial_states[0], vec![0.5, -2.0, 4.0]);
}

#[test]
fn gradcheck_holds_stop_gradient_at_its_value() {
    // The stabilised exponential gating of xLSTM's sLSTM: its gradients
    // match finite differences only with m' held constant, as the backward
    // step takes it.
    let source = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/stabilised-exponential-gates.cell"),
    )
    .expect("the reproducer");
    let c = cell(&source);
    let report = cellc::gradcheck::gradcheck(&c, &Bindings::new(), &Default::default()).expect("runs");
    assert!(report.passed(), "{report:?}");
}

#[test]
fn a_tie_of_max_or_min_splits_the_gradient_evenly_as_pytorch_does() {
    for op in ["max", "min"] {
        let c = cell(&format!("cell c {{ input x[H]\n state h[H]\n h' = {op}(x, h)\n output h' }}"));
        let steps = Steps::compile(&c).expect("compiles");
        let sizes = Bindings::from([("H".to_string(), 3)]);
        let bound = steps.forward.bind(&sizes).expect("binds");
        // A tie, x above h, x below h.
        let (x, h0) = ([1.0, 2.0, -2.0], vec![vec![1.0, 0.0, 0.0]]);
        let grads =
            bound.backward(&steps.backward, &x, &h0, &[], &[1.0; 3], &[vec![0.0; 3]]).expect("backward");
        let x_chosen = if op == "max" { [0.5, 1.0, 0.0] } else { [0.5, 0.0, 1.0] };
        assert_eq!(grads.d_inputs, x_chosen, "{op}");
        let h_chosen: Vec<f64> = x_chosen.iter().map(|d| 1.0 - d).collect();
        assert_eq!(grads.d_initial_states[0], h_chosen, "{op}");
    }
}

#[test]
fn gradcheck_leaves_a_kink_unchecked_and_still_checks_the_rest() {
    // `min(stop_gradient(h), h)` ties at every point: finite differences
    // have no derivative to compare with there (perturbing h up stops at the
    // tie, down goes on through every later step), so those elements are
    // counted as kinks and not checked; the input's own term is still checked.
    let c = cell("cell c { input x[H]\n state h[H]\n h' = min(stop_gradient(h), h) + x * x\n output h' }");
    let report = cellc::gradcheck::gradcheck(&c, &Bindings::new(), &Default::default()).expect("runs");
    assert!(report.passed(), "{report:?}");
    assert!(report.tensors.iter().any(|t| t.kinks > 0), "{report:?}");
    // A smooth cell has none.
    let c = cell("cell c { input x[H]\n state h[H]\n h' = tanh(x + h)\n output h' }");
    let report = cellc::gradcheck::gradcheck(&c, &Bindings::new(), &Default::default()).expect("runs");
    assert!(report.passed() && report.tensors.iter().all(|t| t.kinks == 0), "{report:?}");
}
