"""The reference device's graphs: a capture records a tape of steps (a kernel's
NumPy reference with its arguments, a copy, a loop over a body tape, a host
function: a host callback, or the NumPy reference of foreign work), and a
graph launch runs them in order.  Steps are updated in place, as a CUDA
graph's nodes are by cuGraphExecUpdate and cuGraphExecKernelNodeSetParams."""
from __future__ import annotations

import ctypes

from .graphs import capture_failed


class Kernel:
    __slots__ = ("fn", "args")
    kind = "kernel"

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    @property
    def name(self) -> str:
        return self.fn.name

    def run(self) -> None:
        self.fn.reference(self.fn.generics, *self.args)

    def take(self, other: "Kernel") -> None:
        self.args = other.args


class Copy:
    __slots__ = ("dst", "src", "nbytes")
    kind, name = "memcpy", "memcpy"

    def __init__(self, dst, src, nbytes):
        self.dst, self.src, self.nbytes = dst, src, nbytes

    def run(self) -> None:
        ctypes.memmove(self.dst, self.src, self.nbytes)

    def take(self, other: "Copy") -> None:
        self.dst, self.src, self.nbytes = other.dst, other.src, other.nbytes


class Host:
    """A host function: ``kind`` "host" for a host callback (a HOST node on a GPU),
    "graph" for foreign work's NumPy reference (a child GRAPH node there)."""
    __slots__ = ("fn", "name", "kind")

    def __init__(self, fn, name: str, kind: str):
        self.fn, self.name, self.kind = fn, name, kind

    def run(self) -> None:
        self.fn()

    def take(self, other: "Host") -> None:
        self.fn = other.fn


class While:
    """A conditional WHILE node: ``control(start)`` is the control kernel's test."""
    __slots__ = ("name", "control", "body")
    kind = "loop"

    def __init__(self, name, control, body):
        self.name, self.control, self.body = name, control, body

    def run(self) -> None:
        go = self.control(True)
        while go:
            for step in self.body:
                step.run()
            go = self.control(False)

    def take(self, other: "While") -> None:
        self.control = other.control
        for mine, theirs in zip(self.body, other.body):
            mine.take(theirs)


def _shape(tape) -> list:
    return [(s.kind, s.name, _shape(s.body) if s.kind == "loop" else None) for s in tape]


class TapeGraphs:
    """The reference device's ``graphs`` (the functions of runtime/graphs.py):
    a graph is the tape its capture recorded, and instantiating it is taking it."""

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
        for step in exec_:
            step.run()

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
    def set_kernel_node(exec_, handle, params, launch_args, label: str) -> None:
        handle.args = [getattr(a, "_array", a) for a in launch_args]

    def capture_while(self, stream, label: str, launch_control, host_control, run_body) -> None:
        body_stream = self._stream_type(stream.device)
        body_stream.begin_capture()
        try:
            run_body(body_stream)
        finally:
            body, _ = body_stream._end_capture()
        stream._run(While(label, host_control, body))

    @staticmethod
    def nodes(graph) -> list[dict]:
        kinds = {"kernel": "KERNEL", "loop": "CONDITIONAL", "host": "HOST", "graph": "GRAPH"}
        return [{"type": kinds.get(s.kind, "MEMCPY"), "name": s.name} for s in graph]

    @staticmethod
    def dot(graph, verbose: bool) -> str:
        return "digraph deviceop_reference {\n" + "".join(
            f'  n{i} [label="{n["type"]} {n.get("name", "")}"];\n' + (f"  n{i - 1} -> n{i};\n" if i else "")
            for i, n in enumerate(TapeGraphs.nodes(graph))) + "}\n"
