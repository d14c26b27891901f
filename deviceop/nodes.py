"""The kernel nodes of a captured graph, and changing their arguments between replays.

Every kernel launch deviceop records into a graph keeps the handle of the node
the driver made for it: right after the launch, ``cuStreamGetCaptureInfo``
reports the capture's current dependency — that node — and its handle is
copied out at once (the array it comes in is the driver's, valid only until
the next call on the stream).

A launch marked ``.dynamic(...)`` before capture may then get new scalars,
new tensors or a new output partition (hence a new grid) for the next replay::

    step = scale(y.partition([256]), x, 1.0).generics([256]).dynamic("alpha")
    graph = step.graph_on(stream)
    graph.node(step).set(alpha=2.0)     # cuGraphExecKernelNodeSetParams
    graph.launch().sync_on(stream)

That is seed 004's "combined approach": no recapture, no re-instantiation,
one driver call.  Each change is checked as a launch would be (roles, dtypes,
ranks, aliasing, the kernel's own rules); a scalar-only change takes a short
path that packs the new value into the node's parameter buffer.
"""
from __future__ import annotations

import ctypes
import struct
import weakref

from cuda.bindings import driver as cu

from .errors import LaunchError, StateError
from .runtime.driver import raise_error
from .tensor import Tensor


class KernelNode:
    """One kernel node of a captured graph (see the module docstring)."""

    __slots__ = ("kernel", "generics", "label", "index", "handle", "mutable", "values", "launch_args",
                 "_function", "_params", "_buf", "_ptrs", "_scalar_slots", "_graph", "_ref_args", "_stale")

    def __init__(self, kernel, generics, label, values, launch_args, mutable, function=None, config=None,
                 handle=None):
        self.kernel, self.generics, self.label = kernel, generics, label
        self.index, self.handle, self.mutable = -1, handle, mutable
        self.values, self.launch_args = list(values), list(launch_args)
        self._function, self._graph, self._stale = function, None, False
        self._params = self._buf = self._ptrs = None
        self._scalar_slots = {}
        self._ref_args = None
        if function is not None:
            self._buf, self._ptrs = function.param_buffer()
            packed = function.pack(*self.launch_args)
            self._buf[:len(packed)] = packed
            p = self._params = cu.CUDA_KERNEL_NODE_PARAMS()
            p.func = function.handle
            p.gridDimX, p.gridDimY, p.gridDimZ = config.grid
            p.blockDimX, p.blockDimY, p.blockDimZ = config.block
            p.sharedMemBytes = config.shared_mem
            p.kernelParams = ctypes.addressof(self._ptrs)
            for i, prm in enumerate(kernel.params):
                if prm.role == "scalar":
                    self._scalar_slots[i] = (function.offsets[i], struct.Struct("@" + prm.dtype.pack).pack_into)
        else:
            self._ref_args = [t._array if isinstance(t, Tensor) else t for t in self.launch_args]

    # -- inspection ------------------------------------------------------------------
    @property
    def args(self) -> dict:
        """The node's current arguments by parameter name."""
        return {p.name: v for p, v in zip(self.kernel.params, self.values)}

    @property
    def grid(self) -> tuple:
        return tuple(self.values[0].grid)

    def __repr__(self) -> str:
        dyn = ", ".join(self.kernel.params[i].name for i in sorted(self.mutable)) or "none"
        return f"<KernelNode {self.index}: {self.label}, dynamic: {dyn}>"

    # -- updates ---------------------------------------------------------------------
    def set(self, *args, **changes) -> None:
        """New arguments for the next replay: all of them positionally, or some by name.

        Only arguments marked with ``.dynamic(...)`` on the launch before capture
        may change.  The graph is not recaptured or re-instantiated."""
        graph = self._live_graph()
        kernel, params = self.kernel, self.kernel.params
        if args and changes:
            raise LaunchError(f"{self.label}: pass all arguments positionally or some by name, not both")
        if args:
            if len(args) != len(params):
                raise LaunchError(f"{self.label} takes {len(params)} arguments "
                                  f"({', '.join(p.describe() for p in params)}), got {len(args)}")
            new = list(args)
            changed = [i for i in range(len(params)) if new[i] is not self.values[i]]
        else:
            new, changed = list(self.values), []
            index = kernel.param_index
            for name, v in changes.items():
                i = index.get(name)
                if i is None:
                    raise LaunchError(f"{self.label} has no argument {name!r}; its arguments are "
                                      f"{', '.join(p.name for p in params)}")
                new[i] = v
                changed.append(i)
        fixed = [params[i].name for i in changed if i not in self.mutable]
        if fixed:
            raise StateError(f"argument(s) {', '.join(fixed)} of {self.label} were not marked dynamic: call "
                             f".dynamic({', '.join(repr(n) for n in fixed)}) on the launch before capturing "
                             "(or recapture)")
        if not changed:
            return
        fn = self._function
        if all(params[i].role == "scalar" for i in changed):
            coerced = {i: _coerce(params[i], new[i], self.label) for i in changed}
            launch_args = list(self.launch_args)
            for i, v in coerced.items():
                launch_args[i] = new[i]
            if fn is not None:
                saved = self._buf.raw
                for i, v in coerced.items():
                    off, pack_into = self._scalar_slots[i]
                    pack_into(self._buf, off, v)
                self._commit(graph, saved)
        else:
            from .kernel import check_launch
            launch_args = check_launch(kernel, new, self.generics, self.label)
            if fn is not None:
                p = self._params
                saved, grid = self._buf.raw, (p.gridDimX, p.gridDimY, p.gridDimZ)
                packed = fn.pack(*launch_args)
                config = kernel.config(new[0].grid, self.generics)
                self._buf[:len(packed)] = packed
                p.gridDimX, p.gridDimY, p.gridDimZ = config.grid
                try:
                    self._commit(graph, saved)
                except BaseException:
                    p.gridDimX, p.gridDimY, p.gridDimZ = grid
                    raise
        self.values, self.launch_args = new, launch_args  # the graph keeps the new buffers alive
        if fn is None:
            self._ref_args = [t._array if isinstance(t, Tensor) else t for t in launch_args]

    def _commit(self, graph, saved: bytes) -> None:
        if self.handle is None:
            self._buf[:len(saved)] = saved
            raise StateError(f"the driver did not report a node for {self.label} during capture "
                             "(the capture stream had several dependencies), so it cannot be updated")
        code = cu.cuGraphExecKernelNodeSetParams(graph._exec, self.handle, self._params)[0]
        if code:
            self._buf[:len(saved)] = saved  # the node keeps its previous arguments
            raise_error(code, f"cuGraphExecKernelNodeSetParams({self.label})")

    def _live_graph(self):
        graph = self._graph() if self._graph is not None else None
        if graph is None or graph._closed:
            raise StateError(f"the graph of node {self.label} was closed; nodes live as long as their graph")
        if self._stale:
            raise StateError(f"node {self.label} belongs to a capture this graph replaced (recapture); "
                             "take the node of the new launch: graph.node(launch)")
        return graph

    def _attach(self, graph, index: int) -> None:
        self._graph, self.index = weakref.ref(graph), index

    def _replay_reference(self) -> None:
        """The reference device's replay of this node: the kernel's NumPy reference."""
        self.kernel.reference(dict(zip(self.kernel.generic_names, self.generics)), *self._ref_args)


def _coerce(param, value, label):
    from .errors import DTypeError
    try:
        return param.dtype.coerce(value)
    except DTypeError as exc:
        raise DTypeError(f"argument {param.name} of {label}: {exc}") from None
