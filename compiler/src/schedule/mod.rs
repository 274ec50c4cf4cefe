//! Scheduling: how a step becomes kernels, in the structure fused RNN
//! libraries use (cuDNN, oneDNN, haste).
//!
//! The forward step splits into
//! - **hoisted GEMMs**: matrix products whose vector depends only on inputs
//!   and parameters, done once for the whole sequence as one GEMM over all
//!   time steps (before the loop);
//! - **per-step GEMMs**: products of state-dependent vectors;
//! - **fused pointwise kernels** between them (row reductions such as
//!   LayerNorm's `mean` included), one kernel per group.
//!
//! Stages are found by *level*: a per-step value's level is the number of
//! per-step GEMMs on its longest path from the step's start. Pointwise
//! values of level k form one kernel, run after the GEMMs of level k; so a
//! cell is a sequence of stages, not a fixed template (MGU's `U @ (f * h)`
//! gives pointwise, GEMM, pointwise; LSTMP's projection puts a GEMM after
//! the cell update). A cell with no per-step GEMM has an elementwise
//! recurrence and runs as **one whole-sequence kernel** looping over time.
//!
//! The backward step is staged the same way in reverse time, with the
//! recurrence carried by the next states' adjoints. Its products that do
//! not feed that carry — weight gradients `Σ_t dy_t ⊗ x_t`, input gradients
//! `Wᵀ dy_t` — move after the loop as one GEMM over all steps, and vector
//! parameters' gradients become one sum over steps.

mod print;
pub mod saved;
pub mod sink;
pub mod tiles;

pub use print::to_text;
pub use saved::{choose_saved, SavedValues};
pub use tiles::{Fusion, UnitSplit};

use crate::autodiff::Gradient;
use crate::dims::{Bindings, Dim};
use crate::ir::{Cell, Graph, Op, Type, ValueId};
use std::collections::{BTreeMap, HashMap, HashSet};

/// When a stage runs relative to the time loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Placement {
    /// Once, over all time steps, before the loop.
    BeforeLoop,
    /// Once per time step (in reverse time for the backward step).
    EachStep,
    /// Once, over all time steps, after the loop.
    AfterLoop,
}

/// What a stage computes, and so which kind of call runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StageKind {
    /// Matrix products sharing one operand: one GEMM.
    Gemm,
    /// Fused elementwise work, with row reductions if `reductions`.
    Pointwise {
        /// Whether the stage has a row reduction (`sum`, `mean`).
        reductions: bool,
    },
    /// The whole recurrence in one kernel that loops over time inside.
    WholeSequence {
        /// Whether the stage has a row reduction (`sum`, `mean`).
        reductions: bool,
    },
    /// Vector parameters' gradients: sums over all steps.
    SumOverSteps,
    /// Sums of weight-gradient matrices (a parameter used by several
    /// products), once after the loop: `values` are matrix `add`s.
    AddMatrices,
}

impl StageKind {
    /// Whether the stage is a generated kernel (pointwise or whole-sequence)
    /// rather than a GEMM or a sum the runtime does itself.
    pub fn is_kernel(self) -> bool {
        matches!(self, StageKind::Pointwise { .. } | StageKind::WholeSequence { .. })
    }
}

/// One kernel (or one GEMM call) of the schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Stage {
    /// What the stage is: a GEMM, a fused kernel, or a sum.
    pub kind: StageKind,
    /// When it runs relative to the time loop.
    pub placement: Placement,
    /// The values it computes, in topological order.
    pub values: Vec<ValueId>,
    /// Values it reads that other stages or leaves provide.
    pub inputs: Vec<ValueId>,
    /// Values it computes that something outside reads.
    pub outputs: Vec<ValueId>,
}

/// The full plan for a cell: forward and backward stages and saved values.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// The cell's name.
    pub cell: String,
    /// The forward step's stages, in execution order.
    pub forward: Vec<Stage>,
    /// The backward step's stages, in execution order (the per-step ones
    /// run in reverse time).
    pub backward: Vec<Stage>,
    /// No per-step GEMM: the forward step runs as one whole-sequence kernel.
    pub elementwise_recurrence: bool,
    /// Which forward values the backward reads from memory and which it recomputes.
    pub saved: SavedValues,
    /// Elements saved per step per sequence (besides the state history).
    pub saved_elements: Dim,
    /// Elements of the state history per step per sequence.
    pub state_elements: Dim,
    /// The forward step's per-step pointwise stages that run on tiles of
    /// units, fused with the products before them ([`tiles`]).
    pub fusion: Vec<Fusion>,
    /// The forward's GEMM stages before the loop that may run in the step
    /// instead ([`sink`]).
    pub sinkable: Vec<usize>,
    /// The backward step's stages, if each thread may run them on its own
    /// units ([`tiles::UnitSplit`]).
    pub backward_units: Option<UnitSplit>,
}

impl Schedule {
    /// Bytes saved for the backward per step per sequence in f32, at `sizes`
    /// (the state history excluded); `None` if a size is unbound.
    pub fn saved_bytes(&self, sizes: &Bindings) -> Option<u64> {
        self.saved_elements.eval(sizes).ok().map(|n| 4 * n.max(0) as u64)
    }
}

/// Plans `cell` (simplified) with its backward step `grad`; `sizes` weigh
/// the saved-values choice.
pub fn schedule(cell: &Cell, grad: &Gradient, sizes: &Bindings) -> Schedule {
    let saved = choose_saved(grad, sizes);
    let mut roots: Vec<ValueId> = cell.next_states.clone();
    roots.push(cell.output);
    let saved_here: Vec<ValueId> = saved.saved.iter().copied().filter(|v| cell.contains(*v)).collect();
    roots.extend(&saved_here);
    let forward = stage_forward(cell, &roots);
    let roots: HashSet<ValueId> = roots.into_iter().collect();
    let sinkable = sink::sinkable(cell, &forward, &roots);
    let fusion = tiles::fusions(cell, &forward, &roots, &sinkable);
    let elementwise_recurrence =
        !forward.iter().any(|s| s.placement == Placement::EachStep && s.kind == StageKind::Gemm);
    let backward = stage_backward(grad, &saved);
    let backward_units = tiles::unit_split(&grad.graph, &backward);
    let total = |vals: &[ValueId], g: &Graph| {
        vals.iter().fold(Dim::default(), |acc, v| match g.ty(*v) {
            Type::Vector(d) => acc.checked_add(d).unwrap_or(acc),
            _ => acc.checked_add(&Dim::constant(1)).unwrap_or(acc),
        })
    };
    let state_elements =
        cell.states.iter().fold(Dim::default(), |acc, s| acc.checked_add(&s.dim).unwrap_or(acc));
    Schedule {
        cell: cell.name.clone(),
        saved_elements: total(&saved.saved, &grad.graph),
        forward,
        backward,
        elementwise_recurrence,
        saved,
        state_elements,
        fusion,
        sinkable,
        backward_units,
    }
}

fn is_leaf(g: &Graph, v: ValueId) -> bool {
    g.operands(v).is_empty()
}

fn is_product(g: &Graph, v: ValueId) -> bool {
    matches!(g.node(v).op, Op::MatVec | Op::MatVecT | Op::Outer)
}

fn has_reduction(g: &Graph, values: &[ValueId]) -> bool {
    values.iter().any(|v| matches!(g.node(*v).op, Op::Reduce(_)))
}

/// Values depending on any of `sources`.
fn depends_on(g: &Graph, order: &[ValueId], sources: &dyn Fn(&Op) -> bool) -> HashSet<ValueId> {
    let mut out = HashSet::new();
    for &v in order {
        if sources(&g.node(v).op) || g.operands(v).iter().any(|o| out.contains(o)) {
            out.insert(v);
        }
    }
    out
}

/// Levels of the per-step values: GEMMs add one; pointwise values take their
/// operands' maximum. Values in `per_step` only; others count as level 0.
fn levels(
    g: &Graph,
    order: &[ValueId],
    per_step: &HashSet<ValueId>,
    gemm: &dyn Fn(ValueId) -> bool,
) -> HashMap<ValueId, usize> {
    let mut level = HashMap::new();
    for &v in order {
        if !per_step.contains(&v) {
            continue;
        }
        let from_operands = g.operands(v).iter().filter_map(|o| level.get(o).copied()).max().unwrap_or(0);
        level.insert(v, if gemm(v) { from_operands + 1 } else { from_operands });
    }
    level
}

/// Gives each floating value (computed per step but not tied to the
/// recurrence) the level of its earliest consumer, so it fuses into that kernel.
fn place_floating(
    g: &Graph,
    order: &[ValueId],
    floating: &HashSet<ValueId>,
    level: &mut HashMap<ValueId, usize>,
) {
    for &v in order.iter().rev() {
        if !floating.contains(&v) {
            continue;
        }
        let at = g
            .users(v)
            .iter()
            .filter_map(|u| level.get(u).map(|&l| if is_product(g, *u) { l.saturating_sub(1) } else { l }))
            .min()
            .unwrap_or(0);
        level.insert(v, at);
    }
}

/// Moves each per-step pointwise value to the latest level its users allow
/// (a product's operand to the level before the product's), so that work
/// which feeds no product of its own level joins the kernel that reads it
/// instead of making a kernel of its own: the sLSTM's `where(n == 0, ...)`
/// reads only a state, and would otherwise run as a kernel before the
/// step's GEMM. A value nothing in the step reads keeps its level.
fn defer_to_users(
    g: &Graph,
    order: &[ValueId],
    movable: &dyn Fn(ValueId) -> bool,
    level: &mut HashMap<ValueId, usize>,
) {
    for &v in order.iter().rev() {
        let Some(&at) = level.get(&v) else { continue };
        if !movable(v) || is_product(g, v) {
            continue;
        }
        let latest = g
            .users(v)
            .iter()
            .filter_map(|u| level.get(u).map(|&l| if is_product(g, *u) { l.saturating_sub(1) } else { l }))
            .min();
        if let Some(latest) = latest.filter(|&l| l > at) {
            level.insert(v, latest);
        }
    }
}

/// Inputs and outputs of a stage; `roots` are read from outside the graph.
fn make_stage(
    g: &Graph,
    kind: StageKind,
    placement: Placement,
    values: Vec<ValueId>,
    roots: &HashSet<ValueId>,
) -> Stage {
    let inside: HashSet<ValueId> = values.iter().copied().collect();
    let mut inputs = Vec::new();
    let mut outputs = Vec::new();
    for &v in &values {
        for o in g.operands(v) {
            if !inside.contains(&o) && !inputs.contains(&o) {
                inputs.push(o);
            }
        }
        if roots.contains(&v) || g.users(v).iter().any(|u| !inside.contains(u)) {
            outputs.push(v);
        }
    }
    Stage { kind, placement, values, inputs, outputs }
}

/// Stages for work done once over all steps (before or after the loop):
/// by level (the products on a value's longest path), the GEMMs of level
/// `k` and then the pointwise kernel of level `k`, so a product of a
/// product's pointwise function (`W2 @ tanh(W1 @ x)`) runs in order.
fn stages_by_level(
    g: &Graph,
    order: &[ValueId],
    members: &HashSet<ValueId>,
    placement: Placement,
    roots: &HashSet<ValueId>,
) -> Vec<Stage> {
    let level = levels(g, order, members, &|v| is_product(g, v));
    let max = level.values().copied().max().unwrap_or(0);
    let mut stages = Vec::new();
    for k in 0..=max {
        let at = |v: &ValueId| level.get(v) == Some(&k);
        let gemms: Vec<ValueId> = order.iter().copied().filter(|v| is_product(g, *v) && at(v)).collect();
        stages.extend(gemm_stages(g, &gemms, placement, roots));
        let (matrices, pw): (Vec<ValueId>, Vec<ValueId>) = order
            .iter()
            .copied()
            .filter(|v| !is_product(g, *v) && at(v))
            .partition(|v| matches!(g.ty(*v), Type::Matrix(..)));
        if !pw.is_empty() {
            let kind = StageKind::Pointwise { reductions: has_reduction(g, &pw) };
            stages.push(make_stage(g, kind, placement, pw, roots));
        }
        if !matrices.is_empty() {
            stages.push(make_stage(g, StageKind::AddMatrices, placement, matrices, roots));
        }
    }
    stages
}

/// Groups products by their shared operand (one GEMM per group).
fn gemm_stages(
    g: &Graph,
    products: &[ValueId],
    placement: Placement,
    roots: &HashSet<ValueId>,
) -> Vec<Stage> {
    let mut groups: BTreeMap<(String, ValueId), Vec<ValueId>> = BTreeMap::new();
    for &v in products {
        let ops = g.operands(v);
        // matvec/matvect share the vector (one GEMM with stacked weights);
        // outer products share their left vector (dY stacked over steps).
        let key = match g.node(v).op {
            Op::Outer => ("outer".to_string(), ops[0]),
            ref op => (op.mnemonic().to_string(), ops[1]),
        };
        groups.entry(key).or_default().push(v);
    }
    groups.into_values().map(|vals| make_stage(g, StageKind::Gemm, placement, vals, roots)).collect()
}

/// The stages run each step, level by level: the GEMMs of level k, then
/// one pointwise kernel for level k. Without per-step GEMMs, the pointwise
/// work is one whole-sequence kernel.
fn per_step_stages(
    g: &Graph,
    order: &[ValueId],
    level: &HashMap<ValueId, usize>,
    gemm_member: &dyn Fn(ValueId) -> bool,
    pw_member: &dyn Fn(ValueId) -> bool,
    roots: &HashSet<ValueId>,
) -> Vec<Stage> {
    let mut stages = Vec::new();
    let max_level = level.values().copied().max().unwrap_or(0);
    let step_gemms = order.iter().any(|&v| gemm_member(v));
    for k in 0..=max_level {
        let at = |v: &ValueId| level.get(v) == Some(&k);
        let gemms: Vec<ValueId> = order.iter().copied().filter(|v| gemm_member(*v) && at(v)).collect();
        stages.extend(gemm_stages(g, &gemms, Placement::EachStep, roots));
        let pw: Vec<ValueId> = order.iter().copied().filter(|v| pw_member(*v) && at(v)).collect();
        if !pw.is_empty() {
            let reductions = has_reduction(g, &pw);
            let kind = if step_gemms {
                StageKind::Pointwise { reductions }
            } else {
                StageKind::WholeSequence { reductions }
            };
            stages.push(make_stage(g, kind, Placement::EachStep, pw, roots));
        }
    }
    stages
}

fn stage_forward(cell: &Cell, roots: &[ValueId]) -> Vec<Stage> {
    let g: &Graph = cell;
    let roots: HashSet<ValueId> = roots.iter().copied().collect();
    let order = g.topo_order().unwrap_or_default();
    let dynamic = depends_on(g, &order, &|op| matches!(op, Op::State(_)));
    let computed: Vec<ValueId> = order.iter().copied().filter(|&v| !is_leaf(g, v)).collect();

    // Static values feeding a hoisted product are computed before the loop.
    let hoisted: Vec<ValueId> =
        computed.iter().copied().filter(|&v| !dynamic.contains(&v) && is_product(g, v)).collect();
    let mut before_loop: HashSet<ValueId> = HashSet::new();
    let mut stack: Vec<ValueId> = hoisted.iter().flat_map(|&v| g.operands(v)).collect();
    while let Some(v) = stack.pop() {
        // A static product is hoisted itself; its operands are walked from there.
        if !is_leaf(g, v) && !dynamic.contains(&v) && !is_product(g, v) && before_loop.insert(v) {
            stack.extend(g.operands(v));
        }
    }
    let per_step: HashSet<ValueId> = computed.iter().copied().filter(|v| dynamic.contains(v)).collect();
    let mut level = levels(g, &order, &per_step, &|v| is_product(g, v));
    let floating: HashSet<ValueId> = computed
        .iter()
        .copied()
        .filter(|v| !dynamic.contains(v) && !is_product(g, *v) && !before_loop.contains(v))
        .collect();
    // Per-step work as late as its users allow, then the floating values
    // (which only per-step values read) with their earliest reader.
    defer_to_users(g, &order, &|v| per_step.contains(&v), &mut level);
    place_floating(g, &order, &floating, &mut level);

    let pre: HashSet<ValueId> = before_loop.iter().chain(&hoisted).copied().collect();
    let mut stages = stages_by_level(g, &order, &pre, Placement::BeforeLoop, &roots);

    let gemm_member = |v: ValueId| per_step.contains(&v) && is_product(g, v);
    let pw_member = |v: ValueId| !is_product(g, v) && !before_loop.contains(&v);
    stages.extend(per_step_stages(g, &computed, &level, &gemm_member, &pw_member, &roots));
    stages
}

fn stage_backward(grad: &Gradient, saved: &SavedValues) -> Vec<Stage> {
    let g = &grad.graph;
    let order = g.topo_order().unwrap_or_default();
    let results: HashSet<ValueId> = grad.results().into_iter().collect();
    let backward = saved::backward_values(g);
    let recomputed: HashSet<ValueId> = saved.recomputed.iter().copied().filter(|v| !is_leaf(g, *v)).collect();

    // The carry: values the next (earlier) step's adjoints depend on.
    let mut carry: HashSet<ValueId> = HashSet::new();
    let mut stack: Vec<ValueId> = grad.d_states.iter().flatten().copied().collect();
    while let Some(v) = stack.pop() {
        if backward.contains(&v) && carry.insert(v) {
            stack.extend(g.operands(v));
        }
    }
    // Products off the carry run after the loop, over all steps at once,
    // and so does everything computed from them. They may read the
    // carried adjoints: the runtime keeps each step's for every row.
    let mut after_set: HashSet<ValueId> = HashSet::new();
    for &v in &order {
        let from_after = g.operands(v).iter().any(|o| after_set.contains(o));
        if backward.contains(&v) && !carry.contains(&v) && (is_product(g, v) || from_after) {
            after_set.insert(v);
        }
    }
    let after: Vec<ValueId> = order.iter().copied().filter(|v| after_set.contains(v)).collect();
    let in_loop: HashSet<ValueId> = order
        .iter()
        .copied()
        .filter(|v| backward.contains(v) && !is_leaf(g, *v) && !after_set.contains(v))
        .collect();
    // Products on the carry's path whose vector does not depend on the
    // carry (`vᵀ · dy` of an output `v @ h'`, a recomputed `U @ h`) run
    // before the loop, over all steps at once, with the static values
    // that feed them: a per-step product reads only values computed in
    // the step, so its rows are the step's active sequences.
    let carried = depends_on(g, &order, &|op| matches!(op, Op::Seed(k) if *k > 0));
    let hoisted: Vec<ValueId> = order
        .iter()
        .copied()
        .filter(|&v| in_loop.contains(&v) && is_product(g, v) && !carried.contains(&v))
        .collect();
    let mut before_loop: HashSet<ValueId> = HashSet::new();
    let mut stack: Vec<ValueId> = hoisted.iter().flat_map(|&v| g.operands(v)).collect();
    while let Some(v) = stack.pop() {
        let computed_here = in_loop.contains(&v) || recomputed.contains(&v);
        if computed_here && !carried.contains(&v) && !is_product(g, v) && before_loop.insert(v) {
            stack.extend(g.operands(v));
        }
    }
    let per_step: HashSet<ValueId> =
        in_loop.iter().copied().filter(|v| !before_loop.contains(v) && !hoisted.contains(v)).collect();
    let recomputed: HashSet<ValueId> = recomputed.difference(&before_loop).copied().collect();
    let mut level = levels(g, &order, &per_step, &|v| is_product(g, v));
    place_floating(g, &order, &recomputed, &mut level);

    // Vector parameters' gradients are summed over steps after the loop.
    let param_sums: Vec<ValueId> = grad
        .d_params
        .iter()
        .flatten()
        .copied()
        .filter(|v| per_step.contains(v) && !matches!(g.ty(*v), Type::Matrix(..)))
        .collect();
    let mut roots = results.clone();
    roots.extend(after.iter().flat_map(|&v| g.operands(v)));

    let gemm_member = |v: ValueId| per_step.contains(&v) && is_product(g, v);
    let pw_member = |v: ValueId| (per_step.contains(&v) || recomputed.contains(&v)) && !is_product(g, v);
    let pre: HashSet<ValueId> = before_loop.iter().chain(&hoisted).copied().collect();
    let mut stages = stages_by_level(g, &order, &pre, Placement::BeforeLoop, &roots);
    stages.extend(per_step_stages(g, &order, &level, &gemm_member, &pw_member, &roots));
    // After the loop: GEMMs and the pointwise work on their results, by level.
    stages.extend(stages_by_level(g, &order, &after_set, Placement::AfterLoop, &results));
    if !param_sums.is_empty() {
        let mut unique = param_sums;
        unique.sort();
        unique.dedup();
        let inputs = unique.clone();
        stages.push(Stage {
            kind: StageKind::SumOverSteps,
            placement: Placement::AfterLoop,
            values: Vec::new(),
            inputs,
            outputs: unique,
        });
    }
    stages
}
