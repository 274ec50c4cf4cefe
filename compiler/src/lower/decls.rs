//! Lowering declarations: `input`, `state` and `param` lines, their
//! symbolic dimensions, and parameter initialisers.

use super::{BindingKind, CellLowerer};
use crate::diag::{Diagnostic, Span};
use crate::dims::Dim;
use crate::ir::{self, ConstExpr, Init, Type};
use crate::syntax::ast::{self, DeclKind, DimExpr, DimOp, ExprKind};

impl CellLowerer<'_> {
    pub(super) fn declarations(&mut self, def: &ast::CellDef) {
        // Size variables first, in order of appearance, so that init
        // expressions may name any of them.
        for d in &def.decls {
            for dim in &d.dims {
                self.collect_sizes(dim);
            }
        }
        for d in &def.decls {
            let kind = match d.kind {
                DeclKind::Input => BindingKind::Input,
                DeclKind::State => BindingKind::State,
                DeclKind::Param => BindingKind::Param,
            };
            let Some(ty) = self.decl_type(d) else {
                // Reported; the name is still declared, so uses are not unknown.
                self.bind(&d.name, kind, None);
                continue;
            };
            let value = match d.kind {
                DeclKind::Input => {
                    let Type::Vector(dim) = ty else { continue };
                    let idx = self.cell.inputs.len();
                    self.cell.inputs.push(ir::VarDecl {
                        name: d.name.name.clone(),
                        dim: dim.clone(),
                        span: d.span,
                    });
                    self.add(ir::Op::Input(idx), Type::Vector(dim), &[], d.span)
                }
                DeclKind::State => {
                    let Type::Vector(dim) = ty else { continue };
                    let idx = self.cell.states.len();
                    self.cell.states.push(ir::VarDecl {
                        name: d.name.name.clone(),
                        dim: dim.clone(),
                        span: d.span,
                    });
                    self.add(ir::Op::State(idx), Type::Vector(dim), &[], d.span)
                }
                DeclKind::Param => {
                    let init = self.param_init(d, def);
                    let idx = self.cell.params.len();
                    self.cell.params.push(ir::ParamDecl {
                        name: d.name.name.clone(),
                        ty: ty.clone(),
                        declared_heads: d.dims.len() == 3,
                        init: init.unwrap_or(Init::Zeros),
                        span: d.span,
                    });
                    self.add(ir::Op::Param(idx), ty, &[], d.span)
                }
            };
            self.bind(&d.name, kind, value);
        }
        let mut sizes: Vec<(Span, String)> = self.sizes.iter().map(|(n, s)| (*s, n.clone())).collect();
        sizes.sort();
        self.cell.sizes = sizes.into_iter().map(|(_, n)| n).collect();
    }

    fn collect_sizes(&mut self, d: &DimExpr) {
        match d {
            DimExpr::Int(..) => {}
            DimExpr::Var(id) => {
                if !self.globals.consts.contains_key(id.name.as_str()) {
                    self.sizes.entry(id.name.clone()).or_insert(id.span);
                }
            }
            DimExpr::Binary { lhs, rhs, .. } => {
                self.collect_sizes(lhs);
                self.collect_sizes(rhs);
            }
        }
    }

    /// The declared type, checking the number of dimensions for the kind.
    fn decl_type(&mut self, d: &ast::VarDecl) -> Option<Type> {
        if d.dims.is_empty() {
            return None; // The size did not parse (reported).
        }
        let dims: Vec<Dim> = d.dims.iter().map(|e| self.dim(e)).collect::<Option<_>>()?;
        match (d.kind, dims.as_slice()) {
            (DeclKind::Input | DeclKind::State, [v]) => {
                if let (Some(init), DeclKind::Input | DeclKind::State) = (&d.init, d.kind) {
                    let span = init_span(init);
                    self.error(
                        Diagnostic::error(
                            span,
                            format!(
                                "only parameters have an initialiser; `{}` is {}",
                                d.name.name,
                                if d.kind == DeclKind::Input { "an input" } else { "a state" }
                            ),
                        )
                        .with_note(match d.kind {
                            DeclKind::State => {
                                "a state starts from the initial state given at run time (zeros by default)"
                            }
                            _ => "an input takes its value from the sequence",
                        }),
                    );
                }
                Some(Type::Vector(v.clone()))
            }
            (DeclKind::Input | DeclKind::State, _) => {
                self.error(
                    Diagnostic::error(
                        d.span,
                        format!("{} `{}` must have exactly one dimension", d.kind.word(), d.name.name),
                    )
                    .with_label(format!("has {} dimensions", dims.len()))
                    .with_note(match d.kind {
                        DeclKind::Input => "a cell describes one time step of one sequence: declare the features of one step, as `x[I]`; the runtime maps the cell over time and batch",
                        _ => "a state is a vector, as `h[H]`; only parameters may be matrices",
                    }),
                );
                None
            }
            (DeclKind::Param, [v]) => Some(Type::Vector(v.clone())),
            (DeclKind::Param, [m, n]) => Some(Type::matrix(m.clone(), n.clone())),
            (DeclKind::Param, [h, m, n]) => Some(Type::Matrix(h.clone(), m.clone(), n.clone())),
            (DeclKind::Param, _) => {
                self.error(
                    Diagnostic::error(
                        d.span,
                        format!("parameter `{}` has {} dimensions", d.name.name, dims.len()),
                    )
                    .with_label("expected 1, 2 or 3")
                    .with_note("a parameter is a vector `[n]`, a matrix `[m, n]`, or `[heads, m, n]`: one `[m, n]` matrix per head, on the diagonal of a block-diagonal one; stack per-gate weights along the rows, as `[4*H, I]`, and split the product with `chunk`"),
                );
                None
            }
        }
    }

    /// A dimension expression as a polynomial; it must be able to be positive.
    fn dim(&mut self, e: &DimExpr) -> Option<Dim> {
        let d = self.dim_expr(e)?;
        if d.is_zero() {
            self.error(Diagnostic::error(e.span(), "dimension is zero").with_label("this is 0"));
            return None;
        }
        if d.is_never_positive() {
            self.error(
                Diagnostic::error(e.span(), format!("dimension `{d}` is never positive"))
                    .with_label("a size must be at least 1"),
            );
            return None;
        }
        Some(d)
    }

    fn dim_expr(&mut self, e: &DimExpr) -> Option<Dim> {
        match e {
            DimExpr::Int(n, span) => match i64::try_from(*n) {
                Ok(n) => Some(Dim::constant(n)),
                Err(_) => {
                    self.error(Diagnostic::error(*span, "dimension is too large"));
                    None
                }
            },
            DimExpr::Var(id) => {
                if let Some(c) = self.globals.consts.get(id.name.as_str()) {
                    self.globals.mark_used(&id.name);
                    if c.value.fract() == 0.0 && c.value.abs() < 1e15 {
                        return Some(Dim::constant(c.value as i64));
                    }
                    let (problem, note) = if c.value.fract() == 0.0 {
                        ("is too large for a size", "a size must be below 10^15")
                    } else {
                        ("is not a whole number", "a dimension must be a whole number")
                    };
                    self.error(
                        Diagnostic::error(id.span, format!("constant `{}` = {} {problem}", id.name, c.value))
                            .with_secondary(c.name.span, "defined here")
                            .with_note(note),
                    );
                    return None;
                }
                Some(Dim::var(&id.name))
            }
            DimExpr::Binary { op, lhs, rhs, span } => {
                let (a, b) = (self.dim_expr(lhs)?, self.dim_expr(rhs)?);
                let r = match op {
                    DimOp::Add => a.checked_add(&b),
                    DimOp::Sub => a.checked_sub(&b),
                    DimOp::Mul => a.checked_mul(&b),
                };
                if r.is_none() {
                    let d = if *op == DimOp::Mul && a.product_too_complex(&b) {
                        Diagnostic::error(*span, "dimension is too complex")
                            .with_label(format!(
                                "expands to more than {} terms or {} variables in a term",
                                crate::dims::MAX_TERMS,
                                crate::dims::MAX_DEGREE
                            ))
                            .with_note(
                                "sizes are kept as expanded polynomials; give a product of sums a size variable of its own",
                            )
                    } else {
                        Diagnostic::error(*span, "dimension is too large").with_label("overflows 64 bits")
                    };
                    self.error(d);
                }
                r
            }
        }
    }

    fn param_init(&mut self, d: &ast::VarDecl, def: &ast::CellDef) -> Option<Init> {
        match &d.init {
            Some(ast::Init::Zeros(_)) => Some(Init::Zeros),
            Some(ast::Init::Ones(_)) => Some(Init::Ones),
            Some(ast::Init::Uniform(e, _)) => self.const_expr(e).map(Init::Uniform),
            Some(ast::Init::Constant(e, _)) => self.const_expr(e).map(Init::Constant),
            None => {
                // PyTorch's RNN default: uniform(1/sqrt(D)), D the first state's size.
                let Some(state) = def.decls.iter().find(|s| s.kind == DeclKind::State) else {
                    self.error(
                        Diagnostic::error(d.span, format!("parameter `{}` needs an initialiser", d.name.name))
                            .with_note("without `= init`, a parameter starts as uniform(1/sqrt(D)), D the size of the first state, but this cell has no state"),
                    );
                    return None;
                };
                let dim = state.dims.first().and_then(|e| self.dim_expr(e))?;
                let d = dim_to_const(&dim);
                Some(Init::Uniform(ConstExpr::Binary(
                    ir::BinaryOp::Div,
                    Box::new(ConstExpr::Number(1.0)),
                    Box::new(ConstExpr::Unary(ir::UnaryOp::Sqrt, Box::new(d))),
                )))
            }
        }
    }

    /// An init argument: numbers, constants, size variables, arithmetic and
    /// elementwise built-ins.
    fn const_expr(&mut self, e: &ast::Expr) -> Option<ConstExpr> {
        crate::deep::deep(|| self.const_expr_here(e))
    }

    fn const_expr_here(&mut self, e: &ast::Expr) -> Option<ConstExpr> {
        match &e.kind {
            ExprKind::Number(v) => Some(ConstExpr::Number(*v)),
            ExprKind::Name(id) => {
                if let Some(c) = self.globals.consts.get(id.name.as_str()) {
                    self.globals.mark_used(&id.name);
                    return Some(ConstExpr::Number(c.value));
                }
                if self.sizes.contains_key(&id.name) {
                    return Some(ConstExpr::Size(Dim::var(&id.name)));
                }
                let mut d =
                    Diagnostic::error(id.span, format!("`{}` cannot be used in an initialiser", id.name));
                if let Some(b) = self.frames[0].names.get_mut(&id.name) {
                    b.used = true; // Reported here: not also "unused".
                    d = d.with_label(format!("`{}` is {}", id.name, b.kind.a_word()));
                }
                self.error(d.with_note(
                    "an initialiser is computed from numbers, `const`s and the cell's size variables",
                ));
                None
            }
            ExprKind::Paren(inner) => self.const_expr(inner),
            ExprKind::Neg(inner) => Some(ConstExpr::Neg(Box::new(self.const_expr(inner)?))),
            ExprKind::Binary { op, lhs, rhs } => {
                let op = match op {
                    ast::BinOp::Add => ir::BinaryOp::Add,
                    ast::BinOp::Sub => ir::BinaryOp::Sub,
                    ast::BinOp::Mul => ir::BinaryOp::Mul,
                    ast::BinOp::Div => ir::BinaryOp::Div,
                    ast::BinOp::MatMul => {
                        self.error(Diagnostic::error(e.span, "`@` cannot be used in an initialiser"));
                        return None;
                    }
                    comparison => {
                        self.error(Diagnostic::error(
                            e.span,
                            format!(
                                "a comparison (`{}`) cannot be used in an initialiser",
                                comparison.symbol()
                            ),
                        ));
                        return None;
                    }
                };
                let (a, b) = (self.const_expr(lhs), self.const_expr(rhs));
                Some(ConstExpr::Binary(op, Box::new(a?), Box::new(b?)))
            }
            ExprKind::Call { callee, args } => {
                let unary = ir::UnaryOp::from_builtin(&callee.name);
                let binary = ir::BinaryOp::from_builtin(&callee.name);
                match (unary, binary, args.as_slice()) {
                    (Some(op), _, [a]) => Some(ConstExpr::Unary(op, Box::new(self.const_expr(a)?))),
                    (_, Some(op), [a, b]) => {
                        let (a, b) = (self.const_expr(a), self.const_expr(b));
                        Some(ConstExpr::Binary(op, Box::new(a?), Box::new(b?)))
                    }
                    _ => {
                        self.error(
                            Diagnostic::error(e.span, format!("`{}(...)` cannot be used in an initialiser", callee.name))
                                .with_note("initialisers may call the elementwise built-ins (`sqrt`, `exp`, `min`, ...) with the right number of arguments"),
                        );
                        None
                    }
                }
            }
            ExprKind::Primed(id) => {
                self.error(Diagnostic::error(id.span, "a state's value cannot be used in an initialiser"));
                None
            }
            ExprKind::Error => None,
        }
    }
}

fn init_span(init: &ast::Init) -> Span {
    match init {
        ast::Init::Zeros(s) | ast::Init::Ones(s) | ast::Init::Uniform(_, s) | ast::Init::Constant(_, s) => *s,
    }
}

/// A dimension as a constant expression (for the default init's `D`).
fn dim_to_const(d: &Dim) -> ConstExpr {
    match d.as_constant() {
        Some(n) => ConstExpr::Number(n as f64),
        None => ConstExpr::Size(d.clone()),
    }
}
