"""Node control: switching a captured node off and on, and updating memcpy and memset nodes.

* ``graph.node(op).enabled = False`` (cuGraphNodeSetEnabled): the node does
  nothing at the next replays, until it is switched on again; no recapture,
  no re-instantiation.  The reference device's tape skips the step.
* ``api.memcpy`` and ``api.fill`` become a MEMCPY / MEMSET node each, which
  ``graph.node(op).set(...)`` points at other buffers (or another value).

These run on the reference device here and on the GPU under gpu-check; the
driver calls behind them are checked through a fake driver at the end.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import deviceop as dop
from deviceop import api
from deviceop.kernels import add, affine
from deviceop.runtime import graphs as driver_graphs

_cu = driver_graphs.cu  # the real bindings (the fakes below stand in for them)
N, B = 1024, 256


def nan_buffer(stream, n=N, dtype=np.float32):
    return dop.from_numpy(np.full(n, np.nan, dtype), stream=stream)


def refill(t, stream, v=np.nan):
    api.fill(t, v).sync_on(stream)


def test_a_disabled_kernel_node_does_nothing_until_it_is_enabled_again(stream, rng):
    xs = rng.standard_normal(N).astype(np.float32)
    x, y, z = dop.from_numpy(xs, stream=stream), nan_buffer(stream), nan_buffer(stream)
    scale = affine(y.partition([B]), x, 3.0, 0.5).generics([B])
    with dop.CudaGraph.scope(stream) as s:
        s.record(scale)
        s.record(add(z.partition([B]), y, x).generics([B]))
    graph = s.graph
    node = graph.node(scale)
    assert node.enabled
    node.enabled = False
    graph.replay()
    stream.synchronize()
    assert np.isnan(y.numpy(stream=stream)).all()        # affine did not run
    assert np.isnan(z.numpy(stream=stream)).all()        # add ran, on the NaNs affine left
    node.enabled = True
    graph.replay()
    stream.synchronize()
    expected_y = 3.0 * xs.astype(np.float64) + 0.5
    np.testing.assert_allclose(y.numpy(stream=stream), expected_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(z.numpy(stream=stream), expected_y + xs, rtol=1e-6, atol=1e-6)
    assert graph.exec_updates == graph.reinstantiations == 0  # switched in place
    graph.close()


def test_a_memcpy_node_copies_between_other_buffers_after_set(stream, rng):
    a, b = (rng.standard_normal(N).astype(np.float32) for _ in range(2))
    src, src2 = dop.from_numpy(a, stream=stream), dop.from_numpy(b, stream=stream)
    dst, dst2 = nan_buffer(stream), nan_buffer(stream)
    copy = api.memcpy(dst, src)
    graph = copy.graph_on(stream)
    assert [n["type"] for n in graph.nodes()] == ["MEMCPY"]
    node = graph.node(copy)
    assert isinstance(node, dop.MemcpyNode) and graph.kernel_nodes() == []
    node.set(src=src2)
    graph.replay()
    stream.synchronize()
    assert np.array_equal(dst.numpy(stream=stream), b)
    node.set(dst=dst2, src=src)
    graph.replay()
    stream.synchronize()
    assert np.array_equal(dst2.numpy(stream=stream), a)
    refill(dst2, stream)
    node.enabled = False
    graph.replay()
    stream.synchronize()
    assert np.isnan(dst2.numpy(stream=stream)).all()
    graph.close()


def test_memcpy_node_updates_are_checked_and_a_refused_one_changes_nothing(stream, rng):
    a = rng.standard_normal(N).astype(np.float32)
    src, dst = dop.from_numpy(a, stream=stream), nan_buffer(stream)
    copy = api.memcpy(dst, src)
    graph = copy.graph_on(stream)
    node = graph.node(copy)
    with pytest.raises(dop.DTypeError, match="int32.*float32"):
        node.set(src=dop.empty([N], "int32", stream=stream))
    with pytest.raises(dop.ShapeError, match="keeps its size"):
        node.set(src=dop.empty([N // 2], stream=stream))
    with pytest.raises(dop.AliasingError):
        node.set(src=dst)                                   # a buffer onto itself
    with pytest.raises(dop.DTypeError, match="from_numpy"):
        node.set(src=a)                                     # a host array
    with pytest.raises(dop.LaunchError, match=r"set\(\) takes dst and src .*got argument 'source'"):
        node.set(source=src)                                # a raw TypeError before the fix
    with pytest.raises(dop.LaunchError, match=r"set\(\) takes dst and src .*got 3 positional arguments"):
        node.set(dst, src, 0)
    graph.replay()
    stream.synchronize()
    assert np.array_equal(dst.numpy(stream=stream), a)      # it still copies what it did
    with pytest.raises(dop.DTypeError, match="True or False"):
        node.enabled = "off"
    with pytest.raises(dop.StateError, match="not captured into this graph.*api.memcpy"):
        graph.node(api.memcpy(dst, src))
    graph.close()
    with pytest.raises(dop.StateError, match="closed"):
        node.set(src=src)
    with pytest.raises(dop.StateError, match="closed"):
        node.enabled = True


@pytest.mark.parametrize("dtype, value", [("float32", -0.0), ("float16", 1.5), ("bfloat16", -2.25), ("int8", -7),
                                          ("int32", 123456), ("uint8", 255), ("float64", 0.0), ("int64", -1)])
def test_fill_sets_every_element_eagerly_and_as_a_memset_node(stream, dtype, value):
    t = dop.empty([300], dtype, stream=stream)
    api.fill(t, value).sync_on(stream)
    expected = np.full(300, value, dtype=t.dtype.np)
    assert t.numpy(stream=stream).tobytes() == expected.tobytes()   # bits: -0.0 keeps its sign
    api.memcpy(t, dop.from_numpy(np.ones(300, t.dtype.np), stream=stream)).sync_on(stream)
    fill = api.fill(t, value)
    graph = fill.graph_on(stream)
    assert [n["type"] for n in graph.nodes()] == ["MEMSET"]
    assert t.numpy(stream=stream).tobytes() != expected.tobytes()  # capture records, it does not run
    graph.replay()
    stream.synchronize()
    assert t.numpy(stream=stream).tobytes() == expected.tobytes()
    graph.close()


def test_a_memset_node_takes_a_new_value_and_buffer(stream):
    t, u = dop.empty([N], stream=stream), dop.empty([N], stream=stream)
    fill = api.fill(t, 1.0)
    graph = fill.graph_on(stream)
    node = graph.node(fill)
    node.set(value=-3.5)
    graph.replay()
    stream.synchronize()
    assert (t.numpy(stream=stream) == -3.5).all()
    node.set(dst=u, value=2.0)
    graph.replay()
    stream.synchronize()
    assert (u.numpy(stream=stream) == 2.0).all() and (t.numpy(stream=stream) == -3.5).all()
    with pytest.raises(dop.DTypeError, match="float64"):
        node.set(dst=dop.empty([N], "float64", stream=stream))
    with pytest.raises(dop.DTypeError):
        node.set(value="two")
    with pytest.raises(dop.LaunchError, match=r"set\(\) takes dst and value .*got argument 'fill'"):
        node.set(fill=1.0)                                  # a raw TypeError before the fix
    node.enabled = False
    refill(u, stream, 7.0)
    graph.replay()
    stream.synchronize()
    assert (u.numpy(stream=stream) == 7.0).all()
    graph.close()


def test_fill_refuses_what_a_memset_cannot_write(stream):
    with pytest.raises(dop.DTypeError, match="4-byte pattern"):
        api.fill(dop.empty([4], "float64", stream=stream), 1.0)   # 0x3FF00000_00000000: two different halves
    with pytest.raises(dop.ShapeError, match="contiguous"):
        api.fill(dop.empty([8, 8], stream=stream)[:, :4], 1.0)
    with pytest.raises(dop.DTypeError, match="int"):
        api.fill(dop.empty([4], "int32", stream=stream), 0.5)
    with pytest.raises(dop.DTypeError, match="from_numpy"):
        api.fill(np.zeros(4, np.float32), 1.0)


def test_recapture_leaves_every_node_enabled_and_the_old_nodes_stale(stream, rng):
    xs = rng.standard_normal(N).astype(np.float32)
    x, y = dop.from_numpy(xs, stream=stream), nan_buffer(stream)

    def work(alpha):
        return affine(y.partition([B]), x, alpha, 0.0).generics([B])
    first = work(2.0)
    graph = first.graph_on(stream)
    old = graph.node(first)
    old.enabled = False
    second = work(-1.0)
    assert graph.recapture(second) == "updated"
    graph.replay()
    stream.synchronize()
    np.testing.assert_allclose(y.numpy(stream=stream), -xs, rtol=1e-6)  # the new node runs: on, as it says
    assert graph.node(second).enabled
    with pytest.raises(dop.StateError, match="recapture"):
        old.enabled = True
    graph.close()


def test_a_node_in_a_loop_body_can_be_switched_off(stream, rng):
    cond = dop.from_numpy(np.array([3], np.int32), stream=stream)
    x = dop.from_numpy(rng.standard_normal(N).astype(np.float32), stream=stream)
    y = nan_buffer(stream)
    steps = []

    def body():
        steps.append(affine(y.partition([B]), x, 1.0, 0.0).generics([B]))
        return dop.zip_(steps[-1], api.fill(cond, 0))
    graph = dop.while_(cond, body).graph_on(stream)
    graph.node(steps[0]).enabled = False
    graph.replay()
    stream.synchronize()
    assert np.isnan(y.numpy(stream=stream)).all() and cond.numpy(stream=stream)[0] == 0
    graph.close()


# -- the driver calls, through a fake driver ----------------------------------------------

class FakeNodeDriver:
    """cuda.bindings.driver as runtime/graphs.py's node calls see it: records each call."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail
        self.memcpy = SimpleNamespace(srcMemoryType="DEVICE", dstMemoryType="UNIFIED", srcDevice=1, dstDevice=2,
                                      WidthInBytes=8, Height=1, Depth=1)
        self.memset = SimpleNamespace(dst=3, value=0, elementSize=1, width=8, height=1, pitch=0)

    def _result(self, name, *args):
        self.calls.append((name, *args))
        return (_cu.CUresult.CUDA_ERROR_INVALID_VALUE if self.fail == name else 0,)

    def cuGraphNodeSetEnabled(self, exec_, node, on):
        return self._result("cuGraphNodeSetEnabled", exec_, node, on)

    def cuGraphMemcpyNodeGetParams(self, node):
        return 0, self.memcpy

    def cuGraphExecMemcpyNodeSetParams(self, exec_, node, params, ctx):
        return self._result("cuGraphExecMemcpyNodeSetParams", exec_, node, vars(params).copy(), ctx)

    def cuGraphMemsetNodeGetParams(self, node):
        return 0, self.memset

    def cuGraphExecMemsetNodeSetParams(self, exec_, node, params, ctx):
        return self._result("cuGraphExecMemsetNodeSetParams", exec_, node, vars(params).copy(), ctx)

    def __getattr__(self, name):
        return getattr(_cu, name)


def test_the_driver_calls_keep_the_captured_memory_types_and_name_the_node(monkeypatch):
    fake, device = FakeNodeDriver(), SimpleNamespace(context="ctx")
    monkeypatch.setattr(driver_graphs, "cu", fake)
    driver_graphs.set_enabled("exec", "node", False, "affine<256>")
    driver_graphs.set_memcpy_node("exec", "node", 0x1000, 0x2000, 4096, device, "api.memcpy")
    driver_graphs.set_memset_node("exec", "node", 0x3000, 0xBF800000, 4, 512, device, "api.fill")
    assert fake.calls[0] == ("cuGraphNodeSetEnabled", "exec", "node", 0)
    name, exec_, node, params, ctx = fake.calls[1]
    assert params == dict(srcMemoryType="DEVICE", dstMemoryType="UNIFIED", srcDevice=0x2000, dstDevice=0x1000,
                          WidthInBytes=4096, Height=1, Depth=1) and ctx == "ctx"
    name, exec_, node, params, ctx = fake.calls[2]
    assert params == dict(dst=0x3000, value=0xBF800000, elementSize=4, width=512, height=1, pitch=0)
    monkeypatch.setattr(driver_graphs, "cu", FakeNodeDriver(fail="cuGraphExecMemcpyNodeSetParams"))
    with pytest.raises(dop.CudaError, match=r"cuGraphExecMemcpyNodeSetParams\(api.memcpy\).*INVALID_VALUE"):
        driver_graphs.set_memcpy_node("exec", "node", 0x1000, 0x2000, 4096, device, "api.memcpy")
