//! Building a pass's [`Call`] list: kernel launches over pointer tables
//! (uploaded before anything runs), GEMMs on the values' homes, row
//! gathers and column sums.
//!
//! Every table is uploaded while the list is built, so the list itself
//! touches no host memory: it runs as it is, or is captured as one graph.

use super::device::{Arg, Batch, Call, Gemm};
use super::step_loop;
use super::storage::{error, Home, LayerRun, Order, Row};
use super::SideKernels;
use crate::dropout::LayerMasks;
use crate::error::Result;
use crate::plan::TimeLoop;
use cellc::cuda::persistent::{precision_code, StepLoop};
use cellc::cuda::Kernel;
use cellc::ir::{Graph, Op, ValueId};
use cellc::precision::Precision;
use cellc::schedule::{Stage, StageKind};
use cellc::shapes::Shapes;
use std::collections::HashMap;

/// A per-step stage's kernel and its pointer table over every step's rows
/// (in the order the steps run), or `None` for a GEMM stage.
type StepTable<'k> = Option<(&'k Kernel, u64)>;

/// The calls of one pass, in order.
#[derive(Debug)]
pub struct Calls {
    pub list: Vec<Call>,
    block: u32,
    /// The largest scratch buffer so far: its address and floats.
    scratch: (u64, usize),
    /// `Layout` values gathered into `Steps` order, by value.
    gathered: HashMap<ValueId, Home>,
    /// `ones[steps * batch]`, for column sums.
    ones: Option<u64>,
    /// The precision of the products of matrix parameters.
    precision: Precision,
}

impl Calls {
    pub fn new(block: u32, precision: Precision) -> Calls {
        Calls { list: Vec::new(), block, scratch: (0, 0), gathered: HashMap::new(), ones: None, precision }
    }

    /// `g`, a product by matrix `w`, its operands in the pass's precision
    /// where `w` is a parameter (f32 otherwise: see [`Precision`]).
    fn by_matrix(&self, graph: &Graph, w: ValueId, mut g: Gemm) -> Gemm {
        g.operands = self.operand_precision(graph, w);
        g
    }

    /// The precision of a product by matrix `w`: the pass's for a parameter, else f32.
    fn operand_precision(&self, graph: &Graph, w: ValueId) -> Precision {
        match graph.node(w).op {
            Op::Param(_) => self.precision,
            _ => Precision::F32,
        }
    }

    /// The pointer table of kernel `k` over `rows`: each row's inputs,
    /// then its outputs, as the kernel's ABI lists them.
    pub fn table(pass: &mut LayerRun, k: &Kernel, rows: &[Row]) -> Result<u64> {
        // Each value's home looked up once, each row's address by arithmetic:
        // at B=64, T=100 a table has ~70,000 entries.
        let homes: Vec<Home> =
            k.inputs.iter().chain(&k.outputs).map(|&v| pass.home(v)).collect::<Result<_>>()?;
        let (layout, batch) = (pass.layout, pass.batch());
        let mut table = Vec::with_capacity(rows.len() * homes.len());
        for &row in rows {
            table.extend(homes.iter().map(|h| h.addr(row, layout, batch)));
        }
        pass.upload_addresses(&table)
    }

    /// Scratch for `blocks` blocks of `k`, or none if it needs none.
    fn scratch(&mut self, pass: &mut LayerRun, k: &Kernel, blocks: u32) -> Result<u64> {
        let floats = k.scratch * blocks as usize;
        if floats == 0 {
            return Ok(0);
        }
        if floats > self.scratch.1 {
            // Earlier calls keep the smaller buffer: the pass owns both.
            self.scratch = (pass.zeros(floats)?, floats);
        }
        Ok(self.scratch.0)
    }

    /// Kernel `k` over `rows` rows of the table at `table`.
    pub fn rows(&mut self, pass: &mut LayerRun, k: &Kernel, table: u64, rows: usize) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let grid = grid_for(k, rows, self.block);
        let scratch = self.scratch(pass, k, grid)?;
        self.list.push(Call::Launch {
            kernel: k.name.clone(),
            grid,
            block: self.block,
            args: vec![Arg::Ptr(table), Arg::I32(int(rows)?), Arg::Ptr(scratch)],
        });
        Ok(())
    }

    /// Kernel `k` once over `rows` (one table of its own).
    pub fn over(&mut self, pass: &mut LayerRun, k: &Kernel, rows: &[Row]) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let table = Self::table(pass, k, rows)?;
        self.rows(pass, k, table, rows.len())
    }

    /// A whole-sequence kernel over `sequences`, each a list of rows in
    /// the order the kernel walks them.
    pub fn sequences(&mut self, pass: &mut LayerRun, k: &Kernel, sequences: &[Vec<Row>]) -> Result<()> {
        let all: Vec<Row> = sequences.iter().flatten().copied().collect();
        let table = Self::table(pass, k, &all)?;
        let (mut starts, mut counts) = (Vec::new(), Vec::new());
        let mut at = 0;
        for seq in sequences {
            starts.push(int(at)?);
            counts.push(int(seq.len())?);
            at += seq.len();
        }
        let starts = pass.upload_i32(&starts)?;
        let counts = pass.upload_i32(&counts)?;
        let grid = grid_for(k, sequences.len(), self.block);
        let scratch = self.scratch(pass, k, grid)?;
        self.list.push(Call::Launch {
            kernel: k.name.clone(),
            grid,
            block: self.block,
            args: vec![
                Arg::Ptr(table),
                Arg::Ptr(starts),
                Arg::Ptr(counts),
                Arg::I32(int(sequences.len())?),
                Arg::Ptr(scratch),
            ],
        });
        Ok(())
    }

    /// Copies `n` floats for each `(destination, source)` pair (the prelude's `cellc_copy_rows`).
    pub fn copy_rows(&mut self, pass: &mut LayerRun, pairs: &[(u64, u64)], n: usize) -> Result<()> {
        self.row_pairs("cellc_copy_rows", pass, pairs, n)
    }

    /// Adds `n` floats of each source into its destination (the prelude's
    /// `cellc_add_rows`); no two pairs may share a destination.
    pub fn add_rows(&mut self, pass: &mut LayerRun, pairs: &[(u64, u64)], n: usize) -> Result<()> {
        self.row_pairs("cellc_add_rows", pass, pairs, n)
    }

    /// One of the prelude's [`cellc::cuda::prelude::ROW_KERNELS`] over `pairs`.
    fn row_pairs(&mut self, kernel: &str, pass: &mut LayerRun, pairs: &[(u64, u64)], n: usize) -> Result<()> {
        if pairs.is_empty() || n == 0 {
            return Ok(());
        }
        let flat: Vec<u64> = pairs.iter().flat_map(|&(d, s)| [d, s]).collect();
        let table = pass.upload_addresses(&flat)?;
        self.list.push(Call::Launch {
            kernel: kernel.into(),
            grid: pairs.len().clamp(1, 65_535) as u32,
            block: self.block,
            args: vec![Arg::Ptr(table), Arg::I32(int(pairs.len())?), Arg::I32(int(n)?)],
        });
        Ok(())
    }

    /// Multiplies each row of `rows` (`(address of its first feature,
    /// sequence, step)`) by its dropout masks (the prelude's `cellc_drop_rows`).
    pub fn drop_rows(
        &mut self,
        pass: &mut LayerRun,
        rows: &[(u64, usize, usize)],
        masks: &LayerMasks,
    ) -> Result<()> {
        if rows.is_empty() || masks.units == 0 {
            return Ok(());
        }
        let (first, second) = match masks.keys[..] {
            [one] => (one, one),
            [forwards, backwards] => (forwards, backwards),
            _ => return Err(error(format!("masks for {} directions", masks.keys.len()))),
        };
        let addresses: Vec<u64> = rows.iter().map(|r| r.0).collect();
        let at: Vec<i32> = rows.iter().flat_map(|r| [r.1, r.2]).map(int).collect::<Result<_>>()?;
        let bits = |x: u32| Arg::I32(x as i32);
        let args = vec![
            Arg::I32(int(masks.units)?),
            Arg::I32(int(masks.keys.len())?),
            bits(first[0]),
            bits(first[1]),
            bits(second[0]),
            bits(second[1]),
            bits(masks.threshold),
            bits(masks.scale.to_bits()),
        ];
        self.launch_over_rows(pass, "cellc_drop_rows", (&addresses, &at), args)?;
        Ok(())
    }

    /// Launches one of the prelude's row kernels over `rows`: its
    /// arguments are the table of the rows' addresses, their integers
    /// (`ints`, a fixed number per row), the number of rows, then `args`.
    fn launch_over_rows(
        &mut self,
        pass: &mut LayerRun,
        kernel: &str,
        (addresses, ints): (&[u64], &[i32]),
        args: Vec<Arg>,
    ) -> Result<()> {
        let (table, at) = (pass.upload_addresses(addresses)?, pass.upload_i32(ints)?);
        let mut all = vec![Arg::Ptr(table), Arg::Ptr(at), Arg::I32(int(addresses.len())?)];
        all.extend(args);
        self.list.push(Call::Launch {
            kernel: kernel.into(),
            grid: addresses.len().clamp(1, 65_535) as u32,
            block: self.block,
            args: all,
        });
        Ok(())
    }

    /// Writes mask `fill` into `rows` (each `(address, sequence, step,
    /// first unit)`, `units` floats, fewer where the mask's units end), or
    /// with `multiply` multiplies the rows by it (the prelude's `cellc_fill_mask`).
    pub fn fill_mask(
        &mut self,
        pass: &mut LayerRun,
        rows: &[(u64, u32, u32, u32)],
        units: usize,
        (fill, multiply): (&crate::masks::MaskFill, bool),
    ) -> Result<()> {
        if rows.is_empty() || units == 0 {
            return Ok(());
        }
        let addresses: Vec<u64> = rows.iter().map(|r| r.0).collect();
        let at: Vec<i32> = rows.iter().flat_map(|r| [r.1, r.2, r.3]).map(|x| x as i32).collect();
        let bits = |x: u32| Arg::I32(x as i32);
        let drawn = fill.drawn.unwrap_or(crate::masks::Drawn { key: [0, 0], threshold: 0, kept: 0.0 });
        let args = vec![
            Arg::I32(int(units)?),
            Arg::I32(int(fill.units)?),
            bits(drawn.key[0]),
            bits(drawn.key[1]),
            bits(drawn.threshold),
            bits(drawn.kept.to_bits()),
            bits(fill.evaluation.to_bits()),
            Arg::I32(fill.drawn.is_some() as i32),
            Arg::I32(multiply as i32),
        ];
        self.launch_over_rows(pass, "cellc_fill_mask", (&addresses, &at), args)?;
        Ok(())
    }

    /// Copies `len` floats from `src` to `dst`, in rows of a block's width
    /// so that every block of the launch has a share.
    pub fn copy_floats(&mut self, pass: &mut LayerRun, dst: u64, src: u64, len: usize) -> Result<()> {
        let row = (self.block as usize * 16).min(len.max(1));
        let pairs: Vec<(u64, u64)> =
            (0..len / row).map(|i| (dst + 4 * (i * row) as u64, src + 4 * (i * row) as u64)).collect();
        self.copy_rows(pass, &pairs, row)?;
        let (done, rest) = (len / row * row, len % row);
        self.copy_rows(pass, &[(dst + 4 * done as u64, src + 4 * done as u64)], rest)
    }

    /// Sets `floats` floats from `addr` to zero.
    pub fn zero(&mut self, addr: u64, floats: usize) {
        if floats > 0 {
            self.list.push(Call::Zero { addr, floats });
        }
    }

    /// The stages `which` of `stages` (the plan's before or after the
    /// loop), over every row at once: products as GEMMs over all rows,
    /// kernels over every valid row (outputs with no home yet get a `Steps`
    /// one). Sums over steps are the caller's.
    pub fn all_rows_stages(
        &mut self,
        pass: &mut LayerRun,
        (graph, plan): (&Graph, &Shapes),
        kernels: &[(usize, Kernel)],
        stages: &[Stage],
        which: &[usize],
    ) -> Result<()> {
        let valid = pass.valid_rows();
        for (i, st) in which.iter().map(|&i| (i, &stages[i])) {
            match st.kind {
                StageKind::Gemm => {
                    for &v in &st.values {
                        self.all_rows_product(pass, graph, plan, v)?;
                    }
                }
                StageKind::SumOverSteps => {}
                StageKind::AddMatrices => {
                    for &v in &st.values {
                        self.add_matrices(pass, graph, plan, v)?;
                    }
                }
                StageKind::Pointwise { .. } | StageKind::WholeSequence { .. } => {
                    for &v in &st.outputs {
                        if !pass.has_home(v) {
                            pass.place_steps(v, plan.elements(v))?;
                        }
                    }
                    self.over(pass, kernel_of(kernels, i)?, &valid)?;
                }
            }
        }
        Ok(())
    }

    /// The plan's time loop over `stages` (a side's schedule): one
    /// whole-sequence kernel walking each sequence, or the per-step stages,
    /// as one step-loop kernel where [`step_loop::grid`]'s rule takes it,
    /// else step by step; in reverse time when `backwards`.
    pub fn time_loop(
        &mut self,
        pass: &mut LayerRun,
        (graph, plan): (&Graph, &Shapes),
        kernels: &SideKernels,
        (stages, time_loop): (&[Stage], &TimeLoop),
        backwards: bool,
    ) -> Result<()> {
        let each_step: Vec<(usize, &Stage)> = match time_loop {
            TimeLoop::Steps(each_step) => each_step.iter().map(|&i| (i, &stages[i])).collect(),
            &TimeLoop::WholeSequence(i) => {
                let kernels = &kernels.stages;
                let sequences: Vec<Vec<Row>> = (0..pass.batch())
                    .map(|r| {
                        let mut rows = pass.sequence(r);
                        if backwards {
                            rows.reverse();
                        }
                        rows
                    })
                    .collect();
                return self.sequences(pass, kernel_of(kernels, i)?, &sequences);
            }
        };
        let mut steps: Vec<usize> = (0..pass.steps()).collect();
        if backwards {
            steps.reverse();
        }
        // One table per kernel: every step's rows, in the order the steps run.
        let mut tables = Vec::new();
        for &(i, st) in &each_step {
            if st.kind == StageKind::Gemm {
                tables.push(None);
                continue;
            }
            let k = kernels.stage(i)?;
            let rows: Vec<Row> = steps.iter().flat_map(|&s| pass.rows_at(s)).collect();
            tables.push(Some((k, Self::table(pass, k, &rows)?)));
        }
        let widest = pass.order.batch_sizes().iter().copied().max().unwrap_or(0);
        if let TimeLoop::Steps(list) = time_loop {
            if let Some(sl) = kernels.step_loop(list) {
                if let Some(grid) =
                    step_loop::grid(pass.step_loops, pass.device.cooperative_limits(), sl, widest)
                {
                    return self.step_loop(pass, graph, (sl, grid), (&each_step, &tables), &steps);
                }
            }
        }
        let mut done = 0usize;
        for &s in &steps {
            let n = pass.order.batch_sizes()[s];
            for (&(_, st), table) in each_step.iter().zip(&tables) {
                match table {
                    None => {
                        for &v in &st.values {
                            self.step_product(pass, graph, plan, v, s, n)?;
                        }
                    }
                    Some((k, base)) => {
                        self.rows(pass, k, table_row(k, *base, done), n)?;
                    }
                }
            }
            done += n;
        }
        Ok(())
    }

    /// The time loop as one cooperative launch of `step_loop` on `grid`
    /// blocks: its descriptor (the products' weights and precisions, then
    /// each step's rows, products' operands and stages' tables, as
    /// [`cellc::cuda::persistent`] lays it out), a zeroed barrier, scratch.
    fn step_loop(
        &mut self,
        pass: &mut LayerRun,
        graph: &Graph,
        (step_loop, grid): (&StepLoop, usize),
        (each_step, tables): (&[(usize, &Stage)], &[StepTable]),
        steps: &[usize],
    ) -> Result<()> {
        let mut desc = Vec::with_capacity(step_loop.header_len() + steps.len() * step_loop.record_len());
        for p in &step_loop.products {
            let (w, _) = operands(graph, p.value)?;
            desc.extend([fixed(pass, w, p.value)?, precision_code(self.operand_precision(graph, w))]);
        }
        let batch = pass.batch();
        let mut done = 0usize;
        for &s in steps {
            let n = pass.order.batch_sizes()[s];
            desc.push(n as u64);
            let mut products = step_loop.products.iter();
            for (&(_, st), table) in each_step.iter().zip(tables) {
                match table {
                    None => {
                        for &v in &st.values {
                            if products.next().map(|p| p.value) != Some(v) {
                                return Err(error(format!("the step loop computes no product {v} here")));
                            }
                            let (x, y) = (
                                step_rows(pass, operands(graph, v)?.1, v, s, batch)?,
                                step_rows(pass, v, v, s, batch)?,
                            );
                            desc.extend([x.0, x.1 as u64, y.0, y.1 as u64]);
                        }
                    }
                    Some((k, base)) => desc.push(table_row(k, *base, done)),
                }
            }
            done += n;
        }
        if desc.len() != step_loop.header_len() + steps.len() * step_loop.record_len() {
            return Err(error(format!(
                "step loop `{}`: a descriptor of {} words",
                step_loop.kernel.name,
                desc.len()
            )));
        }
        let desc = pass.upload_addresses(&desc)?;
        let barrier = pass.zeros(2)?;
        self.zero(barrier, 2);
        let grid = u32::try_from(grid).map_err(|_| error(format!("a grid of {grid} blocks")))?;
        let scratch = self.scratch(pass, &step_loop.kernel, grid)?;
        let shared = step_loop.shared_bytes(grid as usize).and_then(|b| u32::try_from(b).ok());
        let shared =
            shared.ok_or_else(|| error(format!("step loop `{}` on {grid} blocks", step_loop.kernel.name)))?;
        self.list.push(Call::Cooperative {
            kernel: step_loop.kernel.name.clone(),
            grid,
            block: self.block,
            shared,
            args: vec![Arg::Ptr(desc), Arg::I32(int(steps.len())?), Arg::Ptr(scratch), Arg::Ptr(barrier)],
        });
        pass.step_loops_taken += 1;
        Ok(())
    }

    /// Each sequence's row of a `Steps` history at slot `slot(b)`, copied
    /// into the `[batch, m]` rows at `out`, in batch order.
    pub fn gather_sequences(
        &mut self,
        pass: &mut LayerRun,
        history: Home,
        slot: impl Fn(usize) -> usize,
        out: u64,
    ) -> Result<()> {
        let Home::Steps { len: m, .. } = history else {
            return Err(error("only a history holds a row per sequence and step"));
        };
        let (batch, layout) = (pass.batch(), pass.layout);
        let pairs: Vec<(u64, u64)> = (0..batch)
            .map(|r| {
                let b = pass.order.order()[r];
                (out + 4 * (b * m) as u64, history.addr(Row { b, t: 0, s: slot(b), r }, layout, batch))
            })
            .collect();
        self.copy_rows(pass, &pairs, m)
    }

    /// A history of `steps + 1` slots of `m` floats per rank, zero but for
    /// each sequence's row of the `[batch, m]` rows at `per_sequence`
    /// (batch order), put in slot `slot(b)`: the states before the first
    /// step (slot 0), or the final states' adjoints after each sequence's
    /// last step.
    pub fn scatter_sequences(
        &mut self,
        pass: &mut LayerRun,
        per_sequence: u64,
        m: usize,
        slot: impl Fn(usize) -> usize,
    ) -> Result<Home> {
        let batch = pass.batch();
        let history = Home::Steps { base: pass.zeros((pass.steps() + 1) * batch * m)?, len: m };
        let layout = pass.layout;
        let pairs: Vec<(u64, u64)> = (0..batch)
            .map(|r| {
                let b = pass.order.order()[r];
                (
                    history.addr(Row { b, t: 0, s: slot(b), r }, layout, batch),
                    per_sequence + 4 * (b * m) as u64,
                )
            })
            .collect();
        self.copy_rows(pass, &pairs, m)?;
        Ok(history)
    }

    pub fn gemm(&mut self, g: Gemm) {
        if g.m > 0 && g.n > 0 {
            self.list.push(Call::Gemm(g));
        }
    }

    /// Product `v` for step `s`'s first `n` ranks: `Y = X · Wᵀ` (`matvec`)
    /// or `Y = D · W` (`matvect`), vector and result in step rows.
    pub fn step_product(
        &mut self,
        pass: &LayerRun,
        graph: &Graph,
        plan: &Shapes,
        v: ValueId,
        s: usize,
        n: usize,
    ) -> Result<()> {
        let (w, x) = operands(graph, v)?;
        let weight = fixed(pass, w, v)?;
        let batch = pass.batch();
        let ((xa, xs), (ya, ys)) = (step_rows(pass, x, v, s, batch)?, step_rows(pass, v, v, s, batch)?);
        let g = match graph.node(v).op {
            ref op @ (Op::MatVec | Op::MatVecT) => product(op, n, plan.block(w), (xa, xs), weight, (ya, ys)),
            ref other => return Err(error(format!("{v}: {other:?} in a per-step GEMM"))),
        };
        self.gemm(self.by_matrix(graph, w, g));
        Ok(())
    }

    /// Product `v` over every row at once (before or after the loop). A
    /// `matvec`/`matvect` result takes its vector's order (given a home
    /// here if it has none); an `outer` sums over rows in `Steps` order,
    /// gathering a `Layout` operand first (padding rows hold anything).
    pub fn all_rows_product(
        &mut self,
        pass: &mut LayerRun,
        graph: &Graph,
        plan: &Shapes,
        v: ValueId,
    ) -> Result<()> {
        let (m, x) = operands(graph, v)?;
        match (&graph.node(v).op, pass.home(x)?) {
            (Op::MatVec | Op::MatVecT, Home::Fixed(xa)) => {
                // The same vector on every row (parameters only): one product.
                let w = fixed(pass, m, v)?;
                let len = plan.elements(v);
                let once = pass.zeros(len)?;
                let g = product(&graph.node(v).op, 1, plan.block(m), (xa, plan.elements(x)), w, (once, len));
                self.gemm(self.by_matrix(graph, m, g));
                if pass.has_home(v) {
                    let home = pass.home(v)?;
                    let (layout, batch) = (pass.layout, pass.batch());
                    let pairs: Vec<(u64, u64)> = pass
                        .valid_rows()
                        .into_iter()
                        .map(|row| (home.addr(row, layout, batch), once))
                        .collect();
                    self.copy_rows(pass, &pairs, len)?;
                } else {
                    pass.place(v, Home::Fixed(once));
                }
            }
            (Op::MatVec | Op::MatVecT, _) => {
                let w = fixed(pass, m, v)?;
                let (order, xa, xs) = all_rows(pass, x)?;
                let rows = match order {
                    Order::Layout => pass.layout_rows,
                    Order::Steps => pass.step_major_rows(),
                };
                if !pass.has_home(v) {
                    match order {
                        Order::Layout => pass.place_layout(v, plan.elements(v))?,
                        Order::Steps => pass.place_steps(v, plan.elements(v))?,
                    };
                }
                let (out_order, ya, ys) = all_rows(pass, v)?;
                if out_order != order {
                    return Err(error(format!("{v} is stored in another row order than {x}")));
                }
                let g = product(&graph.node(v).op, rows, plan.block(m), (xa, xs), w, (ya, ys));
                self.gemm(self.by_matrix(graph, m, g));
            }
            (Op::Outer, _) => {
                // Per head: its block of dW from its columns of D and X.
                let (heads, rows_d, cols) = plan.block(v);
                let (da, ds) = self.steps_order(pass, plan, m)?;
                let (xa, xs) = self.steps_order(pass, plan, x)?;
                let out = pass.zeros(plan.elements(v))?;
                pass.place(v, Home::Fixed(out));
                self.gemm(Gemm {
                    m: rows_d,
                    n: cols,
                    k: pass.step_major_rows(),
                    a: da,
                    lda: ds,
                    trans_a: true,
                    b: xa,
                    ldb: xs,
                    trans_b: false,
                    c: out,
                    ldc: cols,
                    accumulate: false,
                    operands: Precision::F32,
                    batch: Batch { count: heads, a: rows_d, b: cols, c: rows_d * cols },
                });
            }
            (other, _) => return Err(error(format!("{v}: {other:?} in a GEMM stage"))),
        }
        Ok(())
    }

    /// `v`'s rows in `Steps` order (zeros where sequences ended): its own
    /// home, or a gathered copy of its valid `Layout` rows (of its one
    /// row, for a value the same on every row).
    fn steps_order(&mut self, pass: &mut LayerRun, plan: &Shapes, v: ValueId) -> Result<(u64, usize)> {
        let home = match self.gathered.get(&v) {
            Some(&h) => h,
            None => pass.home(v)?,
        };
        match home {
            Home::Steps { base, len } => Ok((base, len)),
            Home::Layout { .. } | Home::Fixed(_) => {
                let len = plan.elements(v);
                let gathered = Home::Steps { base: pass.zeros(pass.step_major_rows() * len)?, len };
                let (layout, batch) = (pass.layout, pass.batch());
                let pairs: Vec<(u64, u64)> = pass
                    .valid_rows()
                    .into_iter()
                    .map(|row| (gathered.addr(row, layout, batch), home.addr(row, layout, batch)))
                    .collect();
                self.copy_rows(pass, &pairs, len)?;
                self.gathered.insert(v, gathered);
                match gathered {
                    Home::Steps { base, len } => Ok((base, len)),
                    _ => Err(error("unreachable: a gathered value is in Steps order")),
                }
            }
            other => Err(error(format!("{v} ({other:?}) is not held for every row"))),
        }
    }

    /// `v = a + b` for weight-gradient matrices: two GEMMs with a ones
    /// vector (`1 · a`, then `1 · b` accumulated), exact as a plain add.
    fn add_matrices(&mut self, pass: &mut LayerRun, graph: &Graph, plan: &Shapes, v: ValueId) -> Result<()> {
        let (a, b) = match (&graph.node(v).op, &graph.operands(v)[..]) {
            (Op::Binary(cellc::ir::BinaryOp::Add), &[a, b]) => (a, b),
            (op, _) => return Err(error(format!("{v}: {op:?} in a matrix sum stage"))),
        };
        let len = plan.elements(v);
        let ones = self.ones(pass)?;
        let out = pass.zeros(len)?;
        for (operand, accumulate) in [(a, false), (b, true)] {
            let Home::Fixed(at) = pass.home(operand)? else {
                return Err(error(format!("matrix {operand} is not held once")));
            };
            self.gemm(Gemm {
                m: 1,
                n: len,
                k: 1,
                a: ones,
                lda: 1,
                trans_a: false,
                b: at,
                ldb: len,
                trans_b: false,
                c: out,
                ldc: len,
                accumulate,
                operands: Precision::F32,
                batch: Batch::ONE,
            });
        }
        pass.place(v, Home::Fixed(out));
        Ok(())
    }

    /// `ones[steps * batch]` (at least one), uploaded once per pass.
    fn ones(&mut self, pass: &mut LayerRun) -> Result<u64> {
        match self.ones {
            Some(o) => Ok(o),
            None => {
                let o = pass.upload(&vec![1.0; pass.step_major_rows().max(1)])?;
                self.ones = Some(o);
                Ok(o)
            }
        }
    }

    /// `Σ` over every row of `v`, in a fixed order (a GEMM with ones, no
    /// atomics): the address of the `[len]` result.
    pub fn column_sum(&mut self, pass: &mut LayerRun, plan: &Shapes, v: ValueId) -> Result<u64> {
        let (va, vs) = self.steps_order(pass, plan, v)?;
        let rows = pass.step_major_rows();
        let ones = self.ones(pass)?;
        let len = plan.elements(v);
        let out = pass.zeros(len)?;
        self.gemm(Gemm {
            m: 1,
            n: len,
            k: rows,
            a: ones,
            lda: rows,
            trans_a: false,
            b: va,
            ldb: vs,
            trans_b: false,
            c: out,
            ldc: len,
            accumulate: false,
            operands: Precision::F32,
            batch: Batch::ONE,
        });
        Ok(out)
    }
}

/// `Y[rows, ·] = X[rows, ·] · Wᵀ` (`op` is `matvec`) or `X · W` (`matvect`),
/// with `W` the `heads` blocks `[m, n]` stored one after another at `w`,
/// each on its columns of `X` and `Y` (one strided batched GEMM).
fn product(
    op: &Op,
    rows: usize,
    (heads, m, n): (usize, usize, usize),
    x: (u64, usize),
    w: u64,
    y: (u64, usize),
) -> Gemm {
    // Per head: `out` columns of Y from `k` columns of X.
    let (out, k, trans_b) = if *op == Op::MatVec { (m, n, true) } else { (n, m, false) };
    Gemm {
        m: rows,
        n: out,
        k,
        a: x.0,
        lda: x.1,
        trans_a: false,
        b: w,
        ldb: n,
        trans_b,
        c: y.0,
        ldc: y.1,
        accumulate: false,
        operands: Precision::F32,
        batch: Batch { count: heads, a: k, b: m * n, c: out },
    }
}

/// The kernel of stage `stage` of a side, in `kernels` (by stage index).
pub fn kernel_of(kernels: &[(usize, Kernel)], stage: usize) -> Result<&Kernel> {
    kernels
        .iter()
        .find(|(i, _)| *i == stage)
        .map(|(_, k)| k)
        .ok_or_else(|| error(format!("no kernel for stage {stage}")))
}

fn operands(graph: &Graph, v: ValueId) -> Result<(ValueId, ValueId)> {
    match graph.operands(v)[..] {
        [a, b] => Ok((a, b)),
        _ => Err(error(format!("product {v} needs two operands"))),
    }
}

/// Row `row` of kernel `k`'s pointer table at `table` (each row its inputs' and outputs' pointers).
fn table_row(k: &Kernel, table: u64, row: usize) -> u64 {
    table + 8 * ((k.inputs.len() + k.outputs.len()) * row) as u64
}

/// Step `s`'s rows of `u` (an operand or the result of product `v`),
/// contiguous from rank 0: their address and stride.
fn step_rows(pass: &LayerRun, u: ValueId, v: ValueId, s: usize, batch: usize) -> Result<(u64, usize)> {
    pass.home(u)?
        .step_rows(s, batch)
        .ok_or_else(|| error(format!("per-step product {v}: {u} is not held per rank")))
}

fn fixed(pass: &LayerRun, w: ValueId, v: ValueId) -> Result<u64> {
    match pass.home(w)? {
        Home::Fixed(a) => Ok(a),
        other => Err(error(format!("product {v}: matrix {w} is not a parameter ({other:?})"))),
    }
}

fn all_rows(pass: &LayerRun, v: ValueId) -> Result<(Order, u64, usize)> {
    pass.home(v)?.all_rows().ok_or_else(|| error(format!("{v} is not held for every row")))
}

fn int(x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| error(format!("{x} rows do not fit a kernel's int argument")))
}

/// Blocks for `items` rows or sequences: a lane-form kernel gives every
/// (item, chunk of a block's worth of units) its own block; a block-form
/// kernel one block per item. Both loop over whatever the grid leaves out.
pub fn grid_for(k: &Kernel, items: usize, block: u32) -> u32 {
    let per_item = if k.units > 0 { k.units.div_ceil(block.max(1) as usize) } else { 1 };
    (items * per_item).clamp(1, 65_535) as u32
}
