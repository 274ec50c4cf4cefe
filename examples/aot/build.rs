//! Compiles `cells/lstm.cell` ahead of time: `OUT_DIR/cellc_lstm.rs` (typed
//! bindings) and the kernels, linked as a static library. H = 4 is the
//! hidden size of the PyTorch model in `tests/fixtures/runtime`; the input
//! size stays free (no kernel depends on it), so one set of kernels serves
//! both layers (3 and 8 input features).

fn main() {
    cellc_build::cell("../../cells/lstm.cell").size("H", 4).layers(2).bidirectional(true).build();
}
