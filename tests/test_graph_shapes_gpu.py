"""On the GPU, read with the driver itself: a parallel capture's topology (cuGraphGetEdges,
PDL edges included), a child-graph node (cuGraphNodeGetType), and results bit-equal to
a serial capture.  (tests/test_parallel_graphs.py, test_child_graphs.py and
test_switch_cache.py run on the GPU too under gpu-check.)"""
import numpy as np
import pytest
from cuda.bindings import driver as cu

import deviceop as dop
from deviceop import zip_
from deviceop.kernels import add, affine, matvec_add_bf16

pytestmark = pytest.mark.gpu
K, N, BN = 2048, 2048, 32


def driver_topology(graph):
    """``(node types, edges as (i, j, type))`` of a CudaGraph's definition, straight from the driver."""
    g = graph._current()
    n = cu.cuGraphGetNodes(g, 0)[-1]
    err, nodes, n = cu.cuGraphGetNodes(g, n)
    assert not err
    index = {int(x): i for i, x in enumerate(nodes[:n])}
    types = [cu.cuGraphNodeGetType(x)[1].name.removeprefix("CU_GRAPH_NODE_TYPE_") for x in nodes[:n]]
    m = cu.cuGraphGetEdges(g, 0)[-1]
    err, frm, to, data, m = cu.cuGraphGetEdges(g, m)
    assert not err
    return types, sorted((index[int(a)], index[int(b)], int(d.type)) for a, b, d in zip(frm[:m], to[:m], data[:m]))


def matvecs(stream, rng, pdl: bool):
    import ml_dtypes
    x = dop.from_numpy(rng.standard_normal((1, K)).astype(np.float32), stream=stream)
    ws = [dop.from_numpy((rng.standard_normal((N, K)) / np.sqrt(K)).astype(ml_dtypes.bfloat16), stream=stream)
          for _ in range(4)]
    r = dop.from_numpy(rng.standard_normal(N).astype(np.float32), stream=stream)
    outs = [dop.empty(N, stream=stream) for _ in range(5)]

    def build():   # four independent matvecs, then one that reads the first's output as its residual
        ops = [matvec_add_bf16(o.partition([BN]), x, w, r).generics([BN, 8, K]).pdl(pdl) for o, w in zip(outs, ws)]
        return zip_(*ops, matvec_add_bf16(outs[4].partition([BN]), x, ws[1], outs[0]).generics([BN, 8, K]).pdl(pdl))
    return build, outs


@pytest.mark.parametrize("pdl", [False, True])
def test_a_parallel_capture_has_the_data_edges_and_computes_what_the_serial_one_does(stream, rng, pdl):
    build, outs = matvecs(stream, rng, pdl)
    serial, parallel = build().graph_on(stream), build().graph_on(stream, parallel=True)
    types, edges = driver_topology(parallel)
    assert types == ["KERNEL"] * 5
    programmatic = int(cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
    assert [(i, j) for i, j, _ in edges] == [(0, 4)]
    assert [t for _, _, t in edges] == [programmatic if pdl else 0]
    assert [(i, j) for i, j, _ in driver_topology(serial)[1]] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    got = []
    for g in (serial, parallel):
        for o in outs:
            dop.api.fill(o, np.nan).sync_on(stream)
        for _ in range(3):
            g.replay()
        stream.synchronize()
        got.append([o.numpy(stream=stream) for o in outs])
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


def test_a_graph_launch_in_a_capture_is_a_graph_node_the_outer_graph_updates(stream, rng):
    x = dop.from_numpy(rng.standard_normal(1024).astype(np.float32), stream=stream)
    y, z = dop.empty(1024, stream=stream), dop.empty(1024, stream=stream)
    step = affine(y.partition([256]), x, 2.0, 0.0).dynamic("alpha")
    inner = step.graph_on(stream)
    outer = zip_(inner.launch(), add(z.partition([256]), y, x)).graph_on(stream, parallel=True)
    types, edges = driver_topology(outer)
    assert types == ["GRAPH", "KERNEL"] and [(i, j) for i, j, _ in edges] == [(0, 1)]
    outer.node(step).set(alpha=-3.0)
    outer.replay()
    stream.synchronize()
    xs = x.numpy(stream=stream)
    np.testing.assert_allclose(z.numpy(stream=stream), -2 * xs, rtol=1e-6)
    inner.replay()
    stream.synchronize()
    np.testing.assert_allclose(y.numpy(stream=stream), 2 * xs, rtol=1e-6)
