//! Every bad input to the runtime is a typed error naming the tensor and
//! both shapes (or both values) — never a panic.

mod support;

use cellc_runtime::backend::reference::Reference;
use cellc_runtime::{
    Align, CompiledCell, Input, Major, Model, ModelConfig, PackedSequence, RuntimeError, Weights,
};
use std::sync::Arc;

fn lstm() -> Arc<CompiledCell> {
    Arc::new(CompiledCell::from_file(&support::root().join("cells/lstm.cell"), None).expect("lstm compiles"))
}

fn model(config: ModelConfig) -> Model {
    let sizes = [("H".to_string(), 3)].into();
    Model::new(lstm(), config, &sizes, Some(2), None, 1, Box::new(Reference)).expect("model")
}

fn padded<'a>(data: &'a [f32], batch: usize, steps: usize, lengths: &'a [usize]) -> Input<'a> {
    Input::Padded { data, batch, steps, major: Major::BatchFirst, align: Align::Left, lengths }
}

#[test]
fn input_of_the_wrong_shape() {
    let m = model(ModelConfig::default());
    let x = vec![0.0f32; 2 * 3 * 5]; // 5 features, the model takes 2
    let err = m.forward(padded(&x, 2, 3, &[3, 3]), None).unwrap_err();
    assert!(
        matches!(&err, RuntimeError::Shape { tensor, expected, .. } if tensor == "input" && expected.contains("[2, 3, 2]")),
        "{err}"
    );
    assert!(
        err.to_string().contains("`input` has shape 30 elements, expected [2, 3, 2] (12 elements)"),
        "{err}"
    );
}

#[test]
fn lengths_zero_too_long_or_miscounted() {
    let m = model(ModelConfig::default());
    let x = vec![0.0f32; 2 * 3 * 2];
    let err = m.forward(padded(&x, 2, 3, &[3, 0]), None).unwrap_err();
    assert_eq!(err, RuntimeError::Length { sequence: 1, length: 0, steps: 3 });
    assert!(err.to_string().contains("sequence 1 has length 0"));
    let err = m.forward(padded(&x, 2, 3, &[4, 1]), None).unwrap_err();
    assert_eq!(err, RuntimeError::Length { sequence: 0, length: 4, steps: 3 });
    let err = m.forward(padded(&x, 2, 3, &[3]), None).unwrap_err();
    assert!(matches!(err, RuntimeError::Shape { ref tensor, .. } if tensor == "lengths"), "{err}");
}

#[test]
fn packed_batch_sizes_must_not_increase() {
    let m = model(ModelConfig::default());
    let p = PackedSequence {
        data: vec![0.0; 2 * 4],
        features: 2,
        batch_sizes: vec![1, 2, 1],
        sorted_indices: vec![0, 1],
        unsorted_indices: vec![0, 1],
    };
    let err = m.forward(Input::Packed(p.view()), None).unwrap_err();
    assert!(matches!(err, RuntimeError::BatchSizes { step: 1, .. }), "{err}");
    assert!(err.to_string().contains("batch sizes must not increase"));
    let bad_perm = PackedSequence { batch_sizes: vec![2, 1, 1], sorted_indices: vec![1, 1], ..p.clone() };
    assert!(matches!(
        m.forward(Input::Packed(bad_perm.view()), None).unwrap_err(),
        RuntimeError::Permutation { .. }
    ));
    let short = PackedSequence { data: vec![0.0; 3], batch_sizes: vec![2, 1, 1], ..p };
    assert!(
        matches!(m.forward(Input::Packed(short.view()), None).unwrap_err(), RuntimeError::Shape { ref tensor, .. } if tensor == "data")
    );
}

#[test]
fn initial_states_and_output_gradients_are_checked() {
    let m = model(ModelConfig { layers: 2, bidirectional: true });
    let x = vec![0.0f32; 2 * 3 * 2];
    let wrong_h0 = vec![vec![0.0f32; 4 * 2 * 3], vec![0.0f32; 3]];
    let err = m.forward(padded(&x, 2, 3, &[3, 2]), Some(&wrong_h0)).unwrap_err();
    assert!(matches!(&err, RuntimeError::Shape { tensor, .. } if tensor == "h0.c"), "{err}");
    assert!(err.to_string().contains("[4, 2, 3]"), "{err}");
    let (_, trace) = m.forward_train(padded(&x, 2, 3, &[3, 2]), None).expect("forward");
    let err = m.backward(&trace, &[0.0; 5], None).unwrap_err();
    assert!(matches!(&err, RuntimeError::Shape { tensor, .. } if tensor == "grad_output"), "{err}");
}

#[test]
fn missing_extra_and_misshapen_weights() {
    let m = model(ModelConfig::default());
    let full = m.weights();
    let rebuild = |w: &Weights| {
        Model::new(
            lstm(),
            ModelConfig::default(),
            &Default::default(),
            Some(2),
            Some(w),
            0,
            Box::new(Reference),
        )
    };
    assert!(rebuild(&full).is_ok());

    let mut missing = Weights::default();
    for name in full.names().filter(|n| *n != "bias_hh_l0") {
        let t = full.get(name).expect("present");
        missing.insert(name.to_string(), t.shape.clone(), t.data.clone());
    }
    assert_eq!(rebuild(&missing).unwrap_err(), RuntimeError::MissingWeight { name: "bias_hh_l0".into() });

    let mut extra = full.clone();
    extra.insert("weight_ih_l1".into(), vec![12, 3], vec![0.0; 36]);
    let err = rebuild(&extra).unwrap_err();
    assert!(
        matches!(&err, RuntimeError::UnexpectedWeight { name, expected }
            if name == "weight_ih_l1" && expected.iter().any(|n| n == "weight_ih_l0")),
        "{err:?}"
    );
    assert!(err.to_string().contains("its weights: `weight_ih_l0`"), "{err}");

    let mut wrong = full.clone();
    wrong.insert("bias_ih_l0".into(), vec![8], vec![0.0; 8]);
    let err = rebuild(&wrong).unwrap_err();
    assert!(err.to_string().contains("bias_ih_l0"), "{err}");
}

#[test]
fn a_size_bound_two_ways_names_both() {
    let m = model(ModelConfig::default());
    let w = m.weights();
    let sizes = [("H".to_string(), 5)].into();
    let err = Model::new(lstm(), ModelConfig::default(), &sizes, Some(2), Some(&w), 0, Box::new(Reference))
        .unwrap_err();
    assert!(err.to_string().contains("bias_ih_l0") || err.to_string().contains("weight_ih_l0"), "{err}");
    // The input's features against -D I.
    let sizes = [("H".to_string(), 3), ("I".to_string(), 4)].into();
    let err = Model::new(lstm(), ModelConfig::default(), &sizes, Some(2), None, 0, Box::new(Reference))
        .unwrap_err();
    assert_eq!(
        err,
        RuntimeError::SizeConflict {
            size: "I".into(),
            first: 4,
            first_from: "-D I".into(),
            second: 2,
            second_from: "the input's features".into()
        }
    );
    assert_eq!(err.to_string(), "size `I` is bound two ways: I=4 from -D I, I=2 from the input's features");
}

#[test]
fn unbound_sizes_and_impossible_layers() {
    let err = Model::new(
        lstm(),
        ModelConfig::default(),
        &Default::default(),
        Some(2),
        None,
        0,
        Box::new(Reference),
    )
    .unwrap_err();
    assert_eq!(err, RuntimeError::UnboundSize { size: "H".into() });
    let sru = Arc::new(CompiledCell::from_file(&support::root().join("cells/sru.cell"), None).expect("sru"));
    let sizes = [("H".to_string(), 3)].into();
    let err = Model::new(
        sru,
        ModelConfig { layers: 2, bidirectional: true },
        &sizes,
        Some(3),
        None,
        0,
        Box::new(Reference),
    )
    .unwrap_err();
    assert!(matches!(err, RuntimeError::Layer { layer: 1, .. }), "{err}");
    let err = Model::new(
        lstm(),
        ModelConfig { layers: 0, bidirectional: false },
        &[("H".to_string(), 3)].into(),
        Some(2),
        None,
        0,
        Box::new(Reference),
    )
    .unwrap_err();
    assert!(matches!(err, RuntimeError::Layer { layer: 0, .. }));
}

#[test]
fn a_broken_cell_is_a_compile_error_with_diagnostics() {
    let err =
        CompiledCell::from_source("bad.cell", "cell c { input x[I] state h[H] h' = x output h' }", None)
            .unwrap_err();
    let RuntimeError::Compile(e) = err else { panic!("expected a compile error") };
    assert!(e.rendered.contains("bad.cell:1:"), "{}", e.rendered);
    // Typed: the caller has each diagnostic with its span, and the sources
    // to render them its own way.
    assert_eq!(e.diagnostics.error_count(), 1, "{:?}", e.diagnostics);
    let d = e.diagnostics.iter().next().expect("a diagnostic");
    assert!(d.primary.span.end > d.primary.span.start, "{d:?}");
    assert!(e.sources.render(&e.diagnostics, true).contains("\u{1b}["), "rendered again, in colour");
    let none =
        CompiledCell::from_source("ok.cell", "cell c { input x[H] state h[H] h' = x output h' }", Some("d"));
    assert_eq!(none.unwrap_err(), RuntimeError::NoCell { file: "ok.cell".into(), name: Some("d".into()) });
}

#[test]
fn weights_round_trip_through_safetensors() {
    let m = model(ModelConfig { layers: 2, bidirectional: true });
    let dir = std::env::temp_dir().join(format!("cellc-weights-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("w.safetensors");
    m.weights().save(&path).expect("saves");
    let loaded = Weights::load(&path).expect("loads");
    assert_eq!(loaded, m.weights());
    assert_eq!(loaded.len(), 2 * 2 * 4);
    assert!(loaded.get("weight_hh_l1_reverse").is_some());
    let err = Weights::load(&dir.join("missing.safetensors")).unwrap_err();
    assert!(matches!(err, RuntimeError::Io { .. }));
    std::fs::write(dir.join("junk.safetensors"), b"not safetensors").expect("write");
    assert!(matches!(Weights::load(&dir.join("junk.safetensors")).unwrap_err(), RuntimeError::Io { .. }));
}

#[test]
fn gradients_accumulate_into_caller_buffers() {
    let m = model(ModelConfig::default());
    let x: Vec<f32> = (0..2 * 3 * 2).map(|i| (i as f32 * 0.3).cos()).collect();
    let input = padded(&x, 2, 3, &[3, 2]);
    let (out, trace) = m.forward_train(input, None).expect("forward");
    let once = m.backward(&trace, &out.data, None).expect("backward");
    let mut acc = m.zero_gradients();
    for round in ["first", "second"] {
        let g = m.backward(&trace, &out.data, None).expect(round);
        g.accumulate_into(&mut acc).expect(round);
    }
    for (a, o) in acc.d_params.iter().flatten().zip(once.d_params.iter().flatten()) {
        for (x, y) in a.iter().zip(o) {
            assert!((x - 2.0 * y).abs() <= 1e-6 * y.abs().max(1.0));
        }
    }
    let mut wrong = m.zero_gradients();
    wrong.d_params.pop();
    assert!(matches!(once.accumulate_into(&mut wrong), Err(RuntimeError::Shape { .. })));
}
