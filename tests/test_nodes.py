"""Changing a captured graph without recapturing it (seed 004), and recapture + exec update.

* ``launch.dynamic("alpha")`` before capture; ``graph.node(launch).set(alpha=...)``
  after: the next replay uses the new value (cuGraphExecKernelNodeSetParams).
* ``graph.recapture(op)``: capture again and update the executable graph in
  place (cuGraphExecUpdate), re-instantiating when the topology changed.

Device-agnostic: the reference device keeps the same node table and tape.
"""
import numpy as np
import pytest

import deviceop as dop
from deviceop import CudaGraph, api
from deviceop.kernels import add, affine
from helpers import calls_during

N, B = 1024, 256


def affine_ref(x, alpha, beta):
    return np.float64(alpha) * x.astype(np.float64) + np.float64(beta)


@pytest.fixture
def data(stream, rng):
    xs = rng.standard_normal(N).astype(np.float32)
    return xs, dop.from_numpy(xs, stream=stream), api.full([N], float("nan")).sync_on(stream)


def close(got, ref):
    return np.max(np.abs(got - ref)) <= 1e-6 * max(1.0, np.max(np.abs(ref)))


def test_scalar_update_changes_the_next_replay_without_recapture(stream, data):
    xs, x, y = data
    step = affine(y.partition([B]), x, 2.0, 1.0).generics([B]).dynamic("alpha", "beta")
    graph = step.graph_on(stream)
    graph.launch().sync_on(stream)
    assert close(y.numpy(), affine_ref(xs, 2.0, 1.0))
    node = graph.node(step)
    for alpha, beta in [(3.0, -1.0), (-0.5, 0.25), (1e-3, 7.0)]:
        node.set(alpha=alpha, beta=beta)
        graph.launch().sync_on(stream)
        assert close(y.numpy(), affine_ref(xs, alpha, beta))
    assert node.args["alpha"] == 1e-3 and graph.summary()["nodes"] == 1


def test_tensor_and_grid_updates(stream, data, rng):
    xs, x, y = data
    step = affine(y.partition([B]), x, 2.0, 0.0).generics([B]).dynamic("out", "x")
    graph = step.graph_on(stream)
    node = graph.node(step)
    xs2 = rng.standard_normal(N).astype(np.float32)
    node.set(x=dop.from_numpy(xs2, stream=stream))          # a new input buffer
    graph.launch().sync_on(stream)
    assert close(y.numpy(), affine_ref(xs2, 2.0, 0.0))
    # a bigger output and input: the grid follows the output partition (8 tiles instead of 4)
    big = api.full([2 * N], float("nan")).sync_on(stream)
    xs3 = rng.standard_normal(2 * N).astype(np.float32)
    node.set(out=big.partition([B]), x=dop.from_numpy(xs3, stream=stream))
    assert node.grid == (8,)
    graph.launch().sync_on(stream)
    assert close(big.numpy(), affine_ref(xs3, 2.0, 0.0))


def test_a_positional_set_may_repeat_the_arguments_that_are_not_dynamic(stream, data, rng):
    # set(*args) passes every argument: before the fix the same y, x and beta, given again as
    # a fresh partition and equal values, counted as changes and were refused as not dynamic
    xs, x, y = data
    step = affine(y.partition([B]), x, 2.0, 1).generics([B]).dynamic("alpha")
    graph = step.graph_on(stream)
    node = graph.node(step)
    alpha = float(rng.uniform(-3, 3))
    node.set(y.partition([B]), x.view([N]), alpha, np.float32(1.0))
    graph.launch().sync_on(stream)
    assert close(y.numpy(), affine_ref(xs, alpha, 1.0))
    for beta in (2.0, -1.0):                           # another value is a change
        with pytest.raises(dop.StateError, match=r"argument\(s\) beta of .*not marked dynamic"):
            node.set(y.partition([B]), x, alpha, beta)
    other = dop.empty([N], stream=stream)
    with pytest.raises(dop.StateError, match=r"argument\(s\) out, x of .*not marked dynamic"):
        node.set(other.partition([B]), other, alpha, 1.0)   # other buffers of the same layout are a change
    graph.launch().sync_on(stream)
    assert close(y.numpy(), affine_ref(xs, alpha, 1.0))


def test_update_errors_name_the_problem_and_change_nothing(stream, data):
    xs, x, y = data
    step = affine(y.partition([B]), x, 2.0, 1.0).generics([B]).dynamic("alpha")
    graph = step.graph_on(stream)
    node = graph.node(step)
    with pytest.raises(dop.StateError, match="beta.*not marked dynamic.*dynamic\\('beta'\\)"):
        node.set(beta=2.0)
    with pytest.raises(dop.DTypeError, match="alpha"):
        node.set(alpha="fast")
    with pytest.raises(dop.LaunchError, match="no argument 'gamma'"):
        node.set(gamma=1.0)
    with pytest.raises(dop.LaunchError, match="takes 4 arguments.*got 2"):
        node.set(y.partition([B]), x)
    with pytest.raises(dop.LaunchError, match="has no argument"):
        affine(y.partition([B]), x, 1.0, 1.0).dynamic("gamma")
    graph.launch().sync_on(stream)  # the graph still does what it did
    assert close(y.numpy(), affine_ref(xs, 2.0, 1.0))


def test_a_scalar_update_makes_one_python_call_besides_the_driver(stream, data):
    # node.set(alpha=...) on a scalar is a dynamic loop's hot path: the lock-held open check is
    # inline, so its Python calls are the launch key's lookup, the node's driver and the driver's
    # update (a closure and _in_exec were two more)
    xs, x, y = data
    step = affine(y.partition([B]), x, 2.0, 1.0).generics([B]).dynamic("alpha")
    graph = step.graph_on(stream)
    node = graph.node(step)
    node.set(alpha=-0.5)  # checked once (affine's validate may read scalars): the fast path's key lookup finds it
    node.set(alpha=3.0)

    def made_by_set_fast(frame):
        return frame.f_code.co_name if frame.f_back and frame.f_back.f_code.co_name == "_set_fast" else None
    assert calls_during(lambda: node.set(alpha=-0.5), made_by_set_fast) == ["launch_key", "_driver", "set_kernel_node"]
    graph.launch().sync_on(stream)
    assert close(y.numpy(), affine_ref(xs, -0.5, 1.0))


def test_tensor_updates_are_checked_like_launches(stream, data):
    xs, x, y = data
    step = affine(y.partition([B]), x, 2.0, 1.0).generics([B]).dynamic()
    graph = step.graph_on(stream)
    node = graph.node(step)
    with pytest.raises(dop.AliasingError):
        node.set(x=y)                                          # reads what it writes
    with pytest.raises(dop.DTypeError, match="float32"):
        node.set(x=dop.empty([N], "int32", stream=stream))
    with pytest.raises(dop.ShapeError):
        node.set(x=dop.empty([N // 2], stream=stream))        # the kernel's own rule: x matches out
    graph.launch().sync_on(stream)
    assert close(y.numpy(), affine_ref(xs, 2.0, 1.0))


def test_nodes_of_a_scope_and_of_a_closed_graph(stream, data):
    xs, x, y = data
    z = api.full([N], float("nan")).sync_on(stream)
    first = affine(y.partition([B]), x, 2.0, 0.0).generics([B]).dynamic("alpha")
    second = add(z.partition([B]), y, x).generics([B])

    def body(s):
        s.record(first)
        s.record(second)

    graph = CudaGraph.scope(stream, body)
    assert [n.label for n in graph.kernel_nodes()] == ["affine<256>", "add<256>"]
    graph.node(first).set(alpha=-1.0)                          # z = -x + x = 0, y = -x
    graph.launch().sync_on(stream)
    assert close(y.numpy(), -xs.astype(np.float64)) and np.all(z.numpy() == 0)
    with pytest.raises(dop.StateError, match="not captured into this graph"):
        graph.node(affine(y.partition([B]), x, 1.0, 1.0).generics([B]))
    for thing in ([first], {"op": first}, "affine"):              # no op (a list cannot even be looked up)
        with pytest.raises(dop.StateError, match="not captured into this graph"):
            graph.node(thing)
    child = graph.launch()
    outer = child.graph_on(stream)
    with pytest.raises(dop.StateError, match="is not a node of the graph"):
        outer.node(child).node([first])
    outer.close()
    node = graph.node(first)
    graph.close()
    with pytest.raises(dop.StateError, match="closed"):
        node.set(alpha=1.0)


def build_chain(x, ys, alphas):
    """len(alphas) affine launches: ys[i] = alphas[i] * x (a chain of nodes)."""
    return dop.zip_(*[affine(y.partition([B]), x, a, 0.0).generics([B]) for y, a in zip(ys, alphas)])


def test_recapture_with_the_same_topology_updates_in_place(stream, data):
    xs, x, y = data
    ys = [y, api.full([N], float("nan")).sync_on(stream)]
    graph = build_chain(x, ys, [1.0, 2.0]).graph_on(stream)
    assert graph.recapture(build_chain(x, ys, [3.0, 4.0])) == "updated"
    graph.launch().sync_on(stream)
    assert close(ys[0].numpy(), affine_ref(xs, 3.0, 0)) and close(ys[1].numpy(), affine_ref(xs, 4.0, 0))
    assert graph.exec_updates == 1 and graph.reinstantiations == 0
    # the new capture's nodes address the updated executable graph
    step = affine(ys[0].partition([B]), x, 5.0, 0.0).generics([B]).dynamic("alpha")
    other = affine(ys[1].partition([B]), x, 6.0, 0.0).generics([B])
    assert graph.recapture(dop.zip_(step, other)) == "updated"
    graph.node(step).set(alpha=-2.0)
    graph.launch().sync_on(stream)
    assert close(ys[0].numpy(), affine_ref(xs, -2.0, 0)) and close(ys[1].numpy(), affine_ref(xs, 6.0, 0))


def test_recapture_across_a_changed_topology(stream, data):
    xs, x, y = data
    ys = [y] + [api.full([N], float("nan")).sync_on(stream) for _ in range(2)]
    first = affine(ys[0].partition([B]), x, 1.0, 0.0).generics([B]).dynamic("alpha")
    graph = dop.zip_(first, affine(ys[1].partition([B]), x, 2.0, 0.0).generics([B])).graph_on(stream)
    with pytest.raises(dop.GraphUpdateError, match="reinstantiate=True"):
        graph.recapture(build_chain(x, ys, [7.0, 8.0, 9.0]), reinstantiate=False)
    graph.launch().sync_on(stream)                                # still the old work
    assert close(ys[1].numpy(), affine_ref(xs, 2.0, 0))
    assert graph.recapture(build_chain(x, ys, [7.0, 8.0, 9.0])) == "reinstantiated"
    graph.launch().sync_on(stream)
    assert all(close(t.numpy(), affine_ref(xs, a, 0)) for t, a in zip(ys, [7.0, 8.0, 9.0]))
    assert graph.summary()["nodes"] == 3 and graph.reinstantiations == 1
    with pytest.raises(dop.StateError, match="not captured into this graph"):
        graph.node(first)                                         # its node went with the old capture


def test_a_reinstantiate_flag_that_is_no_bool_is_refused_before_anything_is_captured(stream, data):
    xs, x, y = data
    ys = [y, api.full([N], float("nan")).sync_on(stream)]
    graph = build_chain(x, ys[:1], [2.0]).graph_on(stream)
    with pytest.raises(dop.LaunchError, match="reinstantiate= is True or False"):
        graph.recapture(build_chain(x, ys, [7.0, 8.0]), reinstantiate="no")   # "no" is truthy
    graph.launch().sync_on(stream)                                # still the old work, one node
    assert close(y.numpy(), affine_ref(xs, 2.0, 0)) and graph.summary()["nodes"] == 1
    assert graph.reinstantiations == 0 and graph.exec_updates == 0


def test_a_stale_node_refuses_updates(stream, data):
    xs, x, y = data
    step = affine(y.partition([B]), x, 1.0, 0.0).generics([B]).dynamic("alpha")
    graph = step.graph_on(stream)
    node = graph.node(step)
    graph.recapture(affine(y.partition([B]), x, 2.0, 0.0).generics([B]))
    with pytest.raises(dop.StateError, match="recapture"):
        node.set(alpha=3.0)
    graph.launch().sync_on(stream)
    assert close(y.numpy(), affine_ref(xs, 2.0, 0))


def test_recapture_of_a_scope_body(stream, data):
    xs, x, y = data

    def body(alpha):
        return lambda s: s.record(affine(y.partition([B]), x, alpha, 0.5).generics([B]))

    graph = CudaGraph.scope(stream, body(1.0))
    assert graph.recapture(body(-3.0)) == "updated"
    graph.launch().sync_on(stream)
    assert close(y.numpy(), affine_ref(xs, -3.0, 0.5))
    with pytest.raises(dop.StateError, match="an op or a scope body"):
        graph.recapture(42)


@pytest.mark.gpu
def test_every_captured_kernel_keeps_its_driver_node(stream, data):
    xs, x, y = data
    z = api.full([N], float("nan")).sync_on(stream)
    graph = build_chain(x, [y, z], [1.0, 2.0]).graph_on(stream)
    handles = [n.handle for n in graph.kernel_nodes()]
    assert all(h is not None for h in handles) and len({int(h) for h in handles}) == 2
    assert [n["type"] for n in graph.nodes()] == ["KERNEL", "KERNEL"]


def test_replay_enqueues_without_building_an_op(stream, data):
    xs, x, y = data
    step = affine(y.partition([B]), x, 2.0, 1.0).generics([B]).dynamic("alpha")
    graph = step.graph_on(stream)
    node = graph.node(step)
    for alpha in (4.0, -1.0):  # the loop of seed 004: set, replay, set, replay
        node.set(alpha=alpha)
        graph.replay()
    stream.synchronize()
    assert close(y.numpy(), affine_ref(xs, -1.0, 1.0))
    graph.close()
    with pytest.raises(dop.StateError, match="closed"):
        graph.replay()
