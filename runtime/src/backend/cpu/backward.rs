//! One layer and direction backwards on the CPU, in the plan's phases:
//! where each value lives (the forward's tape read in place), the stages
//! before the loop over every row, the time loop backwards (step by step,
//! or one whole-sequence kernel), then the stages after the loop and the
//! gradients of the parameters, the input and the initial states.

use super::all_rows::{run_all_rows, valid_rows, AllRows};
use super::buffers::{constants, leaf_locations, locate, Buffers, Frame, Loc};
use super::host::{HostBackward, HostGradients, RowsMut, SharedRows};
use super::prepared::PreparedParams;
use super::profile::{Clock, Phase};
use super::row_sums::RowSums;
use super::sink::Sunk;
use super::stages::{pack_products, prepared_params, step_weight_bytes, ReadyStage};
use super::step_loop::{Frames, StepLoop};
use super::tape::CpuTape;
use super::team::Team;
use super::unit_split::{pieces, PassUnits};
use super::whole_sequence::{backward_whole_sequence, seeds_per_row, Walk};
use super::LayerCode;
use crate::error::{Result, RuntimeError};
use crate::plan::{Home, ParamGradient, PassPlan, TimeLoop};
use crate::pool;
use cellc::ir::ValueId;
use cellc::precision::Precision;
use cellc::program::{Kept, Side};
use cellc::schedule::Placement;
use cellc::shapes::Shapes;
use std::collections::HashMap;
use std::ops::Range;

/// Copies each value's row for `(b, t)` at rank `r` into layout row `row`
/// of its buffer (the backward's values kept for after the loop): the
/// whole row, or units `mine` of each block of `units`.
///
/// # Safety
/// Each buffer holds layout row `row` of its value's length, and no other
/// thread writes these units of it.
unsafe fn keep_row(
    kept: &[(ValueId, SharedRows)],
    (bufs, frame, shapes): (&Buffers, &Frame, &Shapes),
    (b, t, r): (usize, usize, usize),
    (row, units, mine): (usize, usize, &Option<Range<usize>>),
) -> Result<()> {
    for &(v, dst) in kept {
        let len = shapes.elements(v);
        let src = locate(bufs, frame, v, b, t, r)?;
        for piece in pieces(len, units, mine) {
            // SAFETY: the located row is valid for `len` floats; dst per the contract.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.add(piece.start),
                    dst.at(row * len + piece.start),
                    piece.len(),
                )
            };
        }
    }
    Ok(())
}

/// One layer and direction backwards over `job`'s batch, reading the
/// forward's `tape` and adding the input's adjoint into `d_input`: the
/// initial states' and the parameters' gradients.
pub(super) fn backward(
    (threads, precision, fuse): (usize, Precision, bool),
    code: &LayerCode,
    job: &HostBackward,
    tape: &CpuTape,
    d_input: &mut RowsMut,
) -> Result<HostGradients> {
    let (g, shapes) = (&*code.bwd_graph, &*code.bwd_shapes);
    let layer = job.layer;
    let pass = layer.pass(Side::Backward, true);
    let mut clock = Clock::start();
    let step_bytes = step_weight_bytes(pass, &code.backward, (shapes, precision));
    let team = Team::new(job.order, threads, step_bytes);
    let summed = Summed::of(code, pass);
    let (mut bufs, mut kept) = place_values(code, job, pass, tape, (&summed, &team))?;
    let in_loop = RowSums::new(&summed.in_loop, shapes, job.order.batch());
    let mut carry = team.by_rank(job.d_final, &layer.state_sizes);
    let mut local = None;
    let rows = (job.order.rows(), precision);
    let weights = prepared_params(job.prepared, &mut local, job.params.len(), rows);
    pack_products(weights, (g, &code.backward, shapes), job.params, None);

    // Before the loop: products that read no carried adjoint, over every valid row.
    let all_rows = valid_rows(job.order);
    let all = AllRows { order: job.order, rows: &all_rows, shapes, threads };
    clock.lap(Phase::Setup);
    run_all_rows(
        &code.backward,
        &pass.before_loop,
        &mut bufs,
        &frame_of(job, weights, &[]),
        &all,
        &mut HashMap::new(),
    )?;
    clock.lap(Phase::BeforeLoop);

    // The loop, backwards in time.
    match pass.time_loop {
        TimeLoop::WholeSequence(k) => {
            let ReadyStage::Pointwise { exec } = &code.backward[k] else {
                return Err(RuntimeError::Internal("a whole-sequence stage that is not a kernel".into()));
            };
            let walk = Walk { job, exec: exec.as_ref(), threads };
            backward_whole_sequence(&walk, &mut bufs, weights, pass, team.order(), &mut carry)?;
            // The kernel kept every value per row; the carried adjoints are
            // the next row's state adjoints, or the final ones.
            kept.clear();
            for &(v, i) in &pass.carries_for_after_loop {
                kept.insert(v, seeds_per_row(job, pass, &bufs, i, job.layout_rows())?);
            }
            clock.lap(Phase::WholeSequence);
        }
        TimeLoop::Steps(_) => {
            let carry_rows = SharedRows::each(&mut carry);
            let frame = frame_of(job, weights, &carry_rows);
            let split = (code.bwd_units.as_ref().filter(|_| fuse))
                .filter(|k| moves_units((pass, &layer.state_sizes), (shapes, &summed.in_loop), k.units))
                .and_then(|k| {
                    PassUnits::new(k, (&code.backward, pass.stages_at(Placement::EachStep)), &team, weights)
                })
                .map(|split| split.meeting_at_step_end(!products_read_rows_of_their_step(code, pass, &bufs)));
            let steps =
                Steps { code, job, pass, team: &team, bufs: &bufs, frame: &frame, split: split.as_ref() };
            steps.run(&mut kept, &in_loop)?;
            // The loop's threads timed their own phases: the clock starts again after it.
            clock = Clock::start();
        }
    }

    // After the loop, over every valid row.
    for (v, data) in kept {
        bufs.row_data(v, data);
    }
    let carry_rows = SharedRows::each(&mut carry);
    let frame = frame_of(job, weights, &carry_rows);
    let mut matrices: HashMap<ValueId, Vec<f32>> = HashMap::new();
    run_all_rows(&code.backward, &pass.after_loop, &mut bufs, &frame, &all, &mut matrices)?;
    let after_loop = RowSums::new(&summed.after_loop, shapes, job.order.batch());
    after_loop.add_kept_rows((&bufs, &frame), job.order, job.reverse, threads)?;
    let d_params = param_gradients(job, pass, [&in_loop, &after_loop], matrices)?;
    add_input_adjoint(job, pass, (&bufs, &frame), &all_rows, d_input)?;
    let d_h0 = layer
        .state_sizes
        .iter()
        .enumerate()
        .map(|(i, &m)| {
            let mut out = vec![0.0; job.order.batch() * m];
            for (r, &b) in team.order().iter().enumerate() {
                out[b * m..(b + 1) * m].copy_from_slice(&carry[i][r * m..(r + 1) * m]);
            }
            out
        })
        .collect();
    clock.lap(Phase::AfterLoop);
    Ok(HostGradients { d_h0, d_params })
}

/// Whether everything a step's bookkeeping moves (the carried adjoints,
/// the rows kept for after the loop and the rows summed in the loop) is
/// blocks of `units` floats, so that a thread moves its own units of it.
fn moves_units(
    (pass, state_sizes): (&PassPlan, &[usize]),
    (shapes, summed): (&Shapes, &[ValueId]),
    units: usize,
) -> bool {
    let moved = pass.carried.iter().flatten().chain(&pass.kept_for_after_loop).chain(summed);
    let sizes = moved.map(|&v| shapes.elements(v)).chain(state_sizes.iter().copied());
    units > 0 && { sizes }.all(|n| n.is_multiple_of(units))
}

/// Whether every per-step product reads its operand at the layout's rows
/// (each step's row its own), rather than in a row each step overwrites.
fn products_read_rows_of_their_step(code: &LayerCode, pass: &PassPlan, bufs: &Buffers) -> bool {
    (pass.stages_at(Placement::EachStep).iter()).all(|&k| match &code.backward[k] {
        ReadyStage::Gemm { products } => {
            products.iter().all(|&(_, _, _, x)| bufs.loc(x) == Some(Loc::RowBuf))
        }
        _ => true,
    })
}

/// The backward's frame over `job`'s rows, with the carried adjoints `carry`.
fn frame_of<'a>(job: &'a HostBackward, weights: &'a PreparedParams, carry: &'a [SharedRows]) -> Frame<'a> {
    let layer = job.layer;
    let d_output = Some((job.d_output, layer.output_size));
    Frame {
        carry,
        d_output,
        backward: Some(job),
        ..Frame::new((job.input, job.masks), layer, job.params, weights)
    }
}

/// Layout rows per value the backward keeps for after its loop.
type KeptRows = HashMap<ValueId, Vec<f32>>;

/// The values' storage for a backward pass: constants, the leaves where
/// the plan says, the forward's values it reads in the tape's rows,
/// per-step values in rank rows and the rest in layout rows; and the
/// layout rows each step copies into, of the values the plan keeps for
/// after the loop that a per-step product reads by rank. The others the
/// loop's kernels write straight into their layout rows (see
/// [`in_layout_rows`]).
fn place_values(
    code: &LayerCode,
    job: &HostBackward,
    pass: &PassPlan,
    tape: &CpuTape,
    (summed, team): (&Summed, &Team),
) -> Result<(Buffers, KeptRows)> {
    let (g, shapes) = (&*code.bwd_graph, &*code.bwd_shapes);
    let (batch, layout_rows) = (job.order.batch(), job.layout_rows());
    let mut bufs = Buffers::new();
    constants(g, shapes, &mut bufs);
    leaf_locations(pass, shapes, &mut bufs);
    for (v, home) in pass.homes() {
        let loc = match home {
            Home::Tape(kept) => Loc::TapeRows(tape.part(kept)?.as_ptr() as *mut f32),
            Home::StateBeforeFromTape(i) => {
                Loc::StateBeforeFromTape(tape.part(Kept::StateAfter(i))?.as_ptr() as *mut f32, i)
            }
            _ => continue,
        };
        bufs.place(v, loc, shapes.elements(v));
    }
    let each_step = pass.stages_at(Placement::EachStep);
    let direct: Vec<ValueId> = in_layout_rows(code, job, pass, team)
        .into_iter()
        .filter(|v| !summed.only_in_loop.contains(v))
        .collect();
    for (k, st) in code.backward.iter().enumerate() {
        for v in st.outputs() {
            match pass.home(v) {
                Some(Home::Fixed) => {}
                _ if each_step.contains(&k) && !direct.contains(&v) => {
                    bufs.rank_buf(v, shapes.elements(v), batch)
                }
                _ => bufs.row_buf(v, shapes.elements(v), layout_rows),
            }
        }
    }
    let persisted = (pass.kept_for_after_loop.iter().copied())
        .filter(|v| !direct.contains(v) && !summed.only_in_loop.contains(v));
    let persisted = persisted.chain(pass.carries_for_after_loop.iter().map(|&(v, _)| v));
    let kept = persisted.map(|v| (v, pool::take(layout_rows * shapes.elements(v)))).collect();
    Ok((bufs, kept))
}

/// The values the plan keeps for after the loop that the loop's kernels
/// write straight into their layout rows, when the loop runs step by step:
/// those no per-step product writes or takes as its matrix, and that
/// none reads as its rows, unless each product's rows lie evenly spaced at
/// the layout at every step ([`Team::products_read_evenly`]: a product
/// reads the step's rows one stride apart). Each saves a copy of every row
/// at every step: a LayerNorm-LSTM keeps five rows of parameter gradients
/// and one of the input projection's adjoint this way; on a batch of equal
/// lengths, the LSTM its gates' adjoint too.
fn in_layout_rows(code: &LayerCode, job: &HostBackward, pass: &PassPlan, team: &Team) -> Vec<ValueId> {
    if !matches!(pass.time_loop, TimeLoop::Steps(_)) {
        return Vec::new();
    }
    let order = team.order();
    let at_layout = |r: usize, s: usize| {
        let b = order[r];
        job.input.layout.row(b, job.order.time(b, s, job.reverse))
    };
    let rows_in_place = team.products_read_evenly(job.order.steps(), at_layout);
    let products = (pass.stages_at(Placement::EachStep).iter()).filter_map(|&k| match &code.backward[k] {
        ReadyStage::Gemm { products } => Some(products.iter()),
        _ => None,
    });
    let by_rank: Vec<ValueId> = products
        .flatten()
        .flat_map(|&(out, _, m, x)| [Some(out), Some(m), (!rows_in_place).then_some(x)])
        .flatten()
        .collect();
    pass.kept_for_after_loop.iter().copied().filter(|v| !by_rank.contains(v)).collect()
}

/// The plan's step-by-step loop backwards over a pass's placed values.
struct Steps<'a> {
    code: &'a LayerCode,
    job: &'a HostBackward<'a>,
    pass: &'a PassPlan,
    team: &'a Team,
    bufs: &'a Buffers,
    frame: &'a Frame<'a>,
    /// The step split by units, if the pass runs it so.
    split: Option<&'a PassUnits<'a>>,
}

impl Steps<'_> {
    /// Runs every step backwards in time across the batch's ranks, each
    /// thread writing only its ranks' carried adjoints (`frame.carry`) and
    /// its sequences' rows of `kept`.
    fn run(&self, kept: &mut KeptRows, sums: &RowSums) -> Result<()> {
        let Steps { code, job, pass, team, bufs, frame, split } = *self;
        let (layer, order, shapes) = (job.layer, team.order(), &*code.bwd_shapes);
        let units = code.bwd_units.as_ref().map_or(0, |k| k.units);
        let kept_rows: Vec<(ValueId, SharedRows)> =
            kept.iter_mut().map(|(&v, b)| (v, SharedRows::of(b))).collect();
        // Whole rows of the thread's ranks, or (split by units) its units of every rank.
        let after = |s: usize, ranks: Range<usize>, mine: Option<Range<usize>>| -> Result<()> {
            for r in ranks {
                let b = order[r];
                let t = job.order.time(b, s, job.reverse);
                let row = job.input.layout.row(b, t);
                // SAFETY (block): rank r's carried adjoints and sequence b's
                // kept rows and sums, or these units of them, belong to this
                // thread alone; located rows are valid for their values' lengths.
                unsafe {
                    keep_row(&kept_rows, (bufs, frame, shapes), (b, t, r), (row, units, &mine))?;
                    sums.add((bufs, frame), (b, t, r), (units, &mine))?;
                    // The carry is replaced in place: this row's stages have
                    // read it, and the kept rows above were copied first.
                    for (i, &m) in layer.state_sizes.iter().enumerate() {
                        let dst = frame.carry[i].at(r * m);
                        let src = pass.carried[i].map(|v| locate(bufs, frame, v, b, t, r)).transpose()?;
                        for piece in pieces(m, units, &mine) {
                            let (at, n) = (piece.start, piece.len());
                            match src {
                                Some(src) => std::ptr::copy(src.add(at), dst.add(at), n),
                                None => std::ptr::write_bytes(dst.add(at), 0, n),
                            }
                        }
                    }
                }
            }
            Ok(())
        };
        let steps: Vec<usize> = (0..job.order.steps()).rev().collect();
        let each_step = StepLoop {
            team,
            stages: &code.backward,
            each_step: pass.stages_at(Placement::EachStep),
            bufs,
            frames: Frames::one(frame),
            shapes,
            order: job.order,
            reverse: job.reverse,
            tiles: None,
            units: split,
            sunk: &Sunk::default(),
        };
        each_step.run(&steps, &after)
    }
}

/// The parameters' gradients, in the cell's order: products accumulated
/// over rows (`matrices`, from the stages after the loop), or sums of rows
/// (from `sums`: those the loop added up, then those of rows kept for
/// after it).
fn param_gradients(
    job: &HostBackward,
    pass: &PassPlan,
    sums: [&RowSums; 2],
    mut matrices: HashMap<ValueId, Vec<f32>>,
) -> Result<Vec<Vec<f32>>> {
    let mut d_params = Vec::with_capacity(job.params.len());
    for (i, d) in pass.d_params.iter().enumerate() {
        let len = job.params[i].len();
        match *d {
            None => d_params.push(vec![0.0; len]),
            Some(ParamGradient::Matrix(v)) => {
                // Two parameters may share one gradient (`w @ x + u @ x`): the last takes it.
                let shared = pass.d_params[i + 1..].iter().flatten().any(|g| g.value() == v);
                let matrix = if shared { matrices.get(&v).cloned() } else { matrices.remove(&v) };
                d_params.push(
                    matrix.ok_or_else(|| {
                        RuntimeError::Internal(format!("weight gradient {v} is not computed"))
                    })?,
                )
            }
            Some(ParamGradient::SumOfRows(v)) => {
                let [in_loop, after_loop] = sums;
                d_params.push(if in_loop.has(v) { in_loop.total(v)? } else { after_loop.total(v)? })
            }
        }
    }
    Ok(d_params)
}

/// The parameter gradients that are sums of rows, by where they are
/// added up ([`RowSums`]).
struct Summed {
    /// Values the loop's steps compute: added as the loop goes.
    in_loop: Vec<ValueId>,
    /// Of those, the ones nothing else reads after the loop: not kept per row.
    only_in_loop: Vec<ValueId>,
    /// The rest (computed before or after the loop, or by a whole-sequence
    /// kernel): added from their rows after the loop.
    after_loop: Vec<ValueId>,
}

impl Summed {
    fn of(code: &LayerCode, pass: &PassPlan) -> Summed {
        // Each once: two biases may share one gradient (`w @ x + b + u @ h + c`).
        let mut all: Vec<ValueId> = Vec::new();
        for d in pass.d_params.iter().flatten() {
            if let ParamGradient::SumOfRows(v) = *d {
                if !all.contains(&v) {
                    all.push(v);
                }
            }
        }
        let stepped = matches!(pass.time_loop, TimeLoop::Steps(_));
        let (in_loop, after_loop): (Vec<ValueId>, Vec<ValueId>) =
            all.into_iter().partition(|v| stepped && pass.kept_for_after_loop.contains(v));
        let read_after_loop: Vec<ValueId> = (pass.after_loop.iter())
            .flat_map(|&k| match &code.backward[k] {
                ReadyStage::Gemm { products } => products.iter().flat_map(|&(_, _, m, x)| [m, x]).collect(),
                ReadyStage::Pointwise { exec } => exec.inputs().to_vec(),
                ReadyStage::Sum | ReadyStage::AddMatrices { .. } => Vec::new(),
            })
            .chain(pass.d_inputs.iter().flatten().copied())
            .collect();
        let only_in_loop = in_loop.iter().copied().filter(|v| !read_after_loop.contains(v)).collect();
        Summed { in_loop, only_in_loop, after_loop }
    }
}

/// Adds the input's adjoint, every valid row of each input's slice, into `d_input`.
fn add_input_adjoint(
    job: &HostBackward,
    pass: &PassPlan,
    (bufs, frame): (&Buffers, &Frame),
    all_rows: &[(usize, usize, usize)],
    d_input: &mut RowsMut,
) -> Result<()> {
    let layer = job.layer;
    for (d, &(o, l)) in pass.d_inputs.iter().zip(&layer.input_slices) {
        let Some(v) = d else { continue };
        for &(b, t, _) in all_rows {
            let p = locate(bufs, frame, *v, b, t, 0)?;
            // SAFETY: a located row of `l` floats of v, in a buffer of this run (not d_input).
            let row = unsafe { std::slice::from_raw_parts(p, l) };
            let dst = d_input.get_mut(b, t, layer.input_size);
            dst[o..o + l].iter_mut().zip(row).for_each(|(a, x)| *a += x);
        }
    }
    Ok(())
}
