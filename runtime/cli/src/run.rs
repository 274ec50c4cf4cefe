//! `cellc run`: a model over a batch from safetensors files, to a
//! safetensors file — inference, or forward and backward with `--grad`.
//!
//! Files (batch-first, padded, aligned as `--align` says):
//! - input:   `input` f32 [B, T, I], `lengths` i64 [B] (optional: all T),
//!   `resets` bool (or integers) [B, T] (optional: per-step resets, the
//!   state restarting from `h0` at each nonzero step),
//!   `h0.<state>` f32 [L*D, B, size] (optional), and with `--grad`
//!   `grad_output` f32 [B, T, O*D] and optionally `grad_final.<state>`;
//! - weights: `<param>_l<k>` and `<param>_l<k>_reverse`;
//! - output:  `output` f32 [B, T, O*D] (zeros at padding),
//!   `final.<state>` [L*D, B, size]; with `--grad` also `grad.input`,
//!   `grad.<param>_l<k>[_reverse]` and `grad.h0.<state>`; with `--masks`
//!   every mask the call used: `mask.<function>#<i>_l<k>[_reverse]` (a
//!   cell's masks, [B, T, units], or a DropConnect parameter's shape) and
//!   `mask.dropout_l<k>` (dropout between layers `k` and `k + 1`, [B, T, O*D]).
//!
//! The pass runs in evaluation unless `--train` says training: then its
//! masks (the cell's, `-R` sets their rates, and `--dropout` between
//! layers) are drawn from `--seed` and `--offset`.

use cellc::dims::Bindings;
use cellc_runtime::backend::cpu::{Cpu, Kernels};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::{
    read_tensors, write_tensors, Align, CallOptions, CompiledCell, Input, Major, MaskSeed, Model,
    ModelConfig, Precision, RuntimeError, Tensor, TensorData, Weights,
};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    Reference,
    Cpu,
    Cuda,
    /// The CUDA back end on an emulated device: the generated CUDA C++
    /// compiled as host C++ with g++ and run on the CPU, to check a cell's
    /// CUDA kernels without a GPU.
    CudaEmulated,
}

/// How the CPU back end runs pointwise stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KernelsChoice {
    /// AVX-512 where the processor has it, else AVX2, else Cranelift's code (the same results).
    Fastest,
    /// Compiled by Cranelift in the process (f32x4).
    Jit,
    /// The kernel plans walked by AVX-512 code.
    Avx512,
    /// The kernel plans walked by AVX2 code (with FMA).
    Avx2,
    /// The interpreter's semantics, value by value (slow: a check).
    Interpreted,
}

impl KernelsChoice {
    fn kernels(self) -> Kernels {
        match self {
            KernelsChoice::Fastest => Kernels::Fastest,
            KernelsChoice::Jit => Kernels::Jit,
            KernelsChoice::Avx512 => Kernels::Avx512,
            KernelsChoice::Avx2 => Kernels::Avx2,
            KernelsChoice::Interpreted => Kernels::Interpreted,
        }
    }
}

/// The precision of the products of the cell's matrix parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DtypeChoice {
    /// f32 operands, f32 sums.
    #[default]
    F32,
    /// bf16 operands, f32 sums; everything else f32 (the CPU and CUDA back ends).
    Bf16,
    /// fp16 operands, f32 sums; everything else f32 (the CUDA back end).
    F16,
    /// TF32 operands, f32 sums; everything else f32 (the CUDA back end).
    Tf32,
}

impl DtypeChoice {
    pub fn precision(self) -> Precision {
        match self {
            DtypeChoice::F32 => Precision::F32,
            DtypeChoice::Bf16 => Precision::Bf16,
            DtypeChoice::F16 => Precision::F16,
            DtypeChoice::Tf32 => Precision::Tf32,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AlignChoice {
    Left,
    Right,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The .cell file (its first cell, or the one named by --cell).
    pub cell_file: PathBuf,
    /// Which cell of the file.
    #[arg(long)]
    pub cell: Option<String>,
    /// Weights: `<param>_l<k>[_reverse]` (a PyTorch state_dict saved with safetensors).
    #[arg(long)]
    pub weights: PathBuf,
    /// The batch: `input`, `lengths`, `h0.<state>`, and with --grad `grad_output`, `grad_final.<state>`.
    #[arg(long)]
    pub input: PathBuf,
    /// Where to write `output`, `final.<state>` and, with --grad, the gradients.
    #[arg(long)]
    pub out: PathBuf,
    /// Bind a size variable, e.g. -D H=256 (else inferred from the weights and the input).
    #[arg(short = 'D', value_name = "NAME=VALUE", value_parser = crate::parse_binding)]
    pub define: Vec<(String, usize)>,
    #[arg(long, default_value_t = 1)]
    pub layers: usize,
    #[arg(long)]
    pub bidirectional: bool,
    /// Where the padding is: at the end of each sequence (left) or at the start (right).
    #[arg(long, value_enum, default_value_t = AlignChoice::Left)]
    pub align: AlignChoice,
    /// Default: the fastest available.
    #[arg(long, value_enum)]
    pub backend: Option<BackendChoice>,
    /// Also run the backward and write the gradients.
    #[arg(long)]
    pub grad: bool,
    /// Threads for the CPU backend (default: all cores).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub threads: Option<u64>,
    /// CUDA backend: run each layer as a CUDA graph (captured once per shape, then relaunched).
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
    /// Training mode: draw the masks of the cell and of --dropout (else evaluation: none).
    #[arg(long)]
    pub train: bool,
    /// Training mode: the seed the masks are drawn from.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Training mode: the offset in the seed's stream (a framework's generator advances it call by call).
    #[arg(long, default_value_t = 0)]
    pub offset: u64,
    /// Set one of the cell's rates, e.g. -R zh=0.05 (else its default).
    #[arg(short = 'R', value_name = "NAME=RATE", value_parser = crate::parse_rate)]
    pub rates: Vec<(String, f32)>,
    /// Dropout between layers (training mode only), as nn.LSTM's.
    #[arg(long, default_value_t = 0.0)]
    pub dropout: f32,
    /// Also write every mask the call used (`mask.*` tensors).
    #[arg(long)]
    pub masks: bool,
}

/// The backend asked for; by default the fastest available (the CPU).
pub fn make_backend(
    choice: Option<BackendChoice>,
    threads: Option<u64>,
    cuda_graphs: bool,
    (kernels, unfused): (KernelsChoice, bool),
) -> Result<Box<dyn Device>, RuntimeError> {
    match choice.unwrap_or(BackendChoice::Cpu) {
        BackendChoice::Reference => Ok(Box::new(Reference)),
        BackendChoice::Cpu => {
            let cpu = Cpu::new(threads.unwrap_or(0) as usize, kernels.kernels())?;
            Ok(Box::new(if unfused { cpu.unfused() } else { cpu }))
        }
        BackendChoice::Cuda => {
            Ok(Box::new(cellc_runtime::backend::cuda::Cuda::gpu(0)?.with_graphs(cuda_graphs)))
        }
        BackendChoice::CudaEmulated => {
            Ok(Box::new(cellc_runtime::backend::cuda::Cuda::emulated()?.with_graphs(cuda_graphs)))
        }
    }
}

/// `model` computing its products in `--dtype`'s precision; where its
/// device has no such products, the device's error, naming the flag.
pub fn with_dtype(model: Model, dtype: DtypeChoice) -> Result<Model, RuntimeError> {
    let precision = dtype.precision();
    model.with_precision(precision).map_err(|e| match e {
        RuntimeError::Backend { backend, message } => {
            RuntimeError::Backend { backend, message: format!("{message} (`--dtype {precision}`)") }
        }
        other => other,
    })
}

/// A tensor's shape and f32 data.
type F32Tensor = (Vec<usize>, Vec<f32>);

fn take_f32(
    tensors: &mut BTreeMap<String, Tensor>,
    name: &str,
    file: &str,
) -> Result<Option<F32Tensor>, RuntimeError> {
    match tensors.remove(name) {
        None => Ok(None),
        Some(Tensor { shape, data: TensorData::F32(d) }) => Ok(Some((shape, d))),
        Some(Tensor { .. }) => {
            Err(RuntimeError::Io { path: file.into(), message: format!("`{name}` must hold f32 values") })
        }
    }
}

/// An integer tensor (a file's integers of any width, or bools) of shape `want`.
fn take_integers(
    tensors: &mut BTreeMap<String, Tensor>,
    name: &str,
    want: &[usize],
    file: &str,
) -> Result<Option<Vec<i64>>, RuntimeError> {
    match tensors.remove(name) {
        None => Ok(None),
        Some(Tensor { shape, data: TensorData::I64(values) }) => {
            expect_shape(name, &shape, want)?;
            Ok(Some(values))
        }
        Some(Tensor { .. }) => {
            Err(RuntimeError::Io { path: file.into(), message: format!("`{name}` must hold integers") })
        }
    }
}

fn expect_shape(name: &str, shape: &[usize], want: &[usize]) -> Result<(), RuntimeError> {
    if shape != want {
        let text =
            |d: &[usize]| format!("[{}]", d.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", "));
        return Err(RuntimeError::Shape { tensor: name.into(), expected: text(want), found: text(shape) });
    }
    Ok(())
}

pub fn run(args: &RunArgs) -> Result<(), RuntimeError> {
    crate::refuse_overwriting_inputs(&args.out, &[&args.cell_file, &args.weights, &args.input])
        .map_err(|message| RuntimeError::Io { path: "--out".into(), message })?;
    let compiled = Arc::new(CompiledCell::from_file(&args.cell_file, args.cell.as_deref())?);
    let state_names: Vec<String> = compiled.forward.states.iter().map(|s| s.name.clone()).collect();
    let input_file = args.input.display().to_string();
    let mut x = read_tensors(&args.input)?;
    let (shape, data) = take_f32(&mut x, "input", &input_file)?
        .ok_or_else(|| RuntimeError::Io { path: input_file.clone(), message: "no `input` tensor".into() })?;
    let [batch, steps, features] = shape[..] else {
        return Err(RuntimeError::Shape {
            tensor: "input".into(),
            expected: "[B, T, I]".into(),
            found: format!("{shape:?}"),
        });
    };
    let lengths = take_integers(&mut x, "lengths", &[batch], &input_file)?;
    let lengths = cellc_runtime::sequence::lengths_from_i64(lengths.as_deref(), batch, steps)?;
    let resets: Option<Vec<bool>> = take_integers(&mut x, "resets", &[batch, steps], &input_file)?
        .map(|flags| flags.iter().map(|&f| f != 0).collect());
    let resets = resets.as_deref();

    let weights = Weights::load(&args.weights)?;
    let sizes: Bindings = args.define.iter().cloned().collect();
    crate::warn_unused_defines(&args.define, &[&compiled.forward], &args.cell_file.display().to_string());
    let config = ModelConfig { layers: args.layers, bidirectional: args.bidirectional };
    let model = Model::new(
        compiled,
        config,
        &sizes,
        Some(features),
        Some(&weights),
        0,
        make_backend(args.backend, args.threads, args.cuda_graphs, (args.kernels, args.unfused))?,
    )?
    .with_dropout(args.dropout)?;
    let model = with_dtype(model, args.dtype)?;
    let rates: Vec<(&str, f32)> = args.rates.iter().map(|(n, r)| (n.as_str(), *r)).collect();
    let model = model.with_rates(&rates)?;
    let seed = args.train.then_some(MaskSeed { seed: args.seed, offset: args.offset });
    let ld = model.layers().len() * model.directions();
    let state_sizes = model.layers()[0].state_sizes.clone();

    // `None` when the file has none of them (the model starts from zeros
    // without the CLI allocating them); missing ones among given ones are zeros.
    let read_states =
        |prefix: &str, x: &mut BTreeMap<String, Tensor>| -> Result<Option<Vec<Vec<f32>>>, RuntimeError> {
            if !state_names.iter().any(|name| x.contains_key(&format!("{prefix}.{name}"))) {
                return Ok(None);
            }
            let mut out = Vec::new();
            for (name, &n) in state_names.iter().zip(&state_sizes) {
                let key = format!("{prefix}.{name}");
                match take_f32(x, &key, &input_file)? {
                    Some((shape, d)) => {
                        expect_shape(&key, &shape, &[ld, batch, n])?;
                        out.push(d);
                    }
                    None => out.push(vec![0.0; ld * batch * n]),
                }
            }
            Ok(Some(out))
        };
    let h0 = read_states("h0", &mut x)?;
    let align = if args.align == AlignChoice::Right { Align::Right } else { Align::Left };
    let input =
        Input::Padded { data: &data, batch, steps, major: Major::BatchFirst, align, lengths: &lengths };

    let mut out: BTreeMap<String, Tensor> = BTreeMap::new();
    let o = model.output_size();
    if args.grad {
        let (dy_shape, dy) =
            take_f32(&mut x, "grad_output", &input_file)?.ok_or_else(|| RuntimeError::Io {
                path: input_file.clone(),
                message: "--grad needs a `grad_output` tensor".into(),
            })?;
        expect_shape("grad_output", &dy_shape, &[batch, steps, o])?;
        let d_final = read_states("grad_final", &mut x)?;
        let options = CallOptions { masks: seed, resets, ..Default::default() };
        let (output, trace) = model.forward_traced(input, h0.as_deref(), &options)?;
        let grads = model.backward(&trace, &dy, d_final.as_deref())?;
        out.insert("grad.input".into(), Tensor::f32(vec![batch, steps, features], grads.d_input));
        for ((name, d), &n) in state_names.iter().zip(grads.d_h0).zip(&state_sizes) {
            out.insert(format!("grad.h0.{name}"), Tensor::f32(vec![ld, batch, n], d));
        }
        for ((name, shape), d) in model.weight_names().into_iter().zip(grads.d_params.into_iter().flatten()) {
            out.insert(format!("grad.{name}"), Tensor::f32(shape, d));
        }
        insert_forward(&mut out, &state_names, &state_sizes, output, [batch, steps, o], ld);
    } else {
        let options = CallOptions { masks: seed, resets, ..Default::default() };
        let output = model.forward_with(input, h0.as_deref(), &options)?;
        insert_forward(&mut out, &state_names, &state_sizes, output, [batch, steps, o], ld);
    }
    if args.masks {
        for m in model.cell_masks(input, seed, None)? {
            let units = m.shape[1..].iter().product::<usize>();
            let shape = if m.shape[0] == batch * steps && m.shape.len() == 2 {
                vec![batch, steps, units]
            } else {
                m.shape
            };
            out.insert(format!("mask.{}", m.name), Tensor::f32(shape, m.values));
        }
        if let Some(seed) = seed {
            for (k, rows) in model.dropout_masks(input, seed, None)?.into_iter().enumerate() {
                let width = rows.len() / (batch * steps).max(1);
                out.insert(format!("mask.dropout_l{k}"), Tensor::f32(vec![batch, steps, width], rows));
            }
        }
    }
    for unused in x.keys() {
        eprintln!("warning: {input_file}: tensor `{unused}` is not used");
    }
    write_tensors(&args.out, &out)
}

fn insert_forward(
    out: &mut BTreeMap<String, Tensor>,
    states: &[String],
    state_sizes: &[usize],
    o: cellc_runtime::Output,
    shape: [usize; 3],
    ld: usize,
) {
    out.insert("output".into(), Tensor::f32(shape.to_vec(), o.data));
    for ((name, d), &n) in states.iter().zip(o.final_states).zip(state_sizes) {
        out.insert(format!("final.{name}"), Tensor::f32(vec![ld, shape[0], n], d));
    }
}
