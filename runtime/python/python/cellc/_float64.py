"""``float64`` calls of ``cellc.RNN``: the model run through cellc's interpreter in f64, one
sequence at a time (``cellc_runtime::exact``), differentiable, for checking a cell with
``torch.autograd.gradcheck``. It is the oracle cellc's back ends are tested against, not a fast
route: every tensor crosses as a list of floats."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from . import _cellc
from .errors import DTypeError, ShapeError


class _Exact(torch.autograd.Function):
    """One f64 pass over the sequences' rows ``x`` ([N, input_size], one sequence after
    another), from the initial states ``h0`` (none: zeros) with ``weights``; returns the output
    rows and the final states. The backward runs the interpreter's backward on the same call."""

    @staticmethod
    def forward(ctx, call: tuple, n_h0: int, x: Tensor, *tensors: Tensor):
        spec, lengths, resets, rates, state_shapes = call
        h0, weights = list(tensors[:n_h0]), list(tensors[n_h0:])
        out, finals, *_ = _cellc.exact_pass(spec, lengths, _floats(x), [_floats(h) for h in h0] or None,
                                            [_floats(w) for w in weights], resets, rates, None)
        ctx.call, ctx.n_h0 = call, n_h0
        ctx.save_for_backward(x, *tensors)
        out = torch.tensor(out, dtype=torch.float64).view(x.shape[0], -1)
        return (out, *(torch.tensor(f, dtype=torch.float64).view(s) for f, s in zip(finals, state_shapes)))

    @staticmethod
    def backward(ctx, grad_out: Tensor, *grad_finals: Tensor):
        spec, lengths, resets, rates, state_shapes = ctx.call
        x, *tensors = ctx.saved_tensors
        h0, weights = tensors[:ctx.n_h0], tensors[ctx.n_h0:]
        adjoints = (_floats(grad_out), [_floats(g) for g in grad_finals])
        _, _, d_x, d_h0, d_w = _cellc.exact_pass(spec, lengths, _floats(x), [_floats(h) for h in h0] or None,
                                                 [_floats(w) for w in weights], resets, rates, adjoints)
        as_tensor = lambda values, like: torch.tensor(values, dtype=torch.float64).view(like.shape)  # noqa: E731
        grads_h0 = [as_tensor(d, h) for d, h in zip(d_h0, h0)]
        return (None, None, as_tensor(d_x, x), *grads_h0, *(as_tensor(d, w) for d, w in zip(d_w, weights)))


def _floats(t: Tensor) -> list[float]:
    return t.detach().contiguous().view(-1).tolist()


def forward(module, input, hx, lengths, align: str, resets):
    """``module(input, hx, lengths=..., align=..., resets=...)`` in float64 (``input``, ``hx``
    and every parameter float64, on the CPU); masks in evaluation."""
    if module._masks() is not None:
        raise DTypeError("a float64 call runs in evaluation (its masks and dropout are not drawn): "
                         "call module.eval() first, as for torch.autograd.gradcheck")
    weights = module._weights()
    data = input.data if isinstance(input, PackedSequence) else input
    for name, w in zip(module._weight_names, weights):
        if w.dtype != torch.float64 or w.device.type != "cpu":
            raise DTypeError(f"`input` is {data.dtype} but parameter `{name}` is {w.dtype} on {w.device}: a "
                             "float64 call needs every parameter float64 on the CPU (module.double())")
    if isinstance(input, PackedSequence):
        if lengths is not None:
            raise ValueError("`lengths` is for a padded input: a PackedSequence carries its own")
        padded, lengths = pad_packed_sequence(input, batch_first=True)
        if isinstance(resets, PackedSequence):
            resets = pad_packed_sequence(resets, batch_first=True)[0]
        elif resets is not None:
            raise ShapeError("`resets` of a packed input must be a PackedSequence of flags")
        out, finals = _padded(module, padded, hx, lengths, "left", resets, weights, batch_first=True)
        return pack_padded_sequence(out, lengths, batch_first=True, enforce_sorted=False), finals
    if not isinstance(input, Tensor):
        raise TypeError(f"input must be a Tensor or a PackedSequence, not {type(input).__name__}")
    unbatched = input.dim() == 2
    x = input.unsqueeze(0 if module.batch_first else 1) if unbatched else input
    if resets is not None and unbatched:
        resets = torch.as_tensor(resets).unsqueeze(0 if module.batch_first else 1)
    out, finals = _padded(module, x, hx, lengths, align, resets, weights, module.batch_first, unbatched)
    if unbatched:
        out = out.squeeze(0 if module.batch_first else 1)
    return out, finals


def _padded(module, x: Tensor, hx, lengths, align, resets, weights, batch_first: bool, unbatched=False):
    if x.dtype != torch.float64 or x.device.type != "cpu":
        raise DTypeError(f"`input` is {x.dtype} on {x.device}: a float64 module takes float64 inputs on the CPU")
    if x.dim() != 3 or x.shape[-1] != module.input_size:
        raise ShapeError(f"`input` has shape {list(x.shape)}, expected {'[B, T' if batch_first else '[T, B'}, "
                         f"input_size] with input_size={module.input_size}")
    if align not in ("left", "right"):
        raise ValueError(f"align must be 'left' or 'right', not {align!r}")
    xb = x if batch_first else x.transpose(0, 1)
    batch, steps = xb.shape[0], xb.shape[1]
    lengths = [steps] * batch if lengths is None else [int(n) for n in torch.as_tensor(lengths).tolist()]
    if len(lengths) != batch or any(n < 1 or n > steps for n in lengths):
        raise ShapeError(f"`lengths` {lengths}: expected {batch} lengths in [1, {steps}]")
    shift = [steps - n if align == "right" else 0 for n in lengths]
    rows_b = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)], dtype=torch.long)
    rows_p = torch.tensor([shift[b] + t for b, n in enumerate(lengths) for t in range(n)], dtype=torch.long)
    flags = []
    if resets is not None:
        r = torch.as_tensor(resets)
        r = r if batch_first else r.transpose(0, 1)
        if tuple(r.shape) != (batch, steps) or r.dtype.is_floating_point:
            raise ShapeError(f"`resets` has shape {list(r.shape)} and dtype {r.dtype}: one bool per sequence and step")
        flags = [(b, t) for b, n in enumerate(lengths) for t in range(n) if bool(r[b, shift[b] + t])]
    slots = module.num_layers * (2 if module.bidirectional else 1)
    h0 = module._initial_states(hx, batch, x, unbatched)
    for name, h in zip(module.state_names, h0):
        if h.dtype != torch.float64:
            raise DTypeError(f"initial state `{name}` is {h.dtype}: a float64 call takes float64 states")
    state_shapes = [(slots, batch, n) for n in module.state_sizes]
    rates = module._cell_rates() or None
    call = (module.spec, lengths, flags, rates, state_shapes)
    out_rows, *finals = _Exact.apply(call, len(h0), xb[rows_b, rows_p], *h0, *weights)
    out = out_rows.new_zeros(batch, steps, out_rows.shape[1]).index_put((rows_b, rows_p), out_rows)
    if not batch_first:
        out = out.transpose(0, 1)
    if unbatched:
        finals = [f.squeeze(1) for f in finals]
    return out, module._states_out(finals)
