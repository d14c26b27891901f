"""Foreign work on a CUDA device: another library's GPU work (cuBLAS through
torch or CuPy, a Triton kernel, an NCCL call ...) run on the stream deviceop
hands it, eagerly or into a graph being captured, and host functions
enqueued on a stream (``cuLaunchHostFunc``).

Captured, the library's work is captured on its own: on this thread's *side
stream*, in CUDA's thread-local capture mode, into a graph of its own that
becomes one child-graph node of the capture in progress.  That is what lets
deviceop see what a capture would otherwise miss or get wrong, and refuse it
with nothing half-recorded:

* thread-local mode refuses the calls a graph cannot replay (``cudaMalloc``,
  a synchronization, a synchronous copy) made on this thread, where the
  capture deviceop begins for its own work is relaxed (docs/robustness.md);
* the side stream is a *blocking* stream, so work put on the legacy default
  stream (torch's and CuPy's default) while it captures is refused by the
  driver (``CUDA_ERROR_STREAM_CAPTURE_IMPLICIT``) instead of running once;
* a body that captured no work at all put it on some other stream;
* work put on the capturing stream itself shows in that stream's dependencies;
* allocations through torch's caching allocator (which relaxes the capture
  mode for its own ``cudaMalloc``, and reuses freed blocks without one) show in
  its counters.
"""
from __future__ import annotations

import ctypes
import itertools
import sys
import threading

from cuda.bindings import driver as cu

from ..errors import CaptureError
from .driver import check, driver_available, error_name, raise_error
from .stream import CudaStream

_THREAD_LOCAL = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
_SET_DEPENDENCIES = cu.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
_side = threading.local()


def side_stream(device) -> CudaStream:
    """This thread's stream for capturing foreign work on ``device`` (blocking: see the
    module docstring); warm-ups run on it too, so that what a library keys by stream
    (torch's cuBLAS workspace) is ready for the capture."""
    streams = _side.__dict__.setdefault("streams", {})
    stream = streams.get(device.ordinal)
    if stream is None:
        device.bind()
        handle = check(cu.cuStreamCreate(0), "cuStreamCreate")  # flags 0: a blocking stream
        stream = streams[device.ordinal] = CudaStream(device, handle=handle, owned=True)
    return stream


class GpuForeign:
    """Foreign work on a CUDA device (``device.foreign(...)``); ``run`` executes it once."""

    def __init__(self, label: str, body, warmup):
        self.label, self.body, self.warmup = label, body, warmup

    def run(self, stream, bind, arrays, capture) -> None:
        """Run the body on ``stream`` (eager), or capture it into the graph ``stream`` is
        capturing (``capture``: the capture in progress, whose ``before`` is an event
        recorded on the stream before it began).  ``bind(s)`` gives the body's tensor
        arguments ``(args, kwargs)`` for stream ``s``; ``arrays`` is the reference device's."""
        stream.device.bind()  # a library in the body works on the current device (CuPy, cuBLAS handles)
        if capture is None:
            args, kwargs = bind(stream)
            self.body(stream, *args, **kwargs)
            return
        side = side_stream(stream.device)
        if self.warmup is not None:
            before = getattr(capture, "before", None)
            if before is not None:
                side.wait_event(before)  # after what the stream did before the capture; not after its graph
            warm = self.body if self.warmup is True else self.warmup
            args, kwargs = bind(side)
            warm(side, *args, **kwargs)
            side.synchronize()
        child = self._capture(stream, side, bind)
        try:
            _add_child(stream, child, self.label)
        finally:
            check(cu.cuGraphDestroy(child), "cuGraphDestroy")  # the node holds a clone

    def _capture(self, stream, side, bind):
        """The body's work, captured on ``side`` into a graph of its own (or a CaptureError)."""
        tips = _dependencies(stream)
        allocations = _torch_allocations(stream.device)
        side.begin_capture("thread_local")
        try:
            mode = check(cu.cuThreadExchangeStreamCaptureMode(_THREAD_LOCAL), "cuThreadExchangeStreamCaptureMode")
            try:
                args, kwargs = bind(side)
                self.body(side, *args, **kwargs)
            finally:
                cu.cuThreadExchangeStreamCaptureMode(mode)
        except BaseException as exc:
            code, graph = cu.cuStreamEndCapture(side.handle)
            _destroy(graph)
            err = broken(self.label, exc, error_name(code) if code else None)
            if err is None:
                raise  # not the capture's doing: the body's own error, unchanged
            raise err from exc
        code, graph = cu.cuStreamEndCapture(side.handle)
        if code:
            _destroy(graph)
            raise broken(self.label, None, error_name(code))
        try:
            self._check_captured(stream, graph, tips, allocations)
        except BaseException:
            _destroy(graph)
            raise
        return graph

    def _check_captured(self, stream, graph, tips, allocations) -> None:
        """Refuse a capture that went through but missed or misplaced the body's work."""
        if _dependencies(stream) != tips:
            raise CaptureError(
                f"{self.label} enqueued work on {stream!r}, the stream deviceop is capturing, instead of on the "
                "stream the body is handed (its first argument): that work would sit in the graph outside the "
                "op. Enqueue everything on the handed stream `s` (with torch.cuda.stream(s.torch), with s.cupy, "
                "or pass s / s.ptr to the library)")
        made = _torch_allocations(stream.device) - allocations
        if made:
            raise CaptureError(
                f"{self.label} allocated {made} block(s) through torch's caching allocator while it was being "
                "captured: torch frees such a temporary when the body returns and hands its memory out again, "
                "while every replay of the graph still writes it. Write into the declared writes (out=...), "
                "allocate any scratch buffer before capturing and declare it in writes=, and let warmup=True "
                "run the body once before the capture so that libraries allocate their workspaces then")
        if not check(cu.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")[1]:
            raise CaptureError(
                f"{self.label} captured no work on the stream the body is handed: its work went to another stream "
                "(a library's own or current stream), where it ran once, now, and no replay would run it. "
                "Enqueue it on the handed stream `s` (with torch.cuda.stream(s.torch), with s.cupy, or pass s / "
                "s.ptr to the library); a body with nothing to do for these arguments should not be captured")


def _capture_info(stream) -> tuple:
    """``(graph, dependencies)`` of the capturing ``stream``: the graph it captures into and
    the nodes its next work will follow."""
    info = check(cu.cuStreamGetCaptureInfo(stream.handle), "cuStreamGetCaptureInfo")
    n = info[-1]
    return info[2], list(info[3][:n]) if n else []


def _dependencies(stream) -> tuple:
    return tuple(sorted(int(d) for d in _capture_info(stream)[1]))


def _add_child(stream, child, label: str) -> None:
    """Add ``child`` as a node of the graph ``stream`` is capturing, after its dependencies;
    the stream's next work follows that node."""
    graph, deps = _capture_info(stream)
    code, node = cu.cuGraphAddChildGraphNode(graph, deps, len(deps), child)
    if code:
        raise CaptureError(f"{label}'s captured work cannot be a node of the graph (cuGraphAddChildGraphNode: "
                           f"{error_name(code)}): a child graph may not hold memory allocation or free nodes "
                           "(cudaMallocAsync, cudaFreeAsync, a stream-ordered memory pool) or conditional nodes. "
                           "Allocate before capturing and pass the buffers in (declared in writes=)")
    check(cu.cuStreamUpdateCaptureDependencies(stream.handle, [node], None, 1, _SET_DEPENDENCIES),
          "cuStreamUpdateCaptureDependencies")


def _destroy(graph) -> None:
    if graph is not None and int(graph):
        cu.cuGraphDestroy(graph)


def _torch_allocations(device) -> int:
    """How many allocations torch's caching allocator has served on ``device`` (0 without torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_stats(device.ordinal).get("allocation.all.allocated", 0))


# -- what broke a capture ----------------------------------------------------------------

# The capture errors, most specific first: (CUresult name, what the body did, the fix).
_AVOID = ("allocate before capturing and pass the buffers in (declared in reads=/writes=), wait only before "
          "or after the capture, and give the op warmup=True so that the body runs once before it is "
          "captured (libraries load modules and allocate workspaces on first use)")
_CAUSES = (
    ("CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "work on the legacy default stream (torch's and CuPy's default stream, or a call without a stream)",
     "enqueue it on the stream the body is handed, `s`: with torch.cuda.stream(s.torch), with s.cupy "
     "(or cupy.cuda.ExternalStream(s.ptr)), or pass s (it has __cuda_stream__) or s.ptr to the library"),
    ("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "a call a capture forbids: an allocation (cudaMalloc, a memory pool growing), a synchronization "
     "(cudaStreamSynchronize, cudaDeviceSynchronize, .item(), .cpu(), .get()) or a synchronous copy", _AVOID),
    ("CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
     "work forked onto another stream (it waited on an event of the handed stream) without joining it back",
     "before the body returns, make the handed stream wait on an event recorded at the end of that stream"),
    ("CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
     "a wait on an event recorded outside this capture",
     "wait only on events recorded on the handed stream (or streams forked from it) during the body"),
    ("CUDA_ERROR_CAPTURED_EVENT",
     "a wait on, or query of, an event recorded during the capture", _AVOID),
    ("CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
     "work on the capture from another thread", "call the library from the thread that runs the op"),
    ("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "a call that broke the capture (a synchronization, an allocation, work on the legacy stream)", _AVOID),
)


def _spellings(name: str) -> tuple:
    """How libraries print a CUresult: its driver name, the runtime's cudaError name, the description."""
    words = name.removeprefix("CUDA_ERROR_").split("_")
    found = [name, "cudaError" + "".join(w.capitalize() for w in words)]
    if driver_available():
        err, text = cu.cuGetErrorString(getattr(cu.CUresult, name))
        if not err and text:
            found.append(text.decode())
    return tuple(s.lower() for s in found)


def broken(label: str, exc, code_name: str | None) -> CaptureError | None:
    """The CaptureError of foreign work whose capture broke: ``exc`` the body raised (or
    None), ``code_name`` the error ending the capture returned (or None).  None when
    neither is the capture's doing (the body's own exception then goes on unchanged)."""
    text = f"{type(exc).__name__}: {exc}".lower() if exc is not None else ""
    said = getattr(exc, "code_name", None)  # deviceop's own sync errors carry it
    cause = next((c for c in _CAUSES if c[0] == said or any(s in text for s in _spellings(c[0]))), None)
    if cause is None and code_name is not None:
        cause = next((c for c in _CAUSES if c[0] == code_name), None)
        if cause is None:
            cause = (code_name, "a call the capture could not record", _AVOID)
    if cause is None:
        return None
    raised = f"; the body raised {type(exc).__name__}: {exc}" if exc is not None else ""
    return CaptureError(f"{label} broke its capture ({cause[0]}{raised}). The body made {cause[1]}. Fix: "
                        f"{cause[2]}. The capture was ended and nothing of the op was recorded; the stream is usable")


# -- host functions ----------------------------------------------------------------------------
#
# Called through ctypes, not cuda.bindings: the bindings' cuLaunchHostFunc wraps the function
# in a record it frees after the first call, so a captured host node would run once and then
# read freed memory (NVIDIA/cuda-python issue 790).  One C trampoline serves every host function:
# its userData is a key into ``_pending``.

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_pending: dict = {}  # key -> (fn, once): what the trampoline calls for a userData key
_keys = itertools.count(1)
_driver_lib = None


def _trampoline(key) -> None:
    entry = _pending.get(key)
    if entry is None:
        return  # a graph closed while a replay was in flight
    fn, once = entry
    if once:
        _pending.pop(key, None)
    try:
        fn()
    except BaseException:  # pragma: no cover - fn is deviceop's reporting wrapper, which does not raise
        pass


_TRAMPOLINE = _HOST_FN(_trampoline)  # one C callback for the process, alive as long as the module


def _cu_launch_host_func():
    """The driver's own cuLaunchHostFunc (ctypes releases the GIL while it runs)."""
    global _driver_lib
    if _driver_lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchHostFunc.restype = ctypes.c_int
        lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
        _driver_lib = lib
    return _driver_lib.cuLaunchHostFunc


class HostFunction:
    """A host function registered for a captured node: it stays callable, at every
    replay, while this registration lives (the graph keeps it)."""

    __slots__ = ("key",)

    def __init__(self, key: int):
        self.key = key

    def __del__(self):
        _pending.pop(self.key, None)


def launch_host_func(stream, fn, label: str):
    """Enqueue ``fn()`` on ``stream`` (``cuLaunchHostFunc``): run by a driver thread
    once the work before it is done.  On a capturing stream it becomes a HOST node,
    run at every replay while the returned registration lives; eagerly it runs once
    (returns None)."""
    handle = int(stream._live(label))
    capturing = stream.is_capturing()
    stream.device.bind()
    key = next(_keys)
    _pending[key] = (fn, not capturing)
    code = _cu_launch_host_func()(handle, _TRAMPOLINE, key)
    if code:
        _pending.pop(key, None)
        raise_error(code, f"cuLaunchHostFunc({label})")
    return HostFunction(key) if capturing else None
