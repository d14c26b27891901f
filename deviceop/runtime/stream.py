"""Streams and events.

A :class:`CudaStream` is a non-blocking CUDA stream owned by deviceop.  The
legacy default stream can be wrapped (``Stream.legacy(device)``) for
interoperability, but it is refused for graph capture: CUDA cannot capture it.
"""
from __future__ import annotations

import math
import threading

import numpy as np
from cuda.bindings import driver as cu

from ..errors import CaptureError, CaptureSyncError, LaunchError, NoDeviceError, StateError
from .driver import check, error_name, raise_error

_NON_BLOCKING = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
# What the driver answers a host sync during a capture (the capture is invalidated then),
# and a wait on an event last recorded in a capture.
_CAPTURE_REFUSALS = ("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
_CAPTURED_EVENT = "CUDA_ERROR_CAPTURED_EVENT"
_CAPTURE_MODES = {
    "relaxed": cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED,
    "thread_local": cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    "global": cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL,
}


def sync_in_capture(what: str, call: str, code_name: str = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                    whose: str = "the stream is") -> CaptureSyncError:
    """The error of the host sync ``what`` (driver call ``call``) while a stream
    is capturing a graph: one wording, and one type, for the GPU and the reference device."""
    if code_name == _CAPTURED_EVENT:
        message = (f"{what} on an event last recorded while its stream was capturing a graph ({code_name}): "
                   "such an event marks a point of the graph, not of the stream's work. Record it again "
                   "outside the capture to wait for it, or wait after a replay")
    else:
        message = (f"{what} was called while {whose} capturing a graph ({code_name}): a host sync cannot be "
                   "recorded, and it breaks the capture. Wait before the capture begins or after it ends; "
                   "inside a capture or scope, only record work")
    return CaptureSyncError(message, call, int(getattr(cu.CUresult, code_name)), code_name)


def sync_failed(code, call: str, what: str, whose: str = "the stream is") -> None:
    """Raise the error of the failed driver ``call`` behind the host sync ``what``."""
    name = error_name(code)
    if name in _CAPTURE_REFUSALS or name == _CAPTURED_EVENT:
        raise sync_in_capture(what, call, name, whose)
    raise_error(code, call)


def not_a_stream(what: str, stream) -> LaunchError:
    return LaunchError(f"{what} needs a deviceop stream (device.new_stream(), or CudaStream.from_handle(...) for "
                       f"another library's), got {'None' if stream is None else type(stream).__name__}")


# The streams deviceop's graph layer is capturing: stream_key -> (thread ident, thread name,
# label), while the capture is open.  Eager work other threads enqueue on them is refused.
capturing: dict = {}


def stream_key(stream):
    """What names a stream's queue: its CUDA handle (two wrappers of one stream agree), else the object."""
    return getattr(stream, "ptr", None) or id(stream)


def captured_elsewhere(what: str, owner) -> CaptureError:
    """The error of work enqueued on a stream that another thread is capturing (``owner``:
    its entry in ``capturing``)."""
    _, thread, label = owner
    return CaptureError(f"{what} on a stream that another thread ({thread}) is capturing into a graph "
                        f"({label}): its work would be recorded into that graph, never run now and run at every "
                        "replay. Enqueue it on a stream of its own (device.new_stream()), or once that capture "
                        "has ended")


def refuse_if_captured_elsewhere(what: str, stream) -> None:
    """Refuse work from this thread on ``stream`` while another thread captures it (nothing is enqueued)."""
    if capturing:
        owner = capturing.get(stream_key(stream))
        if owner is not None and owner[0] != threading.get_ident():
            raise captured_elsewhere(what, owner)


def closed_stream(what: str) -> StateError:
    return StateError(f"{what} on a stream that was closed (stream.close()); use a live stream "
                      "(device.new_stream())")


class _ClosedDevice:
    """A closed stream's ``device``: every execution, capture or copy asks its
    stream's device something first, and the answer is that the stream was closed
    (so live streams pay nothing for the check)."""

    __slots__ = ()

    def __getattr__(self, name):
        raise closed_stream("work (an op, a capture, a copy)")

    def __repr__(self) -> str:
        return "<the device of a closed stream>"


_CLOSED = _ClosedDevice()


class ProcessHandle:
    """A handle to a driver object of this process (stream, event, graph): a copy is the
    same handle, as a Device's is; pickling one is refused (it means nothing elsewhere)."""

    __slots__ = ()

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce_ex__(self, protocol):
        raise StateError(f"pickling a {type(self).__name__}: it is a handle to a driver object of this "
                         "process; make one where it is needed (device.new_stream(), stream.record_event(), "
                         "op.graph_on(stream))")


class _NoCudaStream(NoDeviceError, AttributeError):
    """A NoDeviceError that hasattr() and getattr(..., default) still read as a missing attribute."""


# What only a CUDA stream has: the reference device's streams refuse them, naming why
_CUDA_ONLY = frozenset({"ptr", "handle", "torch", "cupy", "__cuda_stream__"})


def no_cuda_stream(stream, name: str):
    """A host-only stream's ``__getattr__`` (reached only where the attribute is missing): what
    only a CUDA stream has is refused naming why, and hasattr() still reads it as missing."""
    if name in _CUDA_ONLY:
        raise _NoCudaStream(f"stream.{name}: this is a stream of the reference device, which has no CUDA "
                            "stream (its work runs on the host); another library's GPU work needs a GPU: run "
                            "it there (scripts/gpu-check), and give dop.foreign a reference= for this device")
    raise AttributeError(f"{type(stream).__name__!r} object has no attribute {name!r}")


class Stream(ProcessHandle):
    """Base of :class:`CudaStream` and the reference device's ``ReferenceStream``."""

    device = None
    is_legacy = False

    def synchronize(self) -> None:
        raise NotImplementedError

    def record_event(self, event=None, *, timing: bool = True):
        """Record ``event`` (a new one if None) on this stream and return it."""
        event = event if event is not None else self.device_event(timing=timing)
        event.record(self)
        return event

    def device_event(self, timing: bool = True):
        return self.device.new_event(timing=timing)


class CudaStream(Stream):
    def __init__(self, device, *, priority: int = 0, handle=None, owned: bool = True):
        self.device = device
        device.bind()
        if handle is None:
            handle = check(cu.cuStreamCreateWithPriority(_NON_BLOCKING, priority), "cuStreamCreateWithPriority")
        self.handle = handle
        self.ptr = int(handle)  # the handle as an int: what each kernel launch passes (None once closed)
        self._owned = owned
        self.is_legacy = int(handle) in (0, int(cu.CU_STREAM_LEGACY))
        self._cupy = self._torch = None

    @classmethod
    def legacy(cls, device) -> "CudaStream":
        """The legacy default stream (synchronizes with every blocking stream)."""
        return cls(device, handle=cu.CUstream(cu.CU_STREAM_LEGACY), owned=False)

    @classmethod
    def from_handle(cls, device, handle: int) -> "CudaStream":
        """Wrap a stream someone else owns (PyTorch, CuPy ...); deviceop will not destroy it."""
        return cls(device, handle=cu.CUstream(int(handle)), owned=False)

    def __int__(self) -> int:
        return int(self.handle)

    def _live(self, what: str):
        """The handle; a closed stream's would be None, which the driver reads as the legacy stream."""
        handle = self.handle
        if handle is None:
            raise closed_stream(what)
        return handle

    def synchronize(self) -> None:
        code = cu.cuStreamSynchronize(self._live("synchronize()"))[0]
        if code:
            sync_failed(code, "cuStreamSynchronize", "stream.synchronize()")

    def query(self) -> bool:
        """True when all work on the stream has finished."""
        code = cu.cuStreamQuery(self._live("query()"))[0]
        if code == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if code:
            sync_failed(code, "cuStreamQuery", "stream.query()")
        return True

    def wait_event(self, event: "CudaEvent") -> None:
        """Make future work on this stream wait for ``event``."""
        check(cu.cuStreamWaitEvent(self._live("wait_event()"), event.handle, 0), "cuStreamWaitEvent")

    def wait_stream(self, other: "CudaStream") -> None:
        """Make future work on this stream wait for the work queued on ``other`` so far."""
        self.wait_event(other.record_event(timing=False))

    # -- capture (the graph layer builds on these) -------------------------
    def is_capturing(self) -> bool:
        status = check(cu.cuStreamIsCapturing(self._live("is_capturing()")), "cuStreamIsCapturing")
        return status == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE

    def begin_capture(self, mode: str = "relaxed") -> None:
        if self.is_legacy:
            raise CaptureError("the legacy default stream cannot be captured; "
                               "capture on a stream from device.new_stream()")
        if mode not in _CAPTURE_MODES:
            raise CaptureError(f"unknown capture mode {mode!r}; use one of {sorted(_CAPTURE_MODES)}")
        if self.is_capturing():
            raise CaptureError("this stream is already capturing; end that capture first")
        self.device.bind()
        check(cu.cuStreamBeginCapture(self.handle, _CAPTURE_MODES[mode]), "cuStreamBeginCapture")

    def end_capture(self):
        """End the capture; returns the CUgraph (raises if the capture was invalidated)."""
        return check(cu.cuStreamEndCapture(self.handle), "cuStreamEndCapture")

    # -- data movement on the stream (the reference stream has the same methods) --
    def memcpy(self, dst: int, src: int, nbytes: int, call: str = "cuMemcpyAsync") -> None:
        """Copy ``nbytes`` from device address ``src`` to ``dst``, ordered on this stream."""
        code = cu.cuMemcpyAsync(dst, src, nbytes, self._live("a copy"))[0]
        if code:
            raise_error(code, call)

    def memset8(self, dst: int, value: int, count: int, call: str = "cuMemsetD8Async") -> None:
        code = cu.cuMemsetD8Async(dst, value, count, self._live("a memset"))[0]
        if code:
            raise_error(code, call)

    def memset16(self, dst: int, value: int, count: int) -> None:
        check(cu.cuMemsetD16Async(dst, value, count, self._live("a memset")), "cuMemsetD16Async")

    def memset32(self, dst: int, value: int, count: int) -> None:
        check(cu.cuMemsetD32Async(dst, value, count, self._live("a memset")), "cuMemsetD32Async")

    def fill(self, array, value) -> None:
        """Set every element of the CuPy ``array`` to ``value``, ordered on this stream."""
        self._live("a fill")
        self.device.bind()  # CuPy launches its fill kernel on its current device (the bound context's)
        with self.cupy:
            if value == 0 and math.copysign(1.0, value) < 0 and array.dtype.kind not in "biu":
                # CuPy memsets a fill that == 0, so -0.0 would become +0.0 (NumPy keeps it): fill its bits
                bits = np.dtype(f"u{array.dtype.itemsize}")
                array.view(bits).fill(np.array(value, dtype=array.dtype).view(bits).item())
            else:
                array.fill(value)

    def upload(self, array, host) -> None:
        """Copy the host array ``host`` into the CuPy ``array``, ordered on this stream."""
        self._live("an upload")
        self.device.bind()  # CuPy's set() enters the array's device and restores the current one after
        array.set(host, stream=self.cupy)

    # -- interop -----------------------------------------------------------
    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol (cuda.core, CuPy and others accept this object)."""
        return (0, int(self._live("__cuda_stream__")))

    @property
    def cupy(self):
        """This stream as a CuPy stream (``with stream.cupy:`` runs CuPy work on it)."""
        if self._cupy is None:
            import cupy
            self._cupy = cupy.cuda.Stream.from_external(self)
        return self._cupy

    @property
    def torch(self):
        """This stream as a ``torch.cuda.ExternalStream`` (``with torch.cuda.stream(stream.torch):``
        runs torch work, and Triton kernels, on it)."""
        if self._torch is None:
            import torch
            self._torch = torch.cuda.ExternalStream(int(self._live("stream.torch")),
                                                    device=torch.device("cuda", self.device.ordinal))
        return self._torch

    def close(self) -> None:
        """Destroy the stream (idempotent); later work on it raises StateError."""
        if self._owned and self.handle is not None:
            handle, self.handle, self.ptr = self.handle, None, None
            self._ordinal, self.device = self.device.ordinal, _CLOSED
            check(cu.cuStreamDestroy(handle), "cuStreamDestroy")

    def __del__(self):
        try:
            if self._owned and self.handle is not None:
                cu.cuStreamDestroy(self.handle)
        except Exception:
            pass

    def __repr__(self) -> str:
        if self.handle is None:
            return f"<closed stream on device {self._ordinal}>"
        kind = "legacy default stream" if self.is_legacy else f"stream 0x{int(self.handle):x}"
        return f"<{kind} on device {self.device.ordinal}>"


class CudaEvent(ProcessHandle):
    def __init__(self, device, *, timing: bool = True):
        self.device = device
        device.bind()
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(cu.cuEventCreate(flags), "cuEventCreate")
        self.timing = timing

    def record(self, stream: CudaStream) -> "CudaEvent":
        check(cu.cuEventRecord(self.handle, stream._live("recording an event")), "cuEventRecord")
        return self

    def synchronize(self) -> None:
        code = cu.cuEventSynchronize(self.handle)[0]
        if code:
            sync_failed(code, "cuEventSynchronize", "event.synchronize()")

    def query(self) -> bool:
        code = cu.cuEventQuery(self.handle)[0]
        if code == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if code:
            sync_failed(code, "cuEventQuery", "event.query()")
        return True

    def elapsed_ms(self, end: "CudaEvent") -> float:
        """Milliseconds from this event to ``end`` (both recorded, ``end`` complete)."""
        if not (self.timing and end.timing):
            raise StateError("elapsed time needs events created with timing=True")
        return check(cu.cuEventElapsedTime(self.handle, end.handle), "cuEventElapsedTime")

    def __del__(self):
        try:
            cu.cuEventDestroy(self.handle)
        except Exception:
            pass
