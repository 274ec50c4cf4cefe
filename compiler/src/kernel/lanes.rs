//! The CUDA lane form's decision: whether a stage's every vector is a
//! whole number of `U`-element pieces, so that one thread per (row, unit)
//! computes element `p * U + j` of every vector in registers, with no
//! thread reading what another wrote (see `cellc::cuda`). Decided by
//! walking the plan's items with each value's piece count; the first value
//! that does not fit sends the stage to the block form.

use super::{Chain, Item, KernelPlan, Kind};
use crate::ir::{Graph, ValueId};
use crate::schedule::{Stage, StageKind};
use crate::shapes::Shapes;
use std::collections::HashMap;

/// At most this many pieces per vector in the lane form (an LSTM's gates
/// are 4): past it a thread would hold too many registers (and the source
/// unroll too far), and the stage takes the block form.
pub const MAX_PIECES: usize = 16;

/// A stage in the lane form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lanes {
    /// Elements per piece: one thread per unit.
    pub units: usize,
    /// Whole-sequence stages: states kept in a register from row to row,
    /// read through their input slot only at a sequence's first row.
    pub chained: Vec<Chained>,
}

/// A state carried in a register along a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chained {
    /// Its input slot (read at a sequence's first row).
    pub input: usize,
    /// The output (index among the outputs) whose value the next row reads.
    pub output: usize,
}

/// How a value is held in the lane form, as far as pieces go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// The same float in every thread (a scalar or a splat).
    Uniform,
    /// In memory (an input, or a view of one): any thread may read any element.
    Memory,
    /// This many pieces, one register each.
    Registers(usize),
}

/// The lane form of `plan` (the kernel of `stage`), or `None` for the block form.
pub(super) fn decide(
    graph: &Graph,
    shapes: &Shapes,
    stage: &Stage,
    plan: &KernelPlan,
    chains: &[Chain],
) -> Option<Lanes> {
    let units = unit(graph, shapes, stage)?;
    let mut walk = Walk { units, shapes, held: HashMap::new() };
    for &(v, _) in &plan.literals {
        walk.held.insert(v, Held::Uniform);
    }
    let mut chained = Vec::new();
    for &(slot, v, kind) in &plan.inputs {
        let chain_output = chains.iter().find(|(input, _)| *input == v).map(|c| c.1);
        let output = chain_output.and_then(|out| plan.outputs.iter().position(|o| o.value == out));
        let held = match output {
            Some(output) if plan.whole_sequence && shapes.elements(v) == units => {
                chained.push(Chained { input: slot, output });
                Held::Registers(1)
            }
            _ if kind == Kind::Vector => Held::Memory,
            _ => Held::Uniform,
        };
        walk.held.insert(v, held);
    }
    for item in &plan.items {
        walk.item(item)?;
    }
    for out in plan.outputs.iter().filter(|o| !o.in_place) {
        walk.pieces(out.value, shapes.elements(out.value))?;
    }
    for c in &chained {
        let v = plan.outputs[c.output].value;
        if walk.pieces(v, shapes.elements(v))? != 1 {
            return None;
        }
    }
    Some(Lanes { units, chained })
}

/// The candidate unit: the shortest elementwise vector, every vector at
/// most [`MAX_PIECES`] of it; none for a whole-sequence stage with a row
/// reduction.
fn unit(graph: &Graph, shapes: &Shapes, stage: &Stage) -> Option<usize> {
    if stage.kind == (StageKind::WholeSequence { reductions: true }) {
        return None;
    }
    let elementwise =
        |v: &&ValueId| graph.node(**v).op.is_elementwise() && graph.ty(**v).vector_dim().is_some();
    let units = stage.values.iter().filter(elementwise).map(|&v| shapes.elements(v)).min()?;
    let longest = stage.values.iter().map(|&v| shapes.elements(v)).max().unwrap_or(0);
    (units > 0 && longest <= units * MAX_PIECES).then_some(units)
}

struct Walk<'a> {
    units: usize,
    shapes: &'a Shapes,
    held: HashMap<ValueId, Held>,
}

impl Walk<'_> {
    fn len(&self, v: ValueId) -> usize {
        self.shapes.elements(v)
    }

    /// The pieces of `v` read as a `len`-element vector, if it splits so.
    fn pieces(&self, v: ValueId, len: usize) -> Option<usize> {
        if !len.is_multiple_of(self.units) {
            return None;
        }
        let q = len / self.units;
        match self.held.get(&v)? {
            Held::Uniform | Held::Memory => Some(q),
            Held::Registers(n) => (*n == q).then_some(q),
        }
    }

    fn registers(&self, v: ValueId) -> bool {
        matches!(self.held.get(&v), Some(Held::Registers(_)))
    }

    /// Holds what `item` computes, or `None` if it leaves the lane form.
    fn item(&mut self, item: &Item) -> Option<()> {
        let units = self.units;
        let fits = |n: usize| n.is_multiple_of(units);
        let held = match item {
            Item::Fused(l) => {
                if !fits(l.len) {
                    return None;
                }
                for &o in &l.outside {
                    self.pieces(o, l.len)?;
                }
                for m in &l.members {
                    self.held.insert(m.value, Held::Registers(l.len / units));
                }
                return Some(());
            }
            // Element 0 of registers is another thread's.
            Item::Broadcast { src, .. } => (!self.registers(*src)).then_some(Held::Uniform)?,
            Item::Scalar { args, .. } => {
                (!args.iter().any(|a| self.registers(*a))).then_some(Held::Uniform)?
            }
            // A row reduction needs the whole row: the block form.
            Item::Reduce { src, .. } => (self.held.get(src)? == &Held::Uniform).then_some(Held::Uniform)?,
            Item::Slice { value, src, offset } => match *self.held.get(src)? {
                Held::Registers(n) => {
                    let len = self.len(*value);
                    let fit = fits(*offset) && fits(len) && (offset + len) / units <= n;
                    fit.then_some(Held::Registers(len / units))?
                }
                other => other,
            },
            Item::Pad { value, src, offset } => {
                let len = self.len(*value);
                self.pieces(*src, self.len(*src))?;
                (fits(*offset) && fits(len)).then_some(Held::Registers(len / units))?
            }
            Item::Concat { value, parts } => {
                for &p in parts {
                    self.pieces(p, self.len(p))?;
                }
                Held::Registers(self.len(*value) / units)
            }
        };
        self.held.insert(item.value()?, held);
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use crate::program::{Program, Side};

    fn program(name: &str, h: usize) -> Program {
        crate::program::shipped(name, |s| if s == "I" { 3 } else { h }).1
    }

    #[test]
    fn gates_split_into_units_take_the_lane_form() {
        let p = program("lstm", 8);
        let fwd = p.kernels().find(|k| k.side == Side::Forward).expect("a forward kernel");
        let lanes = fwd.plan.lanes.as_ref().expect("lanes");
        assert_eq!(lanes.units, 8);
        assert!(lanes.chained.is_empty(), "a per-row stage chains nothing");
    }

    #[test]
    fn a_row_reduction_takes_the_block_form() {
        let p = program("layernorm_lstm", 8);
        let fwd = p.kernels().find(|k| k.side == Side::Forward).expect("a forward kernel");
        assert!(fwd.plan.lanes.is_none());
    }

    #[test]
    fn an_elementwise_recurrence_carries_its_state_in_a_register() {
        let p = program("sru", 8);
        let fwd = p.kernels().find(|k| k.side == Side::Forward).expect("a forward kernel");
        assert!(fwd.plan.whole_sequence);
        let lanes = fwd.plan.lanes.as_ref().expect("lanes");
        assert_eq!(lanes.chained.len(), 1, "c is carried");
        let c = lanes.chained[0];
        assert!(c.input < fwd.plan.input_count && c.output < fwd.plan.outputs.len());
    }
}
