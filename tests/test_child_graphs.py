"""Child graphs: ``graph.launch()`` captured into another graph becomes one child-graph node
(a GRAPH node) running a copy of that graph's work, however the capture reaches it
(``graph_on``, a scope, a ``then`` callback, a loop body).  The copy starts with the
graph's current parameters; then ``outer.node(op)`` updates the outer graph's copy
and ``inner.node(op)`` the inner graph only.  These run on the GPU too under gpu-check."""
import numpy as np
import pytest

import deviceop as dop
from deviceop import CudaGraph, api, zip_
from deviceop.kernels import add, affine

N, B = 1024, 256


def upload(rng, stream):
    return dop.from_numpy(rng.standard_normal(N).astype(np.float32), stream=stream)


def scale(y, x, a=2.0):
    return affine(y.partition([B]), x, a, 0.0).dynamic("alpha", "x")


@pytest.mark.parametrize("how", ["graph_on", "scope", "then", "loop"])
def test_a_graph_launch_inside_a_capture_is_a_child_graph_node(stream, rng, how):
    x, y, z = upload(rng, stream), dop.empty(N, stream=stream), dop.empty(N, stream=stream)
    inner = scale(y, x).graph_on(stream)
    other = stream.device.new_stream()
    after = add(z.partition([B]), y, x)               # reads what the inner graph writes
    if how == "graph_on":
        outer = zip_(inner.launch(), after).graph_on(other)
    elif how == "scope":
        with CudaGraph.scope(other) as s:
            s.record(inner.launch())
            s.record(after)
        outer = s.graph
    elif how == "then":
        outer = dop.value(None).then(lambda _: inner.launch()).then(lambda _: after).graph_on(other)
    else:
        index = dop.from_numpy(np.zeros(1, np.int32), stream=stream)
        outer = zip_(dop.loop(2, index, lambda i: inner.launch()), after).graph_on(other)
    kinds = [n["type"] for n in outer.nodes()]
    assert ("GRAPH" in kinds) if how != "loop" else ("CONDITIONAL" in kinds)
    api.fill(y, np.nan).sync_on(stream)
    stream.synchronize()
    outer.replay()
    other.synchronize()
    xs = x.numpy(stream=stream)
    np.testing.assert_allclose(y.numpy(stream=stream), 2 * xs, rtol=1e-6)
    np.testing.assert_allclose(z.numpy(stream=stream), 3 * xs, rtol=1e-6)
    assert not other.is_capturing()


def test_the_copy_starts_from_the_inner_graphs_updates_then_each_graph_updates_its_own(stream, rng):
    x, x2, y = upload(rng, stream), upload(rng, stream), dop.empty(N, stream=stream)
    step = scale(y, x)
    inner = step.graph_on(stream)
    inner.node(step).set(alpha=3.0)                   # before the outer capture: the copy has it
    launch = inner.launch()
    outer = launch.graph_on(stream)
    xs, xs2 = x.numpy(stream=stream), x2.numpy(stream=stream)
    outer.replay()
    stream.synchronize()
    np.testing.assert_allclose(y.numpy(stream=stream), 3 * xs, rtol=1e-6)
    copy = outer.node(step)                            # the outer graph's copy of the inner kernel
    assert copy is not inner.node(step) and copy.label == inner.node(step).label
    copy.set(alpha=-1.0, x=x2)                         # the outer graph only
    outer.replay()
    stream.synchronize()
    np.testing.assert_allclose(y.numpy(stream=stream), -xs2, rtol=1e-6)
    inner.replay()                                     # the inner graph kept its own
    stream.synchronize()
    np.testing.assert_allclose(y.numpy(stream=stream), 3 * xs, rtol=1e-6)
    inner.node(step).set(alpha=5.0)                    # ... and updates it alone
    outer.replay()
    stream.synchronize()
    np.testing.assert_allclose(y.numpy(stream=stream), -xs2, rtol=1e-6)
    assert isinstance(outer.node(launch), dop.ChildGraphNode)
    with pytest.raises(dop.StateError, match="child-graph node"):
        outer.node(launch).enabled = False
    with pytest.raises(dop.StateError, match="node of a child graph"):
        copy.enabled = False


def test_copy_and_fill_nodes_of_a_child_are_updated_through_the_outer_graph(stream, rng):
    x, x2, y, z = upload(rng, stream), upload(rng, stream), dop.empty(N, stream=stream), dop.empty(N, stream=stream)
    load, clear = api.memcpy(y, x), api.fill(z, 1.5)
    inner = zip_(load, clear).graph_on(stream)
    outer = inner.launch().graph_on(stream)
    outer.node(load).set(src=x2)
    outer.node(clear).set(value=-2.0)
    outer.replay()
    stream.synchronize()
    np.testing.assert_array_equal(y.numpy(stream=stream), x2.numpy(stream=stream))
    assert (z.numpy(stream=stream) == -2.0).all()


def test_a_graph_launched_twice_has_two_copies_named_through_their_child(stream, rng):
    x, y = upload(rng, stream), dop.empty(N, stream=stream)
    step = scale(y, x)
    inner = step.graph_on(stream)
    first, second = inner.launch(), inner.launch()
    outer = zip_(first, second).graph_on(stream)
    with pytest.raises(dop.StateError, match="2 copies"):
        outer.node(step)
    outer.node(second).node(step).set(alpha=7.0)       # the second run writes y last
    outer.replay()
    stream.synchronize()
    np.testing.assert_allclose(y.numpy(stream=stream), 7 * x.numpy(stream=stream), rtol=1e-6)
    assert outer.node(first).node(step).args["alpha"] == 2.0


def test_a_recaptured_outer_graph_still_updates_its_copies(stream, rng):
    x, y = upload(rng, stream), dop.empty(N, stream=stream)
    step = scale(y, x)
    inner = step.graph_on(stream)
    outer = inner.launch().graph_on(stream)
    assert outer.recapture(inner.launch()) == "updated"
    outer.node(step).set(alpha=4.0)
    outer.replay()
    stream.synchronize()
    np.testing.assert_allclose(y.numpy(stream=stream), 4 * x.numpy(stream=stream), rtol=1e-6)


def test_a_graph_with_a_node_switched_off_is_refused_as_a_child(stream, rng):
    x, y = upload(rng, stream), dop.empty(N, stream=stream)
    step = scale(y, x)
    inner = step.graph_on(stream)
    inner.node(step).enabled = False
    other = stream.device.new_stream()
    with pytest.raises(dop.StateError, match="switched off"):
        inner.launch().graph_on(other)
    assert not other.is_capturing()
    inner.node(step).enabled = True
    inner.launch().graph_on(other).replay()           # on again: it can be a child
    other.synchronize()
    np.testing.assert_allclose(y.numpy(stream=stream), 2 * x.numpy(stream=stream), rtol=1e-6)


def test_the_copy_of_a_parallel_graph_refuses_the_updates_its_original_refuses(stream, rng):
    # the copy has the inner graph's edges: an update that would race a parallel branch there races
    # in the copy too, and each copy checks against the buffers its own nodes hold
    xs = [upload(rng, stream) for _ in range(2)]
    ys = [dop.empty(N, stream=stream) for _ in range(2)]
    spare = dop.empty(N, stream=stream)
    first = affine(ys[0].partition([B]), xs[0], 2.0, 0.0).dynamic("out")
    inner = zip_(first, affine(ys[1].partition([B]), xs[1], 3.0, 0.0)).graph_on(stream, parallel=True)
    outer = inner.launch().graph_on(stream)
    with pytest.raises(dop.GraphUpdateError, match="parallel branch"):
        outer.node(first).set(out=xs[1].partition([B]))     # the copy's other branch reads xs[1]
    with pytest.raises(dop.GraphUpdateError, match="parallel branch"):
        inner.node(first).set(out=xs[1].partition([B]))
    outer.node(first).set(out=spare.partition([B]))          # the copy's own: the inner graph keeps ys[0]
    inner.node(first).set(out=ys[0].partition([B]))
    with pytest.raises(dop.GraphUpdateError, match="parallel branch"):
        outer.node(first).set(out=ys[1].partition([B]))     # the copy's other branch writes ys[1]
    outer.replay()
    stream.synchronize()
    np.testing.assert_allclose(spare.numpy(stream=stream), 2 * xs[0].numpy(stream=stream), rtol=1e-6)
    np.testing.assert_allclose(ys[1].numpy(stream=stream), 3 * xs[1].numpy(stream=stream), rtol=1e-6)
