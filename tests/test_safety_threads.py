"""Threads that race for a stream or a buffer (issue 32), tested with real threads.

* Work another thread enqueues on a stream while deviceop captures it (an op's
  ``sync_on``/``async_on``, ``graph.update``, ``graph.replay``, a tensor made on
  it) is refused, naming the capture, and nothing of it is recorded: the graph
  does not perform it at replay.  A capture does not begin on a stream another
  thread is executing work on.
* ``clone()`` and ``try_partition()`` of one handle, racing, never leave a live
  clone of a claimed buffer.

Unmarked tests run on ``dop.Device()`` (the reference device here, the H100 under
scripts/gpu-check).
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import deviceop as dop
from deviceop import CudaGraph, api, zip_
from deviceop.kernels import affine
from helpers import upload

N = 256


def scale(out, x, alpha):
    return affine(out.partition([128]), x, alpha, 0.0).generics([128])


class Held:
    """A capture (or an execution) held open on another thread until ``release()``."""

    def __init__(self, start):
        self.opened, self.released, self.error, self.value = threading.Event(), threading.Event(), None, None

        def hold(_):
            self.opened.set()
            assert self.released.wait(60), "never released"

        def run():
            try:
                self.value = start(dop.value(None).inspect(hold))
            except BaseException as exc:  # reported by release()
                self.error = exc
                self.opened.set()
        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert self.opened.wait(60)

    def release(self):
        self.released.set()
        self.thread.join(60)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return self.value


@pytest.mark.parametrize("style", ["graph_on", "scope"])
def test_work_enqueued_on_a_stream_another_thread_captures_is_refused_and_never_recorded(device, rng, style):
    stream = device.new_stream()
    xs, ws = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    x, y = upload(xs, stream), upload(np.full(N, np.nan), stream)
    w, z = upload(ws, stream), upload(np.full(N, np.nan), stream)
    side = scale(z, w, 5.0).graph_on(stream)  # another graph of the stream, for replay()
    model, w_in = dop.GraphModel(side, w, z), upload(ws, device.new_stream())  # ... and GraphModel.forward

    def capture(hold):
        if style == "graph_on":
            return zip_(hold, scale(y, x, 2.0)).graph_on(stream)
        with CudaGraph.scope(stream) as s:
            s.record(hold)
            s.record(scale(y, x, 2.0))
        return s.graph

    held = Held(capture)
    try:
        label = "zip" if style == "graph_on" else "CudaGraph.scope"
        theirs = scale(z, w, 3.0)
        for enqueue in (lambda: theirs.async_on(stream), lambda: theirs.sync_on(stream),
                        lambda: api.memcpy(z, w).sync_on(stream), lambda: side.update(api.memcpy(z, w)),
                        lambda: side.replay(), lambda: side.launch().sync_on(stream), lambda: model.forward(w_in),
                        lambda: dop.zeros(N, stream=stream), lambda: dop.from_numpy(ws, stream=stream)):
            with pytest.raises(dop.CaptureError, match=rf"another thread \(.*\) is capturing into a graph \({label}\)"
                                                       r".*stream of its own"):
                enqueue()
        theirs.sync_on(device.new_stream())  # refused before it ran: it runs elsewhere
    finally:
        graph = held.release()
    np.testing.assert_array_equal(z.numpy(stream=stream), 3 * ws)
    z2 = upload(np.full(N, np.nan), stream)
    api.memcpy(z, z2).sync_on(stream)  # the stream is this thread's again
    graph.replay()
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * xs)
    assert np.isnan(z.numpy(stream=stream)).all(), "the graph performed the other thread's work"


@pytest.mark.gpu
def test_another_wrapper_of_the_captured_cuda_stream_is_refused_too(rng):
    """CudaStream.from_handle of the stream a thread captures names the same queue: refused as well."""
    device = dop.CudaDevice(0)
    stream = device.new_stream()
    x, y, z = upload(rng.standard_normal(N), stream), dop.empty(N, stream=stream), dop.empty(N, stream=stream)
    held = Held(lambda hold: zip_(hold, scale(y, x, 2.0)).graph_on(stream))
    try:
        twin = dop.CudaStream.from_handle(device, int(stream))
        with pytest.raises(dop.CaptureError, match="another thread"):
            scale(z, x, 3.0).async_on(twin)
    finally:
        graph = held.release()
    assert [n["type"] for n in graph.nodes()] == ["KERNEL"]


def test_a_graph_cache_replay_on_a_stream_another_thread_captures_is_refused(device, rng):
    stream = device.new_stream()
    w = upload(rng.standard_normal(N), stream)

    def forward(ws, x):
        y = ws.empty([ws.size, N])
        return affine(y.reshape(ws.size * N).partition([128]), x.reshape(ws.size * N), 2.0, 0.0) \
            .generics([128]).first().unpartition().reshape(ws.size, N)
    cache = dop.GraphCache(forward, stream=stream, max_size=2)
    xs = rng.standard_normal((2, N)).astype(np.float32)
    x = upload(xs, stream)
    np.testing.assert_array_equal(cache(x).numpy(stream=stream), 2 * xs)  # captured and replayed
    held = Held(lambda hold: zip_(hold, scale(dop.empty(N, stream=stream), w, 1.0)).graph_on(stream))
    try:
        with pytest.raises(dop.CaptureError, match="GraphCache replay on a stream that another thread"):
            cache(upload(3 * xs, device.new_stream()))
    finally:
        graph = held.release()
    assert [n["type"] for n in graph.nodes()] == ["KERNEL"]  # the cache's input copy was not recorded
    with pytest.raises(dop.ReentrancyError, match="graph.replay.. of a GraphCache"):
        dop.value(None).inspect(lambda _: cache(x)).sync_on(device.new_stream())
    np.testing.assert_array_equal(cache(x).numpy(stream=stream), 2 * xs)


def test_a_capture_does_not_begin_on_a_stream_another_thread_is_executing_on(device, rng):
    stream = device.new_stream()
    xs = rng.standard_normal(N).astype(np.float32)
    x, y = upload(xs, stream), dop.empty(N, stream=stream)
    held = Held(lambda hold: zip_(hold, scale(y, x, 2.0)).sync_on(stream))  # mid-execution on the stream
    try:
        op = scale(dop.empty(N, stream=stream), x, 4.0)
        with pytest.raises(dop.CaptureError, match="another thread is executing work on this stream"):
            op.graph_on(stream)
        with pytest.raises(dop.CaptureError, match="another thread is executing work on this stream"):
            with CudaGraph.scope(stream):
                pass
        assert not stream.is_capturing()
    finally:
        held.release()
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * xs)
    graph = op.graph_on(stream)  # the op was handed back; the stream captures now
    graph.replay()


def test_threads_on_streams_of_their_own_are_not_refused(device, rng):
    stream, own = device.new_stream(), device.new_stream()
    xs = rng.standard_normal(N).astype(np.float32)
    x, y, z = upload(xs, stream), dop.empty(N, stream=stream), dop.empty(N, stream=own)
    held = Held(lambda hold: zip_(hold, scale(y, x, 2.0)).graph_on(stream))
    try:
        scale(z, x, 3.0).sync_on(own)
    finally:
        graph = held.release()
    np.testing.assert_array_equal(z.numpy(stream=own), 3 * xs)
    graph.replay()
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * xs)


# -- clone() racing try_partition() ------------------------------------------------------------------

class Gate:
    """An allocation's lock that the first thread takes once the second has reached it,
    and the second once the first has released it: the worst interleaving of two threads
    on a handle, every time (with a plain lock a scheduler lands it about once in a
    hundred tries)."""

    def __init__(self):
        self.lock, self.arrived, self.passed = threading.Lock(), threading.Event(), threading.Event()
        self.first = self.second = None  # thread idents

    def __enter__(self):
        me = threading.get_ident()
        if me == self.first:
            assert self.arrived.wait(10), "the second thread never reached the lock"
        elif me == self.second:
            self.arrived.set()
            assert self.passed.wait(10), "the first thread never took the lock"
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()
        if threading.get_ident() == self.first:
            self.passed.set()


def _race(stream, first, second):
    """Run ``first(handle)`` and ``second(handle)`` on two threads, the second taking the
    allocation's lock only after the first released it; returns their results (or errors)."""
    buf = dop.empty(N, stream=stream)
    handle = buf.into_shared()
    gate = Gate()
    buf._alloc.lock = gate
    results = {}

    def run(name, f):
        setattr(gate, name, threading.get_ident())
        ready.wait()
        try:
            results[name] = f(handle)
        except dop.DeviceOpError as exc:
            results[name] = exc

    ready = threading.Barrier(2)
    threads = [threading.Thread(target=run, args=(name, f)) for name, f in (("first", first), ("second", second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return buf, handle, results["first"], results["second"]


def test_a_clone_that_loses_the_race_to_try_partition_is_refused(stream):
    buf, handle, part, clone = _race(stream, lambda h: h.try_partition([N]), lambda h: h.clone())
    assert isinstance(part, dop.Partition)
    assert isinstance(clone, dop.StateError) and "released or consumed by try_partition" in str(clone)
    assert buf._alloc.handles == 0 and not handle._live


def test_a_try_partition_that_loses_the_race_to_clone_is_refused(stream):
    buf, handle, clone, part = _race(stream, lambda h: h.clone(), lambda h: h.try_partition([N]))
    assert isinstance(clone, dop.SharedTensor) and clone._live
    assert isinstance(part, dop.OwnershipError) and "1 other live SharedTensor handle" in str(part)
    assert buf._alloc.handles == 2 and handle._live


def test_a_close_from_another_thread_waits_for_a_replay_being_enqueued(stream, rng):
    # the replay checked that the graph was open, then another thread closed it (destroying the
    # executable graph) before the launch: the launch then got a destroyed graph (None here; a
    # use-after-free in the driver on a GPU).  The close waits for the launch instead.
    from deviceop.graph.capture import ReplayCheck
    x, y = upload(rng.standard_normal(N), stream), dop.empty(N, stream=stream)
    graph = scale(y, x, 3.0).graph_on(stream)
    closer = []

    class CloseOnAnotherThread(ReplayCheck):  # runs between the replay's checks and its launch
        def check_replay(self):
            t = threading.Thread(target=graph.close)
            t.start()
            t.join(0.2)
            closer.append(t)

    graph._checks = (CloseOnAnotherThread(),)
    graph.replay()                                   # enqueued whole, not refused halfway
    closer[0].join(60)
    assert graph._closed
    stream.synchronize()
    np.testing.assert_allclose(y.numpy(stream=stream), 3 * x.numpy(stream=stream), rtol=1e-6)
    with pytest.raises(dop.StateError, match="closed"):
        graph.replay()


def test_two_threads_beginning_a_capture_on_one_stream_at_once_leave_the_winners_capture_alone(stream, rng,
                                                                                                monkeypatch):
    # both saw the stream not capturing; the second one's begin then failed, and ending its "failed
    # capture" ended the first thread's capture (its graph lost, its work run eagerly).  Now the
    # stream is claimed by one thread at once: the other is refused before it begins anything
    x, y = upload(rng.standard_normal(N), stream), dop.empty(N, stream=stream)
    both_inside = threading.Barrier(2, timeout=0.5)
    record_event = type(stream).record_event

    def in_step(self, *args, **kw):  # where both threads would stand after checking, before beginning
        try:
            both_inside.wait()
        except threading.BrokenBarrierError:
            pass
        return record_event(self, *args, **kw)

    monkeypatch.setattr(type(stream), "record_event", in_step)
    results = {}

    def capture(alpha):
        try:
            results[alpha] = scale(y, x, alpha).graph_on(stream)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[alpha] = exc

    threads = [threading.Thread(target=capture, args=(alpha,)) for alpha in (2.0, 3.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    monkeypatch.undo()
    won = {a: r for a, r in results.items() if isinstance(r, dop.CudaGraph)}
    lost = [r for r in results.values() if not isinstance(r, dop.CudaGraph)]
    assert len(won) == 1 and len(lost) == 1, results
    assert isinstance(lost[0], dop.CaptureError) and "already capturing" in str(lost[0])
    assert not stream.is_capturing()
    (alpha, graph), = won.items()
    api.fill(y, 0.0).sync_on(stream)
    graph.replay()
    stream.synchronize()
    np.testing.assert_allclose(y.numpy(stream=stream), alpha * x.numpy(stream=stream), rtol=1e-6)
    assert [n["type"] for n in graph.nodes()] == ["KERNEL"]


def test_a_node_update_racing_a_close_on_another_thread_is_refused_not_sent_to_a_destroyed_graph(stream, rng):
    # the update checked that its graph was open, then another thread closed it while the update
    # checked its arguments, and the update went on to hand the driver the destroyed executable graph
    from deviceop import Kernel, Out, In, Scalar
    x, y = upload(rng.standard_normal(N), stream), dop.empty(N, stream=stream)
    graph, closer = [], []

    def close_elsewhere(g, out, x, a):  # the kernel's own rule: runs inside set(), between its checks
        if graph and not closer:
            t = threading.Thread(target=graph[0].close)
            t.start()
            t.join(60)
            closer.append(t)

    scaled = Kernel("scaled", "__global__ void scaled(float* out, const float* x, float a) {}",
                    [Out("out", "float32", shape=("N",), tile=(128,)), In("x", "float32", shape=("N",)),
                     Scalar("a", "float32")], validate=close_elsewhere,
                    reference=lambda g, out, x, a: out.__setitem__(..., np.float32(a) * x))
    launch = scaled(y.partition([128]), x, 2.0).dynamic("a")
    graph.append(launch.graph_on(stream))
    node = graph[0].node(launch)
    with pytest.raises(dop.StateError, match="was closed"):
        node.set(a=3.0)
    assert closer and graph[0]._closed
