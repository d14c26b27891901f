"""Making tensors eagerly: ``empty``, ``zeros``, ``from_numpy``, and other
frameworks' memory without a copy (``from_dlpack``, ``as_tensor``).  The lazy
ops that allocate (``api.zeros`` ...) live in deviceop.api."""
from __future__ import annotations

from .errors import DTypeError
from .tensor import Tensor


def empty(shape, dtype="float32", *, device=None, stream=None) -> Tensor:
    return Tensor.empty(shape, dtype, device=device, stream=stream)


def zeros(shape, dtype="float32", *, device=None, stream=None) -> Tensor:
    """A tensor of zeros, allocated and filled in order on ``stream`` (default: the device's)."""
    t = Tensor.empty(shape, dtype, device=device, stream=stream)
    (stream if stream is not None else t.device.default_stream()).fill(t._array, 0)
    return t


def from_numpy(array, *, device=None, stream=None, dtype=None) -> Tensor:
    return Tensor.from_numpy(array, device=device, stream=stream, dtype=dtype)


def from_dlpack(obj, *, device=None, stream=None) -> Tensor:
    return Tensor.from_dlpack(obj, device=device, stream=stream)


def as_tensor(obj, *, device=None) -> Tensor:
    """``obj`` as a Tensor without copying: a Tensor, a DLPack producer or a
    ``__cuda_array_interface__`` exporter.  Host arrays need ``from_numpy``
    (``from_dlpack`` says so for a NumPy array, as here)."""
    if isinstance(obj, Tensor):
        return obj
    if hasattr(obj, "__dlpack__"):
        return Tensor.from_dlpack(obj, device=device)
    if hasattr(obj, "__cuda_array_interface__"):
        return Tensor.from_cuda_array_interface(obj, device=device)
    raise DTypeError(f"cannot view a {type(obj).__name__} as a tensor: it has neither __dlpack__ "
                     "nor __cuda_array_interface__; copy host data with dop.from_numpy(array)")
