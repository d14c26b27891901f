"""The state of one capture in progress, and how a launch becomes a node."""
from __future__ import annotations

from ..errors import GraphSafetyError
from ..kernel import KernelLaunch
from ..op import DeviceOp, SharedOp
from .nodes import KernelNode


class Capture:
    """State of one capture in progress: what the graph must keep alive and
    the kernel nodes recorded so far.

    It also knows what executing into it may change, so that a capture that
    fails (or whose graph is never made) can hand it back with ``undo()``: the
    ops that had not run before it (``fresh``).  Every op a capture runs is
    checked for graph safety first — the op's tree, what a ``then`` callback
    returns, a loop's body — and that walk is where they are found."""

    __slots__ = ("keep", "label", "nodes", "by_launch", "fresh")

    def __init__(self, label: str):
        self.keep, self.label = [], label
        self.nodes, self.by_launch = [], {}
        self.fresh = []

    def check_graph_safe(self, op: DeviceOp) -> None:
        bad = op.unsafe_for_graphs(self.fresh)
        if bad is not None:
            raise GraphSafetyError(f"{bad.describe()} cannot be recorded into a graph: {bad.unsafe_reason}")

    def record_launch(self, stream, launch, head, values, launch_args, plan) -> None:
        """Record a checked kernel launch on the capturing ``stream``: it becomes a
        kernel node of the graph, which keeps its arguments alive and can change
        them between replays (``graph.node(launch).set(...)``)."""
        plan.launcher(stream, plan.config, *launch_args)
        node = KernelNode(launch.kernel, plan.generics, launch.kernel.name_expression(plan.generics), values,
                          launch_args, launch._mutable, plan.function, plan.config,
                          stream.device.graphs.last_node(stream), head=head)
        self.nodes.append(node)
        self.by_launch[launch] = node  # the node keeps the launch's kernel and buffers alive

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
