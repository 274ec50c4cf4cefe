//! A generated cell as a structure: what the generator builds, the shrinker
//! rewrites and [`std::fmt::Display`] prints as `.cell` text.
//!
//! Expressions carry their own numeric guards ([`Guard`]) so that a rewrite
//! never strips the `+ 0.5` that keeps a `log` in its domain: a guard is
//! removed only with the node it protects.
//!
//! Mask calls ([`Expr::Dropout`], [`Expr::Zoneout`], [`Expr::DropConnect`])
//! read the cell's rates ([`CellSpec::rates`]). A matrix parameter applied
//! through `dropconnect` is applied only so, at one rate: the generator
//! decides it per parameter, and no rewrite turns one of its products into
//! a plain `W @ v` (only [`Expr::without_dropconnect`], every one at once).

use crate::ir::UnaryOp;
pub use crate::syntax::ast::BinOp;
use std::collections::BTreeMap;
use std::fmt;

/// A size: a sum of positive integer multiples of size variables (`2*H + P`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Size(pub BTreeMap<String, u32>);

impl Size {
    /// The size that is the variable `name` once (`H`).
    pub fn var(name: &str) -> Size {
        Size([(name.to_string(), 1)].into_iter().collect())
    }

    /// `k` times this size.
    pub fn times(&self, k: u32) -> Size {
        Size(self.0.iter().map(|(v, c)| (v.clone(), c * k)).collect())
    }

    /// The sum of the two sizes, coefficient by coefficient.
    pub fn plus(&self, other: &Size) -> Size {
        let mut out = self.0.clone();
        for (v, c) in &other.0 {
            *out.entry(v.clone()).or_insert(0) += c;
        }
        Size(out)
    }

    /// Whether every coefficient is a multiple of `k` (what `chunk(v, k)` needs).
    pub fn divisible_by(&self, k: u32) -> bool {
        k > 0 && self.0.values().all(|c| c % k == 0)
    }

    /// This size over `k`, coefficient by coefficient (where [`Size::divisible_by`] `k`).
    pub fn over(&self, k: u32) -> Size {
        Size(self.0.iter().map(|(v, c)| (v.clone(), c / k.max(1))).collect())
    }

    /// The ways of writing this size as a sum of two sizes (for `concat`).
    pub fn splits(&self) -> Vec<(Size, Size)> {
        let terms: Vec<(&String, u32)> = self.0.iter().map(|(v, &c)| (v, c)).collect();
        let mut out = Vec::new();
        // Every choice of a coefficient `a` per variable with 0 <= a <= c,
        // neither part empty.
        let mut choice = vec![0u32; terms.len()];
        loop {
            let left: BTreeMap<String, u32> = terms
                .iter()
                .zip(&choice)
                .filter(|(_, &a)| a > 0)
                .map(|((v, _), &a)| ((*v).clone(), a))
                .collect();
            let right: BTreeMap<String, u32> = terms
                .iter()
                .zip(&choice)
                .filter(|((_, c), &a)| c - a > 0)
                .map(|((v, c), &a)| ((*v).clone(), c - a))
                .collect();
            if !left.is_empty() && !right.is_empty() {
                out.push((Size(left), Size(right)));
            }
            let mut i = 0;
            loop {
                if i == terms.len() {
                    return out;
                }
                if choice[i] < terms[i].1 {
                    choice[i] += 1;
                    break;
                }
                choice[i] = 0;
                i += 1;
            }
        }
    }

    /// Its value at `sizes` (variables missing count as 1).
    pub fn eval(&self, sizes: &BTreeMap<String, usize>) -> usize {
        self.0.iter().map(|(v, &c)| c as usize * sizes.get(v).copied().unwrap_or(1)).sum()
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let terms: Vec<String> =
            self.0.iter().map(|(v, &c)| if c == 1 { v.clone() } else { format!("{c}*{v}") }).collect();
        if terms.is_empty() {
            write!(f, "1")
        } else {
            write!(f, "{}", terms.join(" + "))
        }
    }
}

/// The type of a value: a scalar or a vector of a size.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    /// A scalar.
    Scalar,
    /// A vector of the given size.
    Vector(Size),
}

/// The guard a built-in's argument needs to stay in the domain and in range.
pub(crate) fn guard_for(op: UnaryOp) -> Option<Guard> {
    match op {
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt => Some(Guard::Positive),
        UnaryOp::Exp => Some(Guard::Bounded),
        _ => None,
    }
}

/// Whether a built-in has a kink (a point where its derivative jumps).
pub(crate) fn kinked(op: UnaryOp) -> bool {
    matches!(op, UnaryOp::Relu | UnaryOp::Abs)
}

/// A numeric guard around a subexpression, printed as part of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Guard {
    /// Strictly positive, away from zero: `(softplus(e) + 0.5)`.
    Positive,
    /// Within `[-1, 1]`: `tanh(e)`.
    Bounded,
}

/// An expression of the `.cell` language.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// A non-negative number.
    Number(f64),
    /// An input, state, `let`, vector parameter, constant or function parameter.
    Name(String),
    /// A state's value at the end of the step: `h'`.
    Primed(String),
    /// Negation `-e`, printed parenthesised.
    Neg(Box<Expr>),
    /// A built-in of one argument (one of `UnaryOp::BUILTINS`).
    Unary(UnaryOp, Box<Expr>),
    /// An infix operator `a op b` (`+ - * / @`), printed parenthesised.
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// `min(a, b)` (`false`) or `max(a, b)` (`true`).
    MinMax(bool, Box<Expr>, Box<Expr>),
    /// `sum(v)` (`false`) or `mean(v)` (`true`).
    Reduce(bool, Box<Expr>),
    /// `W @ v`, `W` a matrix parameter (or a function's matrix parameter).
    MatVec(String, Box<Expr>),
    /// `v @ W`, `W` a matrix parameter: `Wᵀ v`.
    VecMat(String, Box<Expr>),
    /// `transpose(v, a, b)`: `v`'s `a x b` grid of blocks read column by column.
    Transpose(Box<Expr>, u32, u32),
    /// `concat(a, b, ...)` of vectors.
    Concat(Vec<Expr>),
    /// A call of a file function or of the prelude's `layernorm`.
    Call(String, Vec<Expr>),
    /// A subexpression wrapped in its numeric guard (see [`Guard`]).
    Guarded(Guard, Box<Expr>),
    /// `dropout(value, rate)`, or `variational_dropout(value, rate)` when
    /// `variational`: a vector masked by a rate of the cell.
    Dropout {
        /// One mask per sequence (`variational_dropout`) rather than per step.
        variational: bool,
        /// The vector masked.
        value: Box<Expr>,
        /// The cell's rate it is masked at.
        rate: String,
    },
    /// `zoneout(old, new, rate)`: each unit `new`, or `old` with probability `rate`.
    Zoneout {
        /// The value a zoned-out unit keeps (a state, as generated).
        old: Box<Expr>,
        /// The value a kept unit takes.
        new: Box<Expr>,
        /// The cell's rate of zoning out.
        rate: String,
    },
    /// `(dropconnect(param, rate) @ arg)`: a product with a matrix
    /// parameter that every product of the cell masks at `rate`.
    DropConnect {
        /// The matrix parameter masked.
        param: String,
        /// The cell's rate it is masked at.
        rate: String,
        /// The vector it multiplies.
        arg: Box<Expr>,
    },
}

impl Expr {
    /// A read of the name `n`.
    pub fn name(n: &str) -> Expr {
        Expr::Name(n.to_string())
    }

    /// The direct subexpressions.
    pub fn children(&self) -> Vec<&Expr> {
        match self {
            Expr::Number(_) | Expr::Name(_) | Expr::Primed(_) => Vec::new(),
            Expr::Neg(a)
            | Expr::Unary(_, a)
            | Expr::Reduce(_, a)
            | Expr::MatVec(_, a)
            | Expr::VecMat(_, a)
            | Expr::Transpose(a, ..)
            | Expr::Guarded(_, a)
            | Expr::Dropout { value: a, .. }
            | Expr::DropConnect { arg: a, .. } => {
                vec![a]
            }
            Expr::Binary(_, a, b) | Expr::MinMax(_, a, b) | Expr::Zoneout { old: a, new: b, .. } => {
                vec![a, b]
            }
            Expr::Concat(xs) | Expr::Call(_, xs) => xs.iter().collect(),
        }
    }

    /// The direct subexpressions, mutably.
    pub fn children_mut(&mut self) -> Vec<&mut Expr> {
        match self {
            Expr::Number(_) | Expr::Name(_) | Expr::Primed(_) => Vec::new(),
            Expr::Neg(a)
            | Expr::Unary(_, a)
            | Expr::Reduce(_, a)
            | Expr::MatVec(_, a)
            | Expr::VecMat(_, a)
            | Expr::Transpose(a, ..)
            | Expr::Guarded(_, a)
            | Expr::Dropout { value: a, .. }
            | Expr::DropConnect { arg: a, .. } => {
                vec![a]
            }
            Expr::Binary(_, a, b) | Expr::MinMax(_, a, b) | Expr::Zoneout { old: a, new: b, .. } => {
                vec![a, b]
            }
            Expr::Concat(xs) | Expr::Call(_, xs) => xs.iter_mut().collect(),
        }
    }

    /// Every node, this one first (pre-order).
    pub fn nodes(&self) -> Vec<&Expr> {
        let mut out = vec![self];
        for c in self.children() {
            out.extend(c.nodes());
        }
        out
    }

    /// The `k`-th node in pre-order.
    pub fn node_mut(&mut self, k: usize) -> Option<&mut Expr> {
        fn walk<'a>(e: &'a mut Expr, k: &mut usize) -> Option<&'a mut Expr> {
            if *k == 0 {
                return Some(e);
            }
            *k -= 1;
            for c in e.children_mut() {
                if let Some(found) = walk(c, k) {
                    return Some(found);
                }
            }
            None
        }
        let mut k = k;
        walk(self, &mut k)
    }

    /// Names read (unprimed), parameters applied by `@` included,
    /// functions called and rates masks read.
    pub fn mentions(&self, name: &str) -> bool {
        self.nodes().iter().any(|e| match e {
            Expr::Name(n) | Expr::MatVec(n, _) | Expr::VecMat(n, _) | Expr::Call(n, _) => n == name,
            Expr::Dropout { rate, .. } | Expr::Zoneout { rate, .. } => rate == name,
            Expr::DropConnect { param, rate, .. } => param == name || rate == name,
            _ => false,
        })
    }

    /// Every product of `param` through `dropconnect` made a plain `param @ v`.
    pub fn without_dropconnect(&mut self, param: &str) {
        if let Expr::DropConnect { param: p, arg, .. } = self {
            if p == param {
                *self = Expr::MatVec(p.clone(), arg.clone());
            }
        }
        for c in self.children_mut() {
            c.without_dropconnect(param);
        }
    }

    /// Whether the expression reads `state'`, the state's value at the end of the step.
    pub fn mentions_primed(&self, state: &str) -> bool {
        self.nodes().iter().any(|e| matches!(e, Expr::Primed(n) if n == state))
    }

    /// Replaces every read of `name` (or of `state'` when `primed`) by `with`.
    pub fn replace_name(&mut self, name: &str, primed: bool, with: &Expr) {
        let hit = match self {
            Expr::Name(n) => !primed && n == name,
            Expr::Primed(n) => primed && n == name,
            _ => false,
        };
        if hit {
            *self = with.clone();
            return;
        }
        for c in self.children_mut() {
            c.replace_name(name, primed, with);
        }
    }
}

/// Formats a number so the lexer reads it back (`0.5`, `2`, never `.5`).
fn number(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e6 {
        format!("{}", x as i64)
    } else {
        format!("{x}")
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Number(x) => write!(f, "{}", number(*x)),
            Expr::Name(n) => write!(f, "{n}"),
            Expr::Primed(n) => write!(f, "{n}'"),
            Expr::Neg(a) => write!(f, "(-{a})"),
            Expr::Unary(u, a) => write!(f, "{}({a})", u.name()),
            Expr::Binary(op, a, b) => write!(f, "({a} {} {b})", op.symbol()),
            Expr::MinMax(max, a, b) => write!(f, "{}({a}, {b})", if *max { "max" } else { "min" }),
            Expr::Reduce(mean, a) => write!(f, "{}({a})", if *mean { "mean" } else { "sum" }),
            Expr::MatVec(w, a) => write!(f, "({w} @ {a})"),
            Expr::VecMat(w, a) => write!(f, "({a} @ {w})"),
            Expr::Transpose(a, rows, cols) => write!(f, "transpose({a}, {rows}, {cols})"),
            Expr::Concat(xs) => write!(f, "concat({})", list(xs)),
            Expr::Call(name, xs) => write!(f, "{name}({})", list(xs)),
            Expr::Guarded(Guard::Positive, a) => write!(f, "(softplus({a}) + 0.5)"),
            Expr::Guarded(Guard::Bounded, a) => write!(f, "tanh({a})"),
            Expr::Dropout { variational, value, rate } => {
                let function = if *variational { "variational_dropout" } else { "dropout" };
                write!(f, "{function}({value}, {rate})")
            }
            Expr::Zoneout { old, new, rate } => write!(f, "zoneout({old}, {new}, {rate})"),
            Expr::DropConnect { param, rate, arg } => write!(f, "(dropconnect({param}, {rate}) @ {arg})"),
        }
    }
}

fn list(xs: &[Expr]) -> String {
    xs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

/// A parameter's initialiser.
#[derive(Clone, Debug, PartialEq)]
pub enum Init {
    /// None: `uniform(1/sqrt(D))`, `D` the first state's size.
    Default,
    /// `= zeros`.
    Zeros,
    /// `= ones`.
    Ones,
    /// `= uniform(bound)`: uniform in `[-bound, bound]`.
    Uniform(Scale),
    /// `= constant(c)`: every element `c`.
    Constant(Scale),
}

/// The constant expression of an initialiser.
#[derive(Clone, Debug, PartialEq)]
pub enum Scale {
    /// A literal number.
    Number(f64),
    /// `1 / sqrt(V)`, `V` the cell's first size variable.
    InverseSqrtSize,
    /// `K / V`, a constant over the cell's first size variable.
    ConstOverSize(String),
    /// `min(K, 0.5)`.
    MinConst(String),
}

impl Scale {
    fn text(&self, size: &str) -> String {
        match self {
            Scale::Number(x) => number(*x),
            Scale::InverseSqrtSize => format!("1 / sqrt({size})"),
            Scale::ConstOverSize(k) => format!("{k} / {size}"),
            Scale::MinConst(k) => format!("min({k}, 0.5)"),
        }
    }

    /// The constant it reads, if any.
    pub fn constant(&self) -> Option<&str> {
        match self {
            Scale::ConstOverSize(k) | Scale::MinConst(k) => Some(k),
            _ => None,
        }
    }
}

/// A `param` declaration: a vector or matrix parameter and its initialiser.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// The parameter's name.
    pub name: String,
    /// Its length (a vector) or number of rows (a matrix).
    pub rows: Size,
    /// `Some` for a matrix `[rows, cols]`.
    pub cols: Option<Size>,
    /// A matrix's heads: 1, or `k` blocks `[rows/k, cols/k]` on the
    /// diagonal, declared `[k, rows/k, cols/k]` (`rows` and `cols` are
    /// then the sizes of `W @ v` and `v`).
    pub heads: u32,
    /// How it is initialised (the `= ...` after the shape).
    pub init: Init,
}

/// A file-level function.
#[derive(Clone, Debug, PartialEq)]
pub struct FnDef {
    /// The function's name (`f1`, `g2`, ...: `g` when `matrix`).
    pub name: String,
    /// Its parameters; with `matrix`, the first is a matrix applied to the second.
    pub params: Vec<String>,
    /// Whether its first parameter is a matrix applied with `@` to its second.
    pub matrix: bool,
    /// Its `let name = value;` lines, in order.
    pub lets: Vec<(String, Expr)>,
    /// The expression the function returns.
    pub body: Expr,
}

/// A statement of the cell body.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// `let a = e`, or `let a, b = chunk(e, 2)` with several names.
    Let {
        /// The names bound: one, or `k` for `chunk(e, k)`.
        names: Vec<String>,
        /// The value bound (the chunked vector when there are several names).
        value: Expr,
    },
    /// `h' = e`.
    Assign {
        /// The state assigned (without the prime).
        state: String,
        /// Its value at the end of the step.
        value: Expr,
    },
    /// `output e`: the step's output.
    Output(Expr),
}

impl Stmt {
    /// The statement's value: what it binds, assigns or outputs.
    pub fn value(&self) -> &Expr {
        match self {
            Stmt::Let { value, .. } | Stmt::Assign { value, .. } | Stmt::Output(value) => value,
        }
    }

    /// The statement's value, mutably.
    pub fn value_mut(&mut self) -> &mut Expr {
        match self {
            Stmt::Let { value, .. } | Stmt::Assign { value, .. } | Stmt::Output(value) => value,
        }
    }
}

/// A whole `.cell` file with one cell.
#[derive(Clone, Debug, PartialEq)]
pub struct CellSpec {
    /// The cell's name, as in `cell NAME { ... }`.
    pub name: String,
    /// File-level `const NAME = value` lines.
    pub consts: Vec<(String, f64)>,
    /// File-level functions, printed before the cell.
    pub fns: Vec<FnDef>,
    /// `input` declarations: name and size.
    pub inputs: Vec<(String, Size)>,
    /// `state` declarations: name and size.
    pub states: Vec<(String, Size)>,
    /// `param` declarations.
    pub params: Vec<Param>,
    /// `rate` declarations: name and default (in `[0, 1)`).
    pub rates: Vec<(String, f64)>,
    /// The body's statements, in order.
    pub stmts: Vec<Stmt>,
}

impl CellSpec {
    /// The size variables the cell mentions, in order.
    pub fn size_variables(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let sizes = self
            .inputs
            .iter()
            .map(|(_, s)| s)
            .chain(self.states.iter().map(|(_, s)| s))
            .chain(self.params.iter().flat_map(|p| std::iter::once(&p.rows).chain(p.cols.as_ref())));
        for s in sizes {
            for v in s.0.keys() {
                if !out.contains(v) {
                    out.push(v.clone());
                }
            }
        }
        out
    }

    /// The type of `e` where the cell's names (and `lets` bound so far)
    /// are visible; `None` if it reads a name it cannot type.
    pub fn type_of(&self, e: &Expr, lets: &BTreeMap<String, Ty>) -> Option<Ty> {
        let vector = |s: &Size| Some(Ty::Vector(s.clone()));
        match e {
            Expr::Number(_) => Some(Ty::Scalar),
            Expr::Name(n) => {
                if let Some(t) = lets.get(n) {
                    return Some(t.clone());
                }
                if self.consts.iter().any(|(c, _)| c == n) {
                    return Some(Ty::Scalar);
                }
                if let Some((_, s)) = self.inputs.iter().chain(&self.states).find(|(m, _)| m == n) {
                    return vector(s);
                }
                self.params.iter().find(|p| &p.name == n && p.cols.is_none()).and_then(|p| vector(&p.rows))
            }
            Expr::Primed(n) => self.states.iter().find(|(m, _)| m == n).and_then(|(_, s)| vector(s)),
            Expr::Neg(a) | Expr::Unary(_, a) | Expr::Guarded(_, a) | Expr::Dropout { value: a, .. } => {
                self.type_of(a, lets)
            }
            Expr::Zoneout { old, new, .. } => {
                let ty = self.type_of(new, lets)?;
                (self.type_of(old, lets)? == ty).then_some(ty)
            }
            Expr::DropConnect { param, .. } => {
                self.params.iter().find(|p| &p.name == param).and_then(|p| vector(&p.rows))
            }
            Expr::Binary(_, a, b) | Expr::MinMax(_, a, b) => {
                match (self.type_of(a, lets)?, self.type_of(b, lets)?) {
                    (Ty::Scalar, t) | (t, Ty::Scalar) => Some(t),
                    (x, y) if x == y => Some(x),
                    _ => None,
                }
            }
            Expr::Reduce(_, a) => self.type_of(a, lets).map(|_| Ty::Scalar),
            Expr::MatVec(w, _) => self.params.iter().find(|p| &p.name == w).and_then(|p| vector(&p.rows)),
            Expr::VecMat(w, _) => {
                self.params.iter().find(|p| &p.name == w).and_then(|p| p.cols.as_ref()).and_then(vector)
            }
            Expr::Transpose(a, ..) => self.type_of(a, lets),
            Expr::Concat(xs) => {
                let mut total = Size(BTreeMap::new());
                for x in xs {
                    match self.type_of(x, lets)? {
                        Ty::Vector(s) => total = total.plus(&s),
                        Ty::Scalar => return None,
                    }
                }
                Some(Ty::Vector(total))
            }
            Expr::Call(name, args) => {
                let f = self.fns.iter().find(|f| &f.name == name);
                match f {
                    // `g(W, v, ...)`: the rows of W.
                    Some(f) if f.matrix => match args.first() {
                        Some(Expr::Name(w)) => {
                            self.params.iter().find(|p| &p.name == w).and_then(|p| vector(&p.rows))
                        }
                        _ => None,
                    },
                    // Elementwise functions and `layernorm`: the first vector argument's type.
                    _ => {
                        let tys: Vec<Ty> =
                            args.iter().map(|a| self.type_of(a, lets)).collect::<Option<_>>()?;
                        Some(tys.iter().find(|t| matches!(t, Ty::Vector(_))).cloned().unwrap_or(Ty::Scalar))
                    }
                }
            }
        }
    }

    /// The types of the `let`s bound before statement `k`.
    pub fn lets_before(&self, k: usize) -> BTreeMap<String, Ty> {
        let mut lets = BTreeMap::new();
        for st in &self.stmts[..k.min(self.stmts.len())] {
            if let Stmt::Let { names, value } = st {
                match self.type_of(value, &lets) {
                    Some(Ty::Vector(s)) if names.len() > 1 => {
                        let k = names.len() as u32;
                        let part = Size(s.0.iter().map(|(v, c)| (v.clone(), c / k)).collect());
                        for n in names {
                            lets.insert(n.clone(), Ty::Vector(part.clone()));
                        }
                    }
                    Some(t) => {
                        for n in names {
                            lets.insert(n.clone(), t.clone());
                        }
                    }
                    None => {}
                }
            }
        }
        lets
    }

    /// Whether any expression of the cell (or of a function, or an initialiser) reads `name`.
    pub fn uses(&self, name: &str) -> bool {
        let in_init = |i: &Init| match i {
            Init::Uniform(s) | Init::Constant(s) => s.constant() == Some(name),
            _ => false,
        };
        if self.params.iter().any(|p| in_init(&p.init)) {
            return true;
        }
        self.stmts.iter().any(|st| match st {
            Stmt::Let { value, .. } | Stmt::Assign { value, .. } | Stmt::Output(value) => {
                value.mentions(name)
            }
        }) || self.fns.iter().any(|f| f.body.mentions(name) || f.lets.iter().any(|(_, e)| e.mentions(name)))
    }

    /// The values of the statements of the cell's body, in order.
    pub fn stmt_values(&self) -> impl Iterator<Item = &Expr> {
        self.stmts.iter().map(Stmt::value)
    }

    /// The matrix parameters applied through `dropconnect`, each with its rate.
    pub fn dropconnected(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for e in self.stmt_values().flat_map(Expr::nodes) {
            if let Expr::DropConnect { param, rate, .. } = e {
                if !out.iter().any(|(p, _)| p == param) {
                    out.push((param.clone(), rate.clone()));
                }
            }
        }
        out
    }

    /// Whether the cell uses relu, abs, min or max, whose derivatives jump.
    pub fn has_kinks(&self) -> bool {
        let kinked = |e: &Expr| {
            e.nodes()
                .iter()
                .any(|n| matches!(n, Expr::MinMax(..)) || matches!(n, Expr::Unary(u, _) if kinked(*u)))
        };
        self.stmts.iter().any(|st| match st {
            Stmt::Let { value, .. } | Stmt::Assign { value, .. } | Stmt::Output(value) => kinked(value),
        }) || self.fns.iter().any(|f| kinked(&f.body) || f.lets.iter().any(|(_, e)| kinked(e)))
    }
}

impl fmt::Display for CellSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, value) in &self.consts {
            writeln!(f, "const {name} = {}", number(*value))?;
        }
        for func in &self.fns {
            writeln!(f, "fn {}({}) {{", func.name, func.params.join(", "))?;
            for (name, value) in &func.lets {
                writeln!(f, "    let {name} = {value};")?;
            }
            writeln!(f, "    {}", func.body)?;
            writeln!(f, "}}")?;
        }
        writeln!(f, "cell {} {{", self.name)?;
        let vars = |xs: &[(String, Size)]| {
            xs.iter().map(|(n, s)| format!("{n}[{s}]")).collect::<Vec<_>>().join(", ")
        };
        if !self.inputs.is_empty() {
            writeln!(f, "    input {}", vars(&self.inputs))?;
        }
        if !self.states.is_empty() {
            writeln!(f, "    state {}", vars(&self.states))?;
        }
        for p in &self.params {
            let shape = match &p.cols {
                Some(c) if p.heads > 1 => {
                    format!("{}, {}, {}", p.heads, p.rows.over(p.heads), c.over(p.heads))
                }
                Some(c) => format!("{}, {c}", p.rows),
                None => p.rows.to_string(),
            };
            let size = self.size_variables().into_iter().next().unwrap_or_else(|| "1".into());
            let init = match &p.init {
                Init::Default => String::new(),
                Init::Zeros => " = zeros".into(),
                Init::Ones => " = ones".into(),
                Init::Uniform(b) => format!(" = uniform({})", b.text(&size)),
                Init::Constant(c) => format!(" = constant({})", c.text(&size)),
            };
            writeln!(f, "    param {}[{shape}]{init}", p.name)?;
        }
        if !self.rates.is_empty() {
            let rates: Vec<String> =
                self.rates.iter().map(|(name, default)| format!("{name} = {}", number(*default))).collect();
            writeln!(f, "    rate {}", rates.join(", "))?;
        }
        for st in &self.stmts {
            match st {
                Stmt::Let { names, value } if names.len() > 1 => {
                    writeln!(f, "    let {} = chunk({value}, {})", names.join(", "), names.len())?
                }
                Stmt::Let { names, value } => writeln!(f, "    let {} = {value}", names.join(", "))?,
                Stmt::Assign { state, value } => writeln!(f, "    {state}' = {value}")?,
                Stmt::Output(value) => writeln!(f, "    output {value}")?,
            }
        }
        writeln!(f, "}}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_split_and_print() {
        let s = Size::var("H").times(2).plus(&Size::var("P"));
        assert_eq!(s.to_string(), "2*H + P");
        let splits: Vec<String> = s.splits().iter().map(|(a, b)| format!("{a} | {b}")).collect();
        assert_eq!(splits, ["H | H + P", "2*H | P", "P | 2*H", "H + P | H"]);
        assert!(Size::var("H").times(4).divisible_by(2));
        assert!(!s.divisible_by(2));
        assert!(Size::var("H").splits().is_empty());
    }

    #[test]
    fn guards_print_inside_their_node() {
        let e =
            Expr::Unary(UnaryOp::Log, Box::new(Expr::Guarded(Guard::Positive, Box::new(Expr::name("h")))));
        assert_eq!(e.to_string(), "log((softplus(h) + 0.5))");
        assert_eq!(Expr::Number(0.25).to_string(), "0.25");
        assert_eq!(Expr::Number(2.0).to_string(), "2");
    }

    #[test]
    fn masks_print_as_calls_and_dropconnect_comes_off_every_product_at_once() {
        let product = |v: &str| Expr::DropConnect {
            param: "w1".into(),
            rate: "r1".into(),
            arg: Box::new(Expr::name(v)),
        };
        let dropped = Expr::Dropout { variational: true, value: Box::new(product("x")), rate: "r2".into() };
        let mut e =
            Expr::Zoneout { old: Box::new(Expr::name("h")), new: Box::new(dropped), rate: "r1".into() };
        assert_eq!(e.to_string(), "zoneout(h, variational_dropout((dropconnect(w1, r1) @ x), r2), r1)");
        assert!(e.mentions("r1") && e.mentions("r2") && e.mentions("w1"));
        e.without_dropconnect("w1");
        assert_eq!(e.to_string(), "zoneout(h, variational_dropout((w1 @ x), r2), r1)");
    }
}
