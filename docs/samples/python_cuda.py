"""cellc.RNN on CUDA tensors: the same module and call as on the CPU, nn.LSTM's numbers, no host
wait. Without a GPU, the CUDA back end's code runs on CPU tensors (backend="cuda-emulated")."""

import shutil

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import cellc

gpu = torch.cuda.is_available()
device = "cuda" if gpu else "cpu"
# Full float32 in the reference (cuDNN and cuBLAS use TF32 by default on recent GPUs).
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
lstm = nn.LSTM(6, 9, num_layers=2, batch_first=True).to(device)

# ANCHOR: cuda
rnn = cellc.RNN("lstm", 6, 9, 2, batch_first=True)  # backend=None: the tensors' device decides
rnn.load_state_dict(lstm.state_dict())
rnn = rnn.to(device)                                 # rnn.cuda()
x = torch.randn(5, 7, 6, device=device)
lengths = [5, 2, 7, 7, 1]                            # a list or a CPU tensor: read without a GPU wait
out, (h, c) = rnn(x, lengths=lengths)                # queued on torch.cuda.current_stream()
# ANCHOR_END: cuda

packed = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
want, (want_h, want_c) = lstm(packed)
want, _ = pad_packed_sequence(want, batch_first=True, total_length=7)
for a, b in [(out, want), (h, want_h), (c, want_c)]:
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)

if gpu:
    # ANCHOR: no_sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")          # any wait of the host on the GPU raises
    try:
        out, (h, c) = rnn(x, lengths=lengths)
        (out.sum() + h.sum()).backward()             # forward and backward, queued
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # ANCHOR_END: no_sync
    # ANCHOR: cpu_refuses
    cpu_only = cellc.RNN("lstm", 6, 9, 2, batch_first=True, backend="cpu").cuda()
    try:
        cpu_only(x, lengths=lengths)
        raise AssertionError("the cpu back end ran CUDA tensors")
    except cellc.DeviceError:
        pass
    # ANCHOR_END: cpu_refuses
    print("CUDA tensors ran on the CUDA back end, with nn.LSTM's results and no host wait")
elif shutil.which("g++"):
    # ANCHOR: emulated
    # No GPU: the CUDA back end's generated kernels, compiled as host C++, over CPU tensors.
    emulated = cellc.RNN("lstm", 6, 9, 2, batch_first=True, backend="cuda-emulated")
    emulated.load_state_dict(lstm.state_dict())
    got, (got_h, got_c) = emulated(x, lengths=lengths)
    # ANCHOR_END: emulated
    for a, b in [(got, want), (got_h, want_h), (got_c, want_c)]:
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    print("no GPU: the CPU and the emulated CUDA back end gave nn.LSTM's results")
else:
    print("no GPU and no g++: the CPU back end gave nn.LSTM's results")
