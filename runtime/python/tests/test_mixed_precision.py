"""Mixed precision from PyTorch: ``cellc.RNN`` under ``torch.autocast``, with bf16/fp16 inputs,
and with bf16/fp16 parameters: AMP scripts run and get ``nn.LSTM``'s dtypes, with gradients
reaching every tensor in its own dtype; where the result is bf16, the weights' products take
bf16 operands and sum in float32, as autocast computes them; where it is fp16, so do they on
CUDA with fp16 operands (the CPU, without fp16 products, computes float32 and rounds at the
end)."""

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import cellc

LENGTHS = [5, 2, 4]


def pair():
    torch.manual_seed(0)
    ref = nn.LSTM(6, 8, num_layers=2, batch_first=True)
    rnn = cellc.RNN("lstm", 6, {"H": 8}, num_layers=2, batch_first=True)
    rnn.load_state_dict(ref.state_dict())
    return ref, rnn


def lstm_loop(ref: nn.LSTM, x, rounding):
    """One layer of ``ref`` as a loop, each product's operands passed through ``rounding``."""
    batch, steps, _ = x.shape
    h = c = torch.zeros(batch, ref.hidden_size)
    w_ih, w_hh, b_ih, b_hh = ref.weight_ih_l0, ref.weight_hh_l0, ref.bias_ih_l0, ref.bias_hh_l0
    outputs = []
    for t in range(steps):
        gates = rounding(x[:, t]) @ rounding(w_ih).T + b_ih + rounding(h) @ rounding(w_hh).T + b_hh
        i, f, g, o = gates.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outputs.append(h)
    return torch.stack(outputs, 1)


def lstm_and_data(backend):
    """``nn.LSTM(16, 32)``, a cellc LSTM on ``backend`` with its weights, and a batch of 3x6."""
    torch.manual_seed(0)
    ref = nn.LSTM(16, 32, batch_first=True)
    rnn = cellc.RNN("lstm", 16, {"H": 32}, batch_first=True, backend=backend)
    rnn.load_state_dict(ref.state_dict())
    return ref, rnn, torch.randn(3, 6, 16) * 2


@torch.no_grad()
@pytest.mark.parametrize("backend", [None, "cuda-emulated"])
def test_bf16_results_come_from_bf16_products_with_float32_sums(backend):
    ref, rnn, x = lstm_and_data(backend)
    bf16 = lstm_loop(ref, x, lambda t: t.bfloat16().float())
    # The internal call, before the result is rounded to bf16: the loop's values to float32's
    # rounding, and far from float32's products (bf16's 8-bit operands); on the CPU's kernels
    # and the (emulated) CUDA device's cuBLAS products alike.
    got, _ = rnn._forward(x, None, None, "left", None, "bf16")
    exact, _ = rnn._forward(x, None, None, "left", None, "")
    assert (got - bf16).abs().max() < 1e-5
    assert (exact - bf16).abs().max() > 1e-3
    # Autocast and bf16 inputs take that route, padded or packed.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, _ = rnn(x)
        packed, _ = rnn(pack_padded_sequence(x, torch.tensor([6, 6, 6]), batch_first=True))
    assert torch.equal(autocast, got.bfloat16())
    assert torch.equal(packed.data, pack_padded_sequence(autocast, torch.tensor([6, 6, 6]), batch_first=True).data)
    assert torch.equal(rnn(x.bfloat16())[0], lstm_like_bf16(rnn, x.bfloat16()))


@torch.no_grad()
@pytest.mark.parametrize("backend", [None, "cuda-emulated"])
def test_fp16_results_come_from_fp16_products_on_cuda_and_float32_ones_on_the_cpu(backend):
    ref, rnn, x = lstm_and_data(backend)
    fp16 = lstm_loop(ref, x, lambda t: t.half().float())
    got, _ = rnn._forward(x, None, None, "left", None, "f16")
    exact, _ = rnn._forward(x, None, None, "left", None, "")
    if backend == "cuda-emulated":
        # The loop's values to float32's rounding, and away from float32's products (fp16's
        # 11-bit operands).
        assert (got - fp16).abs().max() < 1e-5
        assert (exact - fp16).abs().max() > 1e-4
    else:
        assert torch.equal(got, exact)
    # fp16 inputs take that route, and return it rounded to fp16.
    assert torch.equal(rnn(x.half())[0], rnn._forward(x.half().float(), None, None, "left", None, "f16")[0].half())


def lstm_like_bf16(rnn, x):
    out, _ = rnn._forward(x.float(), None, None, "left", None, "bf16")
    return out.bfloat16()


def test_under_autocast_outputs_come_in_autocasts_dtype_as_nn_lstms():
    # (nn.LSTM itself returns bf16 there; its oneDNN bf16 kernel needs a CPU with bf16
    # instructions, so it is not run here.)
    _, rnn = pair()
    x = torch.randn(3, 5, 6, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, (h, c) = rnn(x, lengths=LENGTHS)
    assert got.dtype == h.dtype == c.dtype == torch.bfloat16
    exact, _ = rnn(x, lengths=LENGTHS)
    # bf16 products' results, rounded to bf16 (8 bits of mantissa).
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=2e-2)
    (got.float().square().sum() + h.float().sum()).backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    assert all(p.grad.dtype == torch.float32 for p in rnn.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_and_states_give_half_outputs_and_gradients(dtype):
    _, rnn = pair()
    x = torch.randn(3, 5, 6).to(dtype).requires_grad_()
    hx = tuple((torch.randn(2, 3, 8) * 0.5).to(dtype).requires_grad_() for _ in range(2))
    out, (h, c) = rnn(x, hx, lengths=LENGTHS)
    assert out.dtype == h.dtype == c.dtype == dtype
    exact, _ = rnn(x.detach().float(), tuple(t.detach().float() for t in hx), lengths=LENGTHS)
    torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=1e-2)
    out.float().sum().backward()
    assert x.grad.dtype == dtype and all(t.grad.dtype == dtype for t in hx)


def test_a_bf16_module_trains_its_bf16_parameters():
    _, rnn = pair()
    exact_module = cellc.RNN("lstm", 6, {"H": 8}, num_layers=2, batch_first=True)
    exact_module.load_state_dict(rnn.state_dict())
    rnn = rnn.to(torch.bfloat16)
    x = torch.randn(3, 5, 6)
    packed = pack_padded_sequence(x.to(torch.bfloat16), torch.tensor(LENGTHS), batch_first=True,
                                  enforce_sorted=False)
    out, _ = rnn(packed)
    assert out.data.dtype == torch.bfloat16
    out.data.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in rnn.parameters())
    # Against the float32 module given the same (bf16-rounded) weights.
    exact_module.load_state_dict({k: v.float() for k, v in rnn.state_dict().items()})
    want, _ = exact_module(pack_padded_sequence(x.to(torch.bfloat16).float(), torch.tensor(LENGTHS),
                                                batch_first=True, enforce_sorted=False))
    torch.testing.assert_close(out.data.float(), want.data, atol=1e-2, rtol=1e-2)
    made = cellc.RNN("lstm", 6, {"H": 8}, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in made.parameters())


def test_compiled_under_autocast_is_eager_under_autocast():
    _, rnn = pair()
    x = torch.randn(3, 5, 6)
    compiled = torch.compile(lambda x: rnn(x, lengths=LENGTHS)[0], fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x), rnn(x, lengths=LENGTHS)[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
