"""float64 ``cellc.RNN`` calls: the interpreter in f64, one sequence at a time, differentiable,
so ``torch.autograd.gradcheck`` passes on any cell; equal to ``nn.LSTM`` in float64."""

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import cellc
from cellc.errors import DTypeError

LENGTHS = [4, 1, 3]

ZONEOUT_GRU = """
cell zgru {
    input x[I]
    state h[H]
    param w[3*H, I], u[3*H, H], b[3*H]
    rate zh = 0.2
    let r, z, n = chunk(w @ x + b, 3)
    let ur, uz, un = chunk(u @ h, 3)
    let candidate = tanh(n + sigmoid(r + ur) * un)
    h' = zoneout(h, (1 - sigmoid(z + uz)) * candidate + sigmoid(z + uz) * h, zh)
    output h'
}
"""


def test_float64_lstm_is_nn_lstms_in_float64():
    torch.manual_seed(0)
    ref = nn.LSTM(5, 6, num_layers=2, bidirectional=True, batch_first=True).double()
    rnn = cellc.RNN("lstm", 5, {"H": 6}, num_layers=2, bidirectional=True, batch_first=True, dtype=torch.float64)
    rnn.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    hx = tuple(torch.randn(4, 3, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out, (h, c) = rnn(x, hx, lengths=LENGTHS)
    packed = pack_padded_sequence(x, torch.tensor(LENGTHS), batch_first=True, enforce_sorted=False)
    want, (wh, wc) = ref(packed, hx)
    want, _ = pad_packed_sequence(want, batch_first=True, total_length=4)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close((h, c), (wh, wc), atol=1e-12, rtol=1e-12)
    grads = torch.autograd.grad(out.sum() + h.sum(), [x, *hx, *rnn.parameters()])
    want_grads = torch.autograd.grad(want.sum() + wh.sum(), [x, *hx, *ref.parameters()])
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-11, rtol=1e-11)
    # Right-aligned and packed inputs give the same values.
    right = torch.zeros_like(x)
    for b, n in enumerate(LENGTHS):
        right[b, 4 - n:] = x[b, :n]
    out_r, _ = rnn(right, hx, lengths=LENGTHS, align="right")
    for b, n in enumerate(LENGTHS):
        torch.testing.assert_close(out_r[b, 4 - n:], out[b, :n], atol=0, rtol=0)
    got, _ = rnn(packed, hx)
    torch.testing.assert_close(pad_packed_sequence(got, batch_first=True, total_length=4)[0], out, atol=0, rtol=0)


@pytest.mark.parametrize("cell,sizes,layers,bidirectional", [
    ("lstm", {"H": 3}, 2, True),
    ("gru", {"H": 3}, 1, False),
    ("layernorm_lstm", {"H": 3}, 1, True),
    ("mi_lstm", {"H": 2}, 2, False),
    (ZONEOUT_GRU, {"H": 3}, 1, True),
])
def test_gradcheck_passes_on_inputs_states_and_weights(cell, sizes, layers, bidirectional):
    torch.manual_seed(1)
    rnn = cellc.RNN(cell, 2, sizes, num_layers=layers, bidirectional=bidirectional, batch_first=True).double().eval()
    names = [n for n, _ in rnn.named_parameters()]
    slots = layers * (2 if bidirectional else 1)
    x = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    h0 = tuple(torch.randn(slots, 2, n, dtype=torch.float64, requires_grad=True) for n in rnn.state_sizes)
    resets = torch.tensor([[False, False, True], [False, True, False]])

    def run(x, *tensors):
        states, weights = tensors[:len(h0)], tensors[len(h0):]
        hx = states[0] if len(states) == 1 else states
        out, finals = functional_call(rnn, dict(zip(names, weights)), (x, hx),
                                      {"lengths": [3, 2], "resets": resets})
        finals = (finals,) if isinstance(finals, torch.Tensor) else finals
        return (out, *finals)

    weights = tuple(p.detach().clone().requires_grad_() for p in rnn.parameters())
    assert torch.autograd.gradcheck(run, (x, *h0, *weights), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_float32_results_are_near_the_float64_ones():
    torch.manual_seed(2)
    rnn = cellc.RNN("gru", 4, {"H": 8}, num_layers=2, batch_first=True)
    x = torch.randn(3, 4, 4)
    exact, _ = rnn.double()(x.double(), lengths=LENGTHS)
    got, _ = rnn.float()(x, lengths=LENGTHS)
    torch.testing.assert_close(got.double(), exact, atol=1e-6, rtol=1e-5)


def test_float64_needs_float64_everywhere_and_evaluation_for_masks():
    rnn = cellc.RNN(ZONEOUT_GRU, 2, {"H": 3}).double()
    x = torch.randn(3, 2, 2, dtype=torch.float64)
    with pytest.raises(DTypeError, match="eval"):
        rnn.train()(x)
    rnn.eval()
    with pytest.raises(DTypeError, match="float64"):
        rnn(x.float())
    with pytest.raises(DTypeError, match="initial state"):
        rnn(x, torch.zeros(1, 2, 3))
    with pytest.raises(DTypeError, match="parameter"):
        cellc.RNN("lstm", 2, {"H": 3})(x)
    rnn(x)  # in evaluation, float64 everywhere: runs
