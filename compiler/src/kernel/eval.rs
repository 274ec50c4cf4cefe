//! Runs a [`KernelPlan`] one row at a time with the interpreter's
//! semantics ([`Shapes::compute`] for every op): the reference back end's
//! and the CPU's interpreted kernels. It follows the plan, not the graph:
//! literals where the plan has them, slices and pads at the plan's offsets,
//! and a loop member that the plan keeps in registers is gone once its loop
//! ends, so a plan that drops a value something later reads fails here,
//! before any generated kernel runs.

use super::{Item, KernelError, KernelPlan, Literal, Operand};
use crate::ir::{Graph, ValueId};
use crate::shapes::Shapes;

/// Runs one plan over rows, reusing its buffers from row to row.
#[derive(Debug)]
pub struct RowEvaluator<'a> {
    plan: &'a KernelPlan,
    graph: &'a Graph,
    shapes: &'a Shapes,
    /// Each value's elements while it is held, by value index.
    held: Vec<Option<Vec<f32>>>,
}

impl<'a> RowEvaluator<'a> {
    /// An evaluator of `plan`, a kernel of `graph`, at `shapes`.
    pub fn new(plan: &'a KernelPlan, graph: &'a Graph, shapes: &'a Shapes) -> RowEvaluator<'a> {
        RowEvaluator { plan, graph, shapes, held: vec![None; graph.value_bound()] }
    }

    /// The outputs of one row (one vector per output slot) from its inputs
    /// (one slice per input slot, each of its value's length).
    pub fn row(&mut self, inputs: &[&[f32]]) -> Result<Vec<Vec<f32>>, KernelError> {
        let plan = self.plan;
        if inputs.len() != plan.input_count {
            return Err(KernelError(format!("{} inputs for {} slots", inputs.len(), plan.input_count)));
        }
        self.held.iter_mut().for_each(|h| *h = None);
        for &(v, literal) in &plan.literals {
            let value = match literal {
                Literal::Scalar(x) => vec![x],
                Literal::Splat(x) => vec![x; self.shapes.elements(v)],
            };
            self.held[v.index()] = Some(value);
        }
        for &(slot, v, _) in &plan.inputs {
            self.held[v.index()] = Some(inputs[slot].to_vec());
        }
        for item in &plan.items {
            self.item(item)?;
        }
        plan.outputs.iter().map(|o| self.get(o.value, o.value).map(<[f32]>::to_vec)).collect()
    }

    fn get(&self, reader: ValueId, v: ValueId) -> Result<&[f32], KernelError> {
        self.held
            .get(v.index())
            .and_then(|h| h.as_deref())
            .ok_or_else(|| KernelError(format!("{reader} reads {v}, which the kernel does not hold")))
    }

    /// `v` computed by the interpreter from `args`.
    fn compute(&self, v: ValueId, args: &[ValueId]) -> Result<Vec<f32>, KernelError> {
        let args: Vec<&[f32]> = args.iter().map(|&a| self.get(v, a)).collect::<Result<_, _>>()?;
        Ok(self.shapes.compute(self.graph, v, &args))
    }

    fn item(&mut self, item: &Item) -> Result<(), KernelError> {
        let (value, result) = match item {
            Item::Fused(l) => {
                let mut results: Vec<Vec<f32>> = Vec::with_capacity(l.members.len());
                for m in &l.members {
                    let args: Vec<&[f32]> = m
                        .operands
                        .iter()
                        .map(|a| match *a {
                            Operand::Outside(i) => self.get(m.value, l.outside[i]),
                            Operand::Member(j) => Ok(results[j].as_slice()),
                        })
                        .collect::<Result<_, _>>()?;
                    let r = self.shapes.compute(self.graph, m.value, &args);
                    results.push(r);
                }
                // Members the plan keeps in registers end with the loop.
                for (m, r) in l.members.iter().zip(results) {
                    if m.stored {
                        self.held[m.value.index()] = Some(r);
                    }
                }
                return Ok(());
            }
            Item::Scalar { value, args, .. } => (*value, self.compute(*value, args)?),
            Item::Reduce { value, src, .. } => (*value, self.compute(*value, &[*src])?),
            Item::Broadcast { value, src } => {
                let x = self.get(*value, *src)?.first().copied().unwrap_or(0.0);
                (*value, vec![x; self.shapes.elements(*value)])
            }
            Item::Slice { value, src, offset } => {
                let len = self.shapes.elements(*value);
                let s = self.get(*value, *src)?;
                let part = s.get(*offset..offset + len).ok_or_else(|| {
                    KernelError(format!(
                        "{value}: [{offset}, {}) of {src}'s {} elements",
                        offset + len,
                        s.len()
                    ))
                })?;
                (*value, part.to_vec())
            }
            Item::Pad { value, src, offset } => {
                let mut out = vec![0.0; self.shapes.elements(*value)];
                let s = self.get(*value, *src)?;
                let dst = out.get_mut(*offset..offset + s.len()).ok_or_else(|| {
                    KernelError(format!("{value}: {src}'s {} elements from {offset} do not fit", s.len()))
                })?;
                dst.copy_from_slice(s);
                (*value, out)
            }
            Item::Concat { value, parts } => {
                let mut out = Vec::with_capacity(self.shapes.elements(*value));
                for &p in parts {
                    out.extend_from_slice(self.get(*value, p)?);
                }
                (*value, out)
            }
        };
        self.held[value.index()] = Some(result);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{Program, Side, Steps};

    fn program(name: &str) -> (Steps, Program) {
        crate::program::shipped(name, |s| if s == "I" { 3 } else { 5 })
    }

    /// Every kernel of a LayerNorm-LSTM, run by its plan, equals the
    /// interpreter run over the stage's values.
    #[test]
    fn plans_compute_what_the_interpreter_does() {
        let (steps, p) = program("layernorm_lstm");
        for k in p.kernels() {
            let (graph, shapes, stage) = (steps.graph(k.side), p.shapes(k.side), k.stage(&p));
            let inputs: Vec<Vec<f32>> = stage
                .inputs
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    (0..shapes.elements(v)).map(|j| 0.5 + 0.1 * ((i * 7 + j) % 5) as f32).collect()
                })
                .collect();
            // Constants among the inputs hold their values, as the runtime passes them.
            let constants: std::collections::HashMap<_, _> =
                shapes.constant_values::<f32>(graph).into_iter().collect();
            let inputs: Vec<Vec<f32>> = stage
                .inputs
                .iter()
                .zip(inputs)
                .map(|(v, x)| constants.get(v).cloned().unwrap_or(x))
                .collect();
            let mut all: Vec<Option<Vec<f32>>> = vec![None; graph.value_bound()];
            for (v, x) in &constants {
                all[v.index()] = Some(x.clone());
            }
            for (&v, x) in stage.inputs.iter().zip(&inputs) {
                all[v.index()] = Some(x.clone());
            }
            for &v in &stage.values {
                let args: Vec<&[f32]> =
                    graph.operands(v).iter().map(|o| all[o.index()].as_deref().expect("computed")).collect();
                all[v.index()] = Some(shapes.compute(graph, v, &args));
            }
            let slices: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
            let got = RowEvaluator::new(&k.plan, graph, shapes).row(&slices).expect("runs");
            for (out, g) in stage.outputs.iter().zip(got) {
                assert_eq!(Some(g), all[out.index()].clone(), "{} output {out}", k.name);
            }
        }
    }

    /// A plan that reads a value its loop kept in registers fails by name.
    #[test]
    fn a_value_left_in_registers_cannot_be_read_later() {
        let (steps, p) = program("lstm");
        let k = p.kernels().find(|k| k.side == Side::Forward).expect("a forward kernel");
        let mut plan = k.plan.clone();
        let dropped = plan
            .items
            .iter()
            .find_map(|i| match i {
                Item::Fused(l) => l.members.iter().find(|m| !m.stored).map(|m| m.value),
                _ => None,
            })
            .expect("a member kept in registers");
        plan.items.push(Item::Broadcast { value: dropped, src: dropped });
        let shapes = p.shapes(Side::Forward);
        let inputs: Vec<Vec<f32>> =
            k.stage(&p).inputs.iter().map(|&v| vec![0.5; shapes.elements(v)]).collect();
        let slices: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
        let err =
            RowEvaluator::new(&plan, &steps.forward, shapes).row(&slices).expect_err("reads a register");
        assert!(err.to_string().contains(&format!("reads {dropped}")), "{err}");
    }
}
