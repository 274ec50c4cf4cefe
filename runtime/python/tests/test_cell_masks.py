"""A cell's own masks from Python: ``cellc.RNN(..., rates={...})`` with the shipped
``zoneout_lstm``, ``awd_lstm`` and ``gru_recurrent_dropout``. Evaluation is the plain cell (zoneout:
its expectation); training, rebuilt in PyTorch from the masks the call reports
(``cell_masks``), gives the same output and gradients; the masks come from PyTorch's default
generator; rates are checked; ``torch.compile`` takes the module whole."""

import pytest
import torch
from torch import nn

import cellc
from conftest import EMULATED

LENGTHS = [5, 2, 4]


def lstm_and(cell, backend="cpu", **kwargs):
    torch.manual_seed(0)
    reference = nn.LSTM(3, 4, batch_first=True)
    rnn = cellc.RNN(cell, 3, {"H": 4}, batch_first=True, backend=backend, **kwargs)
    rnn.load_state_dict(reference.state_dict())
    return reference, rnn


def zoneout_loop(reference: nn.LSTM, x, zh, zc):
    """A zoneout LSTM in PyTorch: ``zh``/``zc`` per step (``[B, T, H]`` of 1 = new, 0 = old), or
    floats (evaluation: the expectation with those rates)."""
    cell = nn.LSTMCell(3, 4)
    cell.load_state_dict({k.replace("_l0", ""): v for k, v in reference.state_dict().items()})
    b = x.shape[0]
    h, c = x.new_zeros(b, 4), x.new_zeros(b, 4)
    outs = []
    for t in range(x.shape[1]):
        h_new, c_new = cell(x[:, t], (h, c))
        if isinstance(zh, float):
            c = zc * c + (1 - zc) * c_new
            h = zh * h + (1 - zh) * h_new
        else:
            c = zc[:, t] * c_new + (1 - zc[:, t]) * c
            h = zh[:, t] * h_new + (1 - zh[:, t]) * h
        outs.append(h)
    return torch.stack(outs, 1)


@pytest.mark.parametrize("backend", ["cpu", EMULATED])
def test_zoneout_in_evaluation_is_the_expectation(backend):
    reference, rnn = lstm_and("zoneout_lstm", backend, rates={"zh": 0.2, "zc": 0.3})
    rnn.eval()
    x = torch.randn(3, 5, 3)
    got, _ = rnn(x)
    want = zoneout_loop(reference, x, 0.2, 0.3)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("backend", ["cpu", EMULATED])
def test_zoneout_training_is_a_pytorch_loop_with_the_masks_it_reports(backend):
    reference, rnn = lstm_and("zoneout_lstm", backend, rates={"zh": 0.3, "zc": 0.5})
    rnn.train()
    x = torch.randn(3, 5, 3, requires_grad=True)
    torch.manual_seed(5)
    got, _ = rnn(x)
    torch.manual_seed(5)
    masks = rnn.cell_masks(x, cellc.draw_masks())
    # Masks are numbered in the order the cell calls them: c' first, then h'.
    zc, zh = masks["zoneout#0_l0"], masks["zoneout#1_l0"]
    assert zc.shape == (3, 5, 4) and set(zc.unique().tolist()) <= {0.0, 1.0}
    assert 0.3 < zc.mean().item() < 0.7 and 0.5 < zh.mean().item() < 0.9
    x2 = x.detach().clone().requires_grad_()
    want = zoneout_loop(reference, x2, zh, zc)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
    probe = torch.randn_like(got)
    (got * probe).sum().backward()
    (want * probe).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=2e-4, atol=2e-5)


def test_awd_lstm_is_nn_lstm_in_evaluation_and_masks_its_weight_and_input_in_training():
    reference, rnn = lstm_and("awd_lstm", rates={"weight_drop": 0.4, "dropout_input": 0.3})
    x = torch.randn(3, 5, 3)
    rnn.eval()
    torch.testing.assert_close(rnn(x)[0], reference(x)[0], rtol=2e-4, atol=2e-5)
    rnn.train()
    torch.manual_seed(9)
    got, _ = rnn(x, lengths=LENGTHS)
    torch.manual_seed(9)
    masks = rnn.cell_masks(x, cellc.draw_masks(), lengths=LENGTHS)
    w_mask, x_mask = masks["dropconnect#1_l0"], masks["variational_dropout#0_l0"]
    assert w_mask.shape == (16, 4) and x_mask.shape == (3, 5, 3)
    # One input mask per sequence, the same at each of its steps (zeros at padding).
    for b, n in enumerate(LENGTHS):
        assert torch.equal(x_mask[b, :n], x_mask[b, :1].expand(n, 3))
    masked = nn.LSTM(3, 4, batch_first=True)
    state = reference.state_dict()
    masked.load_state_dict({**state, "weight_hh_l0": state["weight_hh_l0"] * w_mask})
    packed = nn.utils.rnn.pack_padded_sequence(x * x_mask, LENGTHS, batch_first=True, enforce_sorted=False)
    want, _ = nn.utils.rnn.pad_packed_sequence(masked(packed)[0], batch_first=True, total_length=5)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)


def test_gru_recurrent_dropout_is_nn_gru_in_evaluation():
    torch.manual_seed(0)
    reference = nn.GRU(3, 4, batch_first=True)
    rnn = cellc.RNN("gru_recurrent_dropout", 3, {"H": 4}, batch_first=True)
    rnn.load_state_dict(reference.state_dict())
    x = torch.randn(3, 5, 3)
    rnn.eval()
    torch.testing.assert_close(rnn(x)[0], reference(x)[0], rtol=2e-4, atol=2e-5)
    rnn.train()
    assert not torch.allclose(rnn(x)[0], reference(x)[0])


def test_masks_come_from_the_default_generator_and_rates_change_between_calls():
    reference, rnn = lstm_and("zoneout_lstm")
    rnn.train()
    x = torch.randn(3, 5, 3)
    torch.manual_seed(1)
    first, _ = rnn(x)
    torch.manual_seed(1)
    assert torch.equal(rnn(x)[0], first)
    assert not torch.equal(rnn(x)[0], first), "a second call drew the first call's masks"
    rnn.rates["zh"] = rnn.rates["zc"] = 0.0
    torch.testing.assert_close(rnn(x)[0], reference(x)[0], rtol=2e-4, atol=2e-5)


def test_bad_rates_are_errors():
    with pytest.raises(ValueError, match="not a rate of cell `zoneout_lstm`"):
        cellc.RNN("zoneout_lstm", 3, {"H": 4}, rates={"zx": 0.1})
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        cellc.RNN("zoneout_lstm", 3, {"H": 4}, rates={"zh": 1.0})
    rnn = cellc.RNN("zoneout_lstm", 3, {"H": 4})
    assert rnn.rates == {"zh": 0.1, "zc": 0.1}
    rnn.rates["zh"] = -0.5
    with pytest.raises(ValueError, match="rate 'zh'"):
        rnn(torch.randn(2, 3, 3))
    assert "rates={'zh': -0.5, 'zc': 0.1}" in repr(rnn)


def test_torch_compile_fullgraph_trains_a_zoneout_lstm():
    _, rnn = lstm_and("zoneout_lstm", rates={"zh": 0.2, "zc": 0.2})
    rnn.train()
    compiled = torch.compile(rnn, fullgraph=True)
    x = torch.randn(3, 5, 3, requires_grad=True)
    torch.manual_seed(3)
    first, _ = compiled(x)
    torch.manual_seed(3)
    again, _ = compiled(x)
    assert torch.equal(first, again)
    first.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def zoneout_stack(rnn, x, lengths, masks, align):
    """A stack of zoneout LSTM layers in PyTorch, sequence by sequence, step by step: the
    masks ``cell_masks`` reported, each applied at its sequence's row of the padded layout."""
    batch, steps, _ = x.shape
    state = rnn.state_dict()
    layer_input = x
    for k in range(rnn.num_layers):
        outputs = []
        for d in range(2 if rnn.bidirectional else 1):
            suffix = f"_l{k}" + ("_reverse" if d else "")
            cell = nn.LSTMCell(layer_input.shape[-1], rnn.hidden_size)
            cell.load_state_dict({name: state[name + suffix] for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")})
            zc, zh = masks[f"zoneout#0{suffix}"], masks[f"zoneout#1{suffix}"]
            rows = []
            for b in range(batch):
                n = lengths[b]
                positions = list(range(steps - n, steps) if align == "right" else range(n))
                h = c = x.new_zeros(1, rnn.hidden_size)
                out = [x.new_zeros(rnn.hidden_size) for _ in range(steps)]
                for t in reversed(positions) if d else positions:
                    h_new, c_new = cell(layer_input[b : b + 1, t], (h, c))
                    c = zc[b : b + 1, t] * c_new + (1 - zc[b : b + 1, t]) * c
                    h = zh[b : b + 1, t] * h_new + (1 - zh[b : b + 1, t]) * h
                    out[t] = h[0]
                rows.append(torch.stack(out))
            outputs.append(torch.stack(rows))
        layer_input = torch.cat(outputs, -1)
    return layer_input


@pytest.mark.parametrize("align", ["left", "right"])
def test_two_bidirectional_zoneout_layers_are_a_pytorch_loop_with_the_reported_masks(align):
    """The exact check: 2 layers, bidirectional, variable lengths in either alignment; outputs
    and the input's gradient within 2e-4 of PyTorch's given the masks the call reports."""
    torch.manual_seed(0)
    rnn = cellc.RNN("zoneout_lstm", 3, {"H": 4}, num_layers=2, bidirectional=True, batch_first=True,
                    rates={"zh": 0.3, "zc": 0.4})
    rnn.train()
    x = torch.randn(3, 5, 3, requires_grad=True)
    torch.manual_seed(8)
    got, _ = rnn(x, lengths=LENGTHS, align=align)
    torch.manual_seed(8)
    masks = rnn.cell_masks(x, cellc.draw_masks(), lengths=LENGTHS, align=align)
    assert sorted(masks) == sorted(f"zoneout#{i}_l{k}{r}" for i in (0, 1) for k in (0, 1) for r in ("", "_reverse"))
    x2 = x.detach().clone().requires_grad_()
    want = zoneout_stack(rnn, x2, LENGTHS, masks, align)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
    probe = torch.randn_like(got)
    (got * probe).sum().backward()
    (want * probe).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=2e-4, atol=2e-4)


def test_masks_do_not_depend_on_alignment_or_packing():
    """The same sequences padded left, padded right and packed draw the same masks (each
    unit a function of the sequence's index in the batch and its own step)."""
    _, rnn = lstm_and("zoneout_lstm", rates={"zh": 0.3, "zc": 0.3})
    rnn.train()
    x = torch.randn(3, 5, 3)
    torch.manual_seed(4)
    left, _ = rnn(x, lengths=LENGTHS)
    right_x = torch.zeros_like(x)
    for b, n in enumerate(LENGTHS):
        right_x[b, 5 - n :] = x[b, :n]
    torch.manual_seed(4)
    right, _ = rnn(right_x, lengths=LENGTHS, align="right")
    packed = nn.utils.rnn.pack_padded_sequence(x, LENGTHS, batch_first=True, enforce_sorted=False)
    torch.manual_seed(4)
    out, _ = rnn(packed)
    unpacked, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=5)
    for b, n in enumerate(LENGTHS):
        assert torch.equal(right[b, 5 - n :], left[b, :n])
        assert torch.equal(unpacked[b, :n], left[b, :n])
