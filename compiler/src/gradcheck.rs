//! Gradient checking: the derived backward step against central finite
//! differences, in f64 on the reference interpreter.
//!
//! The loss is `L = Σ_t out_t · g_t + Σ_i final_i · f_i` with random `g`
//! and `f`, so every output and final state carries gradient. Every input
//! element, initial state element and parameter element is perturbed by
//! `±eps`; the analytic gradient from backpropagation through time must
//! agree with `(L(θ+eps) − L(θ−eps)) / 2 eps`, where the perturbed runs
//! hold every `stop_gradient` at its unperturbed value (the function whose
//! gradient the backward step computes).

use crate::autodiff::Gradient;
use crate::dims::Bindings;
use crate::interp::InterpError;
use crate::ir::Cell;
use crate::program::Steps;

/// What to check and how strictly.
#[derive(Clone, Debug)]
pub struct Options {
    /// Time steps of the random sequence the loss is taken over.
    pub steps: usize,
    /// Seed of the random inputs, initial states, parameters and loss weights.
    pub seed: u64,
    /// Finite-difference step: each element is perturbed by `±eps`.
    pub eps: f64,
    /// Allowed `|analytic − numeric| / max(1, |numeric|)`, beyond what the
    /// losses' rounding alone may move the finite difference by.
    pub tolerance: f64,
}

impl Default for Options {
    fn default() -> Options {
        Options { steps: 6, seed: 1, eps: 1e-6, tolerance: 1e-6 }
    }
}

/// The agreement for one tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorCheck {
    /// `input x`, `initial state h`, `param weight_ih`.
    pub tensor: String,
    /// Number of elements checked (all of them).
    pub elements: usize,
    /// The worst element: its index, the two gradients and the error.
    pub worst_index: usize,
    /// The worst element's gradient from the backward step.
    pub analytic: f64,
    /// The worst element's central-difference gradient.
    pub numeric: f64,
    /// The worst element's `|analytic − numeric| / max(1, |numeric|)`, less
    /// what the losses' rounding alone may move `numeric` by.
    pub error: f64,
    /// Elements at a kink, left unchecked: the one-sided differences
    /// disagree, or a perturbation moves the run off an exact tie (see
    /// [`crate::interp::Ties`]), so the loss has no derivative there to
    /// compare with.
    pub kinks: usize,
}

/// The outcome of a gradient check: the worst error per tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// The sizes the cell was checked at (defaults filled in).
    pub sizes: Bindings,
    /// Time steps the loss was taken over.
    pub steps: usize,
    /// One entry for all inputs together, then one per initial state, then one
    /// per parameter.
    pub tensors: Vec<TensorCheck>,
    /// The largest error allowed ([`Options::tolerance`]).
    pub tolerance: f64,
}

impl Report {
    /// Whether every tensor's worst error is within the tolerance.
    pub fn passed(&self) -> bool {
        self.tensors.iter().all(|t| t.error <= self.tolerance)
    }

    /// The tensor with the largest error (`None` when nothing was checked).
    pub fn worst(&self) -> Option<&TensorCheck> {
        self.tensors.iter().max_by(|a, b| a.error.total_cmp(&b.error))
    }
}

/// Sizes for the check: those given, and small distinct ones for the rest.
pub fn default_sizes(cell: &Cell, given: &Bindings) -> Bindings {
    let mut small = [3usize, 4, 5, 2, 6, 7].into_iter().cycle();
    cell.sizes
        .iter()
        .map(|s| (s.clone(), given.get(s).copied().unwrap_or_else(|| small.next().unwrap_or(3))))
        .collect()
}

/// Checks every gradient of `cell` at `sizes` (unbound ones get small
/// defaults): the backward step the pipeline derives ([`Steps::compile`])
/// against finite differences of the forward step.
pub fn gradcheck(cell: &Cell, sizes: &Bindings, opts: &Options) -> Result<Report, InterpError> {
    let steps = Steps::compile(cell).map_err(|e| InterpError::Internal {
        message: e.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "),
    })?;
    gradcheck_with(&steps.forward, &steps.backward, sizes, opts)
}

/// Checks a given backward step of `cell` (so tests can check the checker).
pub fn gradcheck_with(
    cell: &Cell,
    grad: &Gradient,
    sizes: &Bindings,
    opts: &Options,
) -> Result<Report, InterpError> {
    let sizes = default_sizes(cell, sizes);
    let bound = cell.bind(&sizes)?;
    let mut rng = SplitMix(opts.seed);
    let params: Vec<Vec<f64>> = bound.param_shapes().iter().map(|&(r, c)| rng.vec(r * c, 0.6)).collect();
    let h0: Vec<Vec<f64>> = bound.state_sizes().iter().map(|&n| rng.vec(n, 0.5)).collect();
    let xs = rng.vec(opts.steps * bound.input_size(), 1.0);
    let g_out = rng.vec(opts.steps * bound.output_size(), 1.0);
    let g_final: Vec<Vec<f64>> = bound.state_sizes().iter().map(|&n| rng.vec(n, 1.0)).collect();

    let analytic = bound.backward(grad, &xs, &h0, &params, &g_out, &g_final)?;
    // The loss, and the sum of its terms' magnitudes (its rounding's scale).
    let loss_of = |r: &crate::interp::SequenceResult<f64>| -> Loss {
        let finals = r.final_states.iter().zip(&g_final).flat_map(|(s, g)| s.iter().zip(g));
        let terms = r.outputs.iter().zip(&g_out).chain(finals).map(|(a, b)| a * b);
        terms.fold(Loss { value: 0.0, magnitude: 0.0 }, |l, t| Loss {
            value: l.value + t,
            magnitude: l.magnitude + t.abs(),
        })
    };
    // `stop_gradient` values are constants to the backward step: the
    // perturbed runs hold them at the unperturbed run's values.
    let (unperturbed, stops, ties) = bound.run_recording_stops(&xs, &h0, &params)?;
    let base = loss_of(&unperturbed);
    // A perturbed run that meets other ties than the unperturbed one moved
    // off a tie (or onto one): the loss has no derivative to compare there.
    let loss = |xs: &[f64], h0: &[Vec<f64>], params: &[Vec<f64>]| -> Result<(Loss, bool), InterpError> {
        let (run, met) = bound.run_holding_stops(xs, h0, params, &stops)?;
        Ok((loss_of(&run), met != ties))
    };
    let eps = opts.eps;
    let numeric =
        |perturb: &dyn Fn(f64) -> Result<(Loss, bool), InterpError>| -> Result<Difference, InterpError> {
            let ((minus, left_tie), (plus, right_tie)) = (perturb(-eps)?, perturb(eps)?);
            Ok(Difference::of(minus, base, plus, eps, left_tie || right_tie))
        };

    let mut tensors = Vec::new();
    let mut record = |tensor: String, analytic: &[f64], numeric: Vec<Difference>| {
        let mut check = TensorCheck {
            tensor,
            elements: numeric.len(),
            worst_index: 0,
            analytic: 0.0,
            numeric: 0.0,
            error: 0.0,
            kinks: numeric.iter().filter(|n| n.is_kink()).count(),
        };
        for (i, (&a, n)) in analytic.iter().zip(&numeric).enumerate() {
            let e = n.error(a);
            if e > check.error || i == 0 {
                check = TensorCheck { worst_index: i, analytic: a, numeric: n.central, error: e, ..check };
            }
        }
        tensors.push(check);
    };

    let in_names: Vec<&str> = cell.inputs.iter().map(|i| i.name.as_str()).collect();
    let mut num = Vec::with_capacity(xs.len());
    for i in 0..xs.len() {
        num.push(numeric(&|d| {
            let mut x = xs.clone();
            x[i] += d;
            loss(&x, &h0, &params)
        })?);
    }
    record(format!("input {}", in_names.join(", ")), &analytic.d_inputs, num);

    for (s, decl) in cell.states.iter().enumerate() {
        let mut num = Vec::with_capacity(h0[s].len());
        for i in 0..h0[s].len() {
            num.push(numeric(&|d| {
                let mut h = h0.clone();
                h[s][i] += d;
                loss(&xs, &h, &params)
            })?);
        }
        record(format!("initial state {}", decl.name), &analytic.d_initial_states[s], num);
    }
    for (p, decl) in cell.params.iter().enumerate() {
        let mut num = Vec::with_capacity(params[p].len());
        for i in 0..params[p].len() {
            num.push(numeric(&|d| {
                let mut w = params.clone();
                w[p][i] += d;
                loss(&xs, &h0, &w)
            })?);
        }
        record(format!("param {}", decl.name), &analytic.d_params[p], num);
    }
    Ok(Report { sizes, steps: opts.steps, tensors, tolerance: opts.tolerance })
}

/// The loss of one run: its value, and the sum of its terms' magnitudes.
#[derive(Clone, Copy, Debug)]
struct Loss {
    value: f64,
    magnitude: f64,
}

/// Finite differences of the loss along one coordinate.
#[derive(Clone, Copy, Debug)]
struct Difference {
    /// `(L(θ+eps) − L(θ−eps)) / 2 eps`.
    central: f64,
    /// `(L(θ) − L(θ−eps)) / eps` and `(L(θ+eps) − L(θ)) / eps`.
    left: f64,
    right: f64,
    /// How far rounding alone may move `central`: the losses' rounding
    /// (a few ulp of the sum of their terms' magnitudes) over `2 eps`. A
    /// loss of huge terms (a state that grows step by step, however little
    /// its gradient) differs in rounding more than its gradient moves it.
    rounding: f64,
    /// A perturbed run met other ties than the unperturbed one.
    moves_a_tie: bool,
}

impl Difference {
    /// One-sided derivatives further apart than this (relative, as the
    /// error) mean a kink, not the rounding and curvature of a smooth loss.
    const KINK: f64 = 1e-3;

    /// Ulp of the losses' magnitudes that their rounding is allowed.
    const ROUNDING_ULP: f64 = 16.0;

    fn of(minus: Loss, base: Loss, plus: Loss, eps: f64, moves_a_tie: bool) -> Difference {
        let magnitude = minus.magnitude.max(base.magnitude).max(plus.magnitude);
        Difference {
            central: (plus.value - minus.value) / (2.0 * eps),
            left: (base.value - minus.value) / eps,
            right: (plus.value - base.value) / eps,
            rounding: Self::ROUNDING_ULP * f64::EPSILON * magnitude / (2.0 * eps),
            moves_a_tie,
        }
    }

    /// Whether the loss has a kink here: `min`, `max`, `relu`, `abs` or a
    /// `where` switching at this very point, which structure such as
    /// `min(stop_gradient(x), x)` makes hold everywhere. The gradient is
    /// then the backward step's convention (a tie's even split), which
    /// finite differences cannot check: the central difference of several
    /// kinks met together is no convention's gradient. A run that meets a
    /// tie exactly may not show it in the loss: in `c' = min(-c, stop_gradient(x) - x)`
    /// a state at 0 ties every step, and moving `x` off the tie at one
    /// step is undone at the next, so both one-sided differences agree
    /// while the convention's split still sends gradient through.
    fn is_kink(&self) -> bool {
        if self.moves_a_tie {
            return true;
        }
        // Each one-sided difference carries twice the central one's rounding.
        let apart = ((self.left - self.right).abs() - 4.0 * self.rounding).max(0.0);
        apart / self.central.abs().max(1.0) > Self::KINK
    }

    /// `|analytic − central| / max(1, |central|)`, less what rounding alone
    /// may put between them; 0 at a kink.
    fn error(&self, analytic: f64) -> f64 {
        if self.is_kink() {
            return 0.0;
        }
        ((analytic - self.central).abs() - self.rounding).max(0.0) / self.central.abs().max(1.0)
    }
}

/// SplitMix64: a few lines of well-known generator for reproducible test data.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// `n` values uniform in `[-scale, scale)`.
    fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| ((self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale).collect()
    }
}
