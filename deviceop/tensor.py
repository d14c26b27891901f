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

import gc
import itertools
import math
import operator
import threading
import weakref

import numpy as np

from .dtypes import DType, dtype as as_dtype, host_array_from_dlpack
from .errors import DTypeError, OutOfMemoryError, OwnershipError, ShapeError, StateError


def _shape_tuple(shape) -> tuple[int, ...]:
    try:
        return tuple(map(operator.index, shape))  # C loops: a shape is made per launch built
    except TypeError:
        if isinstance(shape, (int, np.integer)):
            return (int(shape),)
        raise ShapeError(f"a shape is a sequence of ints, got {shape!r}") from None


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


# Launch checks are cached by the layouts of the tensors involved (see
# KernelLaunch._run).  Hashing every tensor's (pointer, shape, strides, dtype)
# tuple at every launch was most of that lookup's cost; so each distinct
# layout gets a small int, once, when a tensor or view is made, and the cache
# keys on those.  Equal ids mean equal layouts (ids come from a counter and are
# never reused); a layout made again after the table was cleared gets a new
# id, which costs that launch one more check, never a wrong verdict.
_sig_ids: dict = {}
_next_sig_id = itertools.count(1).__next__


def _sig_id(sig: tuple) -> int:
    i = _sig_ids.get(sig)
    if i is None:
        if len(_sig_ids) >= 1 << 14:  # bounded: dead tensors' layouts are forgotten
            _sig_ids.clear()
        i = _sig_ids.setdefault(sig, _next_sig_id())  # setdefault: two threads agree on one id
    return i


class _Allocation:
    """One allocation, shared by every view of it: its extent (for overlap
    checks) and who can reach it (ownership, see SharedTensor): the number of
    live SharedTensor handles, the live *borrows* (views made through a handle,
    imports of its memory through DLPack), and whether another framework owns
    the memory (``external``: imported, its other references are invisible)."""

    __slots__ = ("lo", "hi", "handles", "lock", "borrows", "external", "__weakref__")

    def __init__(self, lo: int, hi: int, external: bool = False):
        self.lo, self.hi, self.handles = lo, hi, 0
        self.lock = threading.Lock()
        self.borrows = []  # what each live borrow is (one entry per _Borrow alive)
        self.external = external


class _Borrow:
    """A borrow of an allocation: carried by the view (or import) that made it
    and by every view made from that one, so it lives as long as any of them.
    Counted in ``alloc.borrows`` from its making to its collection (list append
    and remove are single operations under the GIL: no lock on this path)."""

    __slots__ = ("alloc", "what")

    def __init__(self, alloc: _Allocation, what: str):
        self.alloc, self.what = alloc, what
        alloc.borrows.append(what)

    def __del__(self):
        try:
            self.alloc.borrows.remove(self.what)
        except ValueError:  # pragma: no cover - every borrow added its entry
            pass


# The allocations deviceop made, while they live: an import (from_dlpack) of
# memory inside one of them is a borrow of it.
_owned: "weakref.WeakSet[_Allocation]" = weakref.WeakSet()
_owned_lock = threading.Lock()


def _owner_of(lo: int, hi: int) -> "_Allocation | None":
    """The live deviceop allocation that holds ``[lo, hi)``, if any (imports are rare: a scan)."""
    if lo >= hi:  # an empty import touches no byte of anyone's
        return None
    with _owned_lock:
        for a in list(_owned):
            if a.lo <= lo and hi <= a.hi and a.lo < a.hi:
                return a
    return None


class _HostMemory:
    """Exposes a raw host view to NumPy while keeping its base array alive."""

    def __init__(self, base, interface):
        self.base, self.__array_interface__ = base, interface


def _host_view(base, ptr: int, shape, byte_strides, dtype) -> np.ndarray:
    """A NumPy array of exactly ``shape``/``byte_strides`` at ``ptr`` inside ``base``."""
    raw = np.dtype(f"V{dtype.itemsize}")  # any dtype (bfloat16 too) through raw bytes
    iface = {"version": 3, "shape": tuple(shape), "typestr": raw.str, "data": (ptr, False),
             "strides": tuple(byte_strides)}
    return np.asarray(_HostMemory(base, iface)).view(dtype)


class Tensor:
    """A typed, strided view of device memory (host memory on the reference device).

    A tensor is metadata — pointer, shape, strides (in elements), dtype — over
    a *base* array that owns the memory.  Views share the base and cost no
    array construction; the CuPy/NumPy array of a view is made only when
    asked for (``numpy()``, interop, the reference device's kernels).
    """

    __slots__ = ("_base", "_arr", "device", "dtype", "_ptr", "_shape", "_strides", "_alloc", "_contig",
                 "_home_stream", "_sig", "_sig_id", "_views", "_borrow", "__weakref__")

    def __init__(self, *args, **kwargs):
        raise TypeError("create tensors with dop.empty/zeros/from_numpy/from_dlpack or the api ops")

    @classmethod
    def _wrap(cls, array, device, dtype: DType | None = None, home_stream=None, external: bool = False) -> "Tensor":
        """A tensor over all of ``array``, which owns (or keeps alive) the memory;
        ``external``: memory another framework owns (an import)."""
        t = object.__new__(cls)
        t._base = t._arr = array
        t.device = device
        t.dtype = dtype if dtype is not None else as_dtype(array.dtype)
        item = t.dtype.itemsize
        t._shape = tuple(array.shape)
        t._strides = tuple(st // item for st in array.strides)
        t._contig = bool(array.flags.c_contiguous)
        if device.is_reference:
            t._ptr = int(array.__array_interface__["data"][0])
        else:
            t._ptr = int(array.data.ptr)
        # the allocation's extent: views of one allocation share this tuple, so
        # "can these two alias?" is usually one identity test
        mem = getattr(getattr(array, "data", None), "mem", None) if not device.is_reference else None
        t._alloc = _Allocation(*((int(mem.ptr), int(mem.ptr) + int(mem.size)) if mem is not None and mem.size
                                 else t._range()), external)
        t._borrow = None
        if external:
            owner = _owner_of(*t._range())
            if owner is not None:  # deviceop memory coming back through DLPack: a borrow of its buffer
                t._borrow = _Borrow(owner, "an import of its memory (from_dlpack / as_tensor)")
        else:
            with _owned_lock:
                _owned.add(t._alloc)
        t._home_stream = home_stream
        t._sig = (t._ptr, t._shape, t._strides, t.dtype)
        t._sig_id = _sig_id(t._sig)
        t._views = None
        return t

    def _view(self, ptr: int, shape: tuple, strides: tuple, contiguous: bool) -> "Tensor":
        """A view of the same allocation (no array is built)."""
        t = object.__new__(Tensor)
        t._base, t._arr, t.device, t.dtype = self._base, None, self.device, self.dtype
        t._ptr, t._shape, t._strides, t._contig = ptr, shape, strides, contiguous
        t._alloc, t._home_stream, t._borrow = self._alloc, self._home_stream, self._borrow
        t._sig, t._views = (ptr, shape, strides, self.dtype), None
        t._sig_id = _sig_id(t._sig)
        return t

    def _twin(self) -> "Tensor":
        """A new tensor object with this one's layout (no cached array or views, no borrow)."""
        t = object.__new__(Tensor)
        t._base, t._arr, t.device, t.dtype = self._base, None, self.device, self.dtype
        t._ptr, t._shape, t._strides, t._contig = self._ptr, self._shape, self._strides, self._contig
        t._alloc, t._home_stream, t._borrow = self._alloc, self._home_stream, None
        t._sig, t._sig_id, t._views = self._sig, self._sig_id, None
        return t

    @property
    def _array(self):
        """The CuPy (GPU) or NumPy (reference) array of exactly this view."""
        arr = self._arr
        if arr is None:
            base, item = self._base, self.dtype.itemsize
            byte_strides = tuple(s * item for s in self._strides)
            if self.device.is_reference:
                arr = _host_view(base, self._ptr, self._shape, byte_strides, self.dtype.np)
            else:
                import cupy
                arr = cupy.ndarray(self._shape, self.dtype.np, base.data + (self._ptr - base.data.ptr), byte_strides)
            self._arr = arr
        return arr

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
        """A zero-copy tensor over ``obj``'s memory (torch, CuPy, JAX ... anything with ``__dlpack__``).

        The memory stays the other framework's: ``try_partition`` on a handle to
        it is refused (deviceop cannot see who else holds it); ``api.dup`` makes
        a copy deviceop owns."""
        from .runtime.device import Device
        device = device if device is not None else Device(0)
        if isinstance(obj, Tensor):
            return obj
        if device.is_reference:
            return cls._wrap(host_array_from_dlpack(obj), device, external=True)  # (NumPy alone refuses bfloat16)
        import cupy
        kind = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else None
        if kind is not None and int(kind) not in (2, 13):  # kDLCUDA, kDLCUDAManaged
            raise StateError(f"{type(obj).__name__} lives in host memory (DLPack device type {int(kind)}); "
                             "zero-copy import needs device memory: copy it with dop.from_numpy(...)")
        with cupy.cuda.Device(device.ordinal):
            array = cupy.from_dlpack(obj)
        return cls._wrap(array, device, external=True)

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
        return cls._wrap(array, device, external=True)

    # -- metadata ------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements (not bytes)."""
        return self._strides

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def data_ptr(self) -> int:
        """The device address of the first element."""
        return self._ptr

    @property
    def is_contiguous(self) -> bool:
        return self._contig

    def _range(self) -> tuple[int, int]:
        item = self.dtype.itemsize
        if 0 in self._shape:
            return (self._ptr, self._ptr)
        lo = hi = 0
        for n, s in zip(self._shape, self._strides):
            if s >= 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        return (self._ptr + lo * item, self._ptr + (hi + 1) * item)

    def memory_range(self) -> tuple[int, int]:
        """``[lo, hi)`` byte addresses this view can touch (for overlap checks)."""
        return self._range()

    def overlaps(self, other: "Tensor") -> bool:
        """Whether the two views can touch a common byte."""
        a, b = self._alloc, other._alloc
        if a is not b and (a.hi <= b.lo or b.hi <= a.lo):
            return False  # different allocations: the common case, decided without a range
        a0, a1 = self._range()
        b0, b1 = other._range()
        return a0 < b1 and b0 < a1

    # -- views ---------------------------------------------------------------
    def view(self, *shape) -> "Tensor":
        """The same memory seen with another shape (no copy; one dim may be -1).

        Views are immutable, so each tensor remembers the ones it made: asking
        again for the same shape returns the same object, cheaply."""
        shape = shape[0] if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)) else shape
        views = self._views
        if views is not None and type(shape) is tuple:
            v = views.get(shape)
            if v is not None:
                return v
        v = self._make_view(shape)
        if type(shape) is tuple:
            if views is None:
                views = self._views = {}
            if len(views) < 16:
                views[shape] = v
        return v

    reshape = view

    def _make_view(self, shape) -> "Tensor":
        size = self.size
        # the fast path checks signs too: two negative sizes multiply to a positive count
        dims = shape if type(shape) is tuple and math.prod(shape) == size \
            and all(type(d) is int and d >= 0 for d in shape) else \
            _resolve_shape(shape, size, f"view of {self.dtype.name} tensor {self._shape}")
        if not self._contig:
            raise ShapeError(f"cannot view the non-contiguous tensor {self._shape} (strides {self._strides}) "
                             f"as {dims} without a copy; make a contiguous copy first")
        strides, acc = [0] * len(dims), 1
        for i in range(len(dims) - 1, -1, -1):
            strides[i] = acc
            acc *= dims[i]
        return self._view(self._ptr, dims, tuple(strides), True)

    def __getitem__(self, key) -> "Tensor":
        """Basic slicing (ints, slices, ``...``) returns a view; no copying index forms."""
        items = key if isinstance(key, tuple) else (key,)
        for k in items:
            if not isinstance(k, (int, np.integer, slice)) and k is not Ellipsis and k is not None:
                raise ShapeError(f"only basic indexing (ints, slices, ...) makes views; got {type(k).__name__}")
        arr = self._array[key]
        item = self.dtype.itemsize
        ptr = int(arr.__array_interface__["data"][0]) if self.device.is_reference else int(arr.data.ptr)
        t = self._view(ptr, tuple(arr.shape), tuple(st // item for st in arr.strides), bool(arr.flags.c_contiguous))
        t._arr = arr
        return t

    def contiguous(self, *, stream=None) -> "Tensor":
        """This tensor if it is dense (C-contiguous), else a dense copy of it in new
        memory (on the GPU, ordered on ``stream``, default: the tensor's home stream)."""
        if self._contig:
            return self
        if self.device.is_reference:
            return Tensor._wrap(np.ascontiguousarray(self._array), self.device, self.dtype)
        import cupy
        stream = stream or self._home_stream or self.device.default_stream()
        with cupy.cuda.Device(self.device.ordinal), stream.cupy:
            return Tensor._wrap(cupy.ascontiguousarray(self._array), self.device, self.dtype, stream)

    def partition(self, tile_shape) -> "Partition":
        """Borrow this tensor mutably as the output of one launch, cut into tiles."""
        return Partition(self, tile_shape)

    def into_shared(self) -> "SharedTensor":
        """A SharedTensor (Arc-like) handle to this buffer, for the combinator API."""
        return SharedTensor(self)

    # -- transfers and interop -----------------------------------------------
    def numpy(self, *, stream=None) -> np.ndarray:
        """A host copy.  With ``stream`` the copy is ordered after that stream's
        work; without, the whole device is synchronized first."""
        if stream is not None and stream.is_capturing():  # a copy to the host is a host sync: not in a capture
            from .runtime.stream import sync_in_capture
            raise sync_in_capture("tensor.numpy(stream=...)", "cuStreamSynchronize")
        if self.device.is_reference:
            if stream is None:
                self.device.synchronize()  # refused while a capture is open, as on a GPU
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

    __slots__ = ("tensor", "tile_shape", "grid", "_sig_id")

    def __init__(self, tensor: Tensor, tile_shape):
        tile, shape = _shape_tuple(tile_shape), tensor._shape
        if len(tile) != len(shape):
            raise ShapeError(f"tile shape {tile} has rank {len(tile)} but the tensor {shape} "
                             f"has rank {len(shape)}; give one tile size per axis")
        if tile and min(tile) <= 0:
            raise ShapeError(f"tile sizes must be positive, got {tile}")
        grid = tuple(map(operator.floordiv, shape, tile))  # C loops: a partition is built per launch
        if tuple(map(operator.mul, grid, tile)) != shape:
            i = next(i for i, (n, t) in enumerate(zip(shape, tile)) if n % t)
            raise ShapeError(f"tile {tile} does not divide tensor shape {shape}: axis {i} has "
                             f"{shape[i]} elements, not a multiple of {tile[i]}; pick a tile size that divides it")
        self.tensor = tensor
        self.tile_shape = tile
        self.grid = grid
        self._sig_id = _sig_id(("tiles", tensor._sig_id, tile))  # the tensor's layout and the tiles, as one id

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


# -- shared handles and ownership ------------------------------------------------

class SharedTensor:
    """An Arc-like, read-only handle to a tensor.

    ``clone()`` makes another live handle; ``release()`` (or the handle being
    collected) ends one.  ``try_partition(tile)`` turns the *only* live handle
    into a writable Partition and fails with an OwnershipError while anything
    else deviceop can see may still reach the buffer — the runtime form of
    cutile-rs's ``Arc::try_unwrap``:

    * another live handle (counted explicitly — handles made and ended, not
      CPython reference counts — and per allocation: two handles made from two
      views of one buffer still count as two);
    * a live *borrow*: a view made through a handle (``handle.view(...)``, an
      op's ``.reshape`` of a handle) or a DLPack import of the buffer's memory,
      counted while that view, or any view made from it, is alive;
    * memory imported from another framework (``from_dlpack``, ``as_tensor``):
      its other references are invisible, so it is never claimed.

    A plain Tensor is not tracked: ``tensor.partition`` is a mutable borrow its
    caller vouches for (docs/robustness.md, "Ownership", says what is and is
    not enforced).
    """

    __slots__ = ("_tensor", "_live", "__weakref__")

    def __init__(self, tensor: Tensor):
        if not isinstance(tensor, Tensor):
            raise StateError(f"SharedTensor wraps a Tensor, got {type(tensor).__name__}")
        self._tensor = tensor
        alloc = tensor._alloc
        with alloc.lock:
            alloc.handles += 1
        self._live = True

    @property
    def tensor(self) -> Tensor:
        """The tensor, for reading (launch inputs).  It is a plain Tensor: views of
        it are not counted as borrows; make views with ``handle.view(...)``."""
        if not self._live:
            raise StateError("this SharedTensor handle was released or consumed by try_partition")
        return self._tensor

    @property
    def live_handles(self) -> int:
        """Live handles to this buffer's allocation (this one included, if live)."""
        return self._tensor._alloc.handles

    def clone(self) -> "SharedTensor":
        return SharedTensor(self.tensor)  # a dead handle cannot be cloned

    def release(self) -> None:
        """End this handle (idempotent)."""
        if self._live:
            self._live = False
            alloc = self._tensor._alloc
            with alloc.lock:
                alloc.handles -= 1

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass

    def _why_not_exclusive(self, tensor: Tensor) -> str | None:
        """What else can reach the buffer (None: nothing deviceop can see).  Call with the allocation's lock."""
        alloc = tensor._alloc
        if alloc.external:
            return ("is memory imported from another framework (from_dlpack / as_tensor), which may still hold and "
                    "use it: deviceop cannot count its references. Copy it into a buffer deviceop owns "
                    "(api.dup(x), then .into_shared()) and claim that, or, if nothing else uses it, borrow it "
                    "explicitly with handle.tensor.partition(tile)")
        others = alloc.handles - 1
        borrows = list(alloc.borrows)
        own = tensor._borrow  # a handle made from a borrowed view: that borrow is the claimer's own
        if own is not None and own.alloc is alloc and own.what in borrows:
            borrows.remove(own.what)
        if not others and not borrows:
            return None
        reach = []
        if others:
            reach.append(f"{others} other live SharedTensor handle(s)")
        if borrows:
            reach.append(f"{len(borrows)} live borrow(s): {'; '.join(sorted(set(borrows)))}")
        return (f"is still reachable from {' and '.join(reach)}; release() the other handles and drop the "
                "borrowing views or imports (del them) first, or write into a buffer you own")

    def _exclusive(self, what: str, consume: bool) -> Tensor:
        """The tensor, if this is the only way deviceop can see to reach the buffer
        (the handle ended with the same lock held when ``consume``); else OwnershipError."""
        tensor = self.tensor
        alloc = tensor._alloc
        for attempt in (0, 1):
            with alloc.lock:
                why = self._why_not_exclusive(tensor)
                if why is None:
                    if consume:
                        alloc.handles -= 1
                        self._live = False
                    return tensor
            if attempt or not alloc.borrows:
                break
            gc.collect()  # a view in an unreachable reference cycle is no borrow: the verdict must not hinge on it
        raise OwnershipError(f"{what}: the {tensor.dtype.name} buffer {tensor.shape} {why}")

    def try_partition(self, tile_shape) -> Partition:
        """Claim the buffer for writing: succeeds only if nothing else deviceop can
        see reaches it (see the class docstring).

        The handle is consumed (like a Rust move); the partition's tensor is
        the buffer, writable by one launch."""
        tensor = self.tensor
        part = Partition(tensor, tile_shape)  # a bad tile fails before the handle is consumed
        alloc = tensor._alloc
        with alloc.lock:  # the common case inline (a claim is made per buffer per forward built)
            if alloc.handles == 1 and not alloc.borrows and not alloc.external:
                alloc.handles -= 1
                self._live = False
                return part
        self._exclusive("try_partition", consume=True)
        return part

    def check_writable(self, what: str) -> Tensor:
        """The tensor, for a write through this handle (``api.memcpy`` into it):
        allowed when ``try_partition`` would be, without consuming the handle
        (cutile-rs's ``Arc::get_mut``).  Raises OwnershipError otherwise."""
        return self._exclusive(what, consume=False)

    # read-only conveniences, all through .tensor
    @property
    def shape(self):
        return self.tensor.shape

    @property
    def dtype(self):
        return self.tensor.dtype

    def view(self, *shape) -> Tensor:
        """A view of the buffer, counted as a borrow while it (or a view made from
        it) is alive: ``try_partition`` on any handle to the buffer waits for it."""
        tensor = self.tensor
        like = tensor.view(*shape)  # the tensor's cached view: its shape checked once
        v = like._twin()  # an object of its own: its life is the borrow's
        v._borrow = _Borrow(tensor._alloc, "a view made through a handle (handle.view / .reshape)")
        return v

    reshape = view

    def numpy(self, **kw):
        return self.tensor.numpy(**kw)

    def __repr__(self) -> str:
        state = f"{self.live_handles} live handle(s)" if self._live else "released"
        return f"SharedTensor({self._tensor!r}, {state})"

