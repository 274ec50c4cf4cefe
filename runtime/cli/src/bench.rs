//! `cellc bench`: times a model on synthetic data. Compilation (building
//! the model and its kernels, one warm-up run) is timed apart from the
//! measured runs.

use crate::run::{BackendChoice, DtypeChoice, KernelsChoice};
use cellc::dims::Bindings;
use cellc_runtime::{Align, CompiledCell, Input, Major, Model, ModelConfig, Precision, RuntimeError};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Lengths {
    /// Every sequence has T steps.
    Full,
    /// Lengths drawn uniformly from [T/2, T] with a fixed seed.
    Uniform,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Forward only.
    Infer,
    /// Forward keeping activations, then backward.
    Train,
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    pub cell_file: PathBuf,
    #[arg(long)]
    pub cell: Option<String>,
    /// Bind a size variable; the input size defaults to the first state's size.
    #[arg(short = 'D', value_name = "NAME=VALUE", value_parser = crate::parse_binding)]
    pub define: Vec<(String, usize)>,
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub batch: u64,
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=100000))]
    pub steps: u64,
    #[arg(long, default_value_t = 1)]
    pub layers: usize,
    #[arg(long)]
    pub bidirectional: bool,
    /// Dropout between layers (`--mode train` draws and applies its masks;
    /// inference drops nothing).
    #[arg(long, default_value_t = 0.0)]
    pub dropout: f32,
    /// Set one of the cell's rates, e.g. -R zh=0.05 (`--mode train` draws
    /// the cell's masks at its rates; inference is evaluation).
    #[arg(short = 'R', value_name = "NAME=RATE", value_parser = crate::parse_rate)]
    pub rates: Vec<(String, f32)>,
    #[arg(long, value_enum, default_value_t = Lengths::Full)]
    pub lengths: Lengths,
    #[arg(long, value_enum, default_value_t = Mode::Infer)]
    pub mode: Mode,
    #[arg(long, value_enum)]
    pub backend: Option<BackendChoice>,
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub threads: Option<u64>,
    /// CUDA backend: run each layer as a CUDA graph (captured at the first run, then relaunched).
    #[arg(long)]
    pub cuda_graphs: bool,
    /// CPU backend: how pointwise stages run.
    #[arg(long, value_enum, default_value_t = KernelsChoice::Fastest)]
    pub kernels: KernelsChoice,
    /// CPU backend: run no step fused or split by units (the products, then
    /// the pointwise stages, on whole rows; input projections before the
    /// loop), to compare.
    #[arg(long)]
    pub unfused: bool,
    /// The precision of the products of the cell's matrix parameters
    /// (`bf16`: bf16 operands, f32 sums, on the CPU and CUDA back ends;
    /// `f16` and `tf32`: fp16 or TF32 operands, f32 sums, on the CUDA back end).
    #[arg(long, value_enum, default_value_t = DtypeChoice::F32)]
    pub dtype: DtypeChoice,
    /// Inference through the streaming call (`Model::stream`): the state
    /// carried, all steps in one call on the calling thread. The default
    /// for one-step inference of a one-directional model.
    #[arg(long)]
    pub stream: bool,
    /// Least total measured time, in seconds.
    #[arg(long, default_value_t = 1.0)]
    pub min_time: f64,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    pub json: bool,
    /// After the timed runs, run a few more with the CPU back end's phases
    /// timed, and print where a pass's time goes (`profile` in `--json`).
    #[arg(long)]
    pub profile: bool,
}

/// Whether the model runs on the CPU back end.
fn on_cpu(args: &BenchArgs) -> bool {
    args.backend.unwrap_or(BackendChoice::Cpu) == BackendChoice::Cpu
}

/// The threads a CPU pass uses: `--threads`, else every core.
fn threads(args: &BenchArgs) -> usize {
    args.threads.map_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()), |n| n as usize)
}

/// SplitMix64, for reproducible lengths and data.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Matrix-product flops of one pass over `tokens` rows: 2·m·n per product
/// per row, forward (and, training, the backward's products).
fn gemm_flops(model: &Model, tokens: f64, train: bool) -> f64 {
    let mut total = 0.0;
    for layer in model.layers() {
        let per_row = |stages: &[cellc::schedule::Stage],
                       graph: &cellc::ir::Graph,
                       plan: &cellc::shapes::Shapes|
         -> f64 {
            stages
                .iter()
                .filter(|s| s.kind == cellc::schedule::StageKind::Gemm)
                .flat_map(|s| s.values.iter())
                .map(|&v| {
                    let m = graph.operands(v)[0];
                    let (r, c) = plan.shape(m);
                    let (r2, c2) = plan.shape(v);
                    // outer: the result is the matrix; matvec/matvect: the operand is.
                    2.0 * if graph.node(v).op == cellc::ir::Op::Outer {
                        (r2 * c2) as f64
                    } else {
                        (r * c) as f64
                    }
                })
                .sum()
        };
        let c = model.compiled();
        total += per_row(&layer.schedule.forward, &c.forward, &layer.forward_shapes);
        if train {
            total += per_row(&layer.schedule.backward, &c.backward.graph, &layer.backward_shapes);
        }
    }
    total * tokens * model.directions() as f64
}

pub fn bench(args: &BenchArgs) -> Result<(), RuntimeError> {
    let compile_start = Instant::now();
    let compiled = Arc::new(CompiledCell::from_file(&args.cell_file, args.cell.as_deref())?);
    let mut sizes: Bindings = args.define.iter().cloned().collect();
    crate::warn_unused_defines(&args.define, &[&compiled.forward], &args.cell_file.display().to_string());
    // The input size defaults to the first state's size (I = H, as the benchmarks use).
    let input_dim = compiled.forward.input_dim();
    let input_size = match input_dim.eval(&sizes) {
        Ok(n) => n as usize,
        Err(_) => {
            let first_state = compiled.forward.states.first().map(|s| s.dim.clone());
            let n =
                first_state.and_then(|d| d.eval(&sizes).ok()).ok_or_else(|| RuntimeError::UnboundSize {
                    size: compiled
                        .forward
                        .sizes
                        .iter()
                        .find(|s| !sizes.contains_key(*s))
                        .cloned()
                        .unwrap_or_default(),
                })?;
            n as usize
        }
    };
    sizes.retain(|k, _| compiled.forward.sizes.contains(k));
    let backend =
        crate::run::make_backend(args.backend, args.threads, args.cuda_graphs, (args.kernels, args.unfused))?;
    let config = ModelConfig { layers: args.layers, bidirectional: args.bidirectional };
    let model = Model::new(compiled, config, &sizes, Some(input_size), None, 1, backend)?
        .with_dropout(args.dropout)?
        .with_rates(&args.rates.iter().map(|(n, r)| (n.as_str(), *r)).collect::<Vec<_>>())?;
    let model = crate::run::with_dtype(model, args.dtype)?;

    let (b, t) = (args.batch as usize, args.steps as usize);
    let streaming = args.stream || (t == 1 && args.mode == Mode::Infer && !args.bidirectional);
    if streaming && (args.mode != Mode::Infer || args.bidirectional) {
        return Err(RuntimeError::NotStreamable {
            reason: "--stream times inference of a one-directional model".into(),
        });
    }
    if streaming && args.lengths != Lengths::Full && t > 1 {
        return Err(RuntimeError::NotStreamable {
            reason: "a stream advances every sequence together: use --lengths full".into(),
        });
    }
    let mut seed = 0x5eed_u64;
    let lengths: Vec<usize> = (0..b)
        .map(|_| match args.lengths {
            Lengths::Full => t,
            Lengths::Uniform => {
                (t / 2).max(1) + (splitmix(&mut seed) % (t - (t / 2).max(1) + 1) as u64) as usize
            }
        })
        .collect();
    let x: Vec<f32> = (0..b * t * input_size)
        .map(|_| (splitmix(&mut seed) >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect();
    let dy: Vec<f32> = vec![0.01; b * t * model.output_size()];
    let input = Input::Padded {
        data: &x,
        batch: b,
        steps: t,
        major: Major::BatchFirst,
        align: Align::Left,
        lengths: &lengths,
    };
    // Streaming: the synthetic data read as [T, B, I], the states carried
    // from run to run as in a live stream.
    let mut stream = if streaming { Some(model.stream(b)?) } else { None };
    let mut y = vec![0.0f32; if streaming { b * t * model.output_size() } else { 0 }];
    let mut run_once = || -> Result<(), RuntimeError> {
        if let Some(stream) = &mut stream {
            return stream.run(&x, &mut y);
        }
        match args.mode {
            Mode::Infer => model.forward(input, None).map(|_| ()),
            Mode::Train => {
                let (_, trace) = model.forward_train(input, None)?;
                model.backward(&trace, &dy, None).map(|_| ())
            }
        }
    };
    run_once()?; // warm-up: kernels compiled, caches filled
    let compile_s = compile_start.elapsed().as_secs_f64();

    let mut times: Vec<Duration> = Vec::new();
    let started = Instant::now();
    // Short calls are timed many more times: the median of a few µs needs it.
    let most_runs = if streaming { 100_000 } else { 1000 };
    while times.len() < 3 || (started.elapsed().as_secs_f64() < args.min_time && times.len() < most_runs) {
        let t0 = Instant::now();
        run_once()?;
        times.push(t0.elapsed());
    }
    times.sort();
    // Where a pass's time goes (CPU), from passes of their own, so the timed ones carry no clocks.
    let profile = if args.profile && on_cpu(args) {
        use cellc_runtime::backend::cpu::profile;
        let runs = times.len().clamp(3, 20);
        profile::take();
        profile::enable(true);
        let done = (0..runs).try_for_each(|_| run_once());
        profile::enable(false);
        done?;
        let per_pass = |s: f64| s / runs as f64;
        Some(profile::take().into_iter().map(|(p, s)| (p.name(), per_pass(s))).collect::<Vec<_>>())
    } else {
        None
    };
    let median = times[times.len() / 2].as_secs_f64();
    let min = times[0].as_secs_f64();
    let tokens: usize = lengths.iter().sum();
    let tokens_per_s = tokens as f64 / median;
    let gflops = gemm_flops(&model, tokens as f64, args.mode == Mode::Train) / median / 1e9;
    let sizes_text: Vec<String> = model.layers()[0].sizes.iter().map(|(k, v)| format!("{k}={v}")).collect();
    // The same products timed alone (CPU inference, f32): the bound the model is measured against.
    let (on_cpu, threads) = (on_cpu(args), threads(args));
    let gemm_only = match args.mode {
        Mode::Infer if on_cpu && !streaming && model.precision() == Precision::F32 => {
            let (flops, secs) = cellc_runtime::backend::cpu::roofline::forward_gemms(
                (model.compiled(), model.layers(), model.directions()),
                &lengths,
                threads,
                args.min_time.min(1.0),
            )?;
            Some(flops / secs / 1e9)
        }
        _ => None,
    };
    let gemm_only_json = gemm_only.map_or_else(String::new, |g| {
        format!(", \"gemm_only_gflops\": {g:.4}, \"gemm_fraction\": {:.4}", gflops / g)
    });
    // On the CPU, the machine's measured peak for these products at these threads.
    let peak = if on_cpu { crate::peak::for_products(model.precision(), threads) } else { None };
    let profile_json = profile.as_ref().map_or_else(String::new, |phases| {
        let each: Vec<String> = phases.iter().map(|(name, s)| format!("\"{name}\": {s:.6e}")).collect();
        format!(", \"profile\": {{{}}}", each.join(", "))
    });
    let peak_json = peak.map_or_else(String::new, |p| {
        let g = p.flops / 1e9;
        format!(
            ", \"peak_gflops\": {g:.4}, \"peak_isa\": \"{}\", \"peak_threads\": {}, \"peak_fraction\": {:.4}",
            p.isa,
            p.threads,
            gflops / g
        )
    });
    if args.json {
        println!(
            "{{\"cell\": \"{}\", \"backend\": \"{}\", \"dtype\": \"{}\", \"mode\": \"{}\", \"batch\": {b}, \"steps\": {t}, \"layers\": {}, \"bidirectional\": {}, \"dropout\": {}, \"route\": \"{}\", \"sizes\": \"{}\", \"tokens\": {tokens}, \"runs\": {}, \"median_s\": {median:.6e}, \"min_s\": {min:.6e}, \"compile_s\": {compile_s:.6e}, \"tokens_per_s\": {tokens_per_s:.6e}, \"gflops\": {gflops:.4}{gemm_only_json}{peak_json}{profile_json}}}",
            model.compiled().forward.name,
            model.backend_name(),
            model.precision(),
            if args.mode == Mode::Train { "train" } else { "infer" },
            args.layers,
            args.bidirectional,
            args.dropout,
            if streaming { "stream" } else { "batch" },
            sizes_text.join(" "),
            times.len()
        );
    } else {
        // Short calls in µs, the rest in ms.
        let (scale, unit) = if median < 1e-3 { (1e6, "µs") } else { (1e3, "ms") };
        println!(
            "{} ({}) {} on {}{}{}: B={b} T={t} tokens={tokens}: median {:.3} {unit}, min {:.3} {unit} over {} runs; {:.0} tokens/s; {:.2} GFLOP/s (matrix products); compile {:.3} s",
            model.compiled().forward.name,
            sizes_text.join(" "),
            if args.mode == Mode::Train { "train" } else { "infer" },
            model.backend_name(),
            match model.precision() {
                Precision::F32 => String::new(),
                low => format!(" with {low} products"),
            },
            if streaming { " through the streaming call" } else { "" },
            median * scale,
            min * scale,
            times.len(),
            tokens_per_s,
            gflops,
            compile_s
        );
        if let Some(g) = gemm_only {
            println!(
                "the same matrix products alone: {g:.2} GFLOP/s; the whole model runs at {:.0}% of that",
                100.0 * gflops / g
            );
        }
        if let Some(p) = peak {
            println!(
                "{:.0}% of this machine's measured peak ({:.1} GFLOP/s, {} on {} threads: `cellc peak`)",
                100.0 * gflops / (p.flops / 1e9),
                p.flops / 1e9,
                p.isa,
                p.threads
            );
        }
        if let Some(phases) = &profile {
            // Each phase's wall time per pass (the loop's threads each adding their share).
            let timed: f64 = phases.iter().map(|(_, s)| s).sum();
            println!("where a pass's time goes ({:.3} ms timed in the back end's layers):", timed * 1e3);
            for (name, s) in phases.iter().filter(|(_, s)| *s > 0.0) {
                println!("  {name:<28} {:8.3} ms  {:5.1}%", s * 1e3, 100.0 * s / timed);
            }
        }
    }
    Ok(())
}
