"""Devices: a CUDA GPU, or the reference device on a machine without one.

``Device(0)`` returns the same object every time for an ordinal.  Where the
process has no usable GPU it returns the :class:`ReferenceDevice` instead and
says so once on stderr: the reference device runs each kernel's NumPy
reference, so the library, its tests, examples and docs work everywhere —
but nothing measured on it says anything about a GPU.
"""
from __future__ import annotations

import operator
import os
import sys
import threading
import weakref

from cuda.bindings import driver as cu

from ..errors import NoDeviceError
from . import driver
from .driver import check

_instances: dict[tuple[type, int], "Device"] = {}
_instances_lock = threading.Lock()
_CTX_SYNC = "device.synchronize() (which Tensor.numpy() without stream= calls)"


class Device:
    """Base of :class:`CudaDevice` and :class:`ReferenceDevice`.

    Calling ``Device(ordinal)`` picks the right one."""

    is_reference: bool = False
    ordinal: int
    name: str

    def __new__(cls, ordinal: int = 0):
        if cls is Device:
            cls = CudaDevice if driver.driver_available() else ReferenceDevice
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
        self._tls = threading.local()
        self.bind()

    def _attr(self, attribute) -> int:
        return check(cu.cuDeviceGetAttribute(attribute, self.handle), "cuDeviceGetAttribute")

    @property
    def arch(self) -> str:
        """The NVRTC target of this device, e.g. ``"sm_90"``."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    def bind(self) -> None:
        """Make this device's primary context current on the calling thread
        (cheap after the first call on a thread)."""
        if getattr(self._tls, "bound", False):
            return
        check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self._tls.bound = True

    def new_stream(self, priority: int = 0):
        from .stream import CudaStream
        return CudaStream(self, priority=priority)

    def conditional_nodes(self) -> tuple[bool, str]:
        """``(supported, why not)``: can graphs captured here hold conditional
        (WHILE) nodes, which captured loops become?  (CUDA 12.4 drivers and up.)"""
        return driver.conditional_nodes_support()

    def synchronize(self) -> None:
        self.bind()
        code = cu.cuCtxSynchronize()[0]
        if code:  # refused while any stream captures: a CaptureSyncError (a CudaError too)
            from .stream import sync_failed
            sync_failed(code, "cuCtxSynchronize", _CTX_SYNC, whose="a stream of this device is")

    def memory_info(self) -> tuple[int, int]:
        """``(free, total)`` device memory in bytes."""
        self.bind()
        return check(cu.cuMemGetInfo(), "cuMemGetInfo")

    def __repr__(self) -> str:
        return f"<CUDA device {self.ordinal}: {self.name}, {self.arch}, {self.sm_count} SMs, {self.total_memory / 2**30:.1f} GiB>"


_announced = False


class ReferenceDevice(Device):
    """The device of a machine without a GPU: kernels run their NumPy
    references on the host, graphs record launches and replay them.  It exists
    so that everything above the runtime is testable anywhere; it is never
    what a benchmark measures."""

    is_reference = True
    compute_capability = None
    sm_count = 0
    total_memory = 0
    l2_cache_size = 0
    max_shared_memory_per_block = 0

    def _setup(self, ordinal: int) -> None:
        global _announced
        self.reason = driver.probe()[1]
        if ordinal != 0:  # a GPU machine without GPU `ordinal` refuses it too (CudaDevice._setup)
            raise NoDeviceError(f"no CUDA device {ordinal}: this process has no GPU ({self.reason}), only the "
                                "reference device, Device(0); use Device(0), or run on a machine with that GPU")
        self.ordinal = ordinal
        self.name = "deviceop reference device (NumPy)"
        self._streams = weakref.WeakSet()  # every stream made on it (a context-wide sync checks their captures)
        if not _announced:
            _announced = True
            print(f"deviceop: no CUDA GPU ({self.reason}); using the reference device, which runs "
                  "kernels' NumPy references on the CPU. Its timings say nothing about a GPU.",
                  file=sys.stderr)

    @property
    def arch(self) -> str:
        """The architecture NVRTC compiles for here (``DEVICEOP_ARCH``, default
        ``sm_90``, the H100): compiling needs no GPU."""
        return os.environ.get("DEVICEOP_ARCH", "sm_90")

    def bind(self) -> None:
        pass

    def conditional_nodes(self) -> tuple[bool, str]:
        """Always ``(True, "")``: a captured loop replays its body's tape on the host."""
        return True, ""

    def new_stream(self, priority: int = 0):
        from .stream import ReferenceStream
        return ReferenceStream(self)

    def synchronize(self) -> None:
        """Refused while any of its streams captures, and breaks those captures, as ``cuCtxSynchronize`` on a GPU."""
        capturing = [s for s in list(self._streams) if s._capturing]
        if capturing:
            for s in capturing:
                s._break_capture()
            from .stream import sync_in_capture
            raise sync_in_capture(_CTX_SYNC, "cuCtxSynchronize", whose="a stream of this device is")

    def memory_info(self) -> tuple[int, int]:
        return (0, 0)

    def __repr__(self) -> str:
        return f"<reference device: {self.reason}>"


def current_device() -> Device:
    return Device(0)
