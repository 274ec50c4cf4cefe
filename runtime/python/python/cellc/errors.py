"""The exceptions cellc raises. Each names the tensor and the shapes at fault.

Every class derives from :class:`CellcError` and from the built-in exception a
PyTorch user would catch for the same mistake (``ValueError`` for a wrong
shape, ``TypeError`` for a wrong dtype, ...).
"""


class CellcError(Exception):
    """Base class of every cellc error."""


class CellCompileError(CellcError, ValueError):
    """The ``.cell`` source does not compile; the message shows the diagnostics with source spans."""


class ShapeError(CellcError, ValueError):
    """A tensor has the wrong shape, or sizes do not fit together."""


class LengthError(CellcError, ValueError):
    """A sequence length (or a packed sequence's batch sizes or permutation) is invalid."""


class RateError(CellcError, ValueError):
    """A dropout rate is outside [0, 1), or a training call lacks what its masks are drawn from."""


class DTypeError(CellcError, TypeError):
    """A tensor has a dtype cellc does not take here: float32 (and bf16/fp16, cast around it) is
    computed by the back ends, float64 (for checking) on the CPU by the interpreter."""


class DeviceError(CellcError, RuntimeError):
    """Tensors are on a device the module's back end does not run on, or on different devices."""


class TooLargeError(CellcError, MemoryError):
    """A pass needs more memory than the machine has; refused before anything is allocated."""


class BackendError(CellcError, RuntimeError):
    """The back end cannot run here (no CUDA driver, for example)."""


class ExportError(CellcError, ValueError):
    """A call that an exported model (``torch.export``, AOTInductor, ONNX) cannot carry, named at
    export time: a training-mode call that draws masks, per-step resets, a packed batch,
    half-precision products; for ONNX Runtime, whose node runs on the CPU, CUDA tensors and TF32
    products too."""


class InternalError(CellcError, RuntimeError):
    """A bug in cellc: please report it."""
