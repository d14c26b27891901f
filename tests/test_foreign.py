"""dop.foreign and dop.host_callback: other libraries' GPU work, and host work, as ops.

What a declaration refuses (ownership, aliasing, the wrong kind of argument) and
host callbacks run on Device(0): the reference device here, the H100 under
gpu-check.  What the reference device does with foreign work (its NumPy
reference=, eager, captured and replayed) runs on an explicit reference device,
on either machine.  The library bodies themselves (torch, CuPy, Triton) are
GPU tests: tests/test_foreign_gpu.py.
"""
import functools
import inspect
import warnings

import numpy as np
import pytest

import deviceop as dop
from deviceop import CudaGraph, api, zip_


@pytest.fixture
def ref():
    """The reference device and a stream of it (on a GPU machine too)."""
    device = dop.ReferenceDevice(0)
    return device.new_stream()


def gpu_body(*_, **__):  # pragma: no cover - the reference device never calls a body
    raise AssertionError("the reference device runs reference=, never the body")


def no_op(*_):  # a reference for ops that are refused before anything runs, on either device
    pass


def tensor(rng, n, stream, dtype=np.float32):
    return dop.from_numpy(rng.standard_normal(n).astype(dtype), stream=stream)


# -- the reference device: reference= ----------------------------------------------------------

def test_the_reference_gets_numpy_arrays_reads_read_only_and_writes_in_place(ref, rng):
    x, w, y = tensor(rng, 64, ref), tensor(rng, 64, ref), dop.empty(64, stream=ref)
    seen = {}

    def reference(x, w, y):
        seen["types"] = (type(x), type(w), type(y))
        seen["read_only"] = not x.flags.writeable and not w.flags.writeable
        y[...] = x * w + 1.0

    op = dop.foreign(gpu_body, reads=[x, w], writes=[y], reference=reference, name="fma")
    assert op.describe() == "dop.foreign(fma)"
    value = op.sync_on(ref)
    assert value == (y,)  # the value is the tuple of the writes, as given
    assert seen == {"types": (np.ndarray,) * 3, "read_only": True}
    np.testing.assert_array_equal(y.numpy(stream=ref), x.numpy(stream=ref) * w.numpy(stream=ref) + 1.0)


def test_dicts_declare_keyword_arguments(ref, rng):
    x, y = tensor(rng, 32, ref), dop.empty(32, stream=ref)

    def reference(*, src, dst):
        dst[...] = -src

    dop.foreign(gpu_body, reads={"src": x}, writes={"dst": y}, reference=reference).sync_on(ref)
    np.testing.assert_array_equal(y.numpy(stream=ref), -x.numpy(stream=ref))


def test_a_reference_may_not_write_its_reads(ref, rng):
    x, y = tensor(rng, 16, ref), dop.empty(16, stream=ref)
    before = x.numpy(stream=ref)

    def reference(x, y):
        x[...] = 0

    with pytest.raises(dop.LaunchError, match=r"wrote into an array of its reads= \(.*read-only\).*in writes="):
        dop.foreign(gpu_body, reads=[x], writes=[y], reference=reference).sync_on(ref)
    np.testing.assert_array_equal(x.numpy(stream=ref), before)

    def matmul_in_place(x, y):                             # NumPy's other words for it: "output array is read-only"
        np.negative(x, out=x)

    graph = dop.foreign(gpu_body, reads=[x], writes=[y], reference=matmul_in_place).graph_on(ref)
    with pytest.raises(dop.LaunchError, match="wrote into an array of its reads="):
        graph.replay()
    np.testing.assert_array_equal(x.numpy(stream=ref), before)
    with pytest.raises(ValueError, match="not about reads"):   # the reference's own errors go on unchanged
        dop.foreign(gpu_body, reads=[x], writes=[y],
                    reference=lambda x, y: (_ for _ in ()).throw(ValueError("not about reads"))).sync_on(ref)


def test_a_reference_that_returns_its_result_instead_of_writing_it_is_refused(ref, rng):
    x, y = tensor(rng, 16, ref), dop.empty(16, stream=ref)
    with pytest.raises(dop.LaunchError, match=r"returned a ndarray; a reference writes its results into the write "
                                              r"arrays.*out\[\.\.\.\] = "):
        dop.foreign(gpu_body, reads=[x], writes=[y], reference=lambda x, y: x * 2).sync_on(ref)


def test_without_a_reference_the_reference_device_refuses_naming_reference(ref, rng):
    x, y = tensor(rng, 16, ref), dop.empty(16, stream=ref)
    with pytest.raises(dop.NoDeviceError, match=r"dop.foreign\(gemm\) runs another library's GPU work .*needs a "
                                                r"CUDA device.*Give the op a NumPy reference="):
        dop.foreign(gpu_body, reads=[x], writes=[y], name="gemm").sync_on(ref)
    # captured: refused before its inputs ran, the capture ended, nothing marked executed
    copy = api.memcpy(dop.empty(16, stream=ref), x)
    with pytest.raises(dop.NoDeviceError, match="reference="):
        dop.foreign(gpu_body, reads=[copy], writes=[y], name="gemm").graph_on(ref)
    assert not ref.is_capturing()
    copy.sync_on(ref)  # handed back unexecuted: it runs now


def test_a_captured_foreign_op_replays_its_reference_with_new_data(ref, rng):
    x, y = tensor(rng, 128, ref), dop.empty(128, stream=ref)
    calls = []

    def reference(x, y):
        calls.append(1)
        np.sqrt(np.abs(x), out=y)

    graph = dop.foreign(gpu_body, reads=[x], writes=[y], reference=reference, name="sqrt").graph_on(ref)
    assert calls == []  # capturing records; it does not run
    assert graph.nodes() == [{"type": "GRAPH", "name": "dop.foreign(sqrt)"}]
    for i in range(3):
        host = rng.standard_normal(128).astype(np.float32)
        graph.update(api.memcpy(x, dop.from_numpy(host, stream=ref)))
        graph.launch().sync_on(ref)
        np.testing.assert_array_equal(y.numpy(stream=ref), np.sqrt(np.abs(host)))
        assert len(calls) == i + 1


def test_the_warmup_runs_once_before_the_capture_never_eagerly_nor_on_replay(ref, rng):
    x, y = tensor(rng, 16, ref), dop.empty(16, stream=ref)
    calls = []

    def reference(x, y):
        calls.append("run")
        y[...] = x + 1

    dop.foreign(gpu_body, reads=[x], writes=[y], reference=reference, warmup=True).sync_on(ref)
    assert calls == ["run"]  # eager: no warm-up, the op runs once
    calls.clear()
    graph = dop.foreign(gpu_body, reads=[x], writes=[y], reference=reference, warmup=True).graph_on(ref)
    assert calls == ["run"]  # the warm-up, once, before the capture; the capture itself records
    graph.replay()
    graph.replay()
    assert calls == ["run"] * 3
    calls.clear()
    dop.foreign(gpu_body, reads=[x], writes=[y], reference=reference).graph_on(ref)
    assert calls == []  # no warm-up asked for


def test_foreign_work_composes_with_kernels_in_a_scope_and_a_recapture(ref, rng):
    from deviceop.kernels import add
    a, b = tensor(rng, 256, ref), tensor(rng, 256, ref)
    s, y, y2 = dop.empty(256, stream=ref), dop.empty(256, stream=ref), dop.empty(256, stream=ref)

    def double(x, y):
        y[...] = 2 * x

    def body(scope, out):
        total = add(s.partition([128]), a, b).first().unpartition()  # runs first: the foreign op reads it
        scope.record(dop.foreign(gpu_body, reads=[total], writes=[out], reference=double, name="double"))

    graph = CudaGraph.scope(ref, lambda scope: body(scope, y))
    assert [n["type"] for n in graph.nodes()] == ["KERNEL", "GRAPH"]
    graph.replay()
    expected = 2 * (a.numpy(stream=ref) + b.numpy(stream=ref))
    np.testing.assert_array_equal(y.numpy(stream=ref), expected)
    assert graph.recapture(lambda scope: body(scope, y2)) == "updated"  # same nodes, new buffer
    graph.replay()
    np.testing.assert_array_equal(y2.numpy(stream=ref), expected)


def test_a_reference_may_return_the_write_arrays_as_numpys_out_does(ref, rng):
    # np.matmul(x, w, out=y) returns y: a reference that wrote its writes was refused for saying so
    x, y, z = tensor(rng, 16, ref), dop.empty(16, stream=ref), dop.empty(16, stream=ref)
    dop.foreign(gpu_body, reads=[x], writes=[y], reference=lambda x, y: np.multiply(x, 2, out=y)).sync_on(ref)
    np.testing.assert_array_equal(y.numpy(stream=ref), 2 * x.numpy(stream=ref))
    graph = dop.foreign(gpu_body, reads=[x], writes=[y, z],
                        reference=lambda x, y, z: (np.add(x, 1, out=y), np.negative(x, out=z))).graph_on(ref)
    graph.replay()
    np.testing.assert_array_equal(z.numpy(stream=ref), -x.numpy(stream=ref))
    with pytest.raises(dop.LaunchError, match="returned a ndarray"):  # a read is no write
        dop.foreign(gpu_body, reads=[x], writes=[y], reference=lambda x, y: x).sync_on(ref)


def test_deviceop_work_inside_a_reference_is_refused_at_replay_as_eagerly(ref, rng):
    # eagerly the op's execution refused it; at a replay the reference ran outside any execution
    # and its deviceop work ran, unrecorded (a GPU replay never calls Python)
    x, y, other = tensor(rng, 16, ref), dop.empty(16, stream=ref), dop.empty(16, stream=ref)

    def copies_too(xs, ys):
        ys[...] = xs
        api.memcpy(other, x).sync_on(ref)

    with pytest.raises(dop.ReentrancyError, match=r"sync_on\(api.memcpy\) was called while "
                                                  r"sync_on\(dop.foreign\(copies_too\)\) is executing"):
        dop.foreign(gpu_body, reads=[x], writes=[y], reference=copies_too, name="copies_too").sync_on(ref)
    graph = dop.foreign(gpu_body, reads=[x], writes=[y], reference=copies_too, name="copies_too").graph_on(ref)
    for _ in range(2):  # the graph and the stream stay usable
        with pytest.raises(dop.ReentrancyError, match=r"sync_on\(api.memcpy\) was called while "
                                                      r"dop.foreign\(copies_too\) is executing"):
            graph.replay()
    np.testing.assert_array_equal(y.numpy(stream=ref), x.numpy(stream=ref))


def test_names_with_quotes_and_newlines_stay_inside_their_dot_labels(ref, rng):
    # the reference device's DOT wrote a foreign op's name unescaped: a quote ended the label early
    # and Graphviz could not read the graph (a GPU's DOT is the driver's, without these names)
    import re
    x, y = tensor(rng, 8, ref), dop.empty(8, stream=ref)
    graph = zip_(dop.foreign(gpu_body, reads=[x], writes=[y], reference=no_op, name='say "hi"\nto C:\\'),
                 dop.host_callback(lambda: None, name='tick "1"')).graph_on(ref)
    lines = [line for line in graph.to_dot().splitlines() if "label=" in line]
    labels = [re.fullmatch(r'  n\d+ \[label="((?:[^"\\]|\\.)*)"\];', line) for line in lines]
    assert all(labels), lines   # each label one DOT string, escapes and all
    unescaped = [re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), m.group(1)) for m in labels]
    assert unescaped == ['GRAPH dop.foreign(say "hi"\nto C:\\)', 'HOST dop.host_callback(tick "1")']


def test_graph_node_of_foreign_work_or_a_host_callback_says_it_has_none_not_that_it_was_not_captured(ref, rng):
    x, y = tensor(rng, 8, ref), dop.empty(8, stream=ref)
    foreign, tick = dop.foreign(gpu_body, reads=[x], writes=[y], reference=no_op), dop.host_callback(lambda: None)
    graph = zip_(foreign, tick).graph_on(ref)
    for op in (foreign, tick):  # both were captured: "was not captured into this graph" sent users looking
        with pytest.raises(dop.StateError, match=r"has no node graph.node\(\) can give: its work has no parameters "
                                                 r"deviceop can set.*graph.recapture"):
            graph.node(op)


# -- declarations: ownership, aliasing, arguments (Device(0)) ---------------------------------------

def test_a_shared_write_needs_the_only_handle_like_try_partition(stream):
    buf = dop.empty(64, stream=stream).into_shared()
    other = buf.clone()
    x = dop.empty(64, stream=stream)
    with pytest.raises(dop.OwnershipError, match=r"dop.foreign\(gpu_body\) writes writes\[0\]: .*1 other live "
                                                 r"SharedTensor handle"):
        dop.foreign(gpu_body, reads=[x], writes=[buf])
    other.release()
    dop.foreign(gpu_body, reads=[x], writes=[buf]).discard()  # held alone: accepted
    view = buf.view([8, 8])  # a borrow made through the handle
    with pytest.raises(dop.OwnershipError, match="live borrow"):
        dop.foreign(gpu_body, writes=[buf])
    del view
    reader = buf.clone()
    with pytest.raises(dop.OwnershipError):  # a read through another handle is still another handle
        dop.foreign(gpu_body, reads=[reader], writes=[buf])
    reader.release()
    dop.foreign(gpu_body, reads=[dop.empty(8, stream=stream).into_shared()], writes=[buf]).discard()


def test_a_shared_write_is_checked_again_when_the_op_runs(stream):
    """A handle an op produces is checked when the op runs (clones may be made after building)."""
    buf = dop.empty(64, stream=stream).into_shared()
    keep = buf.clone()
    op = dop.foreign(gpu_body, writes=[dop.value(buf)], reference=no_op, name="late")
    with pytest.raises(dop.OwnershipError, match=r"dop.foreign\(late\) writes writes\[0\]"):
        op.sync_on(stream)
    keep.release()


def test_overlapping_writes_and_reads_are_aliasing_errors(stream):
    t = dop.empty(256, stream=stream)
    with pytest.raises(dop.AliasingError, match=r"writes writes\[0\] and reads reads\[0\] from overlapping memory.*"
                                                r"declared once, in writes="):
        dop.foreign(gpu_body, reads=[t], writes=[t])
    with pytest.raises(dop.AliasingError, match=r"writes writes\[0\] and writes writes\[1\]"):
        dop.foreign(gpu_body, writes=[t[:200], t[100:]])
    with pytest.raises(dop.AliasingError, match="writes out and reads x"):
        dop.foreign(gpu_body, reads={"x": t.view([16, 16])}, writes={"out": t.partition([128])})
    dop.foreign(gpu_body, reads=[t[:128], t[:128]], writes=[t[128:]]).discard()  # reads may overlap each other
    with pytest.raises(dop.AliasingError):  # the same check when the arguments are ops
        dop.foreign(gpu_body, reads=[dop.value(t)], writes=[dop.value(t[64:])], reference=no_op).sync_on(stream)


def test_what_is_not_a_tensor_or_a_function_is_refused_naming_the_fix(stream):
    t = dop.empty(16, stream=stream)
    with pytest.raises(dop.LaunchError, match="takes a function body.*got a Tensor"):
        dop.foreign(t, writes=[t])
    with pytest.raises(dop.LaunchError, match=r"reads= is a list of tensors .* got a Tensor; e.g. reads=\[x\]"):
        dop.foreign(gpu_body, reads=t)
    with pytest.raises(dop.LaunchError, match=r"reads reads\[0\], which must be a Tensor .*dop.from_numpy"):
        dop.foreign(gpu_body, reads=[np.zeros(4)])
    with pytest.raises(dop.LaunchError, match="a partition is how a kernel writes"):
        dop.foreign(gpu_body, reads=[t.partition([8])])
    with pytest.raises(dop.LaunchError, match="writes writes.0., which must be a Tensor, a Partition"):
        dop.foreign(gpu_body, writes=[3.0])
    with pytest.raises(dop.LaunchError, match="'x' in both reads= and writes="):
        dop.foreign(gpu_body, reads={"x": t}, writes={"x": dop.empty(16, stream=stream)})
    with pytest.raises(dop.LaunchError, match="reference= is a function"):
        dop.foreign(gpu_body, writes=[t], reference=np.zeros(3))


def test_a_body_reference_or_warmup_that_cannot_take_the_declared_arguments_is_refused_when_built(stream, rng):
    # a GPU called such a body with the wrong arguments (a raw TypeError) and the reference device,
    # which never calls it, ran the op: refused when built now, on both devices, naming the call
    x, y = tensor(rng, 16, stream), dop.empty(16, stream=stream)

    def body(s, x, y):  # pragma: no cover - refused or run on the reference device only
        pass

    def reference(x, y):
        y[...] = x

    for given, says in (
            (dict(body=lambda x, y: None), r"body <lambda>\(x, y\) cannot be called as "
                                             r"body\(stream, reads\[0\], writes\[0\]\) \(too many positional"),
            (dict(reference=lambda s, x, y: None), r"reference <lambda>\(s, x, y\) cannot be called as "
                                                   r"reference\(reads\[0\], writes\[0\]\).*without the stream"),
            (dict(warmup=lambda s, x: None), r"warmup <lambda>\(s, x\) cannot be called as warmup\(stream, "
                                             r"reads\[0\], writes\[0\]\)")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the op it was given is dropped, without a never-executed warning
            copy = api.memcpy(dop.empty(16, stream=stream), x)
            with pytest.raises(dop.LaunchError, match=says):
                dop.foreign(**{"body": body, "reference": reference, **given}, reads=[copy], writes=[y])
            del copy
            import gc
            gc.collect()
    with pytest.raises(dop.LaunchError, match=r"body\(stream, src=\.\.\., dst=\.\.\.\) \(missing a required argument: 'x'\)"):
        dop.foreign(body, reads={"src": x}, writes={"dst": y}, reference=lambda *, src, dst: None)
    with pytest.raises(dop.LaunchError, match=r"dop.host_callback\(<lambda>\)'s fn <lambda>\(n\) cannot be called "
                                              r"as fn\(\).*functools.partial"):
        dop.host_callback(lambda n: None)
    async def later(s, x, y):  # pragma: no cover - refused, never called (it would run nothing if it were)
        pass

    with pytest.raises(dop.LaunchError, match=r"body later is an async function: calling it runs none of its code"):
        dop.foreign(later, reads=[x], writes=[y], reference=reference)
    with pytest.raises(dop.LaunchError, match=r"fn later is an async function"):
        dop.host_callback(later)
    ref = dop.ReferenceDevice(0).new_stream()  # these fit (the reference runs here; the body would on a GPU)
    x, y = tensor(rng, 16, ref), dop.empty(16, stream=ref)
    dop.foreign(body, reads=[x], writes=[y], reference=reference, warmup=body).sync_on(ref)
    np.testing.assert_array_equal(y.numpy(stream=ref), x.numpy(stream=ref))


def test_a_decorated_body_reference_or_callback_is_checked_as_it_is_called_not_as_the_function_it_wraps(rng):
    # functools.wraps makes inspect.signature report the wrapped function's parameters; the op
    # calls the wrapper, so a decorator that supplies arguments itself (the stream, bound values)
    # was refused with a call the wrapper takes
    ref = dop.ReferenceDevice(0).new_stream()
    x, y = tensor(rng, 16, ref), dop.empty(16, stream=ref)

    def drops_stream(fn):  # the body's library picks its own stream
        @functools.wraps(fn)
        def wrapper(stream, *args):
            return fn(*args)
        return wrapper

    def bound(*front):  # hands the function values the decorator holds, then the call's arguments
        def wrap(fn):
            @functools.wraps(fn)
            def wrapper(*args):
                return fn(*front, *args)
            return wrapper
        return wrap

    @drops_stream
    def body(x, y):  # pragma: no cover - the reference device runs the reference
        pass

    @bound(2.0)
    def reference(scale, x, y):
        y[...] = scale * x

    ran = []

    @bound("tick")
    def callback(what):
        ran.append(what)

    dop.zip_(dop.foreign(body, reads=[x], writes=[y], reference=reference), dop.host_callback(callback)).sync_on(ref)
    np.testing.assert_array_equal(y.numpy(stream=ref), 2.0 * x.numpy(stream=ref))
    assert ran == ["tick"]


def test_a_body_built_again_and_again_has_its_signature_read_once_and_its_defaults_still_count(rng, monkeypatch):
    # an eager loop's body function builds its foreign ops at every iteration, and reading and
    # binding three signatures made dop.foreign ~5x dearer to build (~25 us against ~5 on a CPU)
    ref = dop.ReferenceDevice(0).new_stream()
    x, y = tensor(rng, 16, ref), dop.empty(16, stream=ref)
    reads = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda fn, **kw: reads.append(fn) or real(fn, **kw))

    def build(scale):  # a new body and reference at every call, as a loop body's lambdas are
        def reference(x, y):
            y[...] = scale * x
        return dop.foreign(lambda s, x, y: None, reads=[x], writes=[y], reference=reference), dop.host_callback(
            lambda: None)
    for i in range(5):
        for op in build(float(i)):
            op.sync_on(ref)
    assert len(reads) <= 3  # the first build's body, reference and callback
    np.testing.assert_array_equal(y.numpy(stream=ref), 4.0 * x.numpy(stream=ref))

    def fits(s, x, y=None):  # pragma: no cover - the reference device never calls a body
        pass
    dop.foreign(fits, reads=[x], writes=[y], reference=no_op).discard()
    fits.__defaults__ = None  # the same code without its default cannot take reads=[x] alone
    with pytest.raises(dop.LaunchError, match=r"body fits\(s, x, y\) cannot be called as body\(stream, reads\[0\]\)"):
        dop.foreign(fits, reads=[x], reference=no_op)


def test_a_foreign_op_never_executed_warns(stream):
    with pytest.warns(dop.UnexecutedOpWarning, match=r"dop.foreign\(gpu_body\) was never executed"):
        dop.foreign(gpu_body, writes=[dop.empty(4, stream=stream)])
        import gc
        gc.collect()


# -- host callbacks (Device(0): cuLaunchHostFunc on a GPU) ---------------------------------------------

def test_a_host_callback_runs_once_eagerly_and_at_every_replay(stream, rng):
    x, y = tensor(rng, 256, stream), dop.empty(256, stream=stream)
    calls = []
    dop.host_callback(lambda: calls.append("eager")).sync_on(stream)
    assert calls == ["eager"]
    calls.clear()
    graph = zip_(api.memcpy(y, x), dop.host_callback(lambda: calls.append("replay"), name="tick")).graph_on(stream)
    assert calls == []  # capturing records the callback; it does not run
    assert [n["type"] for n in graph.nodes()] == ["MEMCPY", "HOST"]
    for i in range(3):
        graph.launch().sync_on(stream)
        assert calls == ["replay"] * (i + 1)
    graph.close()
    graph2 = CudaGraph.scope(stream, lambda s: s.record(dop.host_callback(lambda: calls.append("scope"))))
    graph2.replay()
    stream.synchronize()
    assert calls[-1] == "scope"


def test_a_host_node_in_a_captured_loop_or_branch_body_is_refused_on_both_devices(stream, rng):
    # CUDA's conditional node bodies hold no host node, through child graphs too: the GPU's driver
    # refuses them, and the reference device, which ran them, refuses them alike, before recording
    x, y = tensor(rng, 64, stream), dop.empty(64, stream=stream)
    index, zero, one = (dop.from_numpy(np.array([v], np.int32), stream=stream) for v in (0, 0, 1))
    calls = []
    tick = lambda: calls.append(1)  # noqa: E731
    with_host = zip_(api.memcpy(y, x), dop.host_callback(tick, name="tick")).graph_on(stream)
    holds_it = with_host.launch().graph_on(stream)          # a graph holding it in a child graph
    for where, op in (("loop.2.", lambda: dop.loop(2, index, lambda i: dop.host_callback(tick, name="tick"))),
                      ("if_", lambda: dop.if_(one, lambda: api.memcpy(y, x),
                                              lambda: dop.host_callback(tick, name="tick"))),
                      ("switch.2.", lambda: dop.switch(zero, [lambda: with_host.launch(), lambda: api.memcpy(y, x)])),
                      ("loop.2.", lambda: dop.loop(2, index, lambda i: holds_it.launch()))):
        with pytest.raises(dop.GraphSafetyError, match=rf"(dop.host_callback\(tick\)|graph.launch\(\) of a graph "
                                                       rf"holding dop.host_callback\(tick\)) cannot be captured in "
                                                       rf"the body of {where}.*no host node"):
            op().graph_on(stream)
        assert not stream.is_capturing()
        op().sync_on(stream)                                  # eagerly a host loop or branch: it runs
    assert len(calls) == 2 + 0 + 1 + 2                        # two iterations, the memcpy branch, branch 0, two
    graph = zip_(dop.loop(2, index, lambda i: api.memcpy(y, x)), holds_it.launch()).graph_on(stream)
    graph.replay()                                            # beside the loop, not in its body: fine
    stream.synchronize()
    assert len(calls) == 6
    with CudaGraph.scope(stream) as s:                        # refused before the GPU adds the loop's node:
        with pytest.raises(dop.GraphSafetyError, match="no host node"):   # the scope goes on, on both devices
            s.record(dop.loop(2, index, lambda i: zip_(api.memcpy(y, x), dop.host_callback(tick, name="tick"))))
        s.record(dop.host_callback(tick, name="tick"))
    s.graph.replay()
    stream.synchronize()
    assert len(calls) == 7 and [n["type"] for n in s.graph.nodes()] == ["HOST"]


def test_an_exception_in_a_host_callback_is_a_warning_and_the_stream_goes_on(stream, rng):
    x, y = tensor(rng, 64, stream), dop.empty(64, stream=stream)

    def fails():
        raise KeyError("boom")

    with pytest.warns(RuntimeWarning, match=r"dop.host_callback\(fails\) raised KeyError: 'boom'; a host callback "
                                            r"cannot stop the stream's work"):
        zip_(dop.host_callback(fails), api.memcpy(y, x)).sync_on(stream)
    np.testing.assert_array_equal(y.numpy(stream=stream), x.numpy(stream=stream))
    with pytest.raises(dop.LaunchError, match="takes a function of no arguments, got a int"):
        dop.host_callback(3)


# -- scope.record records what it is given, or refuses it ------------------------------------------------

@pytest.mark.parametrize("thing, says", [
    (lambda: None, r"got a function, which would run once, now, and never on a replay: .*dop.foreign\(body"),
    (np.ones(3, np.float32), r"got a ndarray, which is host data, not work: .*dop.from_numpy.*api.memcpy"),
    (7, r"got a int, which is no op, so there is nothing to record.*dop.value\(x\)"),
])
def test_scope_record_refuses_what_it_would_not_record(stream, rng, thing, says):
    x, y = tensor(rng, 64, stream), dop.empty(64, stream=stream)
    with pytest.raises(dop.LaunchError, match=says):
        CudaGraph.scope(stream, lambda s: s.record(thing))
    assert not stream.is_capturing()

    def body(s):  # refused, and caught: the scope goes on and records only the copy
        with pytest.raises(dop.LaunchError):
            s.record(thing)
        s.record(api.memcpy(y, x))

    graph = CudaGraph.scope(stream, body)
    assert [n["type"] for n in graph.nodes()] == ["MEMCPY"]
    graph.launch().sync_on(stream)
    np.testing.assert_array_equal(y.numpy(stream=stream), x.numpy(stream=stream))


def test_deviceop_work_inside_a_host_callback_is_refused_at_every_replay(stream, rng):
    # the driver refuses CUDA calls from a host function (or deadlocks); the reference device ran a
    # graph replay from one when the graph holding the callback was replayed
    x, y = tensor(rng, 64, stream), dop.empty(64, stream=stream)
    other = api.memcpy(y, x).graph_on(stream)
    called = []

    def replays_another():
        called.append(1)
        other.replay()

    graph = dop.host_callback(replays_another).graph_on(stream)
    for run in (graph.replay, lambda: graph.launch().sync_on(stream)):
        with pytest.warns(RuntimeWarning, match=r"dop.host_callback\(replays_another\) raised ReentrancyError: "
                                                r"graph.replay\(\) was called while .* is executing"):
            run()
            stream.synchronize()
    assert called == [1, 1]
    ticks = []
    ticking = dop.host_callback(lambda: ticks.append(len(ticks))).graph_on(stream)   # host work alone: fine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ticking.replay()
        ticking.launch().sync_on(stream)
    assert ticks == [0, 1]


@pytest.mark.parametrize("name", ["ptr", "handle", "torch", "cupy", "__cuda_stream__"])
def test_a_reference_streams_cuda_handles_are_refused_naming_the_device(name):
    # What only a CUDA stream has (what a foreign body hands its libraries) is a NoDeviceError on the
    # reference device, not a raw AttributeError; hasattr() still reads it as missing, so code that
    # probes a stream (cuda.core's __cuda_stream__ protocol, getattr(s, "ptr", None)) goes on working.
    stream = dop.ReferenceDevice().default_stream()  # also where a GPU is there
    with pytest.raises(dop.NoDeviceError, match="reference device, which has no CUDA stream"):
        getattr(stream, name)
    assert not hasattr(stream, name) and getattr(stream, name, None) is None
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'") as info:
        stream.no_such_thing
    assert not isinstance(info.value, dop.NoDeviceError)


def test_what_a_gpu_body_may_return_is_judged_by_where_its_arrays_lie(stream):
    # The GPU-side check of a body's return value (the reference device never calls a body):
    # a new array alone is a result lost; the write itself (out=), a tuple with one array in a
    # write beside new ones ((out, lse)), an empty array or anything that is no array are fine.
    from deviceop.foreign import _stray
    y, other = dop.empty((4, 8), stream=stream), dop.empty((4, 8), stream=stream)

    class Cai:  # an array of another library, where it says it lies
        def __init__(self, ptr, shape=(4,)):
            self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": "<f4", "version": 3}
    lo, hi = y.memory_range()
    outside = other.memory_range()[0]
    assert _stray(Cai(outside), [y]) == "Cai" and _stray(other, [y]) == "Tensor"
    assert _stray((Cai(outside), Cai(outside)), [y]) == "Cai"            # none of it written
    for fine in (None, 3, "kernel", y, y.view(32)[8:16], Cai(lo), Cai(hi - 4), (Cai(lo), Cai(outside)),
                 [other, y], Cai(outside, (0,)), Cai(0)):
        assert _stray(fine, [y]) is None, fine
