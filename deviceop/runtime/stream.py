"""Streams and events.

A :class:`CudaStream` is a non-blocking CUDA stream owned by deviceop.  The
legacy default stream can be wrapped (``Stream.legacy(device)``) for
interoperability, but it is refused for graph capture: CUDA cannot capture it.
"""
from __future__ import annotations

import time

from cuda.bindings import driver as cu

from ..errors import CaptureError, StateError
from .driver import check, raise_error

_NON_BLOCKING = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
_CAPTURE_MODES = {
    "relaxed": cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED,
    "thread_local": cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    "global": cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL,
}


class Stream:
    """Base of :class:`CudaStream` and :class:`ReferenceStream`."""

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
        raise NotImplementedError


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
        self._cupy = None

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

    def synchronize(self) -> None:
        check(cu.cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def query(self) -> bool:
        """True when all work on the stream has finished."""
        code = cu.cuStreamQuery(self.handle)[0]
        if code == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if code:
            raise_error(code, "cuStreamQuery")
        return True

    def wait_event(self, event: "CudaEvent") -> None:
        """Make future work on this stream wait for ``event``."""
        check(cu.cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")

    def wait_stream(self, other: "CudaStream") -> None:
        """Make future work on this stream wait for the work queued on ``other`` so far."""
        self.wait_event(other.record_event(timing=False))

    def device_event(self, timing: bool = True) -> "CudaEvent":
        return CudaEvent(self.device, timing=timing)

    # -- capture (the graph layer builds on these) -------------------------
    def is_capturing(self) -> bool:
        status = check(cu.cuStreamIsCapturing(self.handle), "cuStreamIsCapturing")
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

    # -- interop -----------------------------------------------------------
    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol (cuda.core, CuPy and others accept this object)."""
        return (0, int(self.handle))

    @property
    def cupy(self):
        """This stream as a CuPy stream (``with stream.cupy:`` runs CuPy work on it)."""
        if self._cupy is None:
            import cupy
            self._cupy = cupy.cuda.Stream.from_external(self)
        return self._cupy

    def close(self) -> None:
        if self._owned and self.handle is not None:
            handle, self.handle, self.ptr = self.handle, None, None
            check(cu.cuStreamDestroy(handle), "cuStreamDestroy")

    def __del__(self):
        try:
            if self._owned and self.handle is not None:
                cu.cuStreamDestroy(self.handle)
        except Exception:
            pass

    def __repr__(self) -> str:
        kind = "legacy default stream" if self.is_legacy else f"stream 0x{int(self.handle):x}"
        return f"<{kind} on device {self.device.ordinal}>"


class CudaEvent:
    def __init__(self, device, *, timing: bool = True):
        self.device = device
        device.bind()
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(cu.cuEventCreate(flags), "cuEventCreate")
        self.timing = timing

    def record(self, stream: CudaStream) -> "CudaEvent":
        check(cu.cuEventRecord(self.handle, stream.handle), "cuEventRecord")
        return self

    def synchronize(self) -> None:
        check(cu.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def query(self) -> bool:
        code = cu.cuEventQuery(self.handle)[0]
        if code == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if code:
            raise_error(code, "cuEventQuery")
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


class ReferenceStream(Stream):
    """A stream of the reference device: work runs on the host at once."""

    def __init__(self, device):
        self.device = device
        self._capturing = False

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def device_event(self, timing: bool = True) -> "ReferenceEvent":
        return ReferenceEvent(self.device, timing=timing)

    def is_capturing(self) -> bool:
        return self._capturing

    def __repr__(self) -> str:
        return f"<reference stream 0x{id(self):x}>"


class ReferenceEvent:
    """Host-clock event of the reference device."""

    def __init__(self, device, *, timing: bool = True):
        self.device, self.timing, self._t = device, timing, None

    def record(self, stream) -> "ReferenceEvent":
        self._t = time.perf_counter()
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_ms(self, end: "ReferenceEvent") -> float:
        if self._t is None or end._t is None:
            raise StateError("both events must be recorded before elapsed_ms")
        return (end._t - self._t) * 1e3


def Event(device=None, *, timing: bool = True):
    """A new event on ``device`` (default: ``Device(0)``)."""
    from .device import Device
    device = device if device is not None else Device(0)
    return ReferenceEvent(device, timing=timing) if device.is_reference else CudaEvent(device, timing=timing)
