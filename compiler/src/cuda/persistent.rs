//! The step loop as one kernel: a side's per-step stages (products by
//! weight matrices and per-row kernels), all steps, in one cooperative
//! launch with the weights in shared memory for the whole sequence.
//!
//! Each block owns a share of each product's output columns and keeps
//! those rows of the weight (rounded to the product's precision) in its
//! dynamic shared memory from the first step to the last; a step reads
//! only the states from global memory. Products in bf16, fp16 and TF32
//! run on the tensor cores (the prelude's `cellc_mma_product`, where the
//! architecture has `mma.sync`), in f32 on the CUDA cores. Where a per-row stage in the lane
//! form follows a product and reads the product only at its own units, the
//! block owns whole units (unit `u` of every piece of the product: an
//! LSTM's four gates of unit `u`), computes the stage for those units right
//! after the product, and needs no grid-wide barrier in between. Otherwise
//! every stage is separated from the next by a grid-wide barrier
//! (`cellc_grid_sync`), as is each step from the next; a stage with a row
//! reduction (LayerNorm) runs one block per row, as its own kernel does.
//!
//! ```text
//! extern "C" __global__ void NAME(const unsigned long long* __restrict__ desc, int steps,
//!                                 float* __restrict__ scratch, unsigned* __restrict__ barrier)
//! ```
//!
//! - `desc` starts with a header of two words per product, in the order of
//!   [`StepLoop::products`]: the weight's address and its precision's code
//!   ([`precision_code`]). Then one record of [`StepLoop::record_len`]
//!   words per step, in the order the steps run: the step's rows `n`, then
//!   for each piece of work in order, a product's `x`, `x`'s row stride,
//!   `y`, `y`'s row stride (addresses of the step's first row, strides in
//!   floats), or a per-row stage's pointer table at the step's first row
//!   (the stage kernel's row ABI).
//! - `scratch`: [`Kernel::scratch`] floats per block; `barrier`: two words,
//!   zero at launch.
//! - Launched cooperatively with [`StepLoop::shared_bytes`] of dynamic
//!   shared memory, at most [`BLOCK`] threads a block (the reduction
//!   buffer's slots), on any grid whose blocks can all be resident at once.

use super::{row_function, EmitError, Kernel, BLOCK};
use crate::ir::{Graph, Op, ValueId};
use crate::kernel::{Item, KernelPlan, Kind};
use crate::precision::Precision;
use crate::shapes::Shapes;
use std::collections::HashSet;
use std::fmt::Write;

/// One product of a step: `y = x · Wᵀ` (`matvec`) or `y = x · W`
/// (`matvect`) with `W` the `heads` blocks `[m, n]` at one address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Product {
    /// The product's value.
    pub value: ValueId,
    /// `matvect` (`x · W`) rather than `matvec` (`x · Wᵀ`).
    pub transposed: bool,
    /// The weight's blocks (heads).
    pub heads: usize,
    /// Rows of each block.
    pub m: usize,
    /// Columns of each block.
    pub n: usize,
}

impl Product {
    /// Product `v` of `graph` at `shapes`, if it is a `matvec` or `matvect`.
    pub fn of(graph: &Graph, shapes: &Shapes, v: ValueId) -> Result<Product, EmitError> {
        let transposed = match graph.node(v).op {
            Op::MatVec => false,
            Op::MatVecT => true,
            ref other => return Err(EmitError(format!("{v}: {other:?} is no per-step product"))),
        };
        let w = *graph.operands(v).first().ok_or_else(|| EmitError(format!("{v} has no matrix")))?;
        let (heads, m, n) = shapes.block(w);
        Ok(Product { value: v, transposed, heads, m, n })
    }

    /// Output columns per head, and the length summed over.
    fn out_and_k(self) -> (usize, usize) {
        if self.transposed {
            (self.n, self.m)
        } else {
            (self.m, self.n)
        }
    }

    /// Output columns in all.
    pub fn columns(self) -> usize {
        self.heads * self.out_and_k().0
    }

    /// Floats between two of a block's weight rows in shared memory: the
    /// row's length made odd, so the threads of a warp reading one element
    /// of each of their rows hit different banks.
    fn stride(self) -> usize {
        self.out_and_k().1 | 1
    }
}

/// One piece of a step's work, in schedule order.
#[derive(Clone, Copy, Debug)]
pub enum Work<'a> {
    /// The per-step products of a GEMM stage.
    Products(&'a [Product]),
    /// A per-row stage: its kernel (whose row function the loop calls) and plan.
    Rows(&'a Kernel, &'a KernelPlan),
}

/// The code of a [`Precision`] in a step-loop descriptor (and
/// `cellc_round`'s argument).
pub fn precision_code(p: Precision) -> u64 {
    match p {
        Precision::F32 => 0,
        Precision::Bf16 => 1,
        Precision::F16 => 2,
        Precision::Tf32 => 3,
    }
}

/// How a block's share of a product is chosen: `units` units split evenly
/// over the grid, each block taking output column `p * units + u` of every
/// piece `p` for each of its units `u`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Share {
    units: usize,
    pieces: usize,
}

/// A generated step-loop kernel and what its launch needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepLoop {
    /// The kernel ([`Kernel::cooperative`]; its `scratch` is per block).
    pub kernel: Kernel,
    /// Every product, in the order of the descriptor's header and records.
    pub products: Vec<Product>,
    /// Per-row stages in the loop.
    pub row_stages: usize,
    /// Each product's share, in `products` order.
    shares: Vec<Share>,
    /// Grid-wide barriers per step.
    pub barriers_per_step: usize,
}

impl StepLoop {
    /// Words of the descriptor's header.
    pub fn header_len(&self) -> usize {
        header_words(self.products.len())
    }

    /// Words of one step's record.
    pub fn record_len(&self) -> usize {
        record_words(self.products.len(), self.row_stages)
    }

    /// Bytes of dynamic shared memory a block of a `grid`-block launch
    /// needs: its rows of every weight, then the reduction buffer; `None`
    /// where the kernel's 32-bit share arithmetic cannot take the grid
    /// (a product's units times the grid past 2^32).
    pub fn shared_bytes(&self, grid: usize) -> Option<usize> {
        if self.shares.iter().any(|s| s.units.saturating_mul(grid + 1) > u32::MAX as usize) {
            return None;
        }
        let weights: usize = self
            .products
            .iter()
            .zip(&self.shares)
            .map(|(p, s)| s.pieces * s.units.div_ceil(grid.max(1)) * p.stride())
            .sum();
        Some(4 * (weights + BLOCK as usize))
    }
}

/// The descriptor's header: two words per product.
fn header_words(products: usize) -> usize {
    2 * products
}

/// A step's record: its rows, four words per product, one per per-row stage.
fn record_words(products: usize, row_stages: usize) -> usize {
    1 + 4 * products + row_stages
}

/// The step loop over `work` (one step's stages, in order), named `name`.
pub fn emit(name: &str, work: &[Work]) -> Result<StepLoop, EmitError> {
    let mut products = Vec::new();
    let mut shares = Vec::new();
    let mut fused_after = HashSet::new();
    let mut row_stages = 0;
    let mut scratch = 0;
    for (i, w) in work.iter().enumerate() {
        match *w {
            Work::Products(ps) => {
                let next = match work.get(i + 1) {
                    Some(&Work::Rows(k, plan)) if k.units > 0 => Some((k.units, plan)),
                    _ => None,
                };
                let values: Vec<ValueId> = ps.iter().map(|p| p.value).collect();
                let fused = next.filter(|&(units, plan)| {
                    ps.iter().all(|p| p.columns().is_multiple_of(units)) && lane_wise(plan, &values)
                });
                if fused.is_some() {
                    fused_after.insert(i + 1);
                }
                for &p in ps {
                    shares.push(match fused {
                        Some((units, _)) => Share { units, pieces: p.columns() / units },
                        None => Share { units: p.columns(), pieces: 1 },
                    });
                    products.push(p);
                }
            }
            Work::Rows(k, _) => {
                if k.whole_sequence {
                    return Err(EmitError(format!("{}: a whole-sequence stage in a step loop", k.name)));
                }
                row_stages += 1;
                scratch = scratch.max(k.scratch);
            }
        }
    }

    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: every step of the loop in one cooperative launch; {} product(s) with their weights in shared memory.",
        products.len()
    );
    // No `__launch_bounds__`: with one, ptxas spills in some loops at 40
    // registers (sm_80, NVRTC 13.0). The reduction buffer has BLOCK slots,
    // and launches never have more threads (`Device::block_size`).
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}(const unsigned long long* __restrict__ desc, int steps, float* __restrict__ scratch, unsigned* __restrict__ barrier) {{"
    );
    src.push_str("    CELLC_DYNAMIC_SHARED(smem);\n");
    // 32-bit arithmetic throughout (a 64-bit division is a function call
    // whose ABI spills): [`StepLoop::shared_bytes`] refuses a grid whose
    // units times blocks pass 2^32.
    src.push_str("    const unsigned G = gridDim.x, b = blockIdx.x;\n");
    // Each product's share and its rows of the weight, loaded once.
    let mut offset = String::from("0");
    for (p, (product, share)) in products.iter().zip(&shares).enumerate() {
        let (out, k) = product.out_and_k();
        let (units, pieces, stride) = (share.units, share.pieces, product.stride());
        let (m, n) = (product.m, product.n);
        let at = if product.transposed { "kk * N + oo" } else { "oo * N + kk" };
        let _ = writeln!(
            src,
            "    // product {p}: {} ({} {}x[{m}, {n}]), {pieces} piece(s) of {units} units",
            product.value,
            if product.transposed { "matvect" } else { "matvec" },
            product.heads
        );
        let _ = writeln!(
            src,
            "    const int u0_{p} = (int)(b * {units}u / G), own_{p} = (int)((b + 1) * {units}u / G) - u0_{p};"
        );
        let _ = writeln!(src, "    float* const w_{p} = smem + {offset};");
        let _ = writeln!(src, "    const int prec_{p} = (int)desc[{}];", 2 * p + 1);
        let _ = writeln!(src, "    {{");
        let _ = writeln!(src, "        const float* const W = (const float*)desc[{}];", 2 * p);
        let _ = writeln!(src, "        const int N = {n};");
        let _ = writeln!(
            src,
            "        for (int e = threadIdx.x; e < {pieces} * own_{p} * {k}; e += blockDim.x) {{"
        );
        let _ = writeln!(src, "            const int c = e / {k}, kk = e - c * {k}, piece = c / own_{p};");
        let _ = writeln!(src, "            const int o = piece * {units} + u0_{p} + (c - piece * own_{p}), head = o / {out}, oo = o - head * {out};");
        let _ = writeln!(
            src,
            "            w_{p}[c * {stride} + kk] = cellc_round(W[(size_t)head * {} + {at}], prec_{p});",
            m * n
        );
        let _ = writeln!(src, "        }}");
        let _ = writeln!(src, "    }}");
        offset = format!("{offset} + {pieces} * (({units} + G - 1) / G) * {stride}");
    }
    let _ = writeln!(src, "    float* const red = smem + {offset};");
    let _ = writeln!(src, "    (void)red;");
    src.push_str("    __syncthreads();\n");
    let _ = writeln!(src, "    for (int step = 0; step < steps; ++step) {{");
    let _ = writeln!(
        src,
        "        const unsigned long long* const rec = desc + {} + (size_t)step * {};",
        header_words(products.len()),
        record_words(products.len(), row_stages)
    );
    src.push_str("        const int n = (int)rec[0];\n");
    let (mut word, mut p, mut barriers) = (1, 0, 0);
    for (i, w) in work.iter().enumerate() {
        match *w {
            Work::Products(ps) => {
                for product in ps {
                    product_code(&mut src, p, *product, shares[p], word);
                    word += 4;
                    p += 1;
                }
            }
            Work::Rows(k, _) => {
                let _ = writeln!(src, "        {{ // {}", k.name);
                let _ = writeln!(src, "            float* const* const table = (float* const*)rec[{word}];");
                let slots = k.inputs.len() + k.outputs.len();
                let f = row_function(&k.name);
                if fused_after.contains(&i) {
                    // The block's own units, whose product columns it computed.
                    let owner = p - 1;
                    let _ = writeln!(
                        src,
                        "            for (int e = threadIdx.x; e < n * own_{owner}; e += blockDim.x) {{"
                    );
                    let _ = writeln!(src, "                const int r = e / own_{owner};");
                    let _ = writeln!(
                        src,
                        "                {f}(table + (size_t)r * {slots}, u0_{owner} + e - r * own_{owner});"
                    );
                    src.push_str("            }\n");
                } else if k.units > 0 {
                    let u = k.units;
                    let _ = writeln!(
                        src,
                        "            for (int e = (int)(b * blockDim.x + threadIdx.x); e < n * {u}; e += (int)(G * blockDim.x)) {{"
                    );
                    let _ = writeln!(src, "                const int r = e / {u};");
                    let _ = writeln!(src, "                {f}(table + (size_t)r * {slots}, e - r * {u});");
                    src.push_str("            }\n");
                } else {
                    let s = if k.scratch > 0 {
                        format!("scratch + (size_t)b * {scratch}")
                    } else {
                        "nullptr".into()
                    };
                    src.push_str("            for (int r = (int)b; r < n; r += (int)G) {\n");
                    let _ = writeln!(src, "                {f}(table + (size_t)r * {slots}, {s}, red);");
                    src.push_str("                __syncthreads();\n            }\n");
                }
                src.push_str("        }\n");
                word += 1;
            }
        }
        if fused_after.contains(&(i + 1)) {
            src.push_str("        __syncthreads();\n");
        } else {
            src.push_str("        cellc_grid_sync(barrier);\n");
            barriers += 1;
        }
    }
    src.push_str("    }\n}\n");
    let kernel = Kernel {
        name: name.to_string(),
        source: src,
        inputs: Vec::new(),
        outputs: Vec::new(),
        scratch,
        whole_sequence: false,
        units: 0,
        cooperative: true,
    };
    Ok(StepLoop { kernel, products, row_stages, shares, barriers_per_step: barriers })
}

/// One product's code for a step: the block's columns for every row. In
/// bf16, fp16 and TF32 on tensor cores (the prelude's `cellc_mma_product`)
/// where the device has them; otherwise, and in f32, four rows a thread at
/// a time (a weight element read from shared memory once serves four rows).
fn product_code(src: &mut String, p: usize, product: Product, share: Share, word: usize) {
    let (out, k) = product.out_and_k();
    let (units, pieces, stride) = (share.units, share.pieces, product.stride());
    let _ = writeln!(src, "        {{ // product {p}: {}", product.value);
    let _ = writeln!(src, "            const float* const x = (const float*)rec[{word}];");
    let _ = writeln!(src, "            const int xs = (int)rec[{}];", word + 1);
    let _ = writeln!(src, "            float* const y = (float*)rec[{}];", word + 2);
    let _ = writeln!(src, "            const int ys = (int)rec[{}];", word + 3);
    let _ = writeln!(src, "            const int cols = {pieces} * own_{p}, groups = (n + 3) / 4;");
    // Tensor cores for bf16, fp16 and TF32 where the architecture has
    // them (the prelude's CELLC_MMA) and the block is whole warps.
    src.push_str("#ifdef CELLC_MMA\n");
    let _ = writeln!(src, "            if (prec_{p} != 0 && (blockDim.x & 31u) == 0u) {{");
    let _ = writeln!(
        src,
        "                cellc_mma_product(x, xs, y, ys, n, w_{p}, {stride}, cols, own_{p}, {units}, u0_{p}, {out}, {k}, prec_{p});"
    );
    src.push_str("            } else\n#endif\n");
    src.push_str("            for (int e = threadIdx.x; e < groups * cols; e += blockDim.x) {\n");
    src.push_str("                const int g = e / cols, c = e - g * cols, piece = c / own_");
    let _ = writeln!(src, "{p};");
    let _ = writeln!(
        src,
        "                const int o = piece * {units} + u0_{p} + (c - piece * own_{p}), head = o / {out};"
    );
    let _ = writeln!(src, "                const float* const wr = w_{p} + c * {stride};");
    src.push_str("                const int r0 = 4 * g;\n");
    // Rows past the step's last read row r0 again (in bounds), and are not written.
    let _ = writeln!(src, "                const float* const x0 = x + (size_t)r0 * xs + head * {k};");
    src.push_str("                const float* const x1 = x0 + (r0 + 1 < n ? xs : 0);\n");
    src.push_str("                const float* const x2 = x0 + (r0 + 2 < n ? 2 * xs : 0);\n");
    src.push_str("                const float* const x3 = x0 + (r0 + 3 < n ? 3 * xs : 0);\n");
    src.push_str("                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;\n");
    let _ = writeln!(src, "                for (int kk = 0; kk < {k}; ++kk) {{");
    src.push_str("                    const float wk = wr[kk];\n");
    let _ = writeln!(src, "                    a0 = fmaf(cellc_round(x0[kk], prec_{p}), wk, a0);");
    let _ = writeln!(src, "                    a1 = fmaf(cellc_round(x1[kk], prec_{p}), wk, a1);");
    let _ = writeln!(src, "                    a2 = fmaf(cellc_round(x2[kk], prec_{p}), wk, a2);");
    let _ = writeln!(src, "                    a3 = fmaf(cellc_round(x3[kk], prec_{p}), wk, a3);");
    src.push_str("                }\n");
    src.push_str("                y[(size_t)r0 * ys + o] = a0;\n");
    src.push_str("                if (r0 + 1 < n) y[(size_t)(r0 + 1) * ys + o] = a1;\n");
    src.push_str("                if (r0 + 2 < n) y[(size_t)(r0 + 2) * ys + o] = a2;\n");
    src.push_str("                if (r0 + 3 < n) y[(size_t)(r0 + 3) * ys + o] = a3;\n");
    src.push_str("            }\n        }\n");
}

/// Whether a lane-form stage reads the products `values` only at its own
/// units: never an element through a scalar, a broadcast or a reduction
/// (which would read another block's columns).
fn lane_wise(plan: &KernelPlan, values: &[ValueId]) -> bool {
    let mut from: HashSet<ValueId> = values.iter().copied().collect();
    if plan.inputs.iter().any(|&(_, v, kind)| from.contains(&v) && kind == Kind::Scalar) {
        return false;
    }
    for item in &plan.items {
        match item {
            Item::Slice { value, src, .. } if from.contains(src) => {
                from.insert(*value);
            }
            Item::Broadcast { src, .. } | Item::Reduce { src, .. } if from.contains(src) => return false,
            Item::Scalar { args, .. } if args.iter().any(|a| from.contains(a)) => return false,
            _ => {}
        }
    }
    true
}
