//! What the CUDA emulation tests share: a layer's forward and backward
//! stages at given sizes, row buffers and pointer tables for a stage
//! (chained through time for whole-sequence stages), and building the
//! generated kernels with g++ and the emulation header.

// Each test binary that includes this module uses a part of it.
#![allow(dead_code)]

use cellc::cuda::Kernel;
use cellc::ir::{Graph, ValueId};
use cellc::kernel::KernelPlan;
use cellc::program::Side as ProgramSide;
use cellc::schedule::Stage;
use cellc::shapes::Shapes;
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::{CompiledCell, Model, ModelConfig};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::support::Rng;

/// One side (forward or backward) of a layer: its graph, plan and stages.
pub struct Side {
    pub graph: Arc<Graph>,
    pub plan: Arc<Shapes>,
    pub stages: Vec<Stage>,
    /// The kernel plan of each kernel stage, by stage index.
    pub plans: HashMap<usize, KernelPlan>,
    /// For whole-sequence stages: (input value, output value of the previous row) pairs.
    pub chains: Vec<(ValueId, ValueId)>,
}

pub fn sides(c: &Arc<CompiledCell>, h: usize, i: usize) -> Vec<(&'static str, Side)> {
    let sizes = crate::support::cell_sizes(c, h, 3);
    let input = c.forward.input_dim().eval(&sizes).map_or(i, |n| n as usize);
    let config = ModelConfig { layers: 1, bidirectional: false };
    let model =
        Model::new(c.clone(), config, &sizes, Some(input), None, 1, Box::new(Reference)).expect("model");
    let layer = &model.layers()[0];
    let fwd_graph = Arc::new((*c.forward).clone());
    let bwd_graph = Arc::new(c.backward.graph.clone());
    let (fwd_chains, bwd_chains) = cellc::program::chains(&c.forward, &c.backward);
    let plans = |side: ProgramSide| -> HashMap<usize, KernelPlan> {
        layer.kernels().filter(|k| k.side == side).map(|k| (k.stage, k.plan.clone())).collect()
    };
    vec![
        (
            "fwd",
            Side {
                graph: fwd_graph,
                plan: Arc::new(layer.forward_shapes.clone()),
                stages: layer.schedule.forward.clone(),
                plans: plans(ProgramSide::Forward),
                chains: fwd_chains,
            },
        ),
        (
            "bwd",
            Side {
                graph: bwd_graph,
                plan: Arc::new(layer.backward_shapes.clone()),
                stages: layer.schedule.backward.clone(),
                plans: plans(ProgramSide::Backward),
                chains: bwd_chains,
            },
        ),
    ]
}

/// Row buffers and the pointer table of one run: `rows` rows (in sequences
/// of `seq_rows` when the stage is whole-sequence), inputs random (vector
/// constants at their values), chained state inputs pointing at the
/// previous row's outputs.
pub struct Run {
    /// Owns what the table points into.
    pub buffers: Vec<Vec<f32>>,
    pub table: Vec<*mut f32>,
    /// The buffer each table entry points into.
    pub slots: Vec<usize>,
}

pub fn run_buffers(side: &Side, stage: &Stage, seq_rows: &[usize], whole: bool, seed: u64) -> Run {
    let constants: HashMap<ValueId, Vec<f32>> =
        side.plan.constant_values::<f32>(&side.graph).into_iter().collect();
    let mut rng = Rng::new(seed);
    let mut buffers: Vec<Vec<f32>> = Vec::new();
    let mut slots: Vec<usize> = Vec::new(); // buffer index per table entry
    let k = stage.inputs.len() + stage.outputs.len();
    for &rows in seq_rows {
        for r in 0..rows {
            let row_start = slots.len();
            for &v in &stage.inputs {
                let chained = side.chains.iter().find(|(input, _)| *input == v).map(|c| c.1);
                match chained {
                    Some(out) if whole && r > 0 => {
                        let at = stage.outputs.iter().position(|o| *o == out).expect("chained output");
                        let prev = row_start - k + stage.inputs.len() + at;
                        slots.push(slots[prev]);
                    }
                    _ => {
                        let n = side.plan.elements(v);
                        let data = constants
                            .get(&v)
                            .cloned()
                            .unwrap_or_else(|| rng.vec(n, 1.0).iter().map(|&x| x as f32).collect());
                        buffers.push(data);
                        slots.push(buffers.len() - 1);
                    }
                }
            }
            for &v in &stage.outputs {
                buffers.push(vec![f32::NAN; side.plan.elements(v)]);
                slots.push(buffers.len() - 1);
            }
        }
    }
    let table = slots.iter().map(|&b| buffers[b].as_mut_ptr()).collect();
    Run { buffers, table, slots }
}

pub use cellc_runtime::backend::cuda::device::emulation_source;

/// Compiles `files` with g++ and the emulation header (see the runtime's
/// `device::gxx`), with debug information for sanitizer reports.
pub fn gxx(files: &[PathBuf], args: &[&str], output: &Path) {
    let args: Vec<&str> = ["-g"].into_iter().chain(args.iter().copied()).collect();
    if let Err(e) = cellc_runtime::backend::cuda::device::gxx(files, &args, output) {
        panic!("{e}");
    }
}

/// The kernels as a shared library to dlopen.
pub fn build(dir: &Path, name: &str, kernels: &[Kernel]) -> PathBuf {
    let cu = dir.join(format!("{name}.cu"));
    std::fs::write(&cu, emulation_source(kernels)).expect("source");
    let so = dir.join(format!("lib{name}.so"));
    gxx(&[cu], &["-shared"], &so);
    so
}
