//! Streaming on the CPU: a workspace per caller that runs a few steps of a
//! one-directional model on the calling thread, with nothing located,
//! allocated or forked per call.
//!
//! Everything is resolved when the stream is made: each value of a layer's
//! forward step gets one row per sequence, the caller's input one staging
//! row per sequence, and every pointer a kernel or a product reads is
//! found then (a pointer table per pointwise kernel, a located product per
//! matrix product, reading the weights packed once per model). A call then
//! copies each step's input in, runs the step's stages in schedule order
//! (hoisted ones too, on this step's rows), and copies the output and the
//! next states out. A batch run's fixed costs (ordering the batch, laying
//! out rows, waking the pool's threads: 7-10 µs from outside it) are gone,
//! which is what a caller feeding one frame at a time pays for.

use super::buffers::{constants, leaf_locations, locate, Buffers, Frame};
use super::host::{Rows, SharedRows};
use super::stage::StageExec;
use super::stages::{ProductCall, ReadyStage};
use super::{Cpu, LayerCode};
use crate::backend::{StepRunner, StreamJob};
use crate::error::{Result, RuntimeError};
use crate::sequence::{Align, BatchOrder, Major, RowLayout};
use cellc::program::Side;
use cellc::schedule::Placement;
use std::marker::PhantomData;
use std::sync::Arc;

/// A stream's workspace: every layer's rows, states and located calls.
pub struct CpuStream<'a> {
    layers: Vec<LayerStep>,
    /// Each layer's output rows but the last's (the next layer's input), `[B, O]`.
    between: Vec<Vec<f32>>,
    /// The calls read the model's parameters and their packed forms, which
    /// cannot change while the model is borrowed.
    _model: PhantomData<&'a ()>,
}

// SAFETY: the pointers point into buffers the stream owns, or into the
// model's parameters and packed weights, which it borrows shared and
// unchanging; a call runs through `&mut self`, so one thread at a time.
unsafe impl Send for CpuStream<'_> {}
unsafe impl Sync for CpuStream<'_> {}

/// One stage of a step, located.
enum Call {
    Product(ProductCall),
    Pointwise { exec: Arc<dyn StageExec>, table: Vec<*mut f32>, rows: usize },
}

/// One layer of a stream.
struct LayerStep {
    /// The layer's kernels (the pointwise calls hold them too).
    _code: Arc<LayerCode>,
    /// Every value's rows, which the calls' pointers point into.
    _bufs: Buffers,
    /// The masks' rows (evaluation values), which the calls' pointers point into.
    _masks: Vec<f32>,
    /// This step's input, `[B, I]`.
    input: Vec<f32>,
    /// The carried states, `[B * size]` each.
    states: Vec<Vec<f32>>,
    calls: Vec<Call>,
    /// Each sequence's output row.
    outputs: Vec<*const f32>,
    output_size: usize,
    /// `(next state's row, state row, floats)`, per state and sequence.
    /// Every next state is a value the step computes (the compiler's
    /// `materialize` pass makes `a' = b` a copy), so no copy reads a state
    /// row another has just written.
    next_states: Vec<(*const f32, *mut f32, usize)>,
}

impl Cpu {
    pub(super) fn make_stream<'a>(&'a self, job: StreamJob<'a>) -> Result<CpuStream<'a>> {
        let mut layers = Vec::with_capacity(job.layers.len());
        for (k, layer) in job.layers.iter().enumerate() {
            let code = self.code(job.cell, layer)?;
            layers.push(LayerStep::new(code, &job, k)?);
        }
        let between = layers[..layers.len().saturating_sub(1)]
            .iter()
            .map(|l| vec![0.0; job.batch * l.output_size])
            .collect();
        Ok(CpuStream { layers, between, _model: PhantomData })
    }
}

impl LayerStep {
    fn new(code: Arc<LayerCode>, job: &StreamJob, k: usize) -> Result<LayerStep> {
        let precision = job.precision;
        let (g, shapes) = (&*code.fwd_graph, &*code.fwd_shapes);
        let (layer, batch) = (&job.layers[k], job.batch);
        let weights = job.prepared[k]
            .get_or_init(precision, || super::prepared::PreparedParams::new(job.params[k].len(), precision))
            .ok_or_else(|| RuntimeError::Internal("another back end's weights in a cpu model".into()))?;
        let mut bufs = Buffers::new();
        constants(g, shapes, &mut bufs);
        let pass = layer.pass(Side::Forward, false);
        leaf_locations(pass, shapes, &mut bufs);
        // Hoisted stages read only inputs and parameters: on one step's rows
        // they run first, as over all rows before the loop.
        let order = [Placement::BeforeLoop, Placement::EachStep, Placement::AfterLoop];
        let stages: Vec<&ReadyStage> =
            order.iter().flat_map(|&at| pass.stages_at(at)).map(|&k| &code.forward[k]).collect();
        for st in &stages {
            for v in st.outputs() {
                bufs.rank_buf(v, shapes.elements(v), batch);
            }
        }
        let input = vec![0.0f32; batch * layer.input_size];
        let mut states: Vec<Vec<f32>> = layer.state_sizes.iter().map(|&n| vec![0.0; batch * n]).collect();
        // One step of `batch` sequences: row `(b, 0)` is row `b`, as is rank `b`.
        let order = BatchOrder::new(&vec![1; batch], 1)?;
        let layout = RowLayout::padded(&order, 1, Major::BatchFirst, Align::Left);
        let state_rows = SharedRows::each(&mut states);
        let rows = Rows { data: &input, layout: &layout, width: layer.input_size, offset: 0 };
        // A stream runs in evaluation: every row reads one row of masks
        // (rows 0 floats apart), set once, as an evaluation pass's.
        let mut masks = vec![0.0f32; layer.mask_width];
        if let (Some(rows), _) = job.masking.of_layer(&job.cell.forward, layer, k, 0) {
            super::host::fill_shared_row(&mut masks, &rows);
        }
        let mask_rows = Rows { data: &masks, layout: &layout, width: 0, offset: 0 };
        let frame = Frame {
            states: &state_rows,
            ..Frame::new((rows, Some(mask_rows)), layer, &job.params[k], weights)
        };
        let mut calls = Vec::new();
        for st in stages {
            match st {
                ReadyStage::Gemm { products, .. } => {
                    for p in products {
                        calls.push(Call::Product(ProductCall::locate(
                            p,
                            &bufs,
                            &frame,
                            (0, 0, 0),
                            batch,
                            1,
                            shapes,
                        )?));
                    }
                }
                ReadyStage::Pointwise { exec, .. } => {
                    let mut table = Vec::with_capacity(batch * (exec.inputs().len() + exec.outputs().len()));
                    for b in 0..batch {
                        for &v in exec.inputs().iter().chain(exec.outputs()) {
                            table.push(locate(&bufs, &frame, v, b, 0, b)?);
                        }
                    }
                    calls.push(Call::Pointwise { exec: exec.clone(), table, rows: batch });
                }
                ReadyStage::Sum | ReadyStage::AddMatrices { .. } => {
                    return Err(RuntimeError::Internal("a gradient stage in a forward step".into()))
                }
            }
        }
        let missing = |what: &str| RuntimeError::Internal(format!("a forward without {what}"));
        let output = pass.output.ok_or_else(|| missing("an output"))?;
        let outputs = (0..batch)
            .map(|b| locate(&bufs, &frame, output, b, 0, b).map(|p| p as *const f32))
            .collect::<Result<_>>()?;
        let mut next_states = Vec::new();
        for (i, &n) in layer.state_sizes.iter().enumerate() {
            let next = pass.carried[i].ok_or_else(|| missing("a next state"))?;
            for b in 0..batch {
                // SAFETY: state `i` holds `batch` rows of `n` floats.
                let row = unsafe { state_rows[i].at(b * n) };
                next_states.push((locate(&bufs, &frame, next, b, 0, b)? as *const f32, row, n));
            }
        }
        Ok(LayerStep {
            _code: code.clone(),
            _bufs: bufs,
            _masks: masks,
            input,
            states,
            calls,
            outputs,
            output_size: layer.output_size,
            next_states,
        })
    }

    /// One step: `x` is `[B, I]`, `y` gets `[B, O]`.
    fn step(&mut self, x: &[f32], y: &mut [f32]) {
        self.input.copy_from_slice(x);
        for call in &self.calls {
            match call {
                // SAFETY: every pointer was located in this stream's buffers
                // or the model's weights, which outlive it.
                Call::Product(p) => unsafe { p.run((0, 1)) },
                // SAFETY: as above; outputs are rows of their own buffers.
                Call::Pointwise { exec, table, rows } => unsafe { exec.run(*rows, table) },
            }
        }
        let o = self.output_size;
        for (row, &src) in y.chunks_exact_mut(o).zip(&self.outputs) {
            // SAFETY: each output row holds `o` floats.
            row.copy_from_slice(unsafe { std::slice::from_raw_parts(src, o) });
        }
        for &(src, dst, n) in &self.next_states {
            // SAFETY: both rows hold `n` floats; the next state's row is the
            // step's own value, never a state row.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
        }
    }
}

impl StepRunner for CpuStream<'_> {
    fn run(&mut self, input: &[f32], steps: usize, output: &mut [f32]) -> Result<()> {
        let last = self.layers.len() - 1;
        let (i, o) = (input.len() / steps.max(1), output.len() / steps.max(1));
        for s in 0..steps {
            let (x, y) = (&input[s * i..(s + 1) * i], &mut output[s * o..(s + 1) * o]);
            for k in 0..=last {
                let layer = &mut self.layers[k];
                match (k, k == last) {
                    (0, true) => layer.step(x, y),
                    (0, false) => layer.step(x, &mut self.between[0]),
                    (_, true) => layer.step(&self.between[k - 1], y),
                    (_, false) => {
                        let (done, rest) = self.between.split_at_mut(k);
                        layer.step(&done[k - 1], &mut rest[0]);
                    }
                }
            }
        }
        Ok(())
    }

    fn state(&self, layer: usize, i: usize) -> &[f32] {
        &self.layers[layer].states[i]
    }

    fn state_mut(&mut self, layer: usize, i: usize) -> &mut [f32] {
        &mut self.layers[layer].states[i]
    }
}
