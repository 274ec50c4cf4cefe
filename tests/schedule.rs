//! The schedule: snapshots of every shipped cell's forward and backward
//! stages (`tests/snapshots/schedule/`, `CELLC_BLESS=1` rewrites them),
//! and structural checks that do not depend on value numbering.

mod support;

use cellc::schedule::{schedule, Placement, Schedule, StageKind};

/// The steps of `cell` and their schedule with every size symbolic (the
/// schedule's structure does not depend on the sizes).
fn plan(cell: &cellc::Cell) -> (cellc::Cell, cellc::autodiff::Gradient, Schedule) {
    let steps = cellc::program::Steps::compile(cell).expect("verifies");
    let sched = schedule(&steps.forward, &steps.backward, &Default::default());
    (steps.forward, steps.backward, sched)
}

fn compile(src: &str) -> cellc::Module {
    cellc::compile("test.cell", src).into_result().expect("compiles")
}

/// `(placement, kind)` of each forward stage.
fn shape(stages: &[cellc::schedule::Stage]) -> Vec<(Placement, StageKind)> {
    stages.iter().map(|s| (s.placement, s.kind)).collect()
}

#[test]
fn schedule_snapshots() {
    let dir = support::root().join("tests/snapshots/schedule");
    let mut failures = Vec::new();
    for path in support::shipped_cells() {
        let module = support::compile_shipped(&path);
        for cell in &module.cells {
            let (forward, grad, sched) = plan(cell);
            let text = cellc::schedule::to_text(&forward, &grad, &sched, &Default::default());
            failures.extend(support::snapshot(&dir.join(format!("{}.txt", cell.name)), &text));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn lstm_is_hoisted_gemm_then_step_gemm_then_one_pointwise_kernel() {
    let module = support::compile_shipped(&support::root().join("cells/lstm.cell"));
    let (_, _, s) = plan(module.cell("lstm").expect("lstm"));
    use Placement::*;
    use StageKind::*;
    assert_eq!(
        shape(&s.forward),
        vec![(BeforeLoop, Gemm), (EachStep, Gemm), (EachStep, Pointwise { reductions: false })]
    );
    assert!(!s.elementwise_recurrence);
    // Backward: one pointwise kernel and the recurrent GEMM per step; input
    // and weight gradients as GEMMs after the loop; bias gradients as sums.
    let bwd = shape(&s.backward);
    assert_eq!(&bwd[..2], &[(EachStep, Pointwise { reductions: false }), (EachStep, Gemm)]);
    assert!(bwd[2..].iter().all(|(p, _)| *p == AfterLoop));
    assert_eq!(bwd.last(), Some(&(AfterLoop, SumOverSteps)));
    // Saved: four gate activations of H each, nothing else.
    assert_eq!(s.saved_elements.to_string(), "4*H");
}

#[test]
fn mgu_schedules_a_gemm_of_a_pointwise_intermediate() {
    // Minimal gated unit (Zhou et al. 2016): U @ (f * h) consumes a pointwise value.
    let module = compile(
        "cell mgu {
            input x[I]
            state h[H]
            param w_f[H, I], u_f[H, H], b_f[H], w[H, I], u[H, H], b[H]
            let f = sigmoid(w_f @ x + u_f @ h + b_f)
            let cand = tanh(w @ x + u @ (f * h) + b)
            h' = (1 - f) * h + f * cand
            output h'
        }",
    );
    let (_, _, s) = plan(&module.cells[0]);
    use Placement::*;
    use StageKind::*;
    let pw = Pointwise { reductions: false };
    assert_eq!(
        shape(&s.forward),
        vec![(BeforeLoop, Gemm), (EachStep, Gemm), (EachStep, pw), (EachStep, Gemm), (EachStep, pw)]
    );
}

#[test]
fn lstmp_projection_is_a_gemm_after_the_cell_update() {
    let module = support::compile_shipped(&support::root().join("cells/lstmp.cell"));
    let (_, _, s) = plan(module.cell("lstmp").expect("lstmp"));
    use Placement::*;
    use StageKind::*;
    assert_eq!(
        shape(&s.forward),
        vec![
            (BeforeLoop, Gemm),
            (EachStep, Gemm),
            (EachStep, Pointwise { reductions: false }),
            (EachStep, Gemm)
        ]
    );
}

#[test]
fn elementwise_recurrences_run_as_one_whole_sequence_kernel() {
    for name in ["sru", "indrnn", "mingru"] {
        let module = support::compile_shipped(&support::root().join(format!("cells/{name}.cell")));
        let (_, _, s) = plan(&module.cells[0]);
        assert!(s.elementwise_recurrence, "{name}");
        let step: Vec<_> = s.forward.iter().filter(|st| st.placement == Placement::EachStep).collect();
        assert_eq!(step.len(), 1, "{name}");
        assert!(matches!(step[0].kind, StageKind::WholeSequence { .. }), "{name}");
        assert!(s
            .forward
            .iter()
            .filter(|st| st.kind == StageKind::Gemm)
            .all(|st| st.placement == Placement::BeforeLoop));
        // The backward recurrence is elementwise too.
        assert!(
            s.backward
                .iter()
                .filter(|st| st.kind == StageKind::Gemm)
                .all(|st| st.placement == Placement::AfterLoop),
            "{name}"
        );
    }
}

#[test]
fn layernorm_lstm_fuses_its_row_reductions() {
    let module = support::compile_shipped(&support::root().join("cells/layernorm_lstm.cell"));
    let (_, _, s) = plan(module.cell("layernorm_lstm").expect("cell"));
    let step: Vec<_> =
        s.forward.iter().filter(|st| st.placement == Placement::EachStep).map(|st| st.kind).collect();
    assert_eq!(step, vec![StageKind::Gemm, StageKind::Pointwise { reductions: true }]);
}

#[test]
fn no_matrix_product_or_reduction_is_recomputed() {
    for path in support::shipped_cells() {
        let module = support::compile_shipped(&path);
        for cell in &module.cells {
            let (_, grad, s) = plan(cell);
            for v in &s.saved.recomputed {
                let op = &grad.graph.node(*v).op;
                assert!(
                    !matches!(
                        op,
                        cellc::ir::Op::MatVec
                            | cellc::ir::Op::MatVecT
                            | cellc::ir::Op::Outer
                            | cellc::ir::Op::Reduce(_)
                    ),
                    "{}: {v} {op:?}",
                    cell.name
                );
            }
        }
    }
}
