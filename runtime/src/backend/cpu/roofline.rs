//! What this machine's GEMMs alone sustain on exactly the products a
//! model's forward pass runs: each hoisted product once over every row,
//! each per-step product at every step's batch, through the same kernels
//! and thread count as the CPU back end. `cellc bench` prints it next
//! to the whole model's rate, so "how close to the GEMM bound" is measured,
//! not guessed.

use super::gemm::{matmul, View};
use super::host::SharedRows;
use super::panels::{PackedB, Rows};
use super::product::multiply;
use crate::cell::{CompiledCell, Layer};
use crate::error::{Result, RuntimeError};
use cellc::ir::Op;
use cellc::schedule::{Placement, StageKind};
use std::time::Instant;

/// One product `[rows, k] · [k, m]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Product {
    rows: usize,
    k: usize,
    m: usize,
    /// Through the packed-panel kernel, split by panels across the threads
    /// (per step), or through `gemm` with the rows shared out (hoisted).
    per_step: bool,
}

/// GEMM-only throughput of the forward of `cell` at `layers`' sizes, each
/// run in `directions` directions, on a batch with these lengths: `(flops
/// per pass, seconds per pass)`, the median of repeated passes over at
/// least `min_time` seconds.
pub fn forward_gemms(
    (cell, layers, directions): (&CompiledCell, &[Layer], usize),
    lengths: &[usize],
    threads: usize,
    min_time: f64,
) -> Result<(f64, f64)> {
    let tokens: usize = lengths.iter().sum();
    let steps = lengths.iter().copied().max().unwrap_or(0);
    let batch_sizes: Vec<usize> = (0..steps).map(|s| lengths.iter().filter(|&&l| l > s).count()).collect();
    let mut products = Vec::new();
    for layer in layers {
        let graph = &cell.forward;
        for stage in layer.schedule.forward.iter().filter(|s| s.kind == StageKind::Gemm) {
            for &v in &stage.values {
                if graph.node(v).op != Op::MatVec {
                    continue;
                }
                let (m, k) = layer.forward_shapes.shape(graph.operands(v)[0]);
                for _ in 0..directions {
                    match stage.placement {
                        Placement::EachStep => products.extend(batch_sizes.iter().map(|&rows| Product {
                            rows,
                            k,
                            m,
                            per_step: true,
                        })),
                        _ => products.push(Product { rows: tokens, k, m, per_step: false }),
                    }
                }
            }
        }
    }
    let flops: f64 = products.iter().map(|p| 2.0 * (p.rows * p.k * p.m) as f64).sum();
    let largest = |f: fn(&Product) -> usize| products.iter().map(f).max().unwrap_or(0);
    let x: Vec<f32> = (0..largest(|p| p.rows * p.k)).map(|i| ((i % 97) as f32) * 0.01).collect();
    let w: Vec<f32> = (0..largest(|p| p.k * p.m)).map(|i| ((i % 89) as f32) * 0.01).collect();
    let mut y = vec![0.0f32; largest(|p| p.rows * p.m)];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|e| RuntimeError::Backend { backend: "cpu".into(), message: e.to_string() })?;
    let mut packed: std::collections::HashMap<(usize, usize), PackedB> = Default::default();
    for p in products.iter().filter(|p| p.per_step) {
        packed.entry((p.k, p.m)).or_insert_with(|| PackedB::of(&w[..p.k * p.m], p.k, p.m));
    }
    let (x, w, packed) = (&x, &w, &packed);
    // One parallel region a pass, as the back end's loop: each thread its
    // share of every product (its panels of a per-step one, a block of
    // rows of a hoisted one), with no barrier between products.
    let pass = |y: &mut [f32]| {
        let yp = SharedRows::of(y);
        rayon::broadcast(|ctx| {
            let (i, parts) = (ctx.index(), ctx.num_threads());
            for p in &products {
                if p.per_step {
                    let Some(b) = packed.get(&(p.k, p.m)) else { continue };
                    // SAFETY: x and y hold the largest product's operands;
                    // threads write disjoint panels of y.
                    unsafe {
                        let rows = Rows { y: yp.at(0), ldy: p.m, a: x.as_ptr(), lda: p.k, m: p.rows };
                        multiply(rows, b, b.share(i, parts), false)
                    };
                } else {
                    let (from, to) = (p.rows * i / parts, p.rows * (i + 1) / parts);
                    // SAFETY: blocks of rows are disjoint; buffers as above.
                    unsafe {
                        matmul(
                            View::rows(yp.at(from * p.m), to - from, p.m, p.m),
                            View::rows(x.as_ptr().add(from * p.k), to - from, p.k, p.k),
                            View::rows(w.as_ptr(), p.k, p.m, p.m),
                            false,
                        )
                    }
                }
            }
        });
    };
    let mut times = Vec::new();
    pool.install(|| {
        let pass = &pass;
        pass(&mut y); // warm-up
        let started = Instant::now();
        while times.len() < 3 || (started.elapsed().as_secs_f64() < min_time && times.len() < 1000) {
            let t0 = Instant::now();
            pass(&mut y);
            times.push(t0.elapsed().as_secs_f64());
        }
    });
    times.sort_by(f64::total_cmp);
    Ok((flops, times[times.len() / 2]))
}
