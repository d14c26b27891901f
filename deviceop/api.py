"""Value ops: allocation (zeros, ones, full, rand, randn, arange, dup,
from_numpy, empty), memcpy and fill.

Allocation ops are *not* graph-safe: a graph bakes in addresses, and an
allocation captured into one would hand out a different buffer, or free the
one the graph still writes.  ``CudaGraph.scope`` refuses them by name and any
capture rejects them when they run.  ``memcpy`` and ``fill`` are graph-safe: they copy into or set buffers that
exist before the capture (a MEMCPY or MEMSET node, which
``graph.node(op)`` can point at other buffers between replays).

Random data is drawn on the host with NumPy's seeded generator and uploaded,
so a seed gives the same numbers on the GPU and on the reference device.
"""
from __future__ import annotations

import operator

import numpy as np

from .dtypes import dtype as as_dtype, host_array
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
        ctx.stream.upload(t._array, t.dtype.from_host(host_fn(t)))
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


def _check_seed(name: str, seed) -> None:
    """A seed NumPy's generator refuses fails as the op is built, not in the middle of running it."""
    try:
        np.random.default_rng(seed)
    except (TypeError, ValueError) as exc:
        raise DTypeError(f"api.{name}(seed={seed!r}): {exc}; a seed is None, an int >= 0, a sequence of them, "
                         "or a NumPy Generator") from None


def rand(shape, dtype="float32", seed=None) -> DeviceOp:
    """Uniform in [0, 1); ``seed`` makes it repeatable (same numbers on every device)."""
    _check_seed("rand", seed)
    dt = as_dtype(dtype)
    if not dt.is_floating:
        raise DTypeError(f"rand makes floating-point tensors, not {dt.name}")
    return AllocOp("rand", shape, dt, _upload(lambda t: np.random.default_rng(seed).random(t.shape)))


def randn(shape, dtype="float32", seed=None) -> DeviceOp:
    """Standard normal; ``seed`` makes it repeatable."""
    _check_seed("randn", seed)
    dt = as_dtype(dtype)
    if not dt.is_floating:
        raise DTypeError(f"randn makes floating-point tensors, not {dt.name}")
    return AllocOp("randn", shape, dt, _upload(lambda t: np.random.default_rng(seed).standard_normal(t.shape)))


def arange(n: int, dtype="int32") -> DeviceOp:
    try:
        n = operator.index(n)
    except TypeError:
        raise ShapeError(f"api.arange(n): n is the length, an int; got {n!r}") from None
    if n > 0:
        as_dtype(dtype).coerce(n - 1)  # the last value must fit, now rather than at execution
    return AllocOp("arange", (n,), dtype, _upload(lambda t: np.arange(t.shape[0])))


def from_numpy(array, dtype=None) -> DeviceOp:
    """A new tensor holding a copy of the host ``array``."""
    array = host_array(array, "api.from_numpy")
    dt = as_dtype(dtype if dtype is not None else array.dtype)
    host = dt.from_host(array)  # converted and checked now, as full checks its value
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
        stats["allocations"] += 1
        if not src.is_contiguous:  # a strided view: a byte copy from its first element would read other memory
            stats["copies"] += 1
            return Tensor._wrap(ctx.device.contiguous(src._array, ctx.stream), ctx.device, src.dtype, ctx.stream)
        dst = Tensor.empty(src.shape, src.dtype, device=ctx.device, stream=ctx.stream)
        _copy(dst, src, ctx)
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
        _copy(dst, src, ctx, self)
        return dst


def memcpy(dst, src) -> DeviceOp:
    """Copy ``src`` into ``dst`` (same dtype and element count, both contiguous)."""
    return Memcpy(dst, src)


def _destination(x, op: str = "api.memcpy") -> Tensor:
    """The tensor ``op`` (memcpy, fill) writes: a SharedTensor only when nothing else can
    reach its buffer (a handle is read-only while shared, as an Arc is)."""
    if isinstance(x, SharedTensor):
        return x.check_writable(f"{op} into a SharedTensor")
    t = _tensor_of(x, f"{op.removeprefix('api.')} destination")
    if t._alloc.read_only:
        raise read_only_error(f"{op} into it", t)
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
        raise DTypeError(f"memcpy from a {src.dtype.name} tensor into a {dst.dtype.name} tensor; dtypes must match "
                         "(memcpy copies bytes, it does not convert): make the two buffers one dtype")
    if dst.size != src.size:
        raise ShapeError(f"memcpy from {src.shape} ({src.size} elements) into {dst.shape} ({dst.size} elements); "
                         "copy between buffers of the same element count (a slice or view of the larger)")
    if not (dst.is_contiguous and src.is_contiguous):
        raise ShapeError(f"memcpy needs contiguous tensors on both sides, got strides {src.strides} -> {dst.strides}; "
                         "copy a strided source's .contiguous() copy, and write into a dense buffer")
    if dst.data_ptr != src.data_ptr and dst.overlaps(src):
        raise AliasingError("memcpy between overlapping buffers; copy through a separate buffer")


def _copy(dst: Tensor, src: Tensor, ctx, op=None) -> None:
    if ctx.guard is not None:  # inside a loop's body: not into the loop's index or count
        ctx.guard.check(dst, "api.memcpy")
    if dst.data_ptr == src.data_ptr or dst.size == 0:
        return
    if ctx.capture is not None:  # a MEMCPY node, which keeps both buffers; graph.node(op) can update it
        ctx.capture.record_copy(ctx.stream, op, dst, src)
    else:
        ctx.stream.memcpy(dst.data_ptr, src.data_ptr, dst.nbytes)
    stats["copies"] += 1


class Fill(DeviceOp):
    """Set every element of the existing buffer ``dst`` to ``value`` (graph-safe)."""

    __slots__ = ("dst", "value")
    graph_safe = True
    op_name = "api.fill"

    def __init__(self, dst, value):
        super().__init__()
        self.dst, self.value = dst, value
        if isinstance(dst, DeviceOp):
            dst._armed = False  # run by this fill
        else:
            fill_pattern(_destination(dst, "api.fill"), value)  # a bad value or buffer fails now, not at execution
        self._armed = True

    __del__ = warn_if_unexecuted

    def children(self):
        return (self.dst,) if isinstance(self.dst, DeviceOp) else ()

    def _execute(self, ctx):
        dst = _destination(resolve(self.dst, ctx), "api.fill")
        bits, size, count = fill_pattern(dst, self.value)
        if count == 0:
            return dst
        if ctx.capture is not None:  # a MEMSET node; graph.node(op) can update it
            ctx.capture.record_fill(ctx.stream, self, dst, self.value, bits, size, count)
        else:
            memset(ctx.stream, dst.data_ptr, bits, size, count)
        return dst


def fill(dst, value) -> DeviceOp:
    """Set every element of the existing tensor ``dst`` to ``value`` (a memset on
    the stream; captured, a MEMSET node): the graph-safe form of ``api.full``."""
    return Fill(dst, value)


def fill_pattern(dst: Tensor, value) -> tuple[int, int, int]:
    """``(bits, element size, count)``: the memset that sets every element of ``dst``
    to ``value``.  CUDA sets 1-, 2- or 4-byte elements; an 8-byte value is two
    4-byte halves, which must then be equal (0, -1 ...)."""
    dt = dst.dtype
    if not dst.is_contiguous:
        raise ShapeError(f"api.fill needs a contiguous tensor, got shape {list(dst.shape)} with strides "
                         f"{list(dst.strides)}; fill the tensor it is a view of, or a contiguous copy")
    coerced = dt.coerce(value)  # a DTypeError names a value the type cannot hold
    if dt.name == "bfloat16":
        bits = coerced  # (coerce gives a bfloat16's bits)
    else:
        bits = int(np.array([coerced], dtype=dt.np).view(np.dtype(f"u{dt.itemsize}"))[0])
    if dt.itemsize <= 4:
        return bits, dt.itemsize, dst.size
    low, high = bits & 0xFFFFFFFF, bits >> 32
    if low != high:
        raise DTypeError(f"api.fill({value!r}) of a {dt.name} tensor: CUDA's memset writes 1-, 2- or 4-byte "
                         f"patterns, and the 8 bytes of {value!r} are not one 4-byte pattern repeated; fill it "
                         "with a kernel, or copy from a tensor made with api.full")
    return low, 4, 2 * dst.size


def memset(stream, dst: int, bits: int, size: int, count: int) -> None:
    """``count`` elements of ``size`` bytes at ``dst`` set to ``bits``, ordered on ``stream``."""
    if size == 1:
        stream.memset8(dst, bits, count)
    elif size == 2:
        stream.memset16(dst, bits, count)
    else:
        stream.memset32(dst, bits, count)
