"""Per-step resets from Python: an episode ends inside a sequence and the state restarts
from hx there (docs/src/guides/training.md)."""
import torch
import cellc

torch.manual_seed(0)
lstm = torch.nn.LSTM(4, 8, batch_first=True)
rnn = cellc.RNN("lstm", 4, {"H": 8}, batch_first=True)
rnn.load_state_dict(lstm.state_dict())

# ANCHOR: resets
x = torch.randn(2, 6, 4, requires_grad=True)             # [B, T, I]
h0 = torch.randn(1, 2, 8, requires_grad=True)
c0 = torch.randn(1, 2, 8, requires_grad=True)
done = torch.zeros(2, 6, dtype=torch.bool)               # [B, T], shaped as the input's rows
done[0, 3] = True                                        # sequence 0: a new episode at step 3
out, (h, c) = rnn(x, (h0, c0), lengths=[6, 5], resets=done)
# ANCHOR_END: resets

# Sequence 0 is two sequences, steps 0-2 and 3-5, each from (h0, c0); sequence 1 runs whole.
hx0 = (h0[:, :1], c0[:, :1])
first, _ = lstm(x[:1, :3], hx0)
second, _ = lstm(x[:1, 3:], hx0)
whole, _ = lstm(x[1:, :5], (h0[:, 1:], c0[:, 1:]))
torch.testing.assert_close(out[0], torch.cat([first, second], 1)[0], atol=2e-6, rtol=1e-5)
torch.testing.assert_close(out[1, :5], whole[0], atol=2e-6, rtol=1e-5)
assert torch.all(out[1, 5] == 0)                         # padding rows are zeros

# The gradient of h0 is the sum over the stretches that start from it.
out.sum().backward()
got = h0.grad.clone()
h0.grad = None
ref = torch.cat([first, second], 1).sum() + whole.sum()
ref.backward()
torch.testing.assert_close(got, h0.grad, atol=2e-6, rtol=1e-5)
print("ok")
