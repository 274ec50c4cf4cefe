"""``cellc.RNN`` where ``nn.LSTM`` code expects ``nn.LSTM``: its constructor, attributes and
initialisation, and the errors a user porting a recipe meets, in Python's terms."""

import os

import numpy as np
import pytest
import torch
from torch import nn

import cellc


def test_nn_lstm_positional_form_and_attributes():
    rnn = cellc.RNN("lstm", 20, 30, 2, True, True)  # input, hidden, layers, bias, batch_first
    lstm = nn.LSTM(20, 30, 2, True, True)
    for name in ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "bidirectional",
                 "dropout", "proj_size"):
        assert getattr(rnn, name) == getattr(lstm, name), name
    assert [n for n, _ in rnn.named_parameters()] == [n for n, _ in lstm.named_parameters()]
    shapes = lambda m: [[tuple(p.shape) for p in ps] for ps in m.all_weights]  # noqa: E731
    assert shapes(rnn) == shapes(lstm)
    rnn.flatten_parameters()
    assert cellc.RNN("lstm", 20, hidden_size=30).sizes == {"H": 30}


def test_a_weight_swapped_for_a_plain_tensor_is_the_one_read():
    # As AWD-LSTM's WeightDrop does: the parameter removed, a tensor set under its name.
    torch.manual_seed(0)
    rnn = cellc.RNN("lstm", 4, 8)
    x = torch.randn(3, 2, 4)
    w = rnn.weight_hh_l0.detach().clone()
    del rnn._parameters["weight_hh_l0"]
    rnn.weight_hh_l0 = torch.zeros_like(w)
    zeroed, _ = rnn(x)
    rnn.weight_hh_l0 = w
    kept, _ = rnn(x)
    assert not torch.equal(zeroed, kept)


def test_initialisation_draws_as_nn_lstm_does():
    torch.manual_seed(7)
    lstm = nn.LSTM(5, 12, 2, bidirectional=True)
    after_lstm = torch.rand(3)
    torch.manual_seed(7)
    rnn = cellc.RNN("lstm", 5, 12, 2, bidirectional=True)
    after_rnn = torch.rand(3)
    for (name, p), (_, q) in zip(rnn.named_parameters(), lstm.named_parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(after_rnn, after_lstm), "the generator is left where nn.LSTM leaves it"


def test_an_explicit_seed_leaves_torchs_generator_alone():
    torch.manual_seed(3)
    rnn = cellc.RNN("gru", 4, 6)
    state = torch.random.get_rng_state()
    rnn.reset_parameters(seed=11)
    assert torch.equal(torch.random.get_rng_state(), state)
    again = cellc.RNN("gru", 4, 6)
    again.reset_parameters(seed=11)
    assert all(torch.equal(p, q) for p, q in zip(rnn.parameters(), again.parameters()))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"sizes": {"X": 4}}, ValueError, r"'X'.*does not have.*'H'"),
    ({"sizes": {"H": -3}}, ValueError, r"sizes\['H'\] must be an integer in \[1,"),
    ({"sizes": {"H": 1 << 40}}, ValueError, r"sizes\['H'\] must be"),
    ({"sizes": {"H": 7.9}}, TypeError, r"sizes\['H'\] must be an integer, not float"),
    ({"sizes": {"H": True}}, TypeError, r"must be an integer, not bool"),
    ({"hidden_size": 0}, ValueError, r"hidden_size must be"),
    ({"hidden_size": 8, "num_layers": 0}, ValueError, r"num_layers must be"),
    ({"hidden_size": 8, "dropout": 1.0}, ValueError, r"dropout must be a number in \[0, 1\)"),
    ({"hidden_size": 8, "dropout": -0.1}, ValueError, r"dropout must be a number in \[0, 1\)"),
    ({"hidden_size": 8, "bias": False}, ValueError, r"bias=False"),
    ({"hidden_size": 8, "proj_size": 4}, ValueError, r"proj_size"),
])
def test_bad_arguments_are_python_errors_naming_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        cellc.RNN("lstm", 4, **kwargs)


def test_bad_input_size_names_it():
    with pytest.raises(ValueError, match=r"input_size must be an integer in"):
        cellc.RNN("lstm", -1, 8)


def test_an_unbound_size_speaks_python():
    with pytest.raises(cellc.ShapeError, match=r"sizes=\{'H': N\}") as e:
        cellc.RNN("lstm", 3)
    assert "-D" not in str(e.value)


def test_a_file_named_like_a_shipped_cell_does_not_shadow_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lstm").mkdir()
    (tmp_path / "gru").write_text("not a cell")
    assert cellc.RNN("lstm", 4, 8).cell == "lstm"
    assert cellc.RNN("gru", 4, 8).cell == "gru"
    (tmp_path / "mine.cell").write_text(
        "cell mine { input x[I] state h[H] param w[H, I] h' = tanh(w @ x + h) output h' }")
    assert cellc.RNN("mine.cell", 4, 8).cell == "mine"
    assert cellc.RNN(os.path.join(".", "mine.cell"), 4, 8).cell == "mine"


def test_modules_made_on_the_meta_device():
    with torch.device("meta"):
        rnn = cellc.RNN("lstm", 4, 8)
    assert all(p.device.type == "meta" for p in rnn.parameters())
    rnn = cellc.RNN("lstm", 4, 8, device="meta")
    rnn.to_empty(device="cpu")
    rnn.reset_parameters()
    out, _ = rnn(torch.randn(2, 3, 4))
    assert out.shape == (2, 3, 8)


def test_initial_states_must_be_tensors():
    rnn = cellc.RNN("lstm", 4, 8)
    h = np.zeros((1, 3, 8), dtype=np.float32)
    with pytest.raises(TypeError, match=r"initial state `h` must be a Tensor, not ndarray"):
        rnn(torch.randn(2, 3, 4), (h, h))


def test_double_backward_is_refused_with_cellcs_message():
    rnn = cellc.RNN("lstm", 4, 8)
    x = torch.randn(2, 3, 4, requires_grad=True)
    out, _ = rnn(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="cellc's backward is not differentiable"):
        g.sum().backward()
