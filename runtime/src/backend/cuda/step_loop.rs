//! The time loop as one cooperative launch ([`cellc::cuda::persistent`]):
//! which time loops have one, and the rule that decides, per pass, whether
//! it runs or the loop's calls are issued step by step (a GEMM through
//! cuBLAS, then the step's kernels).

use super::device::CooperativeLimits;
use crate::cell::{CompiledCell, Layer};
use crate::error::cuda_error as error;
use crate::error::Result;
use crate::plan::TimeLoop;
use cellc::cuda::persistent::{self, Product, StepLoop, Work};
use cellc::cuda::Kernel;
use cellc::program::Side;
use cellc::schedule::StageKind;

/// Which route time loops take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StepLoops {
    /// As [`grid`]'s rule says.
    #[default]
    Auto,
    /// One cooperative launch wherever the device has them and the weights fit.
    Always,
    /// A GEMM and kernels per step, always.
    Never,
}

impl StepLoops {
    /// `CELLC_CUDA_STEP_LOOP`: `auto` (or unset), `always` or `never`.
    pub fn from_env() -> Result<StepLoops> {
        match std::env::var("CELLC_CUDA_STEP_LOOP").ok().as_deref() {
            None | Some("") | Some("auto") => Ok(StepLoops::Auto),
            Some("always") => Ok(StepLoops::Always),
            Some("never") => Ok(StepLoops::Never),
            Some(other) => {
                Err(error(format!("CELLC_CUDA_STEP_LOOP={other}: there are `auto`, `always` and `never`")))
            }
        }
    }
}

/// The widest step (rows) at which [`StepLoops::Auto`] takes the step loop:
/// past it, the products are large enough for cuBLAS's tensor-core GEMMs
/// to beat the loop's own (CUDA-core) products, whatever launches cost.
/// Set from the shapes, to be validated by the GPU check.
pub const AUTO_MAX_ROWS: usize = 64;

/// The grid a pass's step loop `step_loop` runs on, or `None` for the
/// loop step by step: the device must launch cooperative kernels, a
/// block's share of the weights must fit its shared memory with one block
/// per multiprocessor, and (for `Auto`) the widest step must have at most
/// [`AUTO_MAX_ROWS`] rows.
pub fn grid(
    setting: StepLoops,
    limits: Option<CooperativeLimits>,
    step_loop: &StepLoop,
    widest_step: usize,
) -> Option<usize> {
    let limits = limits?;
    let fits = step_loop.shared_bytes(limits.blocks).is_some_and(|b| b <= limits.shared_bytes);
    match setting {
        StepLoops::Never => None,
        StepLoops::Always => fits.then_some(limits.blocks),
        StepLoops::Auto => (fits && widest_step <= AUTO_MAX_ROWS).then_some(limits.blocks),
    }
}

/// The step loops of `layer`'s time loops (the forward's, inference and
/// training, and the backward's), each with the stages it runs;
/// `stage_kernel` gives a per-row stage's kernel.
pub fn step_loops<'k>(
    cell: &CompiledCell,
    layer: &Layer,
    side: Side,
    stage_kernel: impl Fn(usize) -> Option<&'k Kernel>,
) -> Result<Vec<(Vec<usize>, StepLoop)>> {
    let mut loops: Vec<(Vec<usize>, StepLoop)> = Vec::new();
    let (graph, shapes) = (cell.graph(side), layer.shapes(side));
    let stages = match side {
        Side::Forward => &layer.schedule.forward,
        Side::Backward => &layer.schedule.backward,
    };
    for training in [false, true] {
        let TimeLoop::Steps(list) = &layer.pass(side, training).time_loop else { continue };
        if loops.iter().any(|(l, _)| l == list) {
            continue;
        }
        let mut products: Vec<Vec<Product>> = Vec::new();
        for &i in list {
            if stages[i].kind == StageKind::Gemm {
                let ps = stages[i].values.iter().map(|&v| Product::of(graph, shapes, v));
                products.push(ps.collect::<std::result::Result<_, _>>().map_err(|e| error(e.to_string()))?);
            }
        }
        let mut work = Vec::new();
        let mut next_products = products.iter();
        for &i in list {
            match stages[i].kind {
                StageKind::Gemm => work.push(Work::Products(next_products.next().map_or(&[][..], |p| p))),
                StageKind::Pointwise { .. } => {
                    let kernel = stage_kernel(i).ok_or_else(|| error(format!("no kernel for stage {i}")))?;
                    let plan = layer
                        .kernel(side, i)
                        .map(|k| &k.plan)
                        .ok_or_else(|| error(format!("no kernel plan for stage {i}")))?;
                    work.push(Work::Rows(kernel, plan));
                }
                // Nothing else runs in a step: such a loop keeps its calls.
                _ => {
                    work.clear();
                    break;
                }
            }
        }
        if work.is_empty() || !work.iter().any(|w| matches!(w, Work::Products(_))) {
            continue;
        }
        let indices: Vec<String> = list.iter().map(|i| i.to_string()).collect();
        let name = format!("cellc_step_loop_{}_{}", side.tag(), indices.join("_"));
        let step_loop = persistent::emit(&name, &work).map_err(|e| error(e.to_string()))?;
        loops.push((list.clone(), step_loop));
    }
    Ok(loops)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The step loops of a shipped cell at H = I = 32, forward and backward.
    fn loops(name: &str) -> [Vec<(Vec<usize>, StepLoop)>; 2] {
        let path = format!("{}/../cells/{name}.cell", env!("CARGO_MANIFEST_DIR"));
        let cell = CompiledCell::from_file(std::path::Path::new(&path), None).expect("compiles");
        let sizes = cell.forward.sizes.iter().map(|s| (s.clone(), 32)).collect();
        let layer = Layer::new(&cell, 0, &sizes).expect("sizes");
        Side::BOTH.map(|side| {
            let stages: Vec<(usize, Kernel)> = layer
                .kernels()
                .filter(|k| k.side == side)
                .map(|k| {
                    let (graph, shapes) = (cell.graph(side), layer.shapes(side));
                    let cx = cellc::cuda::Context::default();
                    let kernel =
                        cellc::cuda::emit_stage(graph, shapes, k.stage(&layer), &k.plan, &k.name, cx);
                    (k.stage, kernel.expect("emits"))
                })
                .collect();
            let of = |i| stages.iter().find(|(s, _)| *s == i).map(|(_, k)| k);
            step_loops(&cell, &layer, side, of).expect("step loops")
        })
    }

    fn barriers(loops: &[(Vec<usize>, StepLoop)]) -> Vec<usize> {
        loops.iter().map(|(_, l)| l.barriers_per_step).collect()
    }

    /// An LSTM's and a GRU's forward step fuse the pointwise stage after the
    /// product (one grid-wide barrier a step); LayerNorm's row reductions and
    /// the backward's product after its stage take a second.
    #[test]
    fn lane_stages_fuse_after_their_products() {
        let [forward, backward] = loops("lstm");
        assert_eq!(barriers(&forward), [1], "lstm forward (inference and training share one loop)");
        assert_eq!(barriers(&backward), [2], "lstm backward");
        let [forward, _] = loops("gru");
        assert_eq!(barriers(&forward), [1], "gru forward");
        let [forward, _] = loops("layernorm_lstm");
        assert_eq!(barriers(&forward), [2], "layernorm_lstm forward");
        let [forward, backward] = loops("sru");
        assert!(forward.is_empty() && backward.is_empty(), "no per-step product, no step loop");
    }

    /// The rule: no device support or `Never`, no loop; weights past a
    /// block's shared memory, no loop; past 64 rows, only with `Always`.
    #[test]
    fn the_rule_takes_the_loop_where_it_fits() {
        let [forward, _] = loops("lstm");
        let l = &forward[0].1;
        let need = l.shared_bytes(4).expect("fits 32 bits");
        let fits = Some(CooperativeLimits { blocks: 4, shared_bytes: need });
        let small = Some(CooperativeLimits { blocks: 4, shared_bytes: need - 4 });
        assert_eq!(grid(StepLoops::Auto, fits, l, 64), Some(4));
        assert_eq!(grid(StepLoops::Auto, fits, l, 65), None, "wide steps go to cuBLAS");
        assert_eq!(grid(StepLoops::Always, fits, l, 65), Some(4));
        assert_eq!(grid(StepLoops::Never, fits, l, 1), None);
        assert_eq!(grid(StepLoops::Always, small, l, 1), None, "the weights must fit");
        assert_eq!(grid(StepLoops::Always, None, l, 1), None, "no cooperative launch");
        // A block's share of W_hh [4*32, 32]: 32 units over 4 blocks, 4 pieces of 8 rows of 33 floats.
        assert_eq!(need, 4 * (4 * 8 * 33 + cellc::cuda::BLOCK as usize));
    }
}
