"""``cellc.RNN(dropout=p)``, as ``nn.LSTM(dropout=p)``: between layers in training mode only,
the masks from PyTorch's generator (``torch.manual_seed`` reproduces a call, each call draws
new ones) and drawn again by the backward; on the CPU and on the emulated device's memory."""

import pytest
import torch
from torch import nn

import cellc
from conftest import EMULATED


def pair(backend="cpu", dropout=0.3):
    torch.manual_seed(0)
    reference = nn.LSTM(3, 5, num_layers=2, bidirectional=True, batch_first=True, dropout=dropout)
    rnn = cellc.RNN("lstm", 3, 5, 2, batch_first=True, bidirectional=True, dropout=dropout, backend=backend)
    rnn.load_state_dict(reference.state_dict())
    return reference, rnn


@pytest.mark.parametrize("backend", ["cpu", EMULATED])
def test_evaluation_mode_drops_nothing_as_nn_lstm(backend):
    reference, rnn = pair(backend)
    reference.eval(), rnn.eval()
    x = torch.randn(4, 6, 3)
    want, _ = reference(x)
    got, _ = rnn(x)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
    assert torch.equal(rnn(x)[0], got)


@pytest.mark.parametrize("backend", ["cpu", EMULATED])
def test_training_mode_drops_reproducibly_and_anew_each_call(backend):
    _, rnn = pair(backend)
    rnn.train()
    x = torch.randn(4, 6, 3)
    torch.manual_seed(7)
    first, _ = rnn(x, lengths=[6, 2, 5, 1])
    torch.manual_seed(7)
    again, _ = rnn(x, lengths=[6, 2, 5, 1])
    following, _ = rnn(x, lengths=[6, 2, 5, 1])
    assert torch.equal(first, again), "the same seed drew other masks"
    assert not torch.equal(first, following), "a second call drew the first call's masks"
    rnn.eval()
    assert not torch.equal(first, rnn(x, lengths=[6, 2, 5, 1])[0]), "training mode dropped nothing"


@pytest.mark.parametrize("backend", ["cpu", EMULATED])
def test_the_backward_draws_the_forwards_masks(backend):
    """Gradients in training mode against central differences of the same call (the same
    seed before each forward gives the same masks)."""
    _, rnn = pair(backend, dropout=0.5)
    rnn.train()
    x = torch.randn(2, 4, 3, requires_grad=True)
    direction = torch.randn(2, 4, 3)
    probe = torch.randn(2, 4, 10)

    def loss(x):
        torch.manual_seed(11)
        return (rnn(x)[0] * probe).sum()

    loss(x).backward()
    eps = 1e-2
    with torch.no_grad():
        numeric = (loss(x + eps * direction) - loss(x - eps * direction)) / (2 * eps)
    analytic = (x.grad * direction).sum()
    torch.testing.assert_close(analytic, numeric, rtol=2e-2, atol=2e-3)


def test_one_layer_warns_as_nn_lstm_does():
    with pytest.warns(UserWarning, match="num_layers=1"):
        cellc.RNN("lstm", 3, 5, 1, dropout=0.2)


def test_torch_compile_fullgraph_drops_reproducibly():
    """Under ``torch.compile`` the seed is drawn in the graph (as PyTorch's own dropout, the
    compiled graph's generator is inductor's: the same seed reproduces a compiled call, not
    necessarily an eager one)."""
    _, rnn = pair()
    rnn.train()
    compiled = torch.compile(rnn, fullgraph=True)
    x = torch.randn(4, 6, 3, requires_grad=True)
    torch.manual_seed(3)
    first, _ = compiled(x)
    torch.manual_seed(3)
    again, _ = compiled(x)
    assert torch.equal(first, again)
    first.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_training_equals_nn_lstm_layers_given_the_same_masks():
    """With the masks a call used (``dropout_masks``), two one-layer ``nn.LSTM``s with those
    masks between them compute what the fused two-layer call computed: output and gradients."""
    reference, rnn = pair(dropout=0.4)
    rnn.train()
    x = torch.randn(4, 6, 3, requires_grad=True)
    torch.manual_seed(21)
    out, _ = rnn(x)
    torch.manual_seed(21)
    masks = rnn.dropout_masks(x, cellc.draw_masks())
    assert len(masks) == 1 and masks[0].shape == (4, 6, 10)
    kept = (masks[0] != 0).float().mean().item()
    assert 0.45 < kept < 0.75, kept
    layers = [nn.LSTM(3, 5, batch_first=True, bidirectional=True), nn.LSTM(10, 5, batch_first=True, bidirectional=True)]
    state = reference.state_dict()
    for k, layer in enumerate(layers):
        layer.load_state_dict({name.replace(f"_l{k}", "_l0"): v for name, v in state.items() if f"_l{k}" in name})
    x2 = x.detach().clone().requires_grad_()
    between, _ = layers[0](x2)
    want, _ = layers[1](between * masks[0])
    torch.testing.assert_close(out, want, rtol=2e-4, atol=2e-5)
    probe = torch.randn_like(out)
    (out * probe).sum().backward()
    (want * probe).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=2e-4, atol=2e-5)
