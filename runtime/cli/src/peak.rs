//! `cellc peak`: this machine's measured arithmetic peak (f32 fused
//! multiply-adds, bf16 dot products and AMX tile products where it has them), on one thread and
//! on several at once: what every rate `cellc bench` reports is a
//! fraction of.

use cellc_runtime::backend::cpu::peak::{measure, Peak, PeakKind};
use cellc_runtime::{Precision, RuntimeError};

#[derive(Debug, clap::Args)]
pub struct PeakArgs {
    /// Threads that run at once (default: one, then every usable core).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub threads: Vec<u64>,
    /// Seconds each measurement runs (the best of its runs is kept).
    #[arg(long, default_value_t = 0.5)]
    pub min_time: f64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// The peak of the products `cellc bench` times at `precision` on
/// `threads` threads: for bf16, AMX's tile products where the process may
/// use them, else bf16 dot products where the processor has them, else f32
/// multiply-adds (bf16 products then run at the f32 rate); `None` off
/// x86-64 or without FMA.
pub fn for_products(precision: Precision, threads: usize) -> Option<Peak> {
    let measured = |kind| measure(kind, threads, 0.2).ok();
    match precision {
        Precision::Bf16 => measured(PeakKind::Bf16Tiles)
            .or_else(|| measured(PeakKind::Bf16Dot))
            .or_else(|| measured(PeakKind::F32Fma)),
        _ => measured(PeakKind::F32Fma),
    }
}

pub fn peak(args: &PeakArgs) -> Result<(), RuntimeError> {
    let cores = cellc_runtime::backend::cpu::threads::usable_cores();
    let threads: Vec<usize> = if args.threads.is_empty() {
        vec![1, cores]
    } else {
        args.threads.iter().map(|&t| t as usize).collect()
    };
    let mut peaks = Vec::new();
    for kind in PeakKind::ALL {
        for &t in &threads {
            match measure(kind, t, args.min_time) {
                Ok(p) => peaks.push(p),
                // A processor without bf16 instructions has only the f32 peak.
                Err(_) if kind != PeakKind::F32Fma => break,
                Err(e) => return Err(e),
            }
        }
    }
    let name = PeakKind::name;
    if args.json {
        let rows: Vec<String> = peaks
            .iter()
            .map(|p| {
                format!(
                    "{{\"kind\": \"{}\", \"isa\": \"{}\", \"threads\": {}, \"gflops\": {:.3}}}",
                    name(p.kind),
                    p.isa,
                    p.threads,
                    p.flops / 1e9
                )
            })
            .collect();
        println!("{{\"usable_cores\": {cores}, \"peaks\": [{}]}}", rows.join(", "));
    } else {
        for p in &peaks {
            println!(
                "{} ({}) on {} thread{}: {:.1} GFLOP/s",
                name(p.kind),
                p.isa,
                p.threads,
                if p.threads == 1 { "" } else { "s" },
                p.flops / 1e9
            );
        }
    }
    Ok(())
}
