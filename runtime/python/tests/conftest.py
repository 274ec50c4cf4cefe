"""Shared helpers of the cellc Python tests."""

import shutil

import pytest
import torch

# The emulated CUDA device compiles the generated kernels as host C++ with g++.
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulated device compiles with g++")
EMULATED = pytest.param("cuda-emulated", marks=needs_gxx)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _full_float32():
    """cuDNN's RNN, and with it cellc.RNN over device memory (the emulated device's too), in full
    float32: the tests' references are float32 (PyTorch's TF32 default would round the products'
    operands to TF32; test_tf32.py turns it on where it checks that)."""
    cudnn = torch.backends.cudnn
    saved = cudnn.rnn.fp32_precision, cudnn.conv.fp32_precision
    cudnn.allow_tf32 = False
    yield
    cudnn.rnn.fp32_precision, cudnn.conv.fp32_precision = saved


def right_aligned(x: torch.Tensor, lengths, batch_first: bool) -> torch.Tensor:
    """Moves each sequence of a left-aligned padded batch to the end of the time axis."""
    out = torch.zeros_like(x)
    steps = x.shape[1] if batch_first else x.shape[0]
    for b, n in enumerate(lengths):
        n = int(n)
        if batch_first:
            out[b, steps - n :] = x[b, :n]
        else:
            out[steps - n :, b] = x[:n, b]
    return out
