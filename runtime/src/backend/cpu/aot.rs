//! Kernels compiled ahead of time: the symbol that names each one, the
//! manifest written beside the object file, and [`LinkedKernels`], the
//! table through which the CPU back end takes them from a program that
//! linked the object (no code generator at run time).
//!
//! A kernel is one pointwise or whole-sequence stage of a cell's forward or
//! backward schedule, compiled for the sizes its values have. Sizes that no
//! kernel's value depends on (an LSTM's input size `I`: only GEMMs read
//! `x`) are not part of a kernel's identity, so one object serves every
//! value of them, and every layer of a stacked model.

use super::native::{KernelFn, NativeStage, KERNEL_ABI};
pub use crate::cell::Side;
use crate::cell::{CompiledCell, Layer};
use crate::error::{Result, RuntimeError};
use cellc::ir::{Type, ValueId};
use cellc::schedule::Stage;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::OnceLock;

/// The manifest format this runtime reads and writes.
pub const MANIFEST_FORMAT: u32 = 1;

/// Each value a kernel of `layer` computes, reads or writes, with the
/// size variables its type mentions: `(side, stage, value, variables)`.
fn kernel_values(cell: &CompiledCell, layer: &Layer) -> Vec<(Side, usize, ValueId, Vec<String>)> {
    let mut out = Vec::new();
    for kernel in layer.kernels() {
        let (side, index, st) = (kernel.side, kernel.stage, kernel.stage(layer));
        let graph = cell.graph(side);
        for &v in st.values.iter().chain(&st.inputs).chain(&st.outputs) {
            let vars = match graph.ty(v) {
                Type::Vector(d) => d.variables(),
                Type::Matrix(h, r, c) => {
                    h.variables().into_iter().chain(r.variables()).chain(c.variables()).collect()
                }
                Type::Scalar => Vec::new(),
            };
            out.push((side, index, v, vars));
        }
    }
    out
}

/// The size variables some kernel of the cell depends on, with their
/// values in `layer`: those in the type of any value a kernel computes,
/// reads or writes.
pub fn kernel_sizes(cell: &CompiledCell, layer: &Layer) -> BTreeMap<String, usize> {
    kernel_values(cell, layer)
        .into_iter()
        .flat_map(|(.., vars)| vars)
        .filter_map(|var| layer.sizes.get(&var).map(|&n| (var, n)))
        .collect()
}

/// The first kernel value whose type mentions size `var`, as
/// `bwd stage 5 holds v36: [I]`.
pub fn first_use(cell: &CompiledCell, layer: &Layer, var: &str) -> Option<String> {
    kernel_values(cell, layer).into_iter().find(|(.., vars)| vars.iter().any(|x| x == var)).map(
        |(side, index, v, _)| format!("{} stage {index} holds {v}: {}", side.tag(), cell.graph(side).ty(v)),
    )
}

/// A short, stable fingerprint of the cell's IR (FNV-1a, 64 bits).
pub fn fingerprint(cell: &CompiledCell) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in cell.identity().bytes() {
        h = (h ^ byte as u64).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The symbol of a kernel: the program's kernel name (the one scheme of
/// every target, [`cellc::program::kernel_name`]) made unique across cells
/// and sizes linked into one binary:
/// `cellc_<cell>_<fingerprint>_<fwd|bwd>_s<stage>_<sizes>`, e.g.
/// `cellc_lstm_1f0c…_fwd_s2_H128`.
pub fn symbol(cell: &CompiledCell, side: Side, stage: usize, sizes: &BTreeMap<String, usize>) -> String {
    let sizes: Vec<String> = sizes.iter().map(|(k, v)| format!("{k}{v}")).collect();
    let (name, fp) = (&cell.forward.name, &fingerprint(cell)[..8]);
    format!("cellc_{name}_{fp}_{}_{}", side.stage_suffix(stage), sizes.join("_"))
}

/// What an object file holds and what the runtime needs to drive it
/// (written as JSON beside the object).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The manifest's format version ([`MANIFEST_FORMAT`] when written by this runtime).
    pub format: u32,
    /// The name of the cell the kernels were compiled from.
    pub cell: String,
    /// [`fingerprint`] of the cell the kernels were compiled from.
    pub fingerprint: String,
    /// The CPU features the code was compiled for (the build machine's).
    pub target: Vec<String>,
    /// The signature of every kernel.
    pub abi: String,
    /// Every kernel in the object file.
    pub kernels: Vec<ManifestKernel>,
    /// The schedule at each set of sizes compiled, as `cellc graph --stage schedule` prints it.
    pub schedules: Vec<ManifestSchedule>,
}

/// One kernel of a [`Manifest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestKernel {
    /// Its symbol in the object file ([`symbol`]).
    pub symbol: String,
    /// Whether it is a stage of the forward or of the backward schedule.
    pub side: Side,
    /// Its index in the side's schedule.
    pub stage: usize,
    /// The sizes it was compiled for (those its values depend on).
    pub sizes: BTreeMap<String, usize>,
    /// Pointer-table order: each row's inputs, then its outputs (value ids).
    pub inputs: Vec<String>,
    /// The values it writes, after `inputs` in the pointer table (value ids).
    pub outputs: Vec<String>,
    /// Floats of scratch it needs.
    pub scratch: usize,
    /// Takes the rows of whole sequences in time order (a state chained from row to row).
    pub whole_sequence: bool,
}

/// A schedule of a [`Manifest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestSchedule {
    /// The sizes the schedule was made at.
    pub sizes: BTreeMap<String, usize>,
    /// The schedule, as `cellc graph --stage schedule` prints it.
    pub text: String,
}

/// The CPU features kernels compiled here may use.
pub fn host_target() -> Vec<String> {
    let mut out = vec![std::env::consts::ARCH.to_string()];
    #[cfg(target_arch = "x86_64")]
    {
        let has = [
            ("sse4.1", std::arch::is_x86_feature_detected!("sse4.1")),
            ("avx", std::arch::is_x86_feature_detected!("avx")),
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("bmi2", std::arch::is_x86_feature_detected!("bmi2")),
            ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
        ];
        out.extend(has.iter().filter(|(_, on)| *on).map(|(f, _)| f.to_string()));
    }
    out
}

fn error(message: impl Into<String>) -> RuntimeError {
    RuntimeError::Backend { backend: "cpu".into(), message: message.into() }
}

/// Kernels compiled ahead of time and linked into the program: the
/// manifest and each kernel's function, as `cellc-build` generates them.
pub struct LinkedKernels {
    manifest: &'static str,
    functions: &'static [(&'static str, KernelFn)],
    parsed: OnceLock<std::result::Result<Manifest, String>>,
}

impl LinkedKernels {
    /// The table over a manifest (its JSON text) and each kernel's symbol
    /// and function, as the `static` that `cellc-build`'s bindings declare;
    /// nothing is checked until first use ([`LinkedKernels::manifest`]).
    pub const fn new(
        manifest: &'static str,
        functions: &'static [(&'static str, KernelFn)],
    ) -> LinkedKernels {
        LinkedKernels { manifest, functions, parsed: OnceLock::new() }
    }

    /// The manifest, checked against this machine.
    pub fn manifest(&self) -> Result<&Manifest> {
        let parsed = self.parsed.get_or_init(|| {
            let m: Manifest =
                serde_json::from_str(self.manifest).map_err(|e| format!("unreadable manifest: {e}"))?;
            if m.format != MANIFEST_FORMAT {
                return Err(format!("manifest format {} (this runtime reads {MANIFEST_FORMAT})", m.format));
            }
            let host = host_target();
            let missing: Vec<&String> = m.target.iter().filter(|f| !host.contains(f)).collect();
            if !missing.is_empty() {
                return Err(format!(
                    "the kernels were compiled for {:?}; this CPU lacks {missing:?}",
                    m.target
                ));
            }
            Ok(m)
        });
        parsed.as_ref().map_err(|e| error(format!("linked kernels: {e}")))
    }

    /// The kernel for stage `index` of `side` of `layer`, checked against
    /// the manifest: the same cell, sizes, stage inputs and outputs.
    pub fn stage(
        &self,
        cell: &CompiledCell,
        layer: &Layer,
        side: Side,
        index: usize,
        stage: &Stage,
    ) -> Result<NativeStage> {
        let manifest = self.manifest()?;
        if manifest.cell != cell.forward.name || manifest.fingerprint != fingerprint(cell) {
            return Err(error(format!(
                "the linked kernels are of cell `{}` ({}), not of this `{}` ({}): rebuild them from this .cell file",
                manifest.cell,
                manifest.fingerprint,
                cell.forward.name,
                fingerprint(cell)
            )));
        }
        let sizes = kernel_sizes(cell, layer);
        let name = symbol(cell, side, index, &sizes);
        let entry = manifest.kernels.iter().find(|k| k.symbol == name).ok_or_else(|| {
            let built: Vec<&BTreeMap<String, usize>> = manifest.kernels.iter().map(|k| &k.sizes).collect();
            error(format!(
                "no linked kernel for {} stage {index} of `{}` at {sizes:?} (compiled for {built:?}): \
                 add these sizes to the cellc-build configuration",
                side.tag(),
                cell.forward.name
            ))
        })?;
        let ids = |vs: &[ValueId]| vs.iter().map(|v| v.to_string()).collect::<Vec<_>>();
        if entry.inputs != ids(&stage.inputs) || entry.outputs != ids(&stage.outputs) {
            return Err(error(format!(
                "linked kernel {name} reads {:?} and writes {:?}, but this schedule's stage reads {:?} and \
                 writes {:?} (a size the kernels do not depend on changed the schedule: bind it when building)",
                entry.inputs,
                entry.outputs,
                ids(&stage.inputs),
                ids(&stage.outputs)
            )));
        }
        let func = self
            .functions
            .iter()
            .find(|(s, _)| *s == name)
            .map(|(_, f)| *f)
            .ok_or_else(|| error(format!("the manifest lists {name} but no such function is linked")))?;
        // SAFETY: cellc-build links `func` from the object whose manifest
        // describes it: this stage, at these sizes, needing `scratch` floats.
        Ok(unsafe { NativeStage::new(func, &stage.inputs, &stage.outputs, entry.scratch, None) })
    }
}

impl std::fmt::Debug for LinkedKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkedKernels").field("functions", &self.functions.len()).finish()
    }
}

/// The same table (kernel sets are told apart by identity).
impl PartialEq for LinkedKernels {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for LinkedKernels {}

/// The ABI string every manifest carries.
pub fn abi() -> String {
    KERNEL_ABI.to_string()
}
