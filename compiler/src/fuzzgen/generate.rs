//! The random cell generator: type-directed, so every cell it writes is
//! valid, and shaped after real RNN cells so the cells exercise what the
//! back ends must get right.
//!
//! Each expression is generated for a required type. A vector of size `D`
//! is a name of that size, an elementwise function of vectors of size `D`
//! (or of one and a scalar), `W @ v` with a matrix parameter `[D, X]`
//! made or reused for it, a `concat` of two sizes that add up to `D`, a
//! call of a file function or of `layernorm`; a scalar is a number, a
//! constant, a `sum`/`mean`, or arithmetic on scalars. Parameters are
//! declared as the expressions need them.
//!
//! A cell is either a **product recurrence** (some state goes through a
//! matrix product every step, with per-step products of pointwise values
//! and chains of two dependent products) or an **elementwise recurrence**
//! (no product reads a state: the whole-sequence path). Domains and ranges
//! are guarded ([`Guard`]): `log`, `sqrt`, `rsqrt` and divisors see
//! `softplus(e) + 0.5`, `exp` sees `tanh(e)`; state updates are mostly
//! bounded (`tanh`, gates, LayerNorm), as in real cells, so that f32 back
//! ends and an f64 oracle can be compared at a fixed tolerance.
//!
//! Once a cell is written, three cells in ten get masks: one or two
//! `rate`s, and mask calls wrapped around values the cell computes
//! (`dropout`/`variational_dropout` of vectors, `zoneout` of a state's
//! update, `dropconnect` of matrix parameters no function is given). The
//! masks are drawn last, so the rest of a seed's cell does not depend on them.

use super::spec::{guard_for, BinOp, CellSpec, Expr, FnDef, Guard, Init, Param, Scale, Size, Stmt, Ty};
use super::Entropy;
use crate::ir::UnaryOp;
use std::collections::BTreeMap;

/// A value visible to the expression being generated.
#[derive(Clone, Debug)]
struct Value {
    expr: Expr,
    ty: Ty,
    /// Depends on a state (so a product of it runs every step).
    dynamic: bool,
}

struct Gen<'a, 'e> {
    rng: &'a mut Entropy<'e>,
    spec: CellSpec,
    env: Vec<Value>,
    /// Sizes that vectors in scope have (matrix columns are drawn from them).
    sizes: Vec<Size>,
    /// Whether state-dependent vectors may be multiplied by a matrix.
    step_products: bool,
    /// Generating a function body: no parameters, no calls.
    in_fn: bool,
    counter: usize,
}

const NUMBERS: [f64; 7] = [0.5, 1.0, 2.0, 0.25, 1.5, 3.0, 0.1];

/// Defaults of generated rates.
const RATES: [f64; 5] = [0.1, 0.2, 0.25, 0.3, 0.5];

/// Writes a random valid cell named `name`.
pub fn generate(rng: &mut Entropy, name: &str) -> CellSpec {
    let spec = CellSpec {
        name: name.to_string(),
        consts: Vec::new(),
        fns: Vec::new(),
        inputs: Vec::new(),
        states: Vec::new(),
        params: Vec::new(),
        rates: Vec::new(),
        stmts: Vec::new(),
    };
    let mut g =
        Gen { rng, spec, env: Vec::new(), sizes: Vec::new(), step_products: false, in_fn: false, counter: 0 };
    g.cell();
    g.spec
}

impl Gen<'_, '_> {
    fn fresh(&mut self, prefix: &str) -> String {
        self.counter += 1;
        format!("{prefix}{}", self.counter)
    }

    fn add_size(&mut self, s: &Size) {
        if !self.sizes.contains(s) {
            self.sizes.push(s.clone());
        }
    }

    fn bind(&mut self, expr: Expr, ty: Ty, dynamic: bool) {
        if let Ty::Vector(s) = &ty {
            self.add_size(s);
        }
        self.env.push(Value { expr, ty, dynamic });
    }

    fn cell(&mut self) {
        // Size variables: H, and up to two more for states of other sizes.
        let mut vars = vec![Size::var("H")];
        for extra in ["P", "Q"] {
            if self.rng.chance(1, 3) {
                vars.push(Size::var(extra));
            }
        }
        let state_sizes: Vec<Size> = {
            let mut choices = vars.clone();
            choices.push(Size::var("H").times(2));
            if vars.len() > 1 {
                choices.push(vars[0].plus(&vars[1]));
            }
            choices
        };
        // Constants and functions first: they are file items.
        for k in 0..self.rng.below(3) {
            let value = *self.rng.pick(&NUMBERS);
            self.spec.consts.push((format!("K{k}"), value));
        }
        for _ in 0..self.rng.below(3) {
            let f = self.function();
            self.spec.fns.push(f);
        }
        // Inputs: x[I], an input tied to the hidden size, or two inputs.
        let inputs: Vec<(String, Size)> = match self.rng.below(10) {
            0 => vec![("x".into(), Size::var("H"))],
            1 | 2 => vec![("x".into(), Size::var("I")), ("y".into(), Size::var("J"))],
            _ => vec![("x".into(), Size::var("I"))],
        };
        for (n, s) in &inputs {
            self.bind(Expr::name(n), Ty::Vector(s.clone()), false);
        }
        self.spec.inputs = inputs;
        let names = ["h", "c", "m"];
        let count = 1 + self.rng.below(3);
        for name in &names[..count] {
            let size = self.rng.pick(&state_sizes).clone();
            self.spec.states.push((name.to_string(), size.clone()));
            self.bind(Expr::name(name), Ty::Vector(size), true);
        }
        self.step_products = self.rng.chance(3, 5);

        // Lets before the updates, a chunked one among them sometimes.
        for _ in 0..1 + self.rng.below(3) {
            self.let_statement();
        }
        if self.rng.chance(1, 2) {
            self.chunk_statement();
        }
        // State updates in a random order, lets between them.
        let mut order: Vec<usize> = (0..count).collect();
        self.rng.shuffle(&mut order);
        for (k, &i) in order.iter().enumerate() {
            let (state, size) = self.spec.states[i].clone();
            let value = self.update(&state, &size, k == 0 && self.step_products);
            self.spec.stmts.push(Stmt::Assign { state: state.clone(), value });
            self.bind(Expr::Primed(state), Ty::Vector(size), true);
            if self.rng.chance(1, 3) {
                self.let_statement();
            }
        }
        let output = self.output();
        self.spec.stmts.push(Stmt::Output(output));
        self.masks();
    }

    /// In three cells of ten (never once a fuzzer's bytes run out), one
    /// or two rates and masks at them: some matrix parameters applied
    /// through `dropconnect`, maybe a state's update zoned out, and one to
    /// three vectors dropped out.
    fn masks(&mut self) {
        if self.rng.below(10) < 7 {
            return;
        }
        let rates: Vec<String> = (0..1 + self.rng.below(2)).map(|_| self.rate()).collect();
        self.dropconnect(&rates);
        if self.rng.chance(1, 2) {
            self.zoneout(&rates);
        }
        for _ in 0..1 + self.rng.below(3) {
            self.dropout(&rates);
        }
    }

    /// A new `rate` with a default drawn from [`RATES`].
    fn rate(&mut self) -> String {
        let name = self.fresh("r");
        let default = *self.rng.pick(&RATES);
        self.spec.rates.push((name.clone(), default));
        name
    }

    /// Each matrix parameter that only products read (none is given to a
    /// function, where masks may not be) goes through `dropconnect` at one
    /// rate, in every product, with probability 1/3.
    fn dropconnect(&mut self, rates: &[String]) {
        // Passed to a function, or read as `v @ W`: `dropconnect` masks `W @ v` only.
        let passed = |spec: &CellSpec, w: &str| {
            spec.stmt_values().flat_map(Expr::nodes).any(|e| match e {
                Expr::Name(n) | Expr::VecMat(n, _) => n == w,
                _ => false,
            })
        };
        let matrices: Vec<String> = self
            .spec
            .params
            .iter()
            .filter(|p| p.cols.is_some() && !passed(&self.spec, &p.name))
            .map(|p| p.name.clone())
            .collect();
        for w in matrices {
            if !self.rng.chance(1, 3) {
                continue;
            }
            let rate = self.rng.pick(rates).clone();
            for st in &mut self.spec.stmts {
                mask_products(st.value_mut(), &w, &rate);
            }
        }
    }

    /// One state's update `s' = e` becomes `s' = zoneout(s, e, p)`.
    fn zoneout(&mut self, rates: &[String]) {
        let updates: Vec<usize> = (0..self.spec.stmts.len())
            .filter(|&i| matches!(self.spec.stmts[i], Stmt::Assign { .. }))
            .collect();
        if updates.is_empty() {
            return;
        }
        let i = *self.rng.pick(&updates);
        let rate = self.rng.pick(rates).clone();
        if let Stmt::Assign { state, value } = &mut self.spec.stmts[i] {
            let new = Box::new(std::mem::replace(value, Expr::Number(0.0)));
            *value = Expr::Zoneout { old: Box::new(Expr::name(state)), new, rate };
        }
    }

    /// One vector the cell computes (not a guard, which must stay
    /// outermost to keep its domain) wrapped in `dropout` or
    /// `variational_dropout`.
    fn dropout(&mut self, rates: &[String]) {
        let mut sites = Vec::new();
        for i in 0..self.spec.stmts.len() {
            let lets = self.spec.lets_before(i);
            let nodes = self.spec.stmts[i].value().nodes();
            for (k, node) in nodes.iter().enumerate() {
                if droppable(&self.spec, node, &lets) {
                    sites.push((i, k));
                }
            }
        }
        if sites.is_empty() {
            return;
        }
        let (i, k) = *self.rng.pick(&sites);
        let variational = self.rng.chance(1, 2);
        let rate = self.rng.pick(rates).clone();
        if let Some(node) = self.spec.stmts[i].value_mut().node_mut(k) {
            let value = Box::new(std::mem::replace(node, Expr::Number(0.0)));
            *node = Expr::Dropout { variational, value, rate };
        }
    }

    /// A file function: elementwise over its arguments, or `g(W, v, a)`
    /// built around `W @ v`.
    fn function(&mut self) -> FnDef {
        let saved = (std::mem::take(&mut self.env), std::mem::take(&mut self.sizes), self.in_fn);
        self.in_fn = true;
        let t = Size::var("T");
        let matrix = self.rng.chance(1, 3);
        let mut params = Vec::new();
        if matrix {
            params.extend(["w".to_string(), "v".to_string()]);
            self.bind(Expr::MatVec("w".into(), Box::new(Expr::name("v"))), Ty::Vector(t.clone()), false);
        }
        for k in 0..1 + self.rng.below(2) {
            let p = format!("a{k}");
            self.bind(Expr::name(&p), Ty::Vector(t.clone()), false);
            params.push(p);
        }
        let mut lets = Vec::new();
        if self.rng.chance(1, 2) {
            let value = self.vector(&t, 2, true);
            lets.push(("t".to_string(), value));
            self.bind(Expr::name("t"), Ty::Vector(t.clone()), false);
        }
        let body = self.vector(&t, 2, true);
        let name = self.fresh(if matrix { "g" } else { "f" });
        (self.env, self.sizes, self.in_fn) = saved;
        FnDef { name, params, matrix, lets, body }
    }

    fn let_statement(&mut self) {
        let ty = if self.rng.chance(1, 6) {
            Ty::Scalar
        } else {
            Ty::Vector(self.rng.pick(&self.sizes.clone()).clone())
        };
        let value = self.expr(&ty, 2, true);
        let dynamic = self.is_dynamic(&value);
        let name = self.fresh("l");
        self.spec.stmts.push(Stmt::Let { names: vec![name.clone()], value });
        self.bind(Expr::name(&name), ty, dynamic);
    }

    /// `let a, b = chunk(e, k)`: `e` of size `k * D`, usually a product
    /// with a `[k*D, X]` matrix, as an LSTM's gates are.
    fn chunk_statement(&mut self) {
        let k = 2 + self.rng.below(3) as u32;
        let part = self.rng.pick(&self.sizes.clone()).clone();
        let value = self.vector(&part.times(k), 2, true);
        let dynamic = self.is_dynamic(&value);
        let names: Vec<String> = (0..k).map(|_| self.fresh("g")).collect();
        self.spec.stmts.push(Stmt::Let { names: names.clone(), value });
        for n in names {
            self.bind(Expr::name(&n), Ty::Vector(part.clone()), dynamic);
        }
    }

    /// A state update, bounded most of the time as real cells are; with
    /// `product`, it contains a per-step product of the state (sometimes
    /// a chain of two).
    fn update(&mut self, state: &str, size: &Size, product: bool) -> Expr {
        let mut core = self.vector(size, 2, true);
        if product {
            let inner = self.pointwise_of_states(2);
            let p = if self.rng.chance(1, 3) {
                // A chain of two dependent per-step products: W2 @ f(W1 @ inner).
                let mid = self.rng.pick(&self.sizes.clone()).clone();
                let first = self.product_of(&mid, inner);
                let between = unary(*self.rng.pick(&UnaryOp::BUILTINS), first);
                self.product_of(size, between)
            } else {
                self.product_of(size, inner)
            };
            core = Expr::Binary(BinOp::Add, Box::new(core), Box::new(p));
        }
        let gate = |g: &mut Self| {
            let e = g.vector(size, 1, true);
            Expr::Unary(UnaryOp::Sigmoid, Box::new(e))
        };
        match self.rng.below(10) {
            0..=2 => Expr::Unary(UnaryOp::Tanh, Box::new(core)),
            3 | 4 => {
                // A gated mix: z * s + (1 - z) * tanh(core).
                let z = gate(self);
                let keep = Expr::Binary(BinOp::Mul, Box::new(z.clone()), Box::new(Expr::name(state)));
                let one_minus = Expr::Binary(BinOp::Sub, Box::new(Expr::Number(1.0)), Box::new(z));
                let new = Expr::Binary(
                    BinOp::Mul,
                    Box::new(one_minus),
                    Box::new(Expr::Unary(UnaryOp::Tanh, Box::new(core))),
                );
                Expr::Binary(BinOp::Add, Box::new(keep), Box::new(new))
            }
            5 | 6 => {
                // LSTM's cell: f * s + i * tanh(core).
                let (f, i) = (gate(self), gate(self));
                let keep = Expr::Binary(BinOp::Mul, Box::new(f), Box::new(Expr::name(state)));
                let new = Expr::Binary(
                    BinOp::Mul,
                    Box::new(i),
                    Box::new(Expr::Unary(UnaryOp::Tanh, Box::new(core))),
                );
                Expr::Binary(BinOp::Add, Box::new(keep), Box::new(new))
            }
            7 if !self.in_fn => self.layernorm(core, size),
            _ => core,
        }
    }

    /// A pointwise function of some state (and maybe the input).
    fn pointwise_of_states(&mut self, depth: u32) -> Expr {
        let states: Vec<Value> = self
            .env
            .iter()
            .filter(|v| {
                v.dynamic
                    && matches!(v.ty, Ty::Vector(_))
                    && matches!(v.expr, Expr::Name(_) | Expr::Primed(_))
            })
            .cloned()
            .collect();
        let base = self.rng.pick(&states).clone();
        let Ty::Vector(size) = &base.ty else { return base.expr };
        match self.rng.below(3) {
            0 => base.expr,
            _ => {
                let other = self.vector(size, depth - 1, true);
                let op = *self.rng.pick(&[BinOp::Mul, BinOp::Add, BinOp::Sub]);
                Expr::Binary(op, Box::new(base.expr), Box::new(other))
            }
        }
    }

    /// `W @ v` with `W` of `rows` rows (made or reused for `v`'s size).
    fn product_of(&mut self, rows: &Size, v: Expr) -> Expr {
        let lets = self.spec.lets_before(self.spec.stmts.len());
        let cols = match self.spec.type_of(&v, &lets) {
            Some(Ty::Vector(s)) => s,
            _ => rows.clone(),
        };
        let w = self.matrix(rows, &cols);
        Expr::MatVec(w, Box::new(v))
    }

    fn layernorm(&mut self, v: Expr, size: &Size) -> Expr {
        let gain = self.vector_param(size, Some(Init::Ones));
        let bias = self.vector_param(size, Some(Init::Zeros));
        Expr::Call("layernorm".into(), vec![v, Expr::name(&gain), Expr::name(&bias)])
    }

    /// The output: a state, a function of states and inputs, or a product of a state.
    fn output(&mut self) -> Expr {
        let states: Vec<(String, Size)> = self.spec.states.clone();
        let (name, size) = self.rng.pick(&states).clone();
        match self.rng.below(10) {
            0..=2 => Expr::Primed(name),
            3 => Expr::name(&name),
            4..=6 => {
                let size = self.rng.pick(&self.sizes.clone()).clone();
                self.vector(&size, 2, true)
            }
            _ => {
                // `v @ s'` or `v @ f(s')`, to a size of its own or an existing one.
                let rows = if self.rng.chance(1, 2) { Size::var("O") } else { size.clone() };
                let arg = if self.rng.chance(1, 2) {
                    Expr::Primed(name)
                } else {
                    let other = self.vector(&size, 1, true);
                    Expr::Binary(BinOp::Mul, Box::new(Expr::Primed(name)), Box::new(other))
                };
                let w = self.matrix(&rows, &size);
                Expr::MatVec(w, Box::new(arg))
            }
        }
    }

    fn is_dynamic(&self, e: &Expr) -> bool {
        e.nodes().iter().any(|n| match n {
            Expr::Primed(_) => true,
            Expr::Name(name) => {
                self.env.iter().any(|v| v.dynamic && matches!(&v.expr, Expr::Name(m) if m == name))
            }
            _ => false,
        })
    }

    fn expr(&mut self, ty: &Ty, depth: u32, dynamic_ok: bool) -> Expr {
        match ty {
            Ty::Scalar => self.scalar(depth, dynamic_ok),
            Ty::Vector(s) => self.vector(s, depth, dynamic_ok),
        }
    }

    fn leaves(&self, ty: &Ty, dynamic_ok: bool) -> Vec<Expr> {
        self.env
            .iter()
            .filter(|v| &v.ty == ty && (dynamic_ok || !v.dynamic))
            .map(|v| v.expr.clone())
            .collect()
    }

    /// A vector of `size` with nothing nested: a name, or a parameter or
    /// product made for it.
    fn vector_leaf(&mut self, size: &Size, dynamic_ok: bool) -> Expr {
        let leaves = self.leaves(&Ty::Vector(size.clone()), dynamic_ok);
        if !leaves.is_empty() && (self.in_fn || self.rng.chance(4, 5)) {
            return self.rng.pick(&leaves).clone();
        }
        if self.in_fn {
            // Every function value has the argument size.
            return self.rng.pick(&self.leaves(&Ty::Vector(size.clone()), true)).clone();
        }
        if self.rng.chance(1, 2) {
            let b = self.vector_param(size, None);
            return Expr::name(&b);
        }
        // A product of some vector in scope.
        let others: Vec<Value> = self
            .env
            .iter()
            .filter(|v| matches!(v.ty, Ty::Vector(_)) && (dynamic_ok && self.step_products || !v.dynamic))
            .cloned()
            .collect();
        match others.is_empty() {
            true => {
                let b = self.vector_param(size, None);
                Expr::name(&b)
            }
            false => {
                let v = self.rng.pick(&others).clone();
                let Ty::Vector(cols) = &v.ty else { return v.expr };
                let w = self.matrix(size, cols);
                Expr::MatVec(w, Box::new(v.expr))
            }
        }
    }

    fn vector(&mut self, size: &Size, depth: u32, dynamic_ok: bool) -> Expr {
        if depth == 0 {
            return self.vector_leaf(size, dynamic_ok);
        }
        let d = depth - 1;
        let products_ok = !self.in_fn;
        loop {
            match self.rng.below(29) {
                0..=4 => return self.vector_leaf(size, dynamic_ok),
                5..=7 => {
                    let u = *self.rng.pick(&UnaryOp::BUILTINS);
                    let arg = self.vector(size, d, dynamic_ok);
                    return unary(u, arg);
                }
                8..=10 => {
                    let op = *self.rng.pick(&[BinOp::Add, BinOp::Sub, BinOp::Mul, BinOp::Div]);
                    let a = self.vector(size, d, dynamic_ok);
                    let b = self.vector(size, d, dynamic_ok);
                    return binary(op, a, b);
                }
                11 | 12 => {
                    let op = *self.rng.pick(&[BinOp::Add, BinOp::Sub, BinOp::Mul, BinOp::Div]);
                    let a = self.vector(size, d, dynamic_ok);
                    let b = self.scalar(d, dynamic_ok);
                    return if self.rng.chance(1, 2) || op == BinOp::Div {
                        binary(op, a, b)
                    } else {
                        binary(op, b, a)
                    };
                }
                13 => {
                    let a = self.vector(size, d, dynamic_ok);
                    let b = self.vector(size, d, dynamic_ok);
                    return min_max(self.rng.chance(1, 2), a, b);
                }
                14 => return Expr::Neg(Box::new(self.vector(size, d, dynamic_ok))),
                15..=17 if products_ok => {
                    let cols = self.rng.pick(&self.sizes.clone()).clone();
                    let arg = self.vector(&cols, d, dynamic_ok && self.step_products);
                    let w = self.matrix(size, &cols);
                    return Expr::MatVec(w, Box::new(arg));
                }
                18 | 19 if products_ok => {
                    let splits = size.splits();
                    if splits.is_empty() {
                        continue;
                    }
                    let (a, b) = self.rng.pick(&splits).clone();
                    let (a, b) = (self.vector(&a, d, dynamic_ok), self.vector(&b, d, dynamic_ok));
                    return Expr::Concat(vec![a, b]);
                }
                20 | 21 if products_ok && !self.spec.fns.is_empty() => {
                    let f = self.rng.pick(&self.spec.fns.clone()).clone();
                    let mut args = Vec::new();
                    let mut rest = &f.params[..];
                    if f.matrix {
                        let cols = self.rng.pick(&self.sizes.clone()).clone();
                        args.push(Expr::name(&self.matrix(size, &cols)));
                        args.push(self.vector(&cols, d, dynamic_ok && self.step_products));
                        rest = &f.params[2..];
                    }
                    for _ in rest {
                        args.push(self.vector(size, d, dynamic_ok));
                    }
                    return Expr::Call(f.name.clone(), args);
                }
                22 if products_ok => {
                    let v = self.vector(size, d, dynamic_ok);
                    return self.layernorm(v, size);
                }
                23 => {
                    // `where(p cmp q, a, b)`, q a vector or a number.
                    let cmp =
                        *self.rng.pick(&[BinOp::Lt, BinOp::Le, BinOp::Gt, BinOp::Ge, BinOp::Eq, BinOp::Ne]);
                    let p = self.vector(size, d, dynamic_ok);
                    let q = if self.rng.chance(1, 2) {
                        self.vector(size, d, dynamic_ok)
                    } else {
                        Expr::Number(*self.rng.pick(&NUMBERS))
                    };
                    let cond = binary(cmp, p, q);
                    let (a, b) = (self.vector(size, d, dynamic_ok), self.vector(size, d, dynamic_ok));
                    return Expr::Call("where".into(), vec![cond, a, b]);
                }
                24 => return Expr::Call("logsigmoid".into(), vec![self.vector(size, d, dynamic_ok)]),
                26 if products_ok => {
                    // A product by a block-diagonal matrix of 2 or 3 heads.
                    let heads = *self.rng.pick(&[2, 3]);
                    if !size.divisible_by(heads) {
                        continue;
                    }
                    let cols = self.rng.pick(&self.sizes.clone()).times(heads);
                    let arg = self.vector(&cols, d, dynamic_ok && self.step_products);
                    let w = self.matrix_of_heads(size, &cols, heads);
                    return Expr::MatVec(w, Box::new(arg));
                }
                27 if products_ok => {
                    // `v @ W`, with heads where both sizes allow.
                    let rows = self.rng.pick(&self.sizes.clone()).clone();
                    let heads = *self.rng.pick(&[1, 2]);
                    let heads = if rows.divisible_by(heads) && size.divisible_by(heads) { heads } else { 1 };
                    let arg = self.vector(&rows, d, dynamic_ok && self.step_products);
                    let w = self.matrix_of_heads(&rows, size, heads);
                    return Expr::VecMat(w, Box::new(arg));
                }
                28 => {
                    let (a, b) = *self.rng.pick(&[(2, 2), (2, 3), (3, 2)]);
                    if !size.divisible_by(a * b) {
                        continue;
                    }
                    return Expr::Transpose(Box::new(self.vector(size, d, dynamic_ok)), a, b);
                }
                _ => {}
            }
        }
    }

    fn scalar(&mut self, depth: u32, dynamic_ok: bool) -> Expr {
        let consts: Vec<String> = self.spec.consts.iter().map(|(n, _)| n.clone()).collect();
        match self.rng.below(if depth == 0 { 3 } else { 10 }) {
            0 | 1 => Expr::Number(*self.rng.pick(&NUMBERS)),
            2 if !consts.is_empty() => Expr::Name(self.rng.pick(&consts).clone()),
            2 => Expr::Number(*self.rng.pick(&NUMBERS)),
            3..=6 => {
                let size = self.rng.pick(&self.sizes.clone()).clone();
                let v = self.vector(&size, depth - 1, dynamic_ok);
                Expr::Reduce(self.rng.chance(1, 2), Box::new(v))
            }
            7 => {
                let u = *self.rng.pick(&UnaryOp::BUILTINS);
                unary(u, self.scalar(depth - 1, dynamic_ok))
            }
            _ => {
                let op = *self.rng.pick(&[BinOp::Add, BinOp::Sub, BinOp::Mul, BinOp::Div]);
                let (a, b) = (self.scalar(depth - 1, dynamic_ok), self.scalar(depth - 1, dynamic_ok));
                binary(op, a, b)
            }
        }
    }

    fn init(&mut self, matrix: bool) -> Init {
        let consts: Vec<String> = self.spec.consts.iter().map(|(n, _)| n.clone()).collect();
        // Matrices keep random entries: equal rows make a product's
        // results equal, and a LayerNorm of equal values divides by ~0.
        match self.rng.below(16) {
            0 if !matrix => Init::Zeros,
            1 if !matrix => Init::Ones,
            2 => Init::Uniform(Scale::Number(0.3)),
            3 => Init::Uniform(Scale::InverseSqrtSize),
            4 if !consts.is_empty() && !matrix => {
                Init::Constant(Scale::ConstOverSize(self.rng.pick(&consts).clone()))
            }
            5 if !matrix => Init::Constant(Scale::Number(0.2)),
            6 if !consts.is_empty() => Init::Uniform(Scale::MinConst(self.rng.pick(&consts).clone())),
            _ => Init::Default,
        }
    }

    /// A matrix parameter `[rows, cols]`: one already declared, or a new one.
    fn matrix(&mut self, rows: &Size, cols: &Size) -> String {
        self.matrix_of_heads(rows, cols, 1)
    }

    /// A matrix parameter of `heads` blocks, `[heads, rows/heads,
    /// cols/heads]` (`[rows, cols]` for one head): one already declared, or
    /// a new one.
    fn matrix_of_heads(&mut self, rows: &Size, cols: &Size, heads: u32) -> String {
        let existing: Vec<String> = self
            .spec
            .params
            .iter()
            .filter(|p| &p.rows == rows && p.cols.as_ref() == Some(cols) && p.heads == heads)
            .map(|p| p.name.clone())
            .collect();
        if !existing.is_empty() && self.rng.chance(1, 2) {
            return self.rng.pick(&existing).clone();
        }
        let name = self.fresh("w");
        let init = self.init(true);
        self.spec.params.push(Param {
            name: name.clone(),
            rows: rows.clone(),
            cols: Some(cols.clone()),
            heads,
            init,
        });
        name
    }

    /// A vector parameter of `size`, new (with `init`, or a random one).
    fn vector_param(&mut self, size: &Size, init: Option<Init>) -> String {
        let name = self.fresh("b");
        let init = init.unwrap_or_else(|| self.init(false));
        self.spec.params.push(Param { name: name.clone(), rows: size.clone(), cols: None, heads: 1, init });
        self.bind(Expr::name(&name), Ty::Vector(size.clone()), false);
        name
    }
}

/// Whether `node` may be wrapped in `dropout`: a vector, and not a guard.
fn droppable(spec: &CellSpec, node: &Expr, lets: &BTreeMap<String, Ty>) -> bool {
    !matches!(node, Expr::Guarded(..)) && matches!(spec.type_of(node, lets), Some(Ty::Vector(_)))
}

/// Every `w @ v` in `e` made `dropconnect(w, rate) @ v`.
fn mask_products(e: &mut Expr, w: &str, rate: &str) {
    if let Expr::MatVec(param, arg) = e {
        if param.as_str() == w {
            let arg = std::mem::replace(arg, Box::new(Expr::Number(0.0)));
            *e = Expr::DropConnect { param: w.to_string(), rate: rate.to_string(), arg };
        }
    }
    for c in e.children_mut() {
        mask_products(c, w, rate);
    }
}

/// `u(arg)`, its argument guarded where `u` needs it.
fn unary(u: UnaryOp, arg: Expr) -> Expr {
    match guard_for(u) {
        Some(g) => Expr::Unary(u, Box::new(Expr::Guarded(g, Box::new(arg)))),
        None => Expr::Unary(u, Box::new(arg)),
    }
}

/// `a op b`: a divisor is guarded; two equal operands (`x - x`, a kink
/// or a zero by construction) are made different.
fn binary(op: BinOp, a: Expr, b: Expr) -> Expr {
    let b = if a == b { Expr::Unary(UnaryOp::Sigmoid, Box::new(b)) } else { b };
    let b = if op == BinOp::Div { Expr::Guarded(Guard::Positive, Box::new(b)) } else { b };
    Expr::Binary(op, Box::new(a), Box::new(b))
}

fn min_max(max: bool, a: Expr, b: Expr) -> Expr {
    let b = if a == b { Expr::Unary(UnaryOp::Sigmoid, Box::new(b)) } else { b };
    Expr::MinMax(max, Box::new(a), Box::new(b))
}
