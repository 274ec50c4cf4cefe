//! The abstract syntax tree: what the user wrote, with spans, unchecked.
//!
//! Parsing never checks names, dimensions or types; [`crate::lower`] does.
//! Every node keeps the span the diagnostics will underline.

use crate::diag::Span;

/// A name as written, with where it was written.
#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    /// The name's text.
    pub name: String,
    /// Where it is written.
    pub span: Span,
}

/// A whole `.cell` file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct File {
    /// The file's cells, functions and constants, in source order.
    pub items: Vec<Item>,
}

/// A top-level definition of a file.
#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    /// `cell NAME { ... }`.
    Cell(CellDef),
    /// `fn NAME(...) { ... }`.
    Fn(FnDef),
    /// `const NAME = number`.
    Const(ConstDef),
}

/// `const NAME = number`
#[derive(Clone, Debug, PartialEq)]
pub struct ConstDef {
    /// The constant's name.
    pub name: Ident,
    /// Its value, with the sign applied.
    pub value: f64,
    /// From `const` to the number.
    pub span: Span,
}

/// `fn NAME(a, b) { let ... ; expr }`
#[derive(Clone, Debug, PartialEq)]
pub struct FnDef {
    /// The function's name.
    pub name: Ident,
    /// Its parameters, in order.
    pub params: Vec<Ident>,
    /// The `let`s of its body, in order.
    pub lets: Vec<Let>,
    /// The expression the body ends with: the function's result.
    pub result: Expr,
    /// From `fn` to the closing `}`.
    pub span: Span,
    /// The body had syntax errors (already reported), so parts of it may
    /// be missing: checks for unused names are skipped.
    pub recovered: bool,
}

/// `cell NAME { decls stmts }`
#[derive(Clone, Debug, PartialEq)]
pub struct CellDef {
    /// The cell's name.
    pub name: Ident,
    /// The `input`, `state` and `param` declarations, one per declared name.
    pub decls: Vec<VarDecl>,
    /// The `rate` declarations, one per declared name.
    pub rates: Vec<RateDecl>,
    /// The statements after the declarations, in order.
    pub stmts: Vec<Stmt>,
    /// From `cell` to the closing `}`.
    pub span: Span,
    /// The body had syntax errors (already reported), so statements may be
    /// missing: checks for something absent (an assignment, the output, a
    /// use of a name) are skipped.
    pub recovered: bool,
}

/// The keyword a declaration starts with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeclKind {
    /// `input`: a slice of the step's feature vector.
    Input,
    /// `state`: carried from step to step.
    State,
    /// `param`: a learned vector or matrix.
    Param,
}

impl DeclKind {
    /// The keyword as written: `input`, `state` or `param`.
    pub fn word(self) -> &'static str {
        match self {
            DeclKind::Input => "input",
            DeclKind::State => "state",
            DeclKind::Param => "param",
        }
    }
}

/// One declared variable: `x[I]`, `W[4*H, I] = zeros`.
#[derive(Clone, Debug, PartialEq)]
pub struct VarDecl {
    /// Which declaration it is in.
    pub kind: DeclKind,
    /// The declared name.
    pub name: Ident,
    /// Empty when the size failed to parse (already reported): the name is
    /// declared, with no usable value.
    pub dims: Vec<DimExpr>,
    /// The `= init` clause, if any (only parameters may have one).
    pub init: Option<Init>,
    /// The span of `name[dims]`.
    pub span: Span,
}

/// One declared rate: `zh = 0.1`.
#[derive(Clone, Debug, PartialEq)]
pub struct RateDecl {
    /// The declared name.
    pub name: Ident,
    /// The default as written, with its span.
    pub default: (f64, Span),
    /// The span of `name = default`.
    pub span: Span,
}

/// A dimension as written: `4*H + I`.
#[derive(Clone, Debug, PartialEq)]
pub enum DimExpr {
    /// An integer literal: `4`.
    Int(u64, Span),
    /// A size variable (or a `const` with a whole value): `H`.
    Var(Ident),
    /// `lhs op rhs`: `H + I`, `4*H`.
    Binary {
        /// The operator.
        op: DimOp,
        /// The left operand.
        lhs: Box<DimExpr>,
        /// The right operand.
        rhs: Box<DimExpr>,
        /// From the start of `lhs` to the end of `rhs`.
        span: Span,
    },
}

/// An operator of a dimension expression.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DimOp {
    /// `+`.
    Add,
    /// `-`.
    Sub,
    /// `*`.
    Mul,
}

impl DimExpr {
    /// Where the dimension is written.
    pub fn span(&self) -> Span {
        match self {
            DimExpr::Int(_, s) | DimExpr::Binary { span: s, .. } => *s,
            DimExpr::Var(id) => id.span,
        }
    }
}

/// A parameter's init clause.
#[derive(Clone, Debug, PartialEq)]
pub enum Init {
    /// `zeros`.
    Zeros(Span),
    /// `ones`.
    Ones(Span),
    /// `uniform(bound)`: uniform in `[-bound, bound]`; the span covers the whole clause.
    Uniform(Expr, Span),
    /// `constant(c)`: every element `c`; the span covers the whole clause.
    Constant(Expr, Span),
}

/// A statement of a cell body.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// `let a = expr` or `let a, b = chunk(v, 2)`.
    Let(Let),
    /// `NAME' = expr`
    Assign {
        /// The state assigned, without the prime.
        state: Ident,
        /// Its value at the end of the step.
        value: Expr,
        /// From the name to the end of the value.
        span: Span,
    },
    /// `output expr`
    Output {
        /// The step's output.
        value: Expr,
        /// From `output` to the end of the value.
        span: Span,
    },
}

/// `let a, b = expr`
#[derive(Clone, Debug, PartialEq)]
pub struct Let {
    /// The names bound: one, or several for `chunk`.
    pub names: Vec<Ident>,
    /// The value bound.
    pub value: Expr,
    /// From `let` (or the first name, where `let` is missing) to the end of the value.
    pub span: Span,
}

/// An expression, with its span.
#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    /// What kind of expression it is.
    pub kind: ExprKind,
    /// Where it is written, from its first token to its last.
    pub span: Span,
}

/// Dropped without recursion: a chain of thousands of terms is a tree as
/// deep, and a recursive drop would need a stack frame per level. The
/// children are taken out onto a heap stack and dropped once childless.
impl Drop for Expr {
    fn drop(&mut self) {
        let mut pending: Vec<Expr> = Vec::new();
        take_children(&mut self.kind, &mut pending);
        while let Some(mut e) = pending.pop() {
            take_children(&mut e.kind, &mut pending);
        }
    }
}

/// Moves `kind`'s subexpressions onto `pending`, leaving it childless.
fn take_children(kind: &mut ExprKind, pending: &mut Vec<Expr>) {
    let placeholder = |b: &mut Box<Expr>| {
        let span = b.span;
        std::mem::replace(&mut **b, Expr { kind: ExprKind::Error, span })
    };
    match kind {
        ExprKind::Neg(e) | ExprKind::Paren(e) => pending.push(placeholder(e)),
        ExprKind::Binary { lhs, rhs, .. } => {
            pending.push(placeholder(lhs));
            pending.push(placeholder(rhs));
        }
        ExprKind::Call { args, .. } => pending.append(args),
        ExprKind::Number(_) | ExprKind::Name(_) | ExprKind::Primed(_) | ExprKind::Error => {}
    }
}

/// The forms an expression can take.
#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    /// A number literal's value: `0.5`, `1e-5`.
    Number(f64),
    /// A name read: an input, state, parameter, `let`, constant or function parameter.
    Name(Ident),
    /// `c'`: a state's value at the end of the step.
    Primed(Ident),
    /// A call of a built-in or a function: `tanh(x)`, `layernorm(v, g, b)`.
    Call {
        /// The function called.
        callee: Ident,
        /// The arguments, in order.
        args: Vec<Expr>,
    },
    /// `-e`.
    Neg(Box<Expr>),
    /// An infix operation: `a + b`, `W @ x`.
    Binary {
        /// The operator.
        op: BinOp,
        /// The left operand.
        lhs: Box<Expr>,
        /// The right operand.
        rhs: Box<Expr>,
    },
    /// `(e)`; kept so that spans and messages can say what was written.
    Paren(Box<Expr>),
    /// A parse error already reported; lowering skips it silently.
    Error,
}

/// An infix operator of expressions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinOp {
    /// `+`.
    Add,
    /// `-`.
    Sub,
    /// `*`: elementwise.
    Mul,
    /// `/`: elementwise.
    Div,
    /// `@`: a matrix times a vector.
    MatMul,
    /// `<`: 1 where it holds, else 0 (NaN where an operand is NaN); so
    /// are the other comparisons.
    Lt,
    /// `<=`.
    Le,
    /// `>`.
    Gt,
    /// `>=`.
    Ge,
    /// `==`.
    Eq,
    /// `!=`.
    Ne,
}

impl BinOp {
    /// The operator as written: `+`, `-`, `*`, `/`, `@` or a comparison.
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::MatMul => "@",
            BinOp::Lt => "<",
            BinOp::Le => "<=",
            BinOp::Gt => ">",
            BinOp::Ge => ">=",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
        }
    }

    /// Whether it is a comparison (`<`, `<=`, `>`, `>=`, `==`, `!=`).
    pub fn is_comparison(self) -> bool {
        matches!(self, BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge | BinOp::Eq | BinOp::Ne)
    }
}

impl Expr {
    /// A placeholder for an expression that failed to parse (already reported).
    pub fn error(span: Span) -> Expr {
        Expr { kind: ExprKind::Error, span }
    }

    /// Visits every name read by this expression (not call targets).
    pub fn for_each_name(&self, f: &mut dyn FnMut(&Ident, bool)) {
        crate::deep::deep(|| self.for_each_name_here(f))
    }

    fn for_each_name_here(&self, f: &mut dyn FnMut(&Ident, bool)) {
        match &self.kind {
            ExprKind::Name(id) => f(id, false),
            ExprKind::Primed(id) => f(id, true),
            ExprKind::Call { args, .. } => args.iter().for_each(|a| a.for_each_name(f)),
            ExprKind::Neg(e) | ExprKind::Paren(e) => e.for_each_name(f),
            ExprKind::Binary { lhs, rhs, .. } => {
                lhs.for_each_name(f);
                rhs.for_each_name(f);
            }
            ExprKind::Number(_) | ExprKind::Error => {}
        }
    }

    /// Visits every function name called by this expression.
    pub fn for_each_call(&self, f: &mut dyn FnMut(&Ident)) {
        crate::deep::deep(|| self.for_each_call_here(f))
    }

    fn for_each_call_here(&self, f: &mut dyn FnMut(&Ident)) {
        match &self.kind {
            ExprKind::Call { callee, args } => {
                f(callee);
                args.iter().for_each(|a| a.for_each_call(f));
            }
            ExprKind::Neg(e) | ExprKind::Paren(e) => e.for_each_call(f),
            ExprKind::Binary { lhs, rhs, .. } => {
                lhs.for_each_call(f);
                rhs.for_each_call(f);
            }
            ExprKind::Name(_) | ExprKind::Primed(_) | ExprKind::Number(_) | ExprKind::Error => {}
        }
    }
}
