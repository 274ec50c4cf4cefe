"""Training recipes from Python: dropout between layers, a cell's own rates and masks, and
reproducible draws (docs/src/guides/training.md)."""
import torch
import cellc

torch.manual_seed(0)

# ANCHOR: dropout
x = torch.randn(3, 6, 8)                     # [B, T, I], batch-first
lengths = [6, 2, 4]                          # unsorted, no packing
rnn = cellc.RNN("lstm", 8, {"H": 16}, num_layers=2, dropout=0.3, batch_first=True)
rnn.train()                                  # training mode: masks are drawn
torch.manual_seed(1)
first, _ = rnn(x, lengths=lengths)
torch.manual_seed(1)                         # the same seed: the same masks
again, _ = rnn(x, lengths=lengths)
after, _ = rnn(x, lengths=lengths)           # the next call draws new ones
assert torch.equal(first, again) and not torch.equal(again, after)
rnn.eval()                                   # evaluation: nothing is dropped
assert torch.equal(rnn(x, lengths=lengths)[0], rnn(x, lengths=lengths)[0])
# ANCHOR_END: dropout

# ANCHOR: rates
z = cellc.RNN("zoneout_lstm", 8, {"H": 16}, batch_first=True, rates={"zh": 0.05})
assert z.rates == {"zh": 0.05, "zc": 0.1}    # the other rate keeps the cell's default
z.rates["zc"] = 0.2                          # may change between calls
# ANCHOR_END: rates

# ANCHOR: zero-rates
# zoneout_lstm loads an nn.LSTM state_dict; with both rates 0 it is nn.LSTM.
lstm = torch.nn.LSTM(8, 16, batch_first=True)
z.load_state_dict(lstm.state_dict())
z.rates = {"zh": 0.0, "zc": 0.0}
z.eval()
full = torch.randn(2, 5, 8)
torch.testing.assert_close(z(full)[0], lstm(full)[0], atol=2e-6, rtol=1e-5)
# ANCHOR_END: zero-rates

# ANCHOR: masks
z.rates = {"zh": 0.1, "zc": 0.1}
z.train()
torch.manual_seed(2)
seed = cellc.draw_masks()                    # the [seed, offset] the next call draws
masks = z.cell_masks(x, seed, lengths=lengths)
print(sorted(masks))                         # ['zoneout#0_l0', 'zoneout#1_l0']: c's, then h's
torch.manual_seed(2)
out, _ = z(x, lengths=lengths)               # the call draws the same [seed, offset]

# The same computation, one step at a time, with those masks: 1 takes the new value, 0 keeps the old.
cell = torch.nn.LSTMCell(8, 16)
cell.load_state_dict({k[:-3]: v for k, v in z.state_dict().items()})   # weight_ih_l0 -> weight_ih
with torch.no_grad():
    for s, n in enumerate(lengths):
        h = c = torch.zeros(16)
        for t in range(n):
            h_new, c_new = cell(x[s, t], (h, c))
            mc, mh = masks["zoneout#0_l0"][s, t], masks["zoneout#1_l0"][s, t]
            c, h = mc * c_new + (1 - mc) * c, mh * h_new + (1 - mh) * h
            torch.testing.assert_close(out[s, t], h, atol=2e-6, rtol=1e-5)
# ANCHOR_END: masks
print("ok")
