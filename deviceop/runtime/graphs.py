"""The driver's graph work, as thin functions: capture, instantiate, launch,
exec update, kernel-node parameters, conditional WHILE nodes, inspection.

A CUDA device's ``graphs`` is this module; the reference device's is an
object with the same functions over host tapes (runtime/reference.py), so the
graph layer above (deviceop/graph/) never asks which device it runs on.
"""
from __future__ import annotations

import os
import tempfile

from cuda.bindings import driver as cu

from ..errors import CaptureError
from .driver import check, error_name, raise_error


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
    code = cu.cuGraphLaunch(exec_, stream.handle)[0]
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


def set_kernel_node(exec_, handle, params, launch_args, label: str) -> None:
    """New parameters for one kernel node of ``exec_`` (the packed ``params``; the
    reference device reads ``launch_args`` instead)."""
    code = cu.cuGraphExecKernelNodeSetParams(exec_, handle, params)[0]
    if code:
        raise_error(code, f"cuGraphExecKernelNodeSetParams({label})")


def capture_while(stream, label: str, launch_control, host_control, run_body) -> None:
    """Record a conditional WHILE node on the capturing ``stream``.

    ``launch_control(stream, handle, start)`` launches the one-thread kernel that
    sets the node's condition (before the node with ``start`` True, then after
    each iteration of the body); ``run_body(body_stream)`` records the body on a
    stream capturing into the node's child graph.  (``host_control`` is the
    reference device's form of the control kernel; the GPU runs the kernel.)"""
    info = check(cu.cuStreamGetCaptureInfo(stream.handle), "cuStreamGetCaptureInfo")
    graph = info[2]
    context = stream.device.context
    handle = check(cu.cuGraphConditionalHandleCreate(graph, context, 0, 0), "cuGraphConditionalHandleCreate")
    launch_control(stream, handle, True)

    info = check(cu.cuStreamGetCaptureInfo(stream.handle), "cuStreamGetCaptureInfo")
    deps, ndeps = info[3], info[-1]
    params = cu.CUgraphNodeParams()
    params.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    params.conditional.handle = handle
    params.conditional.type = cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
    params.conditional.size = 1
    params.conditional.ctx = context
    node = check(cu.cuGraphAddNode(graph, list(deps[:ndeps]), None, ndeps, params), "cuGraphAddNode(WHILE)")
    body_graph = params.conditional.phGraph_out[0]
    check(cu.cuStreamUpdateCaptureDependencies(
        stream.handle, [node], None, 1,
        cu.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES),
        "cuStreamUpdateCaptureDependencies")

    # The body goes into the node's own graph, captured on a stream of its
    # own (the outer stream stays in its capture); the node owns that graph.
    body_stream = stream.device.new_stream()
    check(cu.cuStreamBeginCaptureToGraph(body_stream.handle, body_graph, None, None, 0,
                                         cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
          "cuStreamBeginCaptureToGraph")
    try:
        run_body(body_stream)
        launch_control(body_stream, handle, False)
    finally:
        code = cu.cuStreamEndCapture(body_stream.handle)[0]
    check((code,), f"cuStreamEndCapture(body of {label})")


def nodes(graph) -> list[dict]:
    """One dict per node: its type and, for kernels, the kernel's name."""
    _, _, n = cu.cuGraphGetNodes(graph, 0)
    found, _ = check(cu.cuGraphGetNodes(graph, n), "cuGraphGetNodes")
    out = []
    for node in found[:n]:
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

