//! One layer and direction forwards on the CPU, in the plan's phases:
//! where each value lives, the stages before the loop over every row, then
//! the time loop (step by step across the batch's ranks, or one
//! whole-sequence kernel); the final states.

use super::all_rows::{run_all_rows, valid_rows, AllRows};
use super::buffers::{constants, leaf_locations, locate, Buffers, Frame, Loc};
use super::host::{HostForward, RowsMut, SharedRows};
use super::profile::{Clock, Phase};
use super::sink::{self, Sunk};
use super::stages::{pack_products, prepared_params, step_weight_bytes, Product, ReadyStage};
use super::step_loop::{Frames, StepLoop};
use super::tape::CpuTape;
use super::team::Team;
use super::tiles::{FusedStep, PassTiles};
use super::whole_sequence::{forward_whole_sequence, Walk};
use super::LayerCode;
use crate::error::{Result, RuntimeError};
use crate::plan::{Home, PassPlan, TapeSource, TimeLoop};
use cellc::ir::ValueId;
use cellc::precision::Precision;
use cellc::program::Side;
use cellc::schedule::Placement;
use std::collections::HashMap;

/// One layer and direction forwards over `job`'s batch, writing `output`
/// and, training, `tape`: the final states.
pub(super) fn forward(
    (threads, precision, fuse): (usize, Precision, bool),
    code: &LayerCode,
    job: &HostForward,
    output: &mut RowsMut,
    tape: Option<&mut [f32]>,
) -> Result<Vec<Vec<f32>>> {
    let (g, shapes) = (&*code.fwd_graph, &*code.fwd_shapes);
    let layer = job.layer;
    let pass = layer.pass(Side::Forward, tape.is_some());
    let mut clock = Clock::start();
    let step_bytes = step_weight_bytes(pass, &code.forward, (shapes, precision));
    let team = Team::new(job.order, threads, step_bytes);
    let mut states = team.by_rank(job.h0, &layer.state_sizes);
    let mut local = None;
    let rows = (job.order.rows(), precision);
    let weights = prepared_params(job.prepared, &mut local, job.params.len(), rows);
    // Hoisted products run in the step instead, each thread on its sequences.
    let to_sink = match fuse {
        true => {
            let sinkable = &layer.schedule.sinkable;
            sink::stages_to_sink(&team, sinkable, (pass, precision, shapes), (&code.forward, step_bytes))
        }
        false => Vec::new(),
    };
    let tiles = match &code.fused {
        Some(step) if fuse && fuses(step, pass, job, tape.is_some()) => {
            let products = code.forward[step.fusion.gemm].outputs();
            PassTiles::new(step, (g, shapes, &products), (job.params, weights), &team, &to_sink)?
        }
        _ => None,
    };
    pack_products(weights, (g, &code.forward, shapes), job.params, tiles.as_ref().map(|t| &t.products));
    let sunk: Vec<usize> = to_sink.iter().map(|(k, _)| *k).collect();
    // What the fused step does not run tile by tile runs at each step's start.
    let at_step_start: Vec<(usize, Vec<Product>)> =
        (to_sink.into_iter()).filter(|(k, _)| !tiles.as_ref().is_some_and(|t| t.sunk.contains(k))).collect();
    let at_step_start = Sunk::of(&at_step_start);
    // A fused step's states take two buffers in turn (see `Frames`), and
    // its kernel writes the next states straight into the other one.
    let in_turn = tiles.is_some() && matches!(pass.time_loop, TimeLoop::Steps(_));
    let (mut bufs, mut tape) = place_values(code, job, pass, tape, (&sunk, in_turn))?;
    let mut spare = if tiles.is_some() { states.clone() } else { Vec::new() };
    let state_rows = SharedRows::each(&mut states);
    let spare_rows = SharedRows::each(&mut spare);
    let frame = Frame {
        states: &state_rows,
        // (empty without a spare buffer; read only where `place_values` placed a next state there)
        next_states: &spare_rows,
        tiles: tiles.as_ref().map(|t| &t.products),
        ..Frame::new((job.input, job.masks), layer, job.params, weights)
    };
    clock.lap(Phase::Setup);

    // Before the loop: every valid row.
    let all_rows = valid_rows(job.order);
    let all = AllRows { order: job.order, rows: &all_rows, shapes, threads };
    let before_loop: Vec<usize> = pass.before_loop.iter().copied().filter(|k| !sunk.contains(k)).collect();
    run_all_rows(&code.forward, &before_loop, &mut bufs, &frame, &all, &mut HashMap::new())?;
    clock.lap(Phase::BeforeLoop);

    // The loop.
    let output_value =
        pass.output.ok_or_else(|| RuntimeError::Internal("a forward without an output".into()))?;
    let next_states: Vec<ValueId> = pass
        .carried
        .iter()
        .map(|v| v.ok_or_else(|| RuntimeError::Internal("a next state that is never computed".into())))
        .collect::<Result<_>>()?;
    let chained = (output_value, &next_states[..]);
    match pass.time_loop {
        TimeLoop::WholeSequence(k) => {
            let ReadyStage::Pointwise { exec } = &code.forward[k] else {
                return Err(RuntimeError::Internal("a whole-sequence stage that is not a kernel".into()));
            };
            let walk = Walk { job, exec: exec.as_ref(), threads };
            let finals =
                forward_whole_sequence(&walk, chained, output, &mut bufs, weights, pass, tape.as_mut());
            clock.lap(Phase::WholeSequence);
            finals
        }
        TimeLoop::Steps(_) => {
            let odd_frame =
                tiles.as_ref().map(|_| Frame { states: &spare_rows, next_states: &state_rows, ..frame });
            let frames = Frames { even: &frame, odd: odd_frame.as_ref() };
            let steps = Steps {
                code,
                job,
                pass,
                team: &team,
                bufs: &bufs,
                frames,
                tiles: tiles.as_ref(),
                sunk: &at_step_start,
            };
            steps.run(chained, output, tape.as_mut())
        }
    }
}

/// Whether a pass may run `step` fused: it is the pass's last per-step
/// stage, and everything the per-row bookkeeping moves (the output, the
/// states, the tape's copied rows) is one block of the unit, so that each
/// thread moves its own units of it.
fn fuses(step: &FusedStep, pass: &PassPlan, job: &HostForward, training: bool) -> bool {
    let units = step.units;
    let layer = job.layer;
    pass.stages_at(Placement::EachStep).last() == Some(&step.fusion.pointwise)
        && layer.output_size == units
        && layer.state_sizes.iter().all(|&n| n == units)
        && (!training
            || pass
                .tape
                .iter()
                .zip(layer.tape().parts())
                .all(|(write, part)| write.direct || part.floats == units))
}

/// The values' storage for a forward pass: constants, the leaves where the
/// plan says, the values it writes straight into the tape (laid over the
/// caller's memory, its padding rows zeroed), layout rows for what runs
/// before the loop and what the plan keeps by layout row, rank rows for
/// the rest (a whole-sequence kernel's outputs are given layout rows
/// where it runs). With `in_turn` (states in two buffers taken in turn),
/// the next states that a per-step kernel computes are written straight
/// into the next step's buffer ([`Loc::NextState`]).
fn place_values(
    code: &LayerCode,
    job: &HostForward,
    pass: &PassPlan,
    tape: Option<&mut [f32]>,
    (sunk, in_turn): (&[usize], bool),
) -> Result<(Buffers, Option<CpuTape>)> {
    let (g, shapes) = (&*code.fwd_graph, &*code.fwd_shapes);
    let (batch, layout_rows) = (job.order.batch(), job.layout_rows());
    let mut bufs = Buffers::new();
    constants(g, shapes, &mut bufs);
    leaf_locations(pass, shapes, &mut bufs);
    let mut tape = match tape {
        None => None,
        // SAFETY: the tape lives for this call, which borrows `memory` mutably.
        Some(memory) => {
            let mut t =
                unsafe { CpuTape::in_caller(job.layer, layout_rows, memory.as_mut_ptr(), memory.len())? };
            t.zero_padding(job, layout_rows);
            Some(t)
        }
    };
    if let Some(t) = tape.as_mut() {
        for (write, (_, rows)) in pass.tape.iter().zip(&mut t.parts) {
            if let (true, TapeSource::Value(v)) = (write.direct, write.source) {
                bufs.place(v, Loc::TapeRows(rows.as_mut_ptr()), shapes.elements(v));
            }
        }
    }
    let each_step = pass.stages_at(Placement::EachStep);
    for (k, st) in code.forward.iter().enumerate() {
        let hoisted = pass.before_loop.contains(&k);
        let per_step_kernel = each_step.contains(&k) && matches!(st, ReadyStage::Pointwise { .. });
        for v in st.outputs() {
            if let (true, true, Some(Home::NextState(i))) = (in_turn, per_step_kernel, pass.home(v)) {
                bufs.place(v, Loc::NextState(i), shapes.elements(v));
                continue;
            }
            if sunk.contains(&k) {
                // Run in the step instead, for the step's rows.
                bufs.rank_buf(v, shapes.elements(v), batch);
                continue;
            }
            match pass.home(v) {
                Some(Home::Tape(_)) => {}
                Some(Home::Layout) => bufs.row_buf(v, shapes.elements(v), layout_rows),
                _ if hoisted => bufs.row_buf(v, shapes.elements(v), layout_rows),
                _ => bufs.rank_buf(v, shapes.elements(v), batch),
            }
        }
    }
    Ok((bufs, tape))
}

/// The plan's step-by-step loop forwards over a pass's placed values.
struct Steps<'a> {
    code: &'a LayerCode,
    job: &'a HostForward<'a>,
    pass: &'a PassPlan,
    team: &'a Team,
    bufs: &'a Buffers,
    frames: Frames<'a>,
    tiles: Option<&'a PassTiles<'a>>,
    /// Products hoisted before the loop run at each step's start instead.
    sunk: &'a Sunk,
}

impl Steps<'_> {
    /// Runs every step across the batch's ranks, each thread writing only
    /// the rows of its ranks: their output rows, their tape rows, their
    /// states, and their sequences' final states (returned).
    fn run(
        &self,
        (output_value, next_states): (ValueId, &[ValueId]),
        output: &mut RowsMut,
        tape: Option<&mut CpuTape>,
    ) -> Result<Vec<Vec<f32>>> {
        let Steps { code, job, pass, team, bufs, frames, tiles, sunk } = *self;
        let layer = job.layer;
        let order = team.order();
        let mut finals: Vec<Vec<f32>> =
            layer.state_sizes.iter().map(|&n| vec![0.0; job.order.batch() * n]).collect();
        let out = SharedRows::of(output.data);
        let (out_width, out_offset, out_layout) = (output.width, output.offset, output.layout);
        let finals_rows = SharedRows::each(&mut finals);
        // The tape's parts that are copied each step, and what from.
        let copies: Vec<(TapeSource, SharedRows, usize)> = match tape {
            None => Vec::new(),
            Some(t) => pass
                .tape
                .iter()
                .zip(&mut t.parts)
                .filter(|(write, _)| !write.direct)
                .map(|(write, (part, rows))| (write.source, SharedRows::of(rows), part.floats))
                .collect(),
        };
        // Each row's `units` of a value of `n` floats (all of them, unfused):
        // the offset and the length.
        let part = |n: usize, units: &Option<std::ops::Range<usize>>| match units {
            Some(u) => (u.start, u.len()),
            None => (0, n),
        };
        let after =
            |s: usize, ranks: std::ops::Range<usize>, units: Option<std::ops::Range<usize>>| -> Result<()> {
                let (o, o_len) = part(layer.output_size, &units);
                for r in ranks {
                    let b = order[r];
                    let t = job.order.time(b, s, job.reverse);
                    // SAFETY (block): every row written is this rank's (sequence b's
                    // row at t, rank r's state), or this thread's units of it (a
                    // fused step: see `fuses`), which no other thread touches; the
                    // located rows are valid for their values' lengths.
                    // Step `s` reads its states in one frame and writes the
                    // next ones in the next step's (the same frame unfused).
                    let (frame, next) = (frames.at(s), frames.at(s + 1));
                    unsafe {
                        let out_row = out.at(out_layout.row(b, t) * out_width + out_offset + o);
                        std::ptr::copy_nonoverlapping(
                            locate(bufs, frame, output_value, b, t, r)?.add(o),
                            out_row,
                            o_len,
                        );
                        // The tape's rows, before the states move on.
                        let row = job.input.layout.row(b, t);
                        for &(source, dst, len) in &copies {
                            let src = match source {
                                TapeSource::StateBefore(i) => frame.states[i].at(r * len),
                                TapeSource::Value(v) => locate(bufs, frame, v, b, t, r)?,
                            };
                            let (at, n) = part(len, &units);
                            std::ptr::copy_nonoverlapping(src.add(at), dst.at(row * len + at), n);
                        }
                        for (i, &m) in layer.state_sizes.iter().enumerate() {
                            let (at, n) = part(m, &units);
                            let state = next.states[i].at(r * m + at);
                            // The new state replaces the old (in place, unless
                            // they ping-pong): this row's stages have read it, and
                            // no other row reads it. Written there by the step's
                            // kernel ([`Loc::NextState`]), it is already in place.
                            let new = locate(bufs, frame, next_states[i], b, t, r)?.add(at);
                            if new != state {
                                std::ptr::copy(new, state, n);
                            }
                            if s + 1 == job.order.lengths()[b] {
                                std::ptr::copy_nonoverlapping(state, finals_rows[i].at(b * m + at), n);
                            }
                        }
                    }
                }
                Ok(())
            };
        let steps: Vec<usize> = (0..job.order.steps()).collect();
        let each_step = StepLoop {
            team,
            stages: &code.forward,
            each_step: pass.stages_at(Placement::EachStep),
            bufs,
            frames,
            shapes: &code.fwd_shapes,
            order: job.order,
            reverse: job.reverse,
            tiles,
            units: None,
            sunk,
        };
        each_step.run(&steps, &after)?;
        Ok(finals)
    }
}
