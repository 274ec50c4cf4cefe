//! The one pipeline from a checked cell to what every back end runs.
//!
//! ```text
//! checked Cell --Steps::compile--> Steps (forward + backward, optimised, verified)
//!              --Program::new----> Program (concrete shapes, schedule, kernel names)
//! ```
//!
//! [`Steps::compile`] is done once per cell and knows no sizes: it
//! simplifies the forward step (verifying the graph after every pass),
//! verifies the result, and derives the backward step (simplified and
//! verified the same way). [`Program::new`] fixes the sizes: every value's
//! shape in both steps and the schedule of their stages. The runtime, the
//! CLI, `cellc-build`, the benches, the fuzz targets and the CUDA emitter
//! all go through these two; nothing else chains the passes.

use crate::autodiff::Gradient;
use crate::dims::Bindings;
use crate::interp::InterpError;
use crate::ir::verify::VerifyError;
use crate::ir::{Cell, Graph, Op, ValueId};
use crate::kernel::{Chain, KernelPlan};
use crate::schedule::{Schedule, Stage};
use crate::shapes::Shapes;
pub use storage::Storage;
use storage::Storages;
pub use tape::{Kept, TapeLayout, TapePart};

mod storage;
mod tape;

/// Which step of a cell: the forward step, or its derived backward step.
/// (Serialisable: ahead-of-time manifests list each kernel's side.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The forward step: inputs and states to output and next states.
    Forward,
    /// The backward step: adjoints of the output and next states to the
    /// adjoints of inputs, states and parameters.
    Backward,
}

impl Side {
    /// Both sides, forward first.
    pub const BOTH: [Side; 2] = [Side::Forward, Side::Backward];

    /// `fwd` or `bwd`, as kernel names say it.
    pub fn tag(self) -> &'static str {
        match self {
            Side::Forward => "fwd",
            Side::Backward => "bwd",
        }
    }

    /// What names stage `stage` of this side in every kernel name:
    /// `fwd_s<stage>` / `bwd_s<stage>`.
    pub fn stage_suffix(self, stage: usize) -> String {
        format!("{}_s{stage}", self.tag())
    }
}

/// A cell's two steps, ready for any sizes: the simplified forward step and
/// its derived backward step, both verified.
#[derive(Clone, Debug)]
pub struct Steps {
    /// The forward step, simplified and with each next state computed in the step.
    pub forward: Cell,
    /// The backward step derived from `forward`, simplified.
    pub backward: Gradient,
}

impl Steps {
    /// Simplifies `cell` (a checked cell, from [`crate::compile`]) and
    /// derives its backward step. An error is a compiler bug: the verifier
    /// names the pass and the value whose invariant broke.
    pub fn compile(cell: &Cell) -> Result<Steps, Vec<VerifyError>> {
        let mut forward = cell.clone();
        crate::passes::optimize_cell(&mut forward)?;
        crate::ir::verify::verify(&forward)?;
        let backward = crate::autodiff::backward_step(&forward)?;
        Ok(Steps { forward, backward })
    }

    /// The graph of `side`.
    pub fn graph(&self, side: Side) -> &Graph {
        match side {
            Side::Forward => &self.forward,
            Side::Backward => &self.backward.graph,
        }
    }

    /// The schedule of both steps with the sizes in `sizes` bound and the
    /// rest symbolic (what `cellc graph --stage schedule` prints; a
    /// [`Program`] binds every size).
    pub fn schedule(&self, sizes: &Bindings) -> Schedule {
        crate::schedule::schedule(&self.forward, &self.backward, sizes)
    }

    /// The steps at `sizes`: see [`Program::new`].
    pub fn program(&self, sizes: &Bindings) -> Result<Program, InterpError> {
        Program::new(&self.forward, &self.backward, sizes)
    }

    /// Both steps' IR as text: two cells with the same identity compile to
    /// the same kernels at the same sizes.
    pub fn identity(&self) -> String {
        let names = crate::ir::print::LeafNames::of(&self.forward, &self.backward.seeds);
        format!(
            "{}\n{}",
            crate::ir::print::values_text(&self.forward, &names, None),
            crate::ir::print::values_text(&self.backward.graph, &names, None)
        )
    }
}

/// A cell's steps at concrete sizes: what a back end needs to run them.
#[derive(Clone, Debug)]
pub struct Program {
    /// The cell's name (kernel names start with it).
    pub cell: String,
    /// The sizes the cell uses (others given are dropped).
    pub sizes: Bindings,
    /// Features per step: all inputs together.
    pub input_size: usize,
    /// Each input's `(offset, len)` in the step's feature vector.
    pub input_slices: Vec<(usize, usize)>,
    /// Elements of the step's output.
    pub output_size: usize,
    /// Elements of each state, in declaration order.
    pub state_sizes: Vec<usize>,
    /// `(rows, cols)` of each parameter; `cols == 1` for a vector.
    pub param_shapes: Vec<(usize, usize)>,
    /// The heads of each parameter: 1 but for a block-diagonal `[heads, m, n]`.
    pub param_heads: Vec<usize>,
    /// Where each mask a step reads lies in a row of the pass's masks,
    /// `(offset, len)`, side by side in mask order; `None` for a
    /// DropConnect mask, which masks its parameter instead (see
    /// [`crate::ir::masks`]).
    pub mask_slices: Vec<Option<(usize, usize)>>,
    /// Floats of a row of the pass's masks: every mask a step reads.
    pub mask_width: usize,
    /// Every forward value's shape, and the forward step's evaluation order.
    pub forward_shapes: Shapes,
    /// Every backward value's shape, and the backward step's evaluation order.
    pub backward_shapes: Shapes,
    /// The stages of both steps, and what the forward saves for the backward.
    pub schedule: Schedule,
    /// Every generated kernel (pointwise and whole-sequence stages), forward first.
    pub kernels: Vec<ProgramKernel>,
    /// Where every value lives ([`Program::storage`]).
    storage: Storages,
    /// What a training forward keeps, and where in a reserve ([`Program::tape`]).
    tape: TapeLayout,
}

/// One generated kernel of a [`Program`]: its stage, its name (the same
/// for every target) and its kernel plan, which every emitter prints.
#[derive(Clone, Debug)]
pub struct ProgramKernel {
    /// Which step's schedule the stage belongs to.
    pub side: Side,
    /// The stage's index in its side's schedule.
    pub stage: usize,
    /// The kernel's name: [`kernel_name`] of the cell, side and stage.
    pub name: String,
    /// What the kernel computes for a row.
    pub plan: KernelPlan,
}

impl ProgramKernel {
    /// Its schedule stage.
    pub fn stage<'p>(&self, program: &'p Program) -> &'p Stage {
        &program.stages(self.side)[self.stage]
    }
}

impl Program {
    /// Fixes a cell's steps (the two halves of a [`Steps`]) at `sizes`
    /// (bindings of sizes the cell does not use are ignored). Errs on an
    /// unbound size, a size that is not positive, or a tensor too large to
    /// index.
    pub fn new(forward: &Cell, backward: &Gradient, sizes: &Bindings) -> Result<Program, InterpError> {
        let bound = forward.bind(sizes)?;
        let sizes = bound.sizes().clone();
        let backward_shapes = Shapes::new(&backward.graph, &sizes, &forward.name)?;
        let schedule = crate::schedule::schedule(forward, backward, &sizes);
        let (forward_chains, backward_chains) = chains(forward, backward);
        let mut kernels = Vec::new();
        for side in Side::BOTH {
            let (graph, shapes, stages, chains) = match side {
                Side::Forward => (&**forward, bound.shapes(), &schedule.forward, &forward_chains),
                Side::Backward => (&backward.graph, &backward_shapes, &schedule.backward, &backward_chains),
            };
            for (stage, st) in stages.iter().enumerate().filter(|(_, st)| st.kind.is_kernel()) {
                let plan = KernelPlan::new(graph, shapes, st, chains).map_err(|e| InterpError::Internal {
                    message: format!("stage {stage} of the {side:?} step: {e}"),
                })?;
                kernels.push(ProgramKernel {
                    side,
                    stage,
                    name: kernel_name(&forward.name, side, stage),
                    plan,
                });
            }
        }
        let storage = Storages::new(forward, backward, &schedule, (bound.shapes(), &backward_shapes));
        // The backward reads a kept state or output where one of its values is stored as one.
        let bwd_storages: Vec<Storage> =
            backward.graph.values().filter_map(|v| storage.get(Side::Backward, v, true)).collect();
        let reads = |kept: Kept| {
            bwd_storages.iter().any(|&s| match (kept, s) {
                (Kept::StateBefore(i), Storage::State(j)) | (Kept::StateAfter(i), Storage::NextState(j)) => {
                    i == j
                }
                (Kept::Output, Storage::Output { .. }) => true,
                _ => false,
            })
        };
        // A state before the step that only kernels read, row by row, can
        // be found as the previous step's state after it (see TapeLayout).
        let read_as_rows = |i: usize| {
            schedule.backward.iter().filter(|st| !st.kind.is_kernel()).all(|st| {
                !st.inputs.iter().any(|&v| storage.get(Side::Backward, v, true) == Some(Storage::State(i)))
            })
        };
        let tape = TapeLayout::new(
            (bound.state_sizes(), bound.output_size()),
            &schedule.saved.saved,
            bound.shapes(),
            (&reads, &read_as_rows),
        );
        let mut mask_width = 0;
        let mask_slices = forward
            .masks
            .iter()
            .zip(bound.mask_sizes())
            .map(|(m, &len)| {
                m.param.is_none().then(|| {
                    mask_width += len;
                    (mask_width - len, len)
                })
            })
            .collect();
        Ok(Program {
            mask_slices,
            mask_width,
            storage,
            tape,
            cell: forward.name.clone(),
            input_size: bound.input_size(),
            input_slices: bound.input_slices().to_vec(),
            output_size: bound.output_size(),
            state_sizes: bound.state_sizes().to_vec(),
            param_shapes: bound.param_shapes().to_vec(),
            param_heads: bound.param_heads().to_vec(),
            forward_shapes: bound.shapes().clone(),
            backward_shapes,
            schedule,
            kernels,
            sizes,
        })
    }

    /// Every value's shape and evaluation order in `side`.
    pub fn shapes(&self, side: Side) -> &Shapes {
        match side {
            Side::Forward => &self.forward_shapes,
            Side::Backward => &self.backward_shapes,
        }
    }

    /// The stages of `side`.
    pub fn stages(&self, side: Side) -> &[Stage] {
        match side {
            Side::Forward => &self.schedule.forward,
            Side::Backward => &self.schedule.backward,
        }
    }

    /// Where value `v` of `side` lives while a batch runs (`training`: the
    /// forward keeps what the backward reads): see [`Storage`].
    pub fn storage(&self, side: Side, v: ValueId, training: bool) -> Option<Storage> {
        self.storage.get(side, v, training)
    }

    /// Whether the backward's work after the loop reads backward value `v`.
    pub fn read_after_loop(&self, v: ValueId) -> bool {
        self.storage.read_after_loop(v)
    }

    /// The forward values the backward reads from the forward's tape.
    pub fn saved(&self) -> &[ValueId] {
        &self.schedule.saved.saved
    }

    /// What a training forward keeps for the backward, per layout row, and
    /// where each part lies in a reserve: every back end that keeps its tape
    /// in the caller's memory reads this one layout.
    pub fn tape(&self) -> &TapeLayout {
        &self.tape
    }

    /// Every generated kernel, forward first.
    pub fn kernels(&self) -> impl Iterator<Item = &ProgramKernel> {
        self.kernels.iter()
    }

    /// The kernel of stage `stage` of `side`, if that stage is one.
    pub fn kernel(&self, side: Side, stage: usize) -> Option<&ProgramKernel> {
        self.kernels.iter().find(|k| k.side == side && k.stage == stage)
    }

    /// Fusion `f`'s pointwise stage (forward, `graph` the forward step) planned for one tile of
    /// `width` units: the shapes it runs at and its kernel, named as the
    /// stage's with the width after it. Errs where a size of the cell
    /// cannot take that width (a size `H - 64` at `H = 32`).
    pub fn tile_kernel(
        &self,
        graph: &Graph,
        f: &crate::schedule::Fusion,
        width: usize,
    ) -> Result<(Shapes, ProgramKernel), InterpError> {
        self.kernel_on_units(graph, (Side::Forward, f.pointwise), &f.tile_sizes(&self.sizes, width), width)
    }

    /// Pointwise stage `stage` of the backward step (`graph`), split by
    /// units as `split` says, planned for `width` of them: as
    /// [`Program::tile_kernel`].
    pub fn units_kernel(
        &self,
        graph: &Graph,
        split: &crate::schedule::UnitSplit,
        stage: usize,
        width: usize,
    ) -> Result<(Shapes, ProgramKernel), InterpError> {
        let sizes = crate::schedule::tiles::sizes_on_units(&self.sizes, &split.unit, width);
        self.kernel_on_units(graph, (Side::Backward, stage), &sizes, width)
    }

    fn kernel_on_units(
        &self,
        graph: &Graph,
        (side, stage): (Side, usize),
        sizes: &Bindings,
        width: usize,
    ) -> Result<(Shapes, ProgramKernel), InterpError> {
        let shapes = Shapes::new(graph, sizes, &self.cell)?;
        let (stages, step) = match side {
            Side::Forward => (&self.schedule.forward, "forward"),
            Side::Backward => (&self.schedule.backward, "backward"),
        };
        let st = stages.get(stage).ok_or_else(|| InterpError::Internal {
            message: format!("no stage {stage} of the {step} step"),
        })?;
        let plan = KernelPlan::new(graph, &shapes, st, &[]).map_err(|e| InterpError::Internal {
            message: format!("stage {stage} of the {step} step on tiles of {width}: {e}"),
        })?;
        let name = format!("{}_w{width}", kernel_name(&self.cell, side, stage));
        Ok((shapes, ProgramKernel { side, stage, name, plan }))
    }

    /// The name of the kernel of stage `stage` of `side`, the same for every
    /// target: `<cell>_fwd_s<i>` / `<cell>_bwd_s<i>`. (Linked objects put a
    /// fingerprint after the cell and the sizes at the end, with the same
    /// [`Side::stage_suffix`]: see the runtime's `aot::symbol`.)
    pub fn kernel_name(&self, side: Side, stage: usize) -> String {
        kernel_name(&self.cell, side, stage)
    }
}

/// The state chains of a cell's forward and backward steps (see
/// [`Chain`]): forward, state `k`'s leaf and the next state; backward
/// (rows in reverse time), the seed of next state `k`'s gradient and the
/// gradient of state `k`, which the step before reads.
pub fn chains(cell: &Cell, grad: &Gradient) -> (Vec<Chain>, Vec<Chain>) {
    let leaf = |g: &Graph, op: Op| g.values().find(|&v| g.node(v).op == op);
    let forward = (0..cell.states.len())
        .filter_map(|k| Some((leaf(cell, Op::State(k))?, *cell.next_states.get(k)?)))
        .collect();
    let backward = (0..cell.states.len())
        .filter_map(|k| Some((leaf(&grad.graph, Op::Seed(k + 1))?, (*grad.d_states.get(k)?)?)))
        .collect();
    (forward, backward)
}

/// `<cell>_<fwd|bwd>_s<stage>`: see [`Program::kernel_name`].
pub fn kernel_name(cell: &str, side: Side, stage: usize) -> String {
    format!("{cell}_{}", side.stage_suffix(stage))
}

/// A shipped cell (`cells/<name>.cell`) compiled, at each size `size_of` gives.
#[cfg(test)]
pub(crate) fn shipped(name: &str, size_of: impl Fn(&str) -> usize) -> (Steps, Program) {
    let path = format!("{}/../cells/{name}.cell", env!("CARGO_MANIFEST_DIR"));
    let src = std::fs::read_to_string(path).expect("shipped cell");
    let module = crate::compile(&format!("{name}.cell"), &src).module.expect("compiles");
    let steps = Steps::compile(&module.cells[0]).expect("verifies");
    let sizes = module.cells[0].sizes.iter().map(|s| (s.clone(), size_of(s))).collect();
    let program = steps.program(&sizes).expect("sizes");
    (steps, program)
}
