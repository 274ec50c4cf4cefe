//! The reference interpreter: the semantics of a cell, executed directly.
//!
//! It is the oracle every back end is tested against, so it is written to
//! be obviously right rather than fast: one value at a time in topological
//! order, plain loops, generic over the float type (`f32` to see what a
//! kernel should produce, `f64` for gradient checks). A [`BoundCell`] is a
//! cell with its size variables fixed; it checks the shapes of everything
//! it is given and says which tensor is wrong.

pub(crate) mod error;

use crate::dims::Bindings;
use crate::ir::op::{apply_binary, apply_select, apply_unary};
use crate::ir::{BinaryOp, Cell, Graph, Init, Op, ReduceOp, Type, UnaryOp, ValueId};
use crate::precision::Precision;
use crate::shapes::Shapes;
use crate::shapes::{check_elements, eval_dim};
pub use error::{bytes_text, InterpError, MAX_TENSOR_ELEMENTS};
use num_traits::Float;
use std::collections::BTreeMap;

/// A parameter's starting values, with the sizes substituted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ConcreteInit {
    /// Every element 0 (`= zeros`).
    Zeros,
    /// Every element 1 (`= ones`).
    Ones,
    /// Uniform in `[-bound, bound]`.
    Uniform(f64),
    /// Every element this value (`= constant(c)`).
    Constant(f64),
}

/// A cell whose size variables have values: every shape is concrete.
#[derive(Clone, Debug)]
pub struct BoundCell<'c> {
    cell: &'c Cell,
    sizes: Bindings,
    plan: Shapes,
    /// `(offset, len)` of each input in the step's feature vector.
    input_slices: Vec<(usize, usize)>,
    input_size: usize,
    state_sizes: Vec<usize>,
    /// `(rows, cols)`; `cols == 1` for vectors.
    param_shapes: Vec<(usize, usize)>,
    param_heads: Vec<usize>,
    /// Elements of each mask (of a row, or of a DropConnect's parameter).
    mask_sizes: Vec<usize>,
    /// The precision of the products of matrix parameters ([`BoundCell::with_precision`]).
    precision: Precision,
    /// The rate of each of the cell's `rate`s, whose evaluation masks the
    /// steps read ([`BoundCell::with_rates`]; the cell's defaults).
    rates: Vec<f32>,
}

/// The values a graph's leaves take for one evaluation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LeafValues<'a, T> {
    /// The step's feature vector, and each input's `(offset, len)` in it.
    pub x: &'a [T],
    pub input_slices: &'a [(usize, usize)],
    pub states: &'a [&'a [T]],
    pub params: &'a [Vec<T>],
    pub seeds: &'a [&'a [T]],
    /// Each mask's values for this row ([`Op::Mask`]).
    pub masks: &'a [&'a [T]],
    /// Values that `stop_gradient` nodes take instead of their operand's
    /// (a gradient check's finite differences hold them where the
    /// unperturbed run put them: see [`BoundCell::run_holding_stops`]).
    pub pinned: &'a [(ValueId, Vec<T>)],
}

/// Evaluates every value of `graph` in `plan`'s order. Parameters are read
/// in place, so their slots in the result stay empty: use [`value`].
pub(crate) fn evaluate<T: Float>(
    graph: &Graph,
    plan: &Shapes,
    leaves: &LeafValues<T>,
    precision: Precision,
) -> Vec<Vec<T>> {
    let mut vals: Vec<Vec<T>> = vec![Vec::new(); graph.value_bound()];
    for &v in &plan.order {
        if let Some((_, pinned)) = leaves.pinned.iter().find(|(p, _)| *p == v) {
            vals[v.index()] = pinned.clone();
            continue;
        }
        let out = match &graph.node(v).op {
            Op::Input(i) => {
                let (o, l) = leaves.input_slices[*i];
                leaves.x[o..o + l].to_vec()
            }
            Op::State(i) => leaves.states[*i].to_vec(),
            Op::Param(_) => Vec::new(),
            Op::Seed(i) => leaves.seeds[*i].to_vec(),
            Op::Mask(i) => leaves.masks[*i].to_vec(),
            _ => {
                let operands = graph.operands(v);
                let args: Vec<&[T]> = operands.iter().map(|&o| value(graph, &vals, leaves, o)).collect();
                plan.compute_in(precision, graph, v, &args)
            }
        };
        vals[v.index()] = out;
    }
    vals
}

/// The interpreter's half of [`Shapes`]: the semantics of every op at these shapes.
impl Shapes {
    /// The values computed from constants only (`const`, `dimvalue`, and
    /// e.g. `broadcast(const 1)`), with their values, in order. Kernels
    /// treat these as literals.
    pub fn constant_values<T: Float>(&self, graph: &Graph) -> Vec<(ValueId, Vec<T>)> {
        let mut known: Vec<Option<usize>> = vec![None; self.shape.len()];
        let mut out: Vec<(ValueId, Vec<T>)> = Vec::new();
        for &v in &self.order {
            let operands = graph.operands(v);
            let constant = match graph.node(v).op {
                Op::Const(_) | Op::DimValue(_) => true,
                Op::Input(_) | Op::State(_) | Op::Param(_) | Op::Mask(_) | Op::Seed(_) => false,
                _ => operands.iter().all(|o| known[o.index()].is_some()),
            };
            if constant {
                let value = {
                    let args: Vec<&[T]> = operands
                        .iter()
                        .filter_map(|o| known[o.index()].map(|k| out[k].1.as_slice()))
                        .collect();
                    self.compute(graph, v, &args)
                };
                known[v.index()] = Some(out.len());
                out.push((v, value));
            }
        }
        out
    }

    /// Computes a non-leaf value from its operands' values (in slot order).
    /// This is the semantics of every op; back ends are tested against it.
    pub fn compute<T: Float>(&self, graph: &Graph, v: ValueId, args: &[&[T]]) -> Vec<T> {
        self.compute_in(Precision::F32, graph, v, args)
    }

    /// [`Shapes::compute`] with the products of matrix parameters in
    /// `precision`: at any but [`Precision::F32`] (bf16, fp16, TF32), both
    /// operands of such a product are rounded to it first (the sums stay in
    /// `T`).
    pub fn compute_in<T: Float>(
        &self,
        precision: Precision,
        graph: &Graph,
        v: ValueId,
        args: &[&[T]],
    ) -> Vec<T> {
        let product_of_param = matches!(graph.node(v).op, Op::MatVec | Op::MatVecT)
            && matches!(graph.node(graph.operands(v)[0]).op, Op::Param(_));
        if precision != Precision::F32 && product_of_param {
            let rounded: Vec<Vec<T>> =
                args.iter().map(|a| a.iter().map(|&x| rounded_to(precision, x)).collect()).collect();
            let rounded: Vec<&[T]> = rounded.iter().map(Vec::as_slice).collect();
            return self.compute(graph, v, &rounded);
        }
        let (rows, cols) = self.shape[v.index()];
        let n = rows * cols;
        let operand_cols = |i: usize| graph.operands(v).get(i).map_or(1, |o| self.shape[o.index()].1);
        match &graph.node(v).op {
            // Leaves have no operands; the caller supplies their values.
            Op::Input(_) | Op::State(_) | Op::Param(_) | Op::Mask(_) | Op::Seed(_) => Vec::new(),
            Op::Const(c) => vec![T::from(*c).unwrap_or_else(T::nan)],
            Op::DimValue(_) => vec![T::from(self.extra[v.index()]).unwrap_or_else(T::nan)],
            Op::Unary(op) => args[0].iter().map(|&a| apply_unary(*op, a)).collect(),
            Op::Binary(op) => args[0].iter().zip(args[1]).map(|(&a, &b)| apply_binary(*op, a, b)).collect(),
            Op::Select => (0..n).map(|i| apply_select(args[0][i], args[1][i], args[2][i])).collect(),
            Op::Broadcast => vec![args[0][0]; n],
            // A block-diagonal matrix of `h` heads is `h*m` rows of `k`
            // columns; row `r` belongs to head `r / m`, which reads (or
            // writes) the vector's `k` elements from `(r / m) * k`.
            Op::MatVec => {
                let (w, x, k) = (args[0], args[1], operand_cols(0));
                let per_head = rows / self.heads(graph.operands(v)[0]);
                (0..rows).map(|r| dot(&w[r * k..(r + 1) * k], &x[r / per_head * k..][..k])).collect()
            }
            Op::MatVecT => {
                let (w, y, k) = (args[0], args[1], operand_cols(0));
                let per_head = y.len() / self.heads(graph.operands(v)[0]);
                let mut out = vec![T::zero(); rows];
                for (r, &yr) in y.iter().enumerate() {
                    for (o, &wv) in out[r / per_head * k..][..k].iter_mut().zip(&w[r * k..(r + 1) * k]) {
                        *o = *o + wv * yr;
                    }
                }
                out
            }
            Op::Outer => {
                let per_head = rows / self.heads(v);
                let (a, b) = (args[0], args[1]);
                (0..rows)
                    .flat_map(|r| b[r / per_head * cols..][..cols].iter().map(move |&bj| a[r] * bj))
                    .collect()
            }
            Op::Reduce(op) => {
                let s = args[0].iter().fold(T::zero(), |acc, &a| acc + a);
                match op {
                    ReduceOp::Sum => vec![s],
                    ReduceOp::Mean => vec![s / T::from(args[0].len()).unwrap_or_else(T::one)],
                }
            }
            Op::Slice { .. } => {
                let o = self.extra[v.index()];
                args[0][o..o + n].to_vec()
            }
            Op::Pad { .. } => {
                let o = self.extra[v.index()];
                let mut out = vec![T::zero(); n];
                out[o..o + args[0].len()].copy_from_slice(args[0]);
                out
            }
            Op::Concat => args.iter().flat_map(|a| a.iter().copied()).collect(),
        }
    }
}

/// The values of a cell's `stop_gradient` nodes, per step of a sequence.
pub type StopValues<T> = Vec<Vec<(ValueId, Vec<T>)>>;

/// Where a run met a kink exactly, as `(step, node, element)` in order:
/// every `min`, `max` or comparison whose operands are equal, and every
/// `relu`, `abs`, `step` or `sign` of zero. The derivative there is the
/// backward step's convention (a tie's even split), which no finite
/// difference can check once a perturbation moves the run off the tie.
pub type Ties = Vec<(usize, ValueId, usize)>;

/// What a run records besides its results.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Record {
    Nothing,
    /// Its [`Ties`] (a run whose `stop_gradient` values are held, so
    /// there is nothing new to record of them).
    Ties,
    /// Its `stop_gradient` values ([`StopValues`]) and its [`Ties`].
    StopsAndTies,
}

/// What one step recorded: its `stop_gradient` nodes' values, and its
/// ties as `(node, element)`.
struct StepRecord<T> {
    stops: Vec<(ValueId, Vec<T>)>,
    ties: Vec<(ValueId, usize)>,
}

/// The elements at which `op`, applied to `args`, meets its kink exactly.
fn ties_at<T: Float>(op: &Op, args: &[&[T]]) -> Vec<usize> {
    match (op, args) {
        (Op::Binary(BinaryOp::Min | BinaryOp::Max | BinaryOp::Ge | BinaryOp::Gt), [a, b]) => {
            // A scalar operand stands for every element.
            let at = |x: &[T], i: usize| x.get(i).or(x.first()).copied();
            (0..a.len().max(b.len())).filter(|&i| at(a, i).is_some_and(|a| Some(a) == at(b, i))).collect()
        }
        (Op::Unary(UnaryOp::Relu | UnaryOp::Abs | UnaryOp::Step | UnaryOp::Sign), [x]) => {
            (0..x.len()).filter(|&i| x[i] == T::zero()).collect()
        }
        _ => Vec::new(),
    }
}

/// A value after [`evaluate`]: parameters come from the leaves.
pub(crate) fn value<'a, T>(
    graph: &Graph,
    vals: &'a [Vec<T>],
    leaves: &LeafValues<'a, T>,
    v: ValueId,
) -> &'a [T] {
    match graph.node(v).op {
        Op::Param(i) => &leaves.params[i],
        _ => &vals[v.index()],
    }
}

/// `x` rounded to `precision` (through f32, whose range bf16 shares and
/// fp16's lies within).
fn rounded_to<T: Float>(precision: Precision, x: T) -> T {
    let rounded = precision.round(x.to_f32().unwrap_or(f32::NAN));
    T::from(rounded).unwrap_or_else(T::nan)
}

fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::zero(), |acc, (&x, &y)| acc + x * y)
}

/// One step's results.
#[derive(Clone, Debug, PartialEq)]
pub struct StepResult<T> {
    /// The step's output vector.
    pub output: Vec<T>,
    /// Each state's value after the step, in declaration order.
    pub next_states: Vec<Vec<T>>,
}

/// A whole sequence's results.
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceResult<T> {
    /// `[steps, output_size]`, row-major.
    pub outputs: Vec<T>,
    /// `states[t][i]`: state `i` after step `t`.
    pub states: Vec<Vec<Vec<T>>>,
    /// The states after the last step (the initial states if there are no steps).
    pub final_states: Vec<Vec<T>>,
}

impl Cell {
    /// Fixes the size variables. Bindings for sizes the cell does not use are ignored.
    pub fn bind(&self, sizes: &Bindings) -> Result<BoundCell<'_>, InterpError> {
        BoundCell::new(self, sizes)
    }
}

impl<'c> BoundCell<'c> {
    fn new(cell: &'c Cell, sizes: &Bindings) -> Result<BoundCell<'c>, InterpError> {
        let sizes: Bindings =
            sizes.iter().filter(|(k, _)| cell.sizes.contains(k)).map(|(k, v)| (k.clone(), *v)).collect();
        let mut input_slices = Vec::new();
        let mut offset = 0usize;
        for i in &cell.inputs {
            let what = format!("input `{}`", i.name);
            let n = eval_dim(&cell.name, &sizes, &what, &i.dim)?;
            check_elements(&what, n, 1)?;
            input_slices.push((offset, n));
            offset = offset
                .checked_add(n)
                .ok_or(InterpError::DimOverflow { what: "the inputs".into(), dim: String::new() })?;
        }
        let state_sizes = cell
            .states
            .iter()
            .map(|s| {
                let what = format!("state `{}`", s.name);
                let n = eval_dim(&cell.name, &sizes, &what, &s.dim)?;
                check_elements(&what, n, 1).map(|()| n)
            })
            .collect::<Result<Vec<_>, _>>()?;
        // `((rows, cols), heads)` of each parameter.
        let (param_shapes, param_heads): (Vec<(usize, usize)>, Vec<usize>) = cell
            .params
            .iter()
            .map(|p| {
                let what = format!("parameter `{}`", p.name);
                let (rows, cols, heads) = match &p.ty {
                    Type::Matrix(h, m, n) => {
                        let heads = eval_dim(&cell.name, &sizes, &what, h)?;
                        let rows = eval_dim(&cell.name, &sizes, &what, m)?;
                        let rows = heads.checked_mul(rows).ok_or_else(|| InterpError::DimOverflow {
                            what: what.clone(),
                            dim: p.ty.to_string(),
                        })?;
                        (rows, eval_dim(&cell.name, &sizes, &what, n)?, heads)
                    }
                    Type::Vector(d) => (eval_dim(&cell.name, &sizes, &what, d)?, 1, 1),
                    Type::Scalar => (1, 1, 1),
                };
                check_elements(&what, rows, cols).map(|()| ((rows, cols), heads))
            })
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .unzip();
        let mask_sizes = cell
            .masks
            .iter()
            .map(|m| match (&m.ty, m.param) {
                (_, Some(p)) => Ok(param_shapes[p].0 * param_shapes[p].1),
                (Type::Vector(d), None) => eval_dim(&cell.name, &sizes, "a mask", d),
                (t, None) => Err(InterpError::Internal { message: format!("a mask of type {t}") }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let plan = Shapes::new(cell, &sizes, &cell.name)?;
        Ok(BoundCell {
            cell,
            sizes,
            plan,
            input_slices,
            input_size: offset,
            state_sizes,
            param_heads,
            param_shapes,
            mask_sizes,
            precision: Precision::F32,
            rates: cell.default_rates(),
        })
    }

    /// This cell with its masks evaluated at `rates` (one per `rate` of the
    /// cell, in order) instead of its defaults: a zoneout's expectation
    /// depends on its rate.
    pub fn with_rates(self, rates: &[f32]) -> Self {
        BoundCell { rates: rates.to_vec(), ..self }
    }

    /// This cell computing the products of its matrix parameters in
    /// `precision`, forwards and backwards, as a back end in that precision
    /// does (see [`Precision`]): at [`Precision::Bf16`], the oracle of bf16
    /// arithmetic, every other value still in the caller's float type.
    pub fn with_precision(self, precision: Precision) -> Self {
        BoundCell { precision, ..self }
    }

    /// Elements of each mask: of a row, or of a DropConnect mask's parameter.
    pub fn mask_sizes(&self) -> &[usize] {
        &self.mask_sizes
    }

    /// The cell this binds.
    pub fn cell(&self) -> &'c Cell {
        self.cell
    }

    /// The size variables' values (only those the cell uses).
    pub fn sizes(&self) -> &Bindings {
        &self.sizes
    }

    /// Features per step: all inputs together.
    pub fn input_size(&self) -> usize {
        self.input_size
    }

    /// Elements of the step's output.
    pub fn output_size(&self) -> usize {
        self.plan.elements(self.cell.output)
    }

    /// Elements of each state, in declaration order.
    pub fn state_sizes(&self) -> &[usize] {
        &self.state_sizes
    }

    /// `(offset, len)` of each input in the step's feature vector.
    pub fn input_slices(&self) -> &[(usize, usize)] {
        &self.input_slices
    }

    /// The forward graph's shapes and evaluation order at these sizes.
    pub fn shapes(&self) -> &Shapes {
        &self.plan
    }

    /// `(rows, cols)` of each parameter; `cols == 1` for a vector; `(heads*m, n)`
    /// for a block-diagonal `[heads, m, n]`.
    pub fn param_shapes(&self) -> &[(usize, usize)] {
        &self.param_shapes
    }

    /// The heads of each parameter (1 for a vector or a plain matrix): a
    /// parameter `[heads, m, n]` has shape `(heads*m, n)` in [`Self::param_shapes`].
    pub fn param_heads(&self) -> &[usize] {
        &self.param_heads
    }

    /// Each parameter's initialiser with the sizes substituted.
    pub fn param_inits(&self) -> Result<Vec<ConcreteInit>, InterpError> {
        self.cell
            .params
            .iter()
            .map(|p| {
                let eval = |e: &crate::ir::ConstExpr| {
                    let v = e.eval(&self.sizes).map_err(|s| InterpError::Init {
                        param: p.name.clone(),
                        message: format!("size `{s}` has no value"),
                    })?;
                    if v.is_finite() {
                        Ok(v)
                    } else {
                        Err(InterpError::Init { param: p.name.clone(), message: format!("{} is {v}", e) })
                    }
                };
                Ok(match &p.init {
                    Init::Zeros => ConcreteInit::Zeros,
                    Init::Ones => ConcreteInit::Ones,
                    Init::Uniform(e) => ConcreteInit::Uniform(eval(e)?),
                    Init::Constant(e) => ConcreteInit::Constant(eval(e)?),
                })
            })
            .collect()
    }

    /// Orders named parameters as the cell declares them, checking names and lengths.
    pub fn params_from_map<T: Clone>(
        &self,
        mut named: BTreeMap<String, Vec<T>>,
    ) -> Result<Vec<Vec<T>>, InterpError> {
        let mut out = Vec::with_capacity(self.cell.params.len());
        for p in &self.cell.params {
            out.push(
                named.remove(&p.name).ok_or_else(|| InterpError::MissingParam { name: p.name.clone() })?,
            );
        }
        if let Some(name) = named.into_keys().next() {
            return Err(InterpError::UnknownParam { name });
        }
        self.check_params(&out)?;
        Ok(out)
    }

    fn check_params<T>(&self, params: &[Vec<T>]) -> Result<(), InterpError> {
        if params.len() != self.cell.params.len() {
            return Err(InterpError::Count {
                what: "parameters",
                expected: self.cell.params.len(),
                found: params.len(),
            });
        }
        for (i, ((p, data), &(r, c))) in
            self.cell.params.iter().zip(params).zip(&self.param_shapes).enumerate()
        {
            if data.len() != r * c {
                let shape = p.weight_shape((r, c), self.param_heads[i]);
                let expected = format!("{shape:?}");
                return Err(InterpError::Shape {
                    tensor: p.name.clone(),
                    expected: format!("{expected} ({} elements)", r * c),
                    found: format!("{} elements", data.len()),
                });
            }
        }
        Ok(())
    }

    fn check_states<S: AsRef<[T]>, T>(&self, states: &[S]) -> Result<(), InterpError> {
        if states.len() != self.state_sizes.len() {
            return Err(InterpError::Count {
                what: "states",
                expected: self.state_sizes.len(),
                found: states.len(),
            });
        }
        for ((s, decl), &n) in states.iter().zip(&self.cell.states).zip(&self.state_sizes) {
            if s.as_ref().len() != n {
                return Err(InterpError::Shape {
                    tensor: format!("state {}", decl.name),
                    expected: format!("[{n}]"),
                    found: format!("[{}]", s.as_ref().len()),
                });
            }
        }
        Ok(())
    }

    /// One step: `x` is the step's feature vector, `states` the values at the start.
    pub fn step<T: Float, S: AsRef<[T]>>(
        &self,
        x: &[T],
        states: &[S],
        params: &[Vec<T>],
    ) -> Result<StepResult<T>, InterpError> {
        if x.len() != self.input_size {
            return Err(InterpError::Shape {
                tensor: "input".into(),
                expected: format!("[{}]", self.input_size),
                found: format!("[{}]", x.len()),
            });
        }
        self.check_states(states)?;
        self.check_params(params)?;
        Ok(self.step_unchecked(x, states, params, &[], Record::Nothing).0)
    }

    /// The values every mask of the cell takes in evaluation (see
    /// [`crate::ir::masks`]) at `rates`, one per `rate` of the cell; a
    /// DropConnect mask's is its parameter's size. The interpreter's own
    /// steps run in evaluation at the cell's default rates, or those of
    /// [`BoundCell::with_rates`].
    pub fn evaluation_masks<T: Float>(&self, rates: &[f32]) -> Vec<Vec<T>> {
        self.cell
            .masks
            .iter()
            .zip(&self.mask_sizes)
            .map(|(m, &n)| {
                let p = rates.get(m.rate).copied().unwrap_or(0.0);
                vec![T::from(m.function.evaluation(p)).unwrap_or_else(T::nan); n]
            })
            .collect()
    }

    /// One step, its `stop_gradient` nodes taking the `pinned` values
    /// where given; returns what `record` asks for too: the values they
    /// took, the step's ties (`(node, element)`, see [`Ties`]).
    fn step_unchecked<T: Float, S: AsRef<[T]>>(
        &self,
        x: &[T],
        states: &[S],
        params: &[Vec<T>],
        pinned: &[(ValueId, Vec<T>)],
        record: Record,
    ) -> (StepResult<T>, StepRecord<T>) {
        let states: Vec<&[T]> = states.iter().map(|s| s.as_ref()).collect();
        let masks = self.evaluation_masks::<T>(&self.rates);
        let masks: Vec<&[T]> = masks.iter().map(Vec::as_slice).collect();
        let leaves = LeafValues {
            x,
            input_slices: &self.input_slices,
            states: &states,
            params,
            seeds: &[],
            masks: &masks,
            pinned,
        };
        let vals = evaluate(self.cell, &self.plan, &leaves, self.precision);
        let get = |v: ValueId| value(self.cell, &vals, &leaves, v).to_vec();
        let stops = match record {
            Record::StopsAndTies => (self.plan.order.iter())
                .filter(|&&v| self.cell.node(v).op == Op::Unary(UnaryOp::StopGradient))
                .map(|&v| (v, get(v)))
                .collect(),
            Record::Nothing | Record::Ties => Vec::new(),
        };
        let ties = match record {
            Record::Nothing => Vec::new(),
            Record::Ties | Record::StopsAndTies => (self.plan.order.iter())
                .flat_map(|&v| {
                    let operands = self.cell.operands(v);
                    let args: Vec<&[T]> =
                        operands.iter().map(|&o| value(self.cell, &vals, &leaves, o)).collect();
                    ties_at(&self.cell.node(v).op, &args).into_iter().map(move |i| (v, i))
                })
                .collect(),
        };
        let result = StepResult {
            output: get(self.cell.output),
            next_states: self.cell.next_states.iter().map(|&v| get(v)).collect(),
        };
        (result, StepRecord { stops, ties })
    }

    /// Runs `steps = xs.len() / input_size` steps from `initial_states`
    /// (`xs` is `[steps, input_size]`, row-major).
    pub fn run<T: Float, S: AsRef<[T]>>(
        &self,
        xs: &[T],
        initial_states: &[S],
        params: &[Vec<T>],
    ) -> Result<SequenceResult<T>, InterpError> {
        self.run_steps(xs, initial_states, params, None, Record::Nothing).map(|(r, _, _)| r)
    }

    /// [`BoundCell::run`], the values its `stop_gradient` nodes took at
    /// each step (for [`BoundCell::run_holding_stops`]), and its [`Ties`].
    pub fn run_recording_stops<T: Float, S: AsRef<[T]>>(
        &self,
        xs: &[T],
        initial_states: &[S],
        params: &[Vec<T>],
    ) -> Result<(SequenceResult<T>, StopValues<T>, Ties), InterpError> {
        self.run_steps(xs, initial_states, params, None, Record::StopsAndTies)
    }

    /// [`BoundCell::run`] with each step's `stop_gradient` nodes held at
    /// the values `stops` recorded, so that a finite difference sees them as
    /// the constants the backward step takes them for.
    pub fn run_holding_stops<T: Float, S: AsRef<[T]>>(
        &self,
        xs: &[T],
        initial_states: &[S],
        params: &[Vec<T>],
        stops: &StopValues<T>,
    ) -> Result<(SequenceResult<T>, Ties), InterpError> {
        self.run_steps(xs, initial_states, params, Some(stops), Record::Ties).map(|(r, _, ties)| (r, ties))
    }

    fn run_steps<T: Float, S: AsRef<[T]>>(
        &self,
        xs: &[T],
        initial_states: &[S],
        params: &[Vec<T>],
        pinned: Option<&StopValues<T>>,
        record: Record,
    ) -> Result<(SequenceResult<T>, StopValues<T>, Ties), InterpError> {
        if self.input_size == 0 || !xs.len().is_multiple_of(self.input_size) {
            return Err(InterpError::Shape {
                tensor: "input".into(),
                expected: format!("[steps, {}]", self.input_size),
                found: format!("{} elements", xs.len()),
            });
        }
        self.check_states(initial_states)?;
        self.check_params(params)?;
        let mut states: Vec<Vec<T>> = initial_states.iter().map(|s| s.as_ref().to_vec()).collect();
        let mut outputs = Vec::new();
        let mut history = Vec::new();
        let (mut stops, mut ties) = (Vec::new(), Vec::new());
        for (t, x) in xs.chunks(self.input_size).enumerate() {
            let pins = pinned.and_then(|p| p.get(t)).map_or(&[][..], Vec::as_slice);
            let (r, recorded) = self.step_unchecked(x, &states, params, pins, record);
            outputs.extend_from_slice(&r.output);
            states = r.next_states;
            history.push(states.clone());
            if record == Record::StopsAndTies {
                stops.push(recorded.stops);
            }
            ties.extend(recorded.ties.into_iter().map(|(v, i)| (t, v, i)));
        }
        Ok((SequenceResult { outputs, states: history, final_states: states }, stops, ties))
    }
}

/// Gradients of a whole sequence (backpropagation through time).
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceGrads<T> {
    /// `[steps, input_size]`, row-major.
    pub d_inputs: Vec<T>,
    /// One per state: the adjoint of its initial value.
    pub d_initial_states: Vec<Vec<T>>,
    /// One per parameter, in its shape (row-major for matrices).
    pub d_params: Vec<Vec<T>>,
}

impl BoundCell<'_> {
    /// Backpropagation through time with the backward step `grad` (from
    /// [`crate::autodiff::differentiate`] of this cell): given the adjoints
    /// of every step's output (`[steps, output_size]`) and of the final
    /// states, returns the adjoints of the inputs, initial states and
    /// parameters.
    pub fn backward<T: Float, S: AsRef<[T]>>(
        &self,
        grad: &crate::autodiff::Gradient,
        xs: &[T],
        initial_states: &[S],
        params: &[Vec<T>],
        d_outputs: &[T],
        d_final_states: &[S],
    ) -> Result<SequenceGrads<T>, InterpError> {
        let forward = self.run(xs, initial_states, params)?;
        let steps = xs.len() / self.input_size;
        let out = self.output_size();
        if d_outputs.len() != steps * out {
            return Err(InterpError::Shape {
                tensor: "d_outputs".into(),
                expected: format!("[{steps}, {out}]"),
                found: format!("{} elements", d_outputs.len()),
            });
        }
        self.check_states(d_final_states)?;
        let plan = Shapes::new(&grad.graph, &self.sizes, &self.cell.name)?;

        let mut carry: Vec<Vec<T>> = d_final_states.iter().map(|s| s.as_ref().to_vec()).collect();
        let mut d_inputs = vec![T::zero(); xs.len()];
        let mut d_params: Vec<Vec<T>> = params.iter().map(|p| vec![T::zero(); p.len()]).collect();
        let masks = self.evaluation_masks::<T>(&self.rates);
        let masks: Vec<&[T]> = masks.iter().map(Vec::as_slice).collect();
        for t in (0..steps).rev() {
            let before: Vec<&[T]> = if t == 0 {
                initial_states.iter().map(|s| s.as_ref()).collect()
            } else {
                forward.states[t - 1].iter().map(|s| s.as_slice()).collect()
            };
            let mut seeds: Vec<&[T]> = vec![&d_outputs[t * out..(t + 1) * out]];
            seeds.extend(carry.iter().map(|c| c.as_slice()));
            let x = &xs[t * self.input_size..(t + 1) * self.input_size];
            let leaves = LeafValues {
                x,
                input_slices: &self.input_slices,
                states: &before,
                params,
                seeds: &seeds,
                masks: &masks,
                pinned: &[],
            };
            let vals = evaluate(&grad.graph, &plan, &leaves, self.precision);
            let get = |v: ValueId| value(&grad.graph, &vals, &leaves, v);

            let dx = &mut d_inputs[t * self.input_size..(t + 1) * self.input_size];
            for (d, &(o, l)) in grad.d_inputs.iter().zip(&self.input_slices) {
                if let Some(d) = d {
                    dx[o..o + l].copy_from_slice(get(*d));
                }
            }
            for (acc, d) in d_params.iter_mut().zip(&grad.d_params) {
                if let Some(d) = d {
                    for (a, &g) in acc.iter_mut().zip(get(*d)) {
                        *a = *a + g;
                    }
                }
            }
            let next: Vec<Vec<T>> = grad
                .d_states
                .iter()
                .zip(&self.state_sizes)
                .map(|(d, &n)| match d {
                    Some(d) => get(*d).to_vec(),
                    None => vec![T::zero(); n],
                })
                .collect();
            carry = next;
        }
        Ok(SequenceGrads { d_inputs, d_initial_states: carry, d_params })
    }
}
