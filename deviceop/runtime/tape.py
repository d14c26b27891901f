"""The reference device's graphs: a capture records a tape of steps (a kernel's
NumPy reference with its arguments, a copy, a memset, a loop over a body tape,
a branch between body tapes, a host function: a host callback, or the NumPy
reference of foreign work, a child graph's tape), and a graph launch runs them.
Steps are updated in place, as a CUDA graph's nodes are by cuGraphExecUpdate and
cuGraphExec*NodeSetParams; a kernel, copy or memset step that is switched off
(``enabled`` False, as cuGraphNodeSetEnabled does on a GPU) is skipped.

A tape is also a graph: each step records the steps it depends on (``Tape.after``,
what the capturing stream's dependencies were, as a CUDA stream capture makes
edges).  A serial capture makes a chain; a parallel one (graph/parallel.py) makes
branches, and a launch then runs the steps in an order that respects the edges
and nothing else: among the steps ready to run, the one recorded last first.  So
independent branches run in reverse capture order here, and a result that
depended on an edge the capture left out would differ from the serial one."""
from __future__ import annotations

import copy
import ctypes
import heapq

import numpy as np

from . import refcache
from .graphs import capture_failed
from .stream import closed_stream


class Tape(list):
    """The steps a capture recorded, and for each the steps it depends on (``after``)."""

    __slots__ = ("after", "_order")

    def __init__(self):
        super().__init__()
        self.after, self._order = [], None

    def record(self, step, deps) -> None:
        self.append(step)
        self.after.append(tuple(deps))

    def deps_of(self) -> list[tuple[int, ...]]:
        """Each step's dependencies as indices into the tape."""
        index = {id(s): i for i, s in enumerate(self)}
        return [tuple(sorted(index[id(d)] for d in deps)) for deps in self.after]

    def order(self) -> list:
        """The steps in the order a launch runs them (see the module docstring)."""
        if self._order is None:
            deps = self.deps_of()
            if all(d == ((i - 1,) if i else ()) for i, d in enumerate(deps)):
                self._order = list(self)  # a chain: capture order
            else:
                waiting = [len(d) for d in deps]
                users = [[] for _ in deps]
                for j, d in enumerate(deps):
                    for i in d:
                        users[i].append(j)
                ready = [-j for j, w in enumerate(waiting) if not w]
                heapq.heapify(ready)
                order = []
                while ready:
                    j = -heapq.heappop(ready)
                    order.append(self[j])
                    for k in users[j]:
                        waiting[k] -= 1
                        if not waiting[k]:
                            heapq.heappush(ready, -k)
                self._order = order
        return self._order


def run_tape(tape) -> None:
    """Run a tape's steps (a chain in order, a graph as its edges allow), skipping those
    switched off (a step of another module, a collective's, has no switch: it always runs)."""
    for step in tape.order() if type(tape) is Tape else tape:
        if getattr(step, "enabled", True):
            step.run()


def copy_tape(tape, copies: dict) -> Tape:
    """A copy of ``tape`` whose steps are copies (bodies too), edges kept; ``copies``
    receives ``id(step) -> copy`` for every step copied."""
    new = Tape()
    for step, deps in zip(tape, getattr(tape, "after", [()] * len(tape))):
        twin = copy.copy(step)
        if isinstance(step, While):
            twin.body = copy_tape(step.body, copies)
        elif isinstance(step, Branch):
            twin.bodies = [copy_tape(b, copies) for b in step.bodies]
        elif isinstance(step, Child):
            twin.body = copy_tape(step.body, copies)
        copies[id(step)] = twin
        new.record(twin, [copies[id(d)] for d in deps])
    return new


class Kernel:
    __slots__ = ("fn", "args", "enabled")
    kind = "kernel"

    def __init__(self, fn, args):
        self.fn, self.args, self.enabled = fn, args, True

    @property
    def name(self) -> str:
        return self.fn.name

    def run(self) -> None:
        with np.errstate(all="ignore"):  # IEEE arithmetic as on the GPU: inf and NaN, never a NumPy warning
            self.fn.reference(self.fn.generics, *self.args)
        refcache.kernel_wrote(getattr(self.fn, "written", None), self.args)  # its float64 copies of what it wrote are stale

    def take(self, other: "Kernel") -> None:
        self.args = other.args


class Copy:
    __slots__ = ("dst", "src", "nbytes", "enabled")
    kind, name = "memcpy", "memcpy"

    def __init__(self, dst, src, nbytes):
        self.dst, self.src, self.nbytes, self.enabled = dst, src, nbytes, True

    def run(self) -> None:
        ctypes.memmove(self.dst, self.src, self.nbytes)
        refcache.wrote_bytes(self.dst, self.nbytes)

    def take(self, other: "Copy") -> None:
        self.dst, self.src, self.nbytes = other.dst, other.src, other.nbytes


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


class Memset:
    """``count`` elements of ``size`` bytes (1, 2 or 4) at ``dst`` set to the bits ``value``."""
    __slots__ = ("dst", "value", "size", "count", "enabled")
    kind, name = "memset", "memset"

    def __init__(self, dst, value, size, count):
        self.dst, self.value, self.size, self.count, self.enabled = dst, value, size, count, True

    def run(self) -> None:
        if self.count:
            words = (ctypes.c_char * (self.size * self.count)).from_address(self.dst)
            np.frombuffer(words, dtype=_UINT[self.size]).fill(self.value)
            refcache.wrote_bytes(self.dst, self.size * self.count)

    def take(self, other: "Memset") -> None:
        self.dst, self.value, self.size, self.count = other.dst, other.value, other.size, other.count


class Host:
    """A host function: ``kind`` "host" for a host callback (a HOST node on a GPU),
    "graph" for foreign work's NumPy reference (a child GRAPH node there)."""
    __slots__ = ("fn", "name", "kind")
    enabled = True  # (the driver switches only kernel, memcpy and memset nodes on and off)

    def __init__(self, fn, name: str, kind: str):
        self.fn, self.name, self.kind = fn, name, kind

    def run(self) -> None:
        self.fn()
        refcache.wrote_anything()  # a host function may write any memory

    def take(self, other: "Host") -> None:
        self.fn = other.fn


class While:
    """A conditional WHILE node: ``control(start)`` is the control kernel's test."""
    __slots__ = ("name", "control", "body")
    kind, enabled = "loop", True

    def __init__(self, name, control, body):
        self.name, self.control, self.body = name, control, body

    @property
    def bodies(self) -> list:
        return [self.body]

    def run(self) -> None:
        go = self.control(True)
        while go:
            run_tape(self.body)
            go = self.control(False)

    def take(self, other: "While") -> None:
        self.control = other.control
        for mine, theirs in zip(self.body, other.body):
            mine.take(theirs)


class Branch:
    """A conditional IF or SWITCH node: ``select()`` is the control kernel's choice,
    the index of the body to run (None: none of them)."""
    __slots__ = ("name", "select", "bodies")
    kind, enabled = "branch", True

    def __init__(self, name, select, bodies):
        self.name, self.select, self.bodies = name, select, bodies

    def run(self) -> None:
        chosen = self.select()
        if chosen is not None:
            run_tape(self.bodies[chosen])

    def take(self, other: "Branch") -> None:
        self.select = other.select
        for body, theirs in zip(self.bodies, other.bodies):
            for mine, step in zip(body, theirs):
                mine.take(step)


class Child:
    """A child-graph node: a copy of another graph's tape, run as one step."""
    __slots__ = ("name", "body")
    kind, enabled = "child", True

    def __init__(self, name, body):
        self.name, self.body = name, body

    @property
    def bodies(self) -> list:
        return [self.body]

    def run(self) -> None:
        run_tape(self.body)

    def take(self, other: "Child") -> None:
        for mine, step in zip(self.body, other.body):
            mine.take(step)


def _shape(tape) -> list:
    deps = tape.deps_of() if type(tape) is Tape else [None] * len(tape)
    return [(s.kind, s.name, [_shape(b) for b in s.bodies] if s.kind in ("loop", "branch", "child") else None, d)
            for s, d in zip(tape, deps)]


class TapeGraphs:
    """The reference device's ``graphs``: the GraphBackend (runtime/graph_backend.py)
    that runtime/graphs.py is on a GPU, over tapes.  A graph is the tape its capture
    recorded, and instantiating it is taking it."""

    def __init__(self, stream_type):
        self._stream_type = stream_type  # what a loop body is captured on

    @staticmethod
    def begin(stream) -> None:
        stream.begin_capture()

    @staticmethod
    def abort(stream) -> None:
        stream._end_capture()

    @staticmethod
    def end(stream, label: str):
        tape, broken = stream._end_capture()
        if broken:  # a host sync broke it
            raise capture_failed(label, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
        return tape

    @staticmethod
    def instantiate(stream, graph, label: str):
        return graph

    @staticmethod
    def launch(exec_, stream) -> None:
        if stream._closed:  # as cuGraphLaunch on a closed stream's handle is refused on a GPU
            raise closed_stream("graph.replay()")
        run_tape(exec_)

    @staticmethod
    def update(exec_, graph, label: str) -> str | None:
        """Each step of ``exec_`` takes the arguments of its counterpart in ``graph``
        (its nodes keep their identity, as cuGraphExecUpdate's do); refused when the
        steps differ in kind or kernel."""
        if _shape(exec_) != _shape(graph):
            return "TOPOLOGY_CHANGED"
        for mine, theirs in zip(exec_, graph):
            mine.take(theirs)
        return None

    @staticmethod
    def destroy(graph) -> None:
        pass

    @staticmethod
    def close(exec_, graphs) -> None:
        pass

    @staticmethod
    def last_node(stream):
        tape = stream._tape
        return tape[-1] if tape else None

    @staticmethod
    def node_id(node) -> int:
        return id(node)  # a step is its own node: one object, one id

    @staticmethod
    def capture_deps(stream) -> list:
        return list(stream._deps)

    @staticmethod
    def set_capture_deps(stream, nodes) -> None:
        stream._deps = list(nodes)

    @staticmethod
    def set_kernel_node(exec_, handle, params, launch_args, label: str) -> None:
        handle.args = [getattr(a, "_array", a) for a in launch_args]

    @staticmethod
    def clone(graph, exec_, handles) -> tuple:
        """runtime/graphs.py's ``clone``: a copy of the tape ``graph`` (the definition of the work
        ``exec_`` does: ``exec_`` itself, or the recapture it was updated to) and the copies of
        ``handles``, steps of ``graph``.  As on a GPU, node updates made since on ``exec_`` alone
        are not in the copy (graph/child.py writes them), and as cuGraphNodeFindInClone, only
        the graph's own steps are found: one in a loop's or branch's body is None."""
        copies = {}
        copy = copy_tape(graph, copies)
        mine = {id(s) for s in graph}
        return copy, [copies[id(h)] if h is not None and id(h) in mine else None for h in handles]

    @staticmethod
    def add_child(stream, source, label: str):
        """runtime/graphs.py's ``add_child``: a Child step running a copy of the tape ``source``."""
        node = Child(label, copy_tape(source, {}))
        stream._run(node)
        return node

    @staticmethod
    def define_kernel_node(handle, params, launch_args) -> None:
        handle.args = [getattr(a, "_array", a) for a in launch_args]

    @staticmethod
    def define_memcpy_node(handle, dst: int, src: int, nbytes: int) -> None:
        handle.dst, handle.src, handle.nbytes = dst, src, nbytes

    @staticmethod
    def define_memset_node(handle, dst: int, value: int, size: int, count: int) -> None:
        handle.dst, handle.value, handle.size, handle.count = dst, value, size, count

    @staticmethod
    def update_child(exec_, child, source, label: str) -> None:
        """The Child step ``child`` takes the parameters of the tape ``source`` (the copy it was
        made from, updated since), as cuGraphExecChildGraphNodeSetParams does."""
        for mine, step in zip(child.body, source):
            mine.take(step)

    @staticmethod
    def set_enabled(exec_, handle, on: bool, label: str) -> None:
        handle.enabled = on

    @staticmethod
    def set_memcpy_node(exec_, handle, dst: int, src: int, nbytes: int, device, label: str) -> None:
        handle.dst, handle.src, handle.nbytes = dst, src, nbytes

    @staticmethod
    def set_memset_node(exec_, handle, dst: int, value: int, size: int, count: int, device, label: str) -> None:
        handle.dst, handle.value, handle.size, handle.count = dst, value, size, count

    def _capture_body(self, stream, run) -> list:
        """The tape ``run(body_stream)`` records on a stream of its own."""
        body_stream = self._stream_type(stream.device)
        body_stream.begin_capture()
        try:
            run(body_stream)
        finally:
            body, _ = body_stream._end_capture()
        return body

    # The step is recorded before its bodies are, as a GPU adds the conditional node before capturing
    # into its bodies: a body that fails leaves the capture changed (a scope that goes on is broken).
    def capture_while(self, stream, label: str, launch_control, host_control, run_body) -> None:
        step = While(label, host_control, Tape())
        stream._run(step)
        step.body = self._capture_body(stream, run_body)

    def capture_branches(self, stream, label: str, kind: str, count: int, several: bool, launch_select,
                         host_select, run_branch) -> None:
        """runtime/graphs.py's ``capture_branches``: one step whose ``host_select()`` picks the body."""
        step = Branch(label, host_select, [])
        stream._run(step)
        for i in range(count):
            step.bodies.append(self._capture_body(stream, lambda s, i=i: run_branch(i, s)))

    @staticmethod
    def nodes(graph) -> list[dict]:
        kinds = {"kernel": "KERNEL", "loop": "CONDITIONAL", "branch": "CONDITIONAL", "host": "HOST", "graph": "GRAPH",
                 "child": "GRAPH", "memset": "MEMSET"}
        return [{"type": kinds.get(s.kind, "MEMCPY"), "name": s.name} for s in graph]

    @staticmethod
    def edges(graph) -> list[tuple[int, int, str]]:
        """runtime/graphs.py's ``edges``: ``(i, j, "full")`` for each step j that depends on step i."""
        return sorted((i, j, "full") for j, deps in enumerate(graph.deps_of()) for i in deps)

    @staticmethod
    def dot(graph, verbose: bool) -> str:
        nodes = TapeGraphs.nodes(graph)
        return "digraph deviceop_reference {\n" + "".join(
            f'  n{i} [label="{_quoted(n["type"] + " " + n.get("name", ""))}"];\n' for i, n in enumerate(nodes)) + "".join(
            f"  n{i} -> n{j};\n" for i, j, _ in TapeGraphs.edges(graph)) + "}\n"


def _quoted(label: str) -> str:
    """``label`` inside a DOT string: a foreign op's or host callback's name may hold quotes and newlines."""
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
