"""CUDA tensors on the CUDA back end: run in place, queued on PyTorch's current stream.

Without a GPU, the same path (device memory, no host copies, the tapes in a reserve in
device memory) is tested over the emulated device in ``test_against_pytorch``
and ``test_autograd`` (``backend="cuda-emulated"``). The tests here need a GPU and are
skipped without one.
"""

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import cellc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(autouse=True)
def full_precision_reference():
    """cuDNN's LSTM and cuBLAS use TF32 by default on Ampere and later: the reference would miss 2e-5."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

LENGTHS = [5, 2, 7, 7, 1]
STEPS, INPUT, HIDDEN = 7, 6, 9


def pair(batch_first=True):
    ref = nn.LSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True, batch_first=batch_first).cuda()
    rnn = cellc.RNN("lstm", INPUT, {"H": HIDDEN}, num_layers=2, bidirectional=True, batch_first=batch_first)
    rnn.load_state_dict(ref.state_dict())
    return ref, rnn.cuda()


def loss_of(out, finals):
    h, c = finals
    return (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum() + (h * h).sum() + 2 * (c * c).sum()


def run(module, x, hx, **kwargs):
    if isinstance(x, PackedSequence):
        leaf = x.data.clone().requires_grad_()
        x = PackedSequence(leaf, x.batch_sizes, x.sorted_indices, x.unsorted_indices)
    else:
        leaf = x = x.clone().requires_grad_()
    module.zero_grad()
    out, finals = module(x, hx, **kwargs)
    data = out.data if isinstance(out, PackedSequence) else out
    loss_of(data, finals).backward()
    return data.detach(), [f.detach() for f in finals], leaf.grad, [p.grad.clone() for p in module.parameters()]


def assert_close(got, want):
    for a, b in zip(got, want):
        if isinstance(a, list):
            assert_close(a, b)
        else:
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_cuda_tensors_match_pytorch_padded_and_packed():
    ref, rnn = pair()
    x = torch.randn(len(LENGTHS), STEPS, INPUT, device="cuda")
    hx = tuple(torch.randn(4, len(LENGTHS), HIDDEN, device="cuda") for _ in range(2))
    packed = pack_padded_sequence(x, torch.tensor(LENGTHS), batch_first=True, enforce_sorted=False)
    want = run(ref, packed, hx)
    got = run(rnn, packed, hx)
    assert_close(got, want)
    # Padded: the same values at the valid rows, with no host synchronisation on the way.
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, (h, c) = rnn(x, hx, lengths=LENGTHS)
        loss_of(out, (h, c)).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    packed_out = pack_padded_sequence(out, torch.tensor(LENGTHS), batch_first=True, enforce_sorted=False)
    torch.testing.assert_close(packed_out.data, want[0], atol=2e-5, rtol=1e-4)


def test_a_side_stream_gives_the_default_streams_results():
    _, rnn = pair()
    x = torch.randn(len(LENGTHS), STEPS, INPUT, device="cuda")
    want = run(rnn, x, None, lengths=LENGTHS, align="right")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = run(rnn, x, None, lengths=LENGTHS, align="right")
    torch.cuda.current_stream().wait_stream(side)
    assert_close(got, want)


def test_compiled_model_on_cuda_matches_eager():
    torch._dynamo.reset()
    _, rnn = pair()
    head = nn.Linear(2 * HIDDEN, 3).cuda()
    model = nn.ModuleDict({"rnn": rnn, "head": head})

    def step(m, x):
        out, _ = m["rnn"](x, lengths=LENGTHS)
        return m["head"](out).sum()

    x = torch.randn(len(LENGTHS), STEPS, INPUT, device="cuda")
    want = step(model, x)
    got = torch.compile(lambda x: step(model, x), fullgraph=True)(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_cpu_back_end_refuses_cuda_tensors():
    rnn = cellc.RNN("gru", INPUT, {"H": HIDDEN}, backend="cpu").cuda()
    with pytest.raises(cellc.DeviceError, match="runs CPU tensors"):
        rnn(torch.randn(STEPS, 2, INPUT, device="cuda"))


def test_a_cells_masks_on_cuda_are_the_cpus():
    """Zoneout and DropConnect drawn on the GPU (the prelude's kernel, in training mode) give
    what the CPU gives with the same seed: outputs and every gradient."""
    for cell, rates in (("zoneout_lstm", {"zh": 0.3, "zc": 0.2}), ("awd_lstm", {"weight_drop": 0.4})):
        torch.manual_seed(0)
        cpu = cellc.RNN(cell, INPUT, {"H": HIDDEN}, num_layers=2, bidirectional=True, batch_first=True, rates=rates)
        gpu = cellc.RNN(cell, INPUT, {"H": HIDDEN}, num_layers=2, bidirectional=True, batch_first=True, rates=rates)
        gpu.load_state_dict(cpu.state_dict())
        gpu = gpu.cuda()
        x = torch.randn(len(LENGTHS), STEPS, INPUT)
        torch.manual_seed(5)
        want = run(cpu, x, None, lengths=LENGTHS)
        torch.manual_seed(5)
        got = run(gpu, x.cuda(), None, lengths=LENGTHS)
        assert_close([t.cpu() if isinstance(t, torch.Tensor) else [u.cpu() for u in t] for t in got], want)


def test_resets_on_cuda_are_the_cpus():
    """Per-step resets on CUDA tensors (padded both alignments, and packed) give what the CPU
    back end gives: outputs, final states and every gradient, the initial states' included."""
    torch.manual_seed(0)
    cpu = cellc.RNN("lstm", INPUT, {"H": HIDDEN}, num_layers=2, bidirectional=True, batch_first=True)
    gpu = cellc.RNN("lstm", INPUT, {"H": HIDDEN}, num_layers=2, bidirectional=True, batch_first=True)
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.cuda()
    x = torch.randn(len(LENGTHS), STEPS, INPUT)
    resets = torch.rand(len(LENGTHS), STEPS) < 0.3
    hx = tuple(torch.randn(4, len(LENGTHS), HIDDEN) for _ in range(2))

    def with_hx(module, x, hx, **kwargs):
        leaves = [h.clone().requires_grad_() for h in hx]
        data, finals, x_grad, grads = run(module, x, tuple(leaves), **kwargs)
        return data, finals, x_grad, grads, [h.grad for h in leaves]

    def on_cpu(t):
        return t.cpu() if isinstance(t, torch.Tensor) else [u.cpu() for u in t]

    for align in ("left", "right"):
        want = with_hx(cpu, x, hx, lengths=LENGTHS, align=align, resets=resets)
        got = with_hx(gpu, x.cuda(), tuple(h.cuda() for h in hx), lengths=LENGTHS, align=align,
                      resets=resets.cuda())
        assert_close([on_cpu(t) for t in got], want)
    packed = pack_padded_sequence(x, torch.tensor(LENGTHS), batch_first=True, enforce_sorted=False)
    flags = pack_padded_sequence(resets, torch.tensor(LENGTHS), batch_first=True, enforce_sorted=False)
    want = with_hx(cpu, packed, hx, resets=flags)
    packed_gpu = pack_padded_sequence(x.cuda(), torch.tensor(LENGTHS), batch_first=True, enforce_sorted=False)
    got = with_hx(gpu, packed_gpu, tuple(h.cuda() for h in hx), resets=flags)
    assert_close([on_cpu(t) for t in got], want)


def test_autocast_on_cuda_returns_autocasts_dtype():
    """Under CUDA autocast (bf16 and fp16) a call on CUDA tensors returns its output and final
    states in autocast's dtype, as nn.LSTM does, close to the float32 call (bf16: with bf16
    products on the tensor cores); gradients reach the float32 input and weights."""
    _, rnn = pair()
    x = torch.randn(len(LENGTHS), STEPS, INPUT, device="cuda", requires_grad=True)
    exact, _ = rnn(x, lengths=LENGTHS)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cuda", dtype=dtype):
            out, (h, c) = rnn(x, lengths=LENGTHS)
        assert out.dtype == h.dtype == c.dtype == dtype
        torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=2e-2)
        out.float().sum().backward()
        assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


def test_aoti_package_on_cuda_tensors_matches_eager(tmp_path):
    """An exported model compiled by AOTInductor for the GPU: its generated code calls
    ``aoti_torch_cuda_cellc_rnn``, which runs the pass on the CUDA back end, queued on PyTorch's
    current stream (the lengths stay on the CPU, as the module keeps them); equal to eager."""
    _, rnn = pair()
    rnn.eval()
    x = torch.randn(len(LENGTHS), STEPS, INPUT, device="cuda")
    lengths = torch.tensor(LENGTHS)

    class Call(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = rnn

        def forward(self, x, lengths):
            out, (h, c) = self.rnn(x, lengths=lengths, align="right")
            return out, h, c

    model = Call().eval()
    with torch.no_grad():
        want = model(x, lengths)
    program = torch.export.export(model, (x, lengths))
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "model.pt2"))
    got = torch._inductor.aoti_load_package(path)(x, lengths)
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert a.device == b.device
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
