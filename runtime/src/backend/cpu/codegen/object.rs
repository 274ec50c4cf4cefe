//! Stages written into an object file ahead of time (Cranelift's object
//! module): the same functions the JIT builds, with the same ISA settings,
//! exported under the symbols [`aot::symbol`] names, and the manifest that
//! describes them.

use super::{define_stage, isa, CodegenError};
use crate::backend::cpu::aot::{
    self, fingerprint, host_target, kernel_sizes, Manifest, ManifestKernel, ManifestSchedule,
};
use crate::cell::{CompiledCell, Layer};
use crate::error::RuntimeError;
use crate::layers::ModelConfig;
use cellc::dims::Bindings;
use cranelift_module::{default_libcall_names, Linkage, Module};
use cranelift_object::{ObjectBuilder, ObjectModule};
use std::collections::HashSet;
use std::fmt::Write;

/// What compiling a cell ahead of time produces.
#[derive(Debug)]
pub struct Artifacts {
    /// A relocatable object file for the host (ELF on Linux).
    pub object: Vec<u8>,
    /// What the object holds, written as JSON beside it.
    pub manifest: Manifest,
    /// Each kernel's Cranelift IR, before optimisation (with `text`).
    pub clif: String,
    /// Each kernel's machine code, disassembled (with `text`).
    pub asm: String,
}

/// Compiles every kernel `layers` need (each distinct one once) into one
/// object; `text` also keeps the IR and the disassembly.
pub fn compile_object(cell: &CompiledCell, layers: &[Layer], text: bool) -> Result<Artifacts, CodegenError> {
    let err = |e: &dyn std::fmt::Display| CodegenError(e.to_string());
    let builder = ObjectBuilder::new(isa()?, format!("cellc_{}", cell.forward.name), default_libcall_names())
        .map_err(|e| err(&e))?;
    let mut module = ObjectModule::new(builder);
    let mut kernels = Vec::new();
    let mut schedules: Vec<ManifestSchedule> = Vec::new();
    let mut seen = HashSet::new();
    let (mut clif, mut asm) = (String::new(), String::new());
    for layer in layers {
        let sizes = kernel_sizes(cell, layer);
        let schedule_sizes = layer.sizes.iter().map(|(k, v)| (k.clone(), *v)).collect();
        if !schedules.iter().any(|s| s.sizes == schedule_sizes) {
            let text = cellc::schedule::to_text(&cell.forward, &cell.backward, &layer.schedule, &layer.sizes);
            schedules.push(ManifestSchedule { sizes: schedule_sizes, text });
        }
        for kernel in layer.kernels() {
            let (side, index) = (kernel.side, kernel.stage);
            let stage = kernel.stage(layer);
            let name = aot::symbol(cell, side, index, &sizes);
            if !seen.insert(name.clone()) {
                continue;
            }
            let mut ctx = module.make_context();
            ctx.set_disasm(text);
            let scratch =
                define_stage(&mut ctx.func, module.target_config(), layer.shapes(side), &kernel.plan)?;
            if text {
                let _ = writeln!(clif, "; {name}\n{}", ctx.func.display());
            }
            let id =
                module.declare_function(&name, Linkage::Export, &ctx.func.signature).map_err(|e| err(&e))?;
            module.define_function(id, &mut ctx).map_err(|e| CodegenError(format!("{name}: {e:?}")))?;
            if text {
                let code = ctx.compiled_code().and_then(|c| c.vcode.clone()).unwrap_or_default();
                let _ = writeln!(asm, "{name}:\n{code}");
            }
            module.clear_context(&mut ctx);
            let ids = |vs: &[cellc::ir::ValueId]| vs.iter().map(|v| v.to_string()).collect();
            kernels.push(ManifestKernel {
                symbol: name,
                side,
                stage: index,
                sizes: sizes.clone(),
                inputs: ids(&stage.inputs),
                outputs: ids(&stage.outputs),
                scratch,
                whole_sequence: matches!(stage.kind, cellc::schedule::StageKind::WholeSequence { .. }),
            });
        }
    }
    let object = module.finish().emit().map_err(|e| err(&e))?;
    let manifest = Manifest {
        format: aot::MANIFEST_FORMAT,
        cell: cell.forward.name.clone(),
        fingerprint: fingerprint(cell),
        target: host_target(),
        abi: aot::abi(),
        kernels,
        schedules,
    };
    Ok(Artifacts { object, manifest, clif, asm })
}

/// A cell compiled ahead of time for a model shape: the artifacts, and the
/// size variables left free (bound at run time: no kernel depends on them).
#[derive(Debug)]
pub struct CompiledModel {
    /// The object file, its manifest and (with `text`) its listings.
    pub artifacts: Artifacts,
    /// The size variables not given, which no kernel depends on.
    pub free_sizes: Vec<String>,
}

/// Compiles every kernel a model of `cell` with `config` needs at `sizes`.
/// A size variable left out of `sizes` is free if no kernel's values
/// depend on it (an LSTM's input size `I`); if one does, it is an error
/// naming the variable.
pub fn compile_model(
    cell: &CompiledCell,
    config: &ModelConfig,
    sizes: &Bindings,
    text: bool,
) -> Result<CompiledModel, RuntimeError> {
    for name in sizes.keys() {
        if !cell.forward.sizes.contains(name) {
            return Err(RuntimeError::Backend {
                backend: "cpu".into(),
                message: format!("`{}` has no size variable `{name}`", cell.forward.name),
            });
        }
    }
    // A stand-in for each free size; kernels that depend on one are refused below.
    let free_sizes: Vec<String> =
        cell.forward.sizes.iter().filter(|s| !sizes.contains_key(*s)).cloned().collect();
    let mut bound = sizes.clone();
    for s in &free_sizes {
        bound.insert(s.clone(), 1);
    }
    let layers = crate::layers::build(cell, config, &bound, None, None)?;
    for layer in &layers {
        let needed = kernel_sizes(cell, layer);
        if let Some(s) = free_sizes.iter().find(|s| needed.contains_key(*s)) {
            return Err(RuntimeError::Backend {
                backend: "cpu".into(),
                message: format!(
                    "size `{s}` must be bound: `{}`'s kernels are specialised to it ({})",
                    cell.forward.name,
                    aot::first_use(cell, layer, s).unwrap_or_default()
                ),
            });
        }
    }
    let artifacts = compile_object(cell, &layers, text)
        .map_err(|e| RuntimeError::Backend { backend: "cpu".into(), message: e.to_string() })?;
    Ok(CompiledModel { artifacts, free_sizes })
}
