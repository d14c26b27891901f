"""Failure recovery: a fault at any step of a capture costs the user nothing but the capture.

After every injected fault — an exception raised inside the captured work at
each position, a KeyboardInterrupt, a capture stage that fails, a driver call
that fails (GPU) — these must hold:

* the exception reaches the caller unchanged in kind (deviceop errors name the step),
* no capture is left open on the stream and the thread may execute again,
* the stream computes correctly, and a new capture on it works,
* no graph is returned or reachable (a failed ``recapture`` leaves the old
  graph doing its old work; a failed GraphCache capture adds no entry),
* no CUDA graph or executable graph handle leaks (counted by DriverSpy on the GPU).

Out-of-memory during allocation or instantiation is a clear OutOfMemoryError
and the process goes on.
"""
from __future__ import annotations

import gc
import traceback

import numpy as np
import pytest

import deviceop as dop
from deviceop import CudaGraph, GraphCache, api, zip_
from deviceop.graph import CudaGraph as _Graph
from deviceop.testing import DriverSpy
from deviceop.kernels import add, affine
from helpers import upload

N = 256
INJECTED = []  # (test, fault) for every fault injected and survived: the summary counts them


@pytest.fixture
def spy(device):
    """Counts graph handles on the GPU (no driver calls on the reference device)."""
    with DriverSpy() as s:
        yield s
    gc.collect()


def chain(stream, x, bufs, fault_at=None, fault=None):
    """affine -> add -> affine -> add -> affine over ``bufs``, raising ``fault`` just
    before step ``fault_at`` (``len(bufs)`` = after the last launch)."""
    steps, prev = [], x
    for k, out in enumerate(bufs):
        if k % 2 == 0:
            steps.append(affine(out.partition([128]), prev, 2.0, 1.0).generics([128]))
        else:
            steps.append(add(out.partition([128]), prev, x).generics([128]))
        prev = out
    ops = []
    for k, step in enumerate(steps + [None]):
        if k == fault_at:
            ops.append(dop.value(None).inspect(lambda _: raise_(fault)))
        if step is not None:
            ops.append(step)
    return zip_(*ops)


def raise_(fault):
    raise fault() if isinstance(fault, type) else fault


def chain_ref(xs, n_steps):
    prev = xs.astype(np.float64)
    for k in range(n_steps):
        prev = (2 * prev + 1 if k % 2 == 0 else prev + xs).astype(np.float32).astype(np.float64)
    return prev


def assert_recovered(stream, spy, what):
    """The invariants of the module docstring, after a fault."""
    assert not stream.is_capturing(), f"{what}: the capture is still open"
    xs = np.arange(N, dtype=np.float32)
    x, out = upload(xs, stream), dop.empty(N, stream=stream)
    add(out.partition([128]), x, x).generics([128]).sync_on(stream)  # the thread may execute again
    np.testing.assert_array_equal(out.numpy(stream=stream), 2 * xs)
    graph = affine(out.partition([128]), x, 3.0, 0.0).generics([128]).graph_on(stream)  # capture works
    graph.launch().sync_on(stream)
    np.testing.assert_array_equal(out.numpy(stream=stream), 3 * xs)
    graph.close()
    gc.collect()
    assert spy.leaked() == {}, f"{what}: graph handles leaked: {spy.leaked()}"
    INJECTED.append(what)


FAULTS = [ValueError("user code failed"), KeyboardInterrupt, dop.LaunchError("a bad launch")]
FAULT_IDS = ["ValueError", "KeyboardInterrupt", "LaunchError"]
STEPS = 5


@pytest.mark.parametrize("fault", FAULTS, ids=FAULT_IDS)
def test_graph_on_survives_a_fault_before_or_after_every_launch(stream, spy, fault, rng):
    x = upload(rng.standard_normal(N), stream)
    for at in range(STEPS + 1):
        bufs = [dop.empty(N, stream=stream) for _ in range(STEPS)]
        with pytest.raises(type(fault) if not isinstance(fault, type) else fault):
            chain(stream, x, bufs, at, fault).graph_on(stream)
        assert_recovered(stream, spy, f"graph_on, {FAULT_IDS[FAULTS.index(fault)]} at step {at}")


@pytest.mark.parametrize("fault", FAULTS, ids=FAULT_IDS)
def test_scope_survives_a_fault_after_every_record(stream, spy, fault, rng):
    x = upload(rng.standard_normal(N), stream)
    for at in range(STEPS + 1):
        bufs = [dop.empty(N, stream=stream) for _ in range(STEPS)]
        scope = CudaGraph.scope(stream)
        with pytest.raises(type(fault) if not isinstance(fault, type) else fault):
            with scope as s:
                for k, op in enumerate(chain(stream, x, bufs).ops):
                    if k == at:
                        raise_(fault)
                    s.record(op)
                if at == STEPS:
                    raise_(fault)
        assert scope.graph is None, "a failed scope left a graph behind"
        assert_recovered(stream, spy, f"scope, {FAULT_IDS[FAULTS.index(fault)]} after {at} records")


@pytest.mark.parametrize("fault", FAULTS, ids=FAULT_IDS)
def test_a_failed_recapture_leaves_the_old_graph_doing_its_old_work(stream, spy, fault, rng):
    xs = rng.standard_normal(N).astype(np.float32)
    x, bufs = upload(xs, stream), [dop.empty(N, stream=stream) for _ in range(STEPS)]
    graph = chain(stream, x, bufs).graph_on(stream)
    for at in range(STEPS + 1):
        with pytest.raises(type(fault) if not isinstance(fault, type) else fault):
            graph.recapture(chain(stream, x, bufs, at, fault))
        assert not stream.is_capturing()
        api.memcpy(bufs[-1], upload(np.full(N, np.nan), stream)).sync_on(stream)
        graph.launch().sync_on(stream)
        np.testing.assert_allclose(bufs[-1].numpy(stream=stream), chain_ref(xs, STEPS), rtol=1e-6)
        INJECTED.append(f"recapture, fault at step {at}")
    assert graph.exec_updates == graph.reinstantiations == 0
    graph.close()
    assert_recovered(stream, spy, "recapture")


def test_a_failed_graph_cache_capture_adds_no_entry(stream, spy, rng):
    calls = {"n": 0}

    def fn(ws, x):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt  # the first capture is interrupted
        y = ws.empty([ws.size, N])
        return affine(y.view([-1]).partition([128]), x.view([-1]), 2.0, 0.0).generics([128]).map(lambda _: y)

    with GraphCache(fn, stream=stream, sizes=[4]) as cache:
        xs = rng.standard_normal((3, N)).astype(np.float32)
        with pytest.raises(KeyboardInterrupt):
            cache(upload(xs, stream))
        assert len(cache) == 0 and cache.stats.captures == 0
        np.testing.assert_array_equal(cache(upload(xs, stream)).numpy(stream=stream), 2 * xs)
        assert cache.stats.captures == 1
    assert_recovered(stream, spy, "GraphCache, interrupted capture")


# -- a failure in each stage of the capture machinery -------------------------------------

def _destroy(stream, graph):
    stream.device.graphs.destroy(graph)  # on a GPU through the DriverSpy, which counts it


def _stage_faults():
    """(name, where, attribute, replacement factory, expected exception): ``where`` "graphs" is
    the device's graph backend (runtime/graph_backend.py's GraphBackend), "CudaGraph" the class.
    Each replacement fails the way that stage fails for real, cleaning up what the real stage
    cleans up itself, so that what is tested is everything around it (graph/capture.py's Recording)."""
    def begin_fails(orig):
        def begin(stream):
            raise dop.CudaError("cuStreamBeginCapture", 1, "CUDA_ERROR_INVALID_VALUE", "injected")
        return begin

    def interrupted_after_begin(orig):
        def begin(stream):
            orig(stream)               # the capture has begun ...
            raise KeyboardInterrupt    # ... and Ctrl-C lands before begin returns
        return begin

    def end_fails(orig):
        def end(stream, label):
            _destroy(stream, orig(stream, label))
            raise dop.CaptureError("injected: the capture was invalidated")
        return end

    def instantiate_out_of_memory(orig):
        def instantiate(stream, graph, label):
            _destroy(stream, graph)
            raise dop.OutOfMemoryError(f"cuGraphInstantiate({label})", 2, "CUDA_ERROR_OUT_OF_MEMORY", "injected")
        return instantiate

    def interrupted_in_constructor(orig):
        def adopt(self, capture, output):
            raise KeyboardInterrupt
        return adopt

    return [("begin fails", "graphs", "begin", begin_fails, dop.CudaError),
            ("interrupt after the capture began", "graphs", "begin", interrupted_after_begin, KeyboardInterrupt),
            ("end of capture fails", "graphs", "end", end_fails, dop.CaptureError),
            ("instantiate runs out of memory", "graphs", "instantiate", instantiate_out_of_memory,
             dop.OutOfMemoryError),
            ("interrupt while the CudaGraph is built", "CudaGraph", "_adopt", interrupted_in_constructor,
             KeyboardInterrupt)]


@pytest.mark.parametrize("style", ["graph_on", "scope"])
def test_a_failure_in_each_capture_stage_is_survived(stream, spy, style, monkeypatch, rng):
    x = upload(rng.standard_normal(N), stream)
    for name, where, attr, make, exc in _stage_faults():
        with monkeypatch.context() as m:
            target = stream.device.graphs if where == "graphs" else _Graph
            m.setattr(target, attr, make(getattr(target, attr)))
            bufs = [dop.empty(N, stream=stream) for _ in range(STEPS)]
            with pytest.raises(exc) as info:
                if style == "graph_on":
                    chain(stream, x, bufs).graph_on(stream)
                else:
                    CudaGraph.scope(stream, lambda s: [s.record(op) for op in chain(stream, x, bufs).ops])
            del info  # its traceback holds the half-built graph: drop it, as a caller's handler would
            gc.collect()
        assert_recovered(stream, spy, f"{style}: {name}")


# -- driver calls that fail (GPU) ----------------------------------------------------------

DRIVER_FAULTS = [
    ("cuStreamBeginCapture", "CUDA_ERROR_INVALID_VALUE", dop.CudaError, "cuStreamBeginCapture"),
    ("cuStreamEndCapture", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", dop.CaptureError, "when the capture ended"),
    ("cuGraphInstantiate", "CUDA_ERROR_OUT_OF_MEMORY", dop.OutOfMemoryError, r"cuGraphInstantiate\(zip\)"),
    ("cuGraphUpload", "CUDA_ERROR_OUT_OF_MEMORY", dop.OutOfMemoryError, "cuGraphUpload"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("call, error, exc, pattern", DRIVER_FAULTS, ids=[f[0] for f in DRIVER_FAULTS])
def test_a_failing_driver_call_during_capture_is_survived(stream, spy, rng, call, error, exc, pattern):
    x = upload(rng.standard_normal(N), stream)
    for style in ("graph_on", "scope", "recapture"):
        bufs = [dop.empty(N, stream=stream) for _ in range(STEPS)]
        old = chain(stream, x, bufs).graph_on(stream) if style == "recapture" else None
        spy.fail(call, error)
        with pytest.raises(exc, match=pattern if style != "scope" else None):
            if style == "graph_on":
                chain(stream, x, bufs).graph_on(stream)
            elif style == "scope":
                CudaGraph.scope(stream, lambda s: [s.record(op) for op in chain(stream, x, bufs).ops])
            else:  # a recapture that must re-instantiate (one launch more) and fails
                old.recapture(chain(stream, x, bufs + [dop.empty(N, stream=stream)]))
        assert spy.injected[call] >= 1
        if old is not None:
            old.launch().sync_on(stream)  # still the old graph
            old.close()
        assert_recovered(stream, spy, f"driver fault {call} -> {error} ({style})")


@pytest.mark.gpu
def test_a_failing_replay_leaves_the_graph_usable(stream, spy, rng):
    xs = rng.standard_normal(N).astype(np.float32)
    x, bufs = upload(xs, stream), [dop.empty(N, stream=stream) for _ in range(STEPS)]
    graph = chain(stream, x, bufs).graph_on(stream)
    spy.fail("cuGraphLaunch", "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")
    with pytest.raises(dop.CudaError, match="cuGraphLaunch failed with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        graph.launch().sync_on(stream)
    graph.launch().sync_on(stream)
    np.testing.assert_allclose(bufs[-1].numpy(stream=stream), chain_ref(xs, STEPS), rtol=1e-6)
    graph.close()
    assert_recovered(stream, spy, "cuGraphLaunch fails once")


# -- out of memory --------------------------------------------------------------------------

def test_out_of_memory_in_an_allocation_is_clear_and_the_process_goes_on(stream, spy, device):
    too_big = 2**50 if device.is_reference else 2 * device.total_memory // 4 + 2**20  # elements
    with pytest.raises(dop.OutOfMemoryError, match=r"allocating .* float32 tensor of shape") as info:
        dop.empty(too_big, stream=stream)
    assert info.value.code_name == "CUDA_ERROR_OUT_OF_MEMORY" and "allocate less" in str(info.value)
    with pytest.raises(dop.OutOfMemoryError):  # the same inside an op, eagerly
        zip_(api.zeros([too_big]), api.ones([4])).sync_on(stream)
    del info
    assert_recovered(stream, spy, "out of memory in an allocation")


@pytest.mark.gpu
def test_out_of_memory_in_instantiation_is_clear_and_the_process_goes_on(stream, spy, rng):
    x = upload(rng.standard_normal(N), stream)
    bufs = [dop.empty(N, stream=stream) for _ in range(STEPS)]
    spy.fail("cuGraphInstantiate", "CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(dop.OutOfMemoryError, match="Free tensors or graphs"):
        chain(stream, x, bufs).graph_on(stream)
    assert_recovered(stream, spy, "out of memory in instantiation")


def test_fault_summary():
    """How many faults the tests above injected and survived (printed with -s; gpu-check logs it)."""
    print(f"\nfaults injected and survived in this module: {len(INJECTED)}")
    assert all(isinstance(w, str) for w in INJECTED)


def test_a_scope_whose_record_failed_halfway_cannot_end_with_half_the_op_in_its_graph(stream, spy, rng):
    # the record raised after the op's first launch was recorded; the body catches the error and goes on:
    # the scope must not hand out a graph that replays half of an op whose record() raised
    x = upload(rng.standard_normal(N), stream)
    bufs = [dop.empty(N, stream=stream) for _ in range(STEPS)]
    scope = CudaGraph.scope(stream)
    with pytest.raises(dop.CaptureError, match="after recording part of its work"):
        with scope as s:
            with pytest.raises(ValueError):
                s.record(chain(stream, x, bufs, 2, ValueError("user code failed")))
            with pytest.raises(dop.CaptureError, match="after recording part"):
                s.record(api.fill(bufs[0], 1.0))              # refused: the scope already failed
    assert scope.graph is None
    assert_recovered(stream, spy, "scope, a record that failed halfway, then caught")
    # a record refused before it recorded anything leaves the scope usable
    with CudaGraph.scope(stream) as s:
        with pytest.raises(dop.ShapeError):
            s.record(add(bufs[0].partition([128]), x, dop.empty(2 * N, stream=stream)))
        s.record(add(bufs[1].partition([128]), x, x).generics([128]))
    s.graph.replay()
    stream.synchronize()
    np.testing.assert_array_equal(bufs[1].numpy(stream=stream), 2 * x.numpy(stream=stream))


def test_a_broken_scopes_refusals_do_not_grow_their_traceback(stream, spy, rng):
    """Each refusal of a scope whose record() failed halfway re-raised one stored exception,
    whose traceback gained this frame's line at every call: 50 calls, 50 more frames."""
    x = upload(rng.standard_normal(N), stream)
    bufs = [dop.empty(N, stream=stream) for _ in range(STEPS)]
    lengths, errors = [], []
    with pytest.raises(dop.CaptureError, match="after recording part of its work") as at_exit:
        with CudaGraph.scope(stream) as s:
            with pytest.raises(ValueError):
                s.record(chain(stream, x, bufs, 2, ValueError("user code failed")))
            for _ in range(50):
                try:
                    s.record(api.fill(bufs[0], 1.0))
                except dop.CaptureError as exc:
                    lengths.append(len(traceback.extract_tb(exc.__traceback__)))
                    errors.append(exc)
    assert len(lengths) == 50 and len(set(lengths)) == 1, lengths
    assert len({id(e) for e in errors}) == 50  # a fresh exception each time, chained from the stored one
    assert all(e.__cause__ is errors[0].__cause__ is at_exit.value.__cause__ for e in errors)
    assert "after recording part" in str(errors[0].__cause__)
    assert_recovered(stream, spy, "scope, 50 refusals after a record that failed halfway")
