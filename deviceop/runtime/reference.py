"""The reference device: the backend of a machine without a GPU.

It implements the interface of a CUDA device — streams, events, memory,
kernel functions and the graph work of runtime/graphs.py — on the host:
memory is NumPy arrays (their addresses are real host addresses, so copies
and memsets are ``ctypes`` calls on them), a kernel runs its NumPy reference,
and a stream that captures records a *tape* of steps instead of running them,
which a graph launch replays.  It refuses what the GPU refuses (a host sync in
a capture, work on a closed stream, a launch the CUBIN would refuse).  The
layers above never ask which device they run on: this module is where the
difference lives.
"""
from __future__ import annotations

import os
import sys
import time
import weakref

import numpy as np

from ..dtypes import host_array_from_dlpack, host_dlpack
from ..errors import DistributedError, LaunchError, NoDeviceError, OutOfMemoryError, StateError
from . import driver, refcache
from .device import CTX_SYNC, Device, arch_from_environment
from .tape import Kernel as _Kernel, Copy as _Copy, Host as _Host, Memset as _Memset, Tape, TapeGraphs
from .params import ParamLayout, check_param_layout
from .stream import _CAPTURED_EVENT, _CLOSED, ProcessHandle, Stream, closed_stream, no_cuda_stream, sync_in_capture

_announced = False


# What a user must know about the reference device (its start message, `python -m deviceop info`).
WHAT_RUNS = ("Each kernel's CUDA C++ is compiled by NVRTC and its signature checked against the CUBIN, but the "
             "kernel's NumPy reference runs, not its CUDA (a bug in the CUDA passes here); run the CUDA on a GPU "
             "with scripts/gpu-check")


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
    label = "reference"
    driver_version = None  # no driver (kernel/prebuilt.py takes NVRTC's CUDA version for it)

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
            print(f"deviceop: no CUDA GPU ({self.reason}); using the reference device. {WHAT_RUNS}. "
                  "Its timings say nothing about a GPU.", file=sys.stderr)

    @property
    def arch(self) -> str:
        """The architecture NVRTC compiles for here (``DEVICEOP_ARCH``, default
        ``sm_90``, the H100): compiling needs no GPU."""
        return arch_from_environment(os.environ.get("DEVICEOP_ARCH") or "sm_90")

    @property
    def max_shared_memory_per_block(self) -> int:
        """The shared memory a block of the GPU this device stands for may opt in to (CUDA's
        per-arch maximum, ``CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN``; 0: unknown)."""
        return _SMEM_OPTIN.get(self.arch.rstrip("af"), 0)

    def bind(self) -> None:
        pass

    what_runs = WHAT_RUNS  # (python -m deviceop info)

    def describe(self) -> str:
        return f"reference device (NumPy) — {self.reason}"

    def require_gpu(self, what: str) -> None:
        raise NoDeviceError(f"{what} needs a CUDA device; this process has the reference device ({self.reason}). "
                            "Kernels declared with a NumPy reference still run there through deviceop's kernel ops.")

    def conditional_nodes(self) -> tuple[bool, str]:
        """Always ``(True, "")``: a captured loop replays its body's tape on the host."""
        return True, ""

    def conditional_branches(self) -> tuple[bool, str]:
        """Always ``(True, "")``: a captured branch is one tape step, whatever the driver."""
        return True, ""

    def new_stream(self, priority: int = 0):
        return ReferenceStream(self)

    def load_function(self, program, expr: str, signature, reference, generics: dict):
        """``expr``'s NumPy ``reference``, behind the interface of a loaded kernel; its
        declared signature checked against the CUBIN's records, as loading it would be.  A kernel
        another compiler built (kernel/prebuilt.py) is refused at once without a reference."""
        built_by = getattr(program, "built_by", "")
        if built_by and reference is None:
            raise NoDeviceError(f"{built_by}: the reference device ({self.reason}) cannot run it. Give it a NumPy "
                                "reference= (called as reference(g, *args) with the arguments as arrays; it writes the "
                                "Out and InOut ones) to run it here, or run on a GPU")
        fn = ReferenceFunction(expr, signature, reference, generics)
        try:
            actual = program.param_layout(expr)
        except ValueError:  # a CUBIN this reader does not understand: nothing to compare
            actual = None
        if actual is not None:
            check_param_layout(expr, fn.full_signature, actual)
        return fn

    def new_event(self, timing: bool = True):
        return ReferenceEvent(self, timing=timing)

    def foreign(self, label: str, body, reference, warmup):
        """Foreign work here: its NumPy ``reference`` runs where a GPU runs its ``body``
        (and its warm-up); without one the op is refused, as the GPU refuses what it cannot run."""
        if reference is None:
            raise NoDeviceError(f"{label} runs another library's GPU work (its body), which needs a CUDA device; "
                                f"this process has the reference device ({self.reason}). Give the op a NumPy "
                                "reference= (called with the read and write tensors as NumPy arrays, it writes "
                                "its results into the write arrays) to run it here")
        return ReferenceForeign(label, reference, warmup)

    @staticmethod
    def launch_host_func(stream, fn, label: str):
        """Run ``fn()`` now, or record it as a host step while ``stream`` captures (nothing to keep)."""
        stream._run(_Host(fn, label, "host"))

    def synchronize(self) -> None:
        """Refused while any of its streams captures, and breaks those captures, as ``cuCtxSynchronize`` on a GPU."""
        capturing = [s for s in list(self._streams) if s._tape is not None]
        if capturing:
            for s in capturing:
                s._broken = True
            raise sync_in_capture(CTX_SYNC, "cuCtxSynchronize", whose="a stream of this device is")

    def memory_info(self) -> tuple[int, int]:
        return (0, 0)

    @staticmethod
    def peer_memory(nbytes: int) -> "HostPeerMemory":
        return HostPeerMemory(nbytes)

    # -- memory: NumPy arrays -------------------------------------------------------
    def alloc(self, dims, dt, stream):
        try:
            array = np.empty(dims, dtype=dt.np)
        except (MemoryError, ValueError) as exc:
            raise OutOfMemoryError(f"allocating a {dt.name} tensor of shape {dims} on the reference device",
                                   2, "CUDA_ERROR_OUT_OF_MEMORY", str(exc), "allocate less") from None
        refcache.own(array)  # its every write is the reference device's (until handed out)
        return array

    @staticmethod
    def address(array) -> int:
        return int(array.__array_interface__["data"][0])

    @staticmethod
    def extent(array):
        return None  # a NumPy array's memory is its own

    @staticmethod
    def view_array(base, ptr: int, shape, byte_strides, dtype):
        raw = np.dtype(f"V{dtype.itemsize}")  # any dtype (bfloat16 too) through raw bytes
        iface = {"version": 3, "shape": tuple(shape), "typestr": raw.str, "data": (ptr, False),
                 "strides": tuple(byte_strides)}
        return np.asarray(_HostMemory(base, iface)).view(dtype)

    def from_host(self, host, dt, stream):
        array = host.copy()
        refcache.own(array)
        return array

    @staticmethod
    def import_dlpack(obj, stream):
        return host_array_from_dlpack(obj)  # (NumPy alone refuses bfloat16)

    @staticmethod
    def export_dlpack(array, stream, consumer, kwargs: dict):
        if consumer is not None:
            raise StateError(f"the reference device's memory is host memory: DLPack's stream={consumer!r} "
                             "names a CUDA stream; leave stream=None")
        refcache.disown(array)  # the consumer may write it unseen
        return host_dlpack(array, kwargs)  # (NumPy alone refuses bfloat16)

    @staticmethod
    def import_cuda_array(obj):
        raise StateError("__cuda_array_interface__ describes GPU memory; the reference device has none: "
                         "copy host data with dop.from_numpy(array), or run on a GPU")

    @staticmethod
    def contiguous(array, stream):
        return np.ascontiguousarray(array)

    def to_host(self, array, stream):
        stream.device.bind()  # a closed stream's device refuses, as on a GPU
        return array.copy()

    @staticmethod
    def cuda_array_interface(array):
        raise AttributeError("a reference-device tensor lives in host memory; use .numpy()")

    @staticmethod
    def cupy_array(array):
        raise StateError("the reference device has no CuPy arrays; use .numpy()")

    def __repr__(self) -> str:
        return f"<reference device: {self.reason}>"


class HostPeerMemory:
    """runtime/ipc.py's peer memory on the host: a NumPy array the other thread-ranks of
    this process (dist.run_reference) reach by its address, as GPUs reach each other's."""

    _alive = weakref.WeakValueDictionary()  # address -> owner: open() refuses a freed buffer

    def __init__(self, nbytes: int):
        self.array = np.zeros(nbytes // 4, dtype=np.uint32)
        self.address = int(self.array.ctypes.data)
        self._alive[self.address] = self

    def export(self):
        return (os.getpid(), self.address)

    def open(self, idents, rank: int) -> list[int]:
        for r, (pid, address) in enumerate(idents):
            if pid != os.getpid() or self._alive.get(address) is None:
                raise DistributedError(f"rank {r}'s peer memory is not in this process: the reference device's "
                                       "ranks are threads of one process (dist.run_reference)")
        return [address for _, address in idents]

    def release(self, barrier) -> None:
        if barrier is not None:  # else leak it: a peer might still store into it
            barrier()
            self._alive.pop(self.address, None)
            self.array = None


_HostMemory = refcache.HostView  # exposes a raw host view to NumPy, keeping its base array alive


# -- streams and events --------------------------------------------------------------

class ReferenceStream(Stream):
    """A stream of the reference device: work runs on the host at once, or,
    while the stream captures, is appended to its tape.

    It refuses what a CUDA stream refuses: a host sync (``synchronize``,
    ``query``) while it captures, and any work once closed."""
    __getattr__ = no_cuda_stream  # .ptr, .torch, .cupy, __cuda_stream__: a NoDeviceError naming why

    def __init__(self, device):
        self.device = device
        self._tape = None  # the steps recorded while capturing
        self._deps = []    # while capturing: the steps the next one depends on (as a CUDA stream's capture)
        self._broken = self._closed = False
        device._streams.add(self)

    @property
    def _capturing(self) -> bool:
        return self._tape is not None

    def _check_sync(self, what: str, call: str) -> None:
        if self._closed:
            raise closed_stream(what)
        if self._tape is not None:
            self._broken = True  # as the driver does, the capture fails when it ends
            raise sync_in_capture(what, call)

    def synchronize(self) -> None:
        self._check_sync("stream.synchronize()", "cuStreamSynchronize")

    def query(self) -> bool:
        self._check_sync("stream.query()", "cuStreamQuery")
        return True

    def wait_event(self, event) -> None:
        if self._closed:
            raise closed_stream("wait_event()")

    def wait_stream(self, other) -> None:
        if self._closed:
            raise closed_stream("wait_stream()")

    def is_capturing(self) -> bool:
        if self._closed:
            raise closed_stream("is_capturing()")
        return self._tape is not None

    def begin_capture(self, mode: str = "relaxed") -> None:
        if self.is_capturing():
            from ..errors import CaptureError
            raise CaptureError("this stream is already capturing; end that capture first")
        self._tape, self._deps, self._broken = Tape(), [], False

    def _end_capture(self):
        """``(tape, broken)``; the stream is no longer capturing."""
        tape, broken, self._tape, self._broken, self._deps = self._tape, self._broken, None, False, []
        return tape, broken

    def _run(self, step) -> None:
        """Run ``step`` now, or record it while capturing (what the GPU's stream does with work)."""
        if self._closed:
            raise closed_stream("work (an op, a capture, a copy)")
        if self._tape is not None:
            self._tape.record(step, self._deps)
            self._deps = [step]
        else:
            step.run()

    # -- data movement (a CUDA stream's methods, on host memory) ----------------------
    def memcpy(self, dst: int, src: int, nbytes: int, call: str = "memcpy") -> None:
        self._run(_Copy(dst, src, nbytes))

    def memset8(self, dst: int, value: int, count: int, call: str = "memset") -> None:
        self._run(_Memset(dst, value & 0xFF, 1, count))

    def memset16(self, dst: int, value: int, count: int) -> None:
        self._run(_Memset(dst, value & 0xFFFF, 2, count))

    def memset32(self, dst: int, value: int, count: int) -> None:
        self._run(_Memset(dst, value & 0xFFFFFFFF, 4, count))

    def fill(self, array, value) -> None:
        array.fill(value)
        refcache.wrote(array)

    def upload(self, array, host) -> None:
        array[...] = host
        refcache.wrote(array)

    def close(self) -> None:
        """Close the stream (idempotent); later work on it raises StateError, as on a GPU."""
        self._closed, self.device = True, _CLOSED

    def __repr__(self) -> str:
        return f"<reference stream 0x{id(self):x}{' (closed)' if self._closed else ''}>"


class ReferenceEvent(ProcessHandle):
    """Host-clock event of the reference device.  Like a CUDA event, one last
    recorded on a capturing stream cannot be waited for (it marks a point of
    the graph) until it is recorded again outside a capture."""

    def __init__(self, device, *, timing: bool = True):
        self.device, self.timing, self._t, self._captured = device, timing, None, False

    def record(self, stream) -> "ReferenceEvent":
        self._t = time.perf_counter()
        self._captured = bool(getattr(stream, "_capturing", False))
        return self

    def synchronize(self) -> None:
        if self._captured:
            raise sync_in_capture("event.synchronize()", "cuEventSynchronize", _CAPTURED_EVENT)

    def query(self) -> bool:
        if self._captured:
            raise sync_in_capture("event.query()", "cuEventQuery", _CAPTURED_EVENT)
        return True

    def elapsed_ms(self, end: "ReferenceEvent") -> float:
        if self._t is None or end._t is None:
            raise StateError("both events must be recorded before elapsed_ms")
        return (end._t - self._t) * 1e3


class ReferenceForeign:
    """Foreign work on the reference device: its NumPy reference, run now or recorded
    as one step (a child-graph node on a GPU) that every replay runs again."""

    def __init__(self, label: str, reference, warmup):
        self.label, self.reference, self.warmup = label, reference, warmup

    def run(self, stream, bind, arrays, capture) -> None:
        """``arrays()``: the reference's arguments ``(args, kwargs)`` (see runtime/foreign.py's ``run``)."""
        args, kwargs = arrays()
        for a in (*args, *kwargs.values()):  # handed to the user's reference, which may keep them
            refcache.disown(a)
        if capture is not None and self.warmup is not None:  # the warm-up is the body run once: here, this
            self._call(args, kwargs)
        stream._run(_Host(lambda: self._call(args, kwargs), self.label, "graph"))

    def _call(self, args, kwargs) -> None:
        try:
            out = self.reference(*args, **kwargs)
        except ValueError as exc:
            if "is read-only" not in str(exc):  # NumPy's words for a write into a read-only array
                raise
            raise LaunchError(f"the reference of {self.label} wrote into an array of its reads= ({exc}): the reads are "
                              "read-only, as the body may only read them; declare a buffer the work writes (in place "
                              "too) in writes=") from exc
        if out is not None:
            raise LaunchError(f"the reference of {self.label} returned a {type(out).__name__}; a reference writes "
                              "its results into the write arrays it is given (e.g. out[...] = x @ w) and returns "
                              "nothing, or those arrays (as np.matmul(x, w, out=out) returns out)")


# -- kernels: the NumPy reference behind a Function's interface --------------------------

# the opt-in shared memory per block of each arch (CUDA's programming guide, compute capabilities table)
_SMEM_OPTIN = {"sm_70": 98304, "sm_75": 65536, "sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376,
               "sm_90": 232448, "sm_100": 232448, "sm_103": 232448, "sm_120": 101376}


class ReferenceFunction(ParamLayout):
    """A kernel on the reference device: ``launch(stream, config, *args)`` runs
    ``reference(generics, *arrays)`` (or records it on a capturing stream).
    Launches are never prepared: a prepared launch would keep its arrays alive."""

    preparable = False
    written = None  # the indices of the arguments it writes, when declared (declare_written)

    def __init__(self, name: str, signature, reference, generics: dict):
        super().__init__(name, signature)
        self.handle, self.reference, self.generics = None, reference, generics
        self.launch = self.launch_pdl = self.launch_cooperative = self.launch_cluster = self._launch

    def _launch(self, stream, config, *args) -> None:
        if self.reference is None:
            raise LaunchError(f"{self.name} has no NumPy reference, so the reference device cannot run it")
        limit = stream.device.max_shared_memory_per_block
        if limit and config.shared_mem > limit:  # what a GPU's launch refuses (runtime/launch.py), refused here too
            raise LaunchError(f"{self.name} asks for {config.shared_mem} bytes of dynamic shared memory; a "
                              f"{stream.device.arch} GPU allows at most {limit} per block in all")
        stream._run(_Kernel(self, [getattr(a, "_array", a) for a in args]))

    def declare_written(self, indices) -> None:
        """The arguments the kernel declares written (Out, InOut): after a launch, runtime/refcache.py
        drops its float64 copies of those only; a kernel that declares nothing drops every argument's."""
        self.written = tuple(indices)

    def node_params(self, config, ptrs):
        return None  # a recorded step reads its arguments, not a parameter buffer

    def prepared(self, attribute, config, *args):  # pragma: no cover - the plan asks `preparable` first
        raise LaunchError(f"{self.name}: the reference device does not prepare launches")


ReferenceDevice.graphs = TapeGraphs(ReferenceStream)
Device.set_fallback(ReferenceDevice)  # what Device(n) is where the driver sees no GPU
