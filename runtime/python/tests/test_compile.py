"""``torch.compile(fullgraph=True)``: a model containing ``cellc.RNN`` compiles with no graph
break, and its outputs and gradients equal eager mode's."""

import torch
from torch import nn

import cellc


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.rnn = cellc.RNN("layernorm_lstm", 8, {"H": 12}, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(24, 5)

    def forward(self, tokens, lengths):
        out, (h, c) = self.rnn(self.embed(tokens), lengths=lengths, align="right")
        return self.head(out).log_softmax(-1), h.sum() + c.sum()


def run(model, tokens, lengths):
    model.zero_grad()
    logp, extra = model(tokens, lengths)
    (logp.sum() + extra).backward()
    return logp.detach(), [p.grad.clone() for p in model.parameters()]


def test_fullgraph_compile_matches_eager():
    torch._dynamo.reset()
    model = Tagger()
    tokens = torch.randint(0, 20, (4, 9))
    lengths = torch.tensor([9, 3, 5, 9])
    want, want_grads = run(model, tokens, lengths)
    compiled = torch.compile(model, fullgraph=True)
    got, got_grads = run(compiled, tokens, lengths)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Another batch shape: the operators' fake implementations give the new shapes.
    got, _ = run(compiled, torch.randint(0, 20, (3, 6)), torch.tensor([6, 2, 4]))
    assert got.shape == (3, 6, 5)


def test_the_operators_constant_spec_names_the_version():
    # torch.compile's caches key a graph by its constants, the spec among them: a graph whose
    # reserve shape an older cellc computed is then never reused by a newer one.
    import json

    rnn = cellc.RNN("lstm", 4, 4)
    assert json.loads(rnn.spec)["cellc"] == cellc.__version__
    assert cellc.__version__.count(".") == 2
