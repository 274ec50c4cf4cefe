//! GEMM stages hoisted before the loop run in the step instead, on each
//! thread's own sequences ([`cellc::schedule::sink`] says which may).
//!
//! Before the loop, an input projection is one product over every row and
//! step (column-split between the threads), and its result, a row per
//! sequence and step, outgrows the caches: at B=64, H=512, T=100 an LSTM's
//! is 52 MB, which each step's pointwise stage reads back from memory. It
//! ran at 85-87% of the FMA peak where the per-step products run at 95%
//! (AMD Zen 5). Where each thread owns whole sequences, with rows enough
//! to reuse the weight ([`SINK_FROM_ROWS_PER_THREAD`]), the pass runs it in
//! each step instead, on the thread's rows: their input rows are gathered
//! rank by rank, and the result is read from the core's cache. A fused
//! step runs it tile by tile with the per-step products
//! ([`super::tiles`]). The results are the same bits: a product's row is
//! the same sum whichever rows are multiplied with it.

use super::buffers::{locate, Buffers, Frame};
use super::cache::stays_in_l2;
use super::stages::{weight_bytes, Product, ProductCall, ReadyStage};
use super::team::Team;
use crate::error::Result;
use crate::plan::{Home, PassPlan, TimeLoop};
use cellc::ir::ValueId;
use cellc::precision::Precision;
use cellc::shapes::Shapes;
use std::ops::Range;

/// Sequences a thread from which a pass whose threads own their sequences
/// runs the sinkable stages in the step (measured on an AMD Zen 5, 2
/// threads, LSTM H=256/512: at 4 a thread 0.97-1.03x the hoisted
/// product's time, from 8 1.05-1.10x faster; `benches/fused_step.py`).
pub const SINK_FROM_ROWS_PER_THREAD: usize = 8;

/// A step's sequence and time of rank `r`: `(b, t)`.
pub type RankRow<'a> = dyn Fn(usize) -> (usize, usize) + 'a;

/// The schedule's sinkable stages (`sinkable`) that a pass of `team` runs
/// in the step, with their products: the loop runs step by step (not one
/// whole-sequence kernel), each thread owns
/// [`SINK_FROM_ROWS_PER_THREAD`] sequences or more, and the stage is one
/// the plan runs before the loop with its products kept nowhere but in
/// their layout rows (not in the tape). None where the products at
/// `precision` are bound by streaming their weights
/// ([`super::product::bound_by_weights`]): in the step, every thread
/// streams the whole input weight at every step, where before the loop
/// each streams its share once. (bf16 on AMX, 2 threads, LSTM T=100: in
/// the step 0.74x at B=16 H=512, 0.91-0.92x at B=16 H=256 and B=64
/// H=512, 1.14x at B=64 H=256, alternating, on a Xeon.) None either where
/// they would push the step's own weights out of a core's L2
/// ([`evicts_resident_weights`]; `step_bytes`: the weights the step's own
/// products read, [`super::stages::step_weight_bytes`]). `shapes` are the
/// forward's.
pub fn stages_to_sink(
    team: &Team,
    sinkable: &[usize],
    (pass, precision, shapes): (&PassPlan, Precision, &Shapes),
    (stages, step_bytes): (&[ReadyStage], usize),
) -> Vec<(usize, Vec<Product>)> {
    let steps = matches!(pass.time_loop, TimeLoop::Steps(_));
    if !steps
        || !team.owns_rows()
        || team.order().len() < SINK_FROM_ROWS_PER_THREAD * team.threads
        || super::product::bound_by_weights(precision)
    {
        return Vec::new();
    }
    let chosen: Vec<(usize, Vec<Product>)> = (sinkable.iter())
        .filter(|k| pass.before_loop.contains(k))
        .filter_map(|&k| match &stages[k] {
            ReadyStage::Gemm { products }
                if products.iter().all(|p| matches!(pass.home(p.0), None | Some(Home::Layout))) =>
            {
                Some((k, products.clone()))
            }
            _ => None,
        })
        .collect();
    let sunk_bytes = weight_bytes(chosen.iter().flat_map(|(_, p)| p), (shapes, precision));
    if evicts_resident_weights(step_bytes, sunk_bytes, super::cache::l2_bytes()) {
        return Vec::new();
    }
    chosen
}

/// Whether the weights of the products sunk into the step (`sunk_bytes`),
/// which every thread that owns its rows streams at every step, would push
/// the step's own weights (`step_bytes`) out of a core's L2 (`l2`), where
/// they stay from step to step without them: half the L2, the rest being
/// the rows that the products and the pointwise stages read and write.
/// Then the step reads every weight from L3 instead, and its products
/// wait for it. On an Intel Xeon (2 MiB L2), 2 threads, T=100, the
/// projection kept before the loop against run in the step (per-round
/// minima, first quartile of 8-10 alternating rounds): LSTM H=256 (1 MiB
/// a weight) 1.20x at B=16, 1.16x at B=32, alike at B=64; GRU H=256 1.09x
/// and LayerNorm-LSTM 1.25x at B=16. Where the step's weights do not stay
/// in the L2 anyway (H=512, or H=256 on a 1 MiB L2 as on an AMD Zen 5),
/// running the projection in the step spares its result a trip through
/// memory (LSTM B=64 H=512 on that Xeon: 1.12x faster in the step).
pub fn evicts_resident_weights(step_bytes: usize, sunk_bytes: usize, l2: Option<usize>) -> bool {
    stays_in_l2(step_bytes, l2) == Some(true)
        && stays_in_l2(step_bytes.saturating_add(sunk_bytes), l2) == Some(false)
}

/// The products a pass runs in the step.
#[derive(Debug, Default)]
pub struct Sunk {
    pub products: Vec<Product>,
}

impl Sunk {
    /// The products of `stages` (from [`stages_to_sink`]).
    pub fn of(stages: &[(usize, Vec<Product>)]) -> Sunk {
        Sunk { products: stages.iter().flat_map(|(_, p)| p.iter().cloned()).collect() }
    }

    /// Each product on rank rows `rows` of a step, whose vectors' rows are
    /// gathered into `gathered` (one buffer a product, reused).
    pub fn locate(
        &self,
        (bufs, frame, shapes): (&Buffers, &Frame, &Shapes),
        rows: Range<usize>,
        step: &RankRow,
        gathered: &mut Vec<Vec<f32>>,
    ) -> Result<Vec<(ProductCall, ValueId)>> {
        gathered.resize(self.products.len(), Vec::new());
        let mut calls = Vec::with_capacity(self.products.len());
        for (p, rows_of_x) in self.products.iter().zip(gathered.iter_mut()) {
            let n = shapes.elements(p.3);
            rows_of_x.clear();
            for r in rows.clone() {
                let (b, t) = step(r);
                let x = locate(bufs, frame, p.3, b, t, r)?;
                // SAFETY: a located row holds its value's `n` floats.
                rows_of_x.extend_from_slice(unsafe { std::slice::from_raw_parts(x, n) });
            }
            let call = ProductCall::locate(p, bufs, frame, (0, 0, rows.start), rows.len(), 1, shapes)?;
            calls.push((call.with_left(rows_of_x.as_ptr(), n), p.0));
        }
        Ok(calls)
    }
}

#[cfg(test)]
mod tests {
    use super::evicts_resident_weights;

    const MIB: usize = 1 << 20;

    #[test]
    fn the_projection_stays_before_the_loop_only_where_it_would_evict_the_step_weights() {
        // An LSTM at H=256 in f32 (1 MiB a weight) on a 2 MiB L2: the step's weight stays
        // in the L2 alone, not beside the input weight.
        assert!(evicts_resident_weights(MIB, MIB, Some(2 * MIB)));
        // On a 1 MiB L2 it does not stay there anyway; at H=512 (4 MiB) nor on 2 MiB.
        assert!(!evicts_resident_weights(MIB, MIB, Some(MIB)));
        assert!(!evicts_resident_weights(4 * MIB, 4 * MIB, Some(2 * MIB)));
        // Both fit (H=128): nothing is evicted.
        assert!(!evicts_resident_weights(MIB / 4, MIB / 4, Some(2 * MIB)));
        // An unknown cache keeps the default.
        assert!(!evicts_resident_weights(MIB, MIB, None));
    }
}
