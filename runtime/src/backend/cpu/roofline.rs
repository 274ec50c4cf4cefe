//! What this machine's GEMMs alone sustain on exactly the products a
//! model's forward pass runs: each hoisted product once over every row,
//! each per-step product at every step's batch, through the same `gemm`
//! calls and thread count as the CPU back end. `cellc bench` prints it next
//! to the whole model's rate, so "how close to the GEMM bound" is measured,
//! not guessed.

use super::gemm::{matmul, matmul_split, View};
use crate::error::{Result, RuntimeError};
use crate::model::Model;
use cellc::ir::Op;
use cellc::schedule::{Placement, StageKind};
use std::time::Instant;

/// One product `[rows, k] · [k, m]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Product {
    rows: usize,
    k: usize,
    m: usize,
    /// Split by output columns across the threads (per step), or the rows
    /// shared out in blocks (hoisted).
    per_step: bool,
}

/// GEMM-only throughput of `model`'s forward on a batch with these
/// lengths: `(flops per pass, seconds per pass)`, the median of repeated
/// passes over at least `min_time` seconds.
pub fn forward_gemms(model: &Model, lengths: &[usize], threads: usize, min_time: f64) -> Result<(f64, f64)> {
    let tokens: usize = lengths.iter().sum();
    let steps = lengths.iter().copied().max().unwrap_or(0);
    let batch_sizes: Vec<usize> = (0..steps).map(|s| lengths.iter().filter(|&&l| l > s).count()).collect();
    let mut products = Vec::new();
    for layer in model.layers() {
        let graph = &model.compiled().forward;
        for stage in layer.schedule.forward.iter().filter(|s| s.kind == StageKind::Gemm) {
            for &v in &stage.values {
                if graph.node(v).op != Op::MatVec {
                    continue;
                }
                let (m, k) = layer.forward_shapes.shape(graph.operands(v)[0]);
                for _ in 0..model.directions() {
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
    let threads = threads.max(1);
    let (x, w) = (&x, &w);
    let pass = |y: &mut [f32]| {
        for p in &products {
            let dst = View::rows(y.as_mut_ptr(), p.rows, p.m, p.m);
            let a = View::rows(x.as_ptr(), p.rows, p.k, p.k);
            let b = View::rows(w.as_ptr(), p.k, p.m, p.m);
            if p.per_step && p.rows <= super::gemv::MAX_ROWS {
                // The back end's path for a few rows: W itself ([m, k]), streamed.
                let (ys, xs) = (&mut y[..p.rows * p.m], &x[..p.rows * p.k]);
                super::gemv::gemv(ys, xs, &w[..p.m * p.k], p.rows, p.m, p.k, threads);
            } else if p.per_step {
                // SAFETY: x, w and y hold the largest product's operands.
                unsafe { matmul_split(dst, a, b, false, if p.m * p.k >= 64 * 64 { threads } else { 1 }) };
            } else {
                let per = p.rows.div_ceil(threads);
                let yp = SendPtr(y.as_mut_ptr());
                rayon::scope(move |s| {
                    for from in (0..p.rows).step_by(per.max(1)) {
                        let n = per.min(p.rows - from);
                        s.spawn(move |_| {
                            let yp = yp;
                            // SAFETY: blocks of rows are disjoint; buffers as above.
                            unsafe {
                                matmul(
                                    View::rows(yp.0.add(from * p.m), n, p.m, p.m),
                                    View::rows(x.as_ptr().add(from * p.k), n, p.k, p.k),
                                    b,
                                    false,
                                )
                            }
                        });
                    }
                });
            }
        }
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

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: hands disjoint row blocks of one buffer to the pool's threads.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
