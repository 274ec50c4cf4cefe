"""Mixed precision from PyTorch: ``cellc.RNN`` under ``torch.autocast``, with bf16/fp16 inputs,
and with bf16/fp16 parameters. The arithmetic is float32 (the results are float32's, rounded to
the dtype asked for); what is tested is that AMP scripts run and get ``nn.LSTM``'s dtypes, with
gradients reaching every tensor in its own dtype."""

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import cellc
from cellc.errors import DTypeError

LENGTHS = [5, 2, 4]


def pair():
    torch.manual_seed(0)
    ref = nn.LSTM(6, 8, num_layers=2, batch_first=True)
    rnn = cellc.RNN("lstm", 6, {"H": 8}, num_layers=2, batch_first=True)
    rnn.load_state_dict(ref.state_dict())
    return ref, rnn


def test_under_autocast_outputs_come_in_autocasts_dtype_as_nn_lstms():
    # (nn.LSTM itself returns bf16 there; its oneDNN bf16 kernel needs a CPU with bf16
    # instructions, so it is not run here.)
    _, rnn = pair()
    x = torch.randn(3, 5, 6, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, (h, c) = rnn(x, lengths=LENGTHS)
    assert got.dtype == h.dtype == c.dtype == torch.bfloat16
    exact, _ = rnn(x, lengths=LENGTHS)
    # float32's results, rounded to bf16 (8 bits of mantissa).
    torch.testing.assert_close(got.float(), exact, atol=1e-2, rtol=1e-2)
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


def test_float64_is_refused_with_its_reason():
    with pytest.raises(DTypeError, match="float32"):
        cellc.RNN("lstm", 6, {"H": 8}, dtype=torch.float64)
    _, rnn = pair()
    with pytest.raises(DTypeError, match="float32"):
        rnn.double()(torch.randn(3, 5, 6, dtype=torch.float64))


def test_compiled_under_autocast_is_eager_under_autocast():
    _, rnn = pair()
    x = torch.randn(3, 5, 6)
    compiled = torch.compile(lambda x: rnn(x, lengths=LENGTHS)[0], fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x), rnn(x, lengths=LENGTHS)[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
