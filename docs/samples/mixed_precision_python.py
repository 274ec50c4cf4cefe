"""Mixed precision from Python: bf16 autocast, bf16 parameters, and float64 for gradcheck
(docs/src/guides/mixed-precision.md). CPU only."""
import torch
import cellc

torch.manual_seed(0)
x = torch.randn(4, 10, 32)
lengths = [10, 3, 7, 9]

# ANCHOR: autocast
rnn = cellc.RNN("lstm", 32, {"H": 64}, batch_first=True)
want, _ = rnn(x, lengths=lengths)                          # float32
with torch.autocast("cpu", dtype=torch.bfloat16):
    out, (h, c) = rnn(x, lengths=lengths)                  # bf16 products, float32 sums
assert out.dtype == h.dtype == torch.bfloat16              # autocast's dtype, as nn.LSTM
error = (out.float() - want).norm() / want.norm()
assert 1e-4 < error < 1e-2, error                          # bf16's rounding, not float32's
with torch.autocast("cpu", dtype=torch.float16):
    out16, _ = rnn(x, lengths=lengths)                     # the CPU has no fp16 products:
assert torch.equal(out16, want.to(torch.float16))          # float32, rounded at the end
# ANCHOR_END: autocast

# ANCHOR: bf16-params
half = cellc.RNN("gru", 32, {"H": 64}, batch_first=True, dtype=torch.bfloat16)
xb = x.to(torch.bfloat16).requires_grad_()
out, h = half(xb, lengths=lengths)
out.float().sum().backward()
assert out.dtype == torch.bfloat16
assert half.weight_hh_l0.grad.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
# ANCHOR_END: bf16-params

# ANCHOR: float64
exact = cellc.RNN("layernorm_lstm", 3, {"H": 4}, batch_first=True, dtype=torch.float64).eval()
x64 = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
assert torch.autograd.gradcheck(lambda v: exact(v, lengths=[5, 2])[0], (x64,))
# ANCHOR_END: float64
print("ok")
