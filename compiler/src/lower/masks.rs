//! Lowering `rate` declarations and the mask functions (`dropout`,
//! `variational_dropout`, `zoneout`, `dropconnect`): each call becomes a
//! mask of the cell ([`ir::MaskDecl`]) and, but for `dropconnect`, a mask
//! leaf and the arithmetic on it that [`ir::masks`] defines.

use super::{describe, BindingKind, CellLowerer};
use crate::diag::{Diagnostic, Span};
use crate::ir::{self, BinaryOp, MaskFn, Op, Type, ValueId};
use crate::syntax::ast::{self, Expr, ExprKind};

impl CellLowerer<'_> {
    /// `rate NAME = default`: names bound (as rates, which are not values)
    /// and defaults checked.
    pub(super) fn rate_declarations(&mut self, def: &ast::CellDef) {
        for r in &def.rates {
            let (default, at) = r.default;
            if !(0.0..1.0).contains(&default) {
                self.error(
                    Diagnostic::error(at, format!("the default of rate `{}` must be in [0, 1)", r.name.name))
                        .with_label(format!("{default} is not a probability below 1"))
                        .with_note("a rate is the probability that a unit is dropped (or zoned out)"),
                );
            }
            self.cell.rates.push(ir::RateDecl {
                name: r.name.name.clone(),
                default: default.clamp(0.0, 0.999),
                span: r.span,
            });
            self.bind(&r.name, BindingKind::Rate, None);
        }
    }

    /// Warns about rates no mask function reads.
    pub(super) fn warn_unused_rates(&mut self) {
        for r in &self.cell.rates {
            let used = self.frames[0].names.get(&r.name).is_none_or(|b| b.used);
            if !used && !r.name.starts_with('_') {
                self.diags.push(
                    Diagnostic::warning(r.span, format!("unused rate `{}`", r.name)).with_note(
                        "no `dropout`, `variational_dropout`, `zoneout` or `dropconnect` reads it",
                    ),
                );
            }
        }
    }

    /// A call of a mask function.
    pub(super) fn mask_call(
        &mut self,
        f: MaskFn,
        callee: &ast::Ident,
        args: &[Expr],
        span: Span,
    ) -> Option<ValueId> {
        if self.in_function() {
            self.error(
                Diagnostic::error(callee.span, format!("`{}` can only be called in a cell's body", f.name()))
                    .with_note(
                        "its rate is declared by the cell, and a function sees only its own parameters",
                    ),
            );
            // The values, for their own errors; the rate is the cell's, unknown here.
            self.check_args(&args[..args.len().saturating_sub(1)]);
            return None;
        }
        let (operands, rate_arg) = match f {
            MaskFn::Zoneout => {
                let [old, new, p] = self.args::<3>(callee, args, span)?;
                (vec![old, new], p)
            }
            _ => {
                let [v, p] = self.args::<2>(callee, args, span)?;
                (vec![v], p)
            }
        };
        let rate = self.rate_arg(f, rate_arg);
        if f == MaskFn::DropConnect {
            return self.dropconnect(operands[0], rate?, span);
        }
        let values: Vec<Option<ValueId>> = operands.iter().map(|e| self.expr(e)).collect();
        let values: Vec<ValueId> = values.into_iter().collect::<Option<_>>()?;
        let rate = rate?;
        let ty = self.masked_type(f, &values, &operands)?;
        let mask = self.new_mask(f, rate, None, ty.clone(), span)?;
        let m = self.add(Op::Mask(mask), ty.clone(), &[], span)?;
        match values[..] {
            [v] => self.add(Op::Binary(BinaryOp::Mul), ty, &[v, m], span),
            [old, new] => {
                // m * new + (1 - m) * old: exactly `new` or `old` in training.
                let one = self.constant(1.0, span)?;
                let ones = self.add(Op::Broadcast, ty.clone(), &[one], span)?;
                let rest = self.add(Op::Binary(BinaryOp::Sub), ty.clone(), &[ones, m], span)?;
                let a = self.add(Op::Binary(BinaryOp::Mul), ty.clone(), &[m, new], span)?;
                let b = self.add(Op::Binary(BinaryOp::Mul), ty.clone(), &[rest, old], span)?;
                self.add(Op::Binary(BinaryOp::Add), ty, &[a, b], span)
            }
            _ => None,
        }
    }

    /// The rate argument: a `rate` the cell declares.
    fn rate_arg(&mut self, f: MaskFn, e: &Expr) -> Option<usize> {
        if let ExprKind::Name(id) = &e.kind {
            if let Some(i) = self.cell.rate_index(&id.name) {
                if let Some(b) = self.frames[0].names.get_mut(&id.name) {
                    b.used = true;
                }
                return Some(i);
            }
        }
        let mut d =
            Diagnostic::error(e.span, format!("the rate of `{}` must be a `rate` of the cell", f.name()))
                .with_label("not a declared rate");
        d = match &e.kind {
            ExprKind::Number(v) => d.with_note(format!(
                "declare it, as `rate p = {v}`, and write `{}(..., p)`: a caller can then change it per model or per call",
                f.name()
            )),
            _ => d.with_note("declare one, as `rate p = 0.1`; a rate is a probability a caller can change"),
        };
        self.error(d);
        if !matches!(e.kind, ExprKind::Name(_) | ExprKind::Number(_)) {
            self.expr(e);
        }
        None
    }

    /// The type of the mask a vector function draws: its operands' vector.
    fn masked_type(&mut self, f: MaskFn, values: &[ValueId], operands: &[&Expr]) -> Option<Type> {
        let types: Vec<Type> = values.iter().map(|&v| self.cell.ty(v).clone()).collect();
        for (t, e) in types.iter().zip(operands) {
            if !matches!(t, Type::Vector(_)) {
                let note = match t {
                    Type::Matrix(..) => "to mask a parameter matrix, use `dropconnect(W, p)`",
                    _ => "a mask has one unit per element of a vector",
                };
                self.error(
                    Diagnostic::error(e.span, format!("`{}` masks a vector", f.name()))
                        .with_label(format!("this is {}", describe(t)))
                        .with_note(note),
                );
                return None;
            }
        }
        if let [old, new] = &types[..] {
            if old != new {
                self.error(
                    Diagnostic::error(
                        operands[1].span,
                        format!("`zoneout` chooses between values of one size: {old} and {new}"),
                    )
                    .with_label(format!("this is {new}"))
                    .with_secondary(operands[0].span, format!("this is {old}"))
                    .with_note("write `zoneout(old, new, p)`, as `zoneout(h, h_new, p)`"),
                );
                return None;
            }
        }
        Some(types[0].clone())
    }

    /// `dropconnect(W, p)`: `W` must name a matrix parameter; the result
    /// is the parameter itself, which the runtime masks for the call.
    fn dropconnect(&mut self, w: &Expr, rate: usize, span: Span) -> Option<ValueId> {
        let param = match &w.kind {
            ExprKind::Name(id) => self.frames[0].names.get_mut(&id.name).and_then(|b| {
                (b.kind == BindingKind::Param).then(|| {
                    b.used = true;
                    b.value
                })
            }),
            _ => None,
        };
        let Some(value) = param else {
            self.error(
                Diagnostic::error(w.span, "`dropconnect` masks a matrix parameter")
                    .with_label("not a parameter's name")
                    .with_note("write `dropconnect(weight_hh, p) @ h`: the parameter itself is masked, once per call"),
            );
            return None;
        };
        let value = value?;
        let ty = self.cell.ty(value).clone();
        let Op::Param(index) = self.cell.node(value).op else { return None };
        if !matches!(ty, Type::Matrix(..)) {
            self.error(
                Diagnostic::error(w.span, "`dropconnect` masks a matrix parameter")
                    .with_label(format!("this is {}", describe(&ty)))
                    .with_note("to mask a vector, use `dropout` or `variational_dropout`"),
            );
            return None;
        }
        match self.cell.masks.iter().find(|m| m.param == Some(index)) {
            Some(m) if m.rate == rate => {}
            Some(m) => {
                let first = m.span;
                self.error(
                    Diagnostic::error(
                        span,
                        format!("`{}` is masked by `dropconnect` at two rates", self.cell.params[index].name),
                    )
                    .with_secondary(first, "first masked here")
                    .with_note("a parameter has one DropConnect mask per call: use one rate"),
                );
                return None;
            }
            None => {
                self.new_mask(MaskFn::DropConnect, rate, Some(index), ty, span)?;
            }
        }
        Some(value)
    }

    fn new_mask(
        &mut self,
        function: MaskFn,
        rate: usize,
        param: Option<usize>,
        ty: Type,
        span: Span,
    ) -> Option<usize> {
        if self.cell.masks.len() >= ir::masks::MAX_MASKS {
            self.error(Diagnostic::error(
                span,
                format!("a cell may call mask functions at most {} times", ir::masks::MAX_MASKS),
            ));
            return None;
        }
        self.cell.masks.push(ir::MaskDecl { function, rate, param, ty, span });
        Some(self.cell.masks.len() - 1)
    }

    /// A parameter masked by `dropconnect` must be read only through it:
    /// the runtime replaces the parameter itself for the call.
    pub(super) fn check_dropconnect_reads(&mut self) {
        for m in self.cell.masks.clone() {
            let Some(p) = m.param else { continue };
            if let Some(&(_, raw)) = self.plain_param_reads.iter().find(|(q, _)| *q == p) {
                let name = self.cell.params[p].name.clone();
                self.error(
                    Diagnostic::error(raw, format!("`{name}` is read without its `dropconnect` mask"))
                        .with_label("read unmasked here")
                        .with_secondary(m.span, "masked here")
                        .with_note("DropConnect masks the parameter for the whole call: read it through `dropconnect` everywhere"),
                );
            }
        }
    }
}
