"""``cells/lstm.cell``, ``gru.cell`` and ``rnn_tanh.cell`` against ``nn.LSTM``, ``nn.GRU``
and ``nn.RNN`` with copied weights: padded (both alignments, both axis orders) and packed,
two layers, both directions; outputs, final states and every gradient. On the CPU back end,
and on the CUDA back end's device-memory path over the emulated device (``cuda-emulated``:
CPU tensors stand in for device memory)."""

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import cellc
from conftest import EMULATED, right_aligned

CELLS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": nn.RNN}
LENGTHS = [5, 2, 7, 7, 1]
STEPS, INPUT, HIDDEN = 7, 6, 9
ATOL = 2e-5


BACKENDS = ["cpu", EMULATED]


def pair(cell: str, batch_first: bool, layers=2, bidirectional=True, backend="cpu"):
    ref = CELLS[cell](INPUT, HIDDEN, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
    rnn = cellc.RNN(cell, INPUT, {"H": HIDDEN}, layers, bidirectional, batch_first, backend=backend)
    rnn.load_state_dict(ref.state_dict())
    return ref, rnn


def as_tuple(states):
    return states if isinstance(states, tuple) else (states,)


def loss_of(out, finals):
    # Every output and final state reaches the loss, with weights that tell entries apart.
    total = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    for k, f in enumerate(as_tuple(finals)):
        total = total + (k + 1) * (f * f).sum()
    return total


def reference_run(ref, x, lengths, hx, batch_first):
    packed = pack_padded_sequence(x, torch.tensor(lengths), batch_first=batch_first, enforce_sorted=False)
    out, finals = ref(packed, hx)
    out, _ = pad_packed_sequence(out, batch_first=batch_first, total_length=STEPS)
    return out, finals


def grads(*tensors):
    return [t.grad.clone() for t in tensors]


def assert_close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= ATOL * max(1.0, b.abs().max().item()), f"{what}: max error {err}"


def initial_states(cell, batch):
    n = 2 if cell == "lstm" else 1
    states = tuple(torch.randn(4, batch, HIDDEN, requires_grad=True) for _ in range(n))
    return states if n == 2 else states[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("align", ["left", "right"])
def test_padded_matches_pytorch(cell, batch_first, align, backend):
    ref, rnn = pair(cell, batch_first, backend=backend)
    shape = (len(LENGTHS), STEPS, INPUT) if batch_first else (STEPS, len(LENGTHS), INPUT)
    x = torch.randn(shape)
    for b, n in enumerate(LENGTHS):  # zero padding, as PyTorch's unpacked output has
        (x[b, n:] if batch_first else x[n:, b]).zero_()
    hx = initial_states(cell, len(LENGTHS))
    x_ref = x.clone().requires_grad_()
    out_ref, finals_ref = reference_run(ref, x_ref, LENGTHS, hx, batch_first)
    loss_of(out_ref, finals_ref).backward()
    want_grads = [x_ref.grad.clone()] + [h.grad.clone() for h in as_tuple(hx)] + [p.grad.clone() for p in ref.parameters()]
    for h in as_tuple(hx):
        h.grad = None

    x_in = (right_aligned(x, LENGTHS, batch_first) if align == "right" else x).clone().requires_grad_()
    out, finals = rnn(x_in, hx, lengths=LENGTHS, align=align)
    loss_of(right_aligned_back(out, align, batch_first), finals).backward()
    assert_close(right_aligned_back(out, align, batch_first), out_ref, "output")
    for a, b in zip(as_tuple(finals), as_tuple(finals_ref)):
        assert_close(a, b, "final state")
    got_x = right_aligned_back(x_in.grad, align, batch_first)
    got = [got_x] + [h.grad for h in as_tuple(hx)] + [p.grad for p in rnn.parameters()]
    names = ["input"] + ["h0"] * len(as_tuple(hx)) + [n for n, _ in rnn.named_parameters()]
    for name, a, b in zip(names, got, want_grads):
        assert_close(a, b, f"gradient of {name}")


def right_aligned_back(t, align, batch_first):
    """A right-aligned padded tensor moved back to the left (identity for align='left')."""
    if align == "left":
        return t
    out = torch.zeros_like(t)
    for b, n in enumerate(LENGTHS):
        if batch_first:
            out[b, :n] = t[b, STEPS - n :]
        else:
            out[:n, b] = t[STEPS - n :, b]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("enforce_sorted", [False, True])
def test_packed_matches_pytorch(cell, enforce_sorted, backend):
    ref, rnn = pair(cell, batch_first=True, backend=backend)
    lengths = sorted(LENGTHS, reverse=True) if enforce_sorted else LENGTHS
    x = torch.randn(len(lengths), STEPS, INPUT)
    hx = initial_states(cell, len(lengths))
    results = []
    for module in (ref, rnn):
        xi = x.clone().requires_grad_()
        packed = pack_padded_sequence(xi, torch.tensor(lengths), batch_first=True, enforce_sorted=enforce_sorted)
        out, finals = module(packed, hx)
        assert isinstance(out, torch.nn.utils.rnn.PackedSequence)
        loss_of(out.data, finals).backward()
        results.append((out.data.detach(), [f.detach() for f in as_tuple(finals)], xi.grad, grads(*as_tuple(hx)), grads(*module.parameters())))
        for h in as_tuple(hx):
            h.grad = None
    (o1, f1, gx1, gh1, gp1), (o2, f2, gx2, gh2, gp2) = results
    assert_close(o2, o1, "packed output")
    for a, b in zip(f2, f1):
        assert_close(a, b, "final state")
    assert_close(gx2, gx1, "input gradient")
    for a, b in zip(gh2 + gp2, gh1 + gp1):
        assert_close(a, b, "state or weight gradient")


def test_one_layer_one_direction_and_unbatched():
    ref, rnn = pair("gru", batch_first=False, layers=1, bidirectional=False)
    x = torch.randn(STEPS, INPUT)
    out, h = rnn(x)
    out_ref, h_ref = ref(x)
    assert_close(out, out_ref, "unbatched output")
    assert_close(h, h_ref, "unbatched final state")


def test_module_behaves_as_a_module():
    ref, rnn = pair("lstm", batch_first=True)
    assert set(rnn.state_dict()) == set(ref.state_dict())
    opt = torch.optim.SGD(rnn.parameters(), lr=0.1)
    out, _ = rnn(torch.randn(2, 3, INPUT))
    out.sum().backward()
    before = rnn.weight_hh_l1_reverse.detach().clone()
    opt.step()
    assert not torch.equal(before, rnn.weight_hh_l1_reverse)
    assert rnn.to(torch.device("cpu")) is rnn
    # A float64 module takes float64 inputs (and checks in float64: test_float64.py).
    with pytest.raises(cellc.DTypeError, match="float32"):
        rnn.double()(torch.randn(2, 3, INPUT))
