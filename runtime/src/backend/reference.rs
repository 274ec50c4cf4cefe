//! The reference back end: runs the schedule's stages with the
//! interpreter's op semantics ([`cellc::shapes::Shapes::compute`]) and plain
//! matrix-vector products, one row at a time.
//!
//! It is slow on purpose and exists to fix the semantics: it executes the
//! stages in schedule order, each over every active row before the next
//! (as kernels would), and each kernel stage by its kernel plan
//! ([`cellc::kernel::eval`]), so a stage that reads a value no earlier
//! stage produced, or a value its kernel keeps in registers, is an error here; and its backward reads only what the
//! schedule saved (plus the state history), so a wrong saved-values
//! choice is an error too. Fast back ends are tested against it.

use super::{check_tape, Backend, BackwardJob, BackwardResult, ForwardJob, RowsMut};
use crate::cell::Layer;
use crate::error::{Result, RuntimeError};
use cellc::ir::{Graph, Op, ValueId};
use cellc::kernel::eval::RowEvaluator;
use cellc::program::{Kept, Side, TapePart};
use cellc::schedule::{Placement, Stage};
use cellc::shapes::Shapes;
use std::collections::HashMap;

/// The reference back end (see the module documentation): slow, one row
/// at a time, the semantics every other back end is tested against.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reference;

/// Values of one row, by value index; parameters are read in place.
type Store = Vec<Option<Vec<f32>>>;

/// A tape in the caller's memory, laid out as the layer's program says:
/// each part's floats of one layout row.
struct RowTape<'t> {
    parts: Vec<(TapePart, std::ops::Range<usize>)>,
    memory: &'t [f32],
}

impl RowTape<'_> {
    fn new<'t>(layer: &Layer, rows: usize, memory: &'t [f32]) -> Result<RowTape<'t>> {
        check_tape(layer, rows, memory.len())?;
        Ok(RowTape { parts: layer.tape().ranges(rows).collect(), memory })
    }

    /// What the part keeping `kept` holds for layout row `row`, if it is kept.
    fn get(&self, kept: Kept, row: usize) -> Option<&[f32]> {
        let (part, range) = self.parts.iter().find(|(p, _)| p.kept == kept)?;
        let at = range.start + row * part.floats;
        Some(&self.memory[at..at + part.floats])
    }
}

/// Writes layout row `row` of every part of a tape, as the layer's program
/// lays it out, from `value` (what each part keeps for that row).
fn keep_row(
    layer: &Layer,
    tape: &mut [f32],
    rows: usize,
    row: usize,
    value: impl Fn(Kept) -> Result<Vec<f32>>,
) -> Result<()> {
    for (part, range) in layer.tape().ranges(rows) {
        let at = range.start + row * part.floats;
        tape[at..at + part.floats].copy_from_slice(&value(part.kept)?);
    }
    Ok(())
}

fn value<'s>(g: &Graph, store: &'s Store, params: &'s [&'s [f32]], v: ValueId) -> Option<&'s [f32]> {
    match g.node(v).op {
        Op::Param(i) => params.get(i).copied(),
        _ => store.get(v.index()).and_then(|x| x.as_deref()),
    }
}

/// Computes `v` from its operands, which must already be in `store`.
fn compute(
    g: &Graph,
    plan: &Shapes,
    store: &mut Store,
    params: &[&[f32]],
    v: ValueId,
    stage: usize,
) -> Result<()> {
    let operands = g.operands(v);
    let mut args = Vec::with_capacity(operands.len());
    for o in &operands {
        match value(g, store, params, *o) {
            Some(a) => args.push(a),
            None => {
                return Err(RuntimeError::Internal(format!(
                    "schedule: stage {stage} computes {v} from {o}, which no earlier stage produced"
                )))
            }
        }
    }
    let out = plan.compute(g, v, &args);
    store[v.index()] = Some(out);
    Ok(())
}

/// Runs the stages of one side for a row at a time: a kernel stage by its
/// kernel plan (what every generated kernel prints), anything else value by
/// value. Each kernel's evaluator is made once per pass and reused row to row.
struct Stages<'a> {
    graph: &'a Graph,
    shapes: &'a Shapes,
    /// The kernel (name, evaluator) of each stage that is one, by stage index.
    kernels: Vec<Option<(&'a str, RowEvaluator<'a>)>>,
}

impl<'a> Stages<'a> {
    fn new(graph: &'a Graph, layer: &'a Layer, side: Side) -> Stages<'a> {
        let shapes = layer.shapes(side);
        let mut kernels: Vec<Option<(&str, RowEvaluator)>> = Vec::new();
        kernels.resize_with(layer.stages(side).len(), || None);
        for k in layer.kernels().filter(|k| k.side == side) {
            kernels[k.stage] = Some((&k.name, RowEvaluator::new(&k.plan, graph, shapes)));
        }
        Stages { graph, shapes, kernels }
    }

    /// Runs stage `k` for the row in `store`.
    fn run(&mut self, (k, st): (usize, &Stage), store: &mut Store, params: &[&[f32]]) -> Result<()> {
        let (g, plan) = (self.graph, self.shapes);
        let Some(Some((name, kernel))) = self.kernels.get_mut(k) else {
            return st.values.iter().try_for_each(|&v| compute(g, plan, store, params, v, k));
        };
        let mut inputs = Vec::with_capacity(st.inputs.len());
        for &v in &st.inputs {
            inputs.push(value(g, store, params, v).ok_or_else(|| {
                RuntimeError::Internal(format!(
                    "schedule: stage {k} reads {v}, which no earlier stage produced"
                ))
            })?);
        }
        let outputs = kernel.row(&inputs).map_err(|e| RuntimeError::Internal(format!("{name}: {e}")))?;
        for (&v, out) in st.outputs.iter().zip(outputs) {
            store[v.index()] = Some(out);
        }
        Ok(())
    }
}

/// Values computed from constants only are available to every stage, as
/// literals are in a kernel.
fn constants(g: &Graph, plan: &Shapes, store: &mut Store) {
    for (v, value) in plan.constant_values(g) {
        store[v.index()] = Some(value);
    }
}

fn stages_at(stages: &[Stage], placement: Placement) -> impl Iterator<Item = (usize, &Stage)> {
    stages.iter().enumerate().filter(move |(_, s)| s.placement == placement)
}

impl Backend for Reference {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn forward(
        &self,
        job: &ForwardJob,
        output: &mut RowsMut,
        mut tape: Option<&mut [f32]>,
    ) -> Result<Vec<Vec<f32>>> {
        let cell = &job.cell.forward;
        let g: &Graph = cell;
        let layer = job.layer;
        let plan = &layer.forward_shapes;
        let stages = &layer.schedule.forward;
        let batch = job.order.batch();
        let layout_rows = job.layout_rows();
        if let Some(t) = tape.as_deref_mut() {
            check_tape(layer, layout_rows, t.len())?;
            // Padding rows stay zero: a reserve holds nothing but this pass's values.
            t.fill(0.0);
        }

        let mut forward_stages = Stages::new(g, layer, Side::Forward);
        let mut base: Store = vec![None; g.value_bound()];
        constants(g, plan, &mut base);
        let fill_inputs = |store: &mut Store, b: usize, t: usize| {
            let x = job.input.get(b, t, layer.input_size);
            for v in g.values() {
                if let Op::Input(i) = g.node(v).op {
                    let (o, l) = layer.input_slices[i];
                    store[v.index()] = Some(x[o..o + l].to_vec());
                }
            }
        };
        let fill_states = |store: &mut Store, states: &[Vec<f32>]| {
            for v in g.values() {
                if let Op::State(i) = g.node(v).op {
                    store[v.index()] = Some(states[i].clone());
                }
            }
        };

        // Before the loop: every row of every sequence.
        let mut pre: HashMap<(usize, usize), Store> = HashMap::new();
        for b in 0..batch {
            for t in 0..job.order.lengths()[b] {
                // No states here: a before-loop stage that reads one is a schedule error.
                let mut store = base.clone();
                fill_inputs(&mut store, b, t);
                for stage in stages_at(stages, Placement::BeforeLoop) {
                    forward_stages.run(stage, &mut store, job.params)?;
                }
                pre.insert((b, t), store);
            }
        }

        let mut states: Vec<Vec<Vec<f32>>> = (0..batch)
            .map(|b| {
                layer
                    .state_sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| job.h0[i][b * n..(b + 1) * n].to_vec())
                    .collect()
            })
            .collect();
        let mut finals = states.clone();
        for s in 0..job.order.steps() {
            let active = job.order.active(s);
            let mut rows: Vec<Store> = Vec::with_capacity(active.len());
            for &b in active {
                let t = job.order.time(b, s, job.reverse);
                let mut store = pre.remove(&(b, t)).unwrap_or_else(|| base.clone());
                fill_inputs(&mut store, b, t);
                fill_states(&mut store, &states[b]);
                rows.push(store);
            }
            // Stage-major: each stage over every active row, then the next.
            for stage in stages_at(stages, Placement::EachStep) {
                for store in rows.iter_mut() {
                    forward_stages.run(stage, store, job.params)?;
                }
            }
            for (&b, store) in active.iter().zip(&rows) {
                let t = job.order.time(b, s, job.reverse);
                let get = |v: ValueId| {
                    value(g, store, job.params, v).map(<[f32]>::to_vec).ok_or_else(|| {
                        RuntimeError::Internal(format!(
                            "schedule: {v} (an output or next state) is never computed"
                        ))
                    })
                };
                let out = get(cell.output)?;
                output.get_mut(b, t, layer.output_size).copy_from_slice(&out);
                let next: Vec<Vec<f32>> = cell.next_states.iter().map(|&v| get(v)).collect::<Result<_>>()?;
                if let Some(tape) = tape.as_deref_mut() {
                    let row = job.input.layout.row(b, t);
                    keep_row(layer, tape, layout_rows, row, |kept| match kept {
                        Kept::StateBefore(i) => Ok(states[b][i].clone()),
                        Kept::StateAfter(i) => Ok(next[i].clone()),
                        Kept::Output => Ok(out.clone()),
                        Kept::Saved(v) => get(v),
                    })?;
                }
                if s + 1 == job.order.lengths()[b] {
                    finals[b] = next.clone();
                }
                states[b] = next;
            }
        }
        let final_states = (0..layer.state_sizes.len())
            .map(|i| finals.iter().flat_map(|f| f[i].iter().copied()).collect())
            .collect();
        Ok(final_states)
    }

    fn backward(&self, job: &BackwardJob, tape: &[f32], d_input: &mut RowsMut) -> Result<BackwardResult> {
        let tape = RowTape::new(job.layer, job.layout_rows(), tape)?;
        let grad = &job.cell.backward;
        let g = &grad.graph;
        let layer = job.layer;
        let plan = &layer.backward_shapes;
        let stages = &layer.schedule.backward;
        let batch = job.order.batch();
        let mut backward_stages = Stages::new(g, layer, Side::Backward);
        let mut base: Store = vec![None; g.value_bound()];
        constants(g, plan, &mut base);

        let mut carry: Vec<Vec<Vec<f32>>> = (0..batch)
            .map(|b| {
                layer
                    .state_sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| job.d_final[i][b * n..(b + 1) * n].to_vec())
                    .collect()
            })
            .collect();
        let mut all_rows: Vec<((usize, usize), Store)> = Vec::with_capacity(job.order.rows());
        for s in (0..job.order.steps()).rev() {
            let active = job.order.active(s);
            let mut rows: Vec<Store> = Vec::with_capacity(active.len());
            for &b in active {
                let t = job.order.time(b, s, job.reverse);
                let row = job.input.layout.row(b, t);
                let x = job.input.get(b, t, layer.input_size);
                let d_out = job.d_output.get(b, t, layer.output_size);
                let mut store = base.clone();
                for v in g.values() {
                    let leaf = match g.node(v).op {
                        Op::Input(i) => {
                            let (o, l) = layer.input_slices[i];
                            Some(x[o..o + l].to_vec())
                        }
                        Op::State(i) => tape.get(Kept::StateBefore(i), row).map(<[f32]>::to_vec),
                        Op::Seed(0) => Some(d_out.to_vec()),
                        _ => None,
                    };
                    if leaf.is_some() {
                        store[v.index()] = leaf;
                    }
                }
                // Forward values the backward reads from the tape, where it
                // keeps them: saved ones, the states after the step and the
                // output (an output that is also a next state is kept once).
                let kept_values = job.layer.saved().iter().map(|&v| (v, Kept::Saved(v)));
                let after = grad.primal_next_states.iter().enumerate();
                let kept_values = kept_values
                    .chain(after.filter_map(|(i, v)| v.map(|v| (v, Kept::StateAfter(i)))))
                    .chain(grad.primal_output.map(|v| (v, Kept::Output)));
                for (v, kept) in kept_values {
                    if let Some(x) = tape.get(kept, row).filter(|_| g.contains(v)) {
                        store[v.index()] = Some(x.to_vec());
                    }
                }
                // Before-loop stages see no carried adjoint: reading one is a schedule error.
                for stage in stages_at(stages, Placement::BeforeLoop) {
                    backward_stages.run(stage, &mut store, job.params)?;
                }
                for v in g.values() {
                    if let Op::Seed(k @ 1..) = g.node(v).op {
                        store[v.index()] = Some(carry[b][k - 1].clone());
                    }
                }
                rows.push(store);
            }
            for stage in stages_at(stages, Placement::EachStep) {
                for store in rows.iter_mut() {
                    backward_stages.run(stage, store, job.params)?;
                }
            }
            for (&b, store) in active.iter().zip(rows) {
                let t = job.order.time(b, s, job.reverse);
                carry[b] = grad
                    .d_states
                    .iter()
                    .zip(&layer.state_sizes)
                    .map(|(d, &n)| match d {
                        Some(v) => value(g, &store, job.params, *v).map(<[f32]>::to_vec).ok_or_else(|| {
                            RuntimeError::Internal(format!(
                                "schedule: state adjoint {v} is not computed in the loop"
                            ))
                        }),
                        None => Ok(vec![0.0; n]),
                    })
                    .collect::<Result<_>>()?;
                all_rows.push(((b, t), store));
            }
        }

        // After the loop: products over all rows, then every row's contribution.
        let mut d_params: Vec<Vec<f32>> = job.params.iter().map(|p| vec![0.0; p.len()]).collect();
        for ((b, t), store) in all_rows.iter_mut() {
            for stage in stages_at(stages, Placement::AfterLoop) {
                backward_stages.run(stage, store, job.params)?;
            }
            for (acc, d) in d_params.iter_mut().zip(&grad.d_params) {
                if let Some(v) = d {
                    let x = value(g, store, job.params, *v).ok_or_else(|| {
                        RuntimeError::Internal(format!("parameter adjoint {v} is never computed"))
                    })?;
                    acc.iter_mut().zip(x).for_each(|(a, x)| *a += x);
                }
            }
            let dx = d_input.get_mut(*b, *t, layer.input_size);
            for (d, &(o, l)) in grad.d_inputs.iter().zip(&layer.input_slices) {
                if let Some(v) = d {
                    let x = value(g, store, job.params, *v).ok_or_else(|| {
                        RuntimeError::Internal(format!("input adjoint {v} is never computed"))
                    })?;
                    dx[o..o + l].iter_mut().zip(x).for_each(|(a, x)| *a += x);
                }
            }
        }
        let d_h0 = (0..layer.state_sizes.len())
            .map(|i| carry.iter().flat_map(|c| c[i].iter().copied()).collect())
            .collect();
        Ok(BackwardResult { d_h0, d_params })
    }
}
