//! The fused step on the CPU: a per-step product and the pointwise stage
//! that reads it, run by each thread on its own tiles of units
//! ([`cellc::schedule::tiles`] decides which stages may).
//!
//! When the threads split a step's units (a batch too small for each to
//! own whole sequences), the unfused step meets at a barrier after the
//! products, runs the pointwise stage on a share of the rows, meets again,
//! then moves the states on. Fused, each thread computes its tiles'
//! columns of the products for every row, then the stage's kernel planned
//! for one tile on them while they are in its cache, then its units of the
//! outputs and states: one barrier a step, before the next step's
//! products, which read every unit. The products' weights are packed with
//! their rows in tile order, so a tile's columns of every gate are
//! contiguous ([`super::prepared::TileOrder`]); vector parameters the
//! stage reads are copied into the same order. Results are bitwise the
//! unfused step's.
//!
//! When each thread owns whole sequences, it never meets the others, and
//! fusing alone gains nothing measurable: such a pass fuses only where it
//! runs a hoisted input projection in the step ([`super::sink`]), which
//! then runs tile by tile with the per-step products ([`Fusion::hoisted`]),
//! so that both products' columns of a tile are in the core's cache when
//! the stage reads them.

use super::buffers::{locate, Buffers, Frame};
use super::prepared::{PreparedParams, TileOrder, TiledProducts};
use super::sink::{RankRow, Sunk};
use super::stage::{BuiltKernels, StageExec};
use super::stages::{Product, ProductCall};
use super::team::Team;
use crate::error::{Result, RuntimeError};
use cellc::ir::{Graph, Op, ValueId};
use cellc::schedule::Fusion;
use cellc::shapes::Shapes;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// Sequences a thread from which a step whose threads split units runs
/// unfused. Below one a thread, the unfused step runs its pointwise stage
/// on fewer threads than the products (a step of one sequence on two
/// threads ran it on one) and meets three times a step; from two a thread
/// the rows balance, two quiet cores meet cheaply, and the fused step's
/// bookkeeping over every row costs more. Measured on an AMD Zen 5, 2
/// threads, T=100, unfused time / fused time (`benches/fused_step.py`):
/// LSTM B=1 H=128/256/512 1.27/1.08/1.03x, GRU B=1 H=256 1.08x; B=2-3
/// 0.98-1.01x; at B=4, LSTM H=256 0.95x, GRU 0.97x.
pub(super) const FUSE_BELOW_ROWS_PER_THREAD: usize = 2;

/// Units of a tile of a thread that owns its rows: its products' columns
/// stay in the core's cache until the stage reads them, and the stage's
/// loops run whole passes of registers (128 floats on AVX-512). Measured
/// on an AMD Zen 5 (2 threads, T=100, LSTM B=16 H=256): tiles of 64 units
/// were 4-10% slower than of 128 to 512, which measured alike.
const ROW_TILE_UNITS: usize = 256;

/// The fewest units of a tile whose columns of a product of `blocks`
/// blocks are whole panels ([`super::panels::PANEL`] columns), so that a
/// thread's tiles are a range of the packed weight's panels: 8 for an
/// LSTM's four gates, 32 for a GRU's three.
fn quantum(blocks: usize) -> usize {
    let panel = super::panels::PANEL;
    panel / gcd(blocks, panel)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// What a thread reuses from step to step of its loop: the kernels'
/// pointer table, each row's pointers (a fused step), and the rows
/// gathered for the products run in the step ([`Sunk::locate`]).
#[derive(Default)]
pub struct TileScratch {
    pub table: Vec<*mut f32>,
    rows_base: Vec<*mut f32>,
    pub gathered: Vec<Vec<f32>>,
}

/// Builds the fused stage's kernel for one tile of a given width.
pub type TileBuilder = dyn Fn(usize) -> Result<Arc<dyn StageExec>> + Send + Sync;

/// A layer's fused step: the compiler's [`Fusion`] and its tile kernels,
/// built on first use for each width.
pub struct FusedStep {
    pub fusion: Fusion,
    /// The unit variable's value.
    pub units: usize,
    build: Box<TileBuilder>,
    kernels: BuiltKernels<usize>,
}

impl std::fmt::Debug for FusedStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedStep").field("fusion", &self.fusion).field("units", &self.units).finish()
    }
}

impl FusedStep {
    pub fn new(fusion: Fusion, units: usize, build: Box<TileBuilder>) -> FusedStep {
        FusedStep { fusion, units, build, kernels: BuiltKernels::default() }
    }

    /// The kernel for a tile of `width` units.
    fn kernel(&self, width: usize) -> Result<Arc<dyn StageExec>> {
        self.kernels.get_or_build(width, || (self.build)(width))
    }
}

/// One pass's fused step: the tile width, each tile's kernel, where its
/// pointers come from, the tile-ordered weights, and each thread's tiles.
pub struct PassTiles<'a> {
    pub step: &'a FusedStep,
    /// The GEMM stages hoisted before the loop that this pass runs in the
    /// step instead, with the fused ones, and their products.
    pub sunk: Vec<usize>,
    sunk_products: Sunk,
    width: usize,
    /// The kernel of a full tile, and of the narrower last one if there is one.
    full: Arc<dyn StageExec>,
    last: Option<Arc<dyn StageExec>>,
    /// Each of the kernels' inputs then outputs (the same for both): where
    /// a row's pointer comes from, and how many blocks of the unit the
    /// value has (a tile starts `blocks * from` floats in; 0 for a scalar).
    slots: Vec<(Slot, usize)>,
    /// The tile-ordered products' weights, packed (their rows permuted).
    pub products: TiledProducts,
    /// Keeps the tile-ordered vector parameters that `slots` point into.
    _vectors: Vec<Arc<[f32]>>,
    threads: usize,
    /// Each thread owns its rows and runs every tile of them (else the
    /// threads share out the tiles, each for every row).
    owns_rows: bool,
}

/// Where a tile kernel's pointer for a value comes from.
#[derive(Clone, Copy, Debug)]
enum Slot {
    /// The value's row, located as for any stage.
    Located(ValueId),
    /// A vector parameter's copy in tile order.
    Vector(*const f32),
}

// SAFETY: `Slot::Vector` points into an `Arc<[f32]>` the tiles keep and only read.
unsafe impl Send for Slot {}
unsafe impl Sync for Slot {}

impl<'a> PassTiles<'a> {
    /// The tiles of a pass run by `team`, if it fuses: where its threads
    /// split units and have fewer than [`FUSE_BELOW_ROWS_PER_THREAD`]
    /// sequences each, a tile or more per thread; where they own their
    /// rows, if the pass runs some of the fusion's hoisted stages in the
    /// step (`sunk`: the stages [`super::sink::stages_to_sink`] chose, with
    /// their products), [`ROW_TILE_UNITS`] a tile, those stages' products
    /// with the per-step ones. Tiles are whole panels, the weights packed
    /// (not read in place). `None` runs the step unfused. `products` are
    /// the fused GEMM stage's.
    pub fn new(
        step: &'a FusedStep,
        (graph, shapes, products): (&Graph, &Shapes, &[ValueId]),
        (params, weights): (&[&[f32]], &PreparedParams),
        team: &Team,
        sunk: &[(usize, Vec<Product>)],
    ) -> Result<Option<PassTiles<'a>>> {
        let (f, units, threads) = (&step.fusion, step.units, team.threads.max(1));
        let owns_rows = team.owns_rows();
        let hoisted: Vec<(usize, Vec<Product>)> =
            sunk.iter().filter(|(k, _)| f.hoisted.contains(k)).cloned().collect();
        let worth = match owns_rows {
            true => !hoisted.is_empty(),
            false => team.order().len() < FUSE_BELOW_ROWS_PER_THREAD * threads,
        };
        if !worth {
            return Ok(None);
        }
        // Tiles whose columns are whole panels of each of the step's `products`.
        let q = products.iter().map(|&v| quantum(f.blocks_of(v))).fold(1, |a, b| a / gcd(a, b) * b);
        let width =
            if owns_rows { ROW_TILE_UNITS.div_ceil(q) * q } else { units.div_ceil(threads).div_ceil(q) * q };
        if weights.reads_in_place() || (!owns_rows && units.div_ceil(width) < threads) {
            return Ok(None);
        }
        let width = width.min(units.div_ceil(q) * q);
        // A size of the cell that cannot take a tile's width (`H - 64` at
        // `H = 32`) leaves the step unfused.
        let Ok(full) = step.kernel(width) else { return Ok(None) };
        let last = match units % width {
            0 => None,
            rest => match step.kernel(rest) {
                Ok(k) => Some(k),
                Err(_) => return Ok(None),
            },
        };
        let mut vectors: HashMap<ValueId, Arc<[f32]>> = HashMap::new();
        let mut panels = Vec::new();
        for &v in &f.tile_ordered {
            let order = TileOrder { blocks: f.blocks_of(v), units, width };
            let ops = graph.operands(v);
            match (&graph.node(v).op, ops.first().map(|&w| &graph.node(w).op)) {
                (Op::Param(i), _) => {
                    vectors.insert(v, weights.vector_tiled(*i, params[*i], order));
                }
                (Op::MatVec, Some(&Op::Param(i))) => {
                    let (_, rows, cols) = shapes.block(ops[0]);
                    panels.push((v, weights.t_panels_tiled(i, params[i], (rows, cols), order)));
                }
                (op, _) => return Err(RuntimeError::Internal(format!("{v} ({op:?}) in tile order"))),
            }
        }
        let slots = (full.inputs().iter().chain(full.outputs()))
            .map(|v| {
                let slot = vectors.get(v).map_or(Slot::Located(*v), |p| Slot::Vector(p.as_ptr()));
                (slot, f.blocks.get(v).copied().unwrap_or(0))
            })
            .collect();
        let _vectors = vectors.into_values().collect();
        let (sunk, sunk_products) = (hoisted.iter().map(|(k, _)| *k).collect(), Sunk::of(&hoisted));
        Ok(Some(PassTiles {
            step,
            sunk,
            sunk_products,
            width,
            full,
            last,
            slots,
            products: TiledProducts(panels),
            _vectors,
            threads,
            owns_rows,
        }))
    }

    /// Thread `i`'s units: every unit when each thread owns its rows, else
    /// whole tiles, the threads' shares as even as tiles allow.
    pub fn units_of(&self, i: usize) -> Range<usize> {
        if self.owns_rows {
            return 0..self.step.units;
        }
        let tiles = self.step.units.div_ceil(self.width);
        let (from, to) = (tiles * i / self.threads, tiles * (i + 1) / self.threads);
        (from * self.width).min(self.step.units)..(to * self.width).min(self.step.units)
    }

    /// Thread `i`'s share of the fused step at rank rows `rows`: tile by
    /// tile, the tile's columns of each product, then the stage on them.
    ///
    /// # Safety
    /// The frame's and buffers' rows are valid, no other thread writes
    /// these units of them, and `rows` are ranks of rank-ordered storage.
    pub unsafe fn run(
        &self,
        (bufs, frame, shapes): (&Buffers, &Frame, &Shapes),
        products: &[Product],
        (i, rows, step): (usize, Range<usize>, &RankRow),
        scratch: &mut TileScratch,
    ) -> Result<()> {
        let units = self.units_of(i);
        if rows.is_empty() || units.is_empty() {
            return Ok(());
        }
        let f = &self.step.fusion;
        let TileScratch { table, rows_base, gathered } = scratch;
        let mut calls = Vec::with_capacity(products.len() + self.sunk_products.products.len());
        for p in products {
            let call = ProductCall::locate(p, bufs, frame, (0, 0, rows.start), rows.len(), 1, shapes)?;
            calls.push((call, f.blocks_of(p.0)));
        }
        let sunk = self.sunk_products.locate((bufs, frame, shapes), rows.clone(), step, gathered)?;
        calls.extend(sunk.into_iter().map(|(call, v)| (call, f.blocks_of(v))));
        // Each row's pointers at the tiles' start, located once a step.
        rows_base.clear();
        for r in rows.clone() {
            let (b, t) = step(r);
            for &(slot, _) in &self.slots {
                rows_base.push(match slot {
                    Slot::Vector(p) => p as *mut f32,
                    Slot::Located(v) => locate(bufs, frame, v, b, t, r)?,
                });
            }
        }
        for from in units.clone().step_by(self.width) {
            let to = (from + self.width).min(units.end);
            for (call, k) in &calls {
                // SAFETY: per the contract; these columns are this tile's in tile order.
                unsafe { call.run_columns(k * from..k * to)? };
            }
            let exec =
                if to - from == self.width { &self.full } else { self.last.as_ref().unwrap_or(&self.full) };
            table.clear();
            let offsets = self.slots.iter().map(|&(_, blocks)| blocks * from).cycle();
            table.extend(rows_base.iter().zip(offsets).map(|(&p, at)| p.wrapping_add(at)));
            // SAFETY: every pointer is its value's row at this tile, valid
            // for the tile's length at the kernel's sizes; this thread alone
            // writes these units of the outputs.
            unsafe { exec.run(rows.len(), table) };
        }
        Ok(())
    }
}
