//! Checking one cell on one [`Case`]: it compiles; its derived backward
//! passes gradcheck; and every back end, as a model of the case's layers
//! and directions on the case's batch, computes what the per-sequence
//! interpreter computes, forwards (inference and training) and backwards,
//! in a layout of its own per pass. Training takes one of the routes users
//! take ([`Route`]): the model's own passes, or the caller-memory pair
//! that the Python package and the candle layer use, over host memory or
//! (on the emulated device) device memory.
//!
//! The interpreter runs a cell's masks (`dropout`, `zoneout`, ...) in
//! evaluation, so a cell with masks is held to it in evaluation-mode passes
//! (inference, and a training pass with no mask seed); its training-mode
//! passes, which draw masks, are held to the reference back end's pass at
//! the same seed ([`TrainingReference`]). The masks themselves must be
//! the same when drawn again and in every layout, and a training pass at
//! every rate 0 must be exactly the evaluation pass.

use crate::backends::{self, BackendKind};
use crate::batch::{Batch, LaidOut, Layout};
use crate::oracle::{noise, oracle, twins_in, Oracle};
use cellc::dims::Bindings;
use cellc::fuzzgen::Entropy;
use cellc_runtime::masks::SeenMask;
use cellc_runtime::{
    BackwardOut, Call, CallOptions, CompiledCell, DeviceBackwardOut, DeviceCall, DeviceFloats,
    DeviceForwardOut, ForwardOut, Gradients, Input, MaskSeed, Model, ModelConfig, Precision, RowLayout,
    RuntimeError,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Everything about a run but the cell: sizes, model shape, batch and
/// the seed of the data and weights. Written into reproducers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Case {
    pub seed: u64,
    pub sizes: BTreeMap<String, usize>,
    pub layers: usize,
    pub bidirectional: bool,
    pub lengths: Vec<usize>,
    pub steps: usize,
    /// Per-step resets, `(sequence, step)` ([`Batch::resets`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resets: Vec<(usize, usize)>,
}

impl Case {
    /// A random case for a cell whose size variables are `variables`:
    /// sizes 1 to 6 (1 and odd ones included), 1-2 layers, either
    /// direction, 1-5 unsorted sequences of 1-6 steps, sometimes padded
    /// beyond the longest.
    pub fn random(rng: &mut Entropy, variables: &[String]) -> Case {
        let sizes = variables.iter().map(|v| (v.clone(), 1 + rng.below(6))).collect();
        let batch = 1 + rng.below(5);
        let lengths: Vec<usize> = (0..batch).map(|_| 1 + rng.below(6)).collect();
        let longest = lengths.iter().copied().max().unwrap_or(1);
        let mut case = Case {
            seed: rng.next_u64(),
            sizes,
            layers: 1 + rng.below(2),
            bidirectional: rng.chance(1, 2),
            steps: longest + usize::from(rng.chance(1, 4)),
            lengths,
            resets: Vec::new(),
        };
        // A third of the cases reset some sequences at a step or two (a
        // first step among them now and then, which changes nothing).
        if rng.chance(1, 3) {
            for (b, &len) in case.lengths.iter().enumerate() {
                for _ in 0..rng.below(3) {
                    case.resets.push((b, rng.below(len)));
                }
            }
        }
        case
    }

    /// Smaller variants: one layer, one direction, fewer or shorter sequences, smaller sizes.
    pub fn smaller(&self) -> Vec<Case> {
        let mut out = Vec::new();
        if self.layers > 1 {
            out.push(Case { layers: 1, ..self.clone() });
        }
        if self.bidirectional {
            out.push(Case { bidirectional: false, ..self.clone() });
        }
        if !self.resets.is_empty() {
            out.push(Case { resets: Vec::new(), ..self.clone() });
        }
        for b in 0..self.lengths.len() {
            if self.lengths.len() > 1 {
                let mut lengths = self.lengths.clone();
                lengths.remove(b);
                let steps = self.steps.min(lengths.iter().copied().max().unwrap_or(1) + 1);
                let resets = self
                    .resets
                    .iter()
                    .filter(|&&(s, _)| s != b)
                    .map(|&(s, t)| (if s > b { s - 1 } else { s }, t))
                    .collect();
                out.push(Case { lengths, steps, resets, ..self.clone() });
            }
        }
        if self.steps > self.lengths.iter().copied().max().unwrap_or(1) {
            out.push(Case { steps: self.steps - 1, ..self.clone() });
        }
        for (k, &v) in &self.sizes {
            if v > 1 {
                let mut sizes = self.sizes.clone();
                sizes.insert(k.clone(), if v > 2 { 2 } else { 1 });
                out.push(Case { sizes, ..self.clone() });
            }
        }
        out
    }
}

/// Which check failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Check {
    /// The generated cell does not compile (a generator or compiler bug).
    Compile,
    /// The derived backward disagrees with finite differences.
    Gradcheck,
    /// The interpreter could not run the case.
    Oracle,
    /// A back end failed, disagreed with the interpreter, or panicked.
    Backend(BackendKind),
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Check::Compile => write!(f, "compile"),
            Check::Gradcheck => write!(f, "gradcheck"),
            Check::Oracle => write!(f, "interpreter"),
            Check::Backend(b) => write!(f, "{}", b.name()),
        }
    }
}

/// A failed check and what went wrong.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    pub check: Check,
    pub message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.check, self.message)
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Checks {
    pub gradcheck: bool,
    pub backends: Vec<BackendKind>,
}

impl Checks {
    /// Every check; the emulated CUDA device only where g++ is installed,
    /// the AVX-512 and AVX2 kernels only where the processor has them.
    pub fn everything() -> Checks {
        let cuda = backends::cuda_emulation_available();
        let (avx512, avx2) =
            (cellc_runtime::backend::cpu::avx512_supported(), cellc_runtime::backend::cpu::avx2_supported());
        Checks {
            gradcheck: true,
            backends: BackendKind::ALL
                .into_iter()
                .filter(|&b| cuda || !b.is_cuda())
                .filter(|&b| avx512 || b != BackendKind::CpuAvx512)
                .filter(|&b| avx2 || b != BackendKind::CpuAvx2)
                .collect(),
        }
    }

    /// These checks without back end `kind`.
    pub fn without(mut self, kind: BackendKind) -> Checks {
        self.backends.retain(|&b| b != kind);
        self
    }

    /// Only the check that failed (for shrinking).
    pub fn only(check: Check) -> Checks {
        match check {
            Check::Backend(b) => Checks { gradcheck: false, backends: vec![b] },
            Check::Gradcheck => Checks { gradcheck: true, backends: Vec::new() },
            Check::Compile | Check::Oracle => Checks { gradcheck: false, backends: Vec::new() },
        }
    }
}

/// What a passing check ran.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Passed {
    /// Forward and backward passes run (each back end runs two forwards
    /// and a backward; for a cell with masks, three forwards and
    /// backwards more).
    pub passes: usize,
    /// The case as run: one layer where the cell cannot be stacked.
    pub layers: usize,
}

/// What a pass's values are held to: whose values they are (for
/// messages), and within what tolerance ([`compare`]).
#[derive(Clone, Copy, Debug)]
struct Against<'a> {
    source: &'a str,
    tol: f64,
}

impl Against<'_> {
    /// The interpreter's values, within `tol`.
    fn interpreter(tol: f64) -> Against<'static> {
        Against { source: "the interpreter", tol }
    }
}

/// `f32` results against `f64` ones: `|a - b| / max(1, |b|)` within the
/// tolerance (NaN only where the values held to have NaN).
fn compare(what: &str, got: &[f32], want: &[f64], against: Against) -> Result<(), String> {
    let Against { source, tol } = against;
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, {source} has {}", got.len(), want.len()));
    }
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let a = a as f64;
        let ok = if b.is_nan() || a.is_nan() {
            b.is_nan() && a.is_nan()
        } else if b.is_infinite() || a.is_infinite() {
            a == b
        } else {
            (a - b).abs() / b.abs().max(1.0) <= tol
        };
        if !ok {
            return Err(format!("{what}[{i}] is {a:e}, {source} gives {b:e}"));
        }
    }
    Ok(())
}

/// The tolerances: `|a - b| / max(1, |b|)` of an f32 back end against
/// the f64 oracle within [`BASE_TOLERANCE`], or within [`NOISE_FACTOR`]
/// times the f32 oracles' own distance from the f64 one (the larger of the
/// run on the data and the run on the data nudged by an ulp), times how many
/// ulp the back end's elementary functions may be off
/// ([`BackendKind::math_ulp`]), whichever is larger: a cell that
/// amplifies rounding (a LayerNorm of a nearly constant row, a state
/// growing step by step) is held to what f32 can compute with those
/// functions, and a wrong value is still far outside it.
///
/// The distance is the largest over a whole pass (the forward's outputs
/// and final states; for the backward, those and every gradient), not
/// one tensor's: a tensor of two values may land near the f64 values by
/// luck in the f32 oracle and not in a back end that sums in another
/// order. Measured on 12,000 random LayerNorm-LSTMs with one to three
/// hidden units (the worst conditioned shipped cell), the JIT's error
/// reached 42 times the oracle's noise, the reference back end's 8.
pub const BASE_TOLERANCE: f64 = 1e-4;
pub const NOISE_FACTOR: f64 = 16.0;

/// The oracle's values and its f32 twins, for tolerances; and, where a
/// back end computes bf16 products, the oracle with those products' operands
/// rounded to bf16 (the twin of bf16 arithmetic).
struct Expected<'a> {
    f64: &'a Oracle,
    /// On the data, and on the data nudged by an ulp.
    f32: &'a [Oracle; 2],
    /// In f64 and in f32 arithmetic ([`twins_in`]).
    bf16: Option<&'a [Oracle; 2]>,
}

fn flat(rows: &[Vec<Vec<f64>>]) -> Vec<f64> {
    rows.iter().flatten().flatten().copied().collect()
}

/// A twin's rounding noise (its distance from the f64 oracle `w`) over a
/// forward pass and over a backward pass (which includes its forward's).
fn pass_noise(w: &Oracle, w32: &Oracle) -> (f64, f64) {
    let finals = w32.finals.iter().zip(&w.finals).map(|(a, b)| noise(a, b));
    let forward = finals.fold(noise(&flat(&w32.out), &flat(&w.out)), f64::max);
    let d_h0 = w32.d_h0.iter().zip(&w.d_h0).map(|(a, b)| noise(a, b));
    let d_params = w32.d_params.iter().flatten().zip(w.d_params.iter().flatten()).map(|(a, b)| noise(a, b));
    let backward = d_h0.chain(d_params).fold(forward.max(noise(&flat(&w32.d_in), &flat(&w.d_in))), f64::max);
    (forward, backward)
}

fn tolerance(noise: f64, kind: BackendKind) -> f64 {
    BASE_TOLERANCE.max(NOISE_FACTOR * kind.math_ulp() * noise)
}

/// Back end `kind`'s tolerances against the oracle: (forward, backward).
///
/// bf16 products follow the same rule with the bf16 twins' noise in place
/// of the f32 twins' (and no factor for the elementary functions, whose
/// f32 error is far below bf16's): the distance bf16 arithmetic itself
/// puts between this cell's values and the exact ones, on this data.
fn tolerances(want: &Expected, kind: BackendKind) -> (f64, f64) {
    if let (BackendKind::CpuBf16, Some([in_f64, in_f32])) = (kind, want.bf16) {
        let (wide, narrow) = (pass_noise(want.f64, in_f64), pass_noise(want.f64, in_f32));
        let (forward, backward) = (wide.0.max(narrow.0), wide.1.max(narrow.1));
        let rule = |noise: f64| BASE_TOLERANCE.max(NOISE_FACTOR * noise);
        return (rule(forward), rule(backward));
    }
    let (twin, nudged) = (pass_noise(want.f64, &want.f32[0]), pass_noise(want.f64, &want.f32[1]));
    let (forward_noise, backward_noise) = (twin.0.max(nudged.0), twin.1.max(nudged.1));
    (tolerance(forward_noise, kind), tolerance(backward_noise, kind))
}

/// Checks `source` (a `.cell` file whose first cell is checked) on `case`.
pub fn check(source: &str, case: &Case, plan: &Checks) -> Result<Passed, Failure> {
    let fail = |check: Check| move |message: String| Failure { check, message };
    let cell = CompiledCell::from_source("fuzz.cell", source, None)
        .map_err(|e| Failure { check: Check::Compile, message: e.to_string() })?;
    let cell = Arc::new(cell);
    let sizes: Bindings = case.sizes.iter().map(|(k, v)| (k.clone(), *v)).collect();
    if plan.gradcheck {
        gradcheck(&cell, &sizes, case.seed).map_err(fail(Check::Gradcheck))?;
    }
    if plan.backends.is_empty() {
        return Ok(Passed::default());
    }
    let model = |kind: BackendKind, layers: usize| -> Result<Model, RuntimeError> {
        let config = ModelConfig { layers, bidirectional: case.bidirectional };
        let layer_programs = cellc_runtime::layers::build(&cell, &config, &sizes, None, None)?;
        let backend = backends::make(kind, &cell, &layer_programs)
            .map_err(|message| RuntimeError::Backend { backend: kind.name().into(), message })?;
        Model::new(cell.clone(), config, &sizes, None, None, case.seed, backend)?
            .with_precision(kind.precision())
    };
    // A cell whose input size is tied to its states stacks only where the
    // sizes agree: one layer otherwise.
    let (reference, layers) = match model(BackendKind::Reference, case.layers) {
        Ok(m) => (m, case.layers),
        Err(RuntimeError::Layer { .. }) if case.layers > 1 => (
            model(BackendKind::Reference, 1)
                .map_err(|e| fail(Check::Backend(BackendKind::Reference))(e.to_string()))?,
            1,
        ),
        Err(e) => {
            return Err(Failure { check: Check::Backend(BackendKind::Reference), message: e.to_string() })
        }
    };
    let mut rng = Entropy::seeded(case.seed);
    let ld = layers * reference.directions();
    let states = reference.layers()[0].state_sizes.clone();
    let shape = (reference.input_size(), reference.output_size());
    let mut batch = Batch::random(&mut rng, &case.lengths, case.steps, shape, &states, ld);
    batch.resets = case.resets.clone();
    let (f64_run, f32_run) = oracle(&reference, &batch).map_err(fail(Check::Oracle))?;
    let bf16_run = match plan.backends.contains(&BackendKind::CpuBf16) {
        true => Some(twins_in(&reference, &batch, Precision::Bf16).map_err(fail(Check::Oracle))?),
        false => None,
    };
    let want = Expected { f64: &f64_run, f32: &f32_run, bf16: bf16_run.as_ref() };
    // A cell with masks trains against the reference back end's pass at the
    // same seed (the interpreter draws no masks), in the products' precision:
    // a bf16 back end against the reference's bf16 twin, whose rounding noise
    // the evaluation pass's tolerance need not bound.
    let layout = Layout::ALL[(case.seed as usize + 3) % Layout::ALL.len()];
    let masked_in = |twin: &Model, like: BackendKind| -> Result<Option<TrainingReference>, Failure> {
        if cell.forward.masks.is_empty() {
            return Ok(None);
        }
        let pass = caught(|| training_reference(twin, &batch, &want, layout, like));
        Ok(Some(pass.map_err(fail(Check::Backend(BackendKind::Reference)))?))
    };
    let masked = masked_in(&reference, BackendKind::Reference)?;
    let masked_bf16 = match plan.backends.contains(&BackendKind::CpuBf16) {
        true => {
            let twin = model(BackendKind::Reference, layers).and_then(|m| m.with_precision(Precision::Bf16));
            let twin = twin.map_err(|e| fail(Check::Backend(BackendKind::Reference))(e.to_string()))?;
            masked_in(&twin, BackendKind::CpuBf16)?
        }
        false => None,
    };
    let mut passes = 0;
    for (k, &kind) in plan.backends.iter().enumerate() {
        // Each back end in two layouts of its own: one for inference, one for training.
        let inference = Layout::ALL[(k * 2 + case.seed as usize) % Layout::ALL.len()];
        let training = Layout::ALL[(k * 2 + 1 + case.seed as usize) % Layout::ALL.len()];
        let route = Route::of(case.seed as usize + k, kind);
        let run = || -> Result<usize, String> {
            let m = model(kind, layers).map_err(|e| e.to_string())?;
            let masked = if kind.precision() == Precision::Bf16 { &masked_bf16 } else { &masked };
            run_backend(m, kind, &batch, &want, (inference, training), route, masked.as_ref())
        };
        passes += caught(run).map_err(fail(Check::Backend(kind)))?;
    }
    Ok(Passed { passes, layers })
}

/// What `f` returns; a panic in it, an error with the panic's message.
fn caught<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => {
            let text = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("panicked: {text}"))
        }
    }
}

/// The derived backward against central finite differences (f64), on the
/// optimised cell the back ends run.
fn gradcheck(cell: &CompiledCell, sizes: &Bindings, seed: u64) -> Result<(), String> {
    // Finite differences in f64 are good to about 1e-7 here; a wrong rule is off by far more.
    let opts = cellc::gradcheck::Options { steps: 5, seed, tolerance: 1e-5, ..Default::default() };
    let report = cellc::gradcheck::gradcheck_with(&cell.forward, &cell.backward, sizes, &opts)
        .map_err(|e| e.to_string())?;
    match report.worst() {
        Some(w) if !report.passed() => Err(format!(
            "gradient of {} element {} is {:+.9e}, finite differences give {:+.9e} (error {:.2e})",
            w.tensor, w.worst_index, w.analytic, w.numeric, w.error
        )),
        _ => Ok(()),
    }
}

/// How a training pass reaches a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// [`Model::forward_train`] and [`Model::backward`].
    Owned,
    /// [`Model::forward_into`] and [`Model::backward_from`] over host
    /// memory the caller owns, with the caller's weights.
    CallerHost,
    /// The same pair over device memory (the emulated device's, which is
    /// the host's).
    CallerDevice,
}

impl Route {
    /// The route of the `n`th back-end run: each in turn, the device's
    /// only on the emulated device.
    fn of(n: usize, kind: BackendKind) -> Route {
        match n % 3 {
            0 => Route::Owned,
            2 if kind.is_cuda() => Route::CallerDevice,
            _ => Route::CallerHost,
        }
    }

    /// The route of an evaluation-mode pass of a cell with masks: the
    /// model's own training pass always draws them, so the caller's pair
    /// over host memory stands in for it.
    fn evaluating(self) -> Route {
        match self {
            Route::Owned => Route::CallerHost,
            other => other,
        }
    }
}

/// What a training forward and its backward give.
struct Trained {
    output: Vec<f32>,
    finals: Vec<Vec<f32>>,
    grads: Gradients,
}

/// A training forward from `h0`, then its backward with `d_out` and
/// `d_final`, by `route`, drawing the cell's masks from `masks` (`None`:
/// evaluation mode). [`Route::Owned`] draws from the model's next seed
/// ([`Model::next_mask_seed`]) whatever `masks` says: a fresh model's
/// first is [`TrainingReference::seed`]. Every buffer the caller provides
/// holds NaN beforehand, so a pass that reads what it did not write shows.
fn train(
    m: &Model,
    (route, masks): (Route, Option<MaskSeed>),
    (input, resets): (Input, Option<&[bool]>),
    h0: &[Vec<f32>],
    (d_out, d_final): (&[f32], &[Vec<f32>]),
) -> Result<Trained, RuntimeError> {
    let nan = |n: usize| vec![f32::NAN; n];
    let rows = d_out.len() / m.output_size().max(1);
    let dirs = m.directions();
    let mut weights: Vec<Vec<Vec<f32>>> =
        (0..m.layers().len() * dirs).map(|s| m.params(s / dirs, s % dirs == 1).to_vec()).collect();
    let mut output = nan(d_out.len());
    let mut finals: Vec<Vec<f32>> = h0.iter().map(|s| nan(s.len())).collect();
    let mut reserve = nan(rows * m.reserve_floats_per_row());
    let mut d_input = nan(rows * m.input_size());
    let mut d_h0: Vec<Vec<f32>> = h0.iter().map(|s| nan(s.len())).collect();
    let mut d_params: Vec<Vec<Vec<f32>>> =
        weights.iter().map(|ps| ps.iter().map(|p| nan(p.len())).collect()).collect();
    match route {
        Route::Owned => {
            let options = CallOptions { masks: Some(m.next_mask_seed()), resets, ..Default::default() };
            let (out, trace) = m.forward_traced(input, Some(h0), &options)?;
            let grads = m.backward(&trace, d_out, Some(d_final))?;
            return Ok(Trained { output: out.data, finals: out.final_states, grads });
        }
        Route::CallerHost => {
            let w: Vec<Vec<&[f32]>> =
                weights.iter().map(|ps| ps.iter().map(Vec::as_slice).collect()).collect();
            let h0: Vec<&[f32]> = h0.iter().map(Vec::as_slice).collect();
            let options = CallOptions { masks, resets, ..Default::default() };
            let call = Call { weights: Some(&w), h0: Some(&h0), options, ..Call::new(input) };
            let out = ForwardOut {
                output: &mut output,
                final_states: finals.iter_mut().map(Vec::as_mut_slice).collect(),
            };
            m.forward_into(&call, out, Some(&mut reserve))?;
            let d_final: Vec<&[f32]> = d_final.iter().map(Vec::as_slice).collect();
            let out = BackwardOut {
                d_input: &mut d_input,
                d_h0: d_h0.iter_mut().map(Vec::as_mut_slice).collect(),
                d_params: d_params
                    .iter_mut()
                    .map(|ps| ps.iter_mut().map(Vec::as_mut_slice).collect())
                    .collect(),
            };
            m.backward_from(&call, &reserve, d_out, Some(&d_final), out)?;
        }
        Route::CallerDevice => {
            // The emulated device's memory is the host's: its addresses are pointers.
            let (at, at_mut) = (DeviceFloats::emulated, DeviceFloats::emulated_mut);
            let (shape, data) = input.split();
            let w: Vec<Vec<DeviceFloats>> =
                weights.iter_mut().map(|ps| ps.iter_mut().map(|p| at_mut(p)).collect()).collect();
            let h0: Vec<DeviceFloats> = h0.iter().map(|s| at(s)).collect();
            let call = DeviceCall {
                shape,
                input: at(data),
                weights: &w,
                h0: Some(&h0),
                stream: 0,
                options: CallOptions { masks, resets, ..Default::default() },
            };
            let out = DeviceForwardOut {
                output: at_mut(&mut output),
                final_states: finals.iter_mut().map(|s| at_mut(s)).collect(),
            };
            let reserve = at_mut(&mut reserve);
            m.forward_into(&call, &out, Some(reserve))?;
            let d_final: Vec<DeviceFloats> = d_final.iter().map(|s| at(s)).collect();
            let out = DeviceBackwardOut {
                d_input: at_mut(&mut d_input),
                d_h0: d_h0.iter_mut().map(|s| at_mut(s)).collect(),
                d_params: d_params.iter_mut().map(|ps| ps.iter_mut().map(|p| at_mut(p)).collect()).collect(),
            };
            m.backward_from(&call, reserve, at(d_out), Some(&d_final), &out)?;
        }
    }
    Ok(Trained { output, finals, grads: Gradients { d_input, d_h0, d_params } })
}

/// [`train`] on `batch` laid out in `layout` (inputs and output
/// adjoints alike); errors name the pass by `label`.
fn train_in(
    m: &Model,
    how: (Route, Option<MaskSeed>),
    batch: &Batch,
    layout: Layout,
    label: &str,
) -> Result<Trained, String> {
    let x = LaidOut::inputs(batch, layout, m.input_size())?;
    let dy = batch.lay_out(layout, &batch.d_out, m.output_size())?;
    let resets = batch.reset_flags(layout)?;
    train(m, how, (x.input(batch), resets.as_deref()), &batch.h0, (&dy, &batch.d_final))
        .map_err(|e| format!("training ({label}): {e}"))
}

/// A cell with masks in training mode: the reference back end's pass,
/// which every back end's pass at the same seed is held to.
struct TrainingReference {
    /// The seed of a fresh model's first training pass of its own
    /// ([`Model::next_mask_seed`]), which every training pass draws from.
    seed: MaskSeed,
    /// The pass's values, per sequence as the interpreter's are.
    pass: Oracle,
    /// The reference back end's own tolerances against the oracle
    /// (forward, backward): a back end's add to them.
    tolerances: (f64, f64),
}

/// The reference back end's training pass in `layout` at a fresh
/// model's first seed, once that seed's masks are seen to be the same
/// when drawn again and in another layout; its products in the precision
/// of back end `like` (the model's), whose tolerances it is held to.
fn training_reference(
    reference: &Model,
    batch: &Batch,
    want: &Expected,
    layout: Layout,
    like: BackendKind,
) -> Result<TrainingReference, String> {
    let seed = reference.next_mask_seed();
    masks_are_deterministic(reference, batch, seed)?;
    let label = format!("reference back end, {layout}, masks at {seed:?}");
    let trained = train_in(reference, (Route::CallerHost, Some(seed)), batch, layout, &label)?;
    let pass = per_sequence(reference, &trained, &batch.row_layout(layout)?, batch);
    Ok(TrainingReference { seed, pass, tolerances: tolerances(want, like) })
}

/// The masks a training call at `seed` draws ([`Model::cell_masks`]) are
/// the same drawn twice, and the same for every sequence and step (and
/// every DropConnect mask) in another layout of the batch.
fn masks_are_deterministic(m: &Model, batch: &Batch, seed: MaskSeed) -> Result<(), String> {
    let drawn = |layout: Layout| -> Result<Vec<SeenMask>, String> {
        let x = LaidOut::inputs(batch, layout, m.input_size())?;
        m.cell_masks(x.input(batch), Some(seed), None).map_err(|e| format!("cell_masks ({layout}): {e}"))
    };
    let (one, other) = (Layout::ALL[0], Layout::Packed);
    let first = drawn(one)?;
    if drawn(one)? != first {
        return Err(format!("cell_masks ({one}): two calls at {seed:?} draw different masks"));
    }
    let second = drawn(other)?;
    let names = |masks: &[SeenMask]| masks.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
    if names(&first) != names(&second) {
        return Err(format!(
            "cell_masks: masks {:?} in {one}, {:?} in {other}",
            names(&first),
            names(&second)
        ));
    }
    let (at_one, at_other) = (batch.row_layout(one)?, batch.row_layout(other)?);
    for (a, b) in first.iter().zip(&second) {
        let same = match a.name.starts_with("dropconnect#") {
            true => a.values == b.values,
            false => same_rows(a, &at_one, b, &at_other, batch),
        };
        if !same {
            return Err(format!("cell_masks at {seed:?}: mask {} differs between {one} and {other}", a.name));
        }
    }
    Ok(())
}

/// Whether two step masks (`[rows, units]`, laid out like the input in
/// `at_a` and `at_b`) hold the same units for every sequence and step.
fn same_rows(a: &SeenMask, at_a: &RowLayout, b: &SeenMask, at_b: &RowLayout, batch: &Batch) -> bool {
    let units = a.shape.get(1).copied().unwrap_or(0);
    let row = |m: &SeenMask, at: &RowLayout, s: usize, t: usize| {
        let r = at.row(s, t);
        m.values.get(r * units..(r + 1) * units).map(<[f32]>::to_vec)
    };
    batch
        .lengths
        .iter()
        .enumerate()
        .all(|(s, &len)| (0..len).all(|t| row(a, at_a, s, t) == row(b, at_b, s, t)))
}

/// A training pass's values in f64, per sequence as the interpreter's
/// are (rows laid out in `at`).
fn per_sequence(m: &Model, trained: &Trained, at: &RowLayout, batch: &Batch) -> Oracle {
    let wide = |v: &[f32]| -> Vec<f64> { v.iter().map(|&x| x as f64).collect() };
    let rows = |data: &[f32], width: usize| -> Vec<Vec<Vec<f64>>> {
        let row = |r: usize| data.get(r * width..(r + 1) * width).map(wide).unwrap_or_default();
        batch
            .lengths
            .iter()
            .enumerate()
            .map(|(b, &len)| (0..len).map(|t| row(at.row(b, t))).collect())
            .collect()
    };
    Oracle {
        out: rows(&trained.output, m.output_size()),
        finals: trained.finals.iter().map(|f| wide(f)).collect(),
        d_in: rows(&trained.grads.d_input, m.input_size()),
        d_h0: trained.grads.d_h0.iter().map(|f| wide(f)).collect(),
        d_params: trained.grads.d_params.iter().map(|ps| ps.iter().map(|p| wide(p)).collect()).collect(),
    }
}

/// One back end: inference in one layout, training (forward, then
/// backward with output and final-state adjoints) in another, by `route`,
/// against the interpreter; for a cell with masks (`masked`), the
/// training pass in evaluation mode, then in training mode against the
/// reference back end's, then at rates 0 against evaluation. Returns the
/// passes run.
fn run_backend(
    m: Model,
    kind: BackendKind,
    batch: &Batch,
    want: &Expected,
    (inference, training): (Layout, Layout),
    route: Route,
    masked: Option<&TrainingReference>,
) -> Result<usize, String> {
    let (out_tol, grad_tol) = tolerances(want, kind);
    infer(&m, batch, want.f64, inference, out_tol)?;
    let oracle = (Against::interpreter(out_tol), Against::interpreter(grad_tol));
    let Some(reference) = masked else {
        let label = format!("{training}, {route:?}");
        let trained = train_in(&m, (route, None), batch, training, &label)?;
        compare_pass(&m, &label, &trained, batch, training, want.f64, oracle)?;
        return Ok(3);
    };
    let label = format!("{training}, {:?}, evaluation", route.evaluating());
    let evaluated = train_in(&m, (route.evaluating(), None), batch, training, &label)?;
    compare_pass(&m, &label, &evaluated, batch, training, want.f64, oracle)?;

    let seed = reference.seed;
    let label = format!("{training}, {route:?}, masks at {seed:?}");
    let trained = train_in(&m, (route, Some(seed)), batch, training, &label)?;
    let (ref_out, ref_grad) = reference.tolerances;
    let source = "the reference back end";
    let against = (Against { source, tol: out_tol + ref_out }, Against { source, tol: grad_tol + ref_grad });
    compare_pass(&m, &label, &trained, batch, training, &reference.pass, against)?;
    rates_zero_is_evaluation(m, route, batch, training)?;
    Ok(9)
}

/// Inference in `layout` (and, for a one-directional model, as a stream)
/// against the interpreter's rows.
fn infer(m: &Model, batch: &Batch, w: &Oracle, layout: Layout, tol: f64) -> Result<(), String> {
    let x = LaidOut::inputs(batch, layout, m.input_size())?;
    let resets = batch.reset_flags(layout)?;
    let out = m
        .forward_with(
            x.input(batch),
            Some(&batch.h0),
            &CallOptions { resets: resets.as_deref(), ..Default::default() },
        )
        .map_err(|e| format!("inference ({layout}): {e}"))?;
    let at = batch.row_layout(layout)?;
    let against = Against::interpreter(tol);
    let what = format!("inference ({layout}) output");
    compare_rows(&what, &out.data, m.output_size(), (&at, batch), &w.out, against)?;
    for (i, g) in out.final_states.iter().enumerate() {
        compare(&format!("inference ({layout}) final state {i}"), g, &w.finals[i], against)?;
    }
    if !m.config().bidirectional && batch.resets.is_empty() {
        stream(m, batch, &w.out, against)?;
    }
    Ok(())
}

/// A training pass (laid out in `layout`, named by `label`) against
/// `want`'s values: output and final states within the first tolerance,
/// gradients within the second.
fn compare_pass(
    m: &Model,
    label: &str,
    got: &Trained,
    batch: &Batch,
    layout: Layout,
    want: &Oracle,
    (out, grad): (Against, Against),
) -> Result<(), String> {
    let at = batch.row_layout(layout)?;
    let what = format!("training ({label}) output");
    compare_rows(&what, &got.output, m.output_size(), (&at, batch), &want.out, out)?;
    for (i, g) in got.finals.iter().enumerate() {
        compare(&format!("training ({label}) final state {i}"), g, &want.finals[i], out)?;
    }
    let grads = &got.grads;
    let what = format!("backward ({label}) d_input");
    compare_rows(&what, &grads.d_input, m.input_size(), (&at, batch), &want.d_in, grad)?;
    for (i, g) in grads.d_h0.iter().enumerate() {
        compare(&format!("backward ({label}) d_h0 of state {i}"), g, &want.d_h0[i], grad)?;
    }
    let names = m.compiled().param_names();
    let dirs = m.directions();
    for (slot, got) in grads.d_params.iter().enumerate() {
        for (p, g) in got.iter().enumerate() {
            let name =
                format!("{}{}", names[p], cellc_runtime::model::weight_suffix(slot / dirs, slot % dirs == 1));
            compare(&format!("backward ({label}) d_{name}"), g, &want.d_params[slot][p], grad)?;
        }
    }
    Ok(())
}

/// At every rate 0 ([`Model::with_rates`]) a training pass (masks drawn,
/// every unit kept, at scale 1) is bit for bit the evaluation pass on the
/// same back end, forwards and backwards.
fn rates_zero_is_evaluation(m: Model, route: Route, batch: &Batch, layout: Layout) -> Result<(), String> {
    let names: Vec<String> = m.rate_names().iter().map(|n| n.to_string()).collect();
    let zeros: Vec<(&str, f32)> = names.iter().map(|n| (n.as_str(), 0.0)).collect();
    let m = m.with_rates(&zeros).map_err(|e| format!("rates 0: {e}"))?;
    let seed = MaskSeed { seed: 1, offset: 0 };
    let label = format!("{layout}, rates 0");
    let trained = train_in(&m, (route, Some(seed)), batch, layout, &format!("{label}, {route:?}, masks"))?;
    let evaluated = train_in(&m, (route.evaluating(), None), batch, layout, &format!("{label}, evaluation"))?;
    let what = |part: &str| format!("{label}: {part} of the training pass ({route:?})");
    identical(&what("output"), &trained.output, &evaluated.output)?;
    for (i, (a, b)) in trained.finals.iter().zip(&evaluated.finals).enumerate() {
        identical(&what(&format!("final state {i}")), a, b)?;
    }
    let (a, b) = (&trained.grads, &evaluated.grads);
    identical(&what("d_input"), &a.d_input, &b.d_input)?;
    for (i, (x, y)) in a.d_h0.iter().zip(&b.d_h0).enumerate() {
        identical(&what(&format!("d_h0 of state {i}")), x, y)?;
    }
    for (slot, (xs, ys)) in a.d_params.iter().zip(&b.d_params).enumerate() {
        for (p, (x, y)) in xs.iter().zip(ys).enumerate() {
            identical(&what(&format!("d_params[{slot}][{p}]")), x, y)?;
        }
    }
    Ok(())
}

/// `got` (a training pass's) is bit for bit `want` (the evaluation pass's), NaN for NaN.
fn identical(what: &str, got: &[f32], want: &[f32]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, the evaluation pass has {}", got.len(), want.len()));
    }
    let same = |(a, b): (&f32, &f32)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    match got.iter().zip(want).position(|pair| !same(pair)) {
        Some(i) => Err(format!("{what}[{i}] is {:e}, the evaluation pass gives {:e}", got[i], want[i])),
        None => Ok(()),
    }
}

/// The model as a stream ([`Model::stream`], a one-directional model):
/// every sequence side by side over the steps they all have, from the
/// batch's initial states, the first step in one call and the rest in a
/// second (the states carried between calls), against the oracle's rows.
fn stream(m: &Model, batch: &Batch, want: &[Vec<Vec<f64>>], against: Against) -> Result<(), String> {
    let steps = batch.lengths.iter().copied().min().unwrap_or(0);
    let (b, o) = (batch.lengths.len(), m.output_size());
    let mut stream = m.stream(b).map_err(|e| format!("stream: {e}"))?;
    stream.set_states(&batch.h0).map_err(|e| format!("stream: {e}"))?;
    let mut t = 0;
    for chunk in [1, steps.saturating_sub(1)] {
        let chunk = chunk.min(steps - t);
        let x: Vec<f32> = (t..t + chunk)
            .flat_map(|t| batch.xs.iter().flat_map(move |seq| seq[t].iter().copied()))
            .collect();
        let mut y = vec![0.0; chunk * b * o];
        stream.run(&x, &mut y).map_err(|e| format!("stream: {e}"))?;
        for (k, rows) in y.chunks(b * o.max(1)).enumerate() {
            for (seq, row) in rows.chunks(o.max(1)).enumerate() {
                compare(
                    &format!("stream output (sequence {seq}, step {})", t + k),
                    row,
                    &want[seq][t + k],
                    against,
                )?;
            }
        }
        t += chunk;
    }
    Ok(())
}

/// Compares every valid row (laid out in `layout`) with `want`'s `[b][t]`
/// rows, and checks that padding rows hold zeros.
fn compare_rows(
    what: &str,
    data: &[f32],
    width: usize,
    (layout, batch): (&RowLayout, &Batch),
    want: &[Vec<Vec<f64>>],
    against: Against,
) -> Result<(), String> {
    let rows = data.len() / width.max(1);
    let mut valid = vec![false; rows];
    for (b, seq) in want.iter().enumerate() {
        for (t, row) in seq.iter().enumerate() {
            let r = layout.row(b, t);
            valid[r] = true;
            compare(
                &format!("{what} (sequence {b}, step {t})"),
                &data[r * width..(r + 1) * width],
                row,
                against,
            )?;
        }
    }
    if let Some(r) =
        (0..rows).find(|&r| !valid[r] && data[r * width..(r + 1) * width].iter().any(|&v| v != 0.0))
    {
        return Err(format!("{what}: padding row {r} is not zero (lengths {:?})", batch.lengths));
    }
    Ok(())
}
