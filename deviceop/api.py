"""Value ops: allocation (zeros, ones, full, rand, randn, arange, dup,
from_numpy, empty) and memcpy.

Allocation ops are *not* graph-safe: a graph bakes in addresses, and an
allocation captured into one would hand out a different buffer, or free the
one the graph still writes.  ``CudaGraph.scope`` refuses them by name and any
capture rejects them when they run.  ``memcpy`` is graph-safe: it copies
between buffers that exist before the capture.

Random data is drawn on the host with NumPy's seeded generator and uploaded,
so a seed gives the same numbers on the GPU and on the reference device.
"""
from __future__ import annotations

import numpy as np

from .dtypes import dtype as as_dtype
from .errors import AliasingError, DTypeError, GraphSafetyError, ShapeError
from .op import DeviceOp, resolve, stats, warn_if_unexecuted
from .memory import read_only_error
from .tensor import SharedTensor, Tensor, _shape_tuple


ALLOCATES = ("it allocates (a replay would reuse or free an address the graph baked in). Allocate before "
             "capturing and pass the buffer in; only kernel launches, api.memcpy, loops and values are graph-safe")


class AllocOp(DeviceOp):
    """An op that allocates a new tensor."""

    __slots__ = ("shape", "dtype", "make", "name")
    graph_safe = False
    unsafe_reason = ALLOCATES

    def __init__(self, name: str, shape, dtype, make):
        super().__init__()
        self.name, self.shape, self.dtype, self.make = name, _shape_tuple(shape), as_dtype(dtype), make

    def describe(self) -> str:
        return f"api.{self.name}({list(self.shape)}, {self.dtype.name})"

    def _execute(self, ctx):
        if ctx.capture is not None:
            raise GraphSafetyError(f"{self.describe()} allocates, which a graph cannot replay safely (its address "
                                   "would change or be freed); allocate before capturing and pass the buffer in")
        t = Tensor.empty(self.shape, self.dtype, device=ctx.device, stream=ctx.stream)
        self.make(t, ctx)
        stats["allocations"] += 1
        return t


def _fill(value):
    def make(t, ctx):
        ctx.stream.fill(t._array, value)
    return make


def _upload(host_fn):
    def make(t, ctx):
        ctx.stream.upload(t._array, np.ascontiguousarray(host_fn(t), dtype=t.dtype.np))
    return make


def empty(shape, dtype="float32") -> DeviceOp:
    return AllocOp("empty", shape, dtype, lambda t, ctx: None)


def zeros(shape, dtype="float32") -> DeviceOp:
    return AllocOp("zeros", shape, dtype, _fill(0))


def ones(shape, dtype="float32") -> DeviceOp:
    return AllocOp("ones", shape, dtype, _fill(1))


def full(shape, fill_value, dtype="float32") -> DeviceOp:
    as_dtype(dtype).coerce(fill_value)  # a bad value fails now, not at execution
    return AllocOp("full", shape, dtype, _fill(fill_value))


def rand(shape, dtype="float32", seed=None) -> DeviceOp:
    """Uniform in [0, 1); ``seed`` makes it repeatable (same numbers on every device)."""
    dt = as_dtype(dtype)
    if not dt.is_floating:
        raise DTypeError(f"rand makes floating-point tensors, not {dt.name}")
    return AllocOp("rand", shape, dt, _upload(lambda t: np.random.default_rng(seed).random(t.shape)))


def randn(shape, dtype="float32", seed=None) -> DeviceOp:
    """Standard normal; ``seed`` makes it repeatable."""
    dt = as_dtype(dtype)
    if not dt.is_floating:
        raise DTypeError(f"randn makes floating-point tensors, not {dt.name}")
    return AllocOp("randn", shape, dt, _upload(lambda t: np.random.default_rng(seed).standard_normal(t.shape)))


def arange(n: int, dtype="int32") -> DeviceOp:
    return AllocOp("arange", (n,), dtype, _upload(lambda t: np.arange(t.shape[0])))


def from_numpy(array, dtype=None) -> DeviceOp:
    """A new tensor holding a copy of the host ``array``."""
    host = np.asarray(array)
    dt = as_dtype(dtype if dtype is not None else host.dtype)
    return AllocOp("from_numpy", host.shape, dt, _upload(lambda t: host))


class Dup(DeviceOp):
    """A new tensor holding a copy of another."""

    __slots__ = ("src",)
    graph_safe = False
    unsafe_reason = ALLOCATES
    op_name = "api.dup"

    def __init__(self, src):
        super().__init__()
        self.src = src

    def children(self):
        return (self.src,) if isinstance(self.src, DeviceOp) else ()

    def _execute(self, ctx):
        if ctx.capture is not None:
            raise GraphSafetyError("api.dup allocates, which a graph cannot replay safely; "
                                   "allocate the copy's buffer before capturing and use api.memcpy")
        src = _tensor_of(resolve(self.src, ctx), "dup source")
        dst = Tensor.empty(src.shape, src.dtype, device=ctx.device, stream=ctx.stream)
        _copy(dst, src, ctx)
        stats["allocations"] += 1
        return dst


def dup(src) -> DeviceOp:
    return Dup(src)


class Memcpy(DeviceOp):
    """Copy ``src`` into the existing buffer ``dst`` on the stream (graph-safe)."""

    __slots__ = ("dst", "src")
    graph_safe = True
    op_name = "api.memcpy"

    def __init__(self, dst, src):
        super().__init__()
        self.dst, self.src = dst, src
        if not isinstance(dst, DeviceOp) and not isinstance(src, DeviceOp):
            _check_copy(_destination(dst), _tensor_of(src, "memcpy source"))
        for x in (dst, src):
            if isinstance(x, DeviceOp):
                x._armed = False  # run by this copy
        self._armed = True

    __del__ = warn_if_unexecuted

    def children(self):
        return tuple(x for x in (self.dst, self.src) if isinstance(x, DeviceOp))

    def writes(self) -> tuple:
        """The tensor this copy writes, if it is known before it runs."""
        dst = self.dst
        return (dst._tensor,) if isinstance(dst, SharedTensor) else (dst,) if isinstance(dst, Tensor) else ()

    def _execute(self, ctx):
        dst = _destination(resolve(self.dst, ctx))  # checked again: clones may have been made since
        src = _tensor_of(resolve(self.src, ctx), "memcpy source")
        _check_copy(dst, src)
        _copy(dst, src, ctx)
        return dst


def memcpy(dst, src) -> DeviceOp:
    """Copy ``src`` into ``dst`` (same dtype and element count, both contiguous)."""
    return Memcpy(dst, src)


def _destination(x) -> Tensor:
    """The tensor memcpy writes: a SharedTensor only when nothing else can reach
    its buffer (a handle is read-only while shared, as an Arc is)."""
    if isinstance(x, SharedTensor):
        return x.check_writable("api.memcpy into a SharedTensor")
    t = _tensor_of(x, "memcpy destination")
    if t._alloc.read_only:
        raise read_only_error("api.memcpy into it", t)
    return t


def _tensor_of(x, what: str) -> Tensor:
    if isinstance(x, SharedTensor):
        return x.tensor
    if isinstance(x, Tensor):
        return x
    hint = "; copy a host array to the device first with dop.from_numpy(array)" \
        if hasattr(x, "__array_interface__") else ""
    raise DTypeError(f"{what} must be a Tensor, got {type(x).__name__}{hint}")


def _check_copy(dst: Tensor, src: Tensor) -> None:
    if dst.dtype is not src.dtype:
        raise DTypeError(f"memcpy from a {src.dtype.name} tensor into a {dst.dtype.name} tensor; dtypes must match")
    if dst.size != src.size:
        raise ShapeError(f"memcpy from {src.shape} ({src.size} elements) into {dst.shape} ({dst.size} elements)")
    if not (dst.is_contiguous and src.is_contiguous):
        raise ShapeError("memcpy needs contiguous tensors on both sides")
    if dst.data_ptr != src.data_ptr and dst.overlaps(src):
        raise AliasingError("memcpy between overlapping buffers; copy through a separate buffer")


def _copy(dst: Tensor, src: Tensor, ctx) -> None:
    if ctx.guard is not None:  # inside a loop's body: not into the loop's index or count
        ctx.guard.check(dst, "api.memcpy")
    if dst.data_ptr == src.data_ptr or dst.size == 0:
        return
    ctx.stream.memcpy(dst.data_ptr, src.data_ptr, dst.nbytes)  # a capturing stream records it
    if ctx.capture is not None:
        ctx.capture.keep.append((dst, src))  # the graph copies between these buffers at every replay
    stats["copies"] += 1
