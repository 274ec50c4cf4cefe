"""Saving whole models as PyTorch users do: ``torch.save(model)`` and ``torch.load`` with its
default ``weights_only=True``, as PyTorch's ``word_language_model`` saves its best model and loads
it back, with ``cellc.RNN`` in place of ``nn.LSTM``: the recipe allows its own classes, and cellc's
needs no more than ``import cellc``."""

import copy
import io
import pickle

import torch
from torch import nn

import cellc


class RNNModel(nn.Module):
    """word_language_model's model.py, the RNN one line changed: encoder, recurrent stack, decoder."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = cellc.RNN("lstm", ninp, nhid, nlayers, dropout=dropout)  # was nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        return self.decoder(output).view(-1, self.ntoken), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


RECIPE_CLASSES = [RNNModel, nn.Embedding, nn.Linear, nn.Dropout]


def test_the_recipes_save_and_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = RNNModel(30, 8, 12, 2, dropout=0.2)
    data = torch.randint(0, 30, (7, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    output, _ = model(data, model.init_hidden(4))
    nn.functional.cross_entropy(output, data.view(-1)).backward()
    optimizer.step()
    path = tmp_path / "model.pt"
    with open(path, "wb") as f:
        torch.save(model, f)
    # The recipe allows its own classes; cellc's are allowed by importing cellc.
    with open(path, "rb") as f, torch.serialization.safe_globals(RECIPE_CLASSES):
        loaded = torch.load(f)
    loaded.rnn.flatten_parameters()
    model.eval(), loaded.eval()
    want, (h, c) = model(data, model.init_hidden(4))
    got, (h2, c2) = loaded(data, loaded.init_hidden(4))
    assert torch.equal(got, want) and torch.equal(h2, h) and torch.equal(c2, c)
    assert loaded.rnn.dropout == 0.2 and loaded.rnn.spec == model.rnn.spec
    # It trains on: the compiled model was rebuilt from the spec.
    loaded.train()
    output, _ = loaded(data, loaded.init_hidden(4))
    nn.functional.cross_entropy(output, data.view(-1)).backward()
    assert all(p.grad is not None for p in loaded.rnn.parameters())


def test_a_pickled_module_holds_no_native_handle_and_keeps_its_rates():
    rnn = cellc.RNN("zoneout_lstm", 3, {"H": 4}, num_layers=2, dropout=0.3, rates={"zc": 0.2})
    blob = pickle.dumps(rnn)
    assert b"Handle" not in blob and b"_cellc" not in blob
    buffer = io.BytesIO()
    torch.save(rnn, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True: cellc.RNN alone, nothing to allow
    for other in (loaded, pickle.loads(blob), copy.deepcopy(rnn)):
        assert other.rates == {"zh": 0.1, "zc": 0.2} and other.dropout == 0.3
        x = torch.randn(5, 2, 3)
        rnn.eval(), other.eval()
        assert torch.equal(other(x)[0], rnn(x)[0])
        other.rates = {"zh": 0.0}  # still a property: checked, filled with defaults
        assert other.rates == {"zh": 0.0, "zc": 0.1}
