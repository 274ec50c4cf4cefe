"""cellc.RNN where nn.LSTM was: the same weights give the same outputs, final states and
gradients, for a batch of unsorted lengths that nn.LSTM needs packed and cellc takes padded."""

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

# ANCHOR: any_cell
import cellc

rnn = cellc.RNN("layernorm_lstm",           # a shipped cell, a .cell path, or .cell source text
                input_size=64, sizes={"H": 128}, num_layers=2, bidirectional=True, batch_first=True)
x = torch.randn(8, 30, 64, requires_grad=True)
lengths = torch.tensor([30, 12, 25, 7, 30, 18, 3, 22])   # unsorted; no pack_padded_sequence
out, (h, c) = rnn(x, lengths=lengths)        # padding at the end; align="right": at the start
out.sum().backward()                         # the fused backward; gradients on rnn's parameters
assert out.shape == (8, 30, 2 * 128) and h.shape == c.shape == (2 * 2, 8, 128)
assert x.grad is not None and all(p.grad is not None for p in rnn.parameters())
# ANCHOR_END: any_cell

# ANCHOR: same_as_lstm
torch.manual_seed(0)
lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
torch.manual_seed(0)
cell = cellc.RNN("lstm", 16, 32, 2, batch_first=True)   # nn.LSTM's positional form
# After the same seed, the same weights (the same names, the same draws):
for (name, a), (cname, b) in zip(lstm.named_parameters(), cell.named_parameters()):
    assert name == cname and torch.equal(a, b)
cell.load_state_dict(lstm.state_dict())     # and a trained nn.LSTM's state_dict loads as it is

x = torch.randn(4, 10, 16, requires_grad=True)
lengths = torch.tensor([10, 4, 7, 1])
packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
want, (want_h, want_c) = lstm(packed)
want, _ = pad_packed_sequence(want, batch_first=True, total_length=10)

got, (got_h, got_c) = cell(x, lengths=lengths)
for a, b in [(got, want), (got_h, want_h), (got_c, want_c)]:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)   # float32 rounding, not bits
# ANCHOR_END: same_as_lstm

# ANCHOR: gradients
# Gradients of a loss on the outputs and the final states, by cellc's fused backward and by nn.LSTM's:
got_grads = torch.autograd.grad(got.sum() + got_h.sum(), [x, *cell.parameters()])
want_grads = torch.autograd.grad(want.sum() + want_h.sum(), [x, *lstm.parameters()])
for a, b in zip(got_grads, want_grads):
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
# ANCHOR_END: gradients
print("cellc.RNN gives nn.LSTM's outputs, final states and gradients")
