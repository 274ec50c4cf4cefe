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

        let steps = cellc::program::Steps::compile(cell).expect("the steps of a checked cell verify");
        let _ = steps.program(&sizes);
        let sched = steps.schedule(&sizes);
        let _ = cellc::schedule::to_text(&steps.forward, &steps.backward, &sched, &sizes);
        let grad = &steps.backward;
        let d_out = vec![1.0f32; 2 * bound.output_size()];
        let _ = bound.backward(grad, &xs, &h0, &params, &d_out, &h0);
    }
});
