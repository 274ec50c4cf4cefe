"""TF32 products: a float32 call of ``cellc.RNN`` over device memory follows PyTorch's switch for
cuDNN's RNN (what ``nn.LSTM`` computes on the same GPU), checked here on the emulated device,
which rounds the products' operands to TF32 as the tensor cores do."""

import copy

import pytest
import torch

import cellc
from cellc import _ops
from conftest import needs_gxx

LENGTHS = [5, 2, 4]


@pytest.fixture
def switches():
    """Restores every TF32 switch the test sets."""
    cudnn = torch.backends.cudnn
    saved = cudnn.rnn.fp32_precision, cudnn.conv.fp32_precision, cudnn.fp32_precision, torch.backends.fp32_precision
    yield cudnn
    torch.backends.fp32_precision = saved[3]
    cudnn.fp32_precision = saved[2]
    cudnn.rnn.fp32_precision, cudnn.conv.fp32_precision = saved[:2]


def test_the_switch_is_cudnns_rnn_switch(switches):
    cudnn = switches
    cudnn.allow_tf32 = True  # PyTorch's default
    assert _ops.cudnn_rnn_allows_tf32()
    cudnn.allow_tf32 = False
    assert not _ops.cudnn_rnn_allows_tf32()
    cudnn.rnn.fp32_precision = "tf32"
    assert _ops.cudnn_rnn_allows_tf32()
    cudnn.rnn.fp32_precision = "ieee"
    assert not _ops.cudnn_rnn_allows_tf32()
    # "none" inherits: cuDNN's setting, then the global one.
    cudnn.rnn.fp32_precision = "none"
    cudnn.fp32_precision = "tf32"
    assert _ops.cudnn_rnn_allows_tf32()
    cudnn.fp32_precision = "none"
    torch.backends.fp32_precision = "tf32"
    assert _ops.cudnn_rnn_allows_tf32()
    torch.backends.fp32_precision = "ieee"
    assert not _ops.cudnn_rnn_allows_tf32()
    # cuBLAS's own switch is not the RNN's.
    torch.backends.fp32_precision = "none"
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert not _ops.cudnn_rnn_allows_tf32()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _pass(rnn, x, grad):
    """Output and every weight's gradient of one training call."""
    rnn.zero_grad()
    out, _ = rnn(x, lengths=torch.tensor(LENGTHS))
    (out * grad).sum().backward()
    return out.detach().double(), [p.grad.detach().double() for p in rnn.parameters()]


def _error(got, want):
    out, grads = got
    out64, grads64 = want
    worst = float((out - out64).abs().max())
    for g, g64 in zip(grads, grads64):
        worst = max(worst, float((g - g64).norm() / g64.norm()))
    return worst


@needs_gxx
def test_tf32_products_where_cudnns_rnn_would_use_them(switches):
    cudnn = switches
    rnn = cellc.RNN("lstm", 16, 24, batch_first=True, backend="cuda-emulated")
    x = torch.randn(3, 5, 16)
    grad = torch.randn(3, 5, 24)
    exact = _pass(copy.deepcopy(rnn).double().eval(), x.double(), grad.double())

    cudnn.allow_tf32 = False
    full = _pass(rnn, x, grad)
    cudnn.allow_tf32 = True
    tf32 = _pass(rnn, x, grad)
    # TF32 keeps 10 of float32's 23 mantissa bits: its products are near, but not float32's.
    assert _error(full, exact) < 1e-5, _error(full, exact)
    assert 1e-5 < _error(tf32, exact) < 5e-3, _error(tf32, exact)
    assert _error(tf32, exact) > 30 * _error(full, exact)

    # Under autocast the products are autocast's, whatever the switch.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        on, _ = rnn(x, lengths=torch.tensor(LENGTHS))
        cudnn.allow_tf32 = False
        off, _ = rnn(x, lengths=torch.tensor(LENGTHS))
    assert torch.equal(on, off)


def test_the_cpu_back_end_stays_float32(switches):
    cudnn = switches
    rnn = cellc.RNN("lstm", 16, 24, batch_first=True)
    x = torch.randn(3, 5, 16)
    cudnn.allow_tf32 = True
    on, _ = rnn(x, lengths=torch.tensor(LENGTHS))
    cudnn.allow_tf32 = False
    off, _ = rnn(x, lengths=torch.tensor(LENGTHS))
    assert torch.equal(on, off)


@needs_gxx
def test_torch_compile_follows_the_switch(switches):
    """A compiled graph guards on the switch: turned on after compiling, the call recompiles
    and computes in TF32, as eager mode does."""
    cudnn = switches
    rnn = cellc.RNN("lstm", 16, 24, batch_first=True, backend="cuda-emulated")
    x = torch.randn(3, 5, 16)
    lengths = torch.tensor(LENGTHS)
    compiled = torch.compile(lambda x: rnn(x, lengths=lengths)[0], fullgraph=True)
    for allowed in (False, True):
        cudnn.allow_tf32 = allowed
        eager = rnn(x, lengths=lengths)[0]
        torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
    cudnn.allow_tf32 = False
    assert not torch.equal(compiled(x), eager)
