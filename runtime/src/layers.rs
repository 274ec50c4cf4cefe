//! Planning a model's layers: the cell's program at each layer's sizes,
//! bound from explicit sizes, the data and the weights (a `[4*H, I]`
//! weight of shape `[20, 3]` binds `H = 5` and `I = 3`; a size bound two
//! ways is an error naming both sources). Layer `k > 0` reads the previous
//! layer's output (`O * directions` features). Nothing here knows of back
//! ends.

use crate::cell::{CompiledCell, Layer};
use crate::error::{Result, RuntimeError};
use crate::weights::Weights;
use cellc::dims::{Bindings, Dim};
use std::collections::BTreeMap;

/// Layers and directions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// Stacked layers (PyTorch's `num_layers`): layer `k > 0` reads layer `k - 1`'s output.
    pub layers: usize,
    /// Each layer runs both directions, the outputs side by side (PyTorch's `bidirectional`).
    pub bidirectional: bool,
}

impl Default for ModelConfig {
    fn default() -> ModelConfig {
        ModelConfig { layers: 1, bidirectional: false }
    }
}

/// Suffix of a weight name: `_l0`, `_l1_reverse`.
pub fn weight_suffix(layer: usize, reverse: bool) -> String {
    if reverse {
        format!("_l{layer}_reverse")
    } else {
        format!("_l{layer}")
    }
}

/// Binds `dim = value` for a dimension of the form `c*V + k`; records where
/// it came from (`from`, a description) and names `tensor` when it cannot.
fn infer(
    dim: &Dim,
    value: usize,
    tensor: &str,
    from: &str,
    sizes: &mut Bindings,
    sources: &mut BTreeMap<String, String>,
) -> Result<()> {
    let vars = dim.variables();
    let unbound: Vec<&String> = vars.iter().filter(|v| !sizes.contains_key(*v)).collect();
    if unbound.len() == 1 {
        let var = unbound[0].clone();
        // Solve c*V + k = value with the other variables bound.
        let mut probe = sizes.clone();
        probe.insert(var.clone(), 0);
        let k = dim.eval(&probe).map_err(|_| RuntimeError::UnboundSize { size: var.clone() })?;
        probe.insert(var.clone(), 1);
        let c = dim.eval(&probe).map_err(|_| RuntimeError::UnboundSize { size: var.clone() })? - k;
        let rest = value as i64 - k;
        if c > 0 && rest > 0 && rest % c == 0 {
            sizes.insert(var.clone(), (rest / c) as usize);
            sources.insert(var, from.to_string());
            return Ok(());
        }
        return Err(RuntimeError::Shape {
            tensor: tensor.to_string(),
            expected: format!("a size of the form [{dim}]"),
            found: format!("{value}"),
        });
    }
    if unbound.is_empty() {
        let want = dim.eval(sizes).map_err(|_| RuntimeError::Internal(format!("cannot evaluate {dim}")))?;
        if want != value as i64 {
            // Name the variable in conflict when the dimension is a single one.
            if vars.len() == 1 && *dim == Dim::var(&vars[0]) {
                let v = &vars[0];
                return Err(RuntimeError::SizeConflict {
                    size: v.clone(),
                    first: sizes[v],
                    first_from: sources.get(v).cloned().unwrap_or_else(|| "-D".into()),
                    second: value,
                    second_from: from.to_string(),
                });
            }
            return Err(RuntimeError::Shape {
                tensor: tensor.to_string(),
                expected: format!("[{dim}] = {want}"),
                found: format!("{value}"),
            });
        }
    }
    Ok(())
}

/// Each layer's sizes, plans and schedule, as [`crate::Model::new`] makes them
/// (`sizes` explicit, then bound from `input_size` and `weights`), without
/// parameters or a back end: what an ahead-of-time compiler needs.
pub fn build(
    compiled: &CompiledCell,
    config: &ModelConfig,
    sizes: &Bindings,
    input_size: Option<usize>,
    weights: Option<&Weights>,
) -> Result<Vec<Layer>> {
    if config.layers == 0 {
        return Err(RuntimeError::Layer { layer: 0, message: "a model needs at least one layer".into() });
    }
    let cell = &compiled.forward;
    let directions = if config.bidirectional { 2 } else { 1 };
    let input_dim = cell.input_dim();
    let input_vars = input_dim.variables();

    // Layer 0 sizes: explicit, then the data, then the layer-0 weights.
    let mut base: Bindings =
        sizes.iter().filter(|(k, _)| cell.sizes.contains(k)).map(|(k, v)| (k.clone(), *v)).collect();
    let mut sources: BTreeMap<String, String> = base.keys().map(|k| (k.clone(), format!("-D {k}"))).collect();
    if let Some(n) = input_size {
        infer(&input_dim, n, "input", "the input's features", &mut base, &mut sources)?;
    }
    if let Some(w) = weights {
        for p in &cell.params {
            let name = format!("{}{}", p.name, weight_suffix(0, false));
            let Some(t) = w.get(&name) else { continue };
            let dims = p.shape();
            if t.shape.len() != dims.len() {
                return Err(RuntimeError::Shape {
                    tensor: name,
                    expected: format!("{} dimensions ({})", dims.len(), p.ty),
                    found: crate::error::shape_text(&t.shape),
                });
            }
            // Matrices' row counts first: `[4*H, I]` binds H before I.
            for (d, &n) in dims.iter().zip(&t.shape) {
                infer(d, n, &name, &format!("weight `{name}`"), &mut base, &mut sources)?;
            }
        }
    }
    for s in &cell.sizes {
        if !base.contains_key(s) {
            return Err(RuntimeError::UnboundSize { size: s.clone() });
        }
    }

    let mut layers = Vec::with_capacity(config.layers);
    for k in 0..config.layers {
        let mut sizes = base.clone();
        if k > 0 {
            let prev: &Layer = &layers[k - 1];
            let features = prev.output_size * directions;
            // Rebind the input's own size variables; any shared with states must agree.
            let mut srcs = sources.clone();
            for v in &input_vars {
                let shared = cell.states.iter().any(|s| s.dim.variables().contains(v))
                    || cell.output_dim().variables().contains(v);
                if !shared {
                    sizes.remove(v);
                    srcs.remove(v);
                }
            }
            infer(
                &input_dim,
                features,
                "input",
                &format!("layer {}'s output ({} features)", k - 1, features),
                &mut sizes,
                &mut srcs,
            )
            .map_err(|e| RuntimeError::Layer { layer: k, message: e.to_string() })?;
        }
        layers.push(Layer::new(compiled, k, &sizes)?);
    }
    Ok(layers)
}
