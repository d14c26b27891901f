"""CUDA graphs: capture an op once (``op.graph_on(stream)``) or a block of imperative
code (``CudaGraph.scope``), replay it with one driver call.

Capture, in order: refuse ops that are not graph-safe (by name, before anything is
recorded); load every kernel's module (loading is not capture work); begin a relaxed-mode
capture; execute the op (this records, it does not compute); *always* end the capture, also
when the op raised (the partial graph is destroyed, the stream usable again); instantiate,
upload, synchronize.  The graph keeps every tensor and kernel it touches alive until closed
or collected.  Begin, end (or abort) and instantiate are graph/capture.py's ``Recording``,
for every path; the driver work is the device's ``graphs`` (runtime/graphs.py on a GPU; on
the reference device a graph is the tape of recorded steps).
"""
from __future__ import annotations

import threading
from threading import get_ident

import numpy as np

from ..errors import CaptureError, CudaError, GraphUpdateError, LaunchError, StateError
from ..execution import SCOPE, _running, executing_now, refuse_reentry
from ..foreign import ForeignOp, HostCallback
from ..op import DeviceOp, ExecutionContext, check_stream, executing, too_deep, value
from ..runtime.device import placed
from ..runtime.stream import ProcessHandle, capturing, refuse_if_captured_elsewhere
from .capture import Capture, Recording, ReplayCheck, check_body, flag, not_recordable, preload
from .child import Ambiguous, ChildGraphNode, GraphLaunch
from .nodes import KernelNode, Node
from .render import render_dot


class CudaGraph(ProcessHandle):
    """A captured, instantiated graph, bound to the stream it was captured on."""

    def __init__(self, stream, graph, exec_, output, capture: Capture):
        self._device = stream.device
        self._graphs = stream.device.graphs  # the driver's graph work for this device
        self._stream, self._graph, self._exec = stream, graph, exec_
        self._shown = None                 # after an exec update: the graph whose work exec now does
        self._closed = False
        # held while the executable graph is launched, updated in place or destroyed: one thread's close()
        # or recapture waits for another's replay to be enqueued (re-entrant: a reference-device host
        # callback runs inside the launch, on the replaying thread)
        self._lock = threading.RLock()
        self.exec_updates = self.reinstantiations = 0
        self.parallel = capture.parallel   # captured with parallel=True: edges from the data (graph/parallel.py)
        self._adopt(capture, output)
        self._origin = [n.handle for n in self._nodes]  # the handles that name exec's kernel nodes
        self._defined = self._origin       # the nodes' handles in the definition of the work exec does now

    def _current(self):
        """The graph definition of the work exec does now (the last exec update's, else the captured one)."""
        return self._shown if self._shown is not None else self._graph

    def _adopt(self, capture: Capture, output) -> None:
        self._output, self._has_output = output, True
        self._keep = capture.keep          # tensors, kernels and modules the graph uses
        self._checks = tuple(dict.fromkeys(k for k in self._keep if isinstance(k, ReplayCheck)))
        self._nodes, self._by_launch = capture.nodes, capture.by_launch
        self._hosts = capture.hosts        # its host nodes: a conditional node's body cannot hold its launch
        for i, node in enumerate(self._nodes):
            node._attach(self, i)

    # -- capture -------------------------------------------------------------------
    @classmethod
    def capture(cls, op: DeviceOp, stream, parallel: bool = False) -> "CudaGraph":
        """Capture ``op`` on ``stream`` (what ``op.graph_on(stream, parallel)`` does)."""
        rec, output = cls._record(op, stream, parallel, instantiate=True)
        try:
            made = cls(stream, rec.graph, rec.exec_, output, rec.cap)
        except BaseException:
            rec.cap.undo()  # no graph: nothing will ever fill the buffers the shared ops returned
            raise
        rec.cap.forget()
        return made

    @classmethod
    def _record(cls, op: DeviceOp, stream, parallel: bool = False, instantiate: bool = False):
        """Capture ``op`` into a new graph (graph/capture.py's Recording): ``(recording, output)``."""
        cap = Capture(op.describe(), flag("parallel", parallel))
        cap.check_graph_safe(op)
        with executing(f"graph_on({op.describe()})"):
            preload(op, stream.device)
            with Recording(stream, cap, instantiate) as rec:
                try:
                    output = op._run(ExecutionContext(stream, cap))
                except CudaError as exc:  # a driver call broke the capture: say which op was captured
                    raise CaptureError(f"capturing {op.describe()} failed: {exc}") from exc
                # deviceop errors name their op; user errors and interrupts go on unchanged
        return rec, output

    @classmethod
    def scope(cls, stream, body=None, *, parallel: bool = False):
        """Imperative capture.  ``CudaGraph.scope(stream, body)`` runs
        ``body(s)`` and returns the graph; ``with CudaGraph.scope(stream) as s:``
        leaves it in ``s.graph``.  ``s.record(op)`` records a graph-safe op.
        ``parallel``: as for ``graph_on`` (graph/parallel.py)."""
        check_stream("CudaGraph.scope", stream)
        scope = Scope(stream, parallel=flag("parallel", parallel))
        if body is None:
            return scope
        check_body("CudaGraph.scope(stream, body)", body)
        with scope as s:
            body(s)
        return scope.graph

    # -- replay --------------------------------------------------------------------
    @property
    def stream(self):
        return self._stream

    def launch(self) -> "GraphLaunch":
        """The replay as an op: ``graph.launch().sync_on(graph.stream)``, ``.then``, ``await``."""
        return GraphLaunch(self)

    def update(self, op: DeviceOp):
        """Run ``op`` (e.g. ``api.memcpy(input, x)``) on the graph's stream now; its value, not waited for."""
        if isinstance(op, DeviceOp):
            op.discard()  # handed over: if it cannot run here, the error says so
        self._check_open()
        if not isinstance(op, DeviceOp):
            raise LaunchError(f"graph.update() takes an op to run before the next replay, e.g. "
                             f"api.memcpy(graph_input, x), got a {type(op).__name__}")
        return op.async_on(self._stream)

    def take_output(self):
        """The value the op produced during capture (once)."""
        if not self._has_output:
            raise StateError("the capture-time output was already taken")
        out, self._output, self._has_output = self._output, None, False
        return out

    def replay(self, stream=None) -> None:
        """Enqueue one replay now on ``stream`` (default: the graph's own), without
        building an op: the loop form of ``graph.launch().async_on(stream)``.  Refused
        inside an execution (an op's callback, a capture scope), as ``sync_on`` there is."""
        if _running and get_ident() in _running:  # (executing_now(), the dict's emptiness first: as GraphModel)
            raise refuse_reentry("graph.replay()", executing_now())
        if stream is None or stream is self._stream:
            stream = self._stream
        else:  # a live stream of the graph's device
            placed("graph.replay(stream)", self._device, stream, "the graph", movable=False)
        # _replay's body, inlined, and acquire/release instead of `with` (cheaper): the host
        # time of a replay is what a device loop's launch costs
        lock = self._lock
        lock.acquire()
        try:
            if self._closed:
                self._check_open()
            for check in self._checks:
                check.check_replay()
            if capturing:
                refuse_if_captured_elsewhere("graph.replay()", stream)
            self._graphs.launch(self._exec, stream)
        finally:
            lock.release()

    def _replay(self, stream) -> None:
        with self._lock:  # not closed (nor swapped by a recapture) between the check and the launch
            self._check_open()
            for check in self._checks:  # (a collective's group closed: its communicator is gone)
                check.check_replay()
            if capturing:
                refuse_if_captured_elsewhere("graph.replay()", stream)
            self._graphs.launch(self._exec, stream)

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("this CudaGraph was closed; capture a new one")

    # -- kernel nodes and updates ----------------------------------------------------
    def node(self, launch) -> Node:
        """The node an op became in this graph: a kernel launch's KernelNode (see
        deviceop.nodes), an ``api.memcpy``'s MemcpyNode, an ``api.fill``'s MemsetNode."""
        self._check_open()
        node = self._by_launch.get(launch) if isinstance(launch, DeviceOp) else None  # (a list is no key)
        if type(node) is Ambiguous:
            raise node.error(launch)
        if node is None:
            if isinstance(launch, DeviceOp):
                launch.discard()  # the error says it was never captured; no warning on top
            what = launch.describe() if isinstance(launch, DeviceOp) else type(launch).__name__
            if isinstance(launch, (ForeignOp, HostCallback)):  # (captured or not: "not captured" misled)
                raise StateError(f"{what} has no node graph.node() can give: its work has no parameters deviceop "
                                 "can set (it sees only a child graph or a host function); capture it again "
                                 "(graph.recapture) to change what it does")
            raise StateError(f"{what} was not captured into this graph: pass the op itself (a kernel launch, "
                             "api.memcpy or api.fill: the one that was executed), e.g. keep it in a variable "
                             "before composing")
        return node

    def kernel_nodes(self) -> list[KernelNode]:
        """Every kernel node, in capture order."""
        self._check_open()
        return [n for n in self._nodes if isinstance(n, KernelNode)]

    def recapture(self, work, *, reinstantiate: bool = True) -> str:
        """Capture ``work`` again — an op, or a scope body ``f(s)`` — and update
        this graph to it in place with ``cuGraphExecUpdate``: no new executable
        graph when only parameters changed.  When the update is refused (the
        topology or a node's kind changed) the graph is re-instantiated, or
        GraphUpdateError is raised with ``reinstantiate=False`` (the graph then
        keeps its old work).  Returns ``"updated"`` or ``"reinstantiated"``."""
        if isinstance(work, DeviceOp):
            work.discard()  # handed over: if it cannot be captured here, the error says so
        self._check_open()
        if not isinstance(reinstantiate, (bool, np.bool_)):  # before anything is captured
            raise LaunchError(f"recapture()'s reinstantiate= is True or False (rebuild the graph when the update "
                              f"is refused, or raise GraphUpdateError), got {reinstantiate!r}")
        stream = self._stream
        if isinstance(work, DeviceOp):
            rec, output = CudaGraph._record(work, stream, self.parallel)
            graph, cap = rec.graph, rec.cap
        elif callable(work):
            check_body("graph.recapture(body)", work)
            scope = Scope(stream, instantiate=False, parallel=self.parallel)
            with scope as s:
                work(s)
            (graph, cap), output = scope.recorded, None
        else:
            raise StateError(f"recapture() takes an op or a scope body f(s), got {type(work).__name__}")
        try:
            how = self._update_to(graph, cap, output, reinstantiate)
        except BaseException:
            cap.undo()  # the old graph goes on doing its old work; the new capture's results are no one's
            raise
        cap.forget()
        return how

    def _update_to(self, graph, cap: Capture, output, reinstantiate: bool) -> str:
        """The second half of ``recapture``: make this graph do ``graph``'s work."""
        stream, graphs = self._stream, self._graphs
        with self._lock:
            if self._closed:  # by the op being captured (a then callback, a branch function): no graph to update
                graphs.destroy(graph)
                raise StateError("this CudaGraph was closed while recapture() captured its new work (by a callback "
                                 "or branch function of the op): capture the op into a new graph, op.graph_on(stream)")
            reason = graphs.update(self._exec, graph, cap.label)
            if reason is None:
                for node in self._nodes:  # the new capture's nodes are on, as the nodes it reports say
                    if not node._enabled:
                        graphs.set_enabled(self._exec, node.handle, True, node.label)
                self._defined = [n.handle for n in cap.nodes]
                for node, origin in zip(cap.nodes, self._origin):
                    if node._via is not None:  # in a child's graph: set there, and pushed through the child node
                        continue
                    node.handle = origin  # exec's nodes keep the names of the graph it was instantiated from
                    if type(node) is ChildGraphNode:
                        node.via.child = origin
                graphs.destroy(self._shown)
                self._shown = graph
                return self._swap(cap, output, updated=True)
            if not reinstantiate:
                graphs.destroy(graph)
                raise GraphUpdateError(f"cuGraphExecUpdate refused the recapture of {cap.label} ({reason}): its "
                                       "topology or node kinds differ; pass reinstantiate=True to rebuild the graph")
            exec_ = graphs.instantiate(stream, graph, cap.label)  # (graph destroyed if that fails)
            old = (self._exec, self._graph, self._shown)
            self._exec, self._graph, self._shown = exec_, graph, None
            self._origin = self._defined = [n.handle for n in cap.nodes]
            graphs.close(old[0], old[1:])
            return self._swap(cap, output, updated=False)

    def _swap(self, cap: Capture, output, updated: bool) -> str:
        for node in self._nodes:
            node._stale = True
        self._adopt(cap, output)
        if updated:
            self.exec_updates += 1
            return "updated"
        self.reinstantiations += 1
        return "reinstantiated"

    # -- inspection ------------------------------------------------------------------
    def nodes(self) -> list[dict]:
        """One dict per node: its type and, for kernels, the kernel's name."""
        self._check_open()
        return self._graphs.nodes(self._shown if self._shown is not None else self._graph)

    def edges(self) -> list[tuple[int, int]]:
        """The graph's dependencies: ``(i, j)`` for each node j (an index into ``nodes()``) that
        runs after node i.  A serial capture is a chain; ``parallel=True`` makes branches."""
        self._check_open()
        return [(i, j) for i, j, _ in self._graphs.edges(self._current())]

    def summary(self) -> dict:
        """Node counts by type and kernel counts by (mangled) name."""
        counts, kernels = {}, {}
        for node in self.nodes():
            counts[node["type"]] = counts.get(node["type"], 0) + 1
            if node["type"] == "KERNEL":
                kernels[node["name"]] = kernels.get(node["name"], 0) + 1
        return {"nodes": sum(counts.values()), "by_type": counts, "kernels": kernels}

    def to_dot(self, path=None, verbose: bool = False) -> str:
        """The graph as Graphviz DOT (``cuGraphDebugDotPrint``); written to ``path`` if given."""
        self._check_open()
        text = self._graphs.dot(self._shown if self._shown is not None else self._graph, verbose)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def render(self, path, format: str | None = None):
        """The graph as a picture (SVG, PNG or PDF, from ``path``'s suffix or ``format``),
        drawn by Graphviz's ``dot`` from :meth:`to_dot`; returns the path."""
        return render_dot(self.to_dot(), path, format)

    # -- lifetime --------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the graph now (idempotent); the buffers it kept are released."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            exec_, graph, shown = self._exec, self._graph, self._shown
            self._exec = self._graph = self._shown = None
            self._keep, self._nodes, self._by_launch, self._checks = [], [], {}, ()
        self._graphs.close(exec_, (graph, shown))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"on {self._stream!r}"
        return f"<CudaGraph {state}>"


class Scope:
    """The recorder of ``CudaGraph.scope``: ``record(op)`` runs a graph-safe op
    on the capture stream at once (recording it) and returns its value.

    A scope entered by hand (``__enter__``) and collected without ``__exit__`` ends
    its capture as a failed one (nothing of it is kept, every op it ran is handed
    back) and releases its thread's execution lock, as cuda.core does for a
    GraphBuilder collected mid-capture."""

    def __init__(self, stream, instantiate: bool = True, parallel: bool = False):
        self.stream, self.graph, self._parallel = stream, None, parallel
        self._cap, self._ctx, self._rec, self._lock_cm = None, None, None, None
        self._instantiate, self.recorded = instantiate, None  # recorded: (graph, capture) when not instantiating
        self._thread = None  # the thread that opened the scope
        self._broken = None  # the CaptureError of a record() that failed after recording part of its op

    def record(self, op: DeviceOp):
        if self._ctx is None:
            if isinstance(op, DeviceOp):
                op.discard()  # refused, and the error says so: no warning on top
            raise StateError("record() outside the scope's capture: record inside `with CudaGraph.scope(stream) as "
                             "s:` (or the body of CudaGraph.scope(stream, body)), before it ends")
        if threading.get_ident() != self._thread:  # an execution context belongs to one thread
            raise StateError("record() from a thread other than the one that opened the scope; "
                             "record on that thread, or open a scope (on a stream of its own) in this one")
        if not isinstance(op, DeviceOp):
            raise not_recordable(op)
        op._armed = False  # taken in: recorded below, or refused with an error that says so
        if self._broken is not None:  # a fresh error each time: re-raising the stored one grew its traceback
            raise CaptureError(str(self._broken)) from self._broken
        self._cap.check_graph_safe(op)
        preload(op, self.stream.device)  # a no-op when already loaded; module loads are legal mid-capture on CUDA >= 12.3
        graphs, nodes = self.stream.device.graphs, len(self._cap.nodes)
        before = self._tips(graphs)
        try:
            return op._run(self._ctx)
        except BaseException as exc:
            if len(self._cap.nodes) != nodes or self._tips(graphs) != before:
                # part of the op is in the graph, and a graph cannot take work back: a scope that went
                # on would replay half an op whose record() raised, so the scope cannot end well
                self._broken = CaptureError(
                    f"s.record({op.describe()}) raised {type(exc).__name__} after recording part of its work, "
                    "which a capture cannot take back: the graph would replay half of the op. The scope "
                    "fails (nothing of it is kept); fix the op, or catch its error outside the scope")
            if isinstance(exc, RecursionError):
                raise too_deep(op, exc) from exc
            raise

    def _tips(self, graphs):
        """The capture's dependencies (what the next work follows), as node ids; None if unreadable."""
        try:
            return frozenset(graphs.node_id(n) for n in graphs.capture_deps(self.stream))
        except CudaError:  # a broken capture: whatever was recorded, it cannot end well
            return None

    def __enter__(self) -> "Scope":
        self._lock_cm = executing(SCOPE)
        self._lock_cm.__enter__()
        self._lock_cm.thread = threading.current_thread()  # its ident may be reused once it ends
        try:
            self._cap = Capture("CudaGraph.scope", self._parallel)
            self._rec = Recording(self.stream, self._cap, self._instantiate).__enter__()
            self._ctx = ExecutionContext(self.stream, self._cap)
            self._thread = threading.get_ident()
            self._broken = None
        except BaseException:
            self._lock_cm.__exit__(None, None, None)
            raise
        return self

    def __del__(self):
        try:
            if self._ctx is not None:  # entered, never exited: end the capture as a failed one
                self._ctx = None
                try:
                    self._rec.__exit__(StateError, None, None)  # aborted, every op it ran handed back
                finally:
                    self._lock_cm.release_from_anywhere()  # the lock of the thread that entered it
        except Exception:
            pass

    def __exit__(self, exc_type, exc, tb):
        if self._rec is None:  # never entered, or already exited
            raise StateError("CudaGraph.scope(stream).__exit__ without its __enter__: use it as `with "
                             "CudaGraph.scope(stream) as s:`")
        self._ctx = None
        broken = self._broken if exc_type is None else None
        if broken is not None:  # a record() failed halfway and the body went on: end it as a failed capture
            exc_type, exc, tb = CaptureError, broken, None
        try:
            self._rec.__exit__(exc_type, exc, tb)  # ends (or aborts) the capture; instantiates
            if broken is not None:
                raise CaptureError(str(broken)) from broken
            if exc_type is not None:
                return False
            if not self._instantiate:
                self.recorded = (self._rec.graph, self._cap)
                return False
            try:
                self.graph = CudaGraph(self.stream, self._rec.graph, self._rec.exec_, None, self._cap)
            except BaseException:
                self._cap.undo()
                raise
            self._cap.forget()
            return False
        finally:
            self._rec = None
            self._lock_cm.__exit__(None, None, None)
