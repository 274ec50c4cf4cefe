"""torch.compile(fullgraph=True) on a model containing cellc.RNN: one graph, no break, the
operator cellc::rnn_forward inside it, the same outputs and gradients as eager mode, and no
recompilation for new lengths. nn.LSTM with pack_padded_sequence cannot be compiled whole."""

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import cellc

# This sample compiles with backend="aot_eager": the same graph capture, fake tensors and
# autograd graph as the default backend (inductor), without generating C++, so that it runs in
# seconds. runtime/python/tests/test_compile.py compiles with inductor.
BACKEND = "aot_eager"


# ANCHOR: compile
class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.rnn = cellc.RNN("layernorm_lstm", 8, {"H": 12}, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * 12, 5)

    def forward(self, tokens, lengths):
        out, _ = self.rnn(self.embed(tokens), lengths=lengths, align="right")
        return self.head(out).log_softmax(-1)


model = Tagger()
graphs = []


def backend(graph, example_inputs):  # records each graph Dynamo captures, then compiles it
    graphs.append(graph)
    return torch._dynamo.lookup_backend(BACKEND)(graph, example_inputs)


compiled = torch.compile(model, fullgraph=True, backend=backend)  # your code: torch.compile(model, fullgraph=True)
tokens = torch.randint(0, 20, (4, 9))
lengths = torch.tensor([9, 3, 5, 9])
logp = compiled(tokens, lengths)
assert len(graphs) == 1  # one graph for the whole model: cellc's operator is a node in it
assert any("cellc.rnn_forward" in str(node.target) for node in graphs[0].graph.nodes)
# ANCHOR_END: compile

# ANCHOR: same_as_eager
grads = torch.autograd.grad(logp.sum(), list(model.parameters()))
want = model(tokens, lengths)
want_grads = torch.autograd.grad(want.sum(), list(model.parameters()))
torch.testing.assert_close(logp, want, atol=1e-5, rtol=1e-5)
for a, b in zip(grads, want_grads):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

# New lengths are data, not part of the graph: no recompilation.
compiled(tokens, torch.tensor([2, 9, 9, 4]))
assert len(graphs) == 1
# ANCHOR_END: same_as_eager

# ANCHOR: nn_breaks
lstm = nn.LSTM(8, 12, batch_first=True)


def with_nn(x, lengths):
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    out, _ = lstm(packed)
    return pad_packed_sequence(out, batch_first=True)[0]


try:
    torch.compile(with_nn, fullgraph=True, backend=BACKEND)(torch.randn(4, 9, 8), lengths)
    raise AssertionError("nn.LSTM with pack_padded_sequence compiled as one graph")
except torch._dynamo.exc.Unsupported as e:
    # Dynamo does not trace pack_padded_sequence, nor nn.LSTM itself: without fullgraph=True
    # the model is cut into graphs around them, and they run eagerly.
    print("nn.LSTM + pack_padded_sequence under fullgraph=True:", str(e).splitlines()[0])
# ANCHOR_END: nn_breaks
print("compiled whole, the same as eager")
