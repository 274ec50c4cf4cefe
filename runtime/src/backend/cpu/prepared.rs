//! One layer-direction's weights prepared once per model (and again when
//! they change) for the products that read them: packed into panels for
//! the microkernel ([`super::panels`], [`super::bf16`]), in the 2 MiB-aligned
//! memory of [`super::aligned`].

use super::panels::PackedB;
use cellc::precision::Precision;
use cellc::schedule::tiles::tile_position;
use std::sync::{Arc, Mutex, OnceLock};

/// One layer-direction's weights in the forms its products read, each made
/// on first use and kept until the weights change: the model keeps this in
/// its [`crate::backend::PreparedWeights`] slot, which it empties whenever it
/// hands its parameters out mutably (an optimiser step, a load).
#[derive(Debug)]
pub struct PreparedParams {
    forms: Vec<Forms>,
    /// The products read the weights where they lie ([`super::in_place`]).
    in_place: bool,
    /// bf16 pair panels ([`PackedB::of_bf16`]) or f32 panels.
    precision: Precision,
}

#[derive(Debug, Default)]
struct Forms {
    /// `Wᵀ` in panels, per head: a per-step `X · Wᵀ`.
    t_panels: OnceLock<Vec<PackedB>>,
    /// `W` in panels, per head: a per-step `D · W`.
    panels: OnceLock<Vec<PackedB>>,
    /// In tile order ([`TileOrder`]), per tile width: `Wᵀ` in panels (a
    /// matrix), or the vector.
    tiled: Mutex<Vec<(usize, Tiled)>>,
}

/// A parameter in tile order.
#[derive(Clone, Debug)]
enum Tiled {
    TPanels(Arc<PackedB>),
    Vector(Arc<[f32]>),
}

/// How a fused step holds a vector of `blocks` blocks of `units` units:
/// tile by tile, `width` units a tile (see [`cellc::schedule::tiles`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileOrder {
    pub blocks: usize,
    pub units: usize,
    pub width: usize,
}

/// A pass's products that come out in tile order, with their weights
/// packed for it (see [`super::tiles`]).
#[derive(Debug, Default)]
pub struct TiledProducts(pub Vec<(cellc::ir::ValueId, Arc<PackedB>)>);

impl TiledProducts {
    /// Product `v`'s weight packed for its output in tile order, if it is one.
    pub fn panels_of(&self, v: cellc::ir::ValueId) -> Option<&PackedB> {
        self.0.iter().find(|(p, _)| *p == v).map(|(_, packed)| &**packed)
    }
}

impl TileOrder {
    /// For each place in tile order, the row (`g * units + u`) it holds.
    pub fn sources(&self) -> Vec<usize> {
        let mut from = vec![0; self.blocks * self.units];
        for g in 0..self.blocks {
            for u in 0..self.units {
                from[tile_position(self.blocks, self.units, self.width, (g, u))] = g * self.units + u;
            }
        }
        from
    }

    /// Row `g * units + u` of `rows` (`blocks * units` rows of `cols`
    /// floats) at its place in tile order.
    pub fn permute(&self, rows: &[f32], cols: usize) -> Vec<f32> {
        self.sources().iter().flat_map(|&from| &rows[from * cols..(from + 1) * cols]).copied().collect()
    }
}

impl PreparedParams {
    /// Room for `count` parameters packed for products in `precision`, nothing made yet.
    pub fn new(count: usize, precision: Precision) -> PreparedParams {
        PreparedParams { forms: (0..count).map(|_| Forms::default()).collect(), in_place: false, precision }
    }

    /// Nothing to prepare: the products read the weights in place (f32 only).
    pub fn in_place() -> PreparedParams {
        PreparedParams { forms: Vec::new(), in_place: true, precision: Precision::F32 }
    }

    /// Whether the products read the weights in place.
    pub fn reads_in_place(&self) -> bool {
        self.in_place
    }

    fn forms(&self, i: usize) -> &Forms {
        &self.forms[i]
    }

    /// Parameter `i` as the packed right operand of `X · Wᵀ`, one panel set
    /// per head: `w` is `heads` blocks `[m, n]` one after another.
    pub fn t_panels(&self, i: usize, w: &[f32], (heads, m, n): (usize, usize, usize)) -> &[PackedB] {
        // fp16 never reaches the CPU (its `Device::precision` refuses it).
        let p = self.forms(i).t_panels.get_or_init(|| {
            per_head(w, heads, |w| match self.precision {
                Precision::F32 | Precision::F16 | Precision::Tf32 => PackedB::of_transpose(w, m, n),
                Precision::Bf16 => PackedB::of_transpose_bf16(w, m, n),
            })
        });
        debug_assert!(p.iter().all(|p| (p.k(), p.n()) == (n, m)));
        p
    }

    /// Parameter `i` (`W: [m, n]`, one head) in tile order `order`, as the
    /// packed right operand of `X · Wᵀ`: its rows permuted, so that the
    /// product's columns come out in tile order.
    pub fn t_panels_tiled(
        &self,
        i: usize,
        w: &[f32],
        (m, n): (usize, usize),
        order: TileOrder,
    ) -> Arc<PackedB> {
        let made = self.tiled(i, order.width, || {
            let source = order.sources();
            let source = |r: usize| source[r];
            Tiled::TPanels(Arc::new(match self.precision {
                Precision::F32 | Precision::F16 | Precision::Tf32 => {
                    PackedB::of_transpose_by(w, m, n, source)
                }
                Precision::Bf16 => PackedB::of_transpose_bf16_by(w, m, n, source),
            }))
        });
        match made {
            Tiled::TPanels(p) => p,
            Tiled::Vector(_) => unreachable!("parameter {i} is a matrix and a vector"),
        }
    }

    /// Vector parameter `i` in tile order `order`.
    pub fn vector_tiled(&self, i: usize, v: &[f32], order: TileOrder) -> Arc<[f32]> {
        match self.tiled(i, order.width, || Tiled::Vector(order.permute(v, 1).into())) {
            Tiled::Vector(v) => v,
            Tiled::TPanels(_) => unreachable!("parameter {i} is a matrix and a vector"),
        }
    }

    /// Parameter `i`'s tile-ordered form at `width`, made by `make` on first use.
    fn tiled(&self, i: usize, width: usize, make: impl FnOnce() -> Tiled) -> Tiled {
        let mut held = self.forms(i).tiled.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, t)) = held.iter().find(|(w, _)| *w == width) {
            return t.clone();
        }
        let t = make();
        held.push((width, t.clone()));
        t
    }

    /// Parameter `i` as the packed right operand of `D · W`, one panel set
    /// per head: `w` is `heads` blocks `[m, n]` one after another.
    pub fn panels(&self, i: usize, w: &[f32], (heads, m, n): (usize, usize, usize)) -> &[PackedB] {
        let p = self.forms(i).panels.get_or_init(|| {
            per_head(w, heads, |w| match self.precision {
                Precision::F32 | Precision::F16 | Precision::Tf32 => PackedB::of(w, m, n),
                Precision::Bf16 => PackedB::of_bf16(w, m, n),
            })
        });
        debug_assert!(p.iter().all(|p| (p.k(), p.n()) == (m, n)));
        p
    }
}

/// `pack` of each of the `heads` equal blocks of `w`, in order.
fn per_head(w: &[f32], heads: usize, pack: impl Fn(&[f32]) -> PackedB) -> Vec<PackedB> {
    w.chunks_exact(w.len() / heads.max(1)).map(pack).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_packed_in_tile_order_are_the_permuted_weights_packed() {
        // 4 blocks of 40 units in tiles of 24 (a panel straddles two blocks'
        // runs of rows), 37 columns (ragged 16x16 blocks).
        let (order, cols) = (TileOrder { blocks: 4, units: 40, width: 24 }, 37);
        let rows = order.blocks * order.units;
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let permuted = order.permute(&w, cols);
        let source = order.sources();
        let by = |r: usize| source[r];
        let f32s = |p: &PackedB| p.data.as_slice().to_vec();
        assert_eq!(
            f32s(&PackedB::of_transpose_by(&w, rows, cols, by)),
            f32s(&PackedB::of_transpose(&permuted, rows, cols))
        );
        let bits = |p: &PackedB| p.data.as_slice().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&PackedB::of_transpose_bf16_by(&w, rows, cols, by)),
            bits(&PackedB::of_transpose_bf16(&permuted, rows, cols))
        );
    }
}
