//! Which per-step pointwise stages run on tiles of units, fused with the
//! products that feed them.
//!
//! A stage is *unit-local* in a size variable `S` when every vector it
//! touches is `k` blocks of `S` (`[S]`, `[4*S]`) and unit `u` of each
//! result reads only unit `u` of each block of its operands: elementwise
//! ops, scalars broadcast, `chunk` and slices at whole blocks, concats of
//! whole blocks; no reduction over units and no size of `S` read as a
//! number. Such a stage computes any range of units on its own, given the
//! same range of every block of its inputs: the same kernel, planned at
//! `S = w`, runs on a *tile* of `w` units.
//!
//! A tile's inputs are contiguous when every vector of more than one block
//! is held in *tile order*: the units of tile `j` (all `k` blocks of them)
//! side by side, tile after tile. A vector the stage reads in tile order is
//! a product of a parameter (its weight's rows permuted once, when it is
//! packed: the results are the same numbers in other places) or a vector
//! parameter (permuted once); what the stage writes for others is one
//! block, whose tile order is its own order.
//!
//! A [`Fusion`] pairs such a stage with the per-step products just before
//! it when nothing else reads them: a thread that owns a range of units
//! computes their columns of the products and then the stage on them,
//! while they are in its cache, and needs no other thread's results until
//! the next step's products. Every number is the one the unfused step
//! computes: a product's column is the same sum wherever it is stored, and
//! the stage's ops are elementwise.
//!
//! A GEMM stage hoisted before the loop that may run in the step
//! ([`super::sink`]) and whose products only the fused stage reads may run
//! with it, tile by tile, as [`Fusion::hoisted`] records.
//!
//! The backward step splits by units the same way, in a form of its own
//! ([`UnitSplit`]): its pointwise stages are unit-local, and each of its
//! products of a parameter gives one block of the unit (`Wᵀ · dgates`, the
//! state's adjoint). A thread that owns a range of units computes those
//! units of every stage: its columns of the products, from every unit of
//! their operands once the threads have met, and the kernels on its units,
//! reading its own columns of the products. The threads meet before each
//! product that reads what the step computed, and at the step's end; not
//! between a product and the kernel that reads it.

use super::{Placement, Stage, StageKind};
use crate::dims::{Bindings, Dim};
use crate::ir::{Graph, Op, Type, ValueId};
use std::collections::{BTreeMap, HashSet};

/// A per-step pointwise stage run on tiles of units, fused with the
/// per-step products before it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fusion {
    /// The index of the per-step GEMM stage whose products the stage reads.
    pub gemm: usize,
    /// The index of the pointwise stage.
    pub pointwise: usize,
    /// The size variable whose units the tiles split.
    pub unit: String,
    /// Blocks of `unit` in each vector the stage reads, computes or writes.
    pub blocks: BTreeMap<ValueId, usize>,
    /// The vectors of more than one block held in tile order: the products
    /// the stage reads (per step or before the loop) and vector parameters.
    pub tile_ordered: Vec<ValueId>,
    /// The GEMM stages before the loop that may instead run in the step
    /// ([`super::sink`]) with the fused ones, tile by tile: their products
    /// are of one head and only the stage reads them.
    pub hoisted: Vec<usize>,
}

impl Fusion {
    /// Blocks of the unit in `v` (1 for a value the stage does not touch).
    pub fn blocks_of(&self, v: ValueId) -> usize {
        self.blocks.get(&v).copied().unwrap_or(1)
    }

    /// Whether `v` is held in tile order (a product's output or a vector parameter).
    pub fn is_tile_ordered(&self, v: ValueId) -> bool {
        self.tile_ordered.contains(&v)
    }

    /// The sizes at which the stage's kernel runs one tile of `width` units.
    pub fn tile_sizes(&self, sizes: &Bindings, width: usize) -> Bindings {
        sizes_on_units(sizes, &self.unit, width)
    }
}

/// Where element `(block g, unit u)` of a vector of `blocks` blocks of
/// `units` units lies in tile order, tiles of `width` units (the last may be
/// narrower): tile `u / width`'s `blocks * width` floats start at
/// `blocks * width * (u / width)`, block by block.
pub fn tile_position(blocks: usize, units: usize, width: usize, (g, u): (usize, usize)) -> usize {
    let tile = u / width;
    let first = tile * width;
    let this_width = width.min(units - first);
    blocks * first + g * this_width + (u - first)
}

/// The fusions of a forward step's `stages`: each per-step pointwise stage
/// that is unit-local and reads, besides vectors of one block, only
/// products of parameters and vector parameters, paired with the per-step
/// GEMM stage just before it when only that stage reads its products.
/// `roots` are the values read from outside the step (the output, next
/// states and values saved for the backward); `sinkable` the stages before
/// the loop that may run in the step.
pub fn fusions(g: &Graph, stages: &[Stage], roots: &HashSet<ValueId>, sinkable: &[usize]) -> Vec<Fusion> {
    (1..stages.len()).filter_map(|p| fusion(g, stages, p, (roots, sinkable))).collect()
}

fn fusion(
    g: &Graph,
    stages: &[Stage],
    p: usize,
    (roots, sinkable): (&HashSet<ValueId>, &[usize]),
) -> Option<Fusion> {
    let (gemm, st) = (&stages[p - 1], &stages[p]);
    let each_step = |s: &Stage| s.placement == Placement::EachStep;
    if !(each_step(gemm) && gemm.kind == StageKind::Gemm && each_step(st)) {
        return None;
    }
    if st.kind != (StageKind::Pointwise { reductions: false }) {
        return None;
    }
    let (unit, blocks) = unit_local(g, st)?;
    let inside: HashSet<ValueId> = st.values.iter().copied().collect();
    let only_here = |v: ValueId| !roots.contains(&v) && g.users(v).iter().all(|u| inside.contains(u));
    // The per-step products: each of a plain parameter matrix, each read by this stage alone.
    if !gemm.values.iter().all(|&v| weight_product(g, v) && only_here(v) && blocks.contains_key(&v)) {
        return None;
    }
    let mut tile_ordered = Vec::new();
    for &v in &st.inputs {
        let k = blocks.get(&v).copied().unwrap_or(1);
        if k == 1 {
            continue;
        }
        let from_products = stages.iter().any(|s| {
            s.kind == StageKind::Gemm && s.placement != Placement::AfterLoop && s.values.contains(&v)
        });
        let ok = match g.node(v).op {
            Op::Param(_) => true,
            _ => from_products && weight_product(g, v) && only_here(v),
        };
        if !ok {
            return None;
        }
        tile_ordered.push(v);
    }
    // What the stage writes for others is one block (its own tile order).
    if st.outputs.iter().any(|v| blocks.get(v).copied().unwrap_or(1) != 1) {
        return None;
    }
    let hoisted = (sinkable.iter().copied())
        .filter(|&k| {
            let values = &stages[k].values;
            values.iter().all(|&v| weight_product(g, v) && only_here(v) && blocks.contains_key(&v))
        })
        .collect();
    Some(Fusion { gemm: p - 1, pointwise: p, unit, blocks, tile_ordered, hoisted })
}

/// A backward step whose per-step stages each thread runs on its own
/// units (see the module's doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitSplit {
    /// The per-step stages, in order: unit-local pointwise stages and
    /// GEMM stages whose products give one block of the unit each.
    pub stages: Vec<usize>,
    /// The size variable whose units the threads split.
    pub unit: String,
    /// Blocks of `unit` in each vector the pointwise stages read, compute
    /// or write, and in each product.
    pub blocks: BTreeMap<ValueId, usize>,
}

impl UnitSplit {
    /// Blocks of the unit in `v` (0 for a value that is not a vector of the unit: a scalar).
    pub fn blocks_of(&self, v: ValueId) -> usize {
        self.blocks.get(&v).copied().unwrap_or(0)
    }
}

/// `sizes` with `unit` bound to `width`: those at which a kernel planned
/// for `width` of the unit's units runs (a tile, a thread's share).
pub fn sizes_on_units(sizes: &Bindings, unit: &str, width: usize) -> Bindings {
    let mut at = sizes.clone();
    at.insert(unit.to_string(), width);
    at
}

/// The backward step's split by units, if every per-step stage of
/// `stages` allows it: each pointwise stage unit-local (no reduction over
/// units) in one unit variable, each GEMM stage's products `W @ x` or
/// `Wᵀ @ x` of a parameter of one head giving one block of that unit, at
/// least one of each.
pub fn unit_split(g: &Graph, stages: &[Stage]) -> Option<UnitSplit> {
    let each_step: Vec<usize> =
        (0..stages.len()).filter(|&k| stages[k].placement == Placement::EachStep).collect();
    let mut unit: Option<String> = None;
    let mut blocks = BTreeMap::new();
    let (mut kernels, mut products) = (0, 0);
    for &k in &each_step {
        let st = &stages[k];
        match st.kind {
            StageKind::Pointwise { reductions: false } => {
                let (u, b) = unit_local(g, st)?;
                if unit.get_or_insert_with(|| u.clone()) != &u {
                    return None;
                }
                blocks.extend(b);
                kernels += 1;
            }
            StageKind::Gemm => products += 1,
            _ => return None,
        }
    }
    let unit = unit?;
    for &k in &each_step {
        if stages[k].kind != StageKind::Gemm {
            continue;
        }
        for &v in &stages[k].values {
            let one_block = g.ty(v).vector_dim().and_then(|d| blocks_of(d, &unit)) == Some(1);
            if !(one_block && param_product(g, v, &[Op::MatVec, Op::MatVecT])) {
                return None;
            }
            if blocks.insert(v, 1).is_some_and(|k| k != 1) {
                return None;
            }
        }
    }
    (kernels > 0 && products > 0).then_some(UnitSplit { stages: each_step, unit, blocks })
}

/// `W @ x` with `W` a parameter of one head.
fn weight_product(g: &Graph, v: ValueId) -> bool {
    param_product(g, v, &[Op::MatVec])
}

/// A product of `ops` whose matrix is a parameter of one head.
fn param_product(g: &Graph, v: ValueId, ops: &[Op]) -> bool {
    let operands = g.operands(v);
    ops.contains(&g.node(v).op)
        && operands.first().is_some_and(|&w| {
            matches!(g.node(w).op, Op::Param(_))
                && matches!(g.ty(w), Type::Matrix(heads, _, _) if heads.as_constant() == Some(1))
        })
}

/// The unit variable and each vector's blocks of it, if `st` is unit-local
/// (see the module's doc).
fn unit_local(g: &Graph, st: &Stage) -> Option<(String, BTreeMap<ValueId, usize>)> {
    let vectors = || st.inputs.iter().chain(&st.values).filter_map(|&v| g.ty(v).vector_dim().map(|d| (v, d)));
    let (_, first) = vectors().next()?;
    let [unit] = &first.variables()[..] else { return None };
    let mut blocks = BTreeMap::new();
    for (v, d) in vectors() {
        blocks.insert(v, blocks_of(d, unit)?);
    }
    let k = |v: ValueId| blocks.get(&v).copied();
    for &v in &st.values {
        let ops = g.operands(v);
        let fits = match &g.node(v).op {
            Op::Unary(_) | Op::Binary(_) | Op::Select | Op::Broadcast | Op::Const(_) => true,
            Op::DimValue(d) => !d.variables().contains(unit),
            Op::Slice { offset } | Op::Pad { offset } => {
                let (inner, outer) = match g.node(v).op {
                    Op::Slice { .. } => (k(v), ops.first().and_then(|&o| k(o))),
                    _ => (ops.first().and_then(|&o| k(o)), k(v)),
                };
                match (whole_blocks(offset, unit), inner, outer) {
                    (Some(at), Some(inner), Some(outer)) => at + inner <= outer,
                    _ => false,
                }
            }
            Op::Concat => ops.iter().map(|&o| k(o)).sum::<Option<usize>>() == k(v),
            _ => false,
        };
        if !fits {
            return None;
        }
    }
    Some((unit.clone(), blocks))
}

/// `k` if `d` is `k * unit`, `k >= 1`.
fn blocks_of(d: &Dim, unit: &str) -> Option<usize> {
    let k = d.eval(&Bindings::from([(unit.to_string(), 1)])).ok()?;
    let k = usize::try_from(k).ok().filter(|&k| k >= 1)?;
    (Dim::var(unit).checked_scale(k as i64)? == *d).then_some(k)
}

/// `j` if `offset` is `j * unit`, `j >= 0`.
fn whole_blocks(offset: &Dim, unit: &str) -> Option<usize> {
    if offset.is_zero() {
        return Some(0);
    }
    blocks_of(offset, unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forward(src: &str) -> (crate::ir::Cell, super::super::Schedule) {
        let module = crate::compile("t.cell", src).into_result().expect("compiles");
        let steps = crate::program::Steps::compile(&module.cells[0]).expect("verifies");
        let schedule = steps.schedule(&Bindings::new());
        (steps.forward, schedule)
    }

    #[test]
    fn tile_order_puts_each_tiles_blocks_side_by_side() {
        // 2 blocks of 5 units, tiles of 2: [b0 u0 u1, b1 u0 u1][b0 u2 u3, b1 u2 u3][b0 u4, b1 u4].
        let order: Vec<usize> =
            (0..2).flat_map(|g| (0..5).map(move |u| tile_position(2, 5, 2, (g, u)))).collect();
        assert_eq!(order, vec![0, 1, 4, 5, 8, 2, 3, 6, 7, 9]);
    }

    #[test]
    fn the_lstm_fuses_its_step_with_gates_in_tile_order() {
        let src = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../cells/lstm.cell"))
            .expect("lstm.cell");
        let (cell, schedule) = forward(&src);
        let [f] = &schedule.fusion[..] else { panic!("one fusion: {:?}", schedule.fusion) };
        assert_eq!((f.gemm, f.pointwise, f.unit.as_str()), (1, 2, "H"));
        // The input projection may run in the step.
        assert_eq!(f.hoisted, vec![0]);
        // Both products of the gates (per step and before the loop) and both biases.
        assert_eq!(f.tile_ordered.len(), 4, "{f:?}");
        for &v in &f.tile_ordered {
            assert_eq!(f.blocks_of(v), 4);
            assert!(matches!(cell.node(v).op, Op::MatVec | Op::Param(_)));
        }
    }

    #[test]
    fn the_lstm_backward_splits_by_units() {
        let src = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../cells/lstm.cell"))
            .expect("lstm.cell");
        let (_, schedule) = forward(&src);
        let split = schedule.backward_units.expect("the backward splits");
        // The gates' adjoint, then `weight_hhᵀ @` it: the state's adjoint, one block.
        assert_eq!((split.stages.as_slice(), split.unit.as_str()), (&[0, 1][..], "H"));
        let products = &schedule.backward[1].values;
        assert!(products.iter().all(|&v| split.blocks_of(v) == 1), "{split:?}");
        assert!(schedule.backward[0].outputs.iter().any(|&v| split.blocks_of(v) == 4));
    }

    #[test]
    fn a_backward_with_a_reduction_over_units_or_a_wide_product_does_not_split() {
        let ln = "cell t { input x[H] state h[H] param W[H, H]
            let a = W @ h + x
            h' = tanh(a - mean(a))
            output h' }";
        assert!(forward(ln).1.backward_units.is_none());
        // The state is two blocks: its adjoint's product gives two blocks.
        let wide = "cell t { input x[H] state h[2*H] param W[4*H, 2*H]
            let p, q = chunk(W @ h, 2)
            h' = tanh(p) * sigmoid(q) + concat(x, x)
            output h' }";
        assert!(forward(wide).1.backward_units.is_none());
    }

    #[test]
    fn reductions_over_units_do_not_fuse() {
        let ln = "cell t { input x[H] state h[H] param W[H, H]
            let a = W @ h + x
            h' = (a - mean(a)) * 0.5
            output h' }";
        assert!(forward(ln).1.fusion.is_empty());
    }

    #[test]
    fn a_product_read_after_the_stage_or_a_state_of_several_blocks_does_not_fuse() {
        // The product is also the output: read outside the stage.
        let out = "cell t { input x[H] state h[H] param W[H, H]
            let a = W @ h
            h' = tanh(a + x)
            output a }";
        assert!(forward(out).1.fusion.is_empty());
        // A state of two blocks is read in its own order, not in tile order.
        let wide = "cell t { input x[H] state h[H], m[2*H] param W[2*H, H]
            let a = W @ h + m
            let p, q = chunk(a, 2)
            h' = tanh(p + q + x)
            m' = a
            output h' }";
        assert!(forward(wide).1.fusion.is_empty());
    }

    #[test]
    fn chunks_fuse_and_vectors_of_two_sizes_do_not() {
        let chunks = "cell t { input x[H] state h[H] param W[3*H, H]
            let a, b, c = chunk(W @ h, 3)
            h' = tanh(b + x) * sigmoid(a) + c
            output h' }";
        assert_eq!(forward(chunks).1.fusion.len(), 1);
        let mixed = "cell t { input x[I] state h[H] param W[H, H], U[H, I]
            h' = tanh(W @ h + U @ x)
            output concat(h', x) }";
        assert!(forward(mixed).1.fusion.is_empty());
    }
}
