//! Models: a compiled cell stacked into layers and directions, with its
//! weights, sizes bound per layer, and the device that runs it.
//!
//! Sizes come from `-D`-style bindings, else from the weights and the data
//! (a `[4*H, I]` weight of shape `[20, 3]` binds `H = 5` and `I = 3`);
//! a size bound two ways is an error naming both sources. The size
//! variables of the input are bound per layer: layer `k > 0` reads the
//! previous layer's output (`O * directions` features).

pub mod call;
mod checks;
pub mod device_call;
pub(crate) mod driver;
pub(crate) mod host_passes;
mod masks;
pub mod passes;
pub mod stream;

use crate::backend::Device;
pub use crate::cell::{CompiledCell, Layer, Side};
use crate::error::{Result, RuntimeError};
pub use crate::layers::{weight_suffix, ModelConfig};
use crate::options::{CallOptions, Settled};
use crate::pass::{PassWeights, PreparedWeights, Span};
use crate::weights::Weights;
use cellc::dims::Bindings;
use cellc::interp::ConcreteInit;
use cellc::precision::Precision;
use std::sync::Arc;

/// A runnable model: a compiled cell stacked into layers and directions,
/// its weights, and the back end that runs it.
///
/// Made by [`Model::new`] (weights given, or drawn from the cell's `init`
/// clauses with a seed). Its passes take a batch in the caller's layout
/// ([`crate::Input`]): [`Model::forward`] for inference,
/// [`Model::forward_train`] and [`Model::backward`] for training; the
/// passes over memory the caller owns are [`Model::forward_into`] and
/// [`Model::backward_from`], and [`Model::stream`] runs it a few steps at
/// a time. A model is `Send + Sync`: passes may run on several threads at
/// once.
///
/// ```
/// use cellc_runtime::backend::reference::Reference;
/// use cellc_runtime::{Align, CompiledCell, Input, Major, Model, ModelConfig};
/// use std::sync::Arc;
///
/// let cell = CompiledCell::from_source("gru.cell", "
///     cell gru {
///         input x[I]
///         state h[H]
///         param weight_ih[3*H, I], weight_hh[3*H, H], bias_ih[3*H] = zeros, bias_hh[3*H] = zeros
///         let xr, xz, xn = chunk(weight_ih @ x + bias_ih, 3)
///         let hr, hz, hn = chunk(weight_hh @ h + bias_hh, 3)
///         let r = sigmoid(xr + hr)
///         let z = sigmoid(xz + hz)
///         h' = (1 - z) * tanh(xn + r * hn) + z * h
///         output h'
///     }", None)?;
/// let sizes = [("H".to_string(), 8)].into();      // as `-D H=8`; I comes from the data
/// let model = Model::new(Arc::new(cell), ModelConfig::default(), &sizes, Some(3), None, 42, Box::new(Reference))?;
///
/// // Two sequences of lengths 2 and 4 (unsorted is fine), padded to 4 steps, batch-first.
/// let x: Vec<f32> = (0..2 * 4 * 3).map(|i| (i as f32 * 0.3).sin()).collect();
/// let input = Input::Padded { data: &x, batch: 2, steps: 4, major: Major::BatchFirst, align: Align::Left, lengths: &[2, 4] };
/// let out = model.forward(input, None)?;          // states start at zero
/// assert_eq!(out.data.len(), 2 * 4 * 8);          // [B, T, H], zeros at padding
/// assert!(out.data[2 * 8..4 * 8].iter().all(|&v| v == 0.0));
///
/// // Training: a loss of 0.5 * |output|^2 has d_output = output.
/// let (out, trace) = model.forward_train(input, None)?;
/// let grads = model.backward(&trace, &out.data, None)?;
/// assert_eq!(grads.d_input.len(), x.len());       // laid out like the input
/// assert_eq!(grads.d_params[0].len(), 4);         // [layer * directions + direction][param]
/// assert!(grads.d_params[0][1].iter().any(|&g| g != 0.0)); // weight_hh's gradient
/// # Ok::<(), cellc_runtime::RuntimeError>(())
/// ```
pub struct Model {
    pub(crate) compiled: Arc<CompiledCell>,
    pub(crate) config: ModelConfig,
    pub(crate) layers: Vec<Layer>,
    /// `params[layer * directions + direction][param]`.
    pub(crate) params: Vec<Vec<Vec<f32>>>,
    /// The back end's prepared form of each entry of `params` (emptied
    /// whenever the parameters are handed out mutably).
    pub(crate) prepared: Vec<PreparedWeights>,
    pub(crate) device: Box<dyn Device>,
    /// False for a model made by [`Model::without_weights`]: `params` holds
    /// empty lists, and every pass must be given its weights.
    pub(crate) owns_weights: bool,
    /// Dropout between layers in training ([`Model::with_dropout`]).
    pub(crate) dropout: f32,
    /// The rate of each of the cell's `rate`s ([`Model::with_rates`]).
    pub(crate) rates: Vec<f32>,
    /// The precision of its calls' products unless a call asks for
    /// another ([`Model::with_precision`]), one the device computes.
    pub(crate) precision: Precision,
    /// The seed the model's own training passes draw masks from, and how
    /// many have drawn (each the next offset).
    mask_seed: u64,
    mask_calls: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("cell", &self.compiled.forward.name)
            .field("config", &self.config)
            .field("sizes", &self.layers.iter().map(|l| &l.sizes).collect::<Vec<_>>())
            .field("device", &self.device.name())
            .field("precision", &self.precision)
            .finish()
    }
}

impl Model {
    /// Builds a model. `sizes` are explicit bindings; `input_size` (the
    /// data's features) and `weights` (if any) bind the rest. Without
    /// weights, parameters are initialised from `seed` per the cell's init clauses.
    pub fn new(
        compiled: Arc<CompiledCell>,
        config: ModelConfig,
        sizes: &Bindings,
        input_size: Option<usize>,
        weights: Option<&Weights>,
        seed: u64,
        device: Box<dyn Device>,
    ) -> Result<Model> {
        let layers = crate::layers::build(&compiled, &config, sizes, input_size, weights)?;
        let mut model = Self::unweighted(compiled, config, layers, device);
        model.ensure_weights_fit()?;
        model.params = match weights {
            Some(w) => model.take_weights(w)?,
            None => model.init_params(seed)?,
        };
        model.owns_weights = true;
        model.mask_seed = seed;
        Ok(model)
    }

    /// A model that keeps no weights of its own: every pass is given them
    /// ([`crate::Call::weights`], the device passes), as a framework that
    /// owns its parameters calls it. `sizes` and `input_size` bind every
    /// size; nothing the size of the weights is allocated.
    pub fn without_weights(
        compiled: Arc<CompiledCell>,
        config: ModelConfig,
        sizes: &Bindings,
        input_size: Option<usize>,
        device: Box<dyn Device>,
    ) -> Result<Model> {
        let layers = crate::layers::build(&compiled, &config, sizes, input_size, None)?;
        Ok(Self::unweighted(compiled, config, layers, device))
    }

    /// Keeps a copy of `weights` as the model's own (every name and shape
    /// of [`Model::weight_names`], checked as [`Model::new`] checks them),
    /// in place of any it had: a model made [`Model::without_weights`] for
    /// a framework's calls, given weights that will not change for a while,
    /// packs them once for all its calls instead of on every call. The
    /// back end's packed copies of the old ones are dropped.
    pub fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        self.ensure_weights_fit()?;
        self.params = self.take_weights(weights)?;
        self.prepared.iter_mut().for_each(|p| *p = Default::default());
        self.owns_weights = true;
        Ok(())
    }

    /// A model of `layers` whose parameter lists are empty.
    fn unweighted(
        compiled: Arc<CompiledCell>,
        config: ModelConfig,
        layers: Vec<Layer>,
        device: Box<dyn Device>,
    ) -> Model {
        let slots = layers.len() * if config.bidirectional { 2 } else { 1 };
        let per = compiled.forward.params.len();
        let rates = compiled.forward.default_rates();
        Model {
            compiled,
            config,
            layers,
            params: (0..slots).map(|_| vec![Vec::new(); per]).collect(),
            prepared: (0..slots).map(|_| Default::default()).collect(),
            device,
            owns_weights: false,
            dropout: 0.0,
            rates,
            precision: Precision::F32,
            mask_seed: 0,
            mask_calls: Default::default(),
        }
    }

    /// The model with dropout at `rate` between layers (PyTorch's
    /// `nn.LSTM(dropout=rate)`): in training passes, every layer's output
    /// but the last is dropped, unit by unit, with probability `rate`, and
    /// kept ones scaled by `1 / (1 - rate)` (see [`crate::dropout`]).
    /// Inference never drops. `rate` is in `[0, 1)`.
    pub fn with_dropout(mut self, rate: f32) -> Result<Model> {
        crate::dropout::check_rate("dropout", rate)?;
        self.dropout = rate;
        Ok(self)
    }

    /// Its dropout rate between layers ([`Model::with_dropout`]).
    pub fn dropout(&self) -> f32 {
        self.dropout
    }

    /// The model with its calls' products of matrix parameters in the
    /// precision its device computes for `asked` (see
    /// [`cellc::precision`]; bf16, fp16 and TF32 products have f32 sums),
    /// unless a call asks for another ([`crate::CallOptions::precision`]):
    /// an error if the device has no such products.
    pub fn with_precision(mut self, asked: Precision) -> Result<Model> {
        self.precision = self.computes(asked)?;
        Ok(self)
    }

    /// The precision its device computes the products of a call that asks
    /// for `asked` in ([`Device::precision`]): an error naming the
    /// precision if it has no such products.
    pub fn computes(&self, asked: Precision) -> Result<Precision> {
        self.device.precision(asked)
    }

    /// The precision of its calls' products unless a call asks for another
    /// ([`Model::with_precision`]; f32 by default).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The precision a call that asks for `asked` computes in: the
    /// device's answer ([`Device::precision`]), or the model's for `None`.
    pub(crate) fn call_precision(&self, asked: Option<Precision>) -> Result<Precision> {
        asked.map_or(Ok(self.precision), |asked| self.computes(asked))
    }

    /// A call's options settled against the model, each checked: what its
    /// pass runs, and what a training forward keeps for its backward.
    pub(crate) fn settle(&self, options: &CallOptions) -> Result<Settled> {
        Ok(Settled {
            dropout: self.caller_dropout(options.masks, options.dropout)?,
            masking: self.caller_masking(options.masks, options.rates)?,
            precision: self.call_precision(options.precision)?,
        })
    }

    /// The dropout between layers of a caller's pass: a call in training
    /// mode (one that gives its `masks`) drops, at its own `rate` if it
    /// gives one (checked) or else the model's; one in evaluation mode does not.
    pub(crate) fn caller_dropout(
        &self,
        masks: Option<crate::dropout::MaskSeed>,
        rate: Option<f32>,
    ) -> Result<Option<crate::dropout::BetweenLayers>> {
        let rate = self.dropout_rate(rate)?;
        Ok(masks.and_then(|masks| crate::dropout::BetweenLayers::of(rate, masks)))
    }

    /// A call's rate of dropout between layers: its own (checked), else the model's.
    pub(crate) fn dropout_rate(&self, rate: Option<f32>) -> Result<f32> {
        match rate {
            Some(rate) => crate::dropout::check_rate("dropout", rate).map(|()| rate),
            None => Ok(self.dropout),
        }
    }

    /// The masks of the model's next training pass of its own (or of a
    /// layer that calls it, as the candle layer): the seed the model was
    /// made with, and the next offset (each call one more).
    pub fn next_mask_seed(&self) -> crate::dropout::MaskSeed {
        let offset = self.mask_calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        crate::dropout::MaskSeed { seed: self.mask_seed, offset }
    }

    /// Whether the model keeps weights of its own (see [`Model::without_weights`]).
    pub fn owns_weights(&self) -> bool {
        self.owns_weights
    }

    /// Each parameter's number of floats, `[layer * directions + direction][param]`.
    pub(crate) fn param_lens(&self) -> Vec<Vec<usize>> {
        self.layers
            .iter()
            .flat_map(|l| {
                let lens: Vec<usize> = l.param_shapes.iter().map(|&(r, c)| r * c).collect();
                std::iter::repeat_n(lens, self.directions())
            })
            .collect()
    }

    /// The cell every layer runs.
    pub fn compiled(&self) -> &CompiledCell {
        &self.compiled
    }

    /// Its layers and directions.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Each layer's program at its sizes, first to last.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// 2 for a bidirectional model, else 1.
    pub fn directions(&self) -> usize {
        if self.config.bidirectional {
            2
        } else {
            1
        }
    }

    /// The name of the back end it runs on ([`crate::backend::Device::name`]).
    pub fn backend_name(&self) -> &str {
        self.device.name()
    }

    /// Features per step of the input.
    pub fn input_size(&self) -> usize {
        self.layers[0].input_size
    }

    /// Features per step of the output: the last layer's output times the directions.
    pub fn output_size(&self) -> usize {
        self.layers.last().map_or(0, |l| l.output_size) * self.directions()
    }

    /// Every weight's name and shape, in a stable order.
    pub fn weight_names(&self) -> Vec<(String, Vec<usize>)> {
        let mut out = Vec::new();
        for (k, layer) in self.layers.iter().enumerate() {
            for d in 0..self.directions() {
                let params = self.compiled.forward.params.iter().zip(&layer.param_shapes);
                for ((p, &shape), &heads) in params.zip(&layer.param_heads) {
                    let shape = p.weight_shape(shape, heads);
                    out.push((format!("{}{}", p.name, weight_suffix(k, d == 1)), shape));
                }
            }
        }
        out
    }

    /// `flat` (one item per weight, in [`Model::weight_names`]' order)
    /// grouped as the passes take weights, `[layer * directions + direction][param]`.
    pub fn group_by_slot<T>(&self, flat: Vec<T>) -> Result<Vec<Vec<T>>> {
        let (slots, per) = (self.layers.len() * self.directions(), self.compiled.forward.params.len());
        if flat.len() != slots * per {
            return Err(RuntimeError::Shape {
                tensor: "weights".into(),
                expected: format!("{} tensors", slots * per),
                found: format!("{} tensors", flat.len()),
            });
        }
        let mut flat = flat.into_iter();
        Ok((0..slots).map(|_| flat.by_ref().take(per).collect()).collect())
    }

    fn take_weights(&self, w: &Weights) -> Result<Vec<Vec<Vec<f32>>>> {
        let names = self.weight_names();
        for name in w.names() {
            if !names.iter().any(|(n, _)| n == name) {
                return Err(RuntimeError::UnexpectedWeight {
                    name: name.to_string(),
                    expected: names.into_iter().map(|(n, _)| n).collect(),
                });
            }
        }
        // One list per layer and direction, even for a cell without parameters.
        let per = self.compiled.forward.params.len();
        let slots = self.layers.len() * self.directions();
        let mut out: Vec<Vec<Vec<f32>>> = (0..slots).map(|_| Vec::with_capacity(per)).collect();
        for (i, (name, shape)) in names.iter().enumerate() {
            let t = w.get(name).ok_or_else(|| RuntimeError::MissingWeight { name: name.clone() })?;
            if &t.shape != shape {
                return Err(RuntimeError::Shape {
                    tensor: name.clone(),
                    expected: crate::error::shape_text(shape),
                    found: crate::error::shape_text(&t.shape),
                });
            }
            if let Some(slot) = out.get_mut(i / per.max(1)) {
                slot.push(t.data.clone());
            }
        }
        Ok(out)
    }

    /// Refuses a model whose weights (and their gradients, when training)
    /// cannot fit in memory, before they are allocated.
    fn ensure_weights_fit(&self) -> Result<()> {
        let elements: u128 = self
            .layers
            .iter()
            .flat_map(|layer| layer.param_shapes.iter())
            .map(|&(r, c)| r as u128 * c as u128)
            .sum::<u128>()
            * self.directions() as u128;
        crate::memory::ensure_fits(
            || format!("the weights of cell `{}` ({elements} f32 values)", self.compiled.forward.name),
            crate::memory::f32_bytes(elements),
        )
    }

    /// Each parameter's initialiser, its `init` clause at the layer's
    /// sizes, `[layer * directions + direction][param]`.
    pub fn param_inits(&self) -> Result<Vec<Vec<ConcreteInit>>> {
        let mut out = Vec::new();
        for layer in &self.layers {
            let inits = self.compiled.forward.bind(&layer.sizes)?.param_inits()?;
            out.extend(std::iter::repeat_n(inits, self.directions()));
        }
        Ok(out)
    }

    /// Parameters from their init clauses; each weight's stream depends on
    /// the seed and its name only.
    fn init_params(&self, seed: u64) -> Result<Vec<Vec<Vec<f32>>>> {
        use rand_chacha::rand_core::{Rng, SeedableRng};
        let mut names = self.weight_names().into_iter();
        let draw = |init: &ConcreteInit, (name, shape): (String, Vec<usize>)| -> Vec<f32> {
            let stream = name
                .bytes()
                .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ stream);
            (0..shape.iter().product::<usize>())
                .map(|_| match *init {
                    ConcreteInit::Zeros => 0.0,
                    ConcreteInit::Ones => 1.0,
                    ConcreteInit::Constant(v) => v as f32,
                    ConcreteInit::Uniform(b) => {
                        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                        ((2.0 * u - 1.0) * b) as f32
                    }
                })
                .collect()
        };
        let inits = self.param_inits()?;
        let mut out = Vec::with_capacity(inits.len());
        for slot in &inits {
            let mut params = Vec::with_capacity(slot.len());
            for init in slot {
                let name = names
                    .next()
                    .ok_or_else(|| RuntimeError::Internal("fewer weight names than inits".into()))?;
                params.push(draw(init, name));
            }
            out.push(params);
        }
        Ok(out)
    }

    /// The weights as named tensors (for saving).
    pub fn weights(&self) -> Weights {
        let mut w = Weights::default();
        let flat = self.params.iter().flatten();
        for ((name, shape), data) in self.weight_names().into_iter().zip(flat) {
            w.insert(name, shape, data.clone());
        }
        w
    }

    /// Parameters of one layer and direction, in the cell's declaration order.
    pub fn params(&self, layer: usize, reverse: bool) -> &[Vec<f32>] {
        &self.params[layer * self.directions() + usize::from(reverse)]
    }

    /// The back end's prepared form of one layer and direction's parameters.
    pub(crate) fn prepared(&self, layer: usize, reverse: bool) -> &PreparedWeights {
        &self.prepared[layer * self.directions() + usize::from(reverse)]
    }

    /// Mutable parameters (for an optimiser step). The back end's packed
    /// copies are dropped, and made again from the new values on the next call.
    pub fn params_mut(&mut self) -> &mut [Vec<Vec<f32>>] {
        self.prepared.iter_mut().for_each(|p| *p = Default::default());
        &mut self.params
    }

    /// The model's own parameters as a pass over host memory reads them.
    pub(crate) fn own_host_weights(&self) -> Result<PassWeights<'_>> {
        self.ensure_owns_weights()?;
        let spans = self.params.iter().map(|ps| ps.iter().map(|p| Span::of(p)).collect()).collect();
        Ok(PassWeights::model(spans, &self.prepared))
    }
}
