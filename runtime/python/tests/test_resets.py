"""Per-step resets (``rnn(x, lengths=..., resets=...)``): at a flagged step the state restarts
from the initial state, as if a new sequence began there. Checked against ``nn.LSTM`` run on
each stretch between resets alone, from the same initial state, with autograd summing the
initial state's gradient over the stretches."""

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import cellc
from cellc.errors import DTypeError, ShapeError

from conftest import EMULATED

BACKENDS = ["cpu", EMULATED]


def _model(backend, layers=2, bidirectional=True, batch_first=False, seed=0):
    torch.manual_seed(seed)
    ref = nn.LSTM(5, 7, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
    rnn = cellc.RNN("lstm", 5, {"H": 7}, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                    backend=backend)
    rnn.load_state_dict(ref.state_dict())
    return ref, rnn


def _segments(length, flags):
    """(first, end) of each stretch of a sequence of `length` steps split at its flags."""
    cuts = [t for t in range(1, length) if flags[t]]
    return list(zip([0, *cuts], [*cuts, length]))


def _reference(ref, x, h0, c0, lengths, resets, align):
    """nn.LSTM on each stretch alone (batch-first tensors), outputs placed back, finals of
    each sequence's last stretch."""
    batch, steps = x.shape[:2]
    out = x.new_zeros((batch, steps, ref.hidden_size * (2 if ref.bidirectional else 1)))
    h_n, c_n = [], []
    for b in range(batch):
        shift = steps - lengths[b] if align == "right" else 0
        for first, end in _segments(lengths[b], resets[b, shift:shift + lengths[b]].tolist()):
            piece = x[b, shift + first:shift + end].unsqueeze(1 if not ref.batch_first else 0)
            y, (h, c) = ref(piece, (h0[:, b:b + 1], c0[:, b:b + 1]))
            y = y.squeeze(1 if not ref.batch_first else 0)
            out = out.index_put((torch.tensor([b]), torch.arange(shift + first, shift + end)), y)
        h_n.append(h)
        c_n.append(c)
    return out, torch.cat(h_n, 1), torch.cat(c_n, 1)


def _random_resets(lengths, steps, seed):
    g = torch.Generator().manual_seed(seed)
    resets = torch.rand((len(lengths), steps), generator=g) < 0.25
    return resets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("align", ["left", "right"])
def test_resets_match_each_stretch_run_alone(backend, align):
    ref, rnn = _model(backend)
    lengths = [6, 3, 9, 1, 7]
    batch, steps = len(lengths), 9
    torch.manual_seed(1)
    x = torch.randn(batch, steps, 5)
    h0, c0 = torch.randn(4, batch, 7) * 0.5, torch.randn(4, batch, 7) * 0.5
    resets = _random_resets(lengths, steps, 2)
    gy, gh, gc = torch.randn(batch, steps, 14), torch.randn(4, batch, 7), torch.randn(4, batch, 7)

    xr, h0r, c0r = (t.clone().requires_grad_() for t in (x, h0, c0))
    ref_out, ref_h, ref_c = _reference(ref, xr, h0r, c0r, lengths, resets, align)
    mask = torch.zeros(batch, steps, 1)
    for b, n in enumerate(lengths):
        shift = steps - n if align == "right" else 0
        mask[b, shift:shift + n] = 1
    ((ref_out * gy * mask).sum() + (ref_h * gh).sum() + (ref_c * gc).sum()).backward()

    xc, h0c, c0c = (t.clone().requires_grad_() for t in (x, h0, c0))
    # cellc takes time-first here: the resets follow the input's layout.
    out, (h, c) = rnn(xc.transpose(0, 1), (h0c, c0c), lengths=lengths, align=align, resets=resets.t())
    out = out.transpose(0, 1)
    ((out * gy).sum() + (h * gh).sum() + (c * gc).sum()).backward()

    torch.testing.assert_close(out, ref_out * mask, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(h, ref_h, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(c, ref_c, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(xc.grad, xr.grad * mask, atol=5e-5, rtol=1e-4)
    # The initial state's gradient sums every stretch's.
    torch.testing.assert_close(h0c.grad, h0r.grad, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(c0c.grad, c0r.grad, atol=5e-5, rtol=1e-4)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(dict(rnn.named_parameters())[name].grad, p.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_resets_are_the_padded_ones(backend):
    """In device memory (the emulated device's), a packing runs in its own order (the states
    permuted, as nn.LSTM does on a GPU): the flags follow their rows there too."""
    _, rnn = _model(backend, layers=1, bidirectional=True, batch_first=True)
    lengths = [4, 7, 2]
    torch.manual_seed(3)
    x = torch.randn(3, 7, 5)
    resets = _random_resets(lengths, 7, 4)
    padded, _ = rnn(x, lengths=lengths, resets=resets)
    packed_x = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
    packed_flags = pack_padded_sequence(resets, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
    packed, _ = rnn(packed_x, resets=packed_flags)
    unpacked, _ = torch.nn.utils.rnn.pad_packed_sequence(packed, batch_first=True, total_length=7)
    torch.testing.assert_close(unpacked, padded, atol=0, rtol=0)
    without, _ = rnn(packed_x)
    assert not torch.allclose(packed.data, without.data)


def test_no_flag_inside_a_sequence_changes_nothing():
    _, rnn = _model("cpu")
    torch.manual_seed(5)
    x = torch.randn(6, 3, 5)
    lengths = [6, 4, 2]
    resets = torch.zeros(6, 3, dtype=torch.bool)
    resets[0] = True  # every first step
    resets[5, 2] = resets[4, 2] = True  # padding
    with_flags, finals = rnn(x, lengths=lengths, resets=resets)
    plain, plain_finals = rnn(x, lengths=lengths)
    assert torch.equal(with_flags, plain)
    assert all(torch.equal(a, b) for a, b in zip(finals, plain_finals))


def test_bad_resets_are_named():
    _, rnn = _model("cpu", layers=1, bidirectional=False)
    x = torch.randn(4, 2, 5)
    with pytest.raises(ShapeError, match="resets"):
        rnn(x, resets=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(DTypeError, match="resets"):
        rnn(x, resets=torch.zeros(4, 2))


def test_resets_under_torch_compile():
    _, rnn = _model("cpu", layers=1, bidirectional=False)
    torch.manual_seed(6)
    x = torch.randn(5, 2, 5)
    resets = torch.zeros(5, 2, dtype=torch.bool)
    resets[3, 0] = True
    eager, _ = rnn(x, resets=resets)
    compiled = torch.compile(lambda x, r: rnn(x, resets=r)[0], fullgraph=True)
    torch.testing.assert_close(compiled(x, resets), eager, atol=0, rtol=0)
