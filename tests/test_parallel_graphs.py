"""Parallel capture (``graph_on(stream, parallel=True)``): nodes that share no written buffer
become parallel branches of the graph; results stay bit-equal to a serial capture and to eager.

The topology is read with ``graph.edges()`` (cuGraphGetEdges on a GPU, the tape's
recorded dependencies here).  The reference device runs a graph's independent
steps last-recorded-first, so a dependency the capture left out would change a
result here too.  These run on the GPU as well under gpu-check.
"""
import numpy as np
import pytest

import deviceop as dop
from deviceop import api, zip_
from deviceop.kernel import In, Kernel, Out
from deviceop.kernels import add, affine

N, B = 1024, 256


def upload(rng, stream, n=N):
    return dop.from_numpy(rng.standard_normal(n).astype(np.float32), stream=stream)


def fork_join(xs, ys, z):
    """Four independent scales, then one add that reads two of them."""
    return zip_(*[affine(y.partition([B]), x, 2.0, 1.0) for x, y in zip(xs, ys)], add(z.partition([B]), ys[0], ys[3]))


def test_independent_ops_of_a_zip_become_parallel_branches_joined_where_the_data_says(stream, rng):
    xs = [upload(rng, stream) for _ in range(4)]
    ys = [dop.empty(N, stream=stream) for _ in range(4)]
    z = dop.empty(N, stream=stream)
    graph = fork_join(xs, ys, z).graph_on(stream, parallel=True)
    assert graph.parallel
    assert [n["type"] for n in graph.nodes()] == ["KERNEL"] * 5
    assert graph.edges() == [(0, 4), (3, 4)]                  # four roots; the add joins the two it reads
    serial = fork_join(xs, ys, z).graph_on(stream)
    assert not serial.parallel and serial.edges() == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for g in (graph, serial):
        api.fill(z, np.nan).sync_on(stream)
        g.replay()
        stream.synchronize()
        got = z.numpy(stream=stream)
        if g is graph:
            first = got
    np.testing.assert_array_equal(first, got)               # bit-equal to the serial graph
    eager = dop.empty(N, stream=stream)
    zip_(*[affine(y.partition([B]), x, 2.0, 1.0) for x, y in zip(xs, ys)],
         add(eager.partition([B]), ys[0], ys[3])).sync_on(stream)
    np.testing.assert_array_equal(first, eager.numpy(stream=stream))


def test_every_kind_of_dependency_is_an_edge_and_no_redundant_one_is(stream, rng):
    x, a, b, c = upload(rng, stream), *(dop.empty(N, stream=stream) for _ in range(3))
    ops = zip_(affine(a.partition([B]), x, 2.0, 0.0),       # 0 writes a
               affine(b.partition([B]), a, 3.0, 0.0),       # 1 reads a: after 0 (read after write)
               affine(c.partition([B]), x, 5.0, 0.0),       # 2 independent
               affine(a.partition([B]), c, 1.0, 1.0),       # 3 writes a, reads c: after 1 (WAR) and 2 (RAW); 0
                                                            #   (WAW) is implied through 1
               api.memcpy(c, b),                            # 4 reads b, writes c: after 3 (WAR); 1 and 2 implied
               api.fill(x, 0.5))                            # 5 writes x: after 0 and 2, which read it (WAR)
    graph = ops.graph_on(stream, parallel=True)
    assert [n["type"] for n in graph.nodes()] == ["KERNEL"] * 4 + ["MEMCPY", "MEMSET"]
    assert graph.edges() == [(0, 1), (0, 5), (1, 3), (2, 3), (2, 5), (3, 4)]
    xs = x.numpy(stream=stream).astype(np.float64)
    api.fill(a, np.nan).sync_on(stream)
    graph.replay()
    stream.synchronize()
    a1 = (2 * xs).astype(np.float32)
    np.testing.assert_allclose(b.numpy(stream=stream), 3 * a1, rtol=1e-6)
    np.testing.assert_allclose(a.numpy(stream=stream), (5 * xs).astype(np.float32) + 1, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(c.numpy(stream=stream), b.numpy(stream=stream))
    assert (x.numpy(stream=stream) == 0.5).all()


def test_the_reference_device_runs_independent_branches_in_reverse_capture_order(stream, rng):
    """What makes a missing edge visible on the reference device: only the edges order steps."""
    if not stream.device.is_reference:
        pytest.skip("the order of independent nodes on a GPU is the hardware's")
    seen = []
    tag = Kernel("tag", 'extern "C" __global__ void tag(float* y, const float* x) { }',
                 [Out("y", "float32", rank=1), In("x", "float32", rank=1)], block=1,
                 reference=lambda g, y, x: seen.append(int(x[0])))
    xs = [dop.from_numpy(np.full(4, i, np.float32), stream=stream) for i in range(4)]
    ys = [dop.empty(4, stream=stream) for _ in range(3)]
    ops = lambda: zip_(tag(ys[0].partition([4]), xs[0]), tag(ys[1].partition([4]), xs[1]),  # noqa: E731
                       tag(ys[2].partition([4]), xs[2]), tag(ys[0].partition([4]), xs[3]))
    ops().graph_on(stream, parallel=True).replay()
    assert seen == [2, 1, 0, 3]      # the branches last-recorded-first; the last writes what the first does
    seen.clear()
    ops().graph_on(stream).replay()
    assert seen == [0, 1, 2, 3]      # a serial graph: capture order


def test_a_scope_records_in_parallel_and_a_recapture_keeps_the_mode(stream, rng):
    xs = [upload(rng, stream) for _ in range(4)]
    ys = [dop.empty(N, stream=stream) for _ in range(4)]
    z = dop.empty(N, stream=stream)

    def body(s):
        for x, y in zip(xs, ys):
            s.record(affine(y.partition([B]), x, 2.0, 1.0))
        s.record(add(z.partition([B]), ys[0], ys[3]))

    graph = dop.CudaGraph.scope(stream, body, parallel=True)
    assert graph.parallel and graph.edges() == [(0, 4), (3, 4)]
    assert graph.recapture(fork_join(xs, ys, z)) == "updated"         # the same topology: updated in place
    assert graph.edges() == [(0, 4), (3, 4)]
    graph.replay()
    stream.synchronize()
    expected = (2 * xs[0].numpy(stream=stream) + 1) + (2 * xs[3].numpy(stream=stream) + 1)
    np.testing.assert_allclose(z.numpy(stream=stream), expected, rtol=1e-6, atol=1e-5)


def test_a_loop_in_a_parallel_capture_is_a_barrier(stream, rng):
    xs = [upload(rng, stream) for _ in range(3)]
    ys = [dop.empty(N, stream=stream) for _ in range(3)]
    index = dop.from_numpy(np.zeros(1, np.int32), stream=stream)

    def body(i):   # two independent copies (parallel in the body's own graph)
        return zip_(api.memcpy(ys[0], xs[0]), api.memcpy(ys[1], xs[1]))

    op = zip_(affine(ys[2].partition([B]), xs[2], 2.0, 0.0), dop.loop(3, index, body),
              affine(xs[2].partition([B]), xs[0], 1.0, 0.0))
    graph = op.graph_on(stream, parallel=True)
    kinds = [n["type"] for n in graph.nodes()]
    assert kinds.count("CONDITIONAL") == 1
    edges = graph.edges()
    last = len(kinds) - 1
    loop_at = kinds.index("CONDITIONAL")
    assert (loop_at, last) in edges and not any(j == last and i != loop_at for i, j in edges)  # after the loop
    graph.replay()
    stream.synchronize()
    np.testing.assert_array_equal(ys[0].numpy(stream=stream), xs[0].numpy(stream=stream))
    np.testing.assert_array_equal(xs[2].numpy(stream=stream), xs[0].numpy(stream=stream))
    assert index.numpy(stream=stream)[0] == 3


def test_a_node_update_that_would_race_a_parallel_branch_is_refused(stream, rng):
    xs = [upload(rng, stream) for _ in range(2)]
    ys = [dop.empty(N, stream=stream) for _ in range(2)]
    spare = dop.empty(N, stream=stream)
    first = affine(ys[0].partition([B]), xs[0], 2.0, 0.0).dynamic("out", "x")
    graph = zip_(first, affine(ys[1].partition([B]), xs[1], 3.0, 0.0)).graph_on(stream, parallel=True)
    node = graph.node(first)
    with pytest.raises(dop.GraphUpdateError, match="parallel branch"):
        node.set(out=xs[1].partition([B]))             # the other branch reads xs[1]: nothing orders the two
    with pytest.raises(dop.GraphUpdateError, match="parallel branch"):
        node.set(x=ys[1])                              # the other branch writes ys[1]
    node.set(out=spare.partition([B]))                 # a buffer of its own: fine
    graph.replay()
    stream.synchronize()
    np.testing.assert_allclose(spare.numpy(stream=stream), 2 * xs[0].numpy(stream=stream), rtol=1e-6)
    with pytest.raises(dop.GraphUpdateError, match="parallel branch"):
        node.set(out=ys[1].partition([B]))            # checked against what the nodes hold now
    node.set(out=ys[0].partition([B]))                 # back where it was: its old buffer is no one else's
    copy = api.memcpy(spare, xs[0])
    g2 = zip_(copy, affine(ys[1].partition([B]), xs[1], 3.0, 0.0)).graph_on(stream, parallel=True)
    with pytest.raises(dop.GraphUpdateError, match="parallel branch"):
        g2.node(copy).set(dst=xs[1])
    serial = zip_(api.memcpy(spare, xs[0]), affine(ys[1].partition([B]), xs[1], 3.0, 0.0))
    g3 = serial.graph_on(stream)
    g3.node(serial.ops[0]).set(dst=xs[1])              # a serial graph orders them: allowed


def test_parallel_takes_a_bool(stream, rng):
    x, y = upload(rng, stream), dop.empty(N, stream=stream)
    with pytest.raises(dop.LaunchError, match="True or False"):
        affine(y.partition([B]), x, 2.0, 0.0).graph_on(stream, parallel="yes")
    with pytest.raises(dop.LaunchError, match="True or False"):
        dop.CudaGraph.scope(stream, lambda s: None, parallel=1)
    assert not stream.is_capturing()


def test_a_parallel_capture_costs_about_the_same_per_node_however_long_the_graph(stream):
    # each node was compared with every byte range recorded before it (quadratic: 2000 nodes took
    # seconds); now with those on the pages its own ranges touch.  16x the nodes must cost far
    # less than 256x the time (about 25x here, 220x before; the best of 3 captures, so load does not decide)
    import time

    def layered(layers):   # 4 scales of the hidden state, joined by 3 adds into the next one: 7 nodes a layer
        bufs = [[dop.empty(B, stream=stream) for _ in range(7)] for _ in range(layers)]

        def build():
            cur, ops = bufs[0][6], []
            for b in bufs:
                ops += [affine(b[k].partition([B]), cur, 1.0, 0.0) for k in range(4)]
                ops += [add(b[4].partition([B]), b[0], b[1]), add(b[5].partition([B]), b[2], b[3]),
                        add(b[6].partition([B]), b[4], b[5])]
                cur = b[6]
            return zip_(*ops)
        return build

    def best(build):
        times = []
        for _ in range(3):
            op = build()
            t0 = time.perf_counter()
            graph = op.graph_on(stream, parallel=True)
            times.append(time.perf_counter() - t0)
        assert len(graph.edges()) == 10 * (len(graph.nodes()) // 7) - 4   # 4 + 2 + 2 + 2 a layer; none into the first
        return min(times)

    small, large = layered(15), layered(240)
    best(small)                                             # compiled and loaded: not timed
    ratio = best(large) / best(small)
    assert ratio < 80, f"16x the nodes took {ratio:.0f}x the time to capture"
