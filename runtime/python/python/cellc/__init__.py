"""cellc for PyTorch: any ``.cell`` recurrent cell as a fused, autograd-ready ``nn.Module``.

:class:`RNN` is the module (``nn.LSTM``'s conventions, any cell); :func:`shipped_cells` names
the cells that come with the package; :func:`set_threading` and :func:`threading` choose and
show the threads of its CPU work; :func:`draw_masks` gives the seed of a training call's masks;
:func:`aoti_library` and :func:`onnx_library` name the libraries that run exported models
(AOTInductor packages, ONNX Runtime sessions); :mod:`cellc.errors` holds the exceptions, each
also a ``ValueError``, ``TypeError``, ``RuntimeError`` or ``MemoryError`` as PyTorch would
raise for the same mistake. The package
links no libtorch: its operators are ``torch.library`` custom operators
(``torch.ops.cellc.rnn_forward`` and ``rnn_backward``, and ``cellc_rnn`` in exported models).

Example:
    >>> import torch, cellc
    >>> rnn = cellc.RNN("lstm", input_size=8, sizes={"H": 16}, batch_first=True)
    >>> out, (h, c) = rnn(torch.randn(3, 5, 8), lengths=[5, 2, 4])
    >>> out.shape, h.shape, c.shape
    (torch.Size([3, 5, 16]), torch.Size([1, 3, 16]), torch.Size([1, 3, 16]))

Attributes:
    __version__: cellc's version, ``"major.minor.patch"``: the package's and its Rust crates' alike.
"""

import torch as _torch

from . import errors
from ._cellc import __version__, shipped_cells
from .errors import (
    BackendError,
    CellcError,
    CellCompileError,
    DeviceError,
    DTypeError,
    ExportError,
    InternalError,
    LengthError,
    RateError,
    ShapeError,
    TooLargeError,
)
from ._ops import aoti_library, draw_masks, onnx_library, set_threading, threading
from .rnn import RNN

# A whole model saved with torch.save(model) loads with torch.load's default weights_only=True,
# as a module of torch.nn's own does once its class is allowed: cellc.RNN pickles only plain data
# and tensors (see RNN.__getstate__).
_torch.serialization.add_safe_globals([RNN])

__all__ = [
    "__version__",
    "RNN",
    "aoti_library",
    "draw_masks",
    "onnx_library",
    "errors",
    "shipped_cells",
    "set_threading",
    "threading",
    "BackendError",
    "CellcError",
    "CellCompileError",
    "DeviceError",
    "DTypeError",
    "ExportError",
    "InternalError",
    "LengthError",
    "RateError",
    "ShapeError",
    "TooLargeError",
]
