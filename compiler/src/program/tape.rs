//! The tape: what a training forward keeps for its backward, per layout
//! row, and where each part lies in a reserve (the caller's memory that a
//! framework's autograd holds, cuDNN's "reserve space").
//!
//! Decided once per program, here, so that every back end that keeps its
//! tape in a reserve reads the same layout and the reserve's size is the
//! program's, not a back end's: part after part, each `rows × floats`
//! of the pass's layout rows, in the order of [`TapeLayout::parts`].

use crate::ir::ValueId;
use crate::shapes::Shapes;
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
    /// What the part holds.
    pub kept: Kept,
    /// Floats it holds per layout row.
    pub floats: usize,
}

/// A program's tape, part after part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TapeLayout {
    parts: Vec<TapePart>,
    /// The states whose value before a step the backward reads from the
    /// previous step's [`Kept::StateAfter`] (see [`TapeLayout::before_from_after`]).
    before_from_after: Vec<usize>,
}

impl TapeLayout {
    /// The states before the step, the states after it and the output that
    /// the backward `reads`, then the saved values in the schedule's order
    /// (`forward` gives their shapes). A part the backward never reads is
    /// not kept: an LSTM's backward reads `h` and `c` before the step and
    /// `c'` after it, not `h'`, which is also its output.
    ///
    /// Nor is a state before the step that the backward reads only in
    /// kernels, row by row (`read_as_rows`), where the tape keeps the same
    /// state after the step: the state before step `s` of a sequence is the
    /// state after its step `s - 1` in the pass's direction, or its initial
    /// state at its first step. An LSTM's tape keeps `c'` and not `c`; a
    /// state that a product reads over all rows (an LSTM's `h`, for `dW_hh`)
    /// is kept as it was, a matrix of rows.
    pub(super) fn new(
        (state_sizes, output_size): (&[usize], usize),
        saved: &[ValueId],
        forward: &Shapes,
        (reads, read_as_rows): (&dyn Fn(Kept) -> bool, &dyn Fn(usize) -> bool),
    ) -> TapeLayout {
        let before_from_after: Vec<usize> = (0..state_sizes.len())
            .filter(|&i| reads(Kept::StateBefore(i)) && reads(Kept::StateAfter(i)) && read_as_rows(i))
            .collect();
        let states = state_sizes.iter().copied().enumerate();
        let parts = states
            .clone()
            .filter(|(i, _)| !before_from_after.contains(i))
            .map(|(i, floats)| TapePart { kept: Kept::StateBefore(i), floats })
            .chain(states.map(|(i, floats)| TapePart { kept: Kept::StateAfter(i), floats }))
            .chain([TapePart { kept: Kept::Output, floats: output_size }])
            .filter(|part| reads(part.kept))
            .chain(saved.iter().map(|&v| TapePart { kept: Kept::Saved(v), floats: forward.elements(v) }))
            .collect();
        TapeLayout { parts, before_from_after }
    }

    /// Whether the backward reads state `i` as a step read it from the
    /// tape's state after the step before, in the pass's direction (or
    /// from the sequence's initial state at its first step), instead of
    /// from a part of its own.
    pub fn before_from_after(&self, i: usize) -> bool {
        self.before_from_after.contains(&i)
    }

    /// What the tape keeps, as `cellc graph --stage schedule` prints it:
    /// the parts in the reserve's order (`states` names the cell's states),
    /// the floats and bytes a row, and the states read from the step before.
    pub fn to_text(&self, states: &[&str]) -> String {
        let name = |i: usize| states.get(i).copied().unwrap_or("?");
        let parts: Vec<String> = (self.parts.iter())
            .map(|part| match part.kept {
                Kept::StateBefore(i) => format!("{} before the step [{}]", name(i), part.floats),
                Kept::StateAfter(i) => format!("{}' after the step [{}]", name(i), part.floats),
                Kept::Output => format!("the output [{}]", part.floats),
                Kept::Saved(v) => format!("{v} [{}]", part.floats),
            })
            .collect();
        let floats = self.floats_per_row();
        let mut text = format!(
            "the training forward's tape, per layout row (the reserve):\n  {}\n  {floats} floats ({} bytes) a row\n",
            if parts.is_empty() { "nothing".to_string() } else { parts.join(", ") },
            4 * floats
        );
        for &i in &self.before_from_after {
            let state = name(i);
            text += &format!(
                "  {state} before a step is {state}' after the step before (at a sequence's first step, its initial state)\n"
            );
        }
        text
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

    fn program(cell: &str) -> Program {
        let path = format!("{}/../cells/{cell}.cell", env!("CARGO_MANIFEST_DIR"));
        let src = std::fs::read_to_string(path).expect("a shipped cell");
        let c = crate::compile("t.cell", &src);
        let cell = &c.module.expect("compiles").cells[0];
        let steps = Steps::compile(cell).expect("steps");
        let sizes = [("H", 3), ("I", 2)].iter().map(|&(n, v)| (n.to_string(), v)).collect();
        steps.program(&sizes).expect("program")
    }

    fn kept(p: &Program) -> Vec<Kept> {
        p.tape().parts().iter().map(|p| p.kept).collect()
    }

    fn saved(p: &Program) -> Vec<Kept> {
        p.saved().iter().map(|&v| Kept::Saved(v)).collect()
    }

    #[test]
    fn the_tape_keeps_what_the_backward_reads_then_the_saved_values() {
        // An LSTM's backward reads h and c before the step and c' after it
        // (not h', its output too); the gates come from the saved values.
        // c before the step is c' after the step before: not kept twice.
        let lstm = program("lstm");
        let want = [Kept::StateBefore(0), Kept::StateAfter(1)];
        assert_eq!(kept(&lstm), [&want[..], &saved(&lstm)].concat());
        assert!(!lstm.saved().is_empty());
        assert!(lstm.tape().before_from_after(1) && !lstm.tape().before_from_after(0));
        // tanh's derivative reads its result, h' after the step; h before
        // it is a product's operand over all rows (dW_hh), so both stay.
        let rnn = program("rnn_tanh");
        assert_eq!(kept(&rnn), [&[Kept::StateBefore(0), Kept::StateAfter(0)][..], &saved(&rnn)].concat());
        assert!(!rnn.tape().before_from_after(0));
    }

    #[test]
    fn the_tape_prints_its_parts_and_the_states_it_reads_from_the_step_before() {
        let text = program("lstm").tape().to_text(&["h", "c"]);
        assert!(text.contains("\n  h before the step [3], c' after the step [3], v"), "{text}");
        assert!(text.contains("  18 floats (72 bytes) a row\n"), "{text}");
        assert!(text.contains("  c before a step is c' after the step before"), "{text}");
        assert!(!text.contains("h before a step is"), "{text}");
    }

    #[test]
    fn parts_follow_one_another_without_gaps() {
        let p = program("lstm");
        let tape = p.tape();
        let floats: Vec<usize> = tape.parts().iter().map(|part| part.floats).collect();
        assert_eq!(&floats[..2], &[3, 3]);
        assert_eq!(tape.floats_per_row(), floats.iter().sum::<usize>());
        let ranges: Vec<Range<usize>> = tape.ranges(7).map(|(_, r)| r).collect();
        assert_eq!(ranges[0].start, 0);
        for (w, part) in ranges.windows(2).zip(tape.parts()) {
            assert_eq!(w[0].end, w[1].start);
            assert_eq!(w[0].len(), 7 * part.floats);
        }
        assert_eq!(ranges.last().map(|r| r.end), Some(7 * tape.floats_per_row()));
    }
}
