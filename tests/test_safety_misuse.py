"""Misuse found by adversarial probes (issue 32): each is refused with a deviceop
error that names the problem and the fix, and leaves nothing half-done.

* An op tree too deep to execute (a 25,000-long chain of maps) is a StateError,
  on every entry point: describing it does not recurse.
* When a shared or unzipped op fails, every other consumer sees a StateError
  chained from the original exception.
* ``graph.recapture(op)`` on a closed graph hands the op back (no
  UnexecutedOpWarning later).
* A graph launch inside a capture is refused for what it is, not as an allocation.
* ``graph.replay()`` inside an op's callback is refused as any execution there
  is; inside a capture it is never run instead of recorded.
* A node whose input handle was released later still takes new arguments.
* A ``CudaGraph.scope`` entered by hand and collected without ``__exit__`` ends
  its capture and gives the thread's execution lock back.

Unmarked tests run on ``dop.Device()`` (the reference device here, the H100 under
scripts/gpu-check).
"""
from __future__ import annotations

import gc
import threading
import warnings

import numpy as np
import pytest

import deviceop as dop
from deviceop import CudaGraph, api, zip_
from deviceop.kernels import add, affine
from helpers import Boom, boom, upload

N = 256


def scale(out, x, alpha=2.0):
    return affine(out.partition([128]), x, alpha, 0.0).generics([128])


@pytest.fixture
def no_unexecuted_warning():
    """Fails the test if an op is collected unexecuted (UnexecutedOpWarning) while it runs."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", dop.UnexecutedOpWarning)
        yield
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, dop.UnexecutedOpWarning)], [str(w.message) for w in seen]


# -- an op tree too deep to execute ------------------------------------------------------------

def _chain(depth):
    op = dop.value(1)
    for _ in range(depth):
        op = op.map(lambda v: v)
    return op


@pytest.mark.parametrize("entry", ["sync_on", "async_on", "graph_on", "scope", "describe"])
def test_a_chain_too_deep_to_execute_is_a_state_error_on_every_entry_point(stream, entry):
    op = _chain(25_000)
    if entry == "describe":  # what every error message asks: bounded, not recursive
        text = op.describe()
        assert text.startswith("value.map.map") and "more" in text and len(text) < 400
        op.discard()
        return
    with pytest.raises(dop.StateError, match="recursion limit.*build it again"):
        if entry == "scope":
            with CudaGraph.scope(stream) as s:
                s.record(op)
        else:
            getattr(op, entry)(stream)
    assert not stream.is_capturing()
    assert dop.value(3).map(lambda v: v + 1).sync_on(stream) == 4  # the thread's lock was given back


def test_a_deep_chain_of_shared_reshapes_and_thens_describes_itself_briefly():
    op = dop.value(1)
    for i in range(3000):
        op = (op.shared(), op.boxed(), op.then(lambda v: v), op.reshape(2))[i % 4]
    text = op.describe()
    assert len(text) < 400 and "more" in text
    op.discard()


# -- a failed shared or unzipped op: every consumer sees the original error ----------------------

def test_every_consumer_of_a_failed_unzipped_op_sees_the_original_error(stream):
    first, second = dop.value((1, 2)).map(boom).unzip(2)
    with pytest.raises(Boom) as original:
        first.sync_on(stream)
    with pytest.raises(dop.StateError, match=r"so its clones have no result \(Boom: injected\)") as other:
        second.sync_on(stream)
    assert other.value.__cause__ is original.value


def test_every_clone_of_a_failed_shared_op_sees_the_original_error(stream):
    s = dop.value(1).map(boom).shared()
    with pytest.raises(Boom) as original:
        s.clone().sync_on(stream)
    for _ in range(3):
        with pytest.raises(dop.StateError, match="Boom: injected.*build the op again") as other:
            zip_(s.clone(), dop.value(2)).sync_on(stream)
        assert other.value.__cause__ is original.value


def test_a_clone_waiting_on_another_thread_sees_the_original_error(device):
    """Two threads run clones of one shared op: the one that waits for the other's run
    gets the runner's exception as the cause of its StateError."""
    started, release = threading.Event(), threading.Event()

    def slow_boom(_):
        started.set()
        assert release.wait(60)
        raise Boom("in the runner")
    s = dop.value(1).map(slow_boom).shared()
    errors = {}

    def run(name):
        try:
            s.clone().sync_on(device.new_stream())
        except BaseException as exc:  # compared below
            errors[name] = exc

    runner = threading.Thread(target=run, args=("runner",))
    runner.start()
    assert started.wait(60)
    waiter = threading.Thread(target=run, args=("waiter",))
    waiter.start()
    while len(s.core.claims) < 2 and waiter.is_alive():  # the waiter has queued behind the runner
        threading.Event().wait(0.001)
    release.set()
    runner.join(60)
    waiter.join(60)
    assert isinstance(errors["runner"], Boom)
    assert isinstance(errors["waiter"], dop.StateError) and errors["waiter"].__cause__ is errors["runner"]


# -- recapture on a closed graph -------------------------------------------------------------------

def test_recapture_on_a_closed_graph_hands_the_op_back(stream, rng, no_unexecuted_warning):
    x, y = upload(rng.standard_normal(N), stream), dop.empty(N, stream=stream)
    graph = scale(y, x).graph_on(stream)
    graph.close()
    op = scale(y, x, 3.0)
    with pytest.raises(dop.StateError, match="closed; capture a new one"):
        graph.recapture(op)
    del op  # refused, so its dropping is no surprise: no UnexecutedOpWarning
    with pytest.raises(dop.StateError, match="closed"):
        graph.recapture(lambda s: s.record(scale(y, x, 4.0)))


# -- an allocation inside a capture (a graph launch there is a child graph: tests/test_child_graphs.py) ----

def _inner_graph(stream, rng):
    x, y = upload(rng.standard_normal(N), stream), dop.empty(N, stream=stream)
    return scale(y, x).graph_on(stream), x, y


def test_an_allocation_in_a_capture_is_still_refused_as_one(stream):
    with pytest.raises(dop.GraphSafetyError, match=r"api\.zeros.*allocates"):
        zip_(api.zeros([4])).graph_on(stream)


# -- graph.replay() inside a callback ------------------------------------------------------------------

def test_graph_replay_inside_a_callback_is_refused_as_any_execution_there(stream, rng):
    inner, x, y = _inner_graph(stream, rng)
    before = y.numpy(stream=stream)
    with pytest.raises(dop.ReentrancyError, match=r"graph\.replay\(\).*non-reentrant"):
        dop.value(None).inspect(lambda _: inner.replay()).sync_on(stream)
    other = stream.device.new_stream()
    z = dop.empty(N, stream=stream)
    with pytest.raises(dop.ReentrancyError, match=r"graph\.replay\(\)"):  # during another capture
        zip_(scale(z, x), dop.value(None).inspect(lambda _: inner.replay(other))).graph_on(other)
    with pytest.raises(dop.ReentrancyError, match=r"graph\.replay\(\)"):
        with CudaGraph.scope(other):
            inner.replay(other)
    assert not other.is_capturing()
    np.testing.assert_array_equal(y.numpy(stream=stream), before)  # it never ran
    inner.replay()  # outside any execution: runs
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * x.numpy(stream=stream))


# -- a node whose input handle was released ----------------------------------------------------------

def test_a_node_takes_new_arguments_after_a_handle_it_was_given_is_released(stream, rng):
    xs = [rng.standard_normal(N).astype(np.float32) for _ in range(3)]
    handle = upload(xs[0], stream).into_shared()
    y = dop.empty(N, stream=stream)
    step = affine(y.partition([128]), handle, 2.0, 0.0).generics([128]).dynamic()
    graph = step.graph_on(stream)
    node = graph.node(step)
    handle.release()  # the handle captured with the launch
    node.set(alpha=3.0)
    graph.replay()
    np.testing.assert_allclose(y.numpy(stream=stream), 3 * xs[0], rtol=1e-6)
    other = upload(xs[1], stream).into_shared()
    node.set(x=other)
    other.release()  # a handle given to set()
    z = dop.empty(N, stream=stream)
    node.set(out=z.partition([128]))  # changes only out
    node.set(alpha=-1.0)
    graph.replay()
    np.testing.assert_allclose(z.numpy(stream=stream), -xs[1], rtol=1e-6)
    again = upload(xs[2], stream).into_shared()
    node.set(z.partition([128]), again, 0.5, 0.0)  # positionally
    graph.replay()
    np.testing.assert_allclose(z.numpy(stream=stream), 0.5 * xs[2], rtol=1e-6)
    again.release()
    with pytest.raises(dop.StateError, match="released"):  # a released handle given now is refused
        node.set(x=again)


# -- a scope entered by hand and collected without __exit__ --------------------------------------------

def test_a_scope_collected_without_exit_ends_its_capture_and_gives_the_lock_back(stream, rng, no_unexecuted_warning):
    xs = rng.standard_normal(N).astype(np.float32)
    x, y = upload(xs, stream), dop.from_numpy(np.full(N, np.nan, np.float32), stream=stream)
    computed = scale(y, x).first().unpartition().shared()
    scope = CudaGraph.scope(stream)
    scope.__enter__()
    scope.record(computed.clone())
    assert stream.is_capturing()
    del scope
    gc.collect()
    assert not stream.is_capturing()
    assert dop.value(2).map(lambda v: v + 1).sync_on(stream) == 3  # no ReentrancyError: the lock is back
    assert computed.clone().sync_on(stream) is y  # the recorded op was handed back: it runs now
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * xs)
    with CudaGraph.scope(stream) as s:  # the stream captures again
        s.record(scale(y, x, 3.0))
    s.graph.replay()
    np.testing.assert_array_equal(y.numpy(stream=stream), 3 * xs)


def test_a_scope_dropped_by_another_thread_frees_that_threads_lock(device):
    """The scope is collected on the main thread; the thread that opened it runs work afterwards."""
    stream = device.new_stream()
    box, dropped, done = {}, threading.Event(), {}

    def opener():
        scope = CudaGraph.scope(stream)
        scope.__enter__()
        box["scope"] = scope
        del scope
        assert dropped.wait(60)
        done["value"] = dop.value(5).sync_on(device.new_stream())

    t = threading.Thread(target=opener)
    t.start()
    while "scope" not in box:
        threading.Event().wait(0.001)
    del box["scope"]
    gc.collect()
    dropped.set()
    t.join(60)
    assert done.get("value") == 5
    assert not stream.is_capturing()


@pytest.mark.parametrize("how", ["scope", "loop"])
def test_a_refused_graph_launch_leaves_no_unexecuted_warning_behind(stream, rng, how):
    """The refusal says the launch never ran; collecting the refused op adds no UnexecutedOpWarning.
    (A graph launch is a child graph of the capture: refused when the graph has a node switched off.)"""
    inner, x, y = _inner_graph(stream, rng)
    inner.kernel_nodes()[0].enabled = False
    other = stream.device.new_stream()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(dop.StateError, match="switched off"):
            if how == "scope":
                with CudaGraph.scope(other) as s:
                    s.record(inner.launch())
            else:
                dop.loop(2, dop.from_numpy(np.zeros(1, np.int32), stream=stream),
                         lambda i: inner.launch()).graph_on(other)
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, dop.UnexecutedOpWarning)]


# -- a graph replayed on a stream that cannot run it; a scope used out of order ----------------------

def test_a_replay_on_a_closed_or_foreign_stream_is_refused_on_both_devices(stream, rng, no_unexecuted_warning):
    # the reference device replayed on a closed stream (and on anything passed as one); a GPU read a
    # closed stream's handle, and an int's .handle raised a raw AttributeError
    inner, x, y = _inner_graph(stream, rng)
    closed = stream.device.new_stream()
    closed.close()
    with pytest.raises(dop.StateError, match=r"graph.replay\(stream\) on a stream that was closed"):
        inner.replay(closed)
    with pytest.raises(dop.LaunchError, match=r"graph.replay\(stream\) needs a deviceop stream.*got int"):
        inner.replay(5)
    with pytest.raises(dop.StateError, match="on a stream that was closed"):
        inner.launch().async_on(closed)
    own = stream.device.new_stream()
    graph = scale(dop.empty(N, stream=own), x).graph_on(own)
    own.close()                                              # the graph's own stream
    with pytest.raises(dop.StateError, match="on a stream that was closed"):
        graph.replay()
    graph.replay(stream)                                     # another live stream of its device: fine
    inner.replay(stream)
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * x.numpy(stream=stream))


def test_a_scope_used_out_of_order_is_refused_naming_the_with_form(stream, rng, no_unexecuted_warning):
    x, y = upload(rng.standard_normal(N), stream), dop.empty(N, stream=stream)
    scope = CudaGraph.scope(stream)
    with pytest.raises(dop.StateError, match="__exit__ without its __enter__"):
        scope.__exit__(None, None, None)                     # a raw AttributeError before
    with scope as s:
        s.record(scale(y, x))
    with pytest.raises(dop.StateError, match="__exit__ without its __enter__"):
        scope.__exit__(None, None, None)                     # twice
    with pytest.raises(dop.StateError, match="record.. outside the scope's capture: record inside"):
        s.record(scale(y, x))                                # refused, and no "never executed" warning on top
    assert not stream.is_capturing()
    scope.graph.replay()
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * x.numpy(stream=stream))
