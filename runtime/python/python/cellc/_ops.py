"""The cellc operators, registered with ``torch.library``.

``cellc::rnn_forward`` and ``cellc::rnn_backward`` are pure functions of
their arguments: the model is named by its spec (a JSON text of the cell
and its configuration, compiled once per process), the weights come as
tensors on every call, and what the backward reads travels from the
forward as a tensor, the *reserve* (as cuDNN's reserve space). So
autograd, ``torch.compile`` and distributed wrappers see ordinary
operators with no hidden state.

Every output is written in place by the Rust runtime, which reads the
inputs where they lie, with the interpreter lock released:

- CPU tensors run on ``torch.get_num_threads()`` threads (at most the
  cores the process may use), on the OpenMP team PyTorch's own operators
  run on (see ``set_threading``); the large buffers come from cellc's
  recycled memory (see ``_recycled``);
- CUDA tensors (back end ``cuda``) run on the CUDA back end, queued on
  PyTorch's current stream with no host wait: outputs and gradients come
  from PyTorch's caching allocator, the pass's scratch memory from cellc's
  own stream-ordered pool; the reserve is a CUDA tensor too, laid out as
  on the CPU. The ``cuda-emulated`` back end runs the same path on CPU
  tensors (the emulated device's memory is the host's), to verify it
  without a GPU.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import json
import os

import torch
from torch import Tensor

from . import _cellc
from .errors import DeviceError, DTypeError, ExportError


def set_threading(team: str) -> str:
    """Chooses the threads cellc's CPU work runs on, for every model of the process.

    On PyTorch's team, cellc's parallel regions find PyTorch's OpenMP workers waiting for work
    (they spin on the cores for a while after each operator) instead of competing with them for
    the cores. A process forked from this one always uses cellc's pool: GNU OpenMP's team does
    not survive a fork. Either way a call runs on ``torch.get_num_threads()`` threads, at most
    the cores the process may use (see :func:`threading`).

    Args:
        team: ``"openmp"``, the OpenMP team PyTorch's own operators run on (the default where
            PyTorch's parallel backend is OpenMP, as in its CPU builds), or ``"cellc"``, a pool
            of cellc's own.

    Returns:
        The team now in use: ``"cellc"`` where ``"openmp"`` was asked for but no OpenMP
        runtime is loaded.

    Raises:
        ValueError: ``team`` is neither ``"openmp"`` nor ``"cellc"``.
    """
    return _cellc.set_threading(team)


def threading() -> tuple[str, int]:
    """Where cellc's CPU work runs.

    Example:
        >>> import cellc
        >>> team, cores = cellc.threading()
        >>> team in ("openmp", "cellc") and cores >= 1
        True

    Returns:
        ``(team, cores)``: the team cellc's CPU work runs on (``"openmp"`` or ``"cellc"``, see
        :func:`set_threading`), and the most threads a call uses: the cores the affinity mask
        and the cgroup's CPU quota grant, whatever ``torch.get_num_threads()`` says.
    """
    return _cellc.threading()


if "parallel backend: OpenMP" in torch.__config__.parallel_info():
    set_threading("openmp")


@functools.lru_cache(maxsize=256)
def describe(spec: str) -> dict:
    """The model's weights, states, sizes and reserve per row (compiled once)."""
    return _cellc.describe(spec)


def _ref(t: Tensor) -> tuple[int, torch.Size]:
    return t.data_ptr(), t.shape


def _batch(layout: str, x: Tensor, index: list[Tensor]):
    if layout.startswith("packed"):
        return index[1].shape[0]
    return x.shape[0] if layout.startswith("batch_first") else x.shape[1]


def _rows(layout: str, x: Tensor):
    return x.shape[0] if layout.startswith("packed") else x.shape[0] * x.shape[1]


def _forward_outputs(spec: str, layout: str, x: Tensor, index: list[Tensor], training: bool, empty,
                     reserve_tensor: bool = True):
    """The output, the final states and the reserve (training), fresh; without training the
    reserve is an empty tensor, or None where no operator's schema asks for one."""
    info = describe(spec)
    batch = _batch(layout, x, index)
    out = empty((*x.shape[:-1], info["output_size"]))
    finals = [x.new_empty((info["slots"], batch, size)) for _, size in info["states"]]
    reserve_len = _rows(layout, x) * info["reserve_per_row"] if training else 0
    if reserve_len:
        return out, finals, empty((reserve_len,))
    return out, finals, x.new_empty((0,)) if reserve_tensor else None


def in_device_memory(spec: str, x: Tensor) -> bool:
    """Whether a call runs over device memory: CUDA tensors, or CPU tensors of a device whose
    memory they are (the emulated device's; its description says, see :func:`describe`)."""
    return runs_in_device_memory(describe(spec)["cpu_tensors"] == "device", x)


def runs_in_device_memory(cpu_tensors_on_device: bool, x: Tensor) -> bool:
    """:func:`in_device_memory` with the description's answer for CPU tensors given (a module
    keeps it): traceable by ``torch.compile``."""
    return x.device.type == "cuda" or cpu_tensors_on_device


def cudnn_rnn_allows_tf32() -> bool:
    """Whether PyTorch lets cuDNN's RNN (``nn.LSTM`` on a GPU) compute float32 products in TF32:
    ``torch.backends.cudnn.rnn.fp32_precision``, or where it is ``"none"`` the setting it
    inherits (``torch.backends.cudnn``'s, then ``torch.backends``'); on a PyTorch without that
    API, ``torch.backends.cudnn.allow_tf32``."""
    rnn = getattr(torch.backends.cudnn, "rnn", None)
    chain = [getattr(rnn, "fp32_precision", None), getattr(torch.backends.cudnn, "fp32_precision", None),
             getattr(torch.backends, "fp32_precision", None)]
    if chain[0] is None:
        return bool(torch.backends.cudnn.allow_tf32)
    return next((p for p in chain if p not in (None, "none")), "ieee") == "tf32"


def float32_products(in_device_memory: bool) -> str:
    """The precision a float32 call asks for its products (the operators' ``precision``):
    ``"tf32"`` over device memory (CUDA tensors, or the emulated device's) where PyTorch lets
    cuDNN's RNN use TF32 (see :func:`cudnn_rnn_allows_tf32`), so that cellc computes what
    ``nn.LSTM`` does there; else ``"f32"``. Traceable by ``torch.compile``, which guards on the
    switch."""
    return "tf32" if in_device_memory and cudnn_rnn_allows_tf32() else "f32"


def _check_devices(spec: str, tensors: list[Tensor]) -> None:
    """Every tensor on the device the spec's back end reads (the first tensor's, for CUDA)."""
    info = describe(spec)
    device = tensors[0].device
    for t in tensors:
        if t.device.type == "cuda" and not info["cuda_tensors"]:
            raise DeviceError(
                f"a tensor on {t.device}, but the `{info['device']}` back end runs CPU tensors: make the "
                "module with backend=None (the tensors' device decides) or backend='cuda'"
            )
        if t.device != device:
            raise DeviceError(f"tensors on both {device} and {t.device}: a call runs on one device")


def _memory(spec: str, x: Tensor):
    """Where a call runs: ``(threads, None)`` over host memory, on PyTorch's thread count;
    ``(0, (device, stream))`` over device memory, queued on PyTorch's current stream on that
    CUDA device (device and stream 0 for the emulated device's memory)."""
    if not in_device_memory(spec, x):
        return torch.get_num_threads(), None
    if x.device.type != "cuda":
        return 0, (0, 0)
    ordinal = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return 0, (ordinal, torch.cuda.current_stream(x.device).cuda_stream)


def _recycled(shape) -> Tensor:
    """A float32 CPU tensor over cellc's recycled memory (DLPack), returned there when freed.

    The large buffers of a step (the reserve, the output, the gradients of the input and the
    weights) would otherwise come from PyTorch's CPU allocator, malloc, which maps buffers
    that large fresh on every call: their pages faulted in and zeroed by the kernel took as
    long as the RNN itself at B=64, H=256. Contents are unspecified; the runtime writes them.
    The extension decides which come from the pool (``_cellc.recycled_tensor``, which the
    native fast path's outputs come from too).
    """
    return _cellc.recycled_tensor(tuple(shape))


def _call_refs(x: Tensor, index: list[Tensor], h0: list[Tensor], weights: list[Tensor]):
    """The tensors every call takes, as the Rust side reads them."""
    return _ref(x), [_ref(t) for t in index], [_ref(t) for t in h0], [_ref(t) for t in weights]


def _resets_ref(resets: Tensor | None):
    """Per-step resets (int64 on the CPU, one flag per row) as the runtime takes them."""
    return None if resets is None else _ref(resets)


def _seed(masks: Tensor | None):
    """A masks tensor (``[seed, offset]``, int64 on the CPU) as the runtime takes it; ``None``:
    evaluation mode, nothing dropped."""
    if masks is None:
        return None
    seed, offset = masks.tolist()
    return seed & (2**64 - 1), offset & (2**64 - 1)


def draw_masks() -> Tensor:
    """Draws the ``[seed, offset]`` of a training-mode call's masks from PyTorch's default
    generator, as every training-mode ``cellc.RNN`` call with masks to draw (dropout between
    layers, the cell's own) does: ``torch.manual_seed`` reproduces them, and each call
    draws new ones. After ``torch.manual_seed(s)``, ``cellc.draw_masks()`` gives the seed of
    the next such call made after the same seed, for :meth:`RNN.dropout_masks` and
    :meth:`RNN.cell_masks`.

    Returns:
        An int64 CPU tensor of two values, each in ``[0, 2**62)``.
    """
    return torch.randint(0, 2**62, (2,), dtype=torch.int64)


def dropout_masks(spec: str, layout: str, x: Tensor, index: list[Tensor], masks: Tensor,
                  dropout: float) -> list[list[float]]:
    """The dropout masks of a call at rate ``dropout`` (see ``cellc.RNN.dropout_masks``), flat,
    one per layer boundary."""
    return _cellc.dropout_masks(spec, layout, _ref(x), [_ref(t) for t in index], _seed(masks), dropout)


def call_rates(dropout: float, rates: list[float]) -> list[float]:
    """A call's rates as the operators take them (their ``rates`` argument, as a float64 CPU
    tensor, or as this list in eager mode): the rate of dropout between layers first, then the
    cell's rates in its order. A tensor, not a constant of the graph, so that ``torch.compile``
    traces a schedule of rates (a changed value is guarded, and recompiles)."""
    return [dropout, *rates]


def _rates_tensor(rates):
    """A call's rates as the operators' schema takes them: a float64 CPU tensor, or ``None``."""
    return rates if rates is None or isinstance(rates, Tensor) else torch.tensor(rates, dtype=torch.float64)


def _rates(rates) -> tuple[float | None, list[float] | None]:
    """The operators' ``rates`` (see :func:`call_rates`: ``None``, a list or a tensor) as the
    runtime takes them: ``(dropout between layers, the cell's rates)``; ``(None, None)``: the
    model's own (its spec's dropout, the cell's defaults)."""
    if rates is None:
        return None, None
    values = rates.tolist() if isinstance(rates, Tensor) else [float(r) for r in rates]
    return values[0], values[1:]


def cell_masks(spec: str, layout: str, x: Tensor, index: list[Tensor], masks: Tensor | None,
               rates: list[float]) -> list[tuple[str, list[int], list[float]]]:
    """The masks of the cell's own mask calls in a call at ``rates`` (the cell's, in its order;
    see ``cellc.RNN.cell_masks``)."""
    return _cellc.cell_masks(spec, layout, _ref(x), [_ref(t) for t in index], _seed(masks), rates or None)


def _forward_impl(spec, layout, x, index, h0, weights, training, masks=None, rates=None, resets=None,
                  precision="f32", checked=False, reserve_tensor=True):
    """The forward operator's work (see ``rnn_forward``); ``checked``: the caller (cellc.RNN)
    has checked the tensors' devices; ``reserve_tensor``: an empty reserve is made when not
    training (the operator's schema returns one)."""
    if not checked:
        _check_devices(spec, [x, *h0, *weights])
    inputs = _call_refs(x, index, h0, weights)
    memory = _memory(spec, x)
    # Device memory from PyTorch's allocator; on the CPU, cellc's recycled memory.
    empty = x.new_empty if memory[1] is not None else _recycled
    out, finals, reserve = _forward_outputs(spec, layout, x, index, training, empty, reserve_tensor)
    outputs = _ref(out), [_ref(t) for t in finals]
    reserve_ref = _ref(reserve) if training else None
    dropout, cell_rates = _rates(rates)
    _cellc.forward(spec, *memory, layout, *inputs, *outputs, reserve_ref, _seed(masks), cell_rates, dropout,
                   _resets_ref(resets), precision)
    return out, finals, reserve


@torch.library.custom_op("cellc::rnn_forward", mutates_args=())
def rnn_forward(
    spec: str,
    layout: str,
    x: Tensor,
    index: list[Tensor],
    h0: list[Tensor],
    weights: list[Tensor],
    training: bool,
    masks: Tensor | None,
    rates: Tensor | None,
    resets: Tensor | None,
    precision: str,
) -> tuple[Tensor, list[Tensor], Tensor]:
    """The operator ``torch.ops.cellc.rnn_forward``: every layer and direction of a model over
    a batch. ``cellc.RNN`` calls it under ``torch.compile``, fake tensors, tensor subclasses
    and functorch transforms (in plain eager mode it runs the same work without the
    dispatcher); its arguments are ``cellc.RNN``'s encoding of a call, not an interface of
    their own.

    A pure function of its arguments (no state is kept between calls), with a fake
    implementation for ``torch.compile`` and an autograd formula (:func:`rnn_backward`), tested
    by ``torch.library.opcheck``.

    Args:
        spec: the model (``cellc.RNN.spec``: the cell's source, sizes and configuration as
            JSON), compiled once per process; a constant of a compiled graph.
        layout: how ``x``'s rows are laid: ``"batch_first/left"``, ``"batch_first/right"``,
            ``"time_first/left"``, ``"time_first/right"`` (padded, padding after or before each
            sequence) or ``"packed"``.
        x: the input, float32: ``[B, T, I]`` or ``[T, B, I]`` padded, ``[N, I]`` packed.
        index: int64 CPU tensors: padded, ``[lengths]`` (``[B]``; none: every sequence runs
            all ``T`` steps); packed, ``[batch_sizes, sorted_indices, unsorted_indices]``.
        h0: the initial states, one ``[layers * directions, B, size]`` tensor per state of the
            cell, or none (zeros).
        weights: every layer's and direction's parameters, in the model's order (the order of
            ``cellc.RNN``'s parameters).
        training: whether to fill the reserve the backward reads.
        masks: ``[seed, offset]`` (:func:`draw_masks`) for a training-mode call: the cell's
            masks and dropout between layers are drawn from it; ``None``: evaluation.
        rates: the call's rates (:func:`call_rates`): a float64 CPU tensor of the rate of
            dropout between layers, then one rate per rate of the cell, in its order; ``None``:
            the model's (the spec's dropout, the cell's defaults).
        resets: per-step resets, an int64 CPU tensor of one flag per row of ``x``'s layout
            (1 where the state restarts before that step); ``None``: none.
        precision: the precision the call asks for its products: ``"f32"``, ``"bf16"``,
            ``"f16"`` or ``"tf32"`` (a device without such products computes f32 ones).

    Returns:
        ``(output, finals, reserve)``: the output (laid out as ``x``, zeros at padding), the
        final states (one ``[layers * directions, B, size]`` tensor per state) and the reserve
        (what the backward reads; empty when not ``training``).
    """
    return _forward_impl(spec, layout, x, index, h0, weights, training, masks, rates, resets, precision)


@rnn_forward.register_fake
def _(spec, layout, x, index, h0, weights, training, masks, rates, resets, precision):
    return _forward_outputs(spec, layout, x, index, training, x.new_empty)


def _backward_impl(spec, layout, x, index, h0, weights, reserve, grad_output, grad_finals, masks, rates, resets,
                   precision):
    """The backward operator's work (see ``rnn_backward``)."""
    _check_devices(spec, [x, *h0, *weights, grad_output, *grad_finals])
    inputs = _call_refs(x, index, h0, weights)
    memory = _memory(spec, x)
    # Device memory from PyTorch's allocator; on the CPU, cellc's recycled memory.
    empty_like = torch.empty_like if memory[1] is not None else (lambda t: _recycled(t.shape))
    grad_x = empty_like(x)
    grad_h0 = [torch.empty_like(h) for h in h0]
    grad_weights = [empty_like(w) for w in weights]
    grads = _ref(grad_output), [_ref(t) for t in grad_finals]
    outputs = _ref(grad_x), [_ref(t) for t in grad_h0], [_ref(t) for t in grad_weights]
    dropout, cell_rates = _rates(rates)
    _cellc.backward(spec, *memory, layout, *inputs, _ref(reserve), *grads, *outputs, _seed(masks), cell_rates,
                    dropout, _resets_ref(resets), precision)
    return grad_x, grad_h0, grad_weights


@torch.library.custom_op("cellc::rnn_backward", mutates_args=())
def rnn_backward(
    spec: str,
    layout: str,
    x: Tensor,
    index: list[Tensor],
    h0: list[Tensor],
    weights: list[Tensor],
    reserve: Tensor,
    grad_output: Tensor,
    grad_finals: list[Tensor],
    masks: Tensor | None,
    rates: Tensor | None,
    resets: Tensor | None,
    precision: str,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """The operator ``torch.ops.cellc.rnn_backward``: the gradients of a
    :func:`rnn_forward` call, which autograd runs for it (a second backward through it raises
    ``NotImplementedError``).

    Args:
        spec: the forward's ``spec``.
        layout: the forward's ``layout``.
        x: the forward's input.
        index: the forward's ``index``.
        h0: the forward's initial states, the same tensors (none: zeros, and no gradient for them):
            the backward reads them where the reserve keeps a state only after each step.
        weights: the forward's weights.
        reserve: the reserve the training forward filled.
        grad_output: the gradient of the forward's output, laid out as it.
        grad_finals: the gradients of the final states, one per state, or none (zeros).
        masks: the forward's ``masks``: its masks are drawn again, not stored.
        rates: the forward's ``rates``.
        resets: the forward's ``resets``.
        precision: the forward's ``precision``.

    Returns:
        ``(grad_x, grad_h0, grad_weights)``: the gradients of the input, of each initial state
        given, and of each weight.
    """
    return _backward_impl(spec, layout, x, index, h0, weights, reserve, grad_output, grad_finals, masks, rates,
                          resets, precision)


@rnn_backward.register_fake
def _(spec, layout, x, index, h0, weights, reserve, grad_output, grad_finals, masks, rates, resets, precision):
    return torch.empty_like(x), [torch.empty_like(h) for h in h0], [torch.empty_like(w) for w in weights]


def _setup_context(ctx, inputs, output, eager=False):
    spec, layout, x, index, h0, weights, training, masks, rates, resets, precision = inputs
    _, finals, reserve = output
    ctx.spec, ctx.layout, ctx.precision, ctx.eager = spec, layout, precision, eager
    # A tensor of rates is saved as the masks and resets are; a list (eager mode) kept as it is.
    ctx.rates = None if isinstance(rates, Tensor) else rates
    extras = [t for t in (resets, masks, rates) if isinstance(t, Tensor)]
    ctx.has_resets, ctx.has_masks = resets is not None, masks is not None
    ctx.has_rates_tensor = isinstance(rates, Tensor)
    ctx.counts = (len(index), len(h0), len(weights))
    ctx.final_shapes = [f.shape for f in finals]
    ctx.mark_non_differentiable(reserve)
    # Outputs nothing reads get no gradient (None), not zeros filled for them: stateful
    # training detaches the final states, and filling their zero gradients cost more
    # than the gradients themselves.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, *index, *h0, *weights, reserve, *extras)


def _backward(ctx, grad_output, grad_finals, _grad_reserve):
    saved = list(ctx.saved_tensors)
    n_index, n_h0, n_weights = ctx.counts
    x = saved[0]
    index = saved[1 : 1 + n_index]
    h0 = saved[1 + n_index : 1 + n_index + n_h0]
    weights = saved[1 + n_index + n_h0 : 1 + n_index + n_h0 + n_weights]
    rates = saved.pop() if ctx.has_rates_tensor else ctx.rates
    masks = saved.pop() if ctx.has_masks else None
    resets = saved.pop() if ctx.has_resets else None
    reserve = saved[-1]
    if grad_output is None:
        grad_output = x.new_zeros((*x.shape[:-1], describe(ctx.spec)["output_size"]))
    if grad_finals is None or all(g is None for g in grad_finals):
        grad_finals = []
    else:
        grad_finals = [
            (g if g is not None else x.new_zeros(s)).contiguous()
            for g, s in zip(grad_finals, ctx.final_shapes)
        ]
    args = [ctx.spec, ctx.layout, x, index, h0, weights, reserve, grad_output.contiguous(), grad_finals, masks, rates,
            resets, ctx.precision]
    if ctx.eager and not torch.is_grad_enabled():
        grad_x, grad_h0, grad_weights = _backward_impl(*args)
    else:
        # Through the operator: under create_graph its gradients carry the refusal of a
        # second backward.
        args[10] = _rates_tensor(rates)
        grad_x, grad_h0, grad_weights = rnn_backward(*args)
    return None, None, grad_x, [None] * n_index, grad_h0, grad_weights, None, None, None, None, None


rnn_forward.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "cellc's backward is not differentiable: a second backward through cellc.RNN's gradients "
        "(torch.autograd.grad(..., create_graph=True) then backward) is not supported"
    )


def _keep_nothing(ctx, inputs, output):
    pass


rnn_backward.register_autograd(_no_double_backward, setup_context=_keep_nothing)


class _Eager(torch.autograd.Function):
    """The operators' pair in eager mode, without the dispatcher: the same work and the same
    autograd (``_setup_context``, ``_backward``), at about 70 µs less per call, which a
    generation loop of one step per call pays on every word."""

    @staticmethod
    def forward(ctx, spec, layout, n_index, n_h0, masks, rates, resets, precision, x, *tensors):
        index, h0 = list(tensors[:n_index]), list(tensors[n_index : n_index + n_h0])
        weights = list(tensors[n_index + n_h0 :])
        checked = x.device.type == "cpu"  # as in `run`
        out, finals, reserve = _forward_impl(spec, layout, x, index, h0, weights, True, masks, rates, resets,
                                             precision, checked)
        inputs = (spec, layout, x, index, h0, weights, True, masks, rates, resets, precision)
        _setup_context(ctx, inputs, (out, finals, reserve), eager=True)
        return out, reserve, *finals

    @staticmethod
    def backward(ctx, grad_output, _grad_reserve, *grad_finals):
        _, _, grad_x, none_index, grad_h0, grad_weights, *_ = _backward(ctx, grad_output, list(grad_finals), None)
        return None, None, None, None, None, None, None, None, grad_x, *none_index, *grad_h0, *grad_weights


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_eager_mode() -> bool:
    """Whether calls run in plain eager mode: no mode or transform that must see the operator
    (torch.compile, fake tensors, torch function or dispatch modes, functorch)."""
    if torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled():
        return False
    return torch._C._len_torch_dispatch_stack() == 0 and torch._C._functorch.peek_interpreter_stack() is None


def _eager(tensors) -> bool:
    """Whether a call may skip the dispatcher: plain eager mode (:func:`plain_eager_mode`) and
    plain tensors (no subclass)."""
    return plain_eager_mode() and all(type(t) in _PLAIN for t in tensors)


def run(spec: str, layout: str, x: Tensor, index: list[Tensor], h0: list[Tensor], weights: list[Tensor],
        masks: Tensor | None = None, rates: list[float] | None = None, resets: Tensor | None = None,
        precision: str = "f32"):
    """Output and final states of the model `spec` (the reserve only when autograd needs it);
    ``masks``: a training-mode call's seed (``draw_masks``), ``None`` in evaluation mode;
    ``rates``: :func:`call_rates`'s list (``None``: the model's own); ``resets`` and
    ``precision``: as the operators take them (see :func:`rnn_forward`)."""
    for name, t in [("input", x), *((f"h0[{i}]", h) for i, h in enumerate(h0))]:
        if t.dtype != torch.float32:
            raise DTypeError(f"`{name}` is {t.dtype}: cellc computes in float32 (call .float() on it)")
    training = torch.is_grad_enabled() and (
        x.requires_grad or any(h.requires_grad for h in h0) or any(w.requires_grad for w in weights)
    )
    if _eager([x, *h0, *weights]):
        if not training:
            # cellc.RNN has checked that every tensor is on x's device: on the CPU, nothing more to check.
            checked = x.device.type == "cpu"
            out, finals, _ = _forward_impl(spec, layout, x, index, h0, weights, False, masks, rates, resets,
                                           precision, checked, False)
            return out, finals
        out, _, *finals = _Eager.apply(spec, layout, len(index), len(h0), masks, rates, resets, precision, x, *index,
                                       *h0, *weights)
        return out, finals
    out, finals, _ = torch.ops.cellc.rnn_forward(spec, layout, x, index, h0, weights, training, masks,
                                                 _rates_tensor(rates), resets, precision)
    return out, finals


# ---- Exported models: torch.export, AOTInductor ---------------------------------------------


@torch.library.custom_op("cellc::cellc_rnn", mutates_args=())
def cellc_rnn(
    spec: str,
    layout: str,
    x: Tensor,
    lengths: Tensor | None,
    h0: list[Tensor],
    weights: list[Tensor],
    precision: str,
) -> tuple[Tensor, Tensor]:
    """The operator ``torch.ops.cellc.cellc_rnn``: an inference call of ``cellc.RNN`` in an
    exported model (``torch.export.export`` traces it in place of :func:`rnn_forward`).

    Its outputs are plain tensors, so that AOTInductor's generated code calls it through a C
    function, ``aoti_torch_cpu_cellc_rnn`` or, in a CUDA graph, ``aoti_torch_cuda_cellc_rnn``
    (the ``cellc-aoti`` library, which this package's extension exports too), with no Python:
    the spec, a constant argument, carries the cell's source, sizes and cellc's version into
    the package.

    Args:
        spec: the model (``cellc.RNN.spec``), base64-encoded (:func:`export_spec`): AOTInductor
            writes a string argument into its generated C++ as it is, unescaped.
        layout: a padded layout (see :func:`rnn_forward`).
        x: the input, float32, ``[B, T, I]`` or ``[T, B, I]``.
        lengths: each sequence's length, int64 ``[B]`` on the CPU; ``None``: all ``T``.
        h0: the initial states, one per state of the cell, or none (zeros).
        weights: every layer's and direction's parameters, in the model's order.
        precision: the precision asked for the products (``"f32"``; ``"tf32"`` over device
            memory where PyTorch allows it, as eager mode computes).

    Returns:
        ``(output, finals)``: the output, and the final states concatenated along their last
        dimension (``[layers * directions, B, sum of the state sizes]``).
    """
    out, finals, _ = _forward_impl(_spec_of(spec), layout, x, [] if lengths is None else [lengths], h0, weights,
                                   False, precision=precision)
    return out, torch.cat(finals, dim=-1)


@cellc_rnn.register_fake
def _(spec, layout, x, lengths, h0, weights, precision):
    info = describe(_spec_of(spec))
    batch = x.shape[0] if layout.startswith("batch_first") else x.shape[1]
    width = sum(size for _, size in info["states"])
    return x.new_empty((*x.shape[:-1], info["output_size"])), x.new_empty((info["slots"], batch, width))


def _check_exportable(x: Tensor, masks, resets, precision: str, exporter: str) -> None:
    """What an exported call cannot carry, as an :class:`ExportError` naming it: masks,
    resets, half-precision products; for ONNX Runtime, whose node runs on the CPU, CUDA tensors
    and TF32 products too. An AOTInductor package runs where the model was exported: CUDA
    tensors on the CUDA back end (the products TF32 where PyTorch lets cuDNN's RNN use it, as
    in eager mode), CPU tensors on the CPU back end (or on the emulated device)."""
    if masks is not None:
        raise ExportError(
            "a training-mode call that draws masks (dropout between layers, or the cell's own) cannot be "
            f"exported: call model.eval() before {exporter}"
        )
    if resets is not None:
        raise ExportError("`resets` cannot be exported yet: export the model without per-step resets")
    onnx = exporter == "torch.onnx.export"
    if onnx and x.device.type != "cpu":
        raise ExportError(
            f"ONNX Runtime runs cellc's node on the CPU, and `input` is on {x.device}: export the model on the CPU"
        )
    # TF32 is asked over device memory only (float32_products), where the CUDA back end computes it.
    allowed = ("f32",) if onnx else ("f32", "tf32")
    if precision not in allowed:
        where = "ONNX Runtime's cellc node" if onnx else "an exported cellc.RNN"
        raise ExportError(
            f"{where} computes {' or '.join(allowed)} products, and this call asks for {precision} (autocast, "
            "half-precision tensors, or TF32 where PyTorch allows it): export it in float32"
            + (" with torch.backends.cudnn.allow_tf32 = False" if precision == "tf32" else "")
        )


#: The ONNX operator a ``cellc.RNN`` call exports to: domain ``cellc``, type ``RNN``.
ONNX_DOMAIN, ONNX_OP, ONNX_VERSION = "cellc", "RNN", 1


def onnx_forward(spec: str, layout: str, x: Tensor, index: list[Tensor], h0: list[Tensor], weights: list[Tensor],
                 masks, resets, precision: str) -> tuple[Tensor, list[Tensor]]:
    """A ``cellc.RNN`` call while ``torch.onnx.export`` traces it: one ``cellc::RNN`` node.

    Inputs, by position: the input ``X``, the ``lengths`` (int64 ``[B]``; absent: every
    sequence runs all the steps), the initial states where the attribute ``initial_states`` is
    1 (one per state of the cell; else zeros), then every weight in the module's order
    (initialisers under PyTorch's names). Outputs: ``Y``, then each final state,
    ``[layers * directions, B, size]``. Attributes: the ``spec`` (the cell's source, sizes,
    configuration and cellc's version: all a runtime needs to compile the cell), the
    ``layout`` (``batch_first/left``, ``time_first/right``, ...), ``initial_states``,
    ``cellc_version``, and, to read the node without parsing the spec, ``cell``, ``layers``,
    ``bidirectional``, ``states`` and ``state_sizes``.
    """
    _check_exportable(x, masks, resets, precision, "torch.onnx.export")
    info = describe(spec)
    names = [name for name, _ in info["states"]]
    sizes = [size for _, size in info["states"]]
    parsed = json.loads(spec)
    batch = x.shape[0] if layout.startswith("batch_first") else x.shape[1]
    outputs = torch.onnx.ops.symbolic_multi_out(
        f"{ONNX_DOMAIN}::{ONNX_OP}",
        [x, index[0] if index else None, *h0, *weights],
        {
            "spec": spec,
            "layout": layout,
            "initial_states": int(bool(h0)),
            "cellc_version": str(parsed.get("cellc", "")),
            "cell": info["cell"],
            "layers": int(parsed["layers"]),
            "bidirectional": int(bool(parsed["bidirectional"])),
            "states": names,
            "state_sizes": sizes,
        },
        dtypes=[torch.float32] * (1 + len(sizes)),
        shapes=[(*x.shape[:-1], info["output_size"]), *[(info["slots"], batch, size) for size in sizes]],
        version=ONNX_VERSION,
    )
    return outputs[0], list(outputs[1:])


def exported_forward(spec: str, layout: str, x: Tensor, index: list[Tensor], h0: list[Tensor],
                     weights: list[Tensor], masks, resets, precision: str) -> tuple[Tensor, list[Tensor]]:
    """A ``cellc.RNN`` call while ``torch.export`` traces it: :func:`cellc_rnn`, its final
    states split again; what an exported model cannot carry is an :class:`ExportError` naming
    the argument, at export time."""
    _check_exportable(x, masks, resets, precision, "torch.export.export")
    out, finals = torch.ops.cellc.cellc_rnn(export_spec(spec), layout, x, index[0] if index else None, h0, weights,
                                            precision)
    sizes = [size for _, size in describe(spec)["states"]]
    return out, list(torch.split(finals, sizes, dim=-1))


def export_spec(spec: str) -> str:
    """A spec as :func:`cellc_rnn` takes it: base64 of its UTF-8 text, which needs no escape in
    a C string literal (the C shim's caller is generated C++ that writes strings as they are)."""
    return base64.b64encode(spec.encode()).decode("ascii")


@functools.lru_cache(maxsize=64)
def _spec_of(encoded: str) -> str:
    """The spec :func:`export_spec` encoded."""
    return base64.b64decode(encoded.encode("ascii")).decode()


#: The C declarations AOTInductor's generated code calls ``cellc::cellc_rnn`` by, on CPU and on
#: CUDA tensors (the C shims of ``runtime/aoti``; their arguments as AOTInductor derives them
#: from the schema, their names from the graph's device).
C_SHIMS = [
    f"AOTITorchError aoti_torch_{device}_cellc_rnn(const char* spec, const char* layout, AtenTensorHandle x, "
    "AtenTensorHandle* lengths, const AtenTensorHandle* h0, int64_t h0_len, const AtenTensorHandle* weights, "
    "int64_t weights_len, const char* precision, AtenTensorHandle* ret0, AtenTensorHandle* ret1)"
    for device in ("cpu", "cuda")
]


def aoti_library() -> str:
    """The path of a library that holds cellc's AOTInductor C shim: this package's extension,
    which exports it. A process that runs an AOTInductor package of a model with ``cellc.RNN``
    but does not import ``cellc`` loads it first (``ctypes.CDLL(path, mode=os.RTLD_GLOBAL)``);
    a C++ program links it, or the ``cellc-aoti`` crate's ``libcellc_aoti.so`` (``cargo build
    --release -p cellc-aoti``), the same functions without Python.

    Returns:
        The extension's file path.
    """
    return _cellc.__file__


def onnx_library() -> str:
    """The path of cellc's ONNX Runtime custom-operator library, which runs the ``cellc::RNN``
    nodes of models exported with ``torch.onnx.export``: this package's extension, which
    exports its entry point (``RegisterCustomOps``). Give it to
    ``onnxruntime.SessionOptions.register_custom_ops_library``; outside Python, the
    ``cellc-onnx`` crate's ``libcellc_onnx.so`` (``cargo build --release -p cellc-onnx``) is
    the same library.

    Returns:
        The extension's file path.
    """
    return _cellc.__file__


def _register_c_shim() -> None:
    """Tells AOTInductor to call ``cellc::cellc_rnn`` through its C shim, and makes the shim,
    which this package's extension exports, visible to the packages it loads in this process.
    A PyTorch without AOTInductor's C shims for custom operators keeps its own route."""
    try:
        from torch._inductor import config
        shims = dict(config.aot_inductor.custom_ops_to_c_shims)
    except (ImportError, AttributeError):
        return
    shims[torch.ops.cellc.cellc_rnn.default] = list(C_SHIMS)
    config.aot_inductor.custom_ops_to_c_shims = shims
    try:
        ctypes.CDLL(_cellc.__file__, mode=os.RTLD_GLOBAL | getattr(os, "RTLD_NOLOAD", 0))
    except OSError:
        pass


_register_c_shim()
