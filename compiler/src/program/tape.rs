//! The tape: what a training forward keeps for its backward, per layout
//! row, and where each part lies in a reserve (the caller's memory that a
//! framework's autograd holds, cuDNN's "reserve space").
//!
//! Decided once per program, here, so that every back end that keeps its
//! tape in a reserve reads the same layout and the reserve's size is the
//! program's, not a back end's: part after part, each `rows × floats`
//! of the pass's layout rows, in the order of [`TapeLayout::parts`].

use crate::interp::Shapes;
use crate::ir::ValueId;
use std::ops::Range;

/// What one part of the tape holds for each row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kept {
    /// State `i` as the step read it.
    StateBefore(usize),
    /// State `i` as the step wrote it.
    StateAfter(usize),
    /// The step's output.
    Output,
    /// A forward value the backward reads (the schedule's saved values).
    Saved(ValueId),
}

/// One part of the tape: what it keeps, and its floats per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TapePart {
    pub kept: Kept,
    pub floats: usize,
}

/// A program's tape, part after part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TapeLayout {
    parts: Vec<TapePart>,
}

impl TapeLayout {
    /// Every state before the step, every state after it, the output, then
    /// the saved values in the schedule's order (`forward` gives their shapes).
    pub(super) fn new(
        state_sizes: &[usize],
        output_size: usize,
        saved: &[ValueId],
        forward: &Shapes,
    ) -> TapeLayout {
        let states = state_sizes.iter().copied().enumerate();
        let parts = states
            .clone()
            .map(|(i, floats)| TapePart { kept: Kept::StateBefore(i), floats })
            .chain(states.map(|(i, floats)| TapePart { kept: Kept::StateAfter(i), floats }))
            .chain([TapePart { kept: Kept::Output, floats: output_size }])
            .chain(saved.iter().map(|&v| TapePart { kept: Kept::Saved(v), floats: forward.elements(v) }))
            .collect();
        TapeLayout { parts }
    }

    /// The parts, in the reserve's order.
    pub fn parts(&self) -> &[TapePart] {
        &self.parts
    }

    /// Floats per layout row, all parts together.
    pub fn floats_per_row(&self) -> usize {
        self.parts.iter().map(|p| p.floats).sum()
    }

    /// Each part and the floats it takes in a reserve of `rows` layout rows.
    pub fn ranges(&self, rows: usize) -> impl Iterator<Item = (TapePart, Range<usize>)> + '_ {
        self.parts.iter().scan(0, move |at, &part| {
            let start = *at;
            *at += rows * part.floats;
            Some((part, start..*at))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{Program, Steps};

    fn program(src: &str, sizes: &[(&str, usize)]) -> Program {
        let c = crate::compile("t.cell", src);
        let cell = &c.module.expect("compiles").cells[0];
        let steps = Steps::compile(cell).expect("steps");
        let sizes = sizes.iter().map(|&(n, v)| (n.to_string(), v)).collect();
        steps.program(&sizes).expect("program")
    }

    #[test]
    fn the_tape_keeps_states_output_and_saved_values_part_after_part() {
        let p = program(
            "cell c { input x[H] state h[H], c[H] param w[H, H]\n\
             let a = tanh(w @ x + h)\n c' = a * c\n h' = sigmoid(a)\n output h' }",
            &[("H", 3)],
        );
        let tape = p.tape();
        let kinds: Vec<Kept> = tape.parts().iter().map(|p| p.kept).collect();
        assert_eq!(
            &kinds[..5],
            &[
                Kept::StateBefore(0),
                Kept::StateBefore(1),
                Kept::StateAfter(0),
                Kept::StateAfter(1),
                Kept::Output
            ]
        );
        let saved: Vec<ValueId> = kinds[5..]
            .iter()
            .map(|k| match k {
                Kept::Saved(v) => *v,
                other => panic!("{other:?} after the output"),
            })
            .collect();
        assert!(!saved.is_empty(), "tanh and sigmoid keep values for the backward");
        assert_eq!(saved, p.saved());
        assert_eq!(
            tape.floats_per_row(),
            5 * 3 + saved.iter().map(|&v| p.forward_shapes.elements(v)).sum::<usize>()
        );
        // Parts follow one another without gaps, rows × floats each.
        let ranges: Vec<Range<usize>> = tape.ranges(7).map(|(_, r)| r).collect();
        assert_eq!(ranges[0].start, 0);
        for (w, part) in ranges.windows(2).zip(tape.parts()) {
            assert_eq!(w[0].end, w[1].start);
            assert_eq!(w[0].len(), 7 * part.floats);
        }
        assert_eq!(ranges.last().map(|r| r.end), Some(7 * tape.floats_per_row()));
    }
}
