"""Tensors: typed, strided views of device memory, and partitions of them.

Memory.  A Tensor on a GPU is backed by a CuPy array allocated from CuPy's
memory pool; on the reference device, by a NumPy array.  Why CuPy rather than
raw ``cuda.core`` buffers: the pool makes allocation nearly free after
warm-up and orders reuse by stream; CuPy already implements DLPack and
``__cuda_array_interface__`` in both directions (bfloat16 included, through
ml_dtypes), fills, random numbers and strided copies — all things we would
otherwise write by hand.  deviceop adds what CuPy lacks: dtypes tied to CUDA
C++ types, partitions, ownership and launch-ready pointers.

Tensors never copy behind your back: ``view``/``reshape`` refuse a layout
they cannot express without a copy, ``numpy()``/``from_numpy`` are the
explicit transfers.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from .dtypes import DType, dtype as as_dtype
from .errors import DTypeError, OutOfMemoryError, ShapeError, StateError


def _shape_tuple(shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise ShapeError(f"a shape is a sequence of ints, got {shape!r}") from None
    return dims


def _resolve_shape(shape, size: int, what: str) -> tuple[int, ...]:
    """``shape`` with at most one ``-1`` filled in so that it holds ``size`` elements."""
    dims = _shape_tuple(shape)
    if sum(d == -1 for d in dims) > 1 or any(d < -1 for d in dims):
        raise ShapeError(f"{what}: shape {dims} may hold one -1 and otherwise non-negative sizes")
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        if known == 0 or size % known:
            raise ShapeError(f"{what}: cannot infer the -1 in {dims} for {size} elements")
        dims = tuple(size // known if d == -1 else d for d in dims)
    if math.prod(dims) != size:
        raise ShapeError(f"{what}: shape {dims} holds {math.prod(dims)} elements but the tensor has {size}")
    return dims


class Tensor:
    """A typed, strided view of device memory (host memory on the reference device)."""

    __slots__ = ("_array", "device", "dtype", "_ptr", "_home_stream", "__weakref__", "_owner")

    def __init__(self, *args, **kwargs):
        raise TypeError("create tensors with dop.empty/zeros/from_numpy/from_dlpack or the api ops")

    @classmethod
    def _wrap(cls, array, device, dtype: DType | None = None, home_stream=None) -> "Tensor":
        t = object.__new__(cls)
        t._array = array
        t.device = device
        t.dtype = dtype if dtype is not None else as_dtype(array.dtype)
        t._ptr = int(array.data.ptr) if not device.is_reference else int(array.__array_interface__["data"][0])
        t._home_stream = home_stream
        t._owner = None
        return t

    # -- creation ------------------------------------------------------------
    @classmethod
    def empty(cls, shape, dtype="float32", *, device=None, stream=None) -> "Tensor":
        """An uninitialised tensor.  Allocation is ordered on ``stream``
        (default: the device's default stream)."""
        from .runtime.device import Device
        device = device if device is not None else Device(0)
        dt = as_dtype(dtype)
        dims = _shape_tuple(shape)
        if any(d < 0 for d in dims):
            raise ShapeError(f"negative size in shape {dims}")
        if device.is_reference:
            try:
                return cls._wrap(np.empty(dims, dtype=dt.np), device, dt)
            except (MemoryError, ValueError) as exc:
                raise OutOfMemoryError(f"allocating a {dt.name} tensor of shape {dims} on the reference device",
                                       2, "CUDA_ERROR_OUT_OF_MEMORY", str(exc), "allocate less") from None
        stream = stream if stream is not None else device.default_stream()
        import cupy
        nbytes = math.prod(dims) * dt.itemsize
        try:
            with cupy.cuda.Device(device.ordinal), stream.cupy:
                array = cupy.empty(dims, dtype=dt.np)
        except cupy.cuda.memory.OutOfMemoryError as exc:
            free, total = device.memory_info()
            raise OutOfMemoryError(f"allocating {nbytes} bytes for a {dt.name} tensor of shape {dims}", 2,
                                   "CUDA_ERROR_OUT_OF_MEMORY",
                                   f"{free / 2**20:.0f} MiB of {total / 2**20:.0f} MiB free ({exc})",
                                   "Free tensors or graphs you no longer need, or allocate less") from None
        return cls._wrap(array, device, dt, stream)

    @classmethod
    def from_numpy(cls, array, *, device=None, stream=None, dtype=None) -> "Tensor":
        """A new tensor holding a copy of the host ``array``."""
        from .runtime.device import Device
        device = device if device is not None else Device(0)
        host = np.asarray(array)
        dt = as_dtype(dtype if dtype is not None else host.dtype)
        host = np.ascontiguousarray(host, dtype=dt.np)
        if device.is_reference:
            return cls._wrap(host.copy(), device, dt)
        t = cls.empty(host.shape, dt, device=device, stream=stream)
        t._array.set(host, stream=(stream or device.default_stream()).cupy)
        return t

    @classmethod
    def from_dlpack(cls, obj, *, device=None) -> "Tensor":
        """A zero-copy tensor over ``obj``'s memory (torch, CuPy, JAX ... anything with ``__dlpack__``)."""
        from .runtime.device import Device
        device = device if device is not None else Device(0)
        if isinstance(obj, Tensor):
            return obj
        if device.is_reference:
            return cls._wrap(np.from_dlpack(obj), device)
        import cupy
        kind = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else None
        if kind is not None and int(kind) not in (2, 13):  # kDLCUDA, kDLCUDAManaged
            raise StateError(f"{type(obj).__name__} lives in host memory (DLPack device type {int(kind)}); "
                             "zero-copy import needs device memory: copy it with dop.from_numpy(...)")
        with cupy.cuda.Device(device.ordinal):
            array = cupy.from_dlpack(obj)
        return cls._wrap(array, device)

    @classmethod
    def from_cuda_array_interface(cls, obj, *, device=None) -> "Tensor":
        """A zero-copy tensor over an object exposing ``__cuda_array_interface__``."""
        from .runtime.device import Device
        device = device if device is not None else Device(0)
        if device.is_reference:
            raise StateError("__cuda_array_interface__ describes GPU memory; the reference device has none")
        import cupy
        with cupy.cuda.Device(device.ordinal):
            array = cupy.asarray(obj)  # CuPy wraps CAI memory without copying
        return cls._wrap(array, device)

    # -- metadata ------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._array.shape

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements (not bytes)."""
        item = self.dtype.itemsize
        return tuple(s // item for s in self._array.strides)

    @property
    def ndim(self) -> int:
        return self._array.ndim

    @property
    def size(self) -> int:
        return self._array.size

    @property
    def nbytes(self) -> int:
        return self._array.size * self.dtype.itemsize

    @property
    def data_ptr(self) -> int:
        """The device address of the first element."""
        return self._ptr

    @property
    def is_contiguous(self) -> bool:
        return bool(self._array.flags.c_contiguous)

    def memory_range(self) -> tuple[int, int]:
        """``[lo, hi)`` byte addresses this view can touch (for overlap checks)."""
        item = self.dtype.itemsize
        if self.size == 0:
            return (self._ptr, self._ptr)
        lo = hi = 0
        for n, s in zip(self._array.shape, self._array.strides):
            if s >= 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        return (self._ptr + lo, self._ptr + hi + item)

    def overlaps(self, other: "Tensor") -> bool:
        a0, a1 = self.memory_range()
        b0, b1 = other.memory_range()
        return a0 < b1 and b0 < a1

    # -- views ---------------------------------------------------------------
    def view(self, *shape) -> "Tensor":
        """The same memory seen with another shape (no copy; one dim may be -1)."""
        shape = shape[0] if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)) else shape
        dims = _resolve_shape(shape, self.size, f"view of {self.dtype.name} tensor {self.shape}")
        if not self.is_contiguous:
            raise ShapeError(f"cannot view the non-contiguous tensor {self.shape} (strides {self.strides}) "
                             f"as {dims} without a copy; make a contiguous copy first")
        return self._derive(self._array.reshape(dims))

    reshape = view

    def __getitem__(self, key) -> "Tensor":
        """Basic slicing (ints, slices, ``...``) returns a view; no copying index forms."""
        items = key if isinstance(key, tuple) else (key,)
        for k in items:
            if not isinstance(k, (int, np.integer, slice)) and k is not Ellipsis and k is not None:
                raise ShapeError(f"only basic indexing (ints, slices, ...) makes views; got {type(k).__name__}")
        return self._derive(self._array[key])

    def _derive(self, array) -> "Tensor":
        t = Tensor._wrap(array, self.device, self.dtype, self._home_stream)
        t._owner = self._owner
        return t

    def partition(self, tile_shape) -> "Partition":
        return Partition(self, tile_shape)

    # -- transfers and interop -----------------------------------------------
    def numpy(self, *, stream=None) -> np.ndarray:
        """A host copy.  With ``stream`` the copy is ordered after that stream's
        work; without, the whole device is synchronized first."""
        if self.device.is_reference:
            return self._array.copy()
        if stream is None:
            self.device.synchronize()
            stream = self._home_stream or self.device.default_stream()
        out = self._array.get(stream=stream.cupy)
        stream.synchronize()
        return out

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.device.is_reference:
            raise AttributeError("a reference-device tensor lives in host memory; use .numpy()")
        return self._array.__cuda_array_interface__

    def __dlpack__(self, *args, **kwargs):
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    def to_cupy(self):
        """The CuPy array over the same memory (GPU only)."""
        if self.device.is_reference:
            raise StateError("the reference device has no CuPy arrays; use .numpy()")
        return self._array

    def __repr__(self) -> str:
        where = "reference" if self.device.is_reference else f"cuda:{self.device.ordinal}"
        return f"Tensor(shape={self.shape}, dtype={self.dtype.name}, device={where})"


class Partition:
    """A tensor cut into equal tiles; the launch grid is the number of tiles per axis.

    A tile shape that does not divide the tensor is an error: a kernel that
    writes whole tiles would otherwise skip the ragged edge silently.
    """

    __slots__ = ("tensor", "tile_shape", "grid")

    def __init__(self, tensor: Tensor, tile_shape):
        tile = _shape_tuple(tile_shape)
        if len(tile) != tensor.ndim:
            raise ShapeError(f"tile shape {tile} has rank {len(tile)} but the tensor {tensor.shape} "
                             f"has rank {tensor.ndim}; give one tile size per axis")
        if any(t <= 0 for t in tile):
            raise ShapeError(f"tile sizes must be positive, got {tile}")
        bad = [i for i, (n, t) in enumerate(zip(tensor.shape, tile)) if n % t]
        if bad:
            i = bad[0]
            raise ShapeError(f"tile {tile} does not divide tensor shape {tensor.shape}: axis {i} has "
                             f"{tensor.shape[i]} elements, not a multiple of {tile[i]}; pick a tile size "
                             f"that divides it")
        self.tensor = tensor
        self.tile_shape = tile
        self.grid = tuple(n // t for n, t in zip(tensor.shape, tile))

    @property
    def num_tiles(self) -> int:
        return math.prod(self.grid)

    def unpartition(self) -> Tensor:
        return self.tensor

    def __repr__(self) -> str:
        return f"Partition({self.tensor!r}, tile={self.tile_shape}, grid={self.grid})"


# -- module-level constructors (eager; the lazy ops live in deviceop.api) --------

def empty(shape, dtype="float32", *, device=None, stream=None) -> Tensor:
    return Tensor.empty(shape, dtype, device=device, stream=stream)


def from_numpy(array, *, device=None, stream=None, dtype=None) -> Tensor:
    return Tensor.from_numpy(array, device=device, stream=stream, dtype=dtype)


def from_dlpack(obj, *, device=None) -> Tensor:
    return Tensor.from_dlpack(obj, device=device)


def as_tensor(obj, *, device=None) -> Tensor:
    """``obj`` as a Tensor without copying: a Tensor, a DLPack producer or a
    ``__cuda_array_interface__`` exporter.  Host arrays need ``from_numpy``."""
    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, np.ndarray):
        raise StateError("a NumPy array lives in host memory; copy it with dop.from_numpy(array)")
    if hasattr(obj, "__dlpack__"):
        return Tensor.from_dlpack(obj, device=device)
    if hasattr(obj, "__cuda_array_interface__"):
        return Tensor.from_cuda_array_interface(obj, device=device)
    raise DTypeError(f"cannot view a {type(obj).__name__} as a tensor: it has neither __dlpack__ "
                     "nor __cuda_array_interface__")
