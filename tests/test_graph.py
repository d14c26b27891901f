"""CUDA graphs: graph_on, scope, update/launch, Module, two graphs in sequence.

Device-agnostic: the reference device records and replays here; the H100 captures real graphs under gpu-check.
"""
import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

import deviceop as dop
from deviceop import CudaGraph, GraphModel, api, zip_
from deviceop.kernels import add, matvec, rms_norm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from token_model import Config, LayerBuffers, build_forward, numpy_forward, random_weights  # noqa: E402
from helpers import calls_during  # noqa: E402

CFG = Config(d=256, n_layers=3, bk=2)


@pytest.fixture
def model(stream):
    weights, host = random_weights(CFG, seed=7, stream=stream)
    return weights, host


def poisoned(shape, stream):
    return api.full(shape, float("nan")).sync_on(stream)


def capture_forward(stream, weights):
    x = poisoned([CFG.d], stream)
    buffers = [LayerBuffers(*(poisoned(s, stream).into_shared() for s in ([1, CFG.d], [CFG.d], [CFG.d], [CFG.d])))
               for _ in range(CFG.n_layers)]
    forward, out = build_forward(CFG, weights, x, buffers)
    graph = forward.graph_on(stream)
    return graph, x, out.sync_on(stream)  # the shared output: retrieved, not recomputed


def test_capture_records_and_launch_computes(stream, model, rng):
    weights, host = model
    graph, x, out = capture_forward(stream, weights)
    assert np.isnan(out.numpy()).all()          # capturing computed nothing
    xs = rng.standard_normal(CFG.d).astype(np.float32)
    graph.update(api.memcpy(x, dop.from_numpy(xs, stream=stream)))
    graph.launch().sync_on(stream)
    ref = numpy_forward(CFG, host, xs)
    assert np.linalg.norm(out.numpy() - ref) / np.linalg.norm(ref) < 1e-5


def test_replay_equals_eager_exactly(stream, model, rng):
    weights, _ = model
    xs = dop.from_numpy(rng.standard_normal(CFG.d).astype(np.float32), stream=stream)
    eager_bufs = [LayerBuffers.allocate(CFG.d, stream) for _ in range(CFG.n_layers)]
    forward, eager_out = build_forward(CFG, weights, xs, eager_bufs)
    forward.sync_on(stream)
    graph, x, out = capture_forward(stream, weights)
    graph.update(api.memcpy(x, xs))
    for _ in range(3):  # replays are idempotent
        graph.launch().sync_on(stream)
        np.testing.assert_array_equal(out.numpy(), eager_out.sync_on(stream).numpy())


def test_graph_model_forward(stream, model, rng):
    weights, host = model
    graph, x, out = capture_forward(stream, weights)
    m = GraphModel(graph, x, out)
    for _ in range(3):
        xs = rng.standard_normal(CFG.d).astype(np.float32)
        y = m.forward(dop.from_numpy(xs, stream=stream))
        assert y is out
        ref = numpy_forward(CFG, host, xs)
        assert np.linalg.norm(y.numpy() - ref) / np.linalg.norm(ref) < 1e-5


def test_scope_records_graph_safe_ops_with_write_then_read(stream, model, rng):
    weights, host = model
    d = CFG.d
    inp = dop.empty(d, stream=stream)
    bufs = [LayerBuffers.allocate(d, stream) for _ in range(CFG.n_layers)]
    raw = [[b.norm.tensor, b.q.tensor, b.o.tensor, b.residual.tensor] for b in bufs]

    def body(s):
        for w, (norm, q, o, res) in zip(weights, raw):
            s.record(rms_norm(norm.partition([1, d]), inp.view([1, d]), w.norm_w, CFG.eps).generics(CFG.rms_generics()))
            s.record(matvec(q.partition([CFG.bn]), norm, w.wq).generics(CFG.mv_generics()))
            s.record(matvec(o.partition([CFG.bn]), q.view([1, d]), w.wo).generics(CFG.mv_generics()))
            s.record(add(res.partition([CFG.block]), inp, o).generics([CFG.block]))
            s.record(api.memcpy(inp, res))   # the next layer reads what this one wrote

    graph = CudaGraph.scope(stream, body)
    xs = rng.standard_normal(d).astype(np.float32)
    api.memcpy(inp, dop.from_numpy(xs, stream=stream)).sync_on(stream)
    graph.launch().sync_on(stream)
    ref = numpy_forward(CFG, host, xs)
    assert np.linalg.norm(inp.numpy() - ref) / np.linalg.norm(ref) < 1e-5


def test_scope_with_statement(stream):
    a = dop.from_numpy(np.arange(256, dtype=np.float32), stream=stream)
    out = dop.empty(256, stream=stream)
    with CudaGraph.scope(stream) as s:
        part, *_ = s.record(add(out.partition([128]), a, a).generics([128]))
        assert part.tensor is out
    s.graph.launch().sync_on(stream)
    np.testing.assert_array_equal(out.numpy(), 2 * np.arange(256))


def test_a_scope_records_only_on_the_thread_that_opened_it(stream):
    """An execution (and a scope's capture is one) belongs to one thread."""
    import threading
    errors = []
    with CudaGraph.scope(stream) as s:
        t = threading.Thread(target=lambda: errors.append(pytest.raises(dop.StateError, s.record, dop.value(1))))
        t.start()
        t.join(60)
        assert s.record(dop.value(2)) == 2
    assert "thread other than the one that opened the scope" in str(errors[0].value)
    assert not stream.is_capturing()


def test_scope_refuses_allocations_by_name_before_recording(stream):
    with pytest.raises(dop.GraphSafetyError, match=r"api\.zeros\(\[4\], float32\) cannot be recorded"):
        with CudaGraph.scope(stream) as s:
            s.record(api.zeros([4]))
    assert not stream.is_capturing()
    for alloc in (api.rand([2]), api.dup(dop.empty(2)), api.ones([1]).map(lambda t: t)):
        with pytest.raises(dop.GraphSafetyError, match="cannot be recorded into a graph"):
            CudaGraph.scope(stream, lambda s: s.record(alloc))


def test_graph_on_refuses_allocations_by_name(stream):
    t = dop.empty(128, stream=stream)
    with pytest.raises(dop.GraphSafetyError, match=r"api\.randn"):
        zip_(api.memcpy(t, t), api.randn([8])).graph_on(stream)
    with pytest.raises(dop.GraphSafetyError, match=r"api\.ones"):  # also when produced inside a then()
        dop.value(1).then(lambda _: api.ones([2])).graph_on(stream)
    assert not stream.is_capturing()


def test_eager_execution_inside_a_scope_is_refused(stream):
    with pytest.raises(dop.ReentrancyError):
        with CudaGraph.scope(stream):
            dop.value(1).sync_on(stream)
    assert not stream.is_capturing()
    assert dop.value(2).sync_on(stream) == 2


def test_graph_on_ends_the_capture_when_the_op_raises(stream):
    out, a = dop.empty(256, stream=stream), dop.empty(256, stream=stream)

    def boom(_):
        raise ValueError("boom")

    op = zip_(add(out.partition([128]), a, a).generics([128]), dop.value(1).map(boom))
    with pytest.raises(ValueError, match="boom"):
        op.graph_on(stream)
    assert not stream.is_capturing()
    assert np.all(api.full([4], 1.0).sync_on(stream).numpy() == 1.0)  # the stream works


def test_keyboard_interrupt_mid_capture_closes_the_capture(stream):
    def interrupt(_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dop.value(1).map(interrupt).graph_on(stream)
    assert not stream.is_capturing()
    with pytest.raises(KeyboardInterrupt):
        with CudaGraph.scope(stream) as s:
            s.record(dop.value(1).map(interrupt))
    assert not stream.is_capturing()


def test_two_graphs_in_sequence(stream, rng):
    """Seed 001, exercise 1: a second graph consumes the first's output on the same stream."""
    d = 256
    x = dop.from_numpy(rng.standard_normal(d).astype(np.float32), stream=stream)
    y, z = dop.empty(d, stream=stream), dop.empty(d, stream=stream)
    first = add(y.partition([128]), x, x).generics([128]).graph_on(stream)        # y = 2x
    second = add(z.partition([128]), y, x).generics([128]).graph_on(stream)       # z = y + x
    first.launch().then(lambda _: second.launch()).sync_on(stream)
    np.testing.assert_allclose(z.numpy(), 3 * x.numpy(), rtol=1e-6)


def test_launch_composes_with_await(stream, rng):
    a = dop.from_numpy(rng.standard_normal(128).astype(np.float32), stream=stream)
    out = dop.empty(128, stream=stream)
    g = add(out.partition([128]), a, a).generics([128]).graph_on(stream)

    async def run():
        await g.launch().on(stream)
        return out.numpy(stream=stream)

    np.testing.assert_allclose(asyncio.run(run()), 2 * a.numpy(), rtol=1e-6)


def test_output_summary_dot_and_close(stream, model):
    weights, _ = model
    graph, x, out = capture_forward(stream, weights)
    s = graph.summary()
    assert s["by_type"].get("KERNEL") == 4 * CFG.n_layers
    assert sum(s["kernels"].values()) == 4 * CFG.n_layers
    assert "digraph" in graph.to_dot()
    assert graph.take_output() == [None] * CFG.n_layers
    with pytest.raises(dop.StateError, match="already taken"):
        graph.take_output()
    with graph:
        pass  # leaving the with-block closes it
    with pytest.raises(dop.StateError, match="closed"):
        graph.launch().sync_on(stream)
    graph.close()  # idempotent


@pytest.mark.gpu
def test_host_sync_inside_a_capture_is_a_capture_error(stream):
    t = dop.from_numpy(np.ones(128, dtype=np.float32), stream=stream)
    out = dop.empty(128, stream=stream)
    op = add(out.partition([128]), t, t).generics([128]).first().unpartition().inspect(lambda r: r.numpy())
    with pytest.raises(dop.CaptureError, match="capturing .*add<128>"):
        op.graph_on(stream)
    assert not stream.is_capturing()
    assert np.all(api.full([4], 3.0).sync_on(stream).numpy() == 3.0)


@pytest.mark.gpu
def test_legacy_stream_cannot_capture(device):
    with pytest.raises(dop.CaptureError, match="legacy default stream"):
        dop.value(1).graph_on(dop.CudaStream.legacy(device))


def test_graph_model_refuses_a_wrong_input(stream, model):
    weights, _ = model
    graph, x, out = capture_forward(stream, weights)
    m = GraphModel(graph, x, out)
    with pytest.raises(dop.ShapeError, match="elements"):
        m.forward(dop.empty(CFG.d + 128, stream=stream))
    with pytest.raises(dop.DTypeError, match="dtypes must match"):
        m.forward(dop.empty(CFG.d, "int32", stream=stream))
    graph.close()
    with pytest.raises(dop.StateError, match="closed"):
        m.forward(dop.empty(CFG.d, stream=stream))
    assert not stream.is_capturing()


def test_a_graph_model_of_no_graph_or_no_input_tensor_is_refused_when_made(stream, model):
    weights, _ = model
    graph, x, out = capture_forward(stream, weights)
    for not_a_graph in (None, "graph", x):
        with pytest.raises(dop.LaunchError, match="takes a CudaGraph"):
            GraphModel(not_a_graph, x, out)             # was an AttributeError at the first forward
    with pytest.raises(dop.DTypeError, match="input must be the deviceop Tensor"):
        GraphModel(graph, x.numpy(), out)
    graph.close()
    with pytest.raises(dop.StateError, match="closed"):
        GraphModel(graph, x, out)


def test_graph_model_forward_is_a_copy_and_a_replay_and_refuses_what_a_replay_refuses(stream, model, rng):
    """The hot path (bench/token_loop.py holds it to the bare driver calls) makes the two
    driver calls and nothing else; a forward inside an execution is still refused."""
    weights, host = model
    graph, x, out = capture_forward(stream, weights)
    m = GraphModel(graph, x, out)
    xs = rng.standard_normal(CFG.d).astype(np.float32)
    x_in = dop.from_numpy(xs, stream=stream)

    def made_by_forward(frame):
        return frame.f_code.co_name if frame.f_back and frame.f_back.f_code.co_name == "forward_async" else None
    assert calls_during(lambda: m.forward_async(x_in), made_by_forward) == ["memcpy", "launch"]
    ref = numpy_forward(CFG, host, xs)
    assert np.linalg.norm(m.output.numpy(stream=stream) - ref) / np.linalg.norm(ref) < 1e-5
    before = out.numpy(stream=stream)
    other = dop.from_numpy(rng.standard_normal(CFG.d).astype(np.float32), stream=stream)
    with pytest.raises(dop.ReentrancyError, match="non-reentrant"):
        dop.value(None).inspect(lambda _: m.forward(other)).sync_on(stream)
    np.testing.assert_array_equal(x.numpy(stream=stream), xs)  # refused before the input was copied
    np.testing.assert_array_equal(out.numpy(stream=stream), before)


def test_a_warm_replay_is_one_python_call_the_driver_launch(stream, model):
    # the host time of graph.replay() is what a device loop's launch costs: its checks (not
    # executing, open, not captured elsewhere) are inline, under the graph's lock, and the one
    # Python call it makes is the driver's graph launch (it made three more: executing_now,
    # _replay, _check_open)
    weights, _ = model
    graph, x, out = capture_forward(stream, weights)

    def made_by_replay(frame):
        return frame.f_code.co_name if frame.f_back and frame.f_back.f_code.co_name == "replay" else None
    assert calls_during(lambda: graph.replay(stream), made_by_replay) == ["launch"]
    assert calls_during(lambda: graph.replay(), made_by_replay) == ["launch"]
    other = stream.device.new_stream()  # another stream of the graph's device: checked first
    assert calls_during(lambda: graph.replay(other), made_by_replay) == ["placed", "launch"]
    other.synchronize()


def test_a_scope_body_that_raises_leaves_no_capture_open(stream):
    a, out = dop.empty(128, stream=stream), dop.empty(128, stream=stream)

    def body(s):
        s.record(add(out.partition([128]), a, a).generics([128]))
        raise ValueError("body failed")

    with pytest.raises(ValueError, match="body failed"):
        CudaGraph.scope(stream, body)
    assert not stream.is_capturing()
    assert np.all(api.full([4], 5.0).sync_on(stream).numpy() == 5.0)


def test_the_graph_keeps_its_buffers_alive(stream, rng):
    import gc
    host = rng.standard_normal(4096).astype(np.float32)
    a = dop.from_numpy(host, stream=stream)
    out = dop.empty(4096, stream=stream)
    graph = add(out.partition([128]), a, a).generics([128]).graph_on(stream)
    del a
    gc.collect()
    # reuse of a's memory would show here: fill fresh same-size buffers with another value
    junk = [api.full([4096], 7.0).sync_on(stream) for _ in range(8)]
    graph.launch().sync_on(stream)
    np.testing.assert_allclose(out.numpy(), 2 * host, rtol=1e-6)
    del junk
