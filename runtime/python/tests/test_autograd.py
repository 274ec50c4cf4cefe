"""The operators' autograd: ``gradcheck`` on custom cells (cellc computes in float32, so
finite differences in float32 with a stated tolerance), and ``torch.library.opcheck``; on the
CPU back end and on the CUDA back end's device-memory path over the emulated device."""

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import cellc
from conftest import EMULATED, needs_gxx

# A cell written here, not shipped: multiplicative integration on a plain tanh RNN.
MI_RNN = """
cell mi_rnn {
    input x[I]
    state h[H]
    param weight_ih[H, I], weight_hh[H, H]
    param alpha[H] = ones
    param bias[H] = zeros
    let wx = weight_ih @ x
    let uh = weight_hh @ h
    h' = tanh(alpha * wx * uh + wx + uh + bias)
    output h'
}
"""

# Central differences in float32. A LayerNorm over 4 features is sharply curved, so the
# truncation error (~eps^2 * f''' / 6) needs a small step: at eps = 3e-3 it is under 5e-4
# (measured: 0.65461 numerical vs 0.65428 analytical), while the rounding error of a
# difference (~6e-8 * |f| / eps) stays near 2e-5; both well below the tolerance.
GRADCHECK = dict(eps=3e-3, atol=1e-3, rtol=1e-2, nondet_tol=0.0, fast_mode=False)


@pytest.mark.parametrize(
    "cell,backend", [(MI_RNN, "cpu"), ("layernorm_lstm", "cpu"), pytest.param(MI_RNN, "cuda-emulated", marks=needs_gxx)]
)
def test_gradcheck_custom_cell(cell, backend):
    rnn = cellc.RNN(cell, 3, {"H": 4}, num_layers=2, bidirectional=True, batch_first=True, backend=backend)
    x = torch.randn(3, 4, 3, requires_grad=True)
    lengths = [4, 1, 3]
    n_states = len(rnn.state_sizes)
    h0 = [torch.randn(4, 3, s, requires_grad=True) for s in rnn.state_sizes]
    weights = list(rnn.parameters())

    def f(x, *rest):
        hs, ws = rest[:n_states], rest[n_states:]
        state = dict(zip(rnn._weight_names, ws))
        out, finals = torch.func.functional_call(rnn, state, (x, tuple(hs) if n_states > 1 else hs[0]), {"lengths": lengths})
        finals = finals if isinstance(finals, tuple) else (finals,)
        return (out, *finals)

    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(f, (x, *h0, *weights), **GRADCHECK)


def op_samples(backend="cpu"):
    rnn = cellc.RNN("gru", 3, {"H": 5}, num_layers=2, bidirectional=True, backend=backend)
    weights = [w.detach().clone().requires_grad_() for w in rnn.parameters()]
    x = torch.randn(4, 3, 3, requires_grad=True)
    lengths = torch.tensor([4, 2, 3])
    h0 = [torch.randn(4, 3, 5, requires_grad=True)]
    packed = pack_padded_sequence(x.detach(), lengths, enforce_sorted=False)
    index = [packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices]
    dropping = cellc.RNN("gru", 3, {"H": 5}, num_layers=2, bidirectional=True, dropout=0.3, backend=backend)
    masks = torch.tensor([5, 7])
    zoneout = cellc.RNN("zoneout_lstm", 3, {"H": 5}, backend=backend)
    z_weights = [w.detach().clone().requires_grad_() for w in zoneout._weights()]
    z_h0 = [torch.randn(1, 3, 5, requires_grad=True) for _ in range(2)]
    resets = torch.zeros(4, 3, dtype=torch.int64)
    resets[2, 0] = resets[1, 2] = 1
    return [
        (rnn.spec, "time_first/left", x, [lengths], h0, weights, True, None, None, None, "f32"),
        (rnn.spec, "time_first/right", x, [lengths], [], weights, True, None, None, None, "f32"),
        (rnn.spec, "packed", packed.data.clone().requires_grad_(), index, h0, weights, True, None, None, None, "f32"),
        (rnn.spec, "time_first/left", x.detach(), [lengths], [], [w.detach() for w in weights], False, None, None,
         None, "f32"),
        (dropping.spec, "time_first/left", x, [lengths], h0, weights, True, masks, None, None, "f32"),
        # The call's rates: dropout between layers, then the cell's (zh, zc).
        (zoneout.spec, "time_first/left", x, [lengths], z_h0, z_weights, True, masks,
         torch.tensor([0.0, 0.2, 0.4], dtype=torch.float64), None, "f32"),
        # Per-step resets ([T, B] flags), and bf16 products.
        (rnn.spec, "time_first/left", x, [lengths], h0, weights, True, None, None, resets, "f32"),
        (rnn.spec, "time_first/left", x, [lengths], h0, weights, True, None, None, None, "bf16"),
    ]


SAMPLES = ["padded", "right", "packed", "inference", "dropout", "zoneout", "resets", "bf16"]


@pytest.mark.parametrize("backend", ["cpu", EMULATED])
@pytest.mark.parametrize("sample", range(len(SAMPLES)), ids=SAMPLES)
def test_opcheck_forward(sample, backend):
    torch.library.opcheck(torch.ops.cellc.rnn_forward.default, op_samples(backend)[sample])


@pytest.mark.parametrize("backend", ["cpu", EMULATED])
@pytest.mark.parametrize("sample", [0, 4, 5, 6, 7], ids=["padded", "dropout", "zoneout", "resets", "bf16"])
def test_opcheck_backward(backend, sample):
    spec, layout, x, index, h0, weights, _, masks, rates, resets, precision = op_samples(backend)[sample]
    out, finals, reserve = torch.ops.cellc.rnn_forward(spec, layout, x, index, h0, weights, True, masks, rates,
                                                       resets, precision)
    grads = (torch.randn_like(out), [torch.randn_like(f) for f in finals])
    detached = [h.detach() for h in h0], [w.detach() for w in weights], reserve.detach()
    args = (spec, layout, x.detach(), index, *detached, *grads, masks, rates, resets, precision)
    torch.library.opcheck(torch.ops.cellc.rnn_backward.default, args)
