//! CUDA C++ for a cell's pointwise stages: text in, text out.
//!
//! One `__global__` function per schedule stage, with the same row
//! pointer-table ABI as the CPU back end's kernels, so the runtime gathers
//! and scatters the caller's padded or packed rows without copies:
//!
//! ```text
//! extern "C" __global__ void NAME(float* const* __restrict__ args, int rows,
//!                                 float* __restrict__ scratch)
//! ```
//!
//! - `args` holds, for each row, one pointer per stage input (in the
//!   stage's input order) then one per output: `args[row * K + i]`.
//! - `scratch` holds [`Kernel::scratch`] floats per block (`gridDim.x *
//!   scratch` in all) for intermediate vectors of the block form; lane-form
//!   kernels use none.
//! - Any grid and any block size up to [`BLOCK`] are right (every loop is
//!   grid- or block-stride); the grids below give every item its own block.
//!   Kernels with a block reduction say `__launch_bounds__(BLOCK)`, so a
//!   larger block fails to launch instead of overrunning shared memory.
//!
//! Two forms, the same parameters:
//!
//! - **Lane form** ([`Kernel::units`] `= U > 0`), for stages whose every
//!   vector is a whole number of `U`-element pieces (an LSTM's `[4*H]`
//!   gates and `[H]` states, `U = H`): one thread per (row, unit); thread
//!   `j` computes element `p * U + j` of every vector, in registers, so no
//!   thread reads what another wrote: no barrier, no shared memory, no
//!   scratch. Slices and concatenations at piece boundaries are register
//!   renamings. Blocks take (row, chunk of `blockDim.x` units) items,
//!   grid-stride; `rows * ceil(U / blockDim.x)` blocks give each its own.
//! - **Block form** (`units == 0`: a row reduction such as LayerNorm's
//!   `mean`, or lengths that share no piece): one block per row
//!   (grid-stride over rows), the block's threads stride over a row's
//!   elements, intermediates in `scratch` with barriers between loops. Row
//!   reductions are block reductions in shared memory in a fixed tree
//!   order: results do not depend on timing, and no `atomicAdd` is used
//!   anywhere.
//!
//! Whole-sequence stages (elementwise recurrences) take the rows of each
//! sequence in time order, each row's state pointer pointing at the
//! previous row's next state:
//!
//! ```text
//! extern "C" __global__ void NAME(float* const* __restrict__ args,
//!                                 const int* __restrict__ seq_start,
//!                                 const int* __restrict__ seq_rows, int sequences,
//!                                 float* __restrict__ scratch)
//! ```
//!
//! Sequence `b`'s rows are `seq_start[b] .. seq_start[b] + seq_rows[b]`
//! of the table (a count of 0 is allowed). In the lane form one thread per
//! (sequence, unit) walks the sequence's rows in time order on its own; a
//! chained state ([`Context::chains`]) stays in a register from row to
//! row, its pointer read only at the sequence's first row. Blocks take
//! (sequence, chunk) items: `sequences * ceil(U / blockDim.x)` blocks. In
//! the block form one block per sequence walks its rows with a barrier
//! between rows.
//!
//! Elementwise ops of one length fuse into one loop with intermediates in
//! registers, as in the CPU's JIT; every value is commented with its IR
//! line and, given the sources, the `.cell` location it came from. Math is
//! `expf`/`tanhf`/`logf` (not the `__expf` intrinsics), to stay close to
//! the CPU back ends.

pub mod prelude;

use crate::autodiff::Gradient;
use crate::diag::SourceMap;
use crate::interp::Shapes;
use crate::ir::print::{value_line, LeafNames};
use crate::ir::{BinaryOp, Cell, Graph, Op, ReduceOp, UnaryOp, ValueId};
use crate::kernel::{FusedGroup, Item, KernelPlan, Kind, Literal};
use crate::program::{Program, Side};
use crate::schedule::{Stage, StageKind};
use std::collections::{HashMap, HashSet};
use std::fmt::Write;

/// The NVRTC options the kernels are meant to be compiled with (plus
/// `--gpu-architecture`). `--prec-div=false`: an IEEE division's slow path
/// (denormal or huge operands) is a real function call whose ABI spills
/// registers to the stack in the larger backward kernels; the fast path is
/// within 2 ulp, the same order as the GPU's `expf`/`tanhf` and as the CPU
/// back end's polynomials, which is the accuracy the project promises.
pub const NVRTC_OPTIONS: &[&str] = &["--std=c++17", "--prec-div=false"];

/// At most this many pieces per vector in the lane form (an LSTM's gates
/// are 4): past it a thread would hold too many registers (and the source
/// unroll too far), and the stage takes the block form.
pub const MAX_PIECES: usize = 16;

/// Threads per block the kernels are written for (the shared-memory
/// reduction buffer has this many slots).
pub const BLOCK: u32 = 128;

/// One generated kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kernel {
    pub name: String,
    /// The function's source (no prelude).
    pub source: String,
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
    /// Scratch floats each block needs.
    pub scratch: usize,
    /// Takes sequences (`seq_start`, `seq_rows`) rather than independent rows.
    pub whole_sequence: bool,
    /// Lane form: the units `U` of each row or sequence, one thread each
    /// (see the module documentation); 0 in block form.
    pub units: usize,
}

/// Why a stage could not be emitted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmitError(pub String);

impl std::fmt::Display for EmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuda: {}", self.0)
    }
}

impl std::error::Error for EmitError {}

/// Every kernel of a cell's `program`: its forward and backward pointwise
/// and whole-sequence stages as the runtime schedules them, named by
/// [`Program::kernel_name`]. `cell` and `grad` are the steps the program
/// was made from ([`crate::program::Steps`]).
pub fn emit_cell(
    cell: &Cell,
    grad: &Gradient,
    program: &Program,
    sources: Option<&SourceMap>,
) -> Result<Vec<Kernel>, EmitError> {
    let names = LeafNames::of(cell, &grad.seeds);
    let (forward_chains, backward_chains) = chains(cell, grad);
    let mut out = Vec::new();
    for (side, chains) in [(Side::Forward, &forward_chains), (Side::Backward, &backward_chains)] {
        let graph = match side {
            Side::Forward => &**cell,
            Side::Backward => &grad.graph,
        };
        let cx = Context { names: Some(&names), sources, chains };
        for (i, st) in program.stages(side).iter().enumerate() {
            if st.kind.is_kernel() {
                out.push(emit_stage(graph, program.shapes(side), st, &program.kernel_name(side, i), cx)?);
            }
        }
    }
    Ok(out)
}

/// A whole-sequence stage's `(input, output)` pair: a row's input is the
/// previous row's output.
pub type Chain = (ValueId, ValueId);

/// The state chains of a cell's forward and backward steps, as
/// [`Context::chains`] takes them: forward, state `k`'s leaf and the next
/// state; backward (rows in reverse time), the seed of next state `k`'s
/// gradient and the gradient of state `k`, which the step before reads.
pub fn chains(cell: &Cell, grad: &Gradient) -> (Vec<Chain>, Vec<Chain>) {
    let leaf = |g: &Graph, op: Op| g.values().find(|&v| g.node(v).op == op);
    let forward = (0..cell.states.len())
        .filter_map(|k| Some((leaf(cell, Op::State(k))?, *cell.next_states.get(k)?)))
        .collect();
    let backward = (0..cell.states.len())
        .filter_map(|k| Some((leaf(&grad.graph, Op::Seed(k + 1))?, (*grad.d_states.get(k)?)?)))
        .collect();
    (forward, backward)
}

/// A translation unit: the prelude, then every kernel.
pub fn translation_unit(kernels: &[Kernel]) -> String {
    let mut out = String::from(prelude::PRELUDE);
    for k in kernels {
        out.push('\n');
        out.push_str(&k.source);
    }
    out
}

/// Where to find the names and source locations for comments.
#[derive(Clone, Copy, Default)]
#[allow(missing_debug_implementations)] // SourceMap holds codespan files, which are not Debug
pub struct Context<'a> {
    pub names: Option<&'a LeafNames<'a>>,
    pub sources: Option<&'a SourceMap>,
    /// Whole-sequence stages: `(input, output)` pairs where a row's input
    /// is the previous row's output (a state and its next state). Lane-form
    /// kernels keep these in registers; without them every row reads its
    /// state through its pointer (the same values, one load more per row).
    pub chains: &'a [Chain],
}

/// The kernel for one pointwise or whole-sequence stage of `graph` at
/// `plan`'s sizes.
pub fn emit_stage(
    graph: &Graph,
    plan: &Shapes,
    stage: &Stage,
    name: &str,
    cx: Context,
) -> Result<Kernel, EmitError> {
    let whole_sequence = match stage.kind {
        StageKind::Pointwise { .. } => false,
        StageKind::WholeSequence { .. } => true,
        _ => return Err(EmitError(format!("{name}: only pointwise stages become kernels"))),
    };
    // The lane form where the stage allows it, else the block form. The
    // unit is the shortest elementwise vector; every other length must be
    // a multiple of it, at most MAX_PIECES times.
    let elementwise = |v: &&ValueId| {
        matches!(graph.node(**v).op, Op::Unary(_) | Op::Binary(_)) && graph.ty(**v).vector_dim().is_some()
    };
    let lane = match stage.kind {
        StageKind::Pointwise { .. } | StageKind::WholeSequence { reductions: false } => {
            let units = stage.values.iter().filter(elementwise).map(|&v| plan.elements(v)).min();
            let longest = stage.values.iter().map(|&v| plan.elements(v)).max().unwrap_or(0);
            units.filter(|&u| u > 0 && longest <= u * MAX_PIECES)
        }
        _ => None,
    };
    let mut e = Emitter::new(graph, plan, cx, lane);
    let tried = e.stage(stage);
    // A stage that leaves the lane form part-way may have left values
    // unheld (an error then): either way the block form decides.
    if lane.is_some() && (tried.is_err() || !e.lane_ok) {
        e = Emitter::new(graph, plan, cx, None);
        e.stage(stage)?;
    } else {
        tried?;
    }
    let k = stage.inputs.len() + stage.outputs.len();
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {} values, {} inputs, {} outputs",
        stage.values.len(),
        stage.inputs.len(),
        stage.outputs.len()
    );
    // What each row's pointers hold.
    let no_names = LeafNames::default();
    let names = cx.names.unwrap_or(&no_names);
    for (i, &v) in stage.inputs.iter().chain(&stage.outputs).enumerate() {
        let what = if i < stage.inputs.len() { "in " } else { "out" };
        let _ = writeln!(src, "//   a[{i}] {what} {}", value_line(graph, names, v));
    }
    let units = e.lane.unwrap_or(0);
    if let (Some(n), false) = (e.lane, whole_sequence) {
        let _ = writeln!(
            src,
            "// Lane form: one thread per (row, unit), {n} units; thread j computes element p * {n} + j of every vector."
        );
        src.push_str(&signature(name, "", false));
        src.push_str(&lane_items(n, "rows", "row"));
        let _ = writeln!(src, "        float* const* const a = args + (size_t)row * {k};");
        src.push_str(&e.body);
        src.push_str("    }\n}\n");
    } else if let Some(n) = e.lane {
        let _ = writeln!(
            src,
            "// Lane form: one thread per (sequence, unit), {n} units, rows in time order, no barriers."
        );
        src.push_str(&signature(name, "", true));
        src.push_str(&lane_items(n, "sequences", "seq"));
        src.push_str("        const int first = seq_start[seq], end = first + seq_rows[seq];\n");
        for (i, out, _) in &e.chained {
            let _ = writeln!(
                src,
                "        // {}: read at the first row, then carried from a[{}] of the row before",
                value_line(graph, names, stage.inputs[*i]),
                stage.inputs.len() + out
            );
            let _ = writeln!(
                src,
                "        float c{i} = first < end ? args[(size_t)first * {k} + {i}][j] : 0.0f;"
            );
        }
        src.push_str("        for (int row = first; row < end; ++row) {\n");
        let _ = writeln!(src, "            float* const* const a = args + (size_t)row * {k};");
        src.push_str(&e.body);
        for (i, _, value) in &e.chained {
            let _ = writeln!(src, "            c{i} = {value};");
        }
        src.push_str("        }\n    }\n}\n");
    } else {
        // Declarations only for what the body uses (NVRTC warns about the rest).
        let mut locals = String::new();
        if e.reduces {
            let _ = writeln!(locals, "    __shared__ float red[{BLOCK}];");
        }
        if e.scratch > 0 {
            let _ = writeln!(locals, "    float* const s = scratch + (size_t)blockIdx.x * {};", e.scratch);
        }
        // The shared reduction buffer has BLOCK slots: a larger block must
        // fail to launch rather than write past it.
        let bounds = if e.reduces { format!("__launch_bounds__({BLOCK}) ") } else { String::new() };
        // Every row ends with a barrier (the next row may reuse scratch or, in
        // a sequence, read this row's results); the body's last one serves.
        let body = e.body.trim_end_matches(|c: char| c.is_whitespace());
        let body = body.strip_suffix("__syncthreads();").unwrap_or(body).trim_end().to_string() + "\n";
        if whole_sequence {
            src.push_str(&signature(name, &bounds, true));
            src.push_str(&locals);
            src.push_str("    for (int seq = blockIdx.x; seq < sequences; seq += gridDim.x) {\n");
            src.push_str(
                "        for (int row = seq_start[seq]; row < seq_start[seq] + seq_rows[seq]; ++row) {\n",
            );
            let _ = writeln!(src, "            float* const* const a = args + (size_t)row * {k};");
            src.push_str(&body);
            src.push_str("            __syncthreads();\n        }\n    }\n}\n");
        } else {
            src.push_str(&signature(name, &bounds, false));
            src.push_str(&locals);
            src.push_str("    for (int row = blockIdx.x; row < rows; row += gridDim.x) {\n");
            let _ = writeln!(src, "        float* const* const a = args + (size_t)row * {k};");
            src.push_str(&body);
            src.push_str("        __syncthreads();\n    }\n}\n");
        }
    }
    Ok(Kernel {
        name: name.to_string(),
        source: src,
        inputs: stage.inputs.clone(),
        outputs: stage.outputs.clone(),
        scratch: e.scratch,
        whole_sequence,
        units,
    })
}

/// A kernel's first line: the row ABI, or the sequence ABI of
/// whole-sequence stages (see the module documentation).
fn signature(name: &str, bounds: &str, whole_sequence: bool) -> String {
    let params = if whole_sequence {
        "float* const* __restrict__ args, const int* __restrict__ seq_start, const int* __restrict__ seq_rows, int sequences, float* __restrict__ scratch"
    } else {
        "float* const* __restrict__ args, int rows, float* __restrict__ scratch"
    };
    format!("extern \"C\" __global__ void {bounds}{name}({params}) {{\n")
}

/// The lane form's grid-stride loop over (item, chunk of a block's units):
/// opens the loop, names the item `index` and the thread's unit `j`.
fn lane_items(units: usize, count: &str, index: &str) -> String {
    format!(
        "    const int chunks = ({units} + (int)blockDim.x - 1) / (int)blockDim.x;\n\
         \x20   for (int item = blockIdx.x; item < {count} * chunks; item += gridDim.x) {{\n\
         \x20       const int {index} = item / chunks;\n\
         \x20       const int j = (item - {index} * chunks) * (int)blockDim.x + (int)threadIdx.x;\n\
         \x20       if (j >= {units}) continue;\n"
    )
}

/// How a value is held while a row is computed.
#[derive(Clone, Debug, PartialEq)]
enum Held {
    /// A scalar, the same in every thread: a C expression.
    Scalar(String),
    /// A vector whose elements all equal this scalar expression.
    Splat(String),
    /// A vector in memory: a pointer expression.
    Mem(String),
    /// Lane form: a vector of `pieces.len()` pieces of `units` elements,
    /// this thread's element `j` of each piece (registers, or `0.0f`).
    Lanes(Vec<String>),
}

struct Emitter<'a> {
    graph: &'a Graph,
    plan: &'a Shapes,
    cx: Context<'a>,
    body: String,
    held: HashMap<ValueId, Held>,
    /// Floats of scratch a row uses (block form; the lane form uses none).
    scratch: usize,
    /// Where each vector the kernel plan keeps in scratch lives.
    scratch_at: HashMap<ValueId, usize>,
    /// Whether a block reduction (and its shared buffer) is needed.
    reduces: bool,
    indent: usize,
    /// Lane form: the units (every vector's length is a multiple); `None`
    /// in block form. In the lane form nothing the kernel computes goes
    /// through memory but its outputs, so no thread reads another's work.
    lane: Option<usize>,
    /// Stays true while the stage fits the lane form.
    lane_ok: bool,
    /// Lane form: output pointers already written.
    stored: HashSet<String>,
    /// Lane form: (input index, output index, the output's value at the
    /// row's end) of each chained state.
    chained: Vec<(usize, usize, String)>,
    /// The `.cell` line last quoted in a comment.
    quoted: Option<(crate::diag::FileId, usize)>,
}

impl<'a> Emitter<'a> {
    fn new(graph: &'a Graph, plan: &'a Shapes, cx: Context<'a>, lane: Option<usize>) -> Self {
        Emitter {
            graph,
            plan,
            cx,
            body: String::new(),
            held: HashMap::new(),
            scratch: 0,
            scratch_at: HashMap::new(),
            reduces: false,
            indent: 3,
            lane,
            lane_ok: true,
            stored: HashSet::new(),
            chained: Vec::new(),
            quoted: None,
        }
    }

    fn len(&self, v: ValueId) -> usize {
        self.plan.elements(v)
    }

    fn line(&mut self, text: &str) {
        for _ in 0..self.indent {
            self.body.push_str("    ");
        }
        self.body.push_str(text);
        self.body.push('\n');
    }

    /// `// v12: [4*H] = add v10, v11  (lstm.cell:9:12)`, after the `.cell`
    /// line itself when the value comes from a line not quoted just before:
    /// `// lstm.cell:9:     let gates = weight_ih @ x + bias_ih`.
    fn comment(&mut self, v: ValueId) {
        let text = match self.cx.names {
            Some(names) => value_line(self.graph, names, v),
            None => value_line(self.graph, &LeafNames::default(), v),
        };
        let at = match (self.cx.sources, self.graph.span(v)) {
            (Some(src), Some(span)) => {
                let (line, _) = src.line_col(span.file, span.start);
                if self.quoted != Some((span.file, line)) {
                    self.quoted = Some((span.file, line));
                    let code = src.line_text(span.file, line).trim();
                    let quote = format!("// {}:{line}: {code}", src.name(span.file));
                    self.line(&comment_safe(&quote));
                }
                format!("  ({})", src.location(span))
            }
            _ => String::new(),
        };
        self.line(&comment_safe(&format!("// {text}{at}")));
    }

    /// Marks the stage as not fitting the lane form (the caller then
    /// emits the block form).
    fn not_lane(&mut self) -> Result<(), EmitError> {
        self.lane_ok = false;
        Ok(())
    }

    /// Lane form: this thread's elements of a `len`-element vector, one per
    /// piece, or `None` when `len` is not a whole number of pieces.
    fn pieces(&self, h: &Held, len: usize) -> Option<Vec<String>> {
        let units = self.lane?;
        if units == 0 || !len.is_multiple_of(units) {
            return None;
        }
        let q = len / units;
        match h {
            Held::Scalar(x) | Held::Splat(x) => Some(vec![x.clone(); q]),
            Held::Mem(p) => Some((0..q).map(|i| index(p, i * units)).collect()),
            Held::Lanes(v) if v.len() == q => Some(v.clone()),
            Held::Lanes(_) => None,
        }
    }

    /// Lane form: writes this thread's elements of `h` to `dst`.
    fn store_pieces(&mut self, dst: &str, h: &Held, len: usize) -> Result<(), EmitError> {
        let Some(pieces) = self.pieces(h, len) else { return self.not_lane() };
        let units = self.lane.unwrap_or(0);
        for (i, x) in pieces.iter().enumerate() {
            self.line(&format!("{} = {x};", index(dst, i * units)));
        }
        self.stored.insert(dst.to_string());
        Ok(())
    }

    fn stage(&mut self, stage: &Stage) -> Result<(), EmitError> {
        if matches!(stage.kind, StageKind::Pointwise { .. }) {
            self.indent = 2;
        }
        let n_in = stage.inputs.len();
        let plan = KernelPlan::new(self.graph, self.plan, &stage.values, &stage.inputs, &stage.outputs);
        self.scratch_at = plan.scratch.clone();
        // Literals first, even where they are also inputs.
        for &(v, lit) in &plan.literals {
            let h = match lit {
                Literal::Scalar(x) => Held::Scalar(literal(x)),
                Literal::Splat(x) => Held::Splat(literal(x)),
            };
            self.held.insert(v, h);
        }
        let whole_sequence = matches!(stage.kind, StageKind::WholeSequence { .. });
        for &(i, v, kind) in &plan.inputs {
            let chained = self.cx.chains.iter().find(|(input, _)| *input == v).map(|c| c.1);
            let h = match chained.and_then(|out| stage.outputs.iter().position(|&o| o == out)) {
                Some(o) if whole_sequence && self.lane == Some(self.len(v)) => {
                    self.chained.push((i, o, String::new()));
                    Held::Lanes(vec![format!("c{i}")])
                }
                _ if kind == Kind::Vector => Held::Mem(format!("a[{i}]")),
                _ => Held::Scalar(format!("a[{i}][0]")),
            };
            self.held.insert(v, h);
        }
        let mut out_ptr: HashMap<ValueId, String> = HashMap::new();
        for (i, &v) in stage.outputs.iter().enumerate() {
            out_ptr.entry(v).or_insert_with(|| format!("a[{}]", n_in + i));
        }
        for item in &plan.items {
            match item {
                Item::Fused(group) => self.flush(group, &plan, &out_ptr)?,
                Item::Single(v) => self.value(*v, out_ptr.get(v).cloned())?,
            }
        }
        // Outputs not already in place.
        for (i, &v) in stage.outputs.iter().enumerate() {
            let dst = format!("a[{}]", n_in + i);
            let h = self
                .held
                .get(&v)
                .cloned()
                .ok_or_else(|| EmitError(format!("output {v} is never computed")))?;
            if h == Held::Mem(dst.clone()) || self.stored.contains(&dst) {
                continue;
            }
            let n = self.len(v);
            self.line(&format!("// output {v}"));
            if self.lane.is_some() {
                self.store_pieces(&dst, &h, n)?;
                continue;
            }
            let src = match &h {
                Held::Scalar(x) | Held::Splat(x) => x.clone(),
                Held::Mem(p) => format!("{p}[j]"),
                Held::Lanes(_) => return Err(EmitError(format!("output {v}: lane value in block form"))),
            };
            self.line(&format!("for (int j = threadIdx.x; j < {n}; j += blockDim.x) {dst}[j] = {src};"));
        }
        // Each chained state's value for the next row.
        let mut chained = std::mem::take(&mut self.chained);
        for (_, o, value) in &mut chained {
            let v = stage.outputs[*o];
            match self.held.get(&v).and_then(|h| self.pieces(h, self.len(v))) {
                Some(p) if p.len() == 1 => *value = p[0].clone(),
                _ => self.lane_ok = false,
            }
        }
        self.chained = if self.lane.is_some() { chained } else { Vec::new() };
        Ok(())
    }

    /// The output or the place in scratch (the kernel plan's) of a vector.
    fn storage(&mut self, v: ValueId, dst: Option<String>) -> Result<String, EmitError> {
        if let Some(d) = dst {
            return Ok(d);
        }
        let at = *self.scratch_at.get(&v).ok_or_else(|| EmitError(format!("{v} has no storage")))?;
        self.scratch = self.scratch.max(at + self.len(v));
        Ok(format!("(s + {at})"))
    }

    /// One loop over the group's elements; members read outside it (or
    /// outputs) are stored, the rest stay in registers. In the lane form,
    /// straight-line code for this thread's element of each piece, every
    /// member a register.
    fn flush(
        &mut self,
        group: &FusedGroup,
        plan: &KernelPlan,
        out_ptr: &HashMap<ValueId, String>,
    ) -> Result<(), EmitError> {
        let members = group.members();
        let n = self.len(members[0]);
        for &v in members {
            self.comment(v);
        }
        if let Some(units) = self.lane {
            if units == 0 || !n.is_multiple_of(units) {
                return self.not_lane();
            }
            let q = n / units;
            let reg = |v: ValueId, p: usize| {
                if q == 1 {
                    format!("t{}", v.index())
                } else {
                    format!("t{}_{p}", v.index())
                }
            };
            for p in 0..q {
                for &v in members {
                    let mut args = Vec::new();
                    for o in self.graph.operands(v) {
                        let arg = if group.contains(o) {
                            reg(o, p)
                        } else {
                            let h = self.get(v, o)?;
                            match self.pieces(&h, n) {
                                Some(pieces) => pieces[p].clone(),
                                None => return self.not_lane(),
                            }
                        };
                        args.push(arg);
                    }
                    let r = reg(v, p);
                    let expr = op_expr(v, &self.graph.node(v).op, &args)?;
                    self.line(&format!("const float {r} = {expr};"));
                    if let Some(dst) = out_ptr.get(&v) {
                        self.line(&format!("{} = {r};", index(dst, p * units)));
                    }
                }
            }
            for &v in members {
                if let Some(dst) = out_ptr.get(&v) {
                    self.stored.insert(dst.clone());
                }
                self.held.insert(v, Held::Lanes((0..q).map(|p| reg(v, p)).collect()));
            }
            return Ok(());
        }
        let mut stores = Vec::new();
        let mut code = Vec::new();
        for &v in members {
            let mut args = Vec::new();
            for o in self.graph.operands(v) {
                args.push(if group.contains(o) {
                    format!("t{}", o.index())
                } else {
                    match self.get(v, o)? {
                        Held::Scalar(x) | Held::Splat(x) => x,
                        Held::Mem(p) => format!("{p}[j]"),
                        Held::Lanes(_) => {
                            return Err(EmitError(format!("{v} reads {o}, a lane value, in block form")))
                        }
                    }
                });
            }
            code.push(format!(
                "const float t{} = {};",
                v.index(),
                op_expr(v, &self.graph.node(v).op, &args)?
            ));
            let read_outside = plan.stored(group, v);
            if read_outside {
                let at = self.storage(v, out_ptr.get(&v).cloned())?;
                code.push(format!("{at}[j] = t{};", v.index()));
                stores.push((v, at));
            }
        }
        self.line(&format!("for (int j = threadIdx.x; j < {n}; j += blockDim.x) {{"));
        for c in code {
            self.line(&format!("    {c}"));
        }
        self.line("}");
        self.line("__syncthreads();");
        for (v, at) in stores {
            self.held.insert(v, Held::Mem(at));
        }
        Ok(())
    }

    fn get(&self, v: ValueId, o: ValueId) -> Result<Held, EmitError> {
        self.held.get(&o).cloned().ok_or_else(|| EmitError(format!("{v} reads {o}, not available")))
    }

    /// A value that is not part of a fused loop.
    fn value(&mut self, v: ValueId, dst: Option<String>) -> Result<(), EmitError> {
        let node = self.graph.node(v).clone();
        let ops = self.graph.operands(v);
        let n = self.len(v);
        self.comment(v);
        let h = match node.op {
            Op::Input(_) | Op::State(_) | Op::Param(_) | Op::Seed(_) => {
                return Err(EmitError(format!("leaf {v} is not among the stage's inputs")))
            }
            Op::Const(_) | Op::DimValue(_) => {
                let c = self.plan.compute::<f32>(self.graph, v, &[]);
                Held::Scalar(literal(c.first().copied().unwrap_or(0.0)))
            }
            Op::MatVec | Op::MatVecT | Op::Outer => {
                return Err(EmitError(format!("{v}: a matrix product in a pointwise stage")))
            }
            Op::Broadcast => match self.get(v, ops[0])? {
                Held::Scalar(s) | Held::Splat(s) => Held::Splat(s),
                // In the lane form memory is only ever an input: any thread may read it.
                Held::Mem(p) => {
                    self.line(&format!("const float u{} = {p}[0];", v.index()));
                    Held::Splat(format!("u{}", v.index()))
                }
                // Element 0 is another thread's.
                Held::Lanes(_) => return self.not_lane(),
            },
            Op::Slice { .. } => {
                let offset = self.plan.offset(v);
                match self.get(v, ops[0])? {
                    Held::Mem(p) => Held::Mem(format!("({p} + {offset})")),
                    Held::Lanes(pieces) => {
                        let units = self.lane.unwrap_or(0);
                        if units == 0 || !offset.is_multiple_of(units) || !n.is_multiple_of(units) {
                            return self.not_lane();
                        }
                        match pieces.get(offset / units..(offset + n) / units) {
                            Some(p) => Held::Lanes(p.to_vec()),
                            None => return self.not_lane(),
                        }
                    }
                    other => other,
                }
            }
            Op::Unary(_) | Op::Binary(_) => {
                // Scalars and splats only (vectors go through fused loops).
                let mut args = Vec::new();
                for &o in &ops {
                    args.push(match self.get(v, o)? {
                        Held::Scalar(x) | Held::Splat(x) => x,
                        Held::Mem(p) => format!("{p}[0]"),
                        Held::Lanes(_) => return self.not_lane(),
                    });
                }
                self.line(&format!("const float u{} = {};", v.index(), op_expr(v, &node.op, &args)?));
                let name = format!("u{}", v.index());
                if self.graph.ty(v).vector_dim().is_some() {
                    Held::Splat(name)
                } else {
                    Held::Scalar(name)
                }
            }
            Op::Reduce(op) => {
                let m = self.len(ops[0]);
                let sum = match self.get(v, ops[0])? {
                    Held::Scalar(s) | Held::Splat(s) => format!("({s}) * {}", literal(m as f32)),
                    Held::Mem(p) if self.lane.is_none() => {
                        self.reduces = true;
                        format!("cellc_block_sum({p}, {m}, red)")
                    }
                    // A row reduction needs the whole row: block form.
                    Held::Mem(_) | Held::Lanes(_) => return self.not_lane(),
                };
                let expr = match op {
                    ReduceOp::Sum => sum,
                    ReduceOp::Mean => format!("{sum} / {}", literal(m as f32)),
                };
                self.line(&format!("const float u{} = {expr};", v.index()));
                Held::Scalar(format!("u{}", v.index()))
            }
            Op::Pad { .. } if self.lane.is_some() => {
                // Zeros around this thread's pieces of the operand.
                let units = self.lane.unwrap_or(0);
                let offset = self.plan.offset(v);
                let len = self.len(ops[0]);
                let inner = self.get(v, ops[0])?;
                let (Some(inner), true) =
                    (self.pieces(&inner, len), offset.is_multiple_of(units) && n.is_multiple_of(units))
                else {
                    return self.not_lane();
                };
                let mut pieces = vec!["0.0f".to_string(); offset / units];
                pieces.extend(inner);
                pieces.resize(n / units, "0.0f".to_string());
                let h = Held::Lanes(pieces);
                if let Some(out) = dst {
                    self.store_pieces(&out, &h, n)?;
                }
                h
            }
            Op::Pad { .. } => {
                let out = self.storage(v, dst)?;
                let offset = self.plan.offset(v);
                let len = self.len(ops[0]);
                let src = match self.get(v, ops[0])? {
                    Held::Scalar(x) | Held::Splat(x) => x,
                    Held::Mem(p) => format!("{p}[j - {offset}]"),
                    Held::Lanes(_) => return Err(EmitError(format!("{v}: lane value in block form"))),
                };
                self.line(&format!(
                    "for (int j = threadIdx.x; j < {n}; j += blockDim.x) {out}[j] = (j >= {offset} && j < {}) ? {src} : 0.0f;",
                    offset + len
                ));
                self.line("__syncthreads();");
                Held::Mem(out)
            }
            Op::Concat if self.lane.is_some() => {
                // This thread's pieces of every operand, in order.
                let mut pieces = Vec::new();
                for &o in &ops {
                    let h = self.get(v, o)?;
                    match self.pieces(&h, self.len(o)) {
                        Some(p) => pieces.extend(p),
                        None => return self.not_lane(),
                    }
                }
                let h = Held::Lanes(pieces);
                if let Some(out) = dst {
                    self.store_pieces(&out, &h, n)?;
                }
                h
            }
            Op::Concat => {
                let out = self.storage(v, dst)?;
                let mut at = 0usize;
                for &o in &ops {
                    let l = self.len(o);
                    let src = match self.get(v, o)? {
                        Held::Scalar(x) | Held::Splat(x) => x,
                        Held::Mem(p) => format!("{p}[j]"),
                        Held::Lanes(_) => return Err(EmitError(format!("{v}: lane value in block form"))),
                    };
                    self.line(&format!(
                        "for (int j = threadIdx.x; j < {l}; j += blockDim.x) {out}[{at} + j] = {src};"
                    ));
                    at += l;
                }
                self.line("__syncthreads();");
                Held::Mem(out)
            }
        };
        self.held.insert(v, h);
        Ok(())
    }
}

/// A `//` comment that stays one: no control characters (a lone carriage
/// return may end a line) and no trailing backslash (it would splice the
/// next line of code into the comment).
fn comment_safe(text: &str) -> String {
    let text: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    text.trim_end_matches(|c: char| c == '\\' || c.is_whitespace()).to_string()
}

/// `p[offset + j]`, written `p[j]` at offset 0.
fn index(p: &str, offset: usize) -> String {
    if offset == 0 {
        format!("{p}[j]")
    } else {
        format!("{p}[{offset} + j]")
    }
}

/// The C expression of an elementwise op on argument expressions. Each
/// operation mirrors the interpreter's definition (`interp.rs`).
fn op_expr(v: ValueId, op: &Op, a: &[String]) -> Result<String, EmitError> {
    let arity = match op {
        Op::Unary(_) | Op::Broadcast => 1,
        Op::Binary(_) => 2,
        other => return Err(EmitError(format!("{v}: {other:?} is not an elementwise operation"))),
    };
    if a.len() != arity {
        return Err(EmitError(format!("{v}: {} takes {arity} operands, found {}", op.mnemonic(), a.len())));
    }
    let (x, y) = (a[0].as_str(), a.get(1).map_or("", String::as_str));
    Ok(match op {
        Op::Unary(u) => match u {
            UnaryOp::Neg => format!("-({x})"),
            UnaryOp::Copy => format!("({x})"),
            UnaryOp::Sigmoid => format!("cellc_sigmoid({x})"),
            UnaryOp::Tanh => format!("tanhf({x})"),
            UnaryOp::Relu => format!("cellc_relu({x})"),
            UnaryOp::Exp => format!("expf({x})"),
            UnaryOp::Log => format!("logf({x})"),
            UnaryOp::Sqrt => format!("sqrtf({x})"),
            UnaryOp::Rsqrt => format!("(1.0f / sqrtf({x}))"),
            UnaryOp::Abs => format!("fabsf({x})"),
            UnaryOp::Softplus => format!("cellc_softplus({x})"),
            UnaryOp::Silu => format!("cellc_silu({x})"),
            UnaryOp::Step => format!("cellc_step({x})"),
            UnaryOp::Sign => format!("cellc_sign({x})"),
        },
        Op::Binary(b) => match b {
            BinaryOp::Add => format!("({x} + {y})"),
            BinaryOp::Sub => format!("({x} - {y})"),
            BinaryOp::Mul => format!("({x} * {y})"),
            BinaryOp::Div => format!("({x} / {y})"),
            BinaryOp::Min => format!("cellc_min({x}, {y})"),
            BinaryOp::Max => format!("cellc_max({x}, {y})"),
            BinaryOp::Ge => format!("cellc_ge({x}, {y})"),
        },
        // A broadcast's value is its scalar operand's.
        _ => x.to_string(),
    })
}

/// An exact `float` literal (Rust's shortest round-trip form).
fn literal(x: f32) -> String {
    if x.is_nan() {
        "__int_as_float(0x7fc00000)".into()
    } else if x.is_infinite() {
        if x > 0.0 {
            "__int_as_float(0x7f800000)".into()
        } else {
            "__int_as_float(0xff800000)".into()
        }
    } else {
        format!("{x:e}f")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dims::Bindings;
    use crate::program::Steps;

    #[test]
    fn comments_cannot_swallow_the_next_line() {
        assert_eq!(comment_safe("// a \\\\ b \\"), "// a \\\\ b");
        assert_eq!(comment_safe("// x\ry\n"), "// x y");
    }

    /// A `[1]` state beside an `[H]` one makes the unit 1: fine for a small
    /// H, the block form once H would need more than MAX_PIECES pieces.
    #[test]
    fn lane_form_only_up_to_max_pieces() {
        let src = "cell two {\n input x[H]\n state h[H], g[1]\n param w[1]\n \
                   h' = tanh(x + h)\n g' = sigmoid(g * w)\n output h'\n}\n";
        let compiled = crate::compile("two.cell", src);
        let module = compiled.module.expect("compiles");
        let steps = Steps::compile(module.cell("two").expect("cell")).expect("verifies");
        let units = |h: usize| -> Vec<usize> {
            let sizes: Bindings = [("H".to_string(), h)].into_iter().collect();
            let program = steps.program(&sizes).expect("sizes");
            let kernels = emit_cell(&steps.forward, &steps.backward, &program, None).expect("emits");
            kernels.iter().map(|k| k.units).collect()
        };
        let small = units(MAX_PIECES);
        assert!(!small.is_empty() && small.iter().all(|&u| u == 1), "{small:?}");
        let large = units(MAX_PIECES + 1);
        assert!(large.contains(&0), "{large:?}");
    }

    /// A size of 0 through the API is an error (fixing the program), not a panic.
    #[test]
    fn zero_sizes_are_an_error() {
        let src =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../cells/layernorm_lstm.cell"))
                .expect("shipped cell");
        let compiled = crate::compile("layernorm_lstm.cell", &src);
        let module = compiled.module.expect("compiles");
        let steps = Steps::compile(&module.cells[0]).expect("verifies");
        let sizes: Bindings = [("H".to_string(), 0), ("I".to_string(), 0)].into_iter().collect();
        let err = steps.program(&sizes).expect_err("a zero size");
        assert!(err.to_string().contains("not positive"), "{err}");
    }
}
