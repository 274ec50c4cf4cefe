//! One pointwise stage over many rows, through a table of row pointers.
//!
//! The ABI every pointwise kernel shares: for each row, one pointer per
//! stage input (in the stage's input order) and one per output. A row's
//! pointers may point anywhere — into the caller's padded or packed buffer,
//! a rank-ordered state buffer, a saved-value buffer — which is how the
//! CPU back end gathers and scatters without copying.
//!
//! [`Interpreted`] runs a stage with the interpreter's op semantics; the
//! JIT-compiled kernels implement the same trait and are tested against it.

use crate::error::{Result, RuntimeError};
use cellc::ir::{Graph, ValueId};
use cellc::shapes::Shapes;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

/// A pointwise stage that runs over rows through a pointer table, each
/// row's inputs' pointers then its outputs'.
pub trait StageExec: Send + Sync {
    /// The values each row's table reads, in table order.
    fn inputs(&self) -> &[ValueId];
    /// The values each row's table writes, after the inputs.
    fn outputs(&self) -> &[ValueId];

    /// Runs `rows` rows.
    ///
    /// # Safety
    /// `args` holds `rows * (inputs + outputs)` pointers, each valid for its
    /// value's length at the stage's sizes; outputs do not alias inputs or
    /// each other.
    unsafe fn run(&self, rows: usize, args: &[*mut f32]);
}

/// Kernels built on first use, one per key (a tile's width; a stage and a
/// width), and kept for the calls after.
pub(crate) struct BuiltKernels<K>(Mutex<HashMap<K, Arc<dyn StageExec>>>);

impl<K> Default for BuiltKernels<K> {
    fn default() -> Self {
        BuiltKernels(Mutex::new(HashMap::new()))
    }
}

impl<K: Eq + Hash> BuiltKernels<K> {
    /// The kernel of `key`, built by `build` the first time.
    pub(crate) fn get_or_build(
        &self,
        key: K,
        build: impl FnOnce() -> Result<Arc<dyn StageExec>>,
    ) -> Result<Arc<dyn StageExec>> {
        let mut held = self.0.lock().map_err(|_| RuntimeError::Internal("built kernels poisoned".into()))?;
        if let Some(k) = held.get(&key) {
            return Ok(k.clone());
        }
        let k = build()?;
        held.insert(key, k.clone());
        Ok(k)
    }
}

/// A stage run by [`Shapes::compute`], value by value.
pub struct Interpreted {
    graph: Arc<Graph>,
    shapes: Arc<Shapes>,
    values: Vec<ValueId>,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
    /// Values computed from constants only, with their values.
    constants: Vec<(ValueId, Vec<f32>)>,
}

impl Interpreted {
    /// The stage that computes `values` of `graph` in order, at `plan`'s
    /// sizes, reading `inputs` and writing `outputs` through the table.
    pub fn new(
        graph: Arc<Graph>,
        shapes: Arc<Shapes>,
        values: &[ValueId],
        inputs: &[ValueId],
        outputs: &[ValueId],
    ) -> Interpreted {
        let constants = shapes.constant_values(&graph);
        Interpreted {
            graph,
            shapes,
            values: values.to_vec(),
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
            constants,
        }
    }
}

impl std::fmt::Debug for Interpreted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interpreted").field("values", &self.values).finish()
    }
}

impl StageExec for Interpreted {
    fn inputs(&self) -> &[ValueId] {
        &self.inputs
    }

    fn outputs(&self) -> &[ValueId] {
        &self.outputs
    }

    unsafe fn run(&self, rows: usize, args: &[*mut f32]) {
        let k = self.inputs.len() + self.outputs.len();
        let mut store: Vec<Option<Vec<f32>>> = vec![None; self.graph.value_bound()];
        for row in 0..rows {
            let ptrs = &args[row * k..(row + 1) * k];
            for (v, c) in &self.constants {
                store[v.index()] = Some(c.clone());
            }
            for (i, &v) in self.inputs.iter().enumerate() {
                if self.constants.iter().any(|(c, _)| *c == v) {
                    continue; // a literal, as in compiled kernels
                }
                let n = self.shapes.elements(v);
                // SAFETY: the caller guarantees n valid floats behind each input pointer.
                store[v.index()] = Some(unsafe { std::slice::from_raw_parts(ptrs[i], n) }.to_vec());
            }
            for &v in &self.values {
                let operands = self.graph.operands(v);
                let out = {
                    let a: Vec<&[f32]> =
                        operands.iter().map(|o| store[o.index()].as_deref().unwrap_or(&[])).collect();
                    self.shapes.compute(&self.graph, v, &a)
                };
                store[v.index()] = Some(out);
            }
            for (i, &v) in self.outputs.iter().enumerate() {
                let n = self.shapes.elements(v);
                let src = store[v.index()].as_deref().unwrap_or(&[]);
                // SAFETY: n writable floats behind each output pointer, not aliasing inputs.
                let dst = unsafe { std::slice::from_raw_parts_mut(ptrs[self.inputs.len() + i], n) };
                dst.copy_from_slice(&src[..n.min(src.len())]);
            }
        }
    }
}
