//! Passes over device memory the caller owns ([`Model::forward_into`],
//! [`Model::backward_from`], the tape in a reserve of that memory), as
//! a framework's CUDA tensors drive them. On the emulated device, host buffers stand in for device memory:
//! the passes give exactly (bit for bit) what the model's own passes give
//! on the same device, on every shipped cell, padded (both alignments) and
//! packed, two layers and both directions, with given and zero initial
//! states; bad buffers get typed errors. On a GPU (when one is present) the
//! same passes run on a stream of the test's own, over device memory, and
//! agree within 1e-5 (not bit for bit: cuBLAS promises the same bits run
//! to run with one active stream, and these passes run on the test's
//! stream, the model's own on the device's).

mod support;

use cellc_runtime::backend::cuda::{self, Cuda};
use cellc_runtime::backend::reference::Reference;
use cellc_runtime::backend::Device;
use cellc_runtime::{
    Align, CallOptions, DeviceBackwardOut, DeviceCall, DeviceFloats, DeviceForwardOut, Input, Major, Model,
    PackedSequence, RuntimeError,
};
use std::sync::Arc;

const LENGTHS: [usize; 4] = [3, 5, 1, 5];
const STEPS: usize = 6;

fn data(n: usize, seed: u64) -> Vec<f32> {
    support::Rng::new(seed).vec(n, 1.0).iter().map(|&v| v as f32).collect()
}

/// Memory a test hands to the passes as device memory.
trait Memory {
    fn put(&mut self, data: &[f32]) -> DeviceFloats;
    /// The floats at `at`, once the work queued so far is done.
    fn get(&self, at: DeviceFloats) -> Vec<f32>;
    fn stream(&self) -> u64;
}

/// Host buffers, for a device whose memory is the host's (the emulated one).
#[derive(Default)]
struct HostMemory(Vec<Vec<f32>>);

impl Memory for HostMemory {
    fn put(&mut self, data: &[f32]) -> DeviceFloats {
        self.0.push(data.to_vec());
        DeviceFloats { addr: self.0.last().map_or(0, |v| v.as_ptr() as u64), len: data.len() }
    }

    fn get(&self, at: DeviceFloats) -> Vec<f32> {
        let buf = self.0.iter().find(|v| v.as_ptr() as u64 == at.addr).expect("a buffer of the test");
        buf[..at.len].to_vec()
    }

    fn stream(&self) -> u64 {
        0
    }
}

/// One pass's results, on the host.
#[derive(Debug, PartialEq)]
struct Results {
    output: Vec<u32>,
    finals: Vec<Vec<u32>>,
    d_input: Vec<u32>,
    d_h0: Vec<Vec<u32>>,
    d_params: Vec<Vec<Vec<u32>>>,
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Forward, then backward, over `mem`, garbage (NaN) in every output buffer beforehand.
fn through_device_memory(
    model: &Model,
    mem: &mut dyn Memory,
    input: Input,
    h0: Option<&[Vec<f32>]>,
    d_out: &[f32],
    d_final: &[Vec<f32>],
) -> Results {
    let (shape, data) = input.split();
    let x = mem.put(data);
    let weights = put_weights(model, mem);
    let h0: Option<Vec<DeviceFloats>> = h0.map(|h| h.iter().map(|s| mem.put(s)).collect());
    let call = DeviceCall {
        shape,
        input: x,
        weights: &weights,
        h0: h0.as_deref(),
        stream: mem.stream(),
        options: CallOptions::default(),
    };
    let nan = |n: usize| vec![f32::NAN; n];
    let out = DeviceForwardOut {
        output: mem.put(&nan(d_out.len())),
        final_states: d_final.iter().map(|s| mem.put(&nan(s.len()))).collect(),
    };
    let rows = d_out.len() / model.output_size().max(1);
    let reserve = mem.put(&nan(rows * model.reserve_floats_per_row()));
    model.forward_into(&call, &out, Some(reserve)).expect("device forward");
    let d_output = mem.put(d_out);
    let d_final: Vec<DeviceFloats> = d_final.iter().map(|s| mem.put(s)).collect();
    let grads = DeviceBackwardOut {
        d_input: mem.put(&nan(x.len)),
        d_h0: out.final_states.iter().map(|s| mem.put(&nan(s.len))).collect(),
        d_params: weights.iter().map(|ps| ps.iter().map(|p| mem.put(&nan(p.len))).collect()).collect(),
    };
    model.backward_from(&call, reserve, d_output, Some(&d_final), &grads).expect("device backward");
    Results {
        output: bits(&mem.get(out.output)),
        finals: out.final_states.iter().map(|&s| bits(&mem.get(s))).collect(),
        d_input: bits(&mem.get(grads.d_input)),
        d_h0: grads.d_h0.iter().map(|&s| bits(&mem.get(s))).collect(),
        d_params: grads.d_params.iter().map(|ps| ps.iter().map(|&p| bits(&mem.get(p))).collect()).collect(),
    }
}

/// Every layer and direction's parameters of `model`, put in `mem`.
fn put_weights(model: &Model, mem: &mut dyn Memory) -> Vec<Vec<DeviceFloats>> {
    let dirs = model.directions();
    (0..model.layers().len() * dirs)
        .map(|s| model.params(s / dirs, s % dirs == 1).iter().map(|p| mem.put(p)).collect())
        .collect()
}

/// The model's own passes over host memory, for the same batch.
fn through_model(
    model: &Model,
    input: Input,
    h0: Option<&[Vec<f32>]>,
    d_out: &[f32],
    d_final: &[Vec<f32>],
) -> Results {
    // Evaluation mode, as the calls (a cell's own masks: `tests/cell_masks.rs`).
    let (out, trace) = model.forward_traced(input, h0, &CallOptions::default()).expect("forward_traced");
    let g = model.backward(&trace, d_out, Some(d_final)).expect("backward");
    Results {
        output: bits(&out.data),
        finals: out.final_states.iter().map(|s| bits(s)).collect(),
        d_input: bits(&g.d_input),
        d_h0: g.d_h0.iter().map(|s| bits(s)).collect(),
        d_params: g.d_params.iter().map(|ps| ps.iter().map(|p| bits(p)).collect()).collect(),
    }
}

/// The same results: bit for bit, or within `tolerance` (relative to max(1, |value|)).
fn assert_agree(what: &str, got: &Results, want: &Results, tolerance: Option<f32>) {
    let Some(tolerance) = tolerance else {
        assert_eq!(got, want, "{what}");
        return;
    };
    let flat = |r: &Results| -> Vec<u32> {
        let mut v = r.output.clone();
        v.extend(r.finals.iter().flatten());
        v.extend(&r.d_input);
        v.extend(r.d_h0.iter().flatten());
        v.extend(r.d_params.iter().flatten().flatten());
        v
    };
    let (got, want) = (flat(got), flat(want));
    assert_eq!(got.len(), want.len(), "{what}: sizes");
    for (j, (&a, &b)) in got.iter().zip(&want).enumerate() {
        let (a, b) = (f32::from_bits(a), f32::from_bits(b));
        assert!((a - b).abs() <= tolerance * b.abs().max(1.0), "{what}: value {j}: {a} against {b}");
    }
}

/// Every shipped cell's device-memory passes against its host-memory ones
/// on `cuda`: bit for bit, or within `tolerance`.
fn device_passes_equal_host_passes(
    cuda: impl Fn() -> Cuda,
    memory: &dyn Fn() -> Box<dyn Memory>,
    tolerance: Option<f32>,
) {
    let cuda = Arc::new(cuda());
    let backend = || -> Box<dyn Device> { Box::new(cuda.clone()) };
    for cell in support::compiled_cells() {
        let name = cell.forward.name.clone();
        let model = support::two_layer_model(&cell, (7, 4, 3), 9, &backend);
        let (i, o, b) = (model.input_size(), model.output_size(), LENGTHS.len());
        let x = data(b * STEPS * i, 1);
        let d_out = data(b * STEPS * o, 2);
        let finals =
            model.forward(padded(&x, Major::BatchFirst, Align::Left), None).expect("forward").final_states;
        let h0: Vec<Vec<f32>> =
            finals.iter().enumerate().map(|(k, s)| data(s.len(), 30 + k as u64)).collect();
        let d_final: Vec<Vec<f32>> =
            finals.iter().enumerate().map(|(k, s)| data(s.len(), 70 + k as u64)).collect();
        let packed = PackedSequence::from_padded(&x, &LENGTHS, STEPS, i, Major::BatchFirst, Align::Left)
            .expect("pack");
        let rows: usize = LENGTHS.iter().sum();
        let batches = [
            ("batch-first, left", padded(&x, Major::BatchFirst, Align::Left), &d_out[..]),
            ("time-first, right", padded(&x, Major::TimeFirst, Align::Right), &d_out[..]),
            ("packed", Input::Packed(packed.view()), &d_out[..rows * o]),
        ];
        for (layout, input, d_out) in batches {
            for h0 in [Some(&h0[..]), None] {
                let what = format!("{name}, {layout}, h0 {}", if h0.is_some() { "given" } else { "zero" });
                let got = through_device_memory(&model, memory().as_mut(), input, h0, d_out, &d_final);
                let want = through_model(&model, input, h0, d_out, &d_final);
                assert_agree(&what, &got, &want, tolerance);
            }
        }
    }
}

fn padded(x: &[f32], major: Major, align: Align) -> Input<'_> {
    Input::Padded { data: x, batch: LENGTHS.len(), steps: STEPS, major, align, lengths: &LENGTHS }
}

#[test]
fn device_memory_passes_on_the_emulated_device_equal_the_models_own() {
    let memory = || -> Box<dyn Memory> { Box::new(HostMemory::default()) };
    device_passes_equal_host_passes(|| Cuda::emulated().expect("emulated device"), &memory, None);
}

#[test]
fn device_memory_passes_on_a_gpu_equal_the_models_own() {
    if !support::gpu_present("device-memory passes on a GPU") {
        return;
    }
    let ctx = cuda::open_device(0).expect("GPU 0");
    let memory = move || -> Box<dyn Memory> { Box::new(GpuMemory::new(&ctx)) };
    device_passes_equal_host_passes(|| Cuda::gpu(0).expect("gpu"), &memory, Some(1e-5));
}

/// Device memory of a GPU, on a stream of the test's own (not the legacy default).
struct GpuMemory {
    stream: Arc<cudarc::driver::CudaStream>,
    bufs: Vec<cudarc::driver::CudaSlice<f32>>,
}

impl GpuMemory {
    fn new(ctx: &Arc<cudarc::driver::CudaContext>) -> GpuMemory {
        GpuMemory { stream: ctx.new_stream().expect("stream"), bufs: Vec::new() }
    }

    fn addr(&self, buf: &cudarc::driver::CudaSlice<f32>) -> u64 {
        use cudarc::driver::DevicePtr;
        buf.device_ptr(&self.stream).0
    }
}

impl Memory for GpuMemory {
    fn put(&mut self, data: &[f32]) -> DeviceFloats {
        let buf = self.stream.clone_htod(data).expect("upload");
        let addr = self.addr(&buf);
        self.bufs.push(buf);
        DeviceFloats { addr, len: data.len() }
    }

    fn get(&self, at: DeviceFloats) -> Vec<f32> {
        let buf = self.bufs.iter().find(|b| self.addr(b) == at.addr).expect("a buffer of the test");
        let all = self.stream.clone_dtoh(buf).expect("download");
        all[..at.len].to_vec()
    }

    fn stream(&self) -> u64 {
        self.stream.cu_stream() as u64
    }
}

/// An LSTM's forward and backward over the same device buffers, five
/// rounds, on a back end running passes as CUDA graphs: the passes warm
/// up, are captured and replayed (on a GPU, captured from the device's
/// own stream and launched on the caller's), and every round gives the
/// first round's bits.
fn graphs_replay_over_device_memory(cuda: Cuda, mem: &mut dyn Memory) {
    let cuda = Arc::new(cuda.with_graphs(true));
    let cell = support::compiled_cells().into_iter().find(|c| c.forward.name == "lstm").expect("lstm");
    let backend = || -> Box<dyn Device> { Box::new(cuda.clone()) };
    let model = support::two_layer_model(&cell, (7, 4, 3), 9, &backend);
    let (i, o, b) = (model.input_size(), model.output_size(), LENGTHS.len());
    let x = data(b * STEPS * i, 1);
    let (shape, _) = padded(&x, Major::TimeFirst, Align::Right).split();
    let input = mem.put(&x);
    let weights = put_weights(&model, mem);
    let finals =
        model.forward(padded(&x, Major::TimeFirst, Align::Right), None).expect("forward").final_states;
    let out = DeviceForwardOut {
        output: mem.put(&vec![0.0; b * STEPS * o]),
        final_states: finals.iter().map(|s| mem.put(s)).collect(),
    };
    let d_output = mem.put(&data(b * STEPS * o, 2));
    let grads = DeviceBackwardOut {
        d_input: mem.put(&vec![0.0; input.len]),
        d_h0: Vec::new(),
        d_params: weights.iter().map(|ps| ps.iter().map(|p| mem.put(&vec![0.0; p.len])).collect()).collect(),
    };
    let call = DeviceCall {
        shape,
        input,
        weights: &weights,
        h0: None,
        stream: mem.stream(),
        options: CallOptions::default(),
    };
    let reserve = mem.put(&vec![0.0; b * STEPS * model.reserve_floats_per_row()]);
    let mut first = None;
    for round in 0..5 {
        model.forward_into(&call, &out, Some(reserve)).expect("device forward");
        model.backward_from(&call, reserve, d_output, None, &grads).expect("device backward");
        let mut got = vec![bits(&mem.get(out.output)), bits(&mem.get(grads.d_input))];
        got.extend(out.final_states.iter().map(|&s| bits(&mem.get(s))));
        got.extend(grads.d_params.iter().flatten().map(|&p| bits(&mem.get(p))));
        match &first {
            None => first = Some(got),
            Some(want) => assert!(&got == want, "round {round} differs from the first"),
        }
    }
    let stats = cuda.graph_stats();
    support::report(&format!("graphs over device memory ({}): {stats:?}", cuda.device_name()));
    assert!(stats.warmed_up > 0 && stats.captured > 0 && stats.replayed > 0, "{stats:?}");
}

#[test]
fn graphs_over_device_memory_on_the_emulated_device_replay() {
    graphs_replay_over_device_memory(Cuda::emulated().expect("emulated device"), &mut HostMemory::default());
}

#[test]
fn graphs_over_device_memory_on_a_gpu_replay() {
    if !support::gpu_present("graphs over device memory on a GPU") {
        return;
    }
    let ctx = cuda::open_device(0).expect("GPU 0");
    graphs_replay_over_device_memory(Cuda::gpu(0).expect("gpu"), &mut GpuMemory::new(&ctx));
}

#[test]
fn bad_device_buffers_get_typed_errors() {
    let cell = support::compiled_cells().into_iter().find(|c| c.forward.name == "gru").expect("gru");
    let cuda = || -> Box<dyn Device> { Box::new(Cuda::emulated().expect("emulated device")) };
    let model = support::two_layer_model(&cell, (6, 3, 3), 5, &cuda);
    let mut mem = HostMemory::default();
    let rows = LENGTHS.len() * STEPS;
    let x = data(rows * model.input_size(), 3);
    let (shape, _) = padded(&x, Major::BatchFirst, Align::Left).split();
    let input = mem.put(&x);
    let weights = put_weights(&model, &mut mem);
    let finals: Vec<DeviceFloats> = model
        .forward(padded(&x, Major::BatchFirst, Align::Left), None)
        .expect("forward")
        .final_states
        .iter()
        .map(|s| mem.put(s))
        .collect();
    let out = DeviceForwardOut {
        output: mem.put(&vec![0.0; rows * model.output_size()]),
        final_states: finals.clone(),
    };
    let shape_error = |e: RuntimeError, want: &str| match e {
        RuntimeError::Shape { ref tensor, .. } if tensor == want => {}
        other => panic!("expected a shape error for `{want}`, got {other:?}"),
    };
    let call =
        |weights| DeviceCall { shape, input, weights, h0: None, stream: 0, options: CallOptions::default() };

    let short = DeviceForwardOut { output: DeviceFloats { len: 3, ..out.output }, ..out.clone() };
    shape_error(model.forward_into(&call(&weights), &short, None).unwrap_err(), "output");
    let mut cut = weights.clone();
    cut[1][0].len -= 1;
    shape_error(model.forward_into(&call(&cut), &out, None).unwrap_err(), "weight_ih_l0_reverse");
    let h0 = [DeviceFloats { len: 1, ..finals[0] }];
    let with_h0 = DeviceCall { h0: Some(&h0), ..call(&weights) };
    shape_error(model.forward_into(&with_h0, &out, None).unwrap_err(), "h0.h");
    // A reserve one float short, to the forward and to the backward.
    let reserve = mem.put(&vec![0.0; rows * model.reserve_floats_per_row() - 1]);
    shape_error(model.forward_into(&call(&weights), &out, Some(reserve)).unwrap_err(), "reserve");
    let grads = DeviceBackwardOut {
        d_input: mem.put(&vec![0.0; input.len]),
        d_h0: Vec::new(),
        d_params: weights.iter().map(|ps| ps.iter().map(|p| mem.put(&vec![0.0; p.len])).collect()).collect(),
    };
    let d_output = mem.put(&vec![0.0; rows * model.output_size()]);
    let backward = model.backward_from(&call(&weights), reserve, d_output, None, &grads);
    shape_error(backward.unwrap_err(), "reserve");

    // A back end on host memory says it cannot take device memory.
    let cpu_model = support::two_layer_model(&cell, (6, 3, 3), 5, &|| Box::new(Reference));
    match cpu_model.forward_into(&call(&weights), &out, None) {
        Err(RuntimeError::Backend { message, .. }) => assert!(message.contains("device memory"), "{message}"),
        other => panic!("expected a back-end error, got {other:?}"),
    }
}
