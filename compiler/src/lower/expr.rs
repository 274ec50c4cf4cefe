//! Lowering expressions and `let`s: names, operators with broadcasting,
//! `@`, built-in calls, `chunk`/`concat`, and `fn` inlining.

use super::names::did_you_mean;
use super::{describe, dim_of, BindingKind, Call, CellLowerer, Frame, MAX_CALL_DEPTH};
use crate::diag::{Diagnostic, Span};
use crate::dims::Dim;
use crate::ir::{BinaryOp, MaskFn, Op, ReduceOp, Type, UnaryOp, ValueId};
use crate::syntax::ast::{self, BinOp, Expr, ExprKind};

/// The most blocks `transpose` reorders (each is a slice of the graph).
const MAX_TRANSPOSE_BLOCKS: i64 = 256;

impl CellLowerer<'_> {
    pub(super) fn let_binding(&mut self, l: &ast::Let) {
        if let ExprKind::Call { callee, args } = &l.value.kind {
            if callee.name == "chunk" {
                return self.chunk(l, args, l.value.span);
            }
        }
        let v = self.expr(&l.value);
        if l.names.len() > 1 {
            // A value that did not parse may have been a `chunk`.
            if !matches!(l.value.kind, ExprKind::Error) {
                self.error(
                    Diagnostic::error(
                        l.value.span,
                        format!("{} names are bound to a single value", l.names.len()),
                    )
                    .with_note("only `chunk(v, n)` binds several names at once: `let a, b = chunk(v, 2)`"),
                );
            }
            for n in &l.names {
                self.bind(n, BindingKind::Let, None);
            }
            return;
        }
        self.bind(&l.names[0], BindingKind::Let, v);
    }

    /// `let a, b, c = chunk(v, 3)`
    fn chunk(&mut self, l: &ast::Let, args: &[Expr], span: Span) {
        let pieces = self.chunk_pieces(l, args, span);
        for (i, n) in l.names.iter().enumerate() {
            let v = pieces.as_ref().and_then(|p| p.get(i).copied());
            self.bind(n, BindingKind::Let, v);
        }
    }

    fn chunk_pieces(&mut self, l: &ast::Let, args: &[Expr], span: Span) -> Option<Vec<ValueId>> {
        let [v, n] = args else {
            self.error(
                Diagnostic::error(span, format!("`chunk` takes 2 arguments, found {}", args.len()))
                    .with_note("write `chunk(v, n)`: split v into n equal parts"),
            );
            self.check_args(args);
            return None;
        };
        let count = self.integer_arg(n, "the number of pieces")?;
        let value = self.expr(v)?;
        if count as usize != l.names.len() {
            self.error(
                Diagnostic::error(
                    span,
                    format!("`chunk` into {count} pieces is bound to {} names", l.names.len()),
                )
                .with_label(format!("makes {count} pieces"))
                .with_note("bind exactly one name per piece"),
            );
            return None;
        }
        let (_, piece) = self.equal_blocks(
            value,
            v.span,
            count,
            "`chunk` splits a vector",
            &format!("{count} equal parts"),
        )?;
        let mut out = Vec::with_capacity(count as usize);
        for i in 0..count {
            let offset = piece.checked_scale(i)?;
            let name_span = l.names[i as usize].span;
            out.push(self.add(Op::Slice { offset }, Type::Vector(piece.clone()), &[value], name_span)?);
        }
        Some(out)
    }

    /// The size of vector `value` (written at `at`) and of each of its
    /// `count` equal blocks, for every value of the size variables; else an
    /// error: `not_vector` if it is not a vector, or that it cannot be split
    /// `into` the blocks asked for.
    fn equal_blocks(
        &mut self,
        value: ValueId,
        at: Span,
        count: i64,
        not_vector: &str,
        into: &str,
    ) -> Option<(Dim, Dim)> {
        let ty = self.cell.ty(value).clone();
        let Type::Vector(d) = ty else {
            self.error(Diagnostic::error(at, not_vector).with_label(format!("this is {}", describe(&ty))));
            return None;
        };
        let Some(piece) = d.exact_div(count) else {
            self.error(
                Diagnostic::error(at, format!("cannot split [{d}] into {into}"))
                    .with_label(format!("[{d}] is not divisible by {count}"))
                    .with_note(
                        "the size must be divisible for every value of its size variables, as `4*H` is by 4",
                    ),
            );
            return None;
        };
        Some((d, piece))
    }

    /// A positive whole number: a literal or an integral `const`.
    fn integer_arg(&mut self, e: &Expr, what: &str) -> Option<i64> {
        let v = match &e.kind {
            ExprKind::Number(v) => Some(*v),
            ExprKind::Name(id) => self.globals.consts.get(id.name.as_str()).map(|c| {
                self.globals.mark_used(&id.name);
                c.value
            }),
            _ => None,
        };
        match v {
            Some(v) if v >= 1.0 && v.fract() == 0.0 && v <= 1e9 => Some(v as i64),
            _ => {
                let mut d = Diagnostic::error(e.span, format!("{what} must be a positive whole number"))
                    .with_label("expected a literal such as `4`, or a `const`");
                if let ExprKind::Name(id) = &e.kind {
                    if self.sizes.contains_key(&id.name) {
                        d = d.with_note(format!(
                            "`{}` is a size variable, bound only when the cell is instantiated; \
                             declare a count the cell needs as a `const` (`const HEADS = 4`), \
                             which sizes may use too (`R[HEADS, D, D]`)",
                            id.name
                        ));
                    }
                }
                self.error(d);
                None
            }
        }
    }

    pub(super) fn expr(&mut self, e: &Expr) -> Option<ValueId> {
        crate::deep::deep(|| self.expr_here(e))
    }

    fn expr_here(&mut self, e: &Expr) -> Option<ValueId> {
        if self.too_large {
            return None;
        }
        match &e.kind {
            ExprKind::Number(v) => self.constant(*v, e.span),
            ExprKind::Name(id) => self.name(id),
            ExprKind::Primed(id) => self.primed(id, e.span),
            ExprKind::Paren(inner) => self.expr(inner),
            ExprKind::Neg(inner) => {
                let v = self.expr(inner)?;
                self.unary(UnaryOp::Neg, v, inner.span, e.span)
            }
            ExprKind::Binary { op: BinOp::MatMul, lhs, rhs } => {
                let (a, b) = (self.expr(lhs), self.expr(rhs));
                self.matvec(a?, b?, lhs.span, rhs.span, e.span)
            }
            ExprKind::Binary { op, lhs, rhs } if op.is_comparison() => {
                let (a, b) = (self.expr(lhs), self.expr(rhs));
                self.comparison(*op, (a?, lhs.span), (b?, rhs.span), e.span)
            }
            ExprKind::Binary { op, lhs, rhs } => {
                let op = match op {
                    BinOp::Add => BinaryOp::Add,
                    BinOp::Sub => BinaryOp::Sub,
                    BinOp::Mul => BinaryOp::Mul,
                    _ => BinaryOp::Div,
                };
                let (a, b) = (self.expr(lhs), self.expr(rhs));
                self.binary(op, a?, b?, (lhs.span, rhs.span), e.span)
            }
            ExprKind::Call { callee, args } => self.call(callee, args, e.span),
            ExprKind::Error => None,
        }
    }

    fn name(&mut self, id: &ast::Ident) -> Option<ValueId> {
        let frame = self.frames.len() - 1;
        if let Some(b) = self.frames[frame].names.get_mut(&id.name) {
            b.used = true;
            let (kind, value) = (b.kind, b.value);
            if kind == BindingKind::Rate {
                self.error(
                    Diagnostic::error(id.span, format!("`{}` is a rate, not a value", id.name))
                        .with_label("a rate is only a mask function's last argument")
                        .with_note(format!(
                            "write `dropout(v, {0})`, `zoneout(old, new, {0})` and the like",
                            id.name
                        )),
                );
                return None;
            }
            if let Some(Op::Param(i)) = value.map(|v| &self.cell.node(v).op) {
                self.plain_param_reads.push((*i, id.span));
            }
            return value;
        }
        if let Some(c) = self.globals.consts.get(id.name.as_str()) {
            self.globals.mark_used(&id.name);
            return self.constant(c.value, id.span);
        }
        let mut d =
            Diagnostic::error(id.span, format!("unknown name `{}`", id.name)).with_label("not defined");
        if let Some(b) = self.frames[0].names.get_mut(&id.name).filter(|_| frame > 0) {
            // Meant as the cell's own: not also "unused".
            b.used = true;
            d = d.with_note(format!(
                "`{}` belongs to the cell; a function sees only its parameters, its own `let`s and `const`s: pass it as an argument",
                id.name
            ));
        } else if self.sizes.contains_key(&id.name) {
            d = Diagnostic::error(id.span, format!("`{}` is a size variable, not a value", id.name))
                .with_label("sizes only appear in declarations")
                .with_note("to average over a vector use `mean(v)` rather than `sum(v) / H`");
        } else if self.globals.cells.contains(&id.name.as_str()) {
            d = d.with_note(format!("`{}` is a cell, not a value", id.name));
        } else if self.globals.fns.contains_key(id.name.as_str()) || super::is_builtin(&id.name) {
            d = d.with_note(format!("`{0}` is a function: call it as `{0}(...)`", id.name));
        } else if let Some(s) = did_you_mean(&id.name, self.frames[frame].names.keys().map(String::as_str)) {
            // The name meant is used, just misspelt: not also "unused".
            if let Some(b) = self.frames[frame].names.get_mut(&s) {
                b.used = true;
            }
            d = d.with_note(format!("did you mean `{s}`?"));
        }
        self.error(d);
        None
    }

    /// `NAME'`; `span` covers the prime too.
    fn primed(&mut self, id: &ast::Ident, span: Span) -> Option<ValueId> {
        if self.in_function() {
            self.error(
                Diagnostic::error(span, format!("`{}'` cannot be read inside a function", id.name))
                    .with_note("pass the value as an argument instead"),
            );
            return None;
        }
        // A state's `NAME'` does not read its value at the start of the step;
        // any other name is meant to be read: not also "unused".
        let kind = self.frames[0].names.get_mut(&id.name).map(|b| {
            b.used |= b.kind != BindingKind::State;
            b.kind
        });
        if self.cell.state_index(&id.name).is_none() {
            if kind == Some(BindingKind::State) {
                return None; // a state whose declaration failed: already reported
            }
            let what = match kind {
                Some(k) => format!("`{}` is {}", id.name, k.a_word()),
                None => format!("`{}` is not declared", id.name),
            };
            let mut d =
                Diagnostic::error(span, format!("`{}'`: only states have a primed value; {what}", id.name))
                    .with_label("not a state");
            if kind.is_some() {
                d = d.with_note(format!("write `{}` for its value", id.name));
            }
            self.error(d);
            return None;
        }
        match self.next.get(&id.name) {
            Some((v, _)) => *v,
            // Never assigned at all: reported once, as such, with this read
            // (or, after a syntax error, perhaps in the part that did not parse).
            None if !self.assigned_at.contains_key(&id.name) => {
                self.unassigned_reads.entry(id.name.clone()).or_insert(span);
                None
            }
            None => {
                let mut d = Diagnostic::error(span, format!("`{}'` is read before it is assigned", id.name))
                    .with_label("read here");
                if let Some(at) = self.assigned_at.get(&id.name) {
                    d = d.with_secondary(*at, "assigned later, here");
                }
                self.error(d.with_note(format!(
                    "`{0}` is the value at the start of the step; `{0}'` exists only once assigned",
                    id.name
                )));
                None
            }
        }
    }

    fn unary(&mut self, op: UnaryOp, v: ValueId, arg_span: Span, span: Span) -> Option<ValueId> {
        let ty = self.cell.ty(v).clone();
        if let Type::Matrix(..) = ty {
            return self.matrix_misuse(v, arg_span);
        }
        self.add(Op::Unary(op), ty, &[v], span)
    }

    fn matrix_misuse(&mut self, v: ValueId, span: Span) -> Option<ValueId> {
        let ty = self.cell.ty(v).clone();
        self.error(
            Diagnostic::error(span, "a matrix can only be an operand of `@`")
                .with_label(format!("this is {}", describe(&ty)))
                .with_note("multiply it by a vector first: `W @ x` (or `x @ W` for `Wᵀ x`)"),
        );
        None
    }

    /// Elementwise binary op; a scalar operand is broadcast to the other's size.
    pub(super) fn binary(
        &mut self,
        op: BinaryOp,
        a: ValueId,
        b: ValueId,
        (sa, sb): (Span, Span),
        span: Span,
    ) -> Option<ValueId> {
        let (ta, tb) = (self.cell.ty(a).clone(), self.cell.ty(b).clone());
        match (&ta, &tb) {
            (Type::Matrix(..), _) => self.matrix_misuse(a, sa),
            (_, Type::Matrix(..)) => self.matrix_misuse(b, sb),
            (Type::Scalar, Type::Scalar) => self.add(Op::Binary(op), Type::Scalar, &[a, b], span),
            (Type::Vector(d), Type::Scalar) => {
                let b = self.add(Op::Broadcast, Type::Vector(d.clone()), &[b], sb)?;
                self.add(Op::Binary(op), ta, &[a, b], span)
            }
            (Type::Scalar, Type::Vector(d)) => {
                let a = self.add(Op::Broadcast, Type::Vector(d.clone()), &[a], sa)?;
                self.add(Op::Binary(op), tb, &[a, b], span)
            }
            (Type::Vector(x), Type::Vector(y)) if x == y => self.add(Op::Binary(op), ta, &[a, b], span),
            (Type::Vector(x), Type::Vector(y)) => {
                let verb = match op {
                    BinaryOp::Add => "add",
                    BinaryOp::Sub => "subtract",
                    BinaryOp::Mul => "multiply",
                    BinaryOp::Div => "divide",
                    BinaryOp::Min => "take the minimum of",
                    BinaryOp::Max => "take the maximum of",
                    BinaryOp::Ge | BinaryOp::Gt => "compare",
                };
                self.error(
                    Diagnostic::error(
                        sb,
                        format!("cannot {verb} vectors of different sizes [{x}] and [{y}]"),
                    )
                    .with_label(format!("this is [{y}]"))
                    .with_secondary(sa, format!("this is [{x}]"))
                    .with_note("elementwise operands must have equal sizes (or one must be a scalar)"),
                );
                None
            }
        }
    }

    /// `a op b` for a comparison `op`: 1 where it holds, 0 where not, NaN
    /// where either operand is NaN. `<` and `<=` are `gt` and `ge` with
    /// the operands swapped; `==` is `ge` both ways, `!=` one minus that.
    fn comparison(
        &mut self,
        op: BinOp,
        (a, sa): (ValueId, Span),
        (b, sb): (ValueId, Span),
        span: Span,
    ) -> Option<ValueId> {
        let compare = |this: &mut Self, op, (x, sx): (ValueId, Span), (y, sy): (ValueId, Span)| {
            this.binary(op, x, y, (sx, sy), span)
        };
        match op {
            BinOp::Gt => compare(self, BinaryOp::Gt, (a, sa), (b, sb)),
            BinOp::Lt => compare(self, BinaryOp::Gt, (b, sb), (a, sa)),
            BinOp::Ge => compare(self, BinaryOp::Ge, (a, sa), (b, sb)),
            BinOp::Le => compare(self, BinaryOp::Ge, (b, sb), (a, sa)),
            _ => {
                let ge = compare(self, BinaryOp::Ge, (a, sa), (b, sb))?;
                let le = compare(self, BinaryOp::Ge, (b, sb), (a, sa))?;
                let equal = self.binary(BinaryOp::Mul, ge, le, (span, span), span)?;
                if op == BinOp::Eq {
                    return Some(equal);
                }
                let one = self.constant(1.0, span)?;
                self.binary(BinaryOp::Sub, one, equal, (span, span), span)
            }
        }
    }

    /// `where(cond, a, b)`: `a` where `cond` is nonzero, `b` where it is
    /// zero (NaN where it is NaN); scalars are broadcast to the vectors'
    /// size, which must agree.
    fn select(&mut self, callee: &ast::Ident, args: &[Expr], span: Span) -> Option<ValueId> {
        let [c, a, b] = self.args::<3>(callee, args, span)?;
        let operands = [self.expr(c), self.expr(a), self.expr(b)];
        let [vc, va, vb] = operands;
        let operands = [(vc?, c.span), (va?, a.span), (vb?, b.span)];
        let mut vector: Option<(Dim, Span)> = None;
        for &(v, s) in &operands {
            match self.cell.ty(v).clone() {
                Type::Matrix(..) => return self.matrix_misuse(v, s),
                Type::Vector(d) => match &vector {
                    Some((seen, at)) if *seen != d => {
                        self.error(
                            Diagnostic::error(
                                s,
                                format!("`where` of vectors of different sizes [{seen}] and [{d}]"),
                            )
                            .with_label(format!("this is [{d}]"))
                            .with_secondary(*at, format!("this is [{seen}]"))
                            .with_note("the condition and both values must have equal sizes (or be scalars)"),
                        );
                        return None;
                    }
                    Some(_) => {}
                    None => vector = Some((d, s)),
                },
                Type::Scalar => {}
            }
        }
        let ty = vector.map_or(Type::Scalar, |(d, _)| Type::Vector(d));
        let mut values = Vec::with_capacity(3);
        for (v, s) in operands {
            let scalar_in_vector = *self.cell.ty(v) == Type::Scalar && ty != Type::Scalar;
            values.push(if scalar_in_vector { self.add(Op::Broadcast, ty.clone(), &[v], s)? } else { v });
        }
        self.add(Op::Select, ty, &values, span)
    }

    /// `logsigmoid(x) = log(sigmoid(x)) = -softplus(-x)`, as stable as
    /// softplus (no overflow, no `log(0)`), its adjoint `sigmoid(-x)`.
    fn logsigmoid(&mut self, callee: &ast::Ident, args: &[Expr], span: Span) -> Option<ValueId> {
        let [a] = self.args::<1>(callee, args, span)?;
        let v = self.expr(a)?;
        let negated = self.unary(UnaryOp::Neg, v, a.span, span)?;
        let softplus = self.unary(UnaryOp::Softplus, negated, a.span, span)?;
        self.unary(UnaryOp::Neg, softplus, a.span, span)
    }

    /// `transpose(v, a, b)`: `v` as an `a x b` grid of equal blocks, row by
    /// row, read column by column; lowered to its `a*b` slices joined in
    /// the new order (`(head, gate)` blocks to `(gate, head)`).
    fn transpose(&mut self, callee: &ast::Ident, args: &[Expr], span: Span) -> Option<ValueId> {
        let [v, a, b] = self.args::<3>(callee, args, span)?;
        let (rows, cols) =
            (self.integer_arg(a, "the grid's rows"), self.integer_arg(b, "the grid's columns"));
        let value = self.expr(v)?;
        let (rows, cols) = (rows?, cols?);
        let blocks = rows.checked_mul(cols).filter(|&n| n <= MAX_TRANSPOSE_BLOCKS);
        let Some(blocks) = blocks else {
            self.error(
                Diagnostic::error(
                    span,
                    format!("a {rows} x {cols} grid is more than {MAX_TRANSPOSE_BLOCKS} blocks"),
                )
                .with_label("too many blocks")
                .with_note("`transpose` reorders a few blocks, such as heads and gates"),
            );
            return None;
        };
        let (d, piece) = self.equal_blocks(
            value,
            v.span,
            blocks,
            "`transpose` reorders the blocks of a vector",
            &format!("a {rows} x {cols} grid of equal blocks"),
        )?;
        if rows == 1 || cols == 1 {
            return Some(value);
        }
        let mut parts = Vec::with_capacity(blocks as usize);
        for j in 0..cols {
            for i in 0..rows {
                let offset = piece.checked_scale(i * cols + j)?;
                parts.push(self.add(Op::Slice { offset }, Type::Vector(piece.clone()), &[value], span)?);
            }
        }
        self.add(Op::Concat, Type::Vector(d), &parts, span)
    }

    /// `a @ b`: a matrix times a vector, or a vector times a matrix.
    fn matvec(&mut self, a: ValueId, b: ValueId, sa: Span, sb: Span, span: Span) -> Option<ValueId> {
        let (ta, tb) = (self.cell.ty(a).clone(), self.cell.ty(b).clone());
        match (&ta, &tb) {
            (Type::Matrix(..), Type::Vector(_)) => return self.product(a, b, (sa, sb), span, false),
            (Type::Vector(_), Type::Matrix(..)) => return self.product(b, a, (sb, sa), span, true),
            _ => {}
        }
        if !matches!(ta, Type::Matrix(..)) {
            let note = match tb {
                Type::Vector(_) if matches!(ta, Type::Vector(_)) => {
                    "for an elementwise product use `*`; for a dot product, `sum(a * b)`"
                }
                _ => "declare the matrix as `param W[m, n]`; for elementwise products use `*`",
            };
            self.error(
                Diagnostic::error(sa, "one operand of `@` must be a matrix parameter")
                    .with_label(format!("this is {}", describe(&ta)))
                    .with_note(note),
            );
        } else {
            self.error(
                Diagnostic::error(sb, "the right operand of `@` must be a vector")
                    .with_label(format!("this is {}", describe(&tb))),
            );
        }
        None
    }

    /// `W @ v`, or with `transposed` `v @ W` (`Wᵀ v`: `[m] @ [m, n]` gives
    /// `[n]`); per head for a block-diagonal `W`. The operands are a matrix
    /// `m` and a vector `v`.
    fn product(
        &mut self,
        m: ValueId,
        v: ValueId,
        (sm, sv): (Span, Span),
        span: Span,
        transposed: bool,
    ) -> Option<ValueId> {
        let (tm, tv) = (self.cell.ty(m).clone(), self.cell.ty(v).clone());
        let (Type::Matrix(heads, rows, cols), Type::Vector(n)) = (&tm, &tv) else { return None };
        let Some((rows_all, cols_all)) = tm.product_dims() else {
            self.error(
                Diagnostic::error(sm, format!("the sizes of this {tm} matrix overflow"))
                    .with_label(format!("this is {}", describe(&tm))),
            );
            return None;
        };
        // The vector multiplies the rows (`v @ W`) or the columns (`W @ v`).
        let (takes, out, per_head) =
            if transposed { (rows_all, cols_all, rows) } else { (cols_all, rows_all, cols) };
        if &takes != n {
            let one_head = heads.as_constant() == Some(1);
            let matrix = if one_head {
                format!("a [{rows}, {cols}] matrix")
            } else {
                format!("{heads} heads of [{rows}, {cols}]")
            };
            let headline = if transposed {
                format!("cannot multiply a [{n}] vector by {matrix}")
            } else {
                format!("cannot multiply {matrix} by a [{n}] vector")
            };
            let takes_what = if one_head {
                format!("this matrix takes a vector of [{per_head}]")
            } else {
                format!("these heads take a vector of [{takes}], {per_head} per head")
            };
            let mut d = Diagnostic::error(sv, headline)
                .with_secondary(sm, takes_what)
                .with_label(format!("this is [{n}]"));
            if let Op::Param(i) = self.cell.node(m).op {
                let decl = &self.cell.params[i];
                if decl.span != sm {
                    d = d.with_secondary(decl.span, format!("`{}` is declared {tm} here", decl.name));
                }
            }
            if transposed && one_head && cols == n {
                d = d.with_note(format!(
                    "the operands may be swapped: `W @ v` multiplies a [{rows}, {cols}] matrix by a [{cols}] vector"
                ));
            }
            self.error(d.with_note(match (transposed, one_head) {
                (false, true) => "`W[m, n] @ v` needs `v` of size [n], the matrix's second dimension",
                (false, false) => {
                    "`W[heads, m, n] @ v` needs `v` of size [heads*n]: each head multiplies its own n elements"
                }
                (true, true) => "`v @ W[m, n]` is `Wᵀ v`: it needs `v` of size [m], the matrix's first dimension",
                (true, false) => {
                    "`v @ W[heads, m, n]` needs `v` of size [heads*m]: each head multiplies its own m elements"
                }
            }));
            return None;
        }
        let op = if transposed { Op::MatVecT } else { Op::MatVec };
        self.add(op, Type::Vector(out), &[m, v], span)
    }

    fn call(&mut self, callee: &ast::Ident, args: &[Expr], span: Span) -> Option<ValueId> {
        let name = callee.name.as_str();
        if let Some(op) = UnaryOp::from_builtin(name) {
            let [a] = self.args::<1>(callee, args, span)?;
            let v = self.expr(a)?;
            return self.unary(op, v, a.span, span);
        }
        if let Some(op) = BinaryOp::from_builtin(name) {
            let [a, b] = self.args::<2>(callee, args, span)?;
            let (va, vb) = (self.expr(a), self.expr(b));
            return self.binary(op, va?, vb?, (a.span, b.span), span);
        }
        if let Some(op) = ReduceOp::from_builtin(name) {
            let [a] = self.args::<1>(callee, args, span)?;
            let v = self.expr(a)?;
            let ty = self.cell.ty(v).clone();
            if !matches!(ty, Type::Vector(_)) {
                self.error(
                    Diagnostic::error(a.span, format!("`{name}` reduces a vector to a scalar"))
                        .with_label(format!("this is {}", describe(&ty))),
                );
                return None;
            }
            return self.add(Op::Reduce(op), Type::Scalar, &[v], span);
        }
        if let Some(f) = MaskFn::from_builtin(name) {
            return self.mask_call(f, callee, args, span);
        }
        match name {
            "concat" => return self.concat(args, span),
            "where" => return self.select(callee, args, span),
            "logsigmoid" => return self.logsigmoid(callee, args, span),
            "transpose" => return self.transpose(callee, args, span),
            "chunk" => {
                self.error(
                    Diagnostic::error(span, "`chunk` may only appear directly on the right of a `let`")
                        .with_note("write `let a, b = chunk(v, 2)` and use `a` and `b`"),
                );
                self.check_args(args);
                return None;
            }
            _ => {}
        }
        let globals = self.globals;
        let Some(f) = globals.fns.get(name) else {
            let mut d = Diagnostic::error(callee.span, format!("unknown function `{name}`"))
                .with_label("not defined");
            let known = globals.fns.keys().copied().chain(super::builtin_names());
            if globals.cells.contains(&name) {
                d = d.with_note(format!(
                    "`{name}` is a cell: cells cannot be called; put what they share in a `fn`"
                ));
            } else if let Some(s) = did_you_mean(name, known) {
                d = d.with_note(format!("did you mean `{s}`?"));
            }
            self.error(d);
            self.check_args(args);
            return None;
        };
        globals.mark_used(name);
        self.inline(f, callee, args, span)
    }

    pub(super) fn args<'e, const N: usize>(
        &mut self,
        callee: &ast::Ident,
        args: &'e [Expr],
        span: Span,
    ) -> Option<&'e [Expr; N]> {
        match <&[Expr; N]>::try_from(args) {
            Ok(a) => Some(a),
            Err(_) => {
                let plural = if N == 1 { "" } else { "s" };
                self.error(
                    Diagnostic::error(
                        span,
                        format!("`{}` takes {N} argument{plural}, found {}", callee.name, args.len()),
                    )
                    .with_label(format!("expected {N} argument{plural}")),
                );
                self.check_args(args);
                None
            }
        }
    }

    /// Lowers the arguments of a call that failed, for their own errors
    /// and so that the names they read do not seem unused.
    pub(super) fn check_args(&mut self, args: &[Expr]) {
        for a in args {
            self.expr(a);
        }
    }

    fn concat(&mut self, args: &[Expr], span: Span) -> Option<ValueId> {
        if args.is_empty() {
            self.error(Diagnostic::error(span, "`concat` needs at least one vector"));
            return None;
        }
        let values: Vec<Option<ValueId>> = args.iter().map(|a| self.expr(a)).collect();
        let values: Vec<ValueId> = values.into_iter().collect::<Option<_>>()?;
        let mut total = Dim::default();
        for (v, a) in values.iter().zip(args) {
            let ty = self.cell.ty(*v).clone();
            let Some(d) = dim_of(&ty) else {
                self.error(
                    Diagnostic::error(a.span, "`concat` joins vectors")
                        .with_label(format!("this is {}", describe(&ty))),
                );
                return None;
            };
            total = total.checked_add(&d)?;
        }
        self.add(Op::Concat, Type::Vector(total), &values, span)
    }

    /// Inlines a call to a user or prelude function.
    fn inline(&mut self, f: &ast::FnDef, callee: &ast::Ident, args: &[Expr], span: Span) -> Option<ValueId> {
        if args.len() != f.params.len() {
            let plural = if f.params.len() == 1 { "" } else { "s" };
            self.error(
                Diagnostic::error(
                    span,
                    format!(
                        "`{}` takes {} argument{plural}, found {}",
                        f.name.name,
                        f.params.len(),
                        args.len()
                    ),
                )
                .with_label(format!("expected {} argument{plural}", f.params.len()))
                .with_secondary(f.name.span, "function defined here"),
            );
            self.check_args(args);
            return None;
        }
        let calls: Vec<&str> =
            self.frames.iter().filter_map(|fr| fr.call.as_ref()).map(|c| c.name.as_str()).collect();
        if let Some(entered) = calls.iter().position(|n| *n == f.name.name) {
            // The calls in between, if the recursion goes through others.
            let through: Vec<String> = calls[entered + 1..].iter().map(|n| format!("`{n}`")).collect();
            let message = if through.is_empty() {
                format!("function `{}` calls itself", f.name.name)
            } else {
                format!("function `{}` calls itself through {}", f.name.name, through.join(", "))
            };
            self.error(
                Diagnostic::error(callee.span, message)
                    .with_label("recursive call")
                    .with_note("functions are inlined where they are called, so recursion is not allowed"),
            );
            return None;
        }
        if self.frames.len() > MAX_CALL_DEPTH {
            self.error(Diagnostic::error(
                span,
                format!("function calls nest more than {MAX_CALL_DEPTH} deep"),
            ));
            return None;
        }
        let values: Vec<Option<ValueId>> = args.iter().map(|a| self.expr(a)).collect();
        if values.iter().any(Option::is_none) {
            return None;
        }
        let described: Vec<String> = f
            .params
            .iter()
            .zip(&values)
            .map(|(p, v)| format!("`{}`: {}", p.name, v.map_or("?".into(), |v| short_type(self.cell.ty(v)))))
            .collect();
        let call = Call { name: f.name.name.clone(), span, args: described.join(", ") };
        self.frames.push(Frame { call: Some(call), ..Frame::default() });
        for (p, v) in f.params.iter().zip(values) {
            self.bind(p, BindingKind::FnParam, v);
        }
        for l in &f.lets {
            self.let_binding(l);
        }
        let result = self.expr(&f.result);
        self.frames.pop();
        result
    }
}

/// A type as in the source: `[4*H]`, `[H, I]`, or `a scalar`.
fn short_type(t: &Type) -> String {
    match t {
        Type::Scalar => "a scalar".into(),
        Type::Vector(d) => format!("[{d}]"),
        Type::Matrix(..) => t.to_string(),
    }
}
