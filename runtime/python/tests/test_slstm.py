"""``cells/slstm.cell`` (4 heads) against the ``xlstm`` package's sLSTM cell, through the
package: the committed fixture of tests/fixtures/gen_xlstm.py (CI has no ``xlstm``), its
state_dict loaded as it is (``_recurrent_kernel_`` [4, 4*D, D] keeps its head axis), padded
both ways, on the CPU and the emulated CUDA device: outputs, final states, and the gradients
of the input and of every weight."""

import os

import pytest
import torch
from safetensors.torch import load_file

import cellc
from conftest import EMULATED, right_aligned

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests", "fixtures", "xlstm")
STATES = ["y", "c", "n", "m"]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("align", ["left", "right"])
@pytest.mark.parametrize("backend", ["cpu", EMULATED])
def test_four_head_slstm_matches_the_xlstm_package(align, backend):
    x = load_file(os.path.join(FIXTURES, "slstm_nh4_input.safetensors"))
    want = load_file(os.path.join(FIXTURES, "slstm_nh4_expected.safetensors"))
    weights = load_file(os.path.join(FIXTURES, "slstm_nh4_weights.safetensors"))
    heads, d = weights["_recurrent_kernel_"].shape[0], weights["_recurrent_kernel_"].shape[2]
    lengths = x["lengths"]
    rnn = cellc.RNN("slstm", x["input"].shape[2], {"D": d}, batch_first=True, backend=backend)
    assert heads == 4 and rnn.hidden_size == heads * d
    rnn.load_state_dict({f"{name}_l0": w for name, w in weights.items()})
    assert rnn._recurrent_kernel__l0.shape == (heads, 4 * d, d)

    steps = x["input"].shape[1]
    mask = (torch.arange(steps)[None, :] < lengths[:, None])[..., None]
    inp = torch.where(mask, x["input"], 0.0)
    if align == "right":
        inp = right_aligned(inp, lengths, batch_first=True)
    inp.requires_grad_(True)
    out, finals = rnn(inp, lengths=lengths, align=align)
    expected = want["output"]
    dy = x["grad_output"]
    if align == "right":
        expected, dy = right_aligned(expected, lengths, True), right_aligned(dy, lengths, True)
    loss = (out * dy).sum() + sum((f * x[f"grad_final.{s}"]).sum() for f, s in zip(finals, STATES))
    loss.backward()

    assert relative(out.detach(), expected) < 1e-5
    for f, s in zip(finals, STATES):
        assert relative(f.detach(), want[f"final.{s}"]) < 1e-5, s
    grad_input = want["grad.input"]
    if align == "right":
        grad_input = right_aligned(grad_input, lengths, True)
    # Zero at the padding on both sides.
    assert relative(inp.grad, grad_input) < 1e-5
    for name in ("_recurrent_kernel_", "_bias_"):
        assert relative(getattr(rnn, f"{name}_l0").grad, want[f"grad.{name}"]) < 1e-5, name
