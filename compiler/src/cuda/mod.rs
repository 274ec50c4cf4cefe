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
//! chained state ([`crate::kernel::lanes::Chained`]) stays in a register from row to
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

pub mod persistent;
pub mod prelude;

use crate::autodiff::Gradient;
use crate::diag::SourceMap;
use crate::ir::print::{value_line, LeafNames};
use crate::ir::{BinaryOp, Cell, Graph, Op, ReduceOp, UnaryOp, ValueId};
use crate::kernel::{FusedLoop, Item, KernelPlan, Kind, Literal, Operand};
use crate::program::{Program, Side};
use crate::schedule::{Stage, StageKind};
use crate::shapes::Shapes;
use std::collections::HashMap;
use std::fmt::Write;

/// The NVRTC options the kernels are meant to be compiled with (plus
/// `--gpu-architecture`). `--prec-div=false`: an IEEE division's slow path
/// (denormal or huge operands) is a real function call whose ABI spills
/// registers to the stack in the larger backward kernels; the fast path is
/// within 2 ulp, the same order as the GPU's `expf`/`tanhf` and as the CPU
/// back end's polynomials, which is the accuracy the project promises.
pub const NVRTC_OPTIONS: &[&str] = &["--std=c++17", "--prec-div=false"];

pub use crate::kernel::lanes::MAX_PIECES;

/// Threads per block the kernels are written for (the shared-memory
/// reduction buffer has this many slots).
pub const BLOCK: u32 = 128;

/// One generated kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kernel {
    /// The `extern "C" __global__` function's name.
    pub name: String,
    /// The function's source (no prelude).
    pub source: String,
    /// The stage's input values, in the order of their pointers in each row's `args`.
    pub inputs: Vec<ValueId>,
    /// The stage's output values, whose pointers follow the inputs' in each row's `args`.
    pub outputs: Vec<ValueId>,
    /// Scratch floats each block needs.
    pub scratch: usize,
    /// Takes sequences (`seq_start`, `seq_rows`) rather than independent rows.
    pub whole_sequence: bool,
    /// Lane form: the units `U` of each row or sequence, one thread each
    /// (see the module documentation); 0 in block form.
    pub units: usize,
    /// A step-loop kernel ([`persistent`]): launched cooperatively, every
    /// block resident at once, with dynamic shared memory.
    pub cooperative: bool,
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

/// Every kernel of `program` (the program of `cell` and `grad`, the
/// steps it was made from: [`crate::program::Steps`]), named by
/// [`Program::kernel_name`], forward first.
pub fn emit_cell(
    cell: &Cell,
    grad: &Gradient,
    program: &Program,
    sources: Option<&SourceMap>,
) -> Result<Vec<Kernel>, EmitError> {
    let names = LeafNames::of(cell, &grad.seeds);
    let cx = Context { names: Some(&names), sources };
    program
        .kernels()
        .map(|k| {
            let graph = match k.side {
                Side::Forward => &**cell,
                Side::Backward => &grad.graph,
            };
            emit_stage(graph, program.shapes(k.side), k.stage(program), &k.plan, &k.name, cx)
        })
        .collect()
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
    /// Names of the graph's leaves, for the comment on each value; `None` prints them as `?`.
    pub names: Option<&'a LeafNames<'a>>,
    /// The sources, to comment each value with the `.cell` location it came from.
    pub sources: Option<&'a SourceMap>,
}

/// The kernel for one pointwise or whole-sequence stage of `graph` at
/// `shapes`, as its kernel `plan` (the program's) decides: the lane form
/// where the plan chose it, else the block form.
pub fn emit_stage(
    graph: &Graph,
    shapes: &Shapes,
    stage: &Stage,
    plan: &KernelPlan,
    name: &str,
    cx: Context,
) -> Result<Kernel, EmitError> {
    let whole_sequence = plan.whole_sequence;
    let mut e = Emitter::new(graph, shapes, cx, plan);
    e.stage(stage)?;
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
        // The row's work as a function of its own: the step-loop kernel
        // (`persistent`) calls it too.
        let _ = writeln!(
            src,
            "__device__ __forceinline__ void {}(float* const* __restrict__ a, int j) {{",
            row_function(name)
        );
        src.push_str(&unindent(&e.body, 1));
        src.push_str("}\n");
        src.push_str(&signature(name, "", false));
        src.push_str(&lane_items(n, "rows", "row"));
        let _ = writeln!(src, "        {}(args + (size_t)row * {k}, j);", row_function(name));
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
            // The row's work, done by the whole block, as a function of its
            // own: the step-loop kernel (`persistent`) calls it too.
            let _ = writeln!(
                src,
                "__device__ __forceinline__ void {}(float* const* __restrict__ a, float* __restrict__ s, float* red) {{",
                row_function(name)
            );
            src.push_str(&unindent(&body, 1));
            src.push_str("}\n");
            src.push_str(&signature(name, &bounds, false));
            if e.reduces {
                let _ = writeln!(src, "    __shared__ float red[{BLOCK}];");
            }
            let s = if e.scratch > 0 {
                format!("scratch + (size_t)blockIdx.x * {}", e.scratch)
            } else {
                "nullptr".into()
            };
            let red = if e.reduces { "red" } else { "nullptr" };
            src.push_str("    for (int row = blockIdx.x; row < rows; row += gridDim.x) {\n");
            let _ = writeln!(src, "        {}(args + (size_t)row * {k}, {s}, {red});", row_function(name));
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
        cooperative: false,
    })
}

/// The `__device__` function doing one row of the per-row stage kernel
/// `kernel`: `(a, j)` in the lane form (the row's pointers, the thread's
/// unit), `(a, s, red)` in the block form (the row's pointers, the block's
/// scratch and its `BLOCK`-slot shared reduction buffer, each unused where
/// the stage needs none), the whole block calling it.
pub fn row_function(kernel: &str) -> String {
    format!("{kernel}_row")
}

/// `body` with its first `levels` levels of indentation (4 spaces each) taken off.
fn unindent(body: &str, levels: usize) -> String {
    let cut = " ".repeat(4 * levels);
    body.lines().map(|l| format!("{}\n", l.strip_prefix(cut.as_str()).unwrap_or(l))).collect()
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
    shapes: &'a Shapes,
    plan: &'a KernelPlan,
    cx: Context<'a>,
    body: String,
    held: HashMap<ValueId, Held>,
    /// Floats of scratch a row uses (block form; the lane form uses none).
    scratch: usize,
    /// Whether a block reduction (and its shared buffer) is needed.
    reduces: bool,
    indent: usize,
    /// Lane form: the units (every vector's length is a multiple); `None`
    /// in block form. In the lane form nothing the kernel computes goes
    /// through memory but its outputs, so no thread reads another's work.
    lane: Option<usize>,
    /// Lane form: (input slot, output index, the output's value at the
    /// row's end) of each chained state.
    chained: Vec<(usize, usize, String)>,
    /// The `.cell` line last quoted in a comment.
    quoted: Option<(crate::diag::FileId, usize)>,
}

impl<'a> Emitter<'a> {
    fn new(graph: &'a Graph, shapes: &'a Shapes, cx: Context<'a>, plan: &'a KernelPlan) -> Self {
        Emitter {
            graph,
            shapes,
            plan,
            cx,
            body: String::new(),
            held: HashMap::new(),
            scratch: 0,
            reduces: false,
            indent: 3,
            lane: plan.lanes.as_ref().map(|l| l.units),
            chained: Vec::new(),
            quoted: None,
        }
    }

    fn len(&self, v: ValueId) -> usize {
        self.shapes.elements(v)
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

    /// The plan chose the lane form for a stage that does not fit it: a
    /// bug in the plan's decision (`cellc::kernel::lanes`).
    fn no_lanes<T>(&self, v: ValueId) -> Result<T, EmitError> {
        Err(EmitError(format!("{v} does not fit the lane form the kernel plan chose")))
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

    /// Lane form: writes this thread's elements of `v` (held as `h`) to `dst`.
    fn store_pieces(&mut self, v: ValueId, dst: &str, h: &Held, len: usize) -> Result<(), EmitError> {
        let Some(pieces) = self.pieces(h, len) else { return self.no_lanes(v) };
        let units = self.lane.unwrap_or(0);
        for (i, x) in pieces.iter().enumerate() {
            self.line(&format!("{} = {x};", index(dst, i * units)));
        }
        Ok(())
    }

    /// The pointer of output slot `i` (counted from the first output).
    fn output(&self, i: usize) -> String {
        format!("a[{}]", self.plan.input_count + i)
    }

    /// Where `v` is written in place, if it is an output.
    fn destination(&self, v: ValueId) -> Option<String> {
        self.plan.output_slot(v).map(|i| self.output(i))
    }

    fn stage(&mut self, stage: &Stage) -> Result<(), EmitError> {
        if matches!(stage.kind, StageKind::Pointwise { .. }) {
            self.indent = 2;
        }
        let plan = self.plan;
        // Literals first, even where they are also inputs.
        for &(v, lit) in &plan.literals {
            let h = match lit {
                Literal::Scalar(x) => Held::Scalar(literal(x)),
                Literal::Splat(x) => Held::Splat(literal(x)),
            };
            self.held.insert(v, h);
        }
        let chained = plan.lanes.iter().flat_map(|l| &l.chained);
        for &(i, v, kind) in &plan.inputs {
            let h = match chained.clone().find(|c| c.input == i) {
                Some(c) => {
                    self.chained.push((i, c.output, String::new()));
                    Held::Lanes(vec![format!("c{i}")])
                }
                None if kind == Kind::Vector => Held::Mem(format!("a[{i}]")),
                None => Held::Scalar(format!("a[{i}][0]")),
            };
            self.held.insert(v, h);
        }
        for item in &plan.items {
            match item {
                Item::Fused(l) => self.fused(l)?,
                other => self.single(other)?,
            }
        }
        // Outputs not written in place.
        for (i, out) in plan.outputs.iter().enumerate().filter(|(_, o)| !o.in_place) {
            let (v, dst) = (out.value, self.output(i));
            let h = self.get(v, v)?;
            let n = self.len(v);
            self.line(&format!("// output {v}"));
            if self.lane.is_some() {
                self.store_pieces(v, &dst, &h, n)?;
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
            let v = plan.outputs[*o].value;
            match self.held.get(&v).and_then(|h| self.pieces(h, self.len(v))) {
                Some(p) if p.len() == 1 => *value = p[0].clone(),
                _ => return self.no_lanes(v),
            }
        }
        self.chained = chained;
        Ok(())
    }

    /// The output or the place in scratch (the kernel plan's) of a vector.
    fn storage(&mut self, v: ValueId) -> Result<String, EmitError> {
        if let Some(d) = self.destination(v) {
            return Ok(d);
        }
        let at = *self.plan.scratch.get(&v).ok_or_else(|| EmitError(format!("{v} has no storage")))?;
        self.scratch = self.scratch.max(at + self.len(v));
        Ok(format!("(s + {at})"))
    }

    /// One loop over the loop's elements; stored members are written out,
    /// the rest stay in registers. In the lane form, straight-line code for
    /// this thread's element of each piece, every member a register.
    fn fused(&mut self, l: &FusedLoop) -> Result<(), EmitError> {
        let n = l.len;
        for m in &l.members {
            self.comment(m.value);
        }
        if let Some(units) = self.lane {
            let Some(q) = (units > 0 && n.is_multiple_of(units)).then(|| n / units) else {
                return self.no_lanes(l.members[0].value);
            };
            let reg = |v: ValueId, p: usize| {
                if q == 1 {
                    format!("t{}", v.index())
                } else {
                    format!("t{}_{p}", v.index())
                }
            };
            let mut outside = Vec::with_capacity(l.outside.len());
            for &o in &l.outside {
                let h = self.get(l.members[0].value, o)?;
                match self.pieces(&h, n) {
                    Some(pieces) => outside.push(pieces),
                    None => return self.no_lanes(o),
                }
            }
            #[allow(clippy::needless_range_loop)] // `p` indexes every member's registers too
            for p in 0..q {
                for m in &l.members {
                    let args: Vec<String> = m
                        .operands
                        .iter()
                        .map(|a| match *a {
                            Operand::Member(j) => reg(l.members[j].value, p),
                            Operand::Outside(i) => outside[i][p].clone(),
                        })
                        .collect();
                    let r = reg(m.value, p);
                    let expr = op_expr(m.value, &m.op, &args)?;
                    self.line(&format!("const float {r} = {expr};"));
                    if let Some(dst) = self.destination(m.value) {
                        self.line(&format!("{} = {r};", index(&dst, p * units)));
                    }
                }
            }
            for m in &l.members {
                self.held.insert(m.value, Held::Lanes((0..q).map(|p| reg(m.value, p)).collect()));
            }
            return Ok(());
        }
        let mut outside = Vec::with_capacity(l.outside.len());
        for &o in &l.outside {
            outside.push(match self.get(l.members[0].value, o)? {
                Held::Scalar(x) | Held::Splat(x) => x,
                Held::Mem(p) => format!("{p}[j]"),
                Held::Lanes(_) => return Err(EmitError(format!("{o}, a lane value, in block form"))),
            });
        }
        let mut stores = Vec::new();
        let mut code = Vec::new();
        for m in &l.members {
            let args: Vec<String> = m
                .operands
                .iter()
                .map(|a| match *a {
                    Operand::Member(j) => format!("t{}", l.members[j].value.index()),
                    Operand::Outside(i) => outside[i].clone(),
                })
                .collect();
            code.push(format!("const float t{} = {};", m.value.index(), op_expr(m.value, &m.op, &args)?));
            if m.stored {
                let at = self.storage(m.value)?;
                code.push(format!("{at}[j] = t{};", m.value.index()));
                stores.push((m.value, at));
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

    /// An item other than a fused loop.
    fn single(&mut self, item: &Item) -> Result<(), EmitError> {
        let Some(v) = item.value() else { return Err(EmitError("a loop is not a single value".into())) };
        let n = self.len(v);
        self.comment(v);
        let h = match item {
            Item::Fused(_) => return Err(EmitError(format!("{v}: a loop is not a single value"))),
            Item::Broadcast { src, .. } => match self.get(v, *src)? {
                Held::Scalar(s) | Held::Splat(s) => Held::Splat(s),
                // In the lane form memory is only ever an input: any thread may read it.
                Held::Mem(p) => {
                    self.line(&format!("const float u{} = {p}[0];", v.index()));
                    Held::Splat(format!("u{}", v.index()))
                }
                // Element 0 is another thread's.
                Held::Lanes(_) => return self.no_lanes(v),
            },
            Item::Slice { src, offset, .. } => match self.get(v, *src)? {
                Held::Mem(p) => Held::Mem(format!("({p} + {offset})")),
                Held::Lanes(pieces) => {
                    let units = self.lane.unwrap_or(0);
                    if units == 0 || !offset.is_multiple_of(units) || !n.is_multiple_of(units) {
                        return self.no_lanes(v);
                    }
                    match pieces.get(offset / units..(offset + n) / units) {
                        Some(p) => Held::Lanes(p.to_vec()),
                        None => return self.no_lanes(v),
                    }
                }
                other => other,
            },
            Item::Scalar { op, args, splat, .. } => {
                let mut exprs = Vec::new();
                for &o in args {
                    exprs.push(match self.get(v, o)? {
                        Held::Scalar(x) | Held::Splat(x) => x,
                        Held::Mem(p) => format!("{p}[0]"),
                        Held::Lanes(_) => return self.no_lanes(v),
                    });
                }
                self.line(&format!("const float u{} = {};", v.index(), op_expr(v, op, &exprs)?));
                let name = format!("u{}", v.index());
                if *splat {
                    Held::Splat(name)
                } else {
                    Held::Scalar(name)
                }
            }
            Item::Reduce { src, op, len, .. } => {
                let m = *len;
                let sum = match self.get(v, *src)? {
                    Held::Scalar(s) | Held::Splat(s) => format!("({s}) * {}", literal(m as f32)),
                    Held::Mem(p) if self.lane.is_none() => {
                        self.reduces = true;
                        format!("cellc_block_sum({p}, {m}, red)")
                    }
                    // A row reduction needs the whole row: block form.
                    Held::Mem(_) | Held::Lanes(_) => return self.no_lanes(v),
                };
                let expr = match op {
                    ReduceOp::Sum => sum,
                    ReduceOp::Mean => format!("{sum} / {}", literal(m as f32)),
                };
                self.line(&format!("const float u{} = {expr};", v.index()));
                Held::Scalar(format!("u{}", v.index()))
            }
            Item::Pad { src, offset, .. } if self.lane.is_some() => {
                // Zeros around this thread's pieces of the operand.
                let units = self.lane.unwrap_or(0);
                let inner = self.get(v, *src)?;
                let (Some(inner), true) = (
                    self.pieces(&inner, self.len(*src)),
                    offset.is_multiple_of(units) && n.is_multiple_of(units),
                ) else {
                    return self.no_lanes(v);
                };
                let mut pieces = vec!["0.0f".to_string(); offset / units];
                pieces.extend(inner);
                pieces.resize(n / units, "0.0f".to_string());
                let h = Held::Lanes(pieces);
                if let Some(out) = self.destination(v) {
                    self.store_pieces(v, &out, &h, n)?;
                }
                h
            }
            Item::Pad { src, offset, .. } => {
                let out = self.storage(v)?;
                let len = self.len(*src);
                let src = match self.get(v, *src)? {
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
            Item::Concat { parts, .. } if self.lane.is_some() => {
                // This thread's pieces of every operand, in order.
                let mut pieces = Vec::new();
                for &o in parts {
                    let h = self.get(v, o)?;
                    match self.pieces(&h, self.len(o)) {
                        Some(p) => pieces.extend(p),
                        None => return self.no_lanes(v),
                    }
                }
                let h = Held::Lanes(pieces);
                if let Some(out) = self.destination(v) {
                    self.store_pieces(v, &out, &h, n)?;
                }
                h
            }
            Item::Concat { parts, .. } => {
                let out = self.storage(v)?;
                let mut at = 0usize;
                for &o in parts {
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
        Op::Select => 3,
        other => return Err(EmitError(format!("{v}: {other:?} is not an elementwise operation"))),
    };
    if a.len() != arity {
        return Err(EmitError(format!("{v}: {} takes {arity} operands, found {}", op.mnemonic(), a.len())));
    }
    let (x, y) = (a[0].as_str(), a.get(1).map_or("", String::as_str));
    Ok(match op {
        Op::Unary(u) => match u {
            UnaryOp::Neg => format!("-({x})"),
            UnaryOp::Copy | UnaryOp::StopGradient => format!("({x})"),
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
            BinaryOp::Gt => format!("cellc_gt({x}, {y})"),
        },
        Op::Select => format!("cellc_select({x}, {y}, {})", a[2]),
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
