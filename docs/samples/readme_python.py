"""The README's Python sample, run by test_book_samples.py; the README shows the lines between
the ANCHOR markers, and runtime/cli/tests/book.rs checks that it shows them unchanged."""

import torch

import cellc

# ANCHOR: readme
rnn = cellc.RNN("layernorm_lstm", input_size=64, sizes={"H": 128}, num_layers=2, batch_first=True)
x = torch.randn(16, 40, 64, requires_grad=True)
lengths = torch.randint(1, 41, (16,))  # unsorted: no pack_padded_sequence
out, (h, c) = rnn(x, lengths=lengths, align="right")  # padding before each sequence
out.sum().backward()  # the fused backward

lstm = cellc.RNN("lstm", 64, {"H": 128})  # nn.LSTM's parameter names and numbers
lstm.load_state_dict(torch.nn.LSTM(64, 128).state_dict())
# ANCHOR_END: readme

assert out.shape == (16, 40, 128) and h.shape == (2, 16, 128)
assert x.grad is not None and rnn.weight_hh_l1.grad is not None
