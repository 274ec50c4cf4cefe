//! Stages compiled into the running process (Cranelift's JIT module).

use super::{define_stage, isa, CodegenError};
use crate::backend::cpu::native::{KernelFn, NativeStage};
use cellc::ir::{Graph, ValueId};
use cellc::kernel::KernelPlan;
use cellc::shapes::Shapes;
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{default_libcall_names, Linkage, Module};

/// The machine code of one stage, kept alive by its [`NativeStage`], and
/// freed with it.
struct JitCode(Option<JITModule>);

impl Drop for JitCode {
    fn drop(&mut self) {
        if let Some(module) = self.0.take() {
            // SAFETY: the stage that called this code is being dropped with
            // it: no pointer into the module is used again.
            unsafe { module.free_memory() };
        }
    }
}

// SAFETY: the module is only kept alive, never touched after finalisation;
// the function in it is reentrant (all state is in its arguments and scratch).
unsafe impl Send for JitCode {}
unsafe impl Sync for JitCode {}

/// Compiles the kernel `plan` (a stage at `shapes`, reading `inputs` and
/// writing `outputs` through the row pointer table).
pub fn compile_stage(
    shapes: &Shapes,
    plan: &KernelPlan,
    inputs: &[ValueId],
    outputs: &[ValueId],
) -> Result<NativeStage, CodegenError> {
    let mut module = JITModule::new(JITBuilder::with_isa(isa()?, default_libcall_names()));
    let mut ctx = module.make_context();
    let scratch = define_stage(&mut ctx.func, module.target_config(), shapes, plan)?;
    let id = module
        .declare_function("stage", Linkage::Export, &ctx.func.signature)
        .map_err(|e| CodegenError(e.to_string()))?;
    module.define_function(id, &mut ctx).map_err(|e| CodegenError(format!("{e:?}")))?;
    module.clear_context(&mut ctx);
    module.finalize_definitions().map_err(|e| CodegenError(e.to_string()))?;
    let code = module.get_finalized_function(id);
    // SAFETY: the function was built with exactly this signature (three
    // pointer-sized arguments, no result).
    let func: KernelFn = unsafe { std::mem::transmute::<*const u8, KernelFn>(code) };
    // SAFETY: the function computes this stage with `scratch` floats of
    // scratch (define_stage), and its module lives as long as the stage.
    Ok(unsafe { NativeStage::new(func, inputs, outputs, scratch, Some(Box::new(JitCode(Some(module))))) })
}

/// Compiles `values` of `graph` as one pointwise stage reading `inputs`
/// and writing `outputs`: a stage outside any program (tests, benches).
pub fn compile_values(
    graph: &Graph,
    shapes: &Shapes,
    values: &[ValueId],
    inputs: &[ValueId],
    outputs: &[ValueId],
) -> Result<NativeStage, CodegenError> {
    let plan = KernelPlan::of_values(graph, shapes, values, inputs, outputs)
        .map_err(|e| CodegenError(e.to_string()))?;
    compile_stage(shapes, &plan, inputs, outputs)
}
