//! The reference back end: runs the schedule's stages with the
//! interpreter's op semantics ([`cellc::shapes::Shapes::compute`]) and plain
//! matrix-vector products, one row at a time.
//!
//! It is slow on purpose and exists to fix the semantics: it executes a
//! pass's plan ([`crate::plan::PassPlan`]), the stages before, in and after
//! the loop in schedule order, each over every active row before the next
//! (as kernels would), and each kernel stage by its kernel plan
//! ([`cellc::kernel::eval`]), so a stage that reads a value no earlier
//! stage produced, or a value its kernel keeps in registers, is an error here; and its backward reads only what the
//! schedule saved (plus the state history), so a wrong saved-values
//! choice is an error too. Fast back ends are tested against it.
//!
//! Its products of matrix parameters take the pass's precision as
//! [`cellc::precision`] states it and the interpreter computes it
//! ([`Shapes::compute_in`]): at bf16, fp16 or TF32 both operands rounded,
//! the sums in f32. So it is the oracle of mixed precision too, training
//! with a cell's masks included, which the interpreter does not draw.

use super::cpu::host::{self, HostBackward, HostForward, HostGradients, Rows, RowsMut, StateBefore};
use super::{check_tape, Device};
use crate::cell::Layer;
use crate::error::{Result, RuntimeError};
use crate::pass::{LayerBackward, LayerForward, Pass};
use crate::plan::{Home, PassPlan, TapeSource};
use cellc::ir::{Graph, ValueId};
use cellc::kernel::eval::RowEvaluator;
use cellc::precision::Precision;
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

    /// What the part keeping `kept` holds for layout row `row`.
    fn get(&self, kept: Kept, row: usize) -> Result<&[f32]> {
        let (part, range) = self.parts.iter().find(|(p, _)| p.kept == kept).ok_or_else(|| {
            RuntimeError::Internal(format!("the backward reads {kept:?}, which the tape does not keep"))
        })?;
        let at = range.start + row * part.floats;
        Ok(&self.memory[at..at + part.floats])
    }
}

/// Writes layout row `row` of every part of a tape, as the pass's plan
/// says, from `value` (what each part's source holds for that row).
fn keep_row(
    pass: &PassPlan,
    layer: &Layer,
    tape: &mut [f32],
    rows: usize,
    row: usize,
    value: impl Fn(TapeSource) -> Result<Vec<f32>>,
) -> Result<()> {
    for (write, (part, range)) in pass.tape.iter().zip(layer.tape().ranges(rows)) {
        let at = range.start + row * part.floats;
        tape[at..at + part.floats].copy_from_slice(&value(write.source)?);
    }
    Ok(())
}

/// Mask `i`'s units of row `(b, t)`, from the masks the pass filled.
fn mask_row(masks: Option<Rows>, layer: &Layer, i: usize, (b, t): (usize, usize)) -> Result<Vec<f32>> {
    let missing = || RuntimeError::Internal(format!("the pass reads mask {i}, which it was not given"));
    let (offset, len) = layer.mask_slices.get(i).copied().flatten().ok_or_else(missing)?;
    Ok(masks.ok_or_else(missing)?.get(b, t, offset + len)[offset..].to_vec())
}

fn value<'s>(pass: &PassPlan, store: &'s Store, params: &'s [&'s [f32]], v: ValueId) -> Option<&'s [f32]> {
    match pass.home(v) {
        Some(Home::Param(i)) => params.get(i).copied(),
        _ => store.get(v.index()).and_then(|x| x.as_deref()),
    }
}

/// Computes `v` from its operands, which must already be in `store`; a
/// product of a matrix parameter in `precision`.
fn compute(
    g: &Graph,
    pass: &PassPlan,
    (plan, precision): (&Shapes, Precision),
    store: &mut Store,
    params: &[&[f32]],
    v: ValueId,
    stage: usize,
) -> Result<()> {
    let operands = g.operands(v);
    let mut args = Vec::with_capacity(operands.len());
    for o in &operands {
        match value(pass, store, params, *o) {
            Some(a) => args.push(a),
            None => {
                return Err(RuntimeError::Internal(format!(
                    "schedule: stage {stage} computes {v} from {o}, which no earlier stage produced"
                )))
            }
        }
    }
    let out = plan.compute_in(precision, g, v, &args);
    store[v.index()] = Some(out);
    Ok(())
}

/// Runs the stages of one side for a row at a time: a kernel stage by its
/// kernel plan (what every generated kernel prints), anything else value by
/// value. Each kernel's evaluator is made once per pass and reused row to row.
struct Stages<'a> {
    graph: &'a Graph,
    pass: &'a PassPlan,
    shapes: &'a Shapes,
    /// The precision of the products of matrix parameters.
    precision: Precision,
    /// The kernel (name, evaluator) of each stage that is one, by stage index.
    kernels: Vec<Option<(&'a str, RowEvaluator<'a>)>>,
}

impl<'a> Stages<'a> {
    fn new(graph: &'a Graph, layer: &'a Layer, pass: &'a PassPlan, precision: Precision) -> Stages<'a> {
        let side = pass.side;
        let shapes = layer.shapes(side);
        let mut kernels: Vec<Option<(&str, RowEvaluator)>> = Vec::new();
        kernels.resize_with(layer.stages(side).len(), || None);
        for k in layer.kernels().filter(|k| k.side == side) {
            kernels[k.stage] = Some((&k.name, RowEvaluator::new(&k.plan, graph, shapes)));
        }
        Stages { graph, pass, shapes, precision, kernels }
    }

    /// Runs the stages `stages` (indices into `all`) for the row in `store`.
    fn run_all(
        &mut self,
        stages: &[usize],
        all: &[Stage],
        store: &mut Store,
        params: &[&[f32]],
    ) -> Result<()> {
        stages.iter().try_for_each(|&k| self.run(k, &all[k], store, params))
    }

    /// Runs stage `k` for the row in `store`.
    fn run(&mut self, k: usize, st: &Stage, store: &mut Store, params: &[&[f32]]) -> Result<()> {
        let (g, pass, plan) = (self.graph, self.pass, (self.shapes, self.precision));
        let Some(Some((name, kernel))) = self.kernels.get_mut(k) else {
            return st.values.iter().try_for_each(|&v| compute(g, pass, plan, store, params, v, k));
        };
        let mut inputs = Vec::with_capacity(st.inputs.len());
        for &v in &st.inputs {
            inputs.push(value(pass, store, params, v).ok_or_else(|| {
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

impl Device for Reference {
    fn name(&self) -> &'static str {
        "reference"
    }

    host::host_memory!();

    /// Every precision: it states the cell's semantics in each (see the
    /// module documentation).
    fn precision(&self, asked: Precision) -> Result<Precision> {
        Ok(asked)
    }

    fn forward(&self, pass: &Pass, job: LayerForward) -> Result<()> {
        // SAFETY: per the trait's contract, every span is host memory of the pass.
        unsafe { host::forward(pass, job, |job, output, tape| forward(job, pass.precision, output, tape)) }
    }

    fn backward(&self, pass: &Pass, job: LayerBackward) -> Result<()> {
        // SAFETY: per the trait's contract, every span is host memory of the pass.
        unsafe {
            host::backward(pass, job, |job, tape, d_input| backward(job, pass.precision, tape, d_input))
        }
    }
}

/// One layer and direction forwards, a row at a time; the final states.
fn forward(
    job: &HostForward,
    precision: Precision,
    output: &mut RowsMut,
    mut tape: Option<&mut [f32]>,
) -> Result<Vec<Vec<f32>>> {
    let g: &Graph = &job.cell.forward;
    let layer = job.layer;
    let pass = layer.pass(Side::Forward, tape.is_some());
    let stages = &layer.schedule.forward;
    let batch = job.order.batch();
    let layout_rows = job.layout_rows();
    if let Some(t) = tape.as_deref_mut() {
        check_tape(layer, layout_rows, t.len())?;
        // Padding rows stay zero: a reserve holds nothing but this pass's values.
        t.fill(0.0);
    }

    let mut forward_stages = Stages::new(g, layer, pass, precision);
    let mut base: Store = vec![None; g.value_bound()];
    constants(g, &layer.forward_shapes, &mut base);
    let fill = |store: &mut Store, b: usize, t: usize, states: Option<&[Vec<f32>]>| -> Result<()> {
        let x = job.input.get(b, t, layer.input_size);
        for (v, home) in pass.homes() {
            let leaf = match home {
                Home::Input(i) => {
                    let (o, l) = layer.input_slices[i];
                    x[o..o + l].to_vec()
                }
                Home::State(i) => match states {
                    Some(states) => states[i].clone(),
                    None => continue,
                },
                Home::Mask(i) => mask_row(job.masks, layer, i, (b, t))?,
                _ => continue,
            };
            store[v.index()] = Some(leaf);
        }
        Ok(())
    };

    // Before the loop: every row of every sequence.
    let mut pre: HashMap<(usize, usize), Store> = HashMap::new();
    for b in 0..batch {
        for t in 0..job.order.lengths()[b] {
            // No states here: a before-loop stage that reads one is a schedule error.
            let mut store = base.clone();
            fill(&mut store, b, t, None)?;
            forward_stages.run_all(&pass.before_loop, stages, &mut store, job.params)?;
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
    let each_step = pass.stages_at(Placement::EachStep);
    for s in 0..job.order.steps() {
        let active = job.order.active(s);
        let mut rows: Vec<Store> = Vec::with_capacity(active.len());
        for &b in active {
            let t = job.order.time(b, s, job.reverse);
            let mut store = pre.remove(&(b, t)).unwrap_or_else(|| base.clone());
            fill(&mut store, b, t, Some(&states[b]))?;
            rows.push(store);
        }
        // Stage-major: each stage over every active row, then the next.
        for &k in each_step {
            for store in rows.iter_mut() {
                forward_stages.run(k, &stages[k], store, job.params)?;
            }
        }
        for (&b, store) in active.iter().zip(&rows) {
            let t = job.order.time(b, s, job.reverse);
            let get = |v: ValueId| {
                value(pass, store, job.params, v).map(<[f32]>::to_vec).ok_or_else(|| {
                    RuntimeError::Internal(format!(
                        "schedule: {v} (an output or next state) is never computed"
                    ))
                })
            };
            let out = get(pass
                .output
                .ok_or_else(|| RuntimeError::Internal("a forward without an output".into()))?)?;
            output.get_mut(b, t, layer.output_size).copy_from_slice(&out);
            let next: Vec<Vec<f32>> = pass
                .carried
                .iter()
                .map(|v| match v {
                    Some(v) => get(*v),
                    None => Err(RuntimeError::Internal("a next state that is never computed".into())),
                })
                .collect::<Result<_>>()?;
            if let Some(tape) = tape.as_deref_mut() {
                let row = job.input.layout.row(b, t);
                keep_row(pass, layer, tape, layout_rows, row, |source| match source {
                    TapeSource::StateBefore(i) => Ok(states[b][i].clone()),
                    TapeSource::Value(v) => get(v),
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

/// One layer and direction backwards, a row at a time, reading the forward's `tape`.
fn backward(
    job: &HostBackward,
    precision: Precision,
    tape: &[f32],
    d_input: &mut RowsMut,
) -> Result<HostGradients> {
    let tape = RowTape::new(job.layer, job.layout_rows(), tape)?;
    let g = &job.cell.backward.graph;
    let layer = job.layer;
    let pass = layer.pass(Side::Backward, true);
    let stages = &layer.schedule.backward;
    let batch = job.order.batch();
    let mut backward_stages = Stages::new(g, layer, pass, precision);
    let mut base: Store = vec![None; g.value_bound()];
    constants(g, &layer.backward_shapes, &mut base);

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
    let each_step = pass.stages_at(Placement::EachStep);
    for s in (0..job.order.steps()).rev() {
        let active = job.order.active(s);
        let mut rows: Vec<Store> = Vec::with_capacity(active.len());
        for &b in active {
            let t = job.order.time(b, s, job.reverse);
            let row = job.input.layout.row(b, t);
            let x = job.input.get(b, t, layer.input_size);
            let d_out = job.d_output.get(b, t, layer.output_size);
            let mut store = base.clone();
            // The leaves but the carried adjoints: before-loop stages
            // see none, so reading one is a schedule error.
            for (v, home) in pass.homes() {
                let leaf = match home {
                    Home::Input(i) => {
                        let (o, l) = layer.input_slices[i];
                        x[o..o + l].to_vec()
                    }
                    Home::Tape(kept) => tape.get(kept, row)?.to_vec(),
                    Home::StateBeforeFromTape(i) => match job.state_before((i, layer.state_sizes[i]), (b, t))
                    {
                        StateBefore::AfterRow(before) => tape.get(Kept::StateAfter(i), before)?.to_vec(),
                        StateBefore::Initial(initial) => initial.to_vec(),
                    },
                    Home::OutputAdjoint => d_out.to_vec(),
                    Home::Mask(i) => mask_row(job.masks, layer, i, (b, t))?,
                    _ => continue,
                };
                store[v.index()] = Some(leaf);
            }
            backward_stages.run_all(&pass.before_loop, stages, &mut store, job.params)?;
            for (v, home) in pass.homes() {
                if let Home::Carry(k) = home {
                    store[v.index()] = Some(carry[b][k].clone());
                }
            }
            rows.push(store);
        }
        for &k in each_step {
            for store in rows.iter_mut() {
                backward_stages.run(k, &stages[k], store, job.params)?;
            }
        }
        for (&b, store) in active.iter().zip(rows) {
            let t = job.order.time(b, s, job.reverse);
            carry[b] = pass
                .carried
                .iter()
                .zip(&layer.state_sizes)
                .map(|(d, &n)| match d {
                    Some(v) => value(pass, &store, job.params, *v).map(<[f32]>::to_vec).ok_or_else(|| {
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

    // After the loop, every row's contribution, summed over the rows.
    let mut d_params: Vec<Vec<f32>> = job.params.iter().map(|p| vec![0.0; p.len()]).collect();
    for ((b, t), store) in all_rows.iter_mut() {
        backward_stages.run_all(&pass.after_loop, stages, store, job.params)?;
        for (acc, d) in d_params.iter_mut().zip(&pass.d_params) {
            if let Some(d) = d {
                let v = d.value();
                let x = value(pass, store, job.params, v).ok_or_else(|| {
                    RuntimeError::Internal(format!("parameter adjoint {v} is never computed"))
                })?;
                acc.iter_mut().zip(x).for_each(|(a, x)| *a += x);
            }
        }
        let dx = d_input.get_mut(*b, *t, layer.input_size);
        for (d, &(o, l)) in pass.d_inputs.iter().zip(&layer.input_slices) {
            if let Some(v) = d {
                let x = value(pass, store, job.params, *v)
                    .ok_or_else(|| RuntimeError::Internal(format!("input adjoint {v} is never computed")))?;
                dx[o..o + l].iter_mut().zip(x).for_each(|(a, x)| *a += x);
            }
        }
    }
    let d_h0 = (0..layer.state_sizes.len())
        .map(|i| carry.iter().flat_map(|c| c[i].iter().copied()).collect())
        .collect();
    Ok(HostGradients { d_h0, d_params })
}
