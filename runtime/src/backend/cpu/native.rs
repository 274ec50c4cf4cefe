//! A pointwise stage as native code: a function with the pointer-table ABI
//! of [`StageExec`], however it came to be in the process (compiled by the
//! JIT, or linked from an object file built ahead of time).

use super::stage::StageExec;
use cellc::ir::ValueId;
use std::any::Any;

/// The ABI of every compiled stage: `rows`, the row pointer table
/// (`rows * (inputs + outputs)` pointers) and scratch for intermediates.
pub type KernelFn = unsafe extern "C" fn(usize, *const *mut f32, *mut f32);

/// The ABI as the manifest of an object file states it.
pub const KERNEL_ABI: &str = "extern \"C\" fn(rows: usize, args: *const *mut f32, scratch: *mut f32)";

/// A stage's native function, the values its table holds, and its scratch.
pub struct NativeStage {
    func: KernelFn,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
    /// Floats of scratch the function needs.
    scratch: usize,
    /// Owns the memory `func` points into (a JIT module), if anything does.
    _code: Option<Box<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for NativeStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeStage").field("inputs", &self.inputs).field("outputs", &self.outputs).finish()
    }
}

impl NativeStage {
    /// # Safety
    /// `func` must compute the stage reading `inputs` and writing `outputs`
    /// through the table, using at most `scratch` floats of scratch, and
    /// stay valid as long as `code` (or the program, without one) lives.
    pub unsafe fn new(
        func: KernelFn,
        inputs: &[ValueId],
        outputs: &[ValueId],
        scratch: usize,
        code: Option<Box<dyn Any + Send + Sync>>,
    ) -> NativeStage {
        NativeStage { func, inputs: inputs.to_vec(), outputs: outputs.to_vec(), scratch, _code: code }
    }

    /// Floats of scratch the function needs.
    pub fn scratch(&self) -> usize {
        self.scratch
    }
}

impl StageExec for NativeStage {
    fn inputs(&self) -> &[ValueId] {
        &self.inputs
    }

    fn outputs(&self) -> &[ValueId] {
        &self.outputs
    }

    unsafe fn run(&self, rows: usize, args: &[*mut f32]) {
        thread_local! {
            /// Scratch reused across calls on this thread (kernels run one at a time per thread).
            static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < self.scratch.max(1) {
                s.resize(self.scratch.max(1), 0.0);
            }
            // SAFETY: the caller's contract covers `args`; scratch has at
            // least the size the code was compiled for (`new`'s contract).
            unsafe { (self.func)(rows, args.as_ptr(), s.as_mut_ptr()) }
        })
    }
}
