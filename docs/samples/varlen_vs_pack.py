"""What pack_padded_sequence does that cellc.RNN does not: sort, copy, insist on padding at the
end; and what nn.LSTM on a padded tensor gets wrong without it."""

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import cellc

torch.manual_seed(0)
lstm = nn.LSTM(3, 4, batch_first=True)
rnn = cellc.RNN("lstm", 3, 4, batch_first=True)
rnn.load_state_dict(lstm.state_dict())
x = torch.randn(3, 6, 3)
lengths = torch.tensor([6, 2, 4])
for b, n in enumerate(lengths):
    x[b, n:] = 0  # padding at the end

# ANCHOR: pack
packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
# Sorted: the batch is reordered by length (longest first) ...
assert packed.sorted_indices.tolist() == [0, 2, 1]
# ... and copied: packed.data is a new [sum(lengths), F] tensor, step by step.
assert packed.data.shape == (12, 3)
assert packed.data.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
out, (h_n, c_n) = lstm(packed)
out, _ = pad_packed_sequence(out, batch_first=True, total_length=6)   # and copied back

# cellc reads the padded batch where it lies, in the caller's order: the same numbers.
got, (h, c) = rnn(x, lengths=lengths)
torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(h, h_n, atol=1e-5, rtol=1e-5)
# ANCHOR_END: pack

# ANCHOR: padded_nn
# nn.LSTM on the padded tensor (no packing) runs the padding too: a short sequence's h_n is
# its state after the padding's steps, not at its own end.
_, (h_padded, _) = lstm(x)
torch.testing.assert_close(h_padded[:, 0], h[:, 0], atol=1e-5, rtol=1e-5)  # full length: the same
assert not torch.allclose(h_padded[:, 1], h[:, 1], atol=1e-3)              # length 2 of 6: not
# ANCHOR_END: padded_nn

# ANCHOR: right
# Padding at the start (right-aligned, as a left-padding tokenizer makes it): pack_padded_sequence
# reads every sequence from step 0, so the batch must first be shifted to the left (a copy).
right = torch.zeros_like(x)
for b, n in enumerate(lengths):
    right[b, 6 - n :] = x[b, :n]
shifted = torch.stack([r.roll(-(6 - int(n)), dims=0) for r, n in zip(right, lengths)])
out, (h_n, _) = lstm(pack_padded_sequence(shifted, lengths, batch_first=True, enforce_sorted=False))
# cellc reads it in place:
got, (h, _) = rnn(right, lengths=lengths, align="right")
torch.testing.assert_close(h, h_n, atol=1e-5, rtol=1e-5)
# ANCHOR_END: right
print("cellc.RNN gives the packed nn.LSTM's results with no sorting, packing or shifting")
