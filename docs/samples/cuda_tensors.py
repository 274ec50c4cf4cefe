"""cellc.RNN on the CUDA back end (docs/src/guides/cuda.md): on CUDA tensors where a GPU is
present, and everywhere on the emulated device (the generated CUDA C++ compiled as host C++
by g++ and run on the CPU), against nn.LSTM."""
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
import cellc

torch.manual_seed(0)
lengths = [5, 2, 7, 4]
x = torch.randn(4, 7, 6)                                   # [B, T, I]
lstm = torch.nn.LSTM(6, 9, num_layers=2, bidirectional=True, batch_first=True)
packed = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
want, _ = pad_packed_sequence(lstm(packed)[0], batch_first=True)

# ANCHOR: emulated
# Full float32, as nn.LSTM on the CPU: PyTorch's default lets cuDNN's RNN, and so cellc.RNN on
# the GPU and on the emulated device, which stands for it, take TF32 operands.
torch.backends.cudnn.allow_tf32 = False
emulated = cellc.RNN("lstm", 6, {"H": 9}, num_layers=2, bidirectional=True, batch_first=True,
                     backend="cuda-emulated")              # CPU tensors, CUDA's code path
emulated.load_state_dict(lstm.state_dict())
out, (h, c) = emulated(x, lengths=lengths)
torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
# ANCHOR_END: emulated

if torch.cuda.is_available():
    torch.backends.cuda.matmul.allow_tf32 = False
    # ANCHOR: gpu
    rnn = cellc.RNN("lstm", 6, {"H": 9}, num_layers=2, bidirectional=True, batch_first=True)
    rnn.load_state_dict(lstm.state_dict())
    rnn = rnn.cuda()                                       # backend=None follows the tensors
    out, (h, c) = rnn(x.cuda(), lengths=lengths)           # lengths on the host: no wait
    out.sum().backward()                                   # on PyTorch's current stream
    # ANCHOR_END: gpu
    torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=1e-4)
print("ok")
