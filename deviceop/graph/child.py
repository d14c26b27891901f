"""Child graphs: ``graph.launch()`` captured into another graph (``zip_(a, g.launch(), b)``,
``s.record(g.launch())``) becomes one child-graph node that runs a copy of ``g``'s work.

The copy is ``g`` as it is when the outer capture runs it: its nodes' current
parameters (updates made through ``g.node(op).set`` so far included).  After
that the two graphs are two copies, as CUDA's child-graph nodes are clones:

* ``outer.node(launch)``, for an op ``g`` captured, is the outer graph's copy of
  that kernel, copy or fill node: its ``set`` changes what the outer graph runs
  (cuGraph*NodeSetParams on the outer graph's own clone of ``g``, then
  cuGraphExecChildGraphNodeSetParams from that clone), and ``g`` keeps its own;
  ``g.node(launch).set`` changes ``g`` only.
* ``outer.node(g_launch_op)`` is the ChildGraphNode; when ``g`` was launched
  more than once into the outer graph, ``outer.node(g_launch_op).node(launch)``
  names the copy in that child.
* Refused, with the reason: switching a child's node off (deviceop switches
  only a graph's own nodes), capturing the launch of a graph whose nodes are
  switched off (the copy would run them), and, by the driver, a graph holding
  memory allocation nodes (deviceop never makes one: allocations are not
  graph-safe, by design).

On the reference device the child is a tape step holding a copy of ``g``'s tape.
"""
from __future__ import annotations

from ..api import fill_pattern
from ..errors import LaunchError, StateError
from ..foreign import in_conditional_body
from ..op import DeviceOp, warn_if_unexecuted
from .copy_nodes import MemcpyNode, MemsetNode
from .nodes import KernelNode, Node


class InChild:
    """The driver calls of the nodes of one child-graph node: a node's new parameters go
    into ``source`` (the outer graph's own clone of the graph the child copied, where the
    node copies have their handles), then from it into the executable graph through the
    child node.  ``source`` is destroyed with this object (the outer graph keeps it)."""

    __slots__ = ("graphs", "child", "source", "label")

    def __init__(self, graphs, child, source, label: str):
        self.graphs, self.child, self.source, self.label = graphs, child, source, label

    def __del__(self):
        try:
            self.graphs.destroy(self.source)
        except Exception:
            pass

    def set_kernel_node(self, exec_, handle, params, launch_args, label: str) -> None:
        self.graphs.define_kernel_node(handle, params, launch_args)
        self.graphs.update_child(exec_, self.child, self.source, label)

    def set_memcpy_node(self, exec_, handle, dst: int, src: int, nbytes: int, device, label: str) -> None:
        self.graphs.define_memcpy_node(handle, dst, src, nbytes)
        self.graphs.update_child(exec_, self.child, self.source, label)

    def set_memset_node(self, exec_, handle, dst: int, value: int, size: int, count: int, device, label: str) -> None:
        self.graphs.define_memset_node(handle, dst, value, size, count)
        self.graphs.update_child(exec_, self.child, self.source, label)

    def set_enabled(self, exec_, handle, on: bool, label: str) -> None:
        raise StateError(f"{label} is a node of a child graph ({self.label}), and deviceop switches only a graph's own "
                         "nodes on and off: switch it in the graph it was captured in before that graph's launch "
                         "is captured, or make it a branch of the outer graph (dop.if_)")


class ChildGraphNode(Node):
    """The child-graph node a ``graph.launch()`` became: ``node(launch)`` is the copy of a
    node of that graph this child holds (see the module docstring)."""

    __slots__ = ("via", "_copies")

    def __init__(self, label: str, handle, via: InChild, copies: dict):
        super().__init__(label, handle)
        self.via, self._copies = via, copies

    @property
    def enabled(self) -> bool:
        return True

    @enabled.setter
    def enabled(self, on) -> None:
        raise StateError(f"{self.label} is a child-graph node, which CUDA cannot switch off (cuGraphNodeSetEnabled "
                         "takes kernel, memcpy and memset nodes): switch off its nodes in the graph it copies before "
                         "capturing its launch, or make the launch a branch (dop.if_)")

    def node(self, launch) -> Node:
        """This child's copy of the node ``launch`` became in the graph it copies."""
        node = self._copies.get(launch) if isinstance(launch, DeviceOp) else None  # (a list is no key)
        if node is None:
            what = launch.describe() if hasattr(launch, "describe") else type(launch).__name__
            raise StateError(f"{what} is not a node of the graph {self.label} copies: pass an op that graph captured")
        return node

    def __repr__(self) -> str:
        return f"<ChildGraphNode {self.index}: {self.label}, {len(self._copies)} updatable nodes>"


class Ambiguous:
    """What ``outer.node(launch)`` finds for an op of a graph launched into the outer one more than once."""

    __slots__ = ("count",)

    def __init__(self):
        self.count = 2

    def error(self, launch) -> StateError:
        return StateError(f"{launch.describe()} has {self.count} copies in this graph: the graph that captured it was "
                          "launched into this capture that many times. Name the copy through its child: "
                          "graph.node(graph_launch_op).node(op)")


def _copy_of(node: Node, handle, graphs):
    """The outer graph's copy of ``node`` (a kernel, memcpy or memset node), at ``handle``
    in the child's graph, with ``node``'s current parameters written there."""
    if isinstance(node, KernelNode):
        twin = KernelNode(node.kernel, node.generics, node.label, node.values, node.launch_args, node.mutable,
                          node._function, node._config, handle, head=node._head)
        if node._buf is not None and handle is not None:  # updated since its capture: the definition has old ones
            twin._prepare()
            graphs.define_kernel_node(handle, twin._params, twin.launch_args)
        return twin
    if isinstance(node, MemcpyNode):
        if handle is not None:
            graphs.define_memcpy_node(handle, node.dst.data_ptr, node.src.data_ptr, node.dst.nbytes)
        return MemcpyNode(node.dst, node.src, handle)
    if isinstance(node, MemsetNode):
        if handle is not None:
            bits, size, count = fill_pattern(node.dst, node.value)
            graphs.define_memset_node(handle, node.dst.data_ptr, bits, size, count)
        return MemsetNode(node.dst, node.value, handle)
    return None  # a child's own child node: its nodes are not reached from here


def _updated(node: Node) -> bool:
    """May ``node`` run other parameters than its graph's definition says (set since its capture)?"""
    if isinstance(node, KernelNode):
        return node._buf is not None  # (made by the first set)
    return isinstance(node, (MemcpyNode, MemsetNode))  # (not tracked: rewritten to be sure)


def _define_current(node: Node, handle, graphs) -> None:
    """Write ``node``'s current parameters into its graph's definition at ``handle``: a node
    update changes only the executable graph, and a child-graph node copies the definition."""
    if isinstance(node, KernelNode):
        graphs.define_kernel_node(handle, node._params, node.launch_args)
    elif isinstance(node, MemcpyNode):
        graphs.define_memcpy_node(handle, node.dst.data_ptr, node.src.data_ptr, node.dst.nbytes)
    else:
        bits, size, count = fill_pattern(node.dst, node.value)
        graphs.define_memset_node(handle, node.dst.data_ptr, bits, size, count)


def record_child(capture, stream, op, inner) -> None:
    """Record ``inner``'s launch (``op``) as a child-graph node on the capturing ``stream``."""
    inner._check_open()
    off = [n.label for n in inner._nodes if not n._enabled]
    if off:
        raise StateError(f"graph.launch() of a graph with node(s) switched off ({', '.join(off)}) cannot be captured "
                         "into another graph: the child-graph node copies the graph's definition, in which every node "
                         "is on. Switch them on first, or capture only the ops you want into the outer graph")
    graphs = stream.device.graphs
    label = f"graph.launch() of a {len(inner._nodes)}-node graph"
    mine = [n for n in inner._nodes if n._via is None]  # a grandchild's nodes are not reached
    defined = [inner._defined[n.index] for n in mine]
    source, handles = graphs.clone(inner._current(), inner._exec, defined)
    stale = [(n, d) for n, d, h in zip(mine, defined, handles) if h is None and d is not None and _updated(n)]
    if stale:  # in a loop's or branch's body, out of the clone's reach: the definition takes them, cloned again
        graphs.destroy(source)
        for n, d in stale:
            _define_current(n, d, graphs)
        source, handles = graphs.clone(inner._current(), inner._exec, defined)
    via = InChild(graphs, None, source, label)  # destroys the clone however this ends
    where = {id(n): h for n, h in zip(mine, handles)}
    copies, dags = {}, {}
    for launch, node in inner._by_launch.items():
        if node._via is not None:
            continue
        twin = _copy_of(node, where[id(node)], graphs)  # the node's current parameters, in the clone
        if twin is not None:
            twin._via = via
            if node._item is not None:  # from a parallel capture: the copy's updates are checked against its edges
                dag, i = node._item
                if id(dag) not in dags:
                    dags[id(dag)] = dag.copy_for_child()
                twin._item = (dags[id(dag)], i)
            copies[launch] = twin
    via.child = child = graphs.add_child(stream, source, label)
    node = ChildGraphNode(label, child, via, copies)
    capture.nodes.append(node)
    capture.by_launch[op] = node
    for launch, twin in copies.items():
        capture.nodes.append(twin)
        held = capture.by_launch.get(launch)
        if held is None:
            capture.by_launch[launch] = twin
        elif type(held) is Ambiguous:
            held.count += 1
        else:
            capture.by_launch[launch] = Ambiguous()
    # the outer graph reads and writes the buffers the inner one does, and checks what it checks
    capture.keep.append((inner._keep, list(inner._nodes)))
    capture.keep.extend(inner._checks)


class GraphLaunch(DeviceOp):
    """One replay of a graph, as an op; captured into another graph, a child-graph node
    (graph/child.py)."""

    __slots__ = ("graph",)
    graph_safe = True
    op_name = "graph.launch"

    def __init__(self, graph):
        super().__init__()
        self.graph = graph
        self._armed = True

    __del__ = warn_if_unexecuted

    @property
    def host_node(self):
        """The host node the graph holds, if any (a conditional node's body cannot hold its launch)."""
        hosts = self.graph._hosts
        return f"graph.launch() of a graph holding {hosts[0]}" if hosts else None

    def home_device(self):
        """The graph's device: ``op.sync()`` runs on its default stream (execution.tensors_device)."""
        return self.graph._device

    def writes(self) -> tuple:
        """The buffers the graph's kernel, copy and fill nodes write (a loop body's checks)."""
        out = []
        for node in self.graph._nodes:
            if isinstance(node, KernelNode):
                out += [t for p, t in zip(node.kernel.params, node.launch_args) if p.writes]
            elif hasattr(node, "dst"):
                out.append(node.dst)
        return tuple(out)

    def _execute(self, ctx):
        if ctx.device is not self.graph._device:  # as graph.replay(stream): its nodes are that device's work
            home = self.graph._device.label
            raise LaunchError(f"executing {self.describe()} on a stream of {ctx.device.label}: the graph was captured "
                              f"on {home} (its kernels and buffers are that device's); launch it on a stream of "
                              f"{home} (graph.stream, or none: op.sync() takes the graph's device)")
        if ctx.guard is not None:  # in a loop's body: not into the loop's index or count
            for t in self.writes():
                ctx.guard.check(t, "graph.launch()")
        if ctx.capture is not None:
            if ctx.body is not None and self.host_node:
                raise in_conditional_body(self.host_node, ctx.body)
            record_child(ctx.capture, ctx.stream, self, self.graph)
            ctx.capture.hosts.extend(self.graph._hosts)
            return None
        self.graph._replay(ctx.stream)
        return None
