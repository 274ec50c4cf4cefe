//! Golden files of the generated kernels (`tests/snapshots/kernels/`,
//! `CELLC_BLESS=1` rewrites them): for a handful of cells at fixed small
//! sizes, each kernel's plan (`cellc::kernel::KernelPlan`: the decisions
//! both emitters print), the CUDA C++ of every kernel and the Cranelift IR
//! the CPU back end compiles. A change to the plan or to either emitter
//! shows here as a diff to review, before any numeric test runs.

mod support;

use cellc_runtime::backend::cpu::codegen::object::compile_model;
use cellc_runtime::{CompiledCell, ModelConfig};

/// Cells that between them use every kind of stage: per-step products with
/// gates (lstm, gru), a row reduction (layernorm_lstm), whole-sequence
/// recurrences (sru, mingru) and a projection (lstmp).
const CELLS: [&str; 6] = ["lstm", "gru", "layernorm_lstm", "sru", "mingru", "lstmp"];

fn sizes(c: &CompiledCell) -> cellc::dims::Bindings {
    [("H", 4), ("I", 3), ("P", 2)]
        .into_iter()
        .filter(|(k, _)| c.forward.sizes.iter().any(|s| s == k))
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

#[test]
fn generated_kernels_match_their_golden_files() {
    let dir = support::root().join("tests/snapshots/kernels");
    let mut failures = Vec::new();
    for name in CELLS {
        let path = support::root().join(format!("cells/{name}.cell"));
        let c = CompiledCell::from_file(&path, None).expect("compiles");
        let sizes = sizes(&c);
        let program = c.program(&sizes).expect("sizes");
        let mut plans = String::new();
        for kernel in program.kernels() {
            plans.push_str(&format!("kernel {}\n", kernel.name));
            plans.push_str(&kernel.plan.to_text(c.graph(kernel.side)));
            plans.push('\n');
        }
        failures.extend(support::snapshot(&dir.join(format!("{name}.plan")), &plans));
        let kernels = cellc::cuda::emit_cell(&c.forward, &c.backward, &program, None).expect("emits");
        let cuda: String = kernels.iter().map(|k| format!("{}\n", k.source)).collect();
        failures.extend(support::snapshot(&dir.join(format!("{name}.cu")), &cuda));
        let built = compile_model(&c, &ModelConfig::default(), &sizes, true).expect("compiles for the CPU");
        failures.extend(support::snapshot(&dir.join(format!("{name}.clif")), &built.artifacts.clif));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
