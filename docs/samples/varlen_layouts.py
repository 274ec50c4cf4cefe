"""One batch of unsorted lengths, laid out four ways (padded with the padding at the end or at
the start, time first, packed): cellc.RNN gives the same outputs and final states for each, and
the same as each sequence run alone."""

import torch
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

import cellc

torch.manual_seed(0)
rnn = cellc.RNN("lstm", 3, {"H": 4}, num_layers=2, bidirectional=True, batch_first=True)
seqs = [torch.randn(n, 3) for n in (5, 2, 4)]  # three sequences, unsorted lengths
lengths = [len(s) for s in seqs]
T = max(lengths)

# ANCHOR: layouts
# Padding at the end (left-aligned, as pad_sequence makes it): [B, T, F]
left = torch.zeros(3, T, 3)
for b, s in enumerate(seqs):
    left[b, : len(s)] = s
out_left, (h_left, c_left) = rnn(left, lengths=lengths)

# Padding at the start (right-aligned: every sequence ends at step T - 1), read where it lies
right = torch.zeros(3, T, 3)
for b, s in enumerate(seqs):
    right[b, T - len(s) :] = s
out_right, (h_right, c_right) = rnn(right, lengths=lengths, align="right")

# A PackedSequence, as pack_sequence / pack_padded_sequence make it: the output is packed too
packed = pack_sequence(seqs, enforce_sorted=False)
out_packed, (h_packed, c_packed) = rnn(packed)
# ANCHOR_END: layouts

# The same numbers, each where its layout puts it.
for b, n in enumerate(lengths):
    torch.testing.assert_close(out_right[b, T - n :], out_left[b, :n])
    assert out_left[b, n:].eq(0).all() and out_right[b, : T - n].eq(0).all()  # zeros at padding
unpacked, _ = pad_packed_sequence(out_packed, batch_first=True)
torch.testing.assert_close(unpacked, out_left)
for got in (h_right, h_packed):
    torch.testing.assert_close(got, h_left)
for got in (c_right, c_packed):
    torch.testing.assert_close(got, c_left)

# ANCHOR: time_first
# Time first ([T, B, F]) is the same call on a module made with batch_first=False.
tf = cellc.RNN("lstm", 3, {"H": 4}, num_layers=2, bidirectional=True)
tf.load_state_dict(rnn.state_dict())
out_tf, (h_tf, _) = tf(left.transpose(0, 1), lengths=lengths)
assert out_tf.shape == (T, 3, 2 * 4)
# ANCHOR_END: time_first
torch.testing.assert_close(out_tf.transpose(0, 1), out_left)
torch.testing.assert_close(h_tf, h_left)

# ANCHOR: alone
# Each sequence's results are those of the sequence run alone: its final states are taken at
# its own last step, and the reverse direction starts from its own last element, not from
# the padding.
for b, s in enumerate(seqs):
    out_alone, (h_alone, c_alone) = rnn(s[None])          # a batch of one, no padding
    torch.testing.assert_close(out_left[b, : len(s)], out_alone[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(h_left[:, b], h_alone[:, 0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(c_left[:, b], c_alone[:, 0], atol=1e-6, rtol=1e-5)
# ANCHOR_END: alone
print("padded left, padded right, time first and packed give the same results, as alone")
