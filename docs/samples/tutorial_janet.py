"""The tutorial's JANET cell (docs/samples/janet.cell) from Python: cellc.RNN against the same
cell written as a PyTorch loop over time, on an unsorted variable-length batch. Outputs, final
states and gradients agree; the timing is printed, not asserted."""

import time

import torch

import cellc

torch.manual_seed(0)

# ANCHOR: module
rnn = cellc.RNN("docs/samples/janet.cell", input_size=32, sizes={"H": 64}, batch_first=True)
print(sorted(name for name, _ in rnn.named_parameters()))
# ['bias_l0', 'weight_hh_l0', 'weight_ih_l0']
# ANCHOR_END: module


# ANCHOR: loop
def janet_loop(x, lengths, weight_ih, weight_hh, bias, beta=1.0):
    """JANET in PyTorch: a Python loop over time, a few small ops a step."""
    batch, steps, _ = x.shape
    h = x.new_zeros(batch, weight_hh.shape[1])
    outputs = []
    for t in range(steps):
        f, g = (x[:, t] @ weight_ih.T + h @ weight_hh.T + bias).chunk(2, dim=1)
        new_h = torch.sigmoid(f) * h + (1 - torch.sigmoid(f - beta)) * torch.tanh(g)
        alive = (t < lengths).unsqueeze(1)  # padding after each sequence
        h = torch.where(alive, new_h, h)
        outputs.append(torch.where(alive, new_h, torch.zeros_like(new_h)))
    return torch.stack(outputs, dim=1), h
# ANCHOR_END: loop


# ANCHOR: compare
x = torch.randn(8, 50, 32, requires_grad=True)
lengths = torch.tensor([50, 3, 17, 50, 1, 42, 8, 29])  # unsorted, no packing
weights = (rnn.weight_ih_l0, rnn.weight_hh_l0, rnn.bias_l0)

out, h = rnn(x, lengths=lengths)  # h: [layers, B, H], at each sequence's last step
want_out, want_h = janet_loop(x, lengths, *weights)
torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(h[0], want_h, rtol=1e-5, atol=1e-5)

grads = torch.autograd.grad((out ** 2).sum(), (x, *weights))
want_grads = torch.autograd.grad((want_out ** 2).sum(), (x, *weights))
for got, want in zip(grads, want_grads):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
# ANCHOR_END: compare


# ANCHOR: time
def train_step_seconds(step, repeats=5):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


cellc_s = train_step_seconds(lambda: rnn(x, lengths=lengths)[0].sum().backward())
loop_s = train_step_seconds(lambda: janet_loop(x, lengths, *weights)[0].sum().backward())
print(f"forward + backward: cellc {cellc_s * 1e3:.1f} ms, PyTorch loop {loop_s * 1e3:.1f} ms")
# ANCHOR_END: time
