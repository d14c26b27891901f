"""The kernel nodes of a captured graph, and changing their arguments between replays;
what every node deviceop hands out has (``Node``: its graph, its driver handle, ``enabled``).

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
ranks, layouts, aliasing, the kernel's own rules), on the whole would-be
argument set and before anything changes, with the launches' verdict cache: a
scalar-only change to arguments seen before takes a short path that packs the
new value into the node's parameter buffer.

``graph.node(step).enabled = False`` switches the node off for the next
replays (cuGraphNodeSetEnabled: it does nothing, as an empty node, until it is
switched on again), also without re-instantiating.
"""
from __future__ import annotations

import math
import struct
import weakref

import numpy as np

from ..errors import DTypeError, LaunchError, StateError
from ..kernel import checked_launch
from ..tensor import Partition, SharedTensor, Tensor
from .parallel import kernel_footprint


class Node:
    """A kernel, memcpy or memset node of a captured graph: its ``label``, its place in
    capture order (``index``), the driver's ``handle``, and ``enabled``."""

    # _item: (Dag, item) in a parallel capture (graph/parallel.py), else None
    # _via: the driver calls of a node inside a child-graph node (graph/child.py), else None
    __slots__ = ("label", "index", "handle", "_graph", "_stale", "_enabled", "_item", "_via")

    def __init__(self, label: str, handle):
        self.label, self.index, self.handle = label, -1, handle
        self._graph, self._stale, self._enabled = None, False, True
        self._item = self._via = None

    @property
    def enabled(self) -> bool:
        """Whether the node runs at the next replays.  ``node.enabled = False`` switches
        it off (it does nothing, as an empty node), ``True`` on again: one driver call
        (cuGraphNodeSetEnabled), no recapture, no re-instantiation; its parameters stay."""
        return self._enabled

    @enabled.setter
    def enabled(self, on) -> None:
        if not isinstance(on, (bool, np.bool_)):
            raise DTypeError(f"{self.label}: enabled takes True or False, got {type(on).__name__} {on!r}")
        graph = self._live_graph()
        self._check_handle("switched on or off")
        self._in_exec(graph, self._driver(graph).set_enabled, bool(on), self.label)
        self._enabled = bool(on)

    def _check_handle(self, what: str) -> None:
        if self.handle is None and self._via is not None:
            raise StateError(f"the driver did not find {self.label} in the copy a child-graph node holds (it sits in "
                             f"a loop or branch of that graph), so it cannot be {what} there: update it in the graph "
                             "it was captured in, and capture the outer graph again")
        if self.handle is None:
            raise StateError(f"the driver did not report a node for {self.label} during capture "
                             f"(the capture stream had several dependencies), so it cannot be {what}")

    def _live_graph(self):
        graph = self._graph() if self._graph is not None else None
        if graph is None or graph._closed:
            raise StateError(f"the graph of node {self.label} was closed; nodes live as long as their graph")
        if self._stale:
            raise StateError(f"node {self.label} belongs to a capture this graph replaced (recapture); "
                             "take the node of the new op: graph.node(op)")
        return graph

    def _in_exec(self, graph, call, *args) -> None:
        """``call(exec_, handle, *args)`` on the graph's executable graph and this node under the
        graph's lock, refused if another thread closed or recaptured the graph since this update
        began: the driver is never handed an executable graph that was destroyed (or one this node
        is no longer in).  (acquire/release rather than ``with``: cheaper on CPython; a scalar update,
        which bench/dynamic_params.py times, inlines this.)"""
        lock = graph._lock
        lock.acquire()
        try:
            if graph._closed or self._stale:
                self._live_graph()  # raises, naming which
            call(graph._exec, self.handle, *args)
        finally:
            lock.release()

    def _attach(self, graph, index: int) -> None:
        self._graph, self.index = weakref.ref(graph), index

    def _driver(self, graph):
        """What sets this node's parameters: the graph's driver work, or a child graph's (``_via``)."""
        return graph._graphs if self._via is None else self._via

    def _check_buffers(self, footprint) -> None:
        """In a graph captured with parallel=True: refuse new buffers that a node on a
        parallel branch uses (graph/parallel.py's ``check_update``)."""
        if self._item is not None:
            dag, i = self._item
            dag.check_update(i, footprint, self.label)

    def _note_buffers(self, footprint) -> None:
        """The node now uses these buffers (the next update is checked against them)."""
        if self._item is not None:
            dag, i = self._item
            dag.footprints[i] = footprint


class KernelNode(Node):
    """One kernel node of a captured graph (see the module docstring)."""

    __slots__ = ("kernel", "generics", "mutable", "values", "launch_args",
                 "_function", "_config", "_params", "_buf", "_ptrs", "_fast", "_head")

    def __init__(self, kernel, generics, label, values, launch_args, mutable, function, config, handle, *, head):
        # capture pays only for these attributes: the parameter buffer is made on the first set()
        super().__init__(label, handle)
        self.kernel, self.generics = kernel, generics
        self._head = head  # the launch key's (device, generics, pdl, cooperative): see kernel.checked_launch
        self.mutable = mutable
        self.values, self.launch_args = _kept(kernel.params, values, launch_args), list(launch_args)
        self._function, self._config = function, config
        self._params = self._buf = self._ptrs = self._fast = None

    def _prepare(self) -> None:
        """The node's own parameter buffer and CUDA_KERNEL_NODE_PARAMS (what the driver reads on set)."""
        fn, config = self._function, self._config
        self._buf, self._ptrs = fn.param_buffer()
        packed = fn.pack(*self.launch_args)
        self._buf[:len(packed)] = packed
        self._params = fn.node_params(config, self._ptrs)
        # the short path of set(): dynamic float/int scalars given as Python floats/ints
        fast = {}
        for i in self.mutable:
            prm = self.kernel.params[i]
            if prm.role == "scalar" and (prm.dtype.kind == "f" and prm.dtype.pack in "fd" or prm.dtype.kind in "iu"):
                kind = float if prm.dtype.kind == "f" else int
                lo, hi = prm.dtype.bounds if kind is int else (None, None)
                fast[prm.name] = (i, fn.offsets[i], fn.scalar_packers[i], kind, lo, hi)
        self._fast = fast

    # -- inspection ------------------------------------------------------------------
    @property
    def args(self) -> dict:
        """The node's current arguments by parameter name."""
        return {p.name: v for p, v in zip(self.kernel.params, self.values)}

    @property
    def grid(self) -> tuple:
        return tuple(self.values[self.kernel.grid_index].grid)

    def __repr__(self) -> str:
        dyn = ", ".join(self.kernel.params[i].name for i in sorted(self.mutable)) or "none"
        return f"<KernelNode {self.index}: {self.label}, dynamic: {dyn}>"

    # -- updates ---------------------------------------------------------------------
    def set(self, *args, **changes) -> None:
        """New arguments for the next replay: all of them positionally, or some by name.

        Only arguments marked with ``.dynamic(...)`` on the launch before capture
        may change.  The graph is not recaptured or re-instantiated."""
        fast = self._fast
        if fast is not None and not args and not self._stale:
            graph = self._graph()
            if graph is not None and not graph._closed and self._set_fast(graph, fast, changes):
                return
        graph = self._live_graph()
        kernel, params = self.kernel, self.kernel.params
        if args and changes:
            raise LaunchError(f"{self.label}: pass all arguments positionally or some by name, not both")
        if args:
            if len(args) != len(params):
                raise LaunchError(f"{self.label} takes {len(params)} arguments "
                                  f"({', '.join(p.describe() for p in params)}), got {len(args)}")
            new = list(args)
            changed = [i for i in range(len(params)) if not _same(new[i], self.values[i], params[i])]
            new = [new[i] if i in changed else self.values[i] for i in range(len(params))]  # the equal ones: as kept
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
        # every check of a launch, on the would-be arguments, before anything changes
        launch_args, _ = checked_launch(kernel, self._head, new, lambda: self.label)
        footprint = None
        if self._item is not None and not all(params[i].role == "scalar" for i in changed):
            footprint = kernel_footprint(params, launch_args)
            self._check_buffers(footprint)
        fn = self._function
        if self._params is None and self._buf is None:
            self._prepare()
        if all(params[i].role == "scalar" for i in changed):
            saved = self._buf.raw
            for i in changed:
                try:
                    fn.pack_scalar(self._buf, i, _coerce(params[i], new[i], self.label))
                except (struct.error, OverflowError) as exc:
                    self._buf[:len(saved)] = saved
                    raise DTypeError(f"argument {params[i].name} of {self.label}: {new[i]!r} does not fit "
                                     f"a {params[i].dtype.name} ({exc})") from None
            self._commit(graph, saved, launch_args)
        else:
            saved, old = self._buf.raw, (self._params, self._config)
            packed = fn.pack(*launch_args)
            config = kernel.config(new[kernel.grid_index].grid, self.generics)  # may refuse the grid: first
            self._buf[:len(packed)] = packed
            self._params, self._config = fn.node_params(config, self._ptrs), config
            try:
                self._commit(graph, saved, launch_args)
            except BaseException:
                self._params, self._config = old
                raise
        self.values, self.launch_args = _kept(self.kernel.params, new, launch_args), launch_args  # the graph keeps the buffers alive
        if footprint is not None:
            self._note_buffers(footprint)

    def _set_fast(self, graph, fast, changes) -> bool:
        """Scalars only, each a float (int) for a float (int) parameter: pack them and
        set the node; False (nothing changed) when anything needs the full path."""
        if self.handle is None:
            return False
        buf, values, kernel = self._buf, self.values, self.kernel
        if kernel.validate is not None:
            # the kernel's own rules may read scalars: these arguments must have been checked before
            # (else the full path checks them, and records the verdict for the next time)
            new = list(values)
            try:
                for name, v in changes.items():
                    new[fast[name][0]] = v
                if kernel._launch_key(*self._head, *new) not in kernel._plans:
                    return False
            except (KeyError, AttributeError, TypeError, ValueError):
                return False
        done = []  # scalars packed so far
        try:
            for name, v in changes.items():
                i, off, pack_into, kind, lo, hi = fast[name]
                if type(v) is not kind or (lo is not None and not lo <= v <= hi):
                    raise KeyError(name)
                pack_into(buf, off, v)
                done.append(i)
        except (KeyError, struct.error, OverflowError):
            self._repack_scalars(done)  # the full path will say what is wrong
            return False
        args = self.launch_args
        for i in done:
            args[i] = changes[kernel.params[i].name]
        lock = graph._lock  # _in_exec inlined: this is the hot path of a scalar update
        try:
            lock.acquire()
            try:
                if graph._closed or self._stale:
                    self._live_graph()  # raises, naming which
                self._driver(graph).set_kernel_node(graph._exec, self.handle, self._params, args, self.label)
            finally:
                lock.release()
        except BaseException:
            for i in done:
                args[i] = values[i]
            self._repack_scalars(done)
            raise
        for i in done:
            values[i] = args[i]
        return True

    def _repack_scalars(self, indices) -> None:
        """Put the current values of these scalar arguments back into the parameter buffer."""
        for i in indices:
            prm = self.kernel.params[i]
            self._function.pack_scalar(self._buf, i, prm.dtype.coerce(self.values[i]))

    def _commit(self, graph, saved: bytes, launch_args) -> None:
        if self.handle is None:
            self._buf[:len(saved)] = saved
            self._check_handle("updated")
        try:
            self._in_exec(graph, self._driver(graph).set_kernel_node, self._params, launch_args, self.label)
        except BaseException:
            self._buf[:len(saved)] = saved  # the node keeps its previous arguments
            raise


def _kept(params, values, launch_args) -> list:
    """The arguments a node keeps: the output partitions (the grid comes from one), and for
    the rest what the kernel reads (a SharedTensor's tensor, not the handle: releasing a handle
    given to the node must not make its later updates fail; the node keeps the buffer alive)."""
    return [v if p.role == "out" else a for p, v, a in zip(params, values, launch_args)]


def _same(given, kept, param) -> bool:
    """Is an argument given to ``set`` the one the node has: the object itself, a live handle to
    its tensor, or (passed positionally, all of them) an equal one: a tensor of the same address
    and layout, a partition of it into the same tiles, a scalar of the same value (a positional
    set passes every argument, also those not marked dynamic, and was refused unless each was
    the very object the capture kept)."""
    if given is kept or (type(given) is SharedTensor and given._live and given._tensor is kept):
        return True
    if type(given) is SharedTensor and given._live:
        given = given._tensor
    if type(given) is Tensor and type(kept) is Tensor:
        return given._sig == kept._sig
    if type(given) is Partition and type(kept) is Partition:
        return given.tile_shape == kept.tile_shape and given.tensor._sig == kept.tensor._sig
    if param.role != "scalar" or isinstance(given, (bool, np.bool_)) != isinstance(kept, (bool, np.bool_)):
        return False
    try:
        a, b = param.dtype.coerce(given), param.dtype.coerce(kept)
    except DTypeError:
        return False
    return type(a) is type(b) and a == b and (type(a) is not float or math.copysign(1, a) == math.copysign(1, b))


def _coerce(param, value, label):
    try:
        return param.dtype.coerce(value)
    except DTypeError as exc:
        raise DTypeError(f"argument {param.name} of {label}: {exc}") from None
