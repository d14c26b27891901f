"""The state of one capture in progress, and how a launch becomes a node."""
from __future__ import annotations

import threading

from ..api import memset
from ..errors import CaptureError, GraphSafetyError, LaunchError
from ..execution import _running
from ..foreign import refuse_uncallable
from ..kernel import KernelLaunch
from ..op import DeviceOp, SharedOp
from .copy_nodes import MemcpyNode, MemsetNode
from .nodes import KernelNode
from .parallel import Dag, copy_footprint, fill_footprint, kernel_footprint
from ..runtime.stream import capturing, stream_key


class ReplayCheck:
    """Something a graph keeps (in ``capture.keep``) that must still hold before each
    replay: ``check_replay()`` raises if the graph must not replay (a collective whose
    communicator was destroyed).  Equal checks are made once per replay."""

    __slots__ = ()

    def check_replay(self) -> None:  # pragma: no cover - subclasses say what they check
        pass


class Capture:
    """State of one capture in progress: what the graph must keep alive and
    the nodes recorded so far (kernels, copies, fills), by the op that made each.

    It also knows what executing into it may change, so that a capture that
    fails (or whose graph is never made) can hand it back with ``undo()``: the
    ops that had not run before it (``fresh``).  Every op a capture runs is
    checked for graph safety first — the op's tree, what a ``then`` callback
    returns, a loop's body — and that walk is where they are found.

    ``parallel``: each kernel, copy and fill node gets the dependencies its buffers
    need instead of following the node before it (graph/parallel.py); ``dags``
    holds the dependency state of each stream it records on."""

    __slots__ = ("keep", "label", "nodes", "by_launch", "fresh", "before", "dags", "hosts")

    def __init__(self, label: str, parallel: bool = False):
        self.keep, self.label = [], label
        self.nodes, self.by_launch = [], {}
        self.fresh = []
        # an event recorded on the stream just before the capture began: foreign work's
        # warm-up runs after what the stream did before the capture (deviceop/foreign.py)
        self.before = None
        self.dags = {} if parallel else None  # id(stream) -> (stream, Dag): the stream is kept, so ids stay unique
        self.hosts = []  # the host nodes recorded (host callbacks, also in child graphs), by label

    @property
    def parallel(self) -> bool:
        return self.dags is not None

    def _recorded(self, stream, footprint, label: str, record):
        """Run ``record()`` (which enqueues one node on ``stream``) in a parallel capture: the
        stream's dependencies are set from ``footprint`` first.  Returns ``(the node's handle,
        (dag, item))`` (``label`` names the node in update errors)."""
        entry = self.dags.get(id(stream))
        if entry is None:
            entry = self.dags[id(stream)] = (stream, Dag(stream.device.graphs))
        dag = entry[1]
        deps = dag.before(stream, footprint)
        record()
        handle, item = dag.after(stream, deps, footprint, label)
        return handle, (dag, item)

    def check_graph_safe(self, op: DeviceOp) -> None:
        bad = op.unsafe_for_graphs(self.fresh)
        if bad is not None:
            raise GraphSafetyError(f"{bad.describe()} cannot be recorded into a graph: {bad.unsafe_reason}")

    def record_launch(self, stream, launch, head, values, launch_args, plan) -> None:
        """Record a checked kernel launch on the capturing ``stream``: it becomes a
        kernel node of the graph, which keeps its arguments alive and can change
        them between replays (``graph.node(launch).set(...)``)."""
        kernel = launch.kernel
        label = kernel.name_expression(plan.generics)
        if self.dags is None:
            plan.launcher(stream, plan.config, *launch_args)
            handle, item = stream.device.graphs.last_node(stream), None
        else:
            handle, item = self._recorded(stream, kernel_footprint(kernel.params, launch_args), label,
                                          lambda: plan.launcher(stream, plan.config, *launch_args))
        node = KernelNode(kernel, plan.generics, label, values, launch_args, launch._mutable, plan.function,
                          plan.config, handle, head=head)
        node._item = item
        self.nodes.append(node)
        self.by_launch[launch] = node  # the node keeps the launch's kernel and buffers alive

    def record_copy(self, stream, op, dst, src) -> None:
        """Record ``op``'s copy from ``src`` into ``dst`` on the capturing ``stream``: a
        MEMCPY node, which ``graph.node(op).set(dst=..., src=...)`` can point elsewhere."""
        if self.dags is None:
            stream.memcpy(dst.data_ptr, src.data_ptr, dst.nbytes)
            handle, item = stream.device.graphs.last_node(stream), None
        else:
            handle, item = self._recorded(stream, copy_footprint(dst, src), f"api.memcpy({dst.size})",
                                          lambda: stream.memcpy(dst.data_ptr, src.data_ptr, dst.nbytes))
        self._add(op, MemcpyNode(dst, src, handle), item)

    def record_fill(self, stream, op, dst, value, bits: int, size: int, count: int) -> None:
        """Record ``op``'s memset of ``dst``: a MEMSET node (``graph.node(op).set(...)``)."""
        if self.dags is None:
            memset(stream, dst.data_ptr, bits, size, count)
            handle, item = stream.device.graphs.last_node(stream), None
        else:
            handle, item = self._recorded(stream, fill_footprint(dst), f"api.fill({dst.size})",
                                          lambda: memset(stream, dst.data_ptr, bits, size, count))
        self._add(op, MemsetNode(dst, value, handle), item)

    def _add(self, op, node, item=None) -> None:
        node._item = item
        self.nodes.append(node)
        if op is not None:
            self.by_launch[op] = node  # the node keeps its buffers alive, and the graph keeps its nodes

    def undo(self) -> None:
        """Leave no op marked as executed by this capture: every shared op it ran
        (completed or failed) is unclaimed again, so a clone run later computes
        it instead of returning a buffer no graph will fill, and every op it
        executed may be executed again (ops that had run before it stay as they were)."""
        for op in self.fresh:
            op._consumed = False
            op._armed = False  # the capture's exception said it did not run: dropping it is no surprise
            if type(op) is SharedOp and (op.core.done or op.core.failed):
                op.core.reset()
        self.forget()

    def forget(self) -> None:
        """The graph was made: nothing to undo, and no op kept alive for it."""
        self.fresh = []


# held while a thread checks that a stream is not capturing and claims it (``capturing``): two
# threads beginning a capture on one stream at once, the second is refused before it begins, and
# never ends (aborts) the first one's capture as its own failed one
_claiming = threading.Lock()


class Recording:
    """One capture on ``stream`` into ``cap``, begin to end: the one sequence that
    ``graph_on``, ``CudaGraph.scope`` and ``recapture`` (and the foreign work their ops
    run) go through, driving the device's graph backend (``stream.device.graphs``)::

        with Recording(stream, cap) as rec:
            ...               # record work on stream
        rec.graph, rec.exec_  # captured; instantiated (None with instantiate=False)

    Every failure ends the capture and hands back what it ran (``cap.undo()``): a
    refusal before it begins changes nothing; a begin that fails or is interrupted
    is aborted; work that raises is aborted (the partial graph destroyed); an end
    that fails (a broken capture) or an instantiate that fails leaves no graph (the
    backend destroys it).  No stream is left capturing and no graph leaked.

    While the capture is open the stream notes which thread captures it
    (runtime.stream.capturing): eager work other threads enqueue on it is refused
    instead of being recorded into this graph (execution.executing).  A capture
    does not begin while another thread is enqueueing work on the stream."""

    __slots__ = ("stream", "cap", "graph", "exec_", "_instantiate")

    def __init__(self, stream, cap: Capture, instantiate: bool = True):
        self.stream, self.cap, self._instantiate = stream, cap, instantiate
        self.graph = self.exec_ = None

    def __enter__(self) -> "Recording":
        stream, cap = self.stream, self.cap
        me, key = threading.current_thread(), stream_key(stream)
        with _claiming:  # one thread claims the stream: a capture someone else began is not ours to end
            if key in capturing or stream.is_capturing():
                raise CaptureError("this stream is already capturing; end that capture first")
            capturing[key] = (me.ident, me.name, cap.label)  # first, then look: see execution.executing
        try:
            cap.before = stream.record_event(timing=False)
            busy = [i for i, e in _running.copy().items() if e.stream is not None and stream_key(e.stream) == key
                    and i != me.ident]
            if busy:
                raise CaptureError(f"capturing {cap.label}: another thread is executing work on this stream now "
                                   "(sync_on / async_on), which the capture would record into the graph. Capture on "
                                   "a stream of your own (device.new_stream()), or once that work is enqueued")
        except BaseException:
            capturing.pop(key, None)
            raise
        try:
            stream.device.graphs.begin(stream)
        except BaseException:  # also a KeyboardInterrupt after the driver began it, before it returned
            self.abort()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        stream, cap = self.stream, self.cap
        if exc_type is not None:
            try:
                self.abort()
            finally:
                cap.undo()
            return False
        try:
            try:
                self.graph = stream.device.graphs.end(stream, cap.label)
            finally:
                capturing.pop(stream_key(stream), None)  # other threads may enqueue on the stream again
            if self._instantiate:
                self.exec_ = stream.device.graphs.instantiate(stream, self.graph, cap.label)
        except BaseException:
            cap.undo()
            raise
        return False

    def abort(self) -> None:
        """End a failed capture and destroy whatever it recorded (the ops it ran are the caller's)."""
        try:
            self.stream.device.graphs.abort(self.stream)
        finally:
            capturing.pop(stream_key(self.stream), None)


def preload(op: DeviceOp, device) -> None:
    """Compile and load every kernel the op tree launches, before the capture
    begins (loading a module is not capture work)."""
    stack = [op]
    seen = set()
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, KernelLaunch):
            gen = o._generics if o._generics is not None else o.infer_generics()
            if gen is not None:
                o.kernel.function(device, gen)
        stack.extend(o.children())


def not_recordable(x) -> LaunchError:
    """The error of ``scope.record(x)`` for an ``x`` that is no op: it would record nothing."""
    if callable(x):
        what = ("which would run once, now, and never on a replay: put another library's GPU work "
                "in dop.foreign(body, reads=[...], writes=[...]) and host work that must run at every replay in "
                "dop.host_callback(fn), and record that op")
    elif hasattr(x, "__array_interface__") or hasattr(x, "__array__"):
        what = ("which is host data, not work: copy it into a device buffer before the scope (dop.from_numpy) and record "
                "api.memcpy(dst, src) to copy it at every replay")
    else:
        what = "which is no op, so there is nothing to record: record a kernel launch, api.memcpy, dop.foreign(...), " \
               "dop.host_callback(...), or a value made an op with dop.value(x)"
    return LaunchError(f"scope.record() takes an op; got a {type(x).__name__}, {what}")


def check_body(label: str, body) -> None:
    """Refuse a scope body that is not a function of the scope, before the capture begins
    (called inside it, its TypeError was a raw one from the middle of a capture)."""
    if not callable(body):
        raise LaunchError(f"{label} takes a function body(s) that records ops with s.record(op), "
                          f"got a {type(body).__name__}")
    refuse_uncallable(label, "body", body, ["s"], [], "define it as def body(s): ... s.record(op)")


def flag(name: str, on) -> bool:
    if not isinstance(on, bool):
        raise LaunchError(f"{name} takes True or False, got {on!r}")
    return on
