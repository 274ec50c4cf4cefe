"""cellc's custom operators: what a cellc.RNN call runs is torch.ops.cellc.rnn_forward, a pure
function of its arguments (the weights among them) whose backward is torch.ops.cellc.rnn_backward;
torch.library.opcheck passes on it, and a second backward is refused."""

import torch

import cellc

# ANCHOR: operator
rnn = cellc.RNN("lstm", 3, 4, num_layers=2, batch_first=True)
x = torch.randn(3, 5, 3, requires_grad=True)
lengths = torch.tensor([5, 2, 4])

# The call rnn(x, lengths=lengths) makes, spelled out: the model named by its spec (compiled
# once per process), the layout of x's rows, the lengths, no initial states (zeros), the
# weights, training (fill the reserve the backward reads), no masks, the model's own rates,
# no resets, float32 products.
args = (rnn.spec, "batch_first/left", x, [lengths], [], list(rnn.parameters()), True, None, None, None, "f32")
out, finals, reserve = torch.ops.cellc.rnn_forward(*args)
want, (h, c) = rnn(x, lengths=lengths)
torch.testing.assert_close(out, want)
torch.testing.assert_close(finals[0], h)
torch.testing.assert_close(finals[1], c)
assert reserve.dim() == 1 and reserve.numel() > 0  # what the backward reads, as a tensor

# Schema, fake (meta) implementation, autograd registration, and torch.compile's view of it:
torch.library.opcheck(torch.ops.cellc.rnn_forward.default, args)
# ANCHOR_END: operator

# ANCHOR: no_double_backward
(grad_x,) = torch.autograd.grad(want.sum(), x, create_graph=True)
try:
    grad_x.sum().backward()  # a gradient of cellc's gradients
    raise AssertionError("a second backward went through cellc's backward")
except NotImplementedError:
    pass
# ANCHOR_END: no_double_backward
print("the operators pass opcheck and give the module's results")
