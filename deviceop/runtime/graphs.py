"""The driver's graph work, as thin functions: capture, instantiate, launch,
exec update, node parameters (kernel, memcpy, memset) and switching nodes on
and off, a capturing stream's dependencies (what a parallel capture sets before
each node), conditional nodes (WHILE, IF, IF/ELSE, SWITCH), child-graph nodes,
inspection (nodes, edges, DOT).

A CUDA device's ``graphs`` is this module; the reference device's is an
object with the same functions over host tapes (runtime/tape.py), so the
graph layer above (deviceop/graph/) never asks which device it runs on.
``GraphBackend`` (runtime/graph_backend.py) is that interface, written down:
a function added here belongs there and in the tape too (tests/test_graph_backend.py).
"""
from __future__ import annotations

import os
import tempfile

from cuda.bindings import driver as cu

from ..errors import CaptureError
from .driver import check, error_name, raise_error
from .stream import closed_stream


def capture_failed(label: str, code_name: str) -> CaptureError:
    """The error of a capture that broke before it ended (one wording for every device)."""
    return CaptureError(f"capturing {label} failed when the capture ended ({code_name}): something in it "
                        "broke the capture, e.g. a host synchronization or work on another stream")


def begin(stream) -> None:
    stream.begin_capture("relaxed")


def abort(stream) -> None:
    """End a failed capture and destroy whatever it recorded."""
    code, graph = cu.cuStreamEndCapture(stream.handle)
    destroy(graph)


def end(stream, label: str):
    """End a capture that went well: the captured graph."""
    code, graph = cu.cuStreamEndCapture(stream.handle)
    if code:
        destroy(graph)
        raise capture_failed(label, error_name(code))
    return graph


def instantiate(stream, graph, label: str):
    """Instantiate and upload ``graph`` (destroyed if that fails): the executable graph."""
    stream.device.bind()  # the graph's kernels are modules of that device's context
    code, exec_ = cu.cuGraphInstantiate(graph, 0)
    if code:
        cu.cuGraphDestroy(graph)
        raise_error(code, f"cuGraphInstantiate({label})")
    try:
        check(cu.cuGraphUpload(exec_, stream.handle), "cuGraphUpload")
        stream.synchronize()
    except BaseException:
        cu.cuGraphExecDestroy(exec_)
        cu.cuGraphDestroy(graph)
        raise
    return exec_


def launch(exec_, stream) -> None:
    handle = stream.handle
    if handle is None:  # closed: the driver would read None as the legacy stream
        raise closed_stream("graph.replay()")
    code = cu.cuGraphLaunch(exec_, handle)[0]
    if code:
        raise_error(code, "cuGraphLaunch")


def update(exec_, graph, label: str) -> str | None:
    """Make ``exec_`` do ``graph``'s work in place (cuGraphExecUpdate): None when it
    did, else why the driver refused (``graph`` is then the caller's to keep or destroy)."""
    code, info = cu.cuGraphExecUpdate(exec_, graph)
    if not code and info.result == cu.CUgraphExecUpdateResult.CU_GRAPH_EXEC_UPDATE_SUCCESS:
        return None
    # the bindings return no result info when the update fails: the error code says enough
    return info.result.name.removeprefix("CU_GRAPH_EXEC_UPDATE_") if info is not None else error_name(code)


def destroy(graph) -> None:
    if graph is not None and int(graph) != 0:
        cu.cuGraphDestroy(graph)


def close(exec_, graphs) -> None:
    """Destroy an executable graph and the graphs behind it (raising what the driver refuses)."""
    if exec_ is not None:
        check(cu.cuGraphExecDestroy(exec_), "cuGraphExecDestroy")
    for g in graphs:
        if g is not None:
            check(cu.cuGraphDestroy(g), "cuGraphDestroy")


def last_node(stream):
    """The node the stream's last captured launch made (copied out of the driver's
    array at once: it is valid only until the next call), or None when the capture
    has several tips."""
    res = cu.cuStreamGetCaptureInfo(stream.handle)
    if res[0] or res[-1] != 1:
        return None
    return cu.CUgraphNode(int(res[4][0]))


def node_id(node) -> int:
    """What identifies a node (CUgraphNode wrappers of one node compare unequal)."""
    return int(node)


_SET_DEPENDENCIES = cu.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES


def capture_deps(stream) -> list:
    """The nodes the capturing ``stream``'s next work will depend on (copied out of the
    driver's array at once)."""
    info = check(cu.cuStreamGetCaptureInfo(stream.handle), "cuStreamGetCaptureInfo")
    n = info[-1]
    return [cu.CUgraphNode(int(d)) for d in info[3][:n]] if n else []


def set_capture_deps(stream, nodes) -> None:
    """Make the capturing ``stream``'s next work depend on exactly ``nodes`` (none: a root)."""
    nodes = list(nodes)
    check(cu.cuStreamUpdateCaptureDependencies(stream.handle, nodes, None, len(nodes), _SET_DEPENDENCIES),
          "cuStreamUpdateCaptureDependencies")


def set_kernel_node(exec_, handle, params, launch_args, label: str) -> None:
    """New parameters for one kernel node of ``exec_`` (the packed ``params``; the
    reference device reads ``launch_args`` instead)."""
    code = cu.cuGraphExecKernelNodeSetParams(exec_, handle, params)[0]
    if code:
        raise_error(code, f"cuGraphExecKernelNodeSetParams({label})")


def set_enabled(exec_, handle, on: bool, label: str) -> None:
    """Switch one kernel, memcpy or memset node of ``exec_`` on or off (a node switched
    off does nothing at the next replays, as an empty node)."""
    code = cu.cuGraphNodeSetEnabled(exec_, handle, 1 if on else 0)[0]
    if code:
        raise_error(code, f"cuGraphNodeSetEnabled({label})")


def set_memcpy_node(exec_, handle, dst: int, src: int, nbytes: int, device, label: str) -> None:
    """Point one memcpy node of ``exec_`` at other buffers: the node's captured parameters
    (its memory types) with new addresses and width."""
    params = check(cu.cuGraphMemcpyNodeGetParams(handle), f"cuGraphMemcpyNodeGetParams({label})")
    params.dstDevice, params.srcDevice, params.WidthInBytes = dst, src, nbytes
    code = cu.cuGraphExecMemcpyNodeSetParams(exec_, handle, params, device.context)[0]
    if code:
        raise_error(code, f"cuGraphExecMemcpyNodeSetParams({label})")


def set_memset_node(exec_, handle, dst: int, value: int, size: int, count: int, device, label: str) -> None:
    """Point one memset node of ``exec_`` at another buffer and value (``count`` elements of ``size`` bytes)."""
    params = check(cu.cuGraphMemsetNodeGetParams(handle), f"cuGraphMemsetNodeGetParams({label})")
    params.dst, params.value, params.elementSize, params.width, params.height = dst, value, size, count, 1
    code = cu.cuGraphExecMemsetNodeSetParams(exec_, handle, params, device.context)[0]
    if code:
        raise_error(code, f"cuGraphExecMemsetNodeSetParams({label})")


def _add_conditional(stream, handle, kind, size: int, label: str) -> list:
    """Add a conditional node of ``kind`` with ``size`` bodies after the capturing
    ``stream``'s work, by hand (capture cannot make one), and make it the stream's
    new dependency: the node's body graphs, which the node owns."""
    info = check(cu.cuStreamGetCaptureInfo(stream.handle), "cuStreamGetCaptureInfo")
    graph, deps, ndeps = info[2], info[3], info[-1]
    params = cu.CUgraphNodeParams()
    params.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    params.conditional.handle = handle
    params.conditional.type = kind
    params.conditional.size = size
    params.conditional.ctx = stream.device.context
    node = check(cu.cuGraphAddNode(graph, list(deps[:ndeps]), None, ndeps, params), f"cuGraphAddNode({label})")
    bodies = [params.conditional.phGraph_out[i] for i in range(size)]
    set_capture_deps(stream, [node])
    return bodies


def _new_handle(stream):
    """A conditional handle of the graph ``stream`` captures into (no default value:
    the control kernel sets it before its node runs)."""
    graph = check(cu.cuStreamGetCaptureInfo(stream.handle), "cuStreamGetCaptureInfo")[2]
    return check(cu.cuGraphConditionalHandleCreate(graph, stream.device.context, 0, 0),
                 "cuGraphConditionalHandleCreate")


def _capture_body(stream, body_graph, label: str, run) -> None:
    """Record ``run(body_stream)`` into a conditional node's ``body_graph``, on a stream
    of its own (the outer stream stays in its capture)."""
    body_stream = stream.device.new_stream()
    check(cu.cuStreamBeginCaptureToGraph(body_stream.handle, body_graph, None, None, 0,
                                         cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
          "cuStreamBeginCaptureToGraph")
    try:
        run(body_stream)
    finally:
        code = cu.cuStreamEndCapture(body_stream.handle)[0]
    check((code,), f"cuStreamEndCapture(body of {label})")


def capture_while(stream, label: str, launch_control, host_control, run_body) -> None:
    """Record a conditional WHILE node on the capturing ``stream``.

    ``launch_control(stream, handle, start)`` launches the one-thread kernel that
    sets the node's condition (before the node with ``start`` True, then after
    each iteration of the body); ``run_body(body_stream)`` records the body on a
    stream capturing into the node's child graph.  (``host_control`` is the
    reference device's form of the control kernel; the GPU runs the kernel.)"""
    handle = _new_handle(stream)
    launch_control(stream, handle, True)
    body_graph, = _add_conditional(stream, handle, cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE, 1,
                                   label)

    def body(body_stream):
        run_body(body_stream)
        launch_control(body_stream, handle, False)
    _capture_body(stream, body_graph, label, body)


def capture_branches(stream, label: str, kind: str, count: int, several: bool, launch_select, host_select,
                     run_branch) -> None:
    """Record ``count`` branches on the capturing ``stream``, of which a device value
    picks one (or none) at every replay: ``kind`` "if" (the bodies then and, with
    ``count`` 2, else) or "switch" (body i runs when the value is i).

    ``launch_select(stream, handle, case)`` launches the one-thread kernel that
    sets a handle from the value; ``run_branch(i, body_stream)`` records body i.
    With ``several`` (CUDA 12.8 drivers and up) it is one node: IF (1 or 2
    bodies) or SWITCH, set by one kernel (``case`` -1).  Without, each body is
    an IF node of its own, whose handle says "this case?" (``case`` i); all the
    handles are set before the first node runs, so a body that changes the
    value cannot make a second body run.  (``host_select`` is the reference
    device's form of the selection.)"""
    if kind == "if" and count == 1 or several:
        handle = _new_handle(stream)
        launch_select(stream, handle, -1)
        node_type = cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF if kind == "if" else \
            cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_SWITCH
        bodies = _add_conditional(stream, handle, node_type, count, label)
        for i, body_graph in enumerate(bodies):
            _capture_body(stream, body_graph, label, lambda s, i=i: run_branch(i, s))
        return
    handles = [_new_handle(stream) for _ in range(count)]
    for i, handle in enumerate(handles):
        launch_select(stream, handle, i)
    for i, handle in enumerate(handles):
        body_graph, = _add_conditional(stream, handle, cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF, 1,
                                       f"{label}, case {i}")
        _capture_body(stream, body_graph, label, lambda s, i=i: run_branch(i, s))


# -- child graphs ------------------------------------------------------------------------

def clone(graph, exec_, handles) -> tuple:
    """``(a copy of graph, the copies of handles in it)`` (cuGraphClone, cuGraphNodeFindInClone;
    None for a node not found there: one inside a conditional body).  ``exec_`` is the
    reference device's; here the definition ``graph`` is copied."""
    copy = check(cu.cuGraphClone(graph), "cuGraphClone")
    found = []
    for h in handles:
        code, node = cu.cuGraphNodeFindInClone(h, copy) if h is not None else (1, None)
        found.append(None if code else node)
    return copy, found


def add_child(stream, source, label: str):
    """Add a child-graph node running a copy of ``source`` after the capturing ``stream``'s
    work (cuGraphAddChildGraphNode), and make it the stream's new dependency."""
    info = check(cu.cuStreamGetCaptureInfo(stream.handle), "cuStreamGetCaptureInfo")
    outer, deps, ndeps = info[2], info[3], info[-1]
    code, node = cu.cuGraphAddChildGraphNode(outer, list(deps[:ndeps]), ndeps, source)
    if code:
        raise CaptureError(f"{label} cannot be a child-graph node of this capture (cuGraphAddChildGraphNode: "
                           f"{error_name(code)}): a child graph may not hold memory allocation or free nodes, and "
                           "the driver decides which conditional nodes it may hold. Replay that graph before or after "
                           "this capture (graph.replay()), or capture its ops into this graph")
    set_capture_deps(stream, [node])
    return node


def define_kernel_node(handle, params, launch_args) -> None:
    """New parameters for a kernel node of a graph definition (not of an executable graph)."""
    check(cu.cuGraphKernelNodeSetParams(handle, params), "cuGraphKernelNodeSetParams")


def define_memcpy_node(handle, dst: int, src: int, nbytes: int) -> None:
    params = check(cu.cuGraphMemcpyNodeGetParams(handle), "cuGraphMemcpyNodeGetParams")
    params.dstDevice, params.srcDevice, params.WidthInBytes = dst, src, nbytes
    check(cu.cuGraphMemcpyNodeSetParams(handle, params), "cuGraphMemcpyNodeSetParams")


def define_memset_node(handle, dst: int, value: int, size: int, count: int) -> None:
    params = check(cu.cuGraphMemsetNodeGetParams(handle), "cuGraphMemsetNodeGetParams")
    params.dst, params.value, params.elementSize, params.width, params.height = dst, value, size, count, 1
    check(cu.cuGraphMemsetNodeSetParams(handle, params), "cuGraphMemsetNodeSetParams")


def update_child(exec_, child, source, label: str) -> None:
    """Make ``exec_``'s child-graph node ``child`` do what ``source`` (the graph it copied,
    updated since) now says: cuGraphExecChildGraphNodeSetParams, same topology, new parameters."""
    code = cu.cuGraphExecChildGraphNodeSetParams(exec_, child, source)[0]
    if code:
        raise_error(code, f"cuGraphExecChildGraphNodeSetParams({label})")


# -- inspection ----------------------------------------------------------------------------

def _node_list(graph) -> list:
    _, _, n = cu.cuGraphGetNodes(graph, 0)
    found, _ = check(cu.cuGraphGetNodes(graph, n), "cuGraphGetNodes")
    return list(found[:n])


def edges(graph) -> list[tuple[int, int, str]]:
    """The graph's dependency edges ``(i, j, kind)``: node j (in ``nodes``' order) runs after
    node i; ``kind`` is "full", or "programmatic" for a PDL edge."""
    index = {int(n): i for i, n in enumerate(_node_list(graph))}
    n = check(cu.cuGraphGetEdges(graph, 0), "cuGraphGetEdges")[-1]
    if not n:
        return []
    frm, to, data, n = check(cu.cuGraphGetEdges(graph, n), "cuGraphGetEdges")
    programmatic = int(cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
    kinds = ["programmatic" if int(d.type) == programmatic else "full" for d in data[:n]] if data else ["full"] * n
    return sorted((index[int(a)], index[int(b)], k) for a, b, k in zip(frm[:n], to[:n], kinds))


def nodes(graph) -> list[dict]:
    """One dict per node: its type and, for kernels, the kernel's name."""
    out = []
    for node in _node_list(graph):
        kind = check(cu.cuGraphNodeGetType(node), "cuGraphNodeGetType")
        entry = {"type": kind.name.removeprefix("CU_GRAPH_NODE_TYPE_")}
        if kind == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            params = check(cu.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
            name = check(cu.cuFuncGetName(params.func), "cuFuncGetName")
            entry["name"] = name.decode() if isinstance(name, bytes) else str(name)
        out.append(entry)
    return out


def dot(graph, verbose: bool) -> str:
    """The graph as Graphviz DOT (cuGraphDebugDotPrint)."""
    flags = cu.CUgraphDebugDot_flags.CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE if verbose else 0
    fd, tmp = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        check(cu.cuGraphDebugDotPrint(graph, tmp.encode(), int(flags)), "cuGraphDebugDotPrint")
        with open(tmp) as f:
            return f.read()
    finally:
        os.unlink(tmp)

