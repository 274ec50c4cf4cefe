"""A small training run of a custom cell (written here, not shipped): its loss falls."""

import torch
from torch import nn

import cellc

# A minimal gated cell (minGRU-like, with a recurrent matrix).
GATED = """
cell gated {
    input x[I]
    state h[H]
    param weight_ih[2*H, I], weight_hh[H, H], bias[2*H] = zeros
    let z, c = chunk(weight_ih @ x + bias, 2)
    h' = (1 - sigmoid(z)) * h + sigmoid(z) * tanh(c + weight_hh @ h)
    output h'
}
"""


def test_custom_cell_learns_to_count():
    torch.manual_seed(1)
    # Predict, at each step, the running parity of the 1s seen so far.
    rnn = cellc.RNN(GATED, 2, {"H": 16}, batch_first=True)
    head = nn.Linear(16, 2)
    opt = torch.optim.Adam([*rnn.parameters(), *head.parameters()], lr=0.02)
    losses = []
    for step in range(150):
        bits = torch.randint(0, 2, (32, 8))
        lengths = torch.randint(3, 9, (32,))
        x = nn.functional.one_hot(bits, 2).float()
        target = bits.cumsum(1) % 2
        out, _ = rnn(x, lengths=lengths)
        mask = torch.arange(8)[None, :] < lengths[:, None]
        loss = nn.functional.cross_entropy(head(out)[mask], target[mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, f"loss {first:.3f} -> {last:.3f}"
