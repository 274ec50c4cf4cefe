//! The abstract syntax tree: what the user wrote, with spans, unchecked.
//!
//! Parsing never checks names, dimensions or types; [`crate::lower`] does.
//! Every node keeps the span the diagnostics will underline.

use crate::diag::Span;

/// A name as written, with where it was written.
#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

/// A whole `.cell` file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct File {
    pub items: Vec<Item>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    Cell(CellDef),
    Fn(FnDef),
    Const(ConstDef),
}

/// `const NAME = number`
#[derive(Clone, Debug, PartialEq)]
pub struct ConstDef {
    pub name: Ident,
    pub value: f64,
    pub span: Span,
}

/// `fn NAME(a, b) { let ... ; expr }`
#[derive(Clone, Debug, PartialEq)]
pub struct FnDef {
    pub name: Ident,
    pub params: Vec<Ident>,
    pub lets: Vec<Let>,
    pub result: Expr,
    pub span: Span,
    /// The body had syntax errors (already reported), so parts of it may
    /// be missing: checks for unused names are skipped.
    pub recovered: bool,
}

/// `cell NAME { decls stmts }`
#[derive(Clone, Debug, PartialEq)]
pub struct CellDef {
    pub name: Ident,
    pub decls: Vec<VarDecl>,
    pub stmts: Vec<Stmt>,
    pub span: Span,
    /// The body had syntax errors (already reported), so statements may be
    /// missing: checks for something absent (an assignment, the output, a
    /// use of a name) are skipped.
    pub recovered: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeclKind {
    Input,
    State,
    Param,
}

impl DeclKind {
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
    pub kind: DeclKind,
    pub name: Ident,
    /// Empty when the size failed to parse (already reported): the name is
    /// declared, with no usable value.
    pub dims: Vec<DimExpr>,
    pub init: Option<Init>,
    /// The span of `name[dims]`.
    pub span: Span,
}

/// A dimension as written: `4*H + I`.
#[derive(Clone, Debug, PartialEq)]
pub enum DimExpr {
    Int(u64, Span),
    Var(Ident),
    Binary { op: DimOp, lhs: Box<DimExpr>, rhs: Box<DimExpr>, span: Span },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DimOp {
    Add,
    Sub,
    Mul,
}

impl DimExpr {
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
    Zeros(Span),
    Ones(Span),
    Uniform(Expr, Span),
    Constant(Expr, Span),
}

#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    Let(Let),
    /// `NAME' = expr`
    Assign {
        state: Ident,
        value: Expr,
        span: Span,
    },
    /// `output expr`
    Output {
        value: Expr,
        span: Span,
    },
}

/// `let a, b = expr`
#[derive(Clone, Debug, PartialEq)]
pub struct Let {
    pub names: Vec<Ident>,
    pub value: Expr,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    /// The literal's text is kept for messages; its value is parsed.
    Number(f64),
    Name(Ident),
    /// `c'`: a state's value at the end of the step.
    Primed(Ident),
    Call {
        callee: Ident,
        args: Vec<Expr>,
    },
    Neg(Box<Expr>),
    Binary {
        op: BinOp,
        lhs: Box<Expr>,
        rhs: Box<Expr>,
    },
    /// `(e)`; kept so that spans and messages can say what was written.
    Paren(Box<Expr>),
    /// A parse error already reported; lowering skips it silently.
    Error,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    MatMul,
}

impl BinOp {
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::MatMul => "@",
        }
    }
}

impl Expr {
    pub fn error(span: Span) -> Expr {
        Expr { kind: ExprKind::Error, span }
    }

    /// Visits every name read by this expression (not call targets).
    pub fn for_each_name(&self, f: &mut dyn FnMut(&Ident, bool)) {
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
