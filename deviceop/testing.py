"""Tools for testing code that uses deviceop: count graph handles, inject driver faults.

:class:`DriverSpy` stands in for ``cuda.bindings.driver`` inside deviceop's driver
graph and stream modules (every other call passes through untouched).  It counts
the CUDA graphs and executable graphs they create and destroy — a leak is a
count that does not return to zero — and can make one named driver call fail
with a chosen CUDA error, the way a real driver fails (an out-of-memory
instantiation, an invalidated capture, a refused upload)::

    with DriverSpy() as spy:
        spy.fail("cuGraphInstantiate", "CUDA_ERROR_OUT_OF_MEMORY")
        try:
            op.graph_on(stream)
        except dop.OutOfMemoryError:
            pass
    assert spy.leaked() == {}

On the reference device no driver call is made, so nothing is counted there.
:func:`host_rss_bytes` and :func:`device_used_bytes` are the memory samples of
the soak (scripts/soak.py).  :class:`ForeignArray` stands for another framework's
array (memory it exports through DLPack and keeps).
"""
from __future__ import annotations

import os
from collections import Counter

from cuda.bindings import driver as _cu

from .runtime import device as _device, graphs as _graphs, stream as _stream


class DriverSpy:
    """``cuda.bindings.driver`` as deviceop.runtime.graphs and deviceop.runtime.stream see it,
    counting graph handles and failing the calls it is told to fail."""

    def __init__(self):
        # "graph" / "exec" -> handles created while installed and not yet destroyed.  Kept
        # by identity: a graph made before the spy and collected while it is installed
        # must not count against what the spy saw made.
        self.live = {"graph": set(), "exec": set()}
        self.calls = Counter()     # driver function name -> calls seen
        self.injected = Counter()  # driver function name -> faults injected
        self._faults = {}          # name -> [calls to let through first, CUresult, times left]
        self._saved = None

    # -- faults ------------------------------------------------------------------
    def fail(self, name: str, error: str = "CUDA_ERROR_UNKNOWN", *, after: int = 0, times: int = 1) -> None:
        """Make ``name`` fail with ``error`` after letting ``after`` calls through, ``times`` times."""
        self._faults[name] = [after, getattr(_cu.CUresult, error), times]

    def _fault(self, name: str):
        f = self._faults.get(name)
        if f is None:
            return None
        if f[0] > 0:
            f[0] -= 1
            return None
        if f[2] <= 0:
            return None
        f[2] -= 1
        self.injected[name] += 1
        return f[1]

    def leaked(self) -> dict:
        """Graph handles created and never destroyed ({} when none)."""
        return {k: len(v) for k, v in self.live.items() if v}

    # -- the calls that make or break graphs ---------------------------------------
    def cuStreamBeginCapture(self, stream, mode):
        self.calls["cuStreamBeginCapture"] += 1
        code = self._fault("cuStreamBeginCapture")
        return (code,) if code is not None else _cu.cuStreamBeginCapture(stream, mode)

    def cuStreamEndCapture(self, stream):
        self.calls["cuStreamEndCapture"] += 1
        code, graph = _cu.cuStreamEndCapture(stream)  # the capture always ends, as when the driver fails it
        fault = self._fault("cuStreamEndCapture")
        if fault is not None:
            if graph is not None and int(graph):
                _cu.cuGraphDestroy(graph)
            return fault, None
        if not code and graph is not None and int(graph):
            self.live["graph"].add(int(graph))
        return code, graph

    def cuGraphDestroy(self, graph):
        self.calls["cuGraphDestroy"] += 1
        result = _cu.cuGraphDestroy(graph)
        if not result[0]:
            self.live["graph"].discard(int(graph))
        return result

    def cuGraphInstantiate(self, graph, flags):
        self.calls["cuGraphInstantiate"] += 1
        fault = self._fault("cuGraphInstantiate")
        if fault is not None:
            return fault, None
        code, exec_ = _cu.cuGraphInstantiate(graph, flags)
        if not code:
            self.live["exec"].add(int(exec_))
        return code, exec_

    def cuGraphExecDestroy(self, exec_):
        self.calls["cuGraphExecDestroy"] += 1
        result = _cu.cuGraphExecDestroy(exec_)
        if not result[0]:
            self.live["exec"].discard(int(exec_))
        return result

    def cuGraphUpload(self, exec_, stream):
        self.calls["cuGraphUpload"] += 1
        fault = self._fault("cuGraphUpload")
        return (fault,) if fault is not None else _cu.cuGraphUpload(exec_, stream)

    def cuGraphLaunch(self, exec_, stream):
        self.calls["cuGraphLaunch"] += 1
        fault = self._fault("cuGraphLaunch")
        return (fault,) if fault is not None else _cu.cuGraphLaunch(exec_, stream)

    def __getattr__(self, name):  # everything else: the real driver
        return getattr(_cu, name)

    # -- installing ----------------------------------------------------------------
    def install(self) -> "DriverSpy":
        self._saved = [(m, m.cu) for m in (_graphs, _stream)]
        for m, _ in self._saved:
            m.cu = self
        return self

    def uninstall(self) -> None:
        for m, real in self._saved or ():
            m.cu = real
        self._saved = None

    def __enter__(self) -> "DriverSpy":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


def host_rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def device_used_bytes(device) -> int:
    """Device memory in use (total - free, all processes); 0 on the reference device."""
    free, total = device.memory_info()  # (0, 0) on the reference device
    return total - free


def loaded_modules() -> int:
    """CUBIN modules deviceop has loaded in this process."""
    return len(_device._loaded)


class ForeignArray:
    """Another framework's array: it exports its memory through DLPack and keeps it
    (a bare NumPy array is host memory, which ``dop.from_dlpack`` refuses)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()
