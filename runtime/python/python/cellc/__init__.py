"""cellc for PyTorch: any ``.cell`` recurrent cell as a fused, autograd-ready ``nn.Module``.

>>> import torch, cellc
>>> rnn = cellc.RNN("lstm", input_size=8, sizes={"H": 16}, batch_first=True)
>>> out, (h, c) = rnn(torch.randn(3, 5, 8), lengths=[5, 2, 4])
"""

from . import errors
from ._cellc import __version__, shipped_cells
from .errors import (
    BackendError,
    CellcError,
    CellCompileError,
    DeviceError,
    DTypeError,
    InternalError,
    LengthError,
    RateError,
    ShapeError,
    TooLargeError,
)
from ._ops import draw_masks, set_threading, threading
from .rnn import RNN

__all__ = [
    "__version__",
    "RNN",
    "draw_masks",
    "errors",
    "shipped_cells",
    "set_threading",
    "threading",
    "BackendError",
    "CellcError",
    "CellCompileError",
    "DeviceError",
    "DTypeError",
    "InternalError",
    "LengthError",
    "RateError",
    "ShapeError",
    "TooLargeError",
]
