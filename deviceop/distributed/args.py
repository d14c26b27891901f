"""The tensors behind a collective's arguments (ops.py and the one-shot all-reduce in
peer.py take the same kinds): what it reads, and what it may write."""
from __future__ import annotations

import operator

from ..errors import DistributedError, DTypeError
from ..memory import Partition, read_only_error
from ..tensor import SharedTensor, Tensor


def tensor_arg(x, what: str) -> Tensor:
    """The tensor behind ``x``: a Tensor, a SharedTensor, or a Partition (a claim to write:
    ``handle.try_partition``, a launch's ``.first()``)."""
    if isinstance(x, SharedTensor):
        return x.tensor
    if isinstance(x, Tensor):
        return x
    if isinstance(x, Partition):
        return x.tensor
    raise DTypeError(f"{what} must be a deviceop Tensor or SharedTensor, got {type(x).__name__}"
                     + ("; copy a host array to the device with dop.from_numpy(array)"
                        if hasattr(x, "__array_interface__") else ""))


def written_arg(x, what: str) -> Tensor:
    """The tensor a collective writes: a SharedTensor only when nothing else reaches it,
    never memory imported read-only."""
    t = x.check_writable(what) if isinstance(x, SharedTensor) else tensor_arg(x, what)
    if t._alloc.read_only:
        raise read_only_error(what, t)
    return t


def check_device(t: Tensor, group, what: str) -> None:
    """Refuse a tensor of another device than the group's: a rank's collectives move its own
    GPU's memory (NCCL given another GPU's pointer faults or reads the wrong memory; each
    thread-rank of the reference backend has a device of its own, as each process its GPU)."""
    if t.device is not group.device:
        raise DistributedError(f"{what} lives on {t.device.label}, but the group's device is {group.device.label}: "
                               "allocate it on the rank's device (dop.empty(..., stream=group.stream), "
                               "dop.from_numpy(array, stream=group.stream))")


def plain_int(value) -> int | None:
    """``value`` as a Python int (NumPy's integers too), or None for anything else (bools, floats, strings)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
