"""SwitchGraphCache, GraphCache's SWITCH mode: one graph per key holds a branch per padded
size (dop.switch), and the device picks the branch from the batch.  Same results as
GraphCache, bit for bit; one capture, one graph.  Runs on the GPU too under gpu-check."""
import numpy as np
import pytest

import deviceop as dop
from deviceop import GraphCache, SwitchGraphCache
from deviceop.kernels import batch_tile, matvec_batched

K, N, BN, BK = 256, 128, 16, 2


def make_forward(w, calls):
    def forward(ws, x):
        calls.append(ws.size)
        y = ws.empty([ws.size, N])
        mb = batch_tile(ws.size)
        return matvec_batched(y.partition([mb, BN]), x, w).generics([BN, BK, K, mb]).first().unpartition()
    return forward


def test_one_graph_with_a_branch_per_size_computes_what_a_graph_per_size_does(stream, rng):
    w = dop.from_numpy((rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32), stream=stream)
    per_size, branches = [], []
    cache = GraphCache(make_forward(w, per_size), stream=stream, max_size=16)
    switched = SwitchGraphCache(make_forward(w, branches), stream=stream, max_size=16)
    for b in [3, 1, 16, 5, 8, 13, 2, 20]:               # 20 > 16: both run it eagerly
        x = dop.from_numpy(rng.standard_normal((b, K)).astype(np.float32), stream=stream)
        want, got = cache(x).numpy(), switched(x).numpy()
        assert got.shape == (b, N)
        np.testing.assert_array_equal(got, want)
    assert branches == [16, 8, 4, 2, 1, 20]             # every size at the first call, largest first; then eager
    assert len(switched) == 1 and switched.stats.captures == 1 and switched.stats.fallbacks == 1
    assert len(cache) == 5 and per_size[:5] == [4, 1, 16, 8, 2]
    (graph,) = [e.graph for e in switched._entries.values()]
    assert [n["type"] for n in graph.nodes()].count("CONDITIONAL") >= 1
    assert switched.warmup(dop.empty([1, K], stream=stream)) == 0   # nothing left to capture for this key


def test_padding_reaches_only_the_padded_size_and_outputs_are_the_branchs_buffers(stream, rng):
    w = dop.from_numpy((rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32), stream=stream)
    switched = SwitchGraphCache(make_forward(w, []), stream=stream, sizes=[4, 8], pad_value=0)
    x8 = dop.from_numpy(rng.standard_normal((8, K)).astype(np.float32), stream=stream)
    y8 = switched(x8).numpy()
    x3 = dop.from_numpy(rng.standard_normal((3, K)).astype(np.float32), stream=stream)
    y3 = switched(x3)
    assert y3.shape == (3, N)
    ref = x3.numpy().astype(np.float64) @ w.numpy().astype(np.float64).T
    np.testing.assert_allclose(y3.numpy(), ref, rtol=1e-4, atol=1e-4)
    full = switched._entries[next(iter(switched._entries))].by_size[4][0][0]
    assert full.shape == (4, N) and (full.numpy()[3] == 0).all()     # the padded row: W 0
    assert np.array_equal(switched(x8).numpy(), y8)                   # the other branch, again


def test_a_key_function_selects_one_graph_per_key(stream, rng):
    w = dop.from_numpy((rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32), stream=stream)
    switched = SwitchGraphCache(make_forward(w, []), stream=stream, sizes=[2, 4], key=lambda x: x.shape[1:])
    for b in (1, 3, 4):
        x = dop.from_numpy(rng.standard_normal((b, K)).astype(np.float32), stream=stream)
        assert switched(x).shape == (b, N)
    assert len(switched) == 1
    with pytest.raises(dop.ShapeError, match="key function"):
        switched(dop.from_numpy(rng.standard_normal((2, K)).astype(np.float64), stream=stream))
