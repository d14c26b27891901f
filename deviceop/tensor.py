"""Tensors: typed, strided views of device memory, and shared handles to them.

Memory is the device's (``device.alloc``): CuPy arrays from CuPy's pool on a
GPU — allocation nearly free after warm-up, reuse ordered by stream, DLPack,
``__cuda_array_interface__`` and strided copies without writing them — NumPy
arrays on the reference device.  deviceop adds dtypes tied to CUDA C++ types,
partitions, ownership and launch-ready pointers.

Tensors never copy behind your back: ``view``/``reshape`` refuse a layout
they cannot express without a copy, ``numpy()``/``from_numpy`` are the
explicit transfers.
"""
from __future__ import annotations

import math

import numpy as np

from .dtypes import DType, dlpack_producer, dtype as as_dtype, host_array, mark_read_only, producer_name
from .errors import DTypeError, LaunchError, OwnershipError, ShapeError, StateError
from .memory import (READ_ONLY, Partition, SharedTensor, _Allocation, _Borrow, _owned, _owned_lock, _owner_of,  # noqa: F401
                     _resolve_shape, _shape_tuple, _sig_id, _sig_ids, claim)  # (_sig_ids: tests read the layout-id table here)
from .runtime import launch as _launch
from .runtime.device import Device, as_device, placed, pointer_ordinal
from .runtime.stream import sync_in_capture


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
        raise LaunchError("dop.Tensor(...) is not a constructor: make a tensor with dop.zeros(shape) or "
                          "dop.empty(shape), dop.from_numpy(array), dop.from_dlpack(obj), or the api ops")

    @classmethod
    def _wrap(cls, array, device, dtype: DType | None = None, home_stream=None, external: bool = False,
              read_only: bool = False) -> "Tensor":
        """A tensor over all of ``array``, which owns (or keeps alive) the memory;
        ``external``: memory another framework owns (an import); ``read_only``: an
        import its producer flagged read-only (deviceop refuses to write it)."""
        t = object.__new__(cls)
        t._base = t._arr = array
        t.device = device
        t.dtype = dtype if dtype is not None else as_dtype(array.dtype)
        item = t.dtype.itemsize
        t._shape = tuple(array.shape)
        t._strides = tuple(st // item for st in array.strides)
        t._contig = bool(array.flags.c_contiguous)
        t._ptr = device.address(array)
        # the allocation's extent: views of one allocation share it, so "can these
        # two alias?" is usually one identity test
        t._alloc = _Allocation(*(device.extent(array) or t._range()), external, read_only)
        t._borrow = None
        if external:
            owner = _owner_of(*t._range())
            if owner is not None:  # deviceop memory coming back through DLPack: a borrow of its buffer
                t._borrow = _Borrow(owner, "an import of its memory (from_dlpack / as_tensor)")
        else:
            with _owned_lock:
                _owned.add(t._alloc)
        t._home_stream = home_stream
        # the device too: an address freed on one device may be handed out on another, and a launch key
        # (kernel/plan.py) must not find the plan checked for the first
        t._sig = (t._ptr, t._shape, t._strides, t.dtype, device) + ((READ_ONLY,) if read_only else ())
        t._sig_id = _sig_id(t._sig)
        t._views = None
        return t

    def _view(self, ptr: int, shape: tuple, strides: tuple, contiguous: bool) -> "Tensor":
        """A view of the same allocation (no array is built)."""
        t = object.__new__(Tensor)
        t._base, t._arr, t.device, t.dtype = self._base, None, self.device, self.dtype
        t._ptr, t._shape, t._strides, t._contig = ptr, shape, strides, contiguous
        t._alloc, t._home_stream, t._borrow = self._alloc, self._home_stream, self._borrow
        t._sig, t._views = (ptr, shape, strides, self.dtype, self.device), None
        if self._alloc.read_only:
            t._sig += (READ_ONLY,)
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
            try:
                arr = self._arr = self.device.view_array(base, self._ptr, self._shape, byte_strides, self.dtype.np)
            except Exception:  # a view NumPy/CuPy cannot hold (over 64 dims, a dim past int64), whatever they raise
                if len(self._shape) <= MAX_NDIM and max(self._shape, default=0) <= MAX_DIM:
                    raise
                raise _bad_dims(self._shape) from None
        return arr

    # -- creation ------------------------------------------------------------
    @classmethod
    def empty(cls, shape, dtype="float32", *, device=None, stream=None) -> "Tensor":
        """An uninitialised tensor.  Allocation is ordered on ``stream``
        (default: the device's default stream)."""
        device, stream = placed("dop.empty", device, stream)
        dt = as_dtype(dtype)
        dims = _shape_tuple(shape)
        if dims and (min(dims) < 0 or len(dims) > MAX_NDIM or max(dims) > MAX_DIM):
            raise _bad_dims(dims)
        return cls._wrap(device.alloc(dims, dt, stream), device, dt, stream)

    @classmethod
    def from_numpy(cls, array, *, device=None, stream=None, dtype=None) -> "Tensor":
        """A new tensor holding a copy of the host ``array``."""
        device, stream = placed("dop.from_numpy", device, stream)
        host = host_array(array, "dop.from_numpy")
        dt = as_dtype(dtype if dtype is not None else host.dtype)
        host = dt.from_host(host)  # refuses a value the copy would change (300 in int8)
        return cls._wrap(device.from_host(host, dt, stream), device, dt, stream)

    @classmethod
    def from_dlpack(cls, obj, *, device=None, stream=None) -> "Tensor":
        """A zero-copy tensor over ``obj``'s memory (torch, CuPy, JAX ... anything with ``__dlpack__``).

        ``device`` defaults to the GPU the memory lives on (a ``cuda:1`` tensor imports onto
        ``Device(1)``); another device is refused.  Ordered on ``stream`` (default: the
        device's default stream), which
        becomes the tensor's home stream: the producer makes it wait for the work
        it still has queued on the memory (torch: its current stream).  The
        memory stays the other framework's: ``try_partition`` on a handle to it
        is refused (deviceop cannot see who else holds it); ``api.dup`` makes a
        copy deviceop owns."""
        home = None if isinstance(obj, Tensor) else _gpu_of(obj)
        if home is not None and device is None and stream is None:
            device = home  # a cuda:1 tensor imports onto Device(1), not the default device
        device, stream = placed("dop.from_dlpack", device, stream)
        if isinstance(obj, Tensor):
            return obj
        if home is not None and device.ordinal != home:
            raise LaunchError(f"dop.from_dlpack: the {producer_name(obj)} lives on GPU {home} (its __dlpack_device__), "
                              f"and the import was asked on {device.label}; import it on its own device "
                              f"(device={home}, or a stream of Device({home}), or neither), or copy it there first")
        if isinstance(obj, np.ndarray):  # on either device, as the GPU must: a NumPy array is host memory
            raise StateError("a NumPy array lives in host memory, and zero-copy import (dop.from_dlpack, "
                             "dop.as_tensor) takes device memory: copy it with dop.from_numpy(array)")
        producer, stream = dlpack_producer(obj), stream or device.default_stream()  # exports checked, read-only noted
        array = device.import_dlpack(producer, stream)
        read_only = producer.read_only or not getattr(getattr(array, "flags", None), "writeable", True)
        return cls._wrap(array, device, home_stream=stream, external=True, read_only=read_only)

    @classmethod
    def from_cuda_array_interface(cls, obj, *, device=None) -> "Tensor":
        """A zero-copy tensor over an object exposing ``__cuda_array_interface__``, on the GPU
        its pointer lives on (``device`` defaults to it; another device is refused)."""
        if not hasattr(obj, "__cuda_array_interface__"):  # (CuPy alone would copy a host array to the GPU)
            raise DTypeError(f"{type(obj).__name__!r} has no __cuda_array_interface__, so it is no GPU memory to view; "
                             "copy host data with dop.from_numpy(array)")
        data = obj.__cuda_array_interface__.get("data")
        home = pointer_ordinal(data[0]) if isinstance(data, tuple) and data[0] else None
        device = as_device(device) if device is not None else Device(home if home is not None else 0)
        if home is not None and device.ordinal != home:
            raise LaunchError(f"dop.from_cuda_array_interface: the memory lives on GPU {home} (its pointer's device) "
                              f"and the view was asked on {device.label}; pass device={home}, or none")
        array = device.import_cuda_array(obj)  # data: (pointer, read-only)
        return cls._wrap(array, device, external=True, read_only=bool(data[1]) if isinstance(data, tuple) else False)

    # -- metadata ------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @shape.setter
    def shape(self, dims):  # NumPy's in-place reshape (a.shape = ...): a tensor's layout is fixed
        raise ShapeError(f"tensor.shape = {dims!r}: a tensor's shape is fixed (views of it and launch keys were "
                         f"made for it); take a view: tensor = tensor.view({dims!r})")

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
        for k in items:  # (a bool is NumPy's mask index: a copy, never a view)
            if isinstance(k, bool) or not isinstance(k, (int, np.integer, slice)) and k is not Ellipsis \
                    and k is not None:
                raise ShapeError(f"only basic indexing (ints, slices, ...) makes views; got {type(k).__name__}")
        try:
            arr = self._array[key]
        except (IndexError, ValueError, TypeError) as e:  # out of range, too many indices, step 0, a float bound
            raise ShapeError(f"index {key!r} into tensor {self._shape}: {e}; index within the shape") from None
        item = self.dtype.itemsize
        ptr = self.device.address(arr)
        t = self._view(ptr, tuple(arr.shape), tuple(st // item for st in arr.strides), bool(arr.flags.c_contiguous))
        t._arr = arr
        return t

    def __len__(self) -> int:
        if not self._shape:
            raise ShapeError("len() of a 0-d tensor: it has no first dimension; read tensor.shape")
        return self._shape[0]

    def __bool__(self) -> bool:  # an object, always true (`out or default`), whatever len() is
        return True

    def __iter__(self):
        """The views ``tensor[0]``, ``tensor[1]``, ... along the first dimension."""
        return (self[i] for i in range(len(self)))

    def __contains__(self, value):
        raise StateError("`value in tensor` would compare device data on the host, which a tensor never reads "
                         "behind your back: test `value in tensor.numpy()`")

    def __int__(self):  # torch's int(t) / float(t) of a one-element tensor: a host read, never implicit
        raise StateError(f"int(tensor) would read a {self.dtype.name} tensor {self._shape} on the host, which a "
                         "tensor never does behind your back: read it with int(tensor.numpy().item())")

    def __float__(self):
        raise StateError(f"float(tensor) would read a {self.dtype.name} tensor {self._shape} on the host, which a "
                         "tensor never does behind your back: read it with float(tensor.numpy().item())")

    def __format__(self, spec: str) -> str:
        if not spec:
            return repr(self)
        raise StateError(f"format(tensor, {spec!r}) (an f-string's {{tensor:{spec}}}) formats values, which live on "
                         f"the device: format the host copy, f\"{{tensor.numpy().item():{spec}}}\"")

    def __reduce_ex__(self, protocol):  # what copy.copy, copy.deepcopy and pickle call
        raise StateError("copying or pickling a deviceop tensor: it is a view of device memory that a copy of the "
                         "object would alias or lose; copy the data with api.dup(tensor) (device) or "
                         "tensor.numpy() (host), and rebuild one with dop.from_numpy(array)")

    def contiguous(self, *, stream=None) -> "Tensor":
        """This tensor if it is dense (C-contiguous), else a dense copy of it in new
        memory (on the GPU, ordered on ``stream``, default: the tensor's home stream)."""
        _, stream = placed("tensor.contiguous", self.device, stream)
        if self._contig:
            return self
        stream = stream or self._live_home()
        return Tensor._wrap(self.device.contiguous(self._array, stream), self.device, self.dtype, stream)

    def _live_home(self):
        """The stream that orders work after this tensor's making: its home stream, or once
        that was closed (its device then is the closed one's), the default stream after a
        device sync (which waits for the closed stream's last work too)."""
        home = self._home_stream
        if home is None:
            return self.device.default_stream()
        if home.device is not self.device:
            self.device.synchronize()
            return self.device.default_stream()
        return home

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
        _, stream = placed("tensor.numpy", self.device, stream)
        if stream is not None and stream.is_capturing():  # a copy to the host is a host sync: not in a capture
            raise sync_in_capture("tensor.numpy(stream=...)", "cuStreamSynchronize")
        if stream is None:
            self.device.synchronize()  # refused while a capture is open
            stream = self._home_stream
            if stream is None or stream.device is not self.device:  # none, or closed (synchronized above)
                stream = self.device.default_stream()
        return self.device.to_host(self._array, stream)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """``np.asarray(tensor)``: a host copy taken once the device is done with the tensor
        (``numpy()``); NumPy 2's ``dtype`` and ``copy`` keywords (``copy=False`` is refused:
        device memory is never host memory, so the array is always a copy)."""
        if copy is False:
            raise StateError("np.asarray(tensor, copy=False): a host array of a deviceop tensor is always a copy; "
                             "pass copy=None or copy=True, or call tensor.numpy()")
        host = self.numpy()
        return host if dtype is None else host.astype(dtype, copy=False)

    @property
    def __cuda_array_interface__(self) -> dict:
        return self.device.cuda_array_interface(self._array)

    def __dlpack__(self, *, stream=None, **kwargs):
        """DLPack export, zero-copy.  The consumer's ``stream`` (torch passes its
        current one) waits for the work queued so far on the tensor's home stream
        (where it was made or imported; work on other streams: synchronize them
        first, as for ``numpy()``)."""
        if stream is not None and (type(stream) is not int or stream == 0 or stream < -1):
            raise LaunchError(f"__dlpack__(stream={stream!r}): DLPack's stream is an int: a CUDA stream handle, "
                              "1 (the legacy default stream), 2 (per-thread default) or -1 (no ordering)")
        home = self._live_home()
        if self._alloc.read_only:
            return self._export_read_only(home, stream, kwargs)
        return self.device.export_dlpack(self._array, home, stream, kwargs)

    def _export_read_only(self, home, stream, kwargs: dict):
        """A DLPack export of read-only memory, flagged so (DLPack 1.0), or refused: an
        export that cannot say it is read-only is one its consumer may write."""
        version = kwargs.get("max_version")
        if isinstance(version, tuple) and version and isinstance(version[0], int) and version[0] >= 1:
            capsule = self.device.export_dlpack(self._array, home, stream, kwargs)
            if mark_read_only(capsule):
                return capsule
        raise OwnershipError(f"a DLPack export of the {self.dtype.name} tensor {self._shape}: it is read-only memory "
                             "imported from another framework, and an export without DLPack 1.0's read-only flag "
                             "(a consumer asking no max_version >= (1, 0)) is one its consumer may write; import it "
                             "with a DLPack 1.0 consumer (np.from_dlpack, torch.from_dlpack), or copy it: api.dup(x)")

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    def to_cupy(self):
        """The CuPy array over the same memory (GPU only)."""
        return self.device.cupy_array(self._array)

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self.dtype.name}, device={self.device.label})"


MAX_NDIM, MAX_DIM = 64, (1 << 63) - 1  # what a NumPy or CuPy array can hold


def _bad_dims(dims: tuple) -> ShapeError:
    if min(dims) < 0:
        return ShapeError(f"negative size in shape {dims}")
    return ShapeError(f"shape {dims}: NumPy and CuPy arrays hold at most {MAX_NDIM} dims, each below 2**63; "
                      "use fewer, smaller dims")


def _gpu_of(obj) -> int | None:
    """The GPU ordinal ``obj``'s memory lives on, by its ``__dlpack_device__``; None for host
    memory or an object that does not say (the import then checks it)."""
    try:
        kind, ordinal = obj.__dlpack_device__()
        return int(ordinal) if int(kind) in (2, 13) else None  # kDLCUDA, kDLCUDAManaged
    except Exception:  # noqa: BLE001 - no (usable) __dlpack_device__: dlpack_producer names what is wrong
        return None


_launch.set_tensor_type(Tensor)  # the launchers' fast path reads a Tensor's pointer without a call
