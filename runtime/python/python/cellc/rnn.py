"""``cellc.RNN``: any ``.cell`` as a ``torch.nn.Module``, with ``nn.LSTM``'s conventions."""

from __future__ import annotations

import contextlib
import json
import os
import warnings

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from . import _cellc, _float64, _ops
from .errors import DeviceError, DTypeError, ExportError, ShapeError

_ALIGNS = ("left", "right")


def cell_source(cell: str) -> tuple[str, str]:
    """The source of a cell given as a shipped cell's name, a ``.cell`` path or source text.

    A bare name (``"lstm"``) is a shipped cell, even if a file of that name lies in the working
    directory. Otherwise a string naming an existing file is a path (whatever characters its
    name holds, ``{`` among them), and so is one ending in ``.cell``; any other text with ``{``
    is source text.

    Args:
        cell: a shipped cell's name, a ``.cell`` file's path, or source text.

    Returns:
        ``(source, file name)``: the file name is ``cells/<name>.cell`` for a shipped cell,
        ``<source>`` for source text.

    Raises:
        FileNotFoundError: a path (ending in ``.cell``, or with a directory part) that names
            no file, or a name that is no shipped cell.
        ValueError: a file too large to be a cell (over 16 MiB: ``/dev/zero``, a wrong path).
    """
    if not isinstance(cell, (str, os.PathLike)):
        raise TypeError(f"cell must be a shipped cell's name, a .cell path or source text, not {type(cell).__name__}")
    cell = os.fspath(cell)
    name = cell.removesuffix(".cell")
    is_path = cell.endswith(".cell") or os.sep in cell or (os.altsep is not None and os.altsep in cell)
    if not is_path and "{" not in cell:
        shipped = _cellc.shipped_cell(name)
        if shipped is not None:
            return shipped, f"cells/{name}.cell"
    if os.path.exists(cell) and not os.path.isdir(cell):  # a file, or a device such as /dev/zero
        return _read_cell_file(cell), cell
    if "{" in cell and not cell.endswith(".cell"):
        return cell, "<source>"
    raise FileNotFoundError(
        f"no cell `{cell}`: no such .cell file, and not a shipped cell ({', '.join(_cellc.shipped_cells())})"
    )


_MOST_CELL_BYTES = _cellc.MOST_CELL_BYTES  # as the runtime reads cell files


def _read_cell_file(path: str) -> str:
    """A cell file's text, read no further than a cell's size allows."""
    with open(path, encoding="utf-8") as f:
        text = f.read(_MOST_CELL_BYTES + 1)
    if len(text) > _MOST_CELL_BYTES:
        raise ValueError(f"{path}: holds more than {_MOST_CELL_BYTES} characters: not a cell file")
    return text


def _size(name: str, value, *, least: int = 1) -> int:
    """``value`` as a size: an integer (not a bool, not a float) of at least ``least`` that cellc can index."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy  # noqa: PLC0415 -- numpy integers are integers too

            is_int = isinstance(value, numpy.integer)
        except ImportError:
            is_int = False
        if not is_int and not (isinstance(value, Tensor) and value.dim() == 0 and not value.dtype.is_floating_point
                               and value.dtype != torch.bool):
            raise TypeError(f"{name} must be an integer, not {type(value).__name__} ({value!r})")
    value = int(value)
    if value < least or value > _MAX_SIZE:
        raise ValueError(f"{name} must be an integer in [{least}, {_MAX_SIZE}], not {value}")
    return value


# Larger sizes cannot be allocated as float32 tensors on any machine cellc runs on.
_MAX_SIZE = 1 << 31


_HALF = (torch.bfloat16, torch.float16)


def _check_rate(name: str, rate) -> None:
    """A rate (of dropout, or of one of the cell's masks): a number in [0, 1)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        raise ValueError(f"{name} must be a number in [0, 1), not {rate!r}")


def _check_mask_seed(masks, optional: bool) -> None:
    """A training call's ``masks`` as :meth:`RNN.dropout_masks` and :meth:`RNN.cell_masks` take
    it: an int64 tensor of two values in ``[0, 2**62)`` (:func:`cellc.draw_masks`), or ``None``
    where ``optional`` (an evaluation call's)."""
    what = "an int64 tensor of two values in [0, 2**62), as cellc.draw_masks() gives"
    if masks is None and optional:
        return
    if not isinstance(masks, Tensor) or masks.dtype != torch.int64:
        kind = f"a {masks.dtype} tensor" if isinstance(masks, Tensor) else repr(masks) if masks is None else \
            f"a {type(masks).__name__}"
        raise TypeError(f"`masks` must be {what}{' (or None: no masks)' if optional else ''}, not {kind}")
    if tuple(masks.shape) != (2,):
        raise ValueError(f"`masks` has shape {list(masks.shape)}: it must be {what}")
    if bool((masks < 0).any()) or bool((masks >= 2**62).any()):
        raise ValueError(f"`masks` is {masks.tolist()}: it must be {what}")


def _check_same_packing(resets: PackedSequence, packed: PackedSequence) -> None:
    """A ``PackedSequence`` of resets packed as the input is (else its flags would land on other
    sequences' rows): the same ``batch_sizes`` and ``sorted_indices``."""
    def same(a, b):
        return (a is None and b is None) or (a is not None and b is not None and torch.equal(a.cpu(), b.cpu()))

    if not same(resets.batch_sizes, packed.batch_sizes) or not same(resets.sorted_indices, packed.sorted_indices):
        raise ShapeError(
            "`resets` is a PackedSequence packed otherwise than `input` (batch_sizes "
            f"{resets.batch_sizes.tolist()} against {packed.batch_sizes.tolist()}, sorted_indices "
            f"{_listed(resets.sorted_indices)} against {_listed(packed.sorted_indices)}): pack the resets "
            "with the input's lengths and enforce_sorted, or pass them as the input's [N] rows"
        )


def _listed(t):
    return None if t is None else t.tolist()


def _result_dtype(x: Tensor):
    """The dtype a call returns where it is not float32: autocast's where autocast is on for the
    input's device (as ``nn.LSTM`` under autocast returns it), else a bf16 or fp16 input's own;
    ``None``: float32 in, float32 out."""
    try:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
    except RuntimeError:
        pass  # a device autocast does not know (meta): the checks below name it
    return x.dtype if x.dtype in _HALF else None


def _integers(name: str, value, what: str) -> Tensor:
    """``value`` (a tensor, or a list a user wrote) as a tensor; an empty list as an empty
    integer tensor (not PyTorch's float32 default); anything that is no array of numbers a
    ``TypeError`` naming ``name`` and ``what`` it should be."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (str, bytes)):
        raise TypeError(f"`{name}` must be {what}, not a {type(value).__name__}")
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"`{name}` must be {what}, not {value!r:.80}") from e
    return t.to(torch.int64) if t.numel() == 0 else t


def _reset_flags(resets, shape: tuple, layout: str) -> Tensor:
    """A call's per-step resets as the operators take them: int64 on the CPU (1 where the state
    restarts), checked to be shaped as the input's rows, then booleans (or integers)."""
    resets = _integers("resets", resets, f"bools shaped {layout}")
    if tuple(resets.shape) != tuple(shape):
        raise ShapeError(f"`resets` has shape {list(resets.shape)}, expected {list(shape)}: {layout}, as the input")
    if resets.dtype.is_floating_point or resets.dtype.is_complex:
        raise DTypeError(f"`resets` is {resets.dtype}: one bool per sequence and step expected")
    return (resets != 0).to(device="cpu", dtype=torch.int64).contiguous()


class RNN(nn.Module):
    """A stack of layers of any ``.cell`` recurrent cell as an ``nn.Module``, run by cellc's fused
    kernels, with ``nn.LSTM``'s conventions.

    Two ways to make one: cellc's form names the cell and its sizes, ``nn.LSTM``'s form takes
    ``nn.LSTM``'s positional arguments after the cell. A call takes a padded batch with each
    sequence's length (padding at the end or at the start, unsorted, nothing copied) or a
    ``PackedSequence``, and returns ``(output, finals)`` as ``nn.LSTM`` does (see :meth:`forward`).

    Example:
        >>> import torch, cellc
        >>> rnn = cellc.RNN("layernorm_lstm", input_size=8, sizes={"H": 16}, num_layers=2, batch_first=True)
        >>> out, (h, c) = rnn(torch.randn(3, 5, 8), lengths=[5, 2, 4])
        >>> out.shape, h.shape
        (torch.Size([3, 5, 16]), torch.Size([2, 3, 16]))
        >>> lstm = cellc.RNN("lstm", 8, 16, 2, batch_first=True)  # nn.LSTM(8, 16, 2, batch_first=True)'s form
        >>> lstm.load_state_dict(torch.nn.LSTM(8, 16, 2, batch_first=True).state_dict())
        <All keys matched successfully>

    Args:
        cell: a shipped cell's name (``"lstm"``, see :func:`cellc.shipped_cells`), a ``.cell``
            file's path (ending in ``.cell`` or with a directory part: ``"./lstm"``), or ``.cell``
            source text. A bare name is a shipped cell even where a file of that name lies in
            the working directory.
        input_size: features per step of the input.
        sizes: the cell's size variables, by name (``{"H": 256}``); the others are inferred
            from ``input_size`` and these. An integer here is ``hidden_size`` (``nn.LSTM``'s
            positional form; the positional arguments after ``num_layers`` are then
            ``nn.LSTM``'s).
        num_layers: layers stacked; layer ``k > 0`` reads layer ``k - 1``'s output (both
            directions' where ``bidirectional``).
        *args: the positional arguments after ``num_layers``: ``bidirectional, batch_first,
            backend`` in cellc's form, ``bias, batch_first, dropout, bidirectional, proj_size``
            in ``nn.LSTM``'s (``sizes`` an integer).
        bidirectional: a second direction per layer, run from each sequence's own last step
            back to its first; the two directions' outputs are concatenated.
        batch_first: inputs and outputs are ``[B, T, F]`` (else ``[T, B, F]``). The states are
            ``[num_layers * directions, B, size]`` either way, as ``nn.LSTM``'s.
        backend: ``None`` (default: the tensors' device decides, ``"cpu"`` for CPU tensors and
            ``"cuda"`` for CUDA tensors), ``"cpu"`` (which refuses CUDA tensors), ``"cuda"``,
            ``"reference"`` (the stages on the interpreter's semantics: slow, exact) or
            ``"cuda-emulated"`` (the CUDA back end's code on CPU tensors, its kernels compiled
            as host C++ by g++: for verification without a GPU).
        hidden_size: the size of the cell's first state (``H`` for the shipped cells), as
            ``nn.LSTM``'s; the same as ``sizes={"H": hidden_size}``.
        bias: ``nn.LSTM``'s, accepted at its default ``True`` only (a cell's biases are
            parameters of its ``.cell`` source: write a cell without them).
        dropout: ``nn.LSTM``'s: in training mode (``module.train()``), every layer's output but
            the last is dropped unit by unit with this probability in ``[0, 1)``, kept units
            scaled by ``1 / (1 - dropout)``. The masks come from cellc's counter-based
            generator, seeded from PyTorch's default generator once per call
            (``torch.manual_seed`` reproduces them; each call draws new ones; the backward
            draws the same again, storing nothing; under DDP, ranks seeded alike draw alike).
            Such a call takes its seed from PyTorch's default generator, so the random numbers
            drawn after it are not those drawn after an ``nn.LSTM`` call. It may be changed
            between calls (:attr:`dropout`).
        proj_size: ``nn.LSTM``'s, accepted at its default ``0`` only: a projection is part of
            the cell, and the shipped cell ``"lstmp"`` is ``nn.LSTM(proj_size=P)``
            (``cellc.RNN("lstmp", input_size, {"H": H, "P": P})`` loads its ``state_dict``).
        cell_name: which cell of a source that defines several (``None``: its only one).
        rates: the cell's own rates (its ``rate`` declarations: the probabilities of its
            ``dropout``, ``variational_dropout``, ``zoneout`` and ``dropconnect``), by name,
            e.g. ``{"zh": 0.05}``; the others keep the cell's defaults. In training mode the
            cell's masks are drawn as dropout's are; in evaluation mode none are (zoneout takes
            its expectation).
        device: where the parameters are made, as for any ``nn.Module`` (``"meta"``: left
            uninitialised, for ``to_empty()``).
        dtype: the parameters' dtype: ``None`` or ``torch.float32`` (the default),
            ``torch.bfloat16``, ``torch.float16``, or ``torch.float64`` (for checking).
            Initialised in float32, as ``nn.LSTM`` draws them, then cast.

    Raises:
        FileNotFoundError: ``cell`` is neither a shipped cell, a ``.cell`` file nor source text.
        CellCompileError: the cell does not compile (the message shows the diagnostics).
        ValueError: an argument out of range: a size below 1 or above ``2**31``, a size or rate
            the cell does not have, ``bias=False``, ``proj_size > 0``, ``dropout`` outside
            ``[0, 1)``, an unknown ``backend``.
        TypeError: an argument of the wrong type (a size that is not an integer, ``sizes``
            neither a dict nor an integer).
        DTypeError: a ``dtype`` cellc does not compute in.

    Attributes:
        cell: the cell's name, as its source declares it.
        input_size: features per step of the input.
        hidden_size: the size of the cell's first state (the output's size for a cell
            without states).
        num_layers: layers stacked.
        bidirectional: whether each layer has a reverse direction.
        batch_first: whether inputs and outputs are ``[B, T, F]``.
        backend: the back end named when the module was made (``None``: the tensors' device
            decides).
        bias: ``True``, as ``nn.LSTM``'s.
        proj_size: ``0``, as ``nn.LSTM``'s.
        sizes: the size variables given (``hidden_size`` under its variable's name).
        output_size: features of one direction's output per step.
        state_names: the cell's states, in ``hx``'s and the finals' order (``["h", "c"]``
            for an LSTM).
        state_sizes: each state's size, in the same order.
        spec: the model's description as the operators take it: JSON of the cell's source,
            its sizes and configuration, and cellc's version.

    Parameters are named as PyTorch names them (``weight_ih_l0``, ``bias_hh_l1_reverse``), so
    ``load_state_dict(nn_lstm.state_dict())`` works for ``cells/lstm.cell`` (and ``gru``,
    ``rnn_tanh``), and they are initialised by the cell's ``init`` clauses from torch's random
    generator as ``nn.LSTM`` draws them: after ``torch.manual_seed(s)``, ``cellc.RNN("lstm", I, H)``
    has ``nn.LSTM(I, H)``'s weights (see :meth:`reset_parameters`).

    Mixed precision: under ``torch.autocast`` a call returns its output and final states in
    autocast's dtype, as ``nn.LSTM`` does; bf16 or fp16 inputs give outputs in their own dtype,
    and a module's parameters may be bf16 or fp16 (``.to(torch.bfloat16)``, ``dtype=``), their
    gradients in their dtype. Where the result is bf16 (bf16 autocast, bf16 inputs), a call
    computes as autocast does: the products of the weights take bf16 operands (weights and
    vectors rounded to nearest even) and sum in float32, with the CPU's bf16 instructions where
    it has them, and on CUDA cuBLAS's tensor cores; the states, the cell's pointwise math and
    the weight gradients stay float32 (against float32 master weights). Where it is fp16 (CUDA's
    default autocast), the products on CUDA take fp16 operands the same way. Elsewhere (fp16 on
    the CPU, which has no fp16 products; the reference back end) the arithmetic is float32,
    rounded at the end.

    TF32: a float32 call on CUDA tensors computes the products of the weights as ``nn.LSTM``'s
    cuDNN RNN does on that GPU. Where PyTorch lets cuDNN's RNN use TF32 (its default,
    ``torch.backends.cudnn.rnn.fp32_precision == "tf32"``; ``torch.backends.cudnn.allow_tf32``
    on older PyTorch), their operands are rounded to TF32 on the tensor cores and summed in
    float32; with ``torch.backends.cudnn.allow_tf32 = False`` (or ``rnn.fp32_precision =
    "ieee"``) they are full float32, as everything is on the CPU.

    float64, for checking: a ``.double()`` module (or ``dtype=torch.float64``) called on float64
    tensors on the CPU runs cellc's interpreter in f64, one sequence at a time, forwards and
    backwards, so ``torch.autograd.gradcheck`` applies to any cell. It is the oracle the back
    ends are tested against, not a fast route; it runs in evaluation (``module.eval()``: masks
    and dropout are not drawn in float64).

    On CUDA tensors (``module.cuda()``), every pass is queued on PyTorch's current stream and
    nothing waits on the host, provided ``lengths`` is a CPU tensor or a list (PyTorch's own
    ``pack_padded_sequence`` asks the same: reading lengths kept on the GPU waits for it).
    """

    def __init__(
        self,
        cell: str,
        input_size: int,
        sizes: dict[str, int] | int | None = None,
        num_layers: int = 1,
        *args,
        bidirectional: bool = False,
        batch_first: bool = False,
        backend: str | None = None,
        hidden_size: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        proj_size: int = 0,
        cell_name: str | None = None,
        rates: dict[str, float] | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        options = dict(bias=bias, batch_first=batch_first, dropout=dropout, bidirectional=bidirectional,
                       proj_size=proj_size, backend=backend)
        if isinstance(sizes, int) and not isinstance(sizes, bool):
            # nn.LSTM's positional form: (input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional).
            if hidden_size is not None:
                raise TypeError("hidden_size given both positionally and by name")
            hidden_size, sizes = sizes, None
            order = ("bias", "batch_first", "dropout", "bidirectional", "proj_size")
        else:
            # cellc's own: (cell, input_size, sizes, num_layers, bidirectional, batch_first, backend).
            order = ("bidirectional", "batch_first", "backend")
        if len(args) > len(order):
            raise TypeError(f"at most {3 + len(order)} positional arguments after the cell")
        options.update(zip(order, args))
        bias, batch_first, dropout = options["bias"], options["batch_first"], options["dropout"]
        bidirectional, proj_size, backend = options["bidirectional"], options["proj_size"], options["backend"]
        if dtype is not None and dtype not in (torch.float32, torch.float64, *_HALF):
            raise DTypeError(f"cellc's parameters are float32, bf16, fp16 or float64 (for checking), not {dtype}")
        if backend not in (None, "cpu", "cuda", "reference", "cuda-emulated"):
            raise ValueError(
                f"backend must be None, 'cpu', 'cuda', 'reference' or 'cuda-emulated', not {backend!r}"
            )
        if bias is not True:
            raise ValueError("bias=False is not supported: a cell's biases are parameters of its .cell source "
                             "(write a cell without them)")
        _check_rate("dropout", dropout)
        if dropout > 0 and num_layers == 1:
            warnings.warn(
                "dropout is applied between layers (to every layer's output but the last): with "
                f"num_layers=1 it does nothing (dropout={dropout})"
            )
        if proj_size != 0:
            raise ValueError("proj_size: a projection is part of the cell; the shipped cell \"lstmp\" is "
                             "nn.LSTM(proj_size=P): cellc.RNN(\"lstmp\", input_size, {\"H\": H, \"P\": P})")
        if sizes is not None and not isinstance(sizes, dict):
            raise TypeError(f"sizes must be a dict of size names to integers (or hidden_size an int), "
                            f"not {type(sizes).__name__}")
        source, file = cell_source(cell)
        input_size = _size("input_size", input_size)
        num_layers = _size("num_layers", num_layers)
        known, hidden_name = _cellc.cell_sizes(file, source, cell_name)
        sizes = {str(k): v for k, v in (sizes or {}).items()}
        unknown = [k for k in sizes if k not in known]
        if unknown:
            raise ValueError(
                f"sizes has {', '.join(repr(k) for k in unknown)}, which the cell does not have "
                f"(its sizes: {', '.join(repr(k) for k in known) or 'none'})"
            )
        if hidden_size is not None:
            hidden_size = _size("hidden_size", hidden_size)
            if hidden_name is None:
                raise ValueError("hidden_size: this cell's first state is not sized by one size variable: "
                                 f"pass sizes={{...}} (its sizes: {', '.join(known)})")
            if sizes.get(hidden_name, hidden_size) != hidden_size:
                raise ValueError(f"hidden_size={hidden_size} but sizes[{hidden_name!r}]={sizes[hidden_name]}")
            sizes[hidden_name] = hidden_size
        sizes = {k: _size(f"sizes[{k!r}]", v) for k, v in sizes.items()}
        spec = {
            "source": source,
            "file": file,
            "cell": cell_name,
            "input_size": input_size,
            "sizes": sizes,
            "layers": num_layers,
            "bidirectional": bool(bidirectional),
            "dropout": float(dropout),
            "backend": backend or "cpu",
            # torch.compile caches graphs by their constants: a new version's shapes are never
            # taken from an old version's graph.
            "cellc": _cellc.__version__,
        }
        self.spec = json.dumps(spec, sort_keys=True)
        # With backend=None, CUDA tensors run on the CUDA back end.
        self._cuda_spec = json.dumps({**spec, "backend": "cuda"}, sort_keys=True) if backend is None else None
        self._hold_models()
        info = _ops.describe(self.spec)
        self.cell = info["cell"]
        self.input_size = input_size
        self.num_layers = num_layers
        self.bidirectional = bool(bidirectional)
        self.batch_first = bool(batch_first)
        self.backend = backend
        self.sizes = dict(sizes)
        self.output_size = info["output_size"]
        self.state_sizes = [size for _, size in info["states"]]
        self.state_names = [name for name, _ in info["states"]]
        self.hidden_size = self.state_sizes[0] if self.state_sizes else self.output_size
        self.bias, self.dropout, self.proj_size = True, float(dropout), 0
        self._has_masks = bool(info["has_masks"])
        self._rate_defaults = dict(info["rates"])  # the cell's rates in its order, by name
        self.rates = {} if rates is None else rates
        self._read_description()
        self._weight_names = [name for name, _ in info["weights"]]
        for name, shape in info["weights"]:
            self.register_parameter(name, nn.Parameter(torch.empty(shape, device=device)))
        self.reset_parameters()
        if dtype is not None and dtype != torch.float32:
            self.to(dtype)  # initialised in float32 (nn.LSTM's draws), then kept in `dtype`

    def reset_parameters(self, seed: int | None = None) -> None:
        """Initialises the weights by the cell's ``init`` clauses, in place.

        The constructor calls it; call it again to draw new weights. Parameters on the ``meta``
        device are left as they are.

        Args:
            seed: ``None`` (default): draw from torch's random generator, weight by weight in
                ``nn.LSTM``'s order (``nn.init.uniform_`` for a ``uniform`` clause): the same
                draws as ``nn.LSTM``'s ``reset_parameters``, leaving the generator where
                ``nn.LSTM`` leaves it. An integer: draw from cellc's own generator (the CLI's
                and Rust's initialisation for that seed), leaving torch's untouched.
        """
        params = self._weights()
        if any(p.device.type == "meta" for p in params):
            return
        with torch.no_grad():
            if seed is None:
                for p, (kind, value) in zip(params, _cellc.param_inits(self.spec)):
                    if kind == "uniform":
                        nn.init.uniform_(p, -value, value)
                    else:
                        p.fill_(value)
                return
            for p, data in zip(params, _cellc.initial_weights(self.spec, int(seed))):
                p.copy_(torch.frombuffer(bytearray(data), dtype=torch.float32).view(p.shape))

    @contextlib.contextmanager
    def frozen(self):
        """A block whose CPU inference calls read the weights as they are on entering it, packed
        for the products once instead of on every call: for a generation loop, whose calls of one
        step each would otherwise spend as long reading the weights as computing with them.

        Inside it the weights must not change (an optimiser step, ``load_state_dict``, a write
        through ``.data``): the calls would not see the change. Calls that record autograd, run
        under ``torch.autocast`` or draw masks read the weights as ever, as do calls on CUDA and
        everything after the block. Blocks nest; the weights are copied at the outermost.

        Returns:
            A context manager, which gives the module itself to ``as``.

        Example:
            >>> import torch, cellc
            >>> rnn = cellc.RNN("gru", 8, 8)
            >>> x, state = torch.randn(1, 1, 8), None
            >>> with torch.no_grad(), rnn.frozen():
            ...     for _ in range(3):
            ...         x, state = rnn(x, state)
        """
        eager = self._eager
        froze = eager is not None and eager.freeze(self._weights())
        try:
            yield self
        finally:
            if froze:
                eager.thaw()

    def flatten_parameters(self) -> None:
        """``nn.LSTM``'s: a no-op here (cellc reads each weight where it lies, with no flat buffer)."""

    def _weights(self) -> list[Tensor]:
        """The weights in the operators' order (read on every call: a swapped weight is seen)."""
        params = self._parameters
        weights = []
        for name in self._weight_names:
            p = params.get(name)
            # A weight swapped for a plain tensor attribute (weight drop, FSDP) is read too.
            weights.append(p if p is not None else getattr(self, name))
        return weights

    @property
    def all_weights(self) -> list[list[Tensor]]:
        """As ``nn.LSTM``'s: a list with one list per layer and direction (layer 0, layer 0's
        reverse direction, layer 1, ...) of its parameters, in the cell's order (``weight_ih,
        weight_hh, bias_ih, bias_hh`` for ``lstm``)."""
        weights = self._weights()
        per = len(weights) // max(self.num_layers * (2 if self.bidirectional else 1), 1)
        return [weights[i : i + per] for i in range(0, len(weights), max(per, 1))]

    def extra_repr(self) -> str:
        """The arguments ``repr(module)`` shows: the cell and every option not at its default.

        Returns:
            The text inside ``RNN(...)``, e.g. ``'lstm', input_size=8, sizes={'H': 16},
            num_layers=1, batch_first=True``.
        """
        parts = [f"{self.cell!r}", f"input_size={self.input_size}"]
        if self.sizes:
            parts.append(f"sizes={self.sizes}")
        parts.append(f"num_layers={self.num_layers}")
        if self.bidirectional:
            parts.append("bidirectional=True")
        if self.batch_first:
            parts.append("batch_first=True")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if self.rates:
            parts.append(f"rates={self.rates}")
        if self.backend is not None:
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)

    def forward(self, input, hx=None, *, lengths=None, align: str = "left", resets=None):
        """Runs every layer and direction over a batch of sequences, as ``nn.LSTM``'s call does.

        One fused call (forward, and the backward autograd runs) however long or unsorted the
        lengths: nothing is sorted, packed or copied, and each sequence stops at its own length.

        Args:
            input: a padded batch, ``[B, T, input_size]`` with ``batch_first`` or else
                ``[T, B, input_size]``; one sequence, ``[T, input_size]`` (its results
                unbatched too); or a ``PackedSequence`` (the output is then packed the same
                way). float32; bf16 and fp16 give results in their dtype, float64 runs the
                interpreter (see the class).
            hx: the initial states as ``nn.LSTM`` takes them: a tuple with one tensor per state
                of the cell (``(h_0, c_0)`` for an LSTM; see ``state_names``), or a tensor for a
                one-state cell, each ``[num_layers * directions, B, size]`` (``[num_layers *
                directions, size]`` for one sequence). ``None``: zeros.
            lengths: for a padded ``input``, each sequence's length: ``B`` integers in ``[1,
                T]``, in any order, as a list or a tensor (on CUDA, a list or a CPU tensor: one
                kept on the GPU makes the call wait for it). ``None``: every sequence runs all
                ``T`` steps.
            align: where a padded batch's padding lies: ``"left"`` (each sequence starts at
                step 0, padding after its end, as ``pad_sequence`` makes it) or ``"right"``
                (padding first, each sequence ending at step ``T - 1``).
            resets: ``None``, or per-step flags (bool or integer, shaped as the input without
                its features: ``[B, T]`` or ``[T, B]``; for a packed input ``[N]``, one per row
                of ``input.data``, or a ``PackedSequence`` of flags) that restart a sequence's
                state at each flagged step: the step is computed from ``hx`` (zeros without
                one), as if a new sequence began there (an episode's end in reinforcement
                learning, TorchRL's ``is_init``), in every layer, and the reverse direction of a
                bidirectional layer runs each stretch between resets on its own. Flags at
                padding or at a sequence's first step change nothing. The gradient of ``hx`` is
                the sum over the stretches that start from it: the first and one per reset.
                Masks do not change with resets (they are drawn per sequence and step).

        Returns:
            ``(output, finals)``, as ``nn.LSTM`` returns them. ``output``: the last layer's
            output at every step, ``[B, T, directions * output_size]`` (``[T, B, ...]`` time
            first; a ``PackedSequence`` for a packed input), the directions concatenated, zeros
            at padding. ``finals``: every state of every layer and direction at each sequence's
            own last step (the reverse direction's at the sequence's first step),
            ``[num_layers * directions, B, size]`` each: a tuple (``(h_n, c_n)`` for an LSTM)
            for a cell of several states, a tensor for one. In autocast's dtype under
            ``torch.autocast``, else in the input's.

        Raises:
            ShapeError: ``input``, ``hx``, ``lengths`` or ``resets`` shaped wrongly.
            LengthError: a length outside ``[1, T]``, or a packed batch's sizes or
                permutation invalid.
            DTypeError: a dtype cellc does not compute in, or float64 mixed with float32.
            DeviceError: tensors on different devices, or CUDA tensors on the ``"cpu"``
                back end.
            ValueError: ``align`` neither ``"left"`` nor ``"right"``, ``lengths`` with a
                ``PackedSequence``, or a rate outside ``[0, 1)``.
        """
        if (not torch.is_grad_enabled() and resets is None and self._eager is not None and not self._draws_masks()
                and not torch.is_autocast_enabled("cpu") and _ops.plain_eager_mode()):
            # The plainest inference call in one native call; it declines anything else
            # (None), a mistake included, and the steps below take it.
            done = self._eager.infer(input, self._weights(), hx, lengths, align, torch.get_num_threads())
            if done is not None:
                return done[0], self._states_out(done[1])
        data = input.data if isinstance(input, PackedSequence) else input
        float64 = isinstance(data, Tensor) and data.dtype == torch.float64
        if float64 or any(w.dtype == torch.float64 for w in self._weights()):
            return _float64.forward(self, input, hx, lengths, align, resets)
        result = _result_dtype(data) if isinstance(data, Tensor) else None
        if result is None:
            return self._forward(input, hx, lengths, align, resets, "")
        # Mixed precision: computed in float32 from float32 copies (differentiable casts, so
        # gradients reach bf16/fp16 inputs and states in their own dtype), returned in `result`.
        if isinstance(input, PackedSequence):
            input = input._replace(data=input.data.float())
        else:
            input = input.float()
        if hx is not None:
            hx = hx.float() if isinstance(hx, Tensor) else tuple(h.float() for h in hx)
        # bf16 or fp16 products where the result is (asked of the device; one without fp16
        # products, the CPU, computes those in float32).
        precision = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(result, "")
        out, finals = self._forward(input, hx, lengths, align, resets, precision)
        if isinstance(out, PackedSequence):
            out = out._replace(data=out.data.to(result))
        else:
            out = out.to(result)
        finals = finals.to(result) if isinstance(finals, Tensor) else tuple(f.to(result) for f in finals)
        return out, finals

    def _forward(self, input, hx, lengths, align: str, resets, precision: str):
        weights = self._weights()
        for i, w in enumerate(weights):
            if w.dtype in _HALF:
                weights[i] = w = w.float()  # a .to(torch.bfloat16) module: float32 for the call
            if w.dtype != torch.float32:
                name = self._weight_names[i]
                raise DTypeError(f"parameter `{name}` is {w.dtype}: cellc computes in float32 (call .float())")
            if not w.is_contiguous():
                weights[i] = w.contiguous()
        if isinstance(input, PackedSequence):
            if lengths is not None:
                raise ValueError("`lengths` is for a padded input: a PackedSequence carries its own")
            return self._forward_packed(input, hx, weights, resets, precision)
        x = input
        if not isinstance(x, Tensor):
            raise TypeError(f"input must be a Tensor or a PackedSequence, not {type(x).__name__}")
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(0 if self.batch_first else 1)
        if x.dim() != 3 or x.shape[-1] != self.input_size:
            layout = "[B, T, input_size]" if self.batch_first else "[T, B, input_size]"
            raise ShapeError(
                f"`input` has shape {list(input.shape)}, expected {layout} with input_size={self.input_size}"
            )
        if align not in _ALIGNS:
            raise ValueError(f"align must be 'left' or 'right', not {align!r}")
        batch, steps = (x.shape[0], x.shape[1]) if self.batch_first else (x.shape[1], x.shape[0])
        if lengths is None:
            index = []  # every sequence runs all the steps
        else:
            lengths = _integers("lengths", lengths, f"[{batch}] integers (one length per sequence)")
            if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.shape != (batch,):
                raise ShapeError(
                    f"`lengths` has shape {list(lengths.shape)} and dtype {lengths.dtype}, "
                    f"expected [{batch}] integers (one length per sequence)"
                )
            index = [lengths.to(device="cpu", dtype=torch.int64).contiguous()]
        self._check_device(x, weights)
        h0 = self._initial_states(hx, batch, x, unbatched)
        layout = ("batch_first/" if self.batch_first else "time_first/") + align
        if resets is not None:
            shape = tuple(input.shape[:-1])
            rows = "[T] (a step of the unbatched input)" if unbatched else "[B, T]" if self.batch_first else "[T, B]"
            resets = _reset_flags(resets, shape, rows).reshape(x.shape[:-1])
        spec, masks = self._spec_for(x), self._masks()
        rates = self._call_rates(masks)
        precision = precision or _ops.float32_products(self._in_device_memory(x))
        if torch.onnx.is_in_onnx_export():
            out, finals = _ops.onnx_forward(spec, layout, x.contiguous(), index, h0, weights, masks, resets, precision)
        elif torch.compiler.is_exporting():
            out, finals = _ops.exported_forward(spec, layout, x.contiguous(), index, h0, weights, masks, resets,
                                                precision)
        else:
            out, finals = _ops.run(spec, layout, x.contiguous(), index, h0, weights, masks, rates, resets, precision)
        if unbatched:
            out = out.squeeze(0 if self.batch_first else 1)
            finals = [f.squeeze(1) for f in finals]
        return out, self._states_out(finals)

    def _forward_packed(self, packed: PackedSequence, hx, weights, resets, precision: str):
        data, batch_sizes, sorted_indices, unsorted_indices = packed
        if data.dim() != 2 or data.shape[-1] != self.input_size:
            raise ShapeError(
                f"`input.data` has shape {list(data.shape)}, expected [N, {self.input_size}]"
            )
        if torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export():
            raise ExportError(
                "a PackedSequence cannot be exported: give the padded batch and its `lengths` (both alignments "
                "export)"
            )
        layout = "packed"
        if resets is not None:
            if isinstance(resets, PackedSequence):
                _check_same_packing(resets, packed)
                resets = resets.data
            resets = _reset_flags(resets, (data.shape[0],), "[N] (one per row of input.data)")
        batch = int(batch_sizes[0]) if batch_sizes.numel() > 0 else 0
        self._check_device(data, weights)
        h0 = self._initial_states(hx, batch, data, False)
        spec = self._spec_for(data)
        in_device_memory = self._in_device_memory(data)
        precision = precision or _ops.float32_products(in_device_memory)
        batch_sizes_cpu = batch_sizes.to(device="cpu", dtype=torch.int64).contiguous()
        if sorted_indices is not None and in_device_memory:
            # As nn.LSTM does on a GPU: the states are put in the packing's
            # order on the device, so its permutations are never read on the host.
            identity = torch.arange(batch)
            index = [batch_sizes_cpu, identity, identity]
            h0 = [h.index_select(1, sorted_indices) for h in h0]
            masks = self._masks()
            rates = self._call_rates(masks)
            out, finals = _ops.run(spec, layout, data.contiguous(), index, h0, weights, masks, rates, resets, precision)
            finals = [f.index_select(1, unsorted_indices) for f in finals]
        else:
            if sorted_indices is None:
                sorted_indices = unsorted_indices = torch.arange(batch)
            index = [batch_sizes_cpu] + [
                t.to(device="cpu", dtype=torch.int64).contiguous() for t in (sorted_indices, unsorted_indices)
            ]
            masks = self._masks()
            rates = self._call_rates(masks)
            out, finals = _ops.run(spec, layout, data.contiguous(), index, h0, weights, masks, rates, resets, precision)
        return PackedSequence(out, batch_sizes, packed.sorted_indices, packed.unsorted_indices), self._states_out(finals)

    def dropout_masks(self, input: Tensor, masks: Tensor, *, lengths=None, align: str = "left") -> list[Tensor]:
        """The dropout masks a training-mode call on ``input`` multiplies each layer's output by
        (every layer's but the last), to rebuild the same computation elsewhere.

        A call draws its ``[seed, offset]`` with :func:`cellc.draw_masks` from PyTorch's default
        generator, so after ``torch.manual_seed(s)``, ``cellc.draw_masks()`` gives the masks of
        the next call made after the same seed.

        Args:
            input: the call's padded input, ``[B, T, input_size]`` or ``[T, B, input_size]``
                as the module's ``batch_first`` says (the masks depend on its shape, not its values).
            masks: the call's ``[seed, offset]``, an int64 tensor from :func:`cellc.draw_masks`.
            lengths: the call's ``lengths`` (``None``: every sequence runs all ``T`` steps).
            align: the call's ``align``, ``"left"`` or ``"right"``.

        Returns:
            A list with one float32 tensor per layer boundary (``num_layers - 1``), laid out as
            the call's output (``[B, T, features]`` or ``[T, B, features]``), each value 0
            (dropped) or ``1 / (1 - dropout)`` (kept), zeros at padding.
        """
        _check_mask_seed(masks, optional=False)
        spec, layout, x, index = self._masks_call(input, lengths, align)
        flat = _ops.dropout_masks(spec, layout, x, index, masks, self.dropout)
        return [torch.tensor(m).view(*x.shape[:-1], -1) for m in flat]

    def cell_masks(self, input: Tensor, masks: Tensor | None = None, *, lengths=None,
                   align: str = "left") -> dict[str, Tensor]:
        """The masks of the cell's own mask calls (``dropout``, ``variational_dropout``,
        ``zoneout``, ``dropconnect``) that a call on ``input`` uses, at ``module.rates``, to
        rebuild the same computation elsewhere.

        Args:
            input: the call's padded input, ``[B, T, input_size]`` or ``[T, B, input_size]``
                as the module's ``batch_first`` says (the masks depend on its shape, not its values).
            masks: the training-mode call's ``[seed, offset]`` (see :meth:`dropout_masks`);
                ``None``: an evaluation-mode call's (no mask drawn: zoneout's expectation).
            lengths: the call's ``lengths`` (``None``: every sequence runs all ``T`` steps).
            align: the call's ``align``, ``"left"`` or ``"right"``.

        Returns:
            A dict of float32 tensors by name, ``<function>#<mask>_l<layer>`` (with
            ``_reverse`` for the reverse direction): a mask a step reads laid out as the call's
            output (``[B, T, units]`` or ``[T, B, units]``, zeros at padding), a DropConnect
            mask shaped as its parameter. Each value is what its unit multiplies (the language
            reference says how each mask call draws it).
        """
        _check_mask_seed(masks, optional=True)
        spec, layout, x, index = self._masks_call(input, lengths, align)
        seen = _ops.cell_masks(spec, layout, x, index, masks, self._cell_rates())
        return {
            name: torch.tensor(values).view(shape if name.startswith("dropconnect#") else (*x.shape[:-1], -1))
            for name, shape, values in seen
        }

    def _masks_call(self, input: Tensor, lengths, align: str):
        """What the runtime reads to draw a call's masks on the host (the reference back end's
        model, which starts no threads): spec, layout, input and index, checked."""
        if input.dim() != 3:
            raise ShapeError(f"`input` has shape {list(input.shape)}: a batched [B, T, F] or [T, B, F] tensor")
        if align not in _ALIGNS:
            raise ValueError(f"align must be 'left' or 'right', not {align!r}")
        what = "one integer length per sequence"
        index = [] if lengths is None else [_integers("lengths", lengths, what).to(device="cpu", dtype=torch.int64).contiguous()]
        layout = ("batch_first/" if self.batch_first else "time_first/") + align
        spec = json.dumps({**json.loads(self.spec), "backend": "reference"}, sort_keys=True)
        return spec, layout, input.detach().to("cpu").contiguous(), index

    def _hold_models(self) -> None:
        """Keeps the compiled models of the module's specs alive while it is (native handles:
        never pickled, made again when a pickled module is loaded)."""
        self._handles = [_cellc.Handle(s) for s in (self.spec, self._cuda_spec) if s is not None]

    def _read_description(self) -> None:
        """What the module keeps of its device's description (made again when a pickled module
        is loaded): whether CPU tensors are its device memory, and the native fast path of its
        plain CPU inference calls (``_cellc.Eager``; never pickled): for a model whose device
        takes it (the description says: the CPU's) of a cell without rates, whose calls read
        nothing but their tensors."""
        info = _ops.describe(self.spec)
        # Whether its device's memory is the CPU tensors' (the emulated device's), kept for
        # `_in_device_memory`, which torch.compile traces.
        self._cpu_tensors_on_device = info["cpu_tensors"] == "device"
        fast = info["fast_path"] and not self._rate_defaults
        self._eager = _cellc.Eager(self.spec, self.batch_first) if fast else None

    def __getstate__(self) -> dict:
        """What pickling keeps (``torch.save(model)``, ``copy.deepcopy``): the module's
        attributes, its parameters among them, and no native handle, so that
        ``torch.load(..., weights_only=True)`` reads it (``cellc.RNN`` is among its safe
        globals once ``cellc`` is imported).

        Returns:
            The module's ``__dict__`` without the handles of its compiled models.
        """
        state = self.__dict__.copy()
        state.pop("_handles", None)
        state.pop("_eager", None)
        return state

    def __setstate__(self, state: dict) -> None:
        """Restores a pickled module and holds its compiled models again (compiled from its spec,
        which holds the cell's source, at its first call). A module pickled by an older cellc
        (its ``rates`` and ``dropout`` plain attributes, its handles pickled) loads too.

        Args:
            state: what :meth:`__getstate__` returned.
        """
        state = dict(state)
        state.pop("_handles", None)
        state.pop("_eager", None)
        if "rates" in state:  # pickled before rates and dropout were properties
            state["_rates"] = state.pop("rates")
        if "dropout" in state:
            state["_dropout"] = float(state.pop("dropout"))
        if "_rate_defaults" not in state:
            state["_rate_defaults"] = {name: default for name, default in _ops.describe(state["spec"])["rates"]}
        self.__dict__.update(state)
        self._hold_models()
        self._read_description()

    @property
    def rates(self) -> dict:
        """Every rate of the cell by name, in the cell's order: the probabilities of its
        ``dropout``, ``variational_dropout``, ``zoneout`` and ``dropconnect`` masks.

        It may be changed between calls, by item (``module.rates["zh"] = 0.1``) or as a whole:
        a dict assigned sets the rates it names, in any order, and the cell's defaults for the
        others. Each call reads them by name. Under ``torch.compile`` a changed rate recompiles
        the graph (the values reach the operators as a tensor the graph guards).

        Raises:
            TypeError: a value assigned that is not a dict.
            ValueError: a name the cell has no rate for, or a rate outside ``[0, 1)``.
        """
        return self._rates

    @rates.setter
    def rates(self, rates) -> None:
        """Sets the rates ``rates`` names (a dict of names to numbers in [0, 1), in any order),
        the cell's defaults for the others: a ``TypeError`` for anything but a dict, a
        ``ValueError`` naming a rate the cell does not have or a value out of range."""
        if not isinstance(rates, dict):
            raise TypeError(f"rates must be a dict of rate names to numbers in [0, 1) (e.g. {{'zh': 0.1}}), "
                            f"not {type(rates).__name__}")
        self._check_rate_names(rates)
        merged = {name: rates.get(name, default) for name, default in self._rate_defaults.items()}
        for name, rate in merged.items():
            _check_rate(f"rate {name!r}", rate)
        self._rates = merged

    @property
    def dropout(self) -> float:
        """The rate of dropout between layers (``nn.LSTM``'s ``dropout``): in training mode every
        layer's output but the last is dropped at this rate. It may be changed between calls, as
        ``nn.LSTM``'s: a training call uses its value then (under ``torch.compile``, a changed
        value recompiles the graph).

        Raises:
            ValueError: a value assigned outside ``[0, 1)``.
        """
        return self._dropout

    @dropout.setter
    def dropout(self, dropout) -> None:
        _check_rate("dropout", dropout)
        self._dropout = float(dropout)

    def _cell_rates(self) -> list[float]:
        """``module.rates`` by name, in the cell's order (whatever the dict's), checked."""
        out = []
        for name in self._rate_defaults:
            if name not in self._rates:
                raise ValueError(f"rates lacks {name!r}, a rate of cell `{self.cell}`: assign a dict to "
                                 "module.rates to reset the others to the cell's defaults")
            rate = self._rates[name]
            _check_rate(f"rate {name!r}", rate)
            out.append(float(rate))
        self._check_rate_names(self._rates)
        return out

    def _check_rate_names(self, rates: dict) -> None:
        """Every name of ``rates`` is a rate of the cell (a ``ValueError`` naming the first that
        is not, and the cell's rates)."""
        unknown = [name for name in rates if name not in self._rate_defaults]
        if unknown:
            known = ", ".join(repr(n) for n in self._rate_defaults) or "none"
            raise ValueError(f"rates has {unknown[0]!r}, which is not a rate of cell `{self.cell}` (its rates: {known})")

    def _call_rates(self, masks: Tensor | None) -> list[float] | None:
        """What a call's operators take as ``rates`` (``_ops.call_rates``): the dropout between
        layers and the cell's rates as they are now; ``None`` where neither matters (a call that
        draws no masks, of a cell without rates)."""
        if masks is None and not self._rate_defaults:
            return None
        _check_rate("dropout", self.dropout)
        return _ops.call_rates(float(self.dropout), self._cell_rates())

    def _draws_masks(self) -> bool:
        """Whether a call now draws masks: in training mode, where the cell has masks of its own
        or drops out between layers."""
        return self.training and (self._has_masks or (self._dropout > 0 and self.num_layers > 1))

    def _masks(self) -> Tensor | None:
        """The seed of this call's masks, where it draws them (:meth:`_draws_masks`)."""
        return _ops.draw_masks() if self._draws_masks() else None

    def _spec_for(self, x: Tensor) -> str:
        """The spec a call on ``x`` runs: the CUDA back end's for CUDA tensors when no back end was named."""
        if x.device.type == "cuda" and self._cuda_spec is not None:
            return self._cuda_spec
        return self.spec

    def _in_device_memory(self, x: Tensor) -> bool:
        """Whether a call on ``x`` runs over device memory (see ``_ops.in_device_memory``), from
        what the module keeps: traceable by ``torch.compile``."""
        return _ops.runs_in_device_memory(self._cpu_tensors_on_device, x)

    def _check_device(self, x: Tensor, weights: list[Tensor]) -> None:
        for name, w in zip(self._weight_names, weights):
            if w.device != x.device:
                raise DeviceError(f"`input` is on {x.device} but parameter `{name}` is on {w.device}")

    def _initial_states(self, hx, batch: int, x: Tensor, unbatched: bool) -> list[Tensor]:
        if hx is None:
            return []
        states = [hx] if isinstance(hx, Tensor) else list(hx)
        if len(states) != len(self.state_sizes):
            kind = "a tensor" if len(self.state_sizes) == 1 else f"a tuple of {len(self.state_sizes)} tensors"
            raise ShapeError(f"`hx` has {len(states)} states, expected {kind} ({', '.join(self.state_names)})")
        slots = self.num_layers * (2 if self.bidirectional else 1)
        out = []
        for name, size, h in zip(self.state_names, self.state_sizes, states):
            if not isinstance(h, Tensor):
                raise TypeError(f"initial state `{name}` must be a Tensor, not {type(h).__name__}")
            if unbatched and h.dim() == 2:
                h = h.unsqueeze(1)
            if tuple(h.shape) != (slots, batch, size):
                raise ShapeError(
                    f"initial state `{name}` has shape {list(h.shape)}, expected "
                    f"[num_layers * directions, B, {size}] = [{slots}, {batch}, {size}]"
                )
            if h.device != x.device:
                raise DeviceError(f"initial state `{name}` is on {h.device} but `input` is on {x.device}")
            out.append(h.contiguous())
        return out

    def _states_out(self, finals: list[Tensor]):
        return finals[0] if len(finals) == 1 else tuple(finals)
