"""The native fast path of plain CPU inference calls (``_cellc.Eager``): the same results, bit
for bit, as the Python layer's steps, and every call it is not for (a mistake included) left to
those steps, with their errors unchanged."""

import pytest
import torch

import cellc
from cellc.errors import LengthError, ShapeError


def both(rnn, *args, **kwargs):
    """The call through the fast path, and through the Python layer's steps."""
    with torch.no_grad():
        fast = rnn(*args, **kwargs)
        eager, rnn._eager = rnn._eager, None
        try:
            slow = rnn(*args, **kwargs)
        finally:
            rnn._eager = eager
    return fast, slow


def same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("align", ["left", "right"])
def test_the_fast_path_is_the_python_layers_call(cell, batch_first, align):
    rnn = cellc.RNN(cell, 5, 7, 2, bidirectional=True, batch_first=batch_first)
    assert rnn._eager is not None
    x = torch.randn(3, 6, 5) if batch_first else torch.randn(6, 3, 5)
    states = [torch.randn(4, 3, 7) for _ in rnn.state_names]
    hx = states[0] if len(states) == 1 else tuple(states)
    for lengths in (None, [6, 2, 4], torch.tensor([3, 6, 1])):
        for h in (None, hx):
            with torch.no_grad():  # the fast path takes this call itself
                assert rnn._eager.infer(x, rnn._weights(), h, lengths, align, 1) is not None
            fast, slow = both(rnn, x, h, lengths=lengths, align=align)
            assert same(fast, slow), (lengths, h is None)


def test_calls_the_fast_path_is_not_for_keep_their_errors_and_meaning():
    rnn = cellc.RNN("lstm", 5, 7, batch_first=True)
    with torch.no_grad():
        with pytest.raises(ShapeError, match="input_size=5"):
            rnn(torch.randn(2, 3, 4))
        with pytest.raises(LengthError):
            rnn(torch.randn(2, 3, 5), lengths=[3, 4])
        with pytest.raises(ShapeError, match="`lengths` has shape"):
            rnn(torch.randn(2, 3, 5), lengths=[3])
        with pytest.raises(ValueError, match="align must be"):
            rnn(torch.randn(2, 3, 5), align="middle")
        with pytest.raises((ShapeError, ValueError)):
            rnn(torch.randn(2, 3, 5), (torch.randn(1, 3, 7), torch.randn(1, 2, 7)))
        # Unbatched, half precision, float64, non-contiguous: the Python layer's calls.
        assert rnn(torch.randn(3, 5))[0].shape == (3, 7)
        assert rnn(torch.randn(2, 3, 5, dtype=torch.bfloat16))[0].dtype == torch.bfloat16
        x = torch.randn(3, 2, 5).transpose(0, 1)
        assert torch.equal(rnn(x)[0], rnn(x.contiguous())[0])
        double = cellc.RNN("lstm", 5, 7, batch_first=True).double().eval()
        assert double(torch.randn(2, 3, 5, dtype=torch.float64))[0].dtype == torch.float64


def test_training_mode_dropout_is_drawn_under_no_grad_as_nn_lstm_does():
    rnn = cellc.RNN("lstm", 5, 7, 2, dropout=0.5, batch_first=True)
    x = torch.randn(2, 4, 5)
    with torch.no_grad():
        rnn.train()
        dropped = rnn(x)[0]
        rnn.eval()
        kept = rnn(x)[0]
    assert not torch.equal(dropped, kept)


def test_cells_with_rates_and_other_back_ends_take_the_python_layers_steps():
    assert cellc.RNN("zoneout_lstm", 3, {"H": 4})._eager is None
    assert cellc.RNN("lstm", 3, 4, backend="reference")._eager is None
    assert cellc.RNN("lstm", 3, 4, backend="cpu")._eager is not None


@pytest.mark.parametrize("cell", ["lstm", "gru", "layernorm_lstm"])
def test_frozen_calls_give_the_unfrozen_bits(cell):
    rnn = cellc.RNN(cell, 5, 7, 2, bidirectional=True, batch_first=True)
    x, lengths = torch.randn(3, 6, 5), [6, 2, 4]
    with torch.no_grad():
        plain = rnn(x, lengths=lengths)
        with rnn.frozen():
            frozen = rnn(x, lengths=lengths)
    assert same(frozen, plain)
    # A generation loop: one step a call, the state carried.
    rnn = cellc.RNN(cell, 5, 5, 2, batch_first=True)
    with torch.no_grad():
        whole = rnn(x)[0]
        state, steps = None, []
        with rnn.frozen():
            for t in range(6):
                y, state = rnn(x[:, t : t + 1], state)
                steps.append(y)
    assert torch.equal(torch.cat(steps, 1), whole)


def test_frozen_calls_read_the_weights_of_the_blocks_entry_until_its_end():
    rnn = cellc.RNN("gru", 4, 6)
    x = torch.randn(2, 3, 4)
    with torch.no_grad():
        before = rnn(x)[0]
        with rnn.frozen():
            with rnn.frozen():
                rnn.weight_hh_l0.mul_(0.5)
            # Still inside the outer block: the copy made on entering it.
            assert torch.equal(rnn(x)[0], before)
        after = rnn(x)[0]
    assert not torch.equal(after, before)
    with torch.no_grad():
        assert torch.equal(rnn(x)[0], after)
    # Calls that record autograd read the module's weights as ever, frozen or not.
    with rnn.frozen():
        assert torch.equal(rnn(x)[0].detach(), after)


def test_frozen_weights_that_are_not_plain_tensors_leave_the_calls_as_they_were():
    rnn = cellc.RNN("lstm", 4, 6)
    x = torch.randn(2, 3, 4)
    with torch.no_grad():
        rnn.weight_ih_l0.data = rnn.weight_ih_l0.data.t().contiguous().t()  # not contiguous
        expected = rnn(x)[0]
        with rnn.frozen():
            assert torch.equal(rnn(x)[0], expected)
