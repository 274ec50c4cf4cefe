"""A generation loop, one step per call with the state carried: inside RNN.frozen() the calls
read the weights packed once on entering the block, and give the same bits as without it."""

import torch

import cellc

torch.manual_seed(0)
# ANCHOR: frozen
rnn = cellc.RNN("gru", 32, 32, num_layers=2, batch_first=True)
decoder = torch.nn.Linear(32, 32)


def generate(steps):
    x, state, out = torch.zeros(1, 1, 32), None, []
    for _ in range(steps):
        y, state = rnn(x, state)
        x = torch.tanh(decoder(y))  # the next step's input, as a decoder would make it
        out.append(x)
    return torch.cat(out, 1)


with torch.no_grad():
    as_ever = generate(20)
    with rnn.frozen():  # the weights must not change inside the block
        frozen = generate(20)
assert torch.equal(frozen, as_ever)
# ANCHOR_END: frozen

# A change of the weights inside the block is not seen until the block ends.
with torch.no_grad(), rnn.frozen():
    rnn.weight_hh_l0.zero_()
    assert torch.equal(generate(20), as_ever)
with torch.no_grad():
    assert not torch.equal(generate(20), as_ever)
