//! Fuzz target: lex + parse + check (lowering and verification) of
//! arbitrary bytes; for whatever compiles, the simplification passes, the
//! derived backward step, the schedule, and a short forward and backward
//! run on the interpreter. Any panic, overflow or hang is a bug.
//!
//! Run: `cd compiler && RUSTC_BOOTSTRAP=1 cargo fuzz run check -- -max_total_time=600`
//! (`RUSTC_BOOTSTRAP` lets cargo-fuzz's nightly flags through on a stable toolchain).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let c = cellc::compile_bytes("fuzz.cell", data);
    let _ = c.render(false);
    let Some(module) = c.module else { return };
    for cell in &module.cells {
        let _ = cellc::ir::print::to_text(cell, Some(&c.sources));
        let sizes = cell.sizes.iter().map(|s| (s.clone(), 2usize)).collect();
        let Ok(bound) = cell.bind(&sizes) else { continue };
        let _ = bound.param_inits();
        let params: Vec<Vec<f32>> = bound.param_shapes().iter().map(|&(r, c)| vec![0.1; r * c]).collect();
        let h0: Vec<Vec<f32>> = bound.state_sizes().iter().map(|&n| vec![0.2; n]).collect();
        let xs = vec![0.3f32; 2 * bound.input_size()];
        let _ = bound.run(&xs, &h0, &params);

        let mut forward = cell.clone();
        cellc::passes::optimize_cell(&mut forward);
        let grad = cellc::autodiff::backward_step(&forward).expect("the backward step of a checked cell verifies");
        let sched = cellc::schedule::schedule(&forward, &grad, &sizes);
        let _ = cellc::schedule::to_text(&forward, &grad, &sched, &sizes);
        let d_out = vec![1.0f32; 2 * bound.output_size()];
        let _ = bound.backward(&grad, &xs, &h0, &params, &d_out, &h0);
    }
});
