"""Devices: a CUDA GPU, or the reference device on a machine without one.

``Device(0)`` returns the same object every time for an ordinal.  Where the
process has no usable GPU it returns the :class:`ReferenceDevice` instead and
says so once on stderr: the reference device runs each kernel's NumPy
reference, so the library, its tests, examples and docs work everywhere —
but nothing measured on it says anything about a GPU.
"""
from __future__ import annotations

import math
import operator
import re
import threading

from cuda.bindings import driver as cu

from ..dtypes import producer_name
from ..errors import ConfigError, LaunchError, NoDeviceError, OutOfMemoryError, StateError
from . import driver, graphs
from .graph_backend import GraphBackend
from . import foreign as foreign_work
from .driver import check
from .module import CudaModule
from .stream import (_CLOSED, CudaEvent, CudaStream, closed_stream, not_a_stream, refuse_if_captured_elsewhere,
                     sync_failed)

_instances: dict[tuple[type, int], "Device"] = {}
_loaded: dict[tuple[int, str], CudaModule] = {}  # (ordinal, program key) -> the module loaded once
_instances_lock = threading.Lock()
CTX_SYNC = "device.synchronize() (which Tensor.numpy() without stream= calls)"


class Device:
    """Base of :class:`CudaDevice` and the reference device (runtime/reference.py).

    Calling ``Device(ordinal)`` picks the right one."""

    is_reference: bool = False
    ordinal: int
    name: str
    # the device class where the driver sees no GPU: ReferenceDevice, installed by runtime/reference.py
    # (set_fallback) when it is imported, which runtime/__init__.py does before anyone can call this;
    # that module subclasses this one, so this one cannot import it back (tests/test_architecture.py)
    _fallback: type
    graphs: GraphBackend  # its graph work: runtime/graphs.py on a GPU, a TapeGraphs on the reference device

    def __new__(cls, ordinal: int = 0):
        if cls is Device:
            cls = CudaDevice if driver.driver_available() else Device._fallback  # (see _fallback)
        try:
            ordinal = operator.index(ordinal)
        except TypeError:
            raise NoDeviceError(f"a device ordinal is an int (0 for the first GPU), got {ordinal!r}") from None
        key = (cls, ordinal)
        inst = _instances.get(key)
        if inst is None:
            with _instances_lock:
                inst = _instances.get(key)
                if inst is None:
                    inst = object.__new__(cls)
                    inst._setup(ordinal)
                    _instances[key] = inst
        return inst

    @staticmethod
    def set_fallback(cls: type) -> None:
        """Make ``cls`` what ``Device(n)`` is where the driver sees no GPU; runtime/reference.py
        installs ReferenceDevice (the one caller)."""
        Device._fallback = cls

    def _setup(self, ordinal: int) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    # A Device is a singleton per ordinal: copies are the same device.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (Device, (self.ordinal,))

    # -- streams -----------------------------------------------------------
    def new_stream(self, priority: int = 0):
        raise NotImplementedError

    def default_stream(self):
        """The stream ``op.sync()`` uses: one non-blocking stream per device,
        created on first use (never the legacy default stream)."""
        stream = self.__dict__.get("_default_stream")
        if stream is None:
            with _instances_lock:
                stream = self.__dict__.get("_default_stream")
                if stream is None:
                    stream = self._default_stream = self.new_stream()
        return stream


class CudaDevice(Device):
    """One CUDA GPU, driven through its primary context (shared with CuPy,
    PyTorch and cuda.core, so their arrays and ours live in one context)."""

    is_reference = False
    graphs = graphs  # the driver's graph work (the reference device has its own)

    def _setup(self, ordinal: int) -> None:
        count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= ordinal < count:
            raise NoDeviceError(f"no CUDA device {ordinal}: this machine has {count} (ordinals 0..{count - 1})")
        self.ordinal = ordinal
        self.handle = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.name = check(cu.cuDeviceGetName(256, self.handle), "cuDeviceGetName").split(b"\0", 1)[0].decode()
        attr = cu.CUdevice_attribute
        self.compute_capability = (
            self._attr(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            self._attr(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        )
        self.sm_count = self._attr(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.total_memory = check(cu.cuDeviceTotalMem(self.handle), "cuDeviceTotalMem")
        self.max_shared_memory_per_block = self._attr(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        self.l2_cache_size = self._attr(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self._context_id = int(self.context)
        self.bind()

    def _attr(self, attribute) -> int:
        return check(cu.cuDeviceGetAttribute(attribute, self.handle), "cuDeviceGetAttribute")

    @property
    def arch(self) -> str:
        """The NVRTC target of this device, e.g. ``"sm_90"``."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    def bind(self) -> None:
        """Make this device's primary context current on the calling thread, where it is
        not: another device opened since, or a library's ``set_device``, may have made
        another GPU's context current (a context-bound call would then act on that GPU)."""
        code, current = cu.cuCtxGetCurrent()
        if code or current is None or int(current) != self._context_id:
            check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    @property
    def driver_version(self) -> str:
        """The CUDA version of the driver, e.g. ``"13.0"`` (what PTX it can JIT-compile)."""
        return driver.driver_version()

    @property
    def label(self) -> str:
        return f"cuda:{self.ordinal}"

    @property
    def what_runs(self) -> str:
        """What a kernel launch runs here (python -m deviceop info; the reference device says its own)."""
        return f"each kernel's CUDA C++, compiled by NVRTC to a CUBIN for {self.arch}"

    def describe(self) -> str:
        free, total = self.memory_info()
        return (f"{self.ordinal}: {self.name}, {self.arch}, {self.sm_count} SMs, "
                f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free)")

    def require_gpu(self, what: str) -> None:
        """Nothing: this is one (the reference device raises NoDeviceError naming ``what``)."""

    def new_stream(self, priority: int = 0):
        return CudaStream(self, priority=priority)

    def load_function(self, program, expr: str, signature, reference, generics: dict):
        """The kernel ``expr`` of ``program`` loaded here (its layout checked by the driver).
        (``reference`` and ``generics`` are what the reference device runs instead.)"""
        return load_module(program, self).get_function(expr, signature, label=expr, symbol=program.symbol(expr))

    def new_event(self, timing: bool = True):
        return CudaEvent(self, timing=timing)

    def foreign(self, label: str, body, reference, warmup):
        """Foreign work here: its ``body`` runs (``reference`` is what the reference device runs)."""
        return foreign_work.GpuForeign(label, body, warmup)

    @staticmethod
    def launch_host_func(stream, fn, label: str):
        """Enqueue ``fn()`` on ``stream`` (runtime/foreign.py); a registration to keep when captured."""
        return foreign_work.launch_host_func(stream, fn, label)

    def conditional_nodes(self) -> tuple[bool, str]:
        """``(supported, why not)``: can graphs captured here hold conditional
        (WHILE) nodes, which captured loops become?  (CUDA 12.4 drivers and up.)"""
        return driver.conditional_nodes_support()

    def conditional_branches(self) -> tuple[bool, str]:
        """``(supported, why not)``: can one conditional node hold several bodies (IF/ELSE,
        SWITCH: CUDA 12.8 drivers and up)?  Without, each branch is an IF node of its own."""
        return driver.conditional_branches_support()

    def synchronize(self) -> None:
        self.bind()
        code = cu.cuCtxSynchronize()[0]
        if code:  # refused while any stream captures: a CaptureSyncError (a CudaError too)
            sync_failed(code, "cuCtxSynchronize", CTX_SYNC, whose="a stream of this device is")

    def memory_info(self) -> tuple[int, int]:
        """``(free, total)`` device memory in bytes."""
        self.bind()
        return check(cu.cuMemGetInfo(), "cuMemGetInfo")

    def peer_memory(self, nbytes: int):
        """A zeroed buffer other processes' GPUs can map and store into (runtime/ipc.py)."""
        from .ipc import IpcPeerMemory
        return IpcPeerMemory(self, nbytes)

    # -- memory: CuPy arrays from CuPy's pool (tensor.py says why CuPy) ----------
    def alloc(self, dims, dt, stream):
        import cupy
        stream = stream if stream is not None else self.default_stream()
        # bound first: entering cupy.cuda.Device(n) reads the runtime's current device (0 on a
        # thread with no context current) and restores it on exit, which would open GPU 0
        self.bind()
        try:
            with cupy.cuda.Device(self.ordinal), stream.cupy:
                return cupy.empty(dims, dtype=dt.np)
        except cupy.cuda.memory.OutOfMemoryError as exc:
            free, total = self.memory_info()
            raise OutOfMemoryError(f"allocating {math.prod(dims) * dt.itemsize} bytes for a {dt.name} tensor of "
                                   f"shape {dims}", 2, "CUDA_ERROR_OUT_OF_MEMORY",
                                   f"{free / 2**20:.0f} MiB of {total / 2**20:.0f} MiB free ({exc})",
                                   "Free tensors or graphs you no longer need, or allocate less") from None

    @staticmethod
    def address(array) -> int:
        return int(array.data.ptr)

    @staticmethod
    def extent(array):
        """``(lo, hi)`` of the pool allocation behind ``array``, or None when unknown."""
        mem = getattr(getattr(array, "data", None), "mem", None)
        return (int(mem.ptr), int(mem.ptr) + int(mem.size)) if mem is not None and mem.size else None

    @staticmethod
    def view_array(base, ptr: int, shape, byte_strides, dtype):
        import cupy
        return cupy.ndarray(shape, dtype, base.data + (ptr - base.data.ptr), byte_strides)

    def from_host(self, host, dt, stream):
        array = self.alloc(host.shape, dt, stream)
        self.bind()  # CuPy's set() enters the array's device and restores the current one after
        array.set(host, stream=(stream or self.default_stream()).cupy)
        return array

    def import_dlpack(self, obj, stream):
        """``obj``'s memory as a CuPy array, ordered on ``stream``: CuPy hands the
        producer this stream (``__dlpack__(stream=...)``), and the producer makes it
        wait for the work still writing the memory."""
        import cupy
        kind = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else None
        if kind is not None and int(kind) not in (2, 13):  # kDLCUDA, kDLCUDAManaged
            raise StateError(f"{producer_name(obj)} lives in host memory (DLPack device type {int(kind)}); "
                             "zero-copy import needs device memory: copy it with dop.from_numpy(...)")
        self.bind()  # (see alloc)
        with cupy.cuda.Device(self.ordinal), stream.cupy:
            return cupy.from_dlpack(obj)

    def export_dlpack(self, array, stream, consumer, kwargs: dict):
        """The DLPack capsule of ``array`` for a consumer on stream ``consumer`` (the
        DLPack protocol's integer: 1 the legacy default stream, 2 per-thread, -1 no
        ordering, None the legacy stream): the consumer's stream first waits for the
        work queued on ``stream`` so far (nothing to wait for when it is ``stream``: a
        foreign op's body imports its tensors on the stream it captures, where an event
        would be one more capture call)."""
        if consumer != -1:
            handle = 1 if consumer is None else int(consumer)  # None means the legacy stream (DLPack)
            if handle == stream.ptr:
                return array.__dlpack__(stream=-1, **kwargs)
            event = stream.record_event(timing=False)
            CudaStream.from_handle(self, handle).wait_event(event)
        return array.__dlpack__(stream=-1, **kwargs)

    def import_cuda_array(self, obj):
        import cupy
        self.bind()  # (see alloc)
        with cupy.cuda.Device(self.ordinal):
            return cupy.asarray(obj)  # CuPy wraps CAI memory without copying

    def contiguous(self, array, stream):
        import cupy
        self.bind()  # (see alloc)
        with cupy.cuda.Device(self.ordinal), stream.cupy:
            return cupy.ascontiguousarray(array)

    @staticmethod
    def to_host(array, stream):
        stream.device.bind()  # CuPy's get() enters the array's device and restores the current one after
        out = array.get(stream=stream.cupy)
        stream.synchronize()
        return out

    @staticmethod
    def cuda_array_interface(array):
        return array.__cuda_array_interface__

    @staticmethod
    def cupy_array(array):
        return array

    def __repr__(self) -> str:
        return f"<CUDA device {self.ordinal}: {self.name}, {self.arch}, {self.sm_count} SMs, {self.total_memory / 2**30:.1f} GiB>"


def device_key(device) -> tuple:
    """What caches of compiled and loaded things key a device by: its kind and ordinal
    (a reference device 0 and GPU 0 may share a process, and must not share a cache entry)."""
    return type(device), device.ordinal


def as_device(device):
    """``device`` (a Device, or its ordinal: ``device=0``) as a Device; None stays None.
    An ordinal without a device, or what is no ordinal, is Device's NoDeviceError."""
    if device is None or isinstance(device, Device) or hasattr(device, "is_reference"):
        return device
    if isinstance(device, bool):  # operator.index(True) is 1: not an ordinal anyone means
        raise NoDeviceError(f"a device ordinal is an int (0 for the first GPU), got {device!r}")
    return Device(device)


def placed(what: str, device, stream, thing: str = "the tensor", movable: bool = True):
    """``(device, stream)`` of a tensor operation given either or both: ``stream`` (None:
    the device's default) must be a live deviceop stream of ``device`` (a Device or its
    ordinal); an omitted ``device`` is the stream's, else Device(0)."""
    device = as_device(device)
    if stream is not None:
        home = getattr(stream, "device", None)
        if home is None:
            raise not_a_stream(what, stream)
        if home is _CLOSED:
            raise closed_stream(what)
        refuse_if_captured_elsewhere(what, stream)  # another thread captures it: not into its graph
        if device is None:
            return home, stream
        if home is not device:  # identity: thread-ranks' reference devices share a kind and an ordinal
            raise wrong_device(what, home, device, thing, movable)
    return (device if device is not None else Device(0)), stream


def wrong_device(what: str, stream_device, tensor_device, tensor: str = "the tensor",
                 movable: bool = True) -> LaunchError:
    """The error of work on a stream of one device with a tensor of another: a GPU given
    another GPU's pointer faults (the context is lost) or reads the wrong memory.  ``movable``:
    the thing can be copied to the stream's device (a tensor), unlike a graph."""
    return LaunchError(f"{what}: the stream is on {stream_device.label}, {tensor} on {tensor_device.label}; "
                       f"use a stream of the {'tensor' if movable else 'graph'}'s device ({tensor_device.label}: "
                       "device.new_stream(), or "
                       "no stream= where the device is inferred)"
                       + (", or copy the tensor there first (api.memcpy)" if movable else
                          ", or capture the work again on a stream of the other device"))


def load_module(program, device=None) -> CudaModule:
    """Load ``program`` on ``device`` once; later calls return the same module."""
    device = device if device is not None else Device(0)
    key = (*device_key(device), program.key or str(id(program)))
    mod = _loaded.get(key)
    if mod is None:
        with _instances_lock:
            mod = _loaded.get(key)
            if mod is None:
                mod = _loaded[key] = CudaModule(device, program)
    return mod


def current_device() -> Device:
    return Device(0)


def pointer_ordinal(address: int) -> int | None:
    """The ordinal of the GPU whose memory ``address`` is (a foreign array's pointer), or
    None: no driver, or memory the driver does not know (host memory)."""
    if not driver.driver_available():
        return None
    try:
        code, ordinal = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                                 int(address))
        return None if code else int(ordinal)
    except Exception:  # noqa: BLE001 - a binding that cannot say: the caller keeps its default
        return None


def default_arch() -> str:
    """The arch code is compiled for when none is named: that of the lowest-numbered GPU this
    process opened (a tensor-parallel rank drives one GPU, not GPU 0), else GPU 0's, read from
    the driver without opening a context there (a context costs memory on its GPU)."""
    if not driver.driver_available():
        return Device(0).arch
    opened = sorted((key[1], dev) for key, dev in list(_instances.items()) if key[0] is CudaDevice)
    if opened:
        return opened[0][1].arch
    handle = check(cu.cuDeviceGet(0), "cuDeviceGet")
    attr = cu.CUdevice_attribute
    major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle),
                  "cuDeviceGetAttribute")
    minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle),
                  "cuDeviceGetAttribute")
    return f"sm_{major}{minor}"


def Event(device=None, *, timing: bool = True):
    """A new event on ``device`` (default: ``Device(0)``)."""
    device = device if device is not None else Device(0)
    return device.new_event(timing=timing)


_ARCH_SPELLING = re.compile(r"(?:sm_|compute_)?(\d+)([af]?)", re.I)
_ARCHS: dict[str, str] = {}


def arch_from_environment(text: str) -> str:
    """``DEVICEOP_ARCH`` spelled as NVRTC's arch (``90``, ``SM_90`` -> ``sm_90``): read as it was
    given, the device's per-arch facts (its shared-memory limit) were unknown, and went unchecked."""
    arch = _ARCHS.get(text)
    if arch is None:
        m = _ARCH_SPELLING.fullmatch(text.strip())
        if not m:
            raise ConfigError(f"DEVICEOP_ARCH={text!r} is not a GPU architecture: write it like sm_90 (the arch "
                              "the reference device compiles for), or unset it for sm_90")
        arch = _ARCHS[text] = f"sm_{int(m.group(1))}{m.group(2).lower()}"
    return arch
