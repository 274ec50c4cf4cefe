//! Streaming: a model run a few steps at a time over a batch whose
//! sequences advance together, the states carried from call to call (voice
//! activity detection, speech enhancement, online decoding: one frame per
//! call).
//!
//! [`Model::stream`] makes a workspace once, sized for its batch; each
//! [`Stream::run`] then runs as many steps as it is given, on the calling
//! thread. On the CPU a call allocates nothing and locates nothing (see
//! `backend::cpu::stream`); a back end without a step path runs each call
//! as a batch with the carried states as its initial states. A stream
//! borrows its model, so the weights cannot change under it, and is
//! `Send + Sync`: callers on several threads each make their own.
//!
//! [`Stream`]'s documentation has an example.

use crate::backend::{StepRunner, StreamJob};
use crate::error::{Result, RuntimeError};
use crate::input::Input;
use crate::model::Model;
use crate::sequence::{check_len, Align, Major};

/// A model running step by step over a batch of sequences that advance
/// together, its states carried from one [`Stream::run`] to the next.
/// Made by [`Model::stream`].
///
/// ```
/// use cellc_runtime::backend::cpu::{Cpu, Kernels};
/// use cellc_runtime::{Align, CompiledCell, Input, Major, Model, ModelConfig};
/// use std::sync::Arc;
///
/// let cell = Arc::new(CompiledCell::from_file("../cells/lstm.cell".as_ref(), None)?); // the repository's LSTM
/// let sizes = [("H".to_string(), 8)].into();
/// let cpu = Box::new(Cpu::new(1, Kernels::default())?);
/// let model = Model::new(cell, ModelConfig::default(), &sizes, Some(4), None, 7, cpu)?;
///
/// let mut stream = model.stream(2)?;              // two sequences side by side, states at zero
/// let frames: Vec<f32> = (0..3 * 2 * 4).map(|i| (i as f32 * 0.1).cos()).collect(); // [T = 3, B, I]
/// let mut y = vec![0.0; 3 * 2 * 8];               // [T, B, O]
/// for (frame, out) in frames.chunks(2 * 4).zip(y.chunks_mut(2 * 8)) {
///     stream.run(frame, out)?;                    // one step per call: [1, B, I] in, [1, B, O] out
/// }
/// let states = stream.states();                   // h and c, [layers, B, H] each
/// assert_eq!((states.len(), states[0].len()), (2, 2 * 8));
///
/// // The same three steps as one batch (time-first) give the same output.
/// let input = Input::Padded { data: &frames, batch: 2, steps: 3, major: Major::TimeFirst, align: Align::Left, lengths: &[3, 3] };
/// let whole = model.forward(input, None)?;
/// assert!(y.iter().zip(&whole.data).all(|(a, b)| (a - b).abs() < 1e-5));
///
/// stream.reset();                                 // zeros: the next call starts new sequences
/// # Ok::<(), cellc_runtime::RuntimeError>(())
/// ```
pub struct Stream<'m> {
    model: &'m Model,
    batch: usize,
    runner: Box<dyn StepRunner + 'm>,
}

impl std::fmt::Debug for Stream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("model", self.model).field("batch", &self.batch).finish()
    }
}

impl<'m> Stream<'m> {
    /// The workspace of [`Model::stream`].
    pub(crate) fn new(model: &'m Model, batch: usize) -> Result<Stream<'m>> {
        model.ensure_owns_weights()?;
        if model.config.bidirectional {
            return Err(RuntimeError::NotStreamable {
                reason: "it is bidirectional, and its reverse direction reads each sequence from its end; \
                         run whole sequences with Model::forward"
                    .into(),
            });
        }
        if batch == 0 {
            return Err(RuntimeError::Shape {
                tensor: "batch".into(),
                expected: "at least one sequence".into(),
                found: "0 sequences".into(),
            });
        }
        // Each layer holds at least its input, output and states per sequence.
        let per_sequence: u128 = model
            .layers
            .iter()
            .map(|l| (l.input_size + l.output_size + l.state_sizes.iter().sum::<usize>()) as u128)
            .sum();
        crate::memory::ensure_fits(
            || format!("a stream of cell `{}` over {batch} sequences", model.compiled.forward.name),
            crate::memory::f32_bytes(per_sequence * batch as u128),
        )?;
        let job = StreamJob {
            cell: &model.compiled,
            layers: &model.layers,
            params: (0..model.layers.len())
                .map(|k| model.params(k, false).iter().map(Vec::as_slice).collect())
                .collect(),
            prepared: (0..model.layers.len()).map(|k| model.prepared(k, false)).collect(),
            batch,
            masking: model.caller_masking(None, None)?,
            precision: model.precision,
        };
        let runner = match model.device.stream(job)? {
            Some(runner) => runner,
            None => Box::new(Batched::new(model, batch)),
        };
        Ok(Stream { model, batch, runner })
    }
}

impl Stream<'_> {
    /// Sequences the stream runs side by side, `B` (fixed when it was made).
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Runs the steps of `input` (`[steps, B, I]`, time first), writing
    /// `output` (`[steps, B, O]`), and carries the states on.
    pub fn run(&mut self, input: &[f32], output: &mut [f32]) -> Result<()> {
        let (b, i, o) = (self.batch, self.model.input_size(), self.model.output_size());
        if b * i == 0 || !input.len().is_multiple_of(b * i) {
            return Err(RuntimeError::Shape {
                tensor: "input".into(),
                expected: format!("[steps, {b}, {i}] (a multiple of {} elements)", b * i),
                found: format!("{} elements", input.len()),
            });
        }
        let steps = input.len() / (b * i);
        check_len("output", output.len(), &[steps, b, o])?;
        if steps == 0 {
            return Ok(());
        }
        self.runner.run(input, steps, output)
    }

    /// The current states: one buffer per state, `[layers, B, size]` (the
    /// layout of [`crate::Output::final_states`]).
    pub fn states(&self) -> Vec<Vec<f32>> {
        let layers = self.model.layers().len();
        (0..self.model.layers()[0].state_sizes.len())
            .map(|i| (0..layers).flat_map(|k| self.runner.state(k, i).iter().copied()).collect())
            .collect()
    }

    /// Replaces the states (`[layers, B, size]` each, as [`Stream::states`]).
    pub fn set_states(&mut self, states: &[Vec<f32>]) -> Result<()> {
        let (layers, b) = (self.model.layers().len(), self.batch);
        let sizes = &self.model.layers()[0].state_sizes;
        if states.len() != sizes.len() {
            return Err(RuntimeError::Shape {
                tensor: "states".into(),
                expected: format!("{} state tensors", sizes.len()),
                found: format!("{}", states.len()),
            });
        }
        for ((given, &n), decl) in states.iter().zip(sizes).zip(&self.model.compiled().forward.states) {
            check_len(&format!("states.{}", decl.name), given.len(), &[layers, b, n])?;
        }
        for (i, (given, &n)) in states.iter().zip(sizes).enumerate() {
            for k in 0..layers {
                self.runner.state_mut(k, i).copy_from_slice(&given[k * b * n..(k + 1) * b * n]);
            }
        }
        Ok(())
    }

    /// Zeros every state: the next call starts new sequences.
    pub fn reset(&mut self) {
        for k in 0..self.model.layers().len() {
            for i in 0..self.model.layers()[0].state_sizes.len() {
                self.runner.state_mut(k, i).fill(0.0);
            }
        }
    }
}

/// The stream of a back end with no step path: each call is a batch of
/// equal-length sequences whose initial states are the carried ones.
struct Batched<'m> {
    model: &'m Model,
    batch: usize,
    /// `[layers, B, size]` per state.
    states: Vec<Vec<f32>>,
}

impl<'m> Batched<'m> {
    fn new(model: &'m Model, batch: usize) -> Batched<'m> {
        let layers = model.layers().len();
        let states = model.layers()[0].state_sizes.iter().map(|&n| vec![0.0; layers * batch * n]).collect();
        Batched { model, batch, states }
    }

    fn size(&self, i: usize) -> usize {
        self.batch * self.model.layers()[0].state_sizes[i]
    }
}

impl StepRunner for Batched<'_> {
    fn run(&mut self, input: &[f32], steps: usize, output: &mut [f32]) -> Result<()> {
        let lengths = vec![steps; self.batch];
        let batch = Input::Padded {
            data: input,
            batch: self.batch,
            steps,
            major: Major::TimeFirst,
            align: Align::Left,
            lengths: &lengths,
        };
        let out = self.model.forward(batch, Some(&self.states))?;
        output.copy_from_slice(&out.data);
        self.states = out.final_states;
        Ok(())
    }

    fn state(&self, layer: usize, i: usize) -> &[f32] {
        let n = self.size(i);
        &self.states[i][layer * n..(layer + 1) * n]
    }

    fn state_mut(&mut self, layer: usize, i: usize) -> &mut [f32] {
        let n = self.size(i);
        &mut self.states[i][layer * n..(layer + 1) * n]
    }
}
