"""The DeviceOp algebra: every semantic rule of DESIGN.md, as a test.

Runs on Device(0): the reference device here and in CI, the H100 under gpu-check.
"""
import asyncio
import threading

import numpy as np
import pytest

import deviceop as dop
from deviceop import api, zip_, DeviceOpVec
from deviceop.op import stats
from deviceop.kernels import add, affine, matvec, rms_norm


def counts():
    return dict(stats)


def test_building_runs_and_allocates_nothing(stream, rng):
    x = dop.from_numpy(rng.standard_normal(1024).astype(np.float32))
    out = dop.empty(1024)
    before = counts()
    op = zip_(api.zeros([4096]), add(out.partition([128]), x, x).generics([128]).first().unpartition())
    op = op.map(lambda v: v[1])
    assert counts() == before  # nothing launched, nothing allocated
    result = op.sync_on(stream)
    assert counts()["launches"] == before["launches"] + 1 and counts()["allocations"] == before["allocations"] + 1
    np.testing.assert_allclose(result.numpy(), 2 * x.numpy(), rtol=1e-6)


def test_shared_op_runs_once_however_many_clones(stream):
    calls = []
    base = dop.value(41).map(lambda v: calls.append(v) or v + 1).shared()
    total = zip_(base.clone(), base.clone(), base).map(sum).sync_on(stream)
    assert total == 126 and calls == [41]
    assert base.clone().sync_on(stream) == 42 and calls == [41]  # later clones see the same result


def test_shared_clones_see_the_same_tensor(stream):
    t = api.ones([8]).shared()
    a, b = zip_(t.clone(), t.clone()).sync_on(stream)
    assert a is b


def test_launch_value_is_the_tuple_of_its_arguments(stream, rng):
    a = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    b = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    out = dop.empty(256)
    launch = add(out.partition([128]), a, b).generics([128])
    part, a2, b2 = launch.sync_on(stream)
    assert isinstance(part, dop.Partition) and part.grid == (2,) and a2 is a and b2 is b
    t = add(out.partition([128]), a, b).generics([128]).first().unpartition().sync_on(stream)
    assert t is out


def test_an_op_is_consumed_by_its_execution(stream):
    op = dop.value(1).map(lambda v: v)
    op.sync_on(stream)
    with pytest.raises(dop.StateError, match="already executed"):
        op.sync_on(stream)


def test_try_partition_needs_the_only_live_handle(rng):
    buf = dop.empty(256).into_shared()
    other = buf.clone()
    with pytest.raises(dop.OwnershipError, match="1 other live SharedTensor handle"):
        buf.try_partition([128])
    other.release()
    part = buf.try_partition([128])  # now sole owner; the handle is consumed
    assert part.grid == (2,)
    with pytest.raises(dop.StateError, match="released or consumed"):
        buf.try_partition([128])


def test_ownership_check_does_not_depend_on_refcounts():
    """Python references to a handle are not handles: only clone() makes one."""
    buf = dop.empty(128).into_shared()
    alias = buf          # a second *reference*, not a second handle
    assert alias.try_partition([128]).grid == (1,)
    buf2 = dop.empty(128).into_shared()
    keep = [buf2.clone() for _ in range(3)]
    assert buf2.live_handles == 4
    for k in keep:
        k.release()
    assert buf2.try_partition([128])


def test_same_buffer_as_output_and_input_is_an_aliasing_error(stream, rng):
    t = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    before = counts()["launches"]
    with pytest.raises(dop.AliasingError, match="writes out and reads a from overlapping memory"):
        add(t.partition([128]), t, dop.empty(256)).generics([128]).sync_on(stream)
    with pytest.raises(dop.AliasingError):
        add(t[0:128].partition([128]), t[64:192], dop.empty(128)).generics([128]).sync_on(stream)
    assert counts()["launches"] == before


def test_execution_is_not_reentrant(stream):
    nested = dop.value(1).map(lambda v: dop.value(2).sync_on(stream))
    with pytest.raises(dop.ReentrancyError, match="non-reentrant"):
        nested.sync_on(stream)
    assert dop.value(3).sync_on(stream) == 3  # the lock was released


def test_then_runs_the_next_op_on_the_same_stream(stream):
    seen = []
    op = api.full([4], 2.0).then(lambda t: api.dup(t).inspect(lambda d: seen.append(d)))
    d = op.sync_on(stream)
    assert seen == [d] and np.all(d.numpy() == 2.0)


def test_await_completes_without_blocking_the_event_loop(stream):
    async def main():
        ticks = []

        async def ticker():
            for _ in range(3):
                ticks.append(1)
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        value = await api.full([1024], 3.0).map(lambda t: t)
        also = await dop.value(5).on(stream)
        await t
        return value, also, ticks

    value, also, ticks = asyncio.run(main())
    assert np.all(value.numpy() == 3.0) and also == 5 and len(ticks) == 3


def test_unzip_first_last_boxed_vec_reshape(stream):
    a, b = zip_(dop.value(1), dop.value(2)).unzip()
    assert zip_(b, a).sync_on(stream) == (2, 1)
    assert zip_(dop.value(1), dop.value(2), dop.value(3)).last().sync_on(stream) == 3
    vec = DeviceOpVec([dop.value(i).boxed() for i in range(3)])
    vec.push(dop.value(3))
    assert vec.sync_on(stream) == [0, 1, 2, 3] and len(vec) == 4
    v = api.zeros([2, 6]).reshape([3, 4]).sync_on(stream)
    assert v.shape == (3, 4)
    with pytest.raises(dop.ShapeError, match="needs an op producing a tensor"):
        dop.value(5).reshape([1]).sync_on(stream)
    with pytest.raises(dop.StateError, match="pass n"):
        dop.value((1, 2)).unzip()


def test_graph_safety_flags():
    t = dop.empty(128)
    copy, launch = api.memcpy(t, t), add(t.partition([128]), t, t)
    assert copy.graph_safe and launch.graph_safe
    copy.discard(), launch.discard()  # built to be inspected, never to run
    for op in (api.zeros([1]), api.rand([1]), api.dup(t), api.from_numpy(np.ones(2))):
        assert op.unsafe_for_graphs() is op
    composite = zip_(api.memcpy(t, t), api.ones([3]).map(lambda x: x))
    assert "api.ones" in composite.unsafe_for_graphs().describe()


# -- api ------------------------------------------------------------------------------

def test_api_values(stream):
    assert np.all(api.zeros([3], "int32").sync_on(stream).numpy() == 0)
    assert np.all(api.ones([2, 2]).sync_on(stream).numpy() == 1)
    assert np.all(api.full([5], 7, "int32").sync_on(stream).numpy() == 7)
    np.testing.assert_array_equal(api.arange(6).sync_on(stream).numpy(), np.arange(6))
    r1, r2 = api.rand([64], seed=3).sync_on(stream), api.rand([64], seed=3).sync_on(stream)
    np.testing.assert_array_equal(r1.numpy(), r2.numpy())
    assert 0 <= r1.numpy().min() and r1.numpy().max() < 1 and r1.numpy().std() > 0.1
    assert abs(api.randn([4096], seed=1).sync_on(stream).numpy().std() - 1) < 0.1
    src = api.from_numpy(np.arange(4, dtype=np.float32)).sync_on(stream)
    copy = api.dup(src).sync_on(stream)
    assert copy.data_ptr != src.data_ptr
    np.testing.assert_array_equal(copy.numpy(), [0, 1, 2, 3])
    dst = dop.empty(4)
    assert api.memcpy(dst, src).sync_on(stream) is dst
    np.testing.assert_array_equal(dst.numpy(), [0, 1, 2, 3])


def test_api_bad_input():
    with pytest.raises(dop.DTypeError, match="dtypes must match"):
        api.memcpy(dop.empty(4, "int32"), dop.empty(4))
    with pytest.raises(dop.ShapeError, match="4 elements"):
        api.memcpy(dop.empty(4), dop.empty(5))
    with pytest.raises(dop.DTypeError, match="floating-point"):
        api.rand([4], "int32")
    with pytest.raises(dop.DTypeError, match="never truncates"):
        api.full([4], 1.5, "int32")


# -- kernel declarations ----------------------------------------------------------------

def test_bad_launches_raise_before_anything_runs(rng):
    x = dop.from_numpy(rng.standard_normal((1, 256)).astype(np.float32))
    w = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    out = dop.empty((1, 256))
    before = counts()
    with pytest.raises(dop.LaunchError, match="takes 4 arguments"):
        rms_norm(out.partition([1, 256]), x, w)
    with pytest.raises(dop.DTypeError, match="argument x of rms_norm must be float32, got a int32"):
        rms_norm(out.partition([1, 256]), dop.empty((1, 256), "int32"), w, 1e-5)
    with pytest.raises(dop.ShapeError, match="argument x of rms_norm must have rank 2"):
        rms_norm(out.partition([1, 256]), dop.empty(256), w, 1e-5)
    with pytest.raises(dop.LaunchError, match="must be a Partition.*tensor.partition"):
        rms_norm(out, x, w, 1e-5)
    with pytest.raises(dop.LaunchError, match="takes 2 generics <D, BS>"):
        rms_norm(out.partition([1, 256]), x, w, 1e-5).generics([256])
    for bad in ([256, 64.0], [256, [64]], [256, ""]):  # 64.0 == 64 in Python, but not a C++ template argument
        with pytest.raises(dop.LaunchError, match="a generic is an int, a bool or a C.. type name"):
            rms_norm(out.partition([1, 256]), x, w, 1e-5).generics(bad)
    with pytest.raises(dop.DTypeError, match="argument eps"):
        rms_norm(out.partition([1, 256]), x, w, "tiny")
    with pytest.raises(dop.ShapeError, match="does not divide"):
        add(dop.empty(100).partition([64]), dop.empty(100), dop.empty(100))
    assert counts() == before


def test_missing_or_inconsistent_generics_fail_at_execution_before_the_launch(stream, rng):
    x = dop.from_numpy(rng.standard_normal((1, 256)).astype(np.float32))
    w = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    out = dop.empty((1, 256))
    before = counts()["launches"]
    with pytest.raises(dop.LaunchError, match="needs generics <D, BS>"):
        rms_norm(out.partition([1, 256]), x, w, 1e-5).sync_on(stream)
    with pytest.raises(dop.ShapeError, match="D=512"):
        rms_norm(out.partition([1, 256]), x, w, 1e-5).generics([512, 128]).sync_on(stream)
    assert counts()["launches"] == before


# -- the tutorial's kernels against float64 NumPy ------------------------------------------

def rel_err(got, ref):
    """Norm-wise relative error ||got - ref|| / ||ref||, against a float64 reference."""
    return float(np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref))


def test_rms_norm_matches_numpy(stream, rng):
    R, D = 3, 2048
    x = rng.standard_normal((R, D)).astype(np.float32) * 3 + 1
    w = rng.standard_normal(D).astype(np.float32)
    out = dop.empty((R, D))
    rms_norm(out.partition([1, D]), dop.from_numpy(x), dop.from_numpy(w), 1e-5).generics([D, 256]).sync_on(stream)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    assert rel_err(out.numpy(), ref) < 1e-5


def test_matvec_matches_numpy(stream, rng):
    N, K = 2048, 2048
    x = rng.standard_normal((1, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    out = dop.empty(N)
    matvec(out.partition([16]), dop.from_numpy(x), dop.from_numpy(w)).generics([16, 16, K]).sync_on(stream)
    ref = w.astype(np.float64) @ x[0].astype(np.float64)
    assert rel_err(out.numpy(), ref) < 1e-5


def test_add_matches_numpy(stream, rng):
    a, b = rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32)
    out = dop.empty(4096)
    add(out.partition([128]), dop.from_numpy(a), dop.from_numpy(b)).generics([128]).sync_on(stream)
    ref = a.astype(np.float64) + b
    assert rel_err(out.numpy(), ref) < 1e-6


def test_handles_are_counted_per_buffer_not_per_wrapper():
    t = dop.empty(256)
    a, b = t.into_shared(), t.view(2, 128).into_shared()  # two handles to one buffer
    with pytest.raises(dop.OwnershipError):
        a.try_partition([128])
    b.release()
    assert a.try_partition([128]).grid == (2,)


def test_walking_a_deep_dag_of_shared_clones_is_linear():
    """Each shared op feeds the next twice: 2^60 paths, 60 nodes (graph-safety walks it once per node)."""
    x = dop.value(1).shared()
    for _ in range(60):
        x = zip_(x.clone(), x.clone()).map(sum).shared()
    assert x.unsafe_for_graphs() is None


def test_a_shared_op_that_needs_its_own_result_is_an_error(stream):
    holder = []
    me = dop.value(1).then(lambda _: holder[0].clone()).shared()
    holder.append(me)
    with pytest.raises(dop.StateError, match="depends on its own result"):
        me.sync_on(stream)


def clones_on_two_threads(op, running, go, device) -> dict:
    """Execute a clone of ``op`` on a first thread; once its run is under way
    (``running`` set), a clone on a second thread, which must then be waiting;
    then let the run finish (``go``).  Returns each thread's value or exception."""
    results = {}

    def execute(name):
        try:
            results[name] = op.clone().sync_on(device.new_stream())
        except Exception as exc:  # noqa: BLE001 - returned to the test
            results[name] = exc

    first, second = (threading.Thread(target=execute, args=(name,)) for name in ("first", "second"))
    first.start()
    try:
        assert running.wait(60)
        second.start()
        second.join(0.2)
        assert second.is_alive()  # waiting for the first thread's run
    finally:
        go.set()
        for t in (first, second):
            if t.ident is not None:  # started
                t.join(60)
    return results


def test_concurrent_clones_of_a_shared_op_run_it_once(device):
    """A thread reaching a shared op that another thread is running waits for that
    run's result; it neither runs the op again nor mistakes the wait for a cycle."""
    running, go, runs = threading.Event(), threading.Event(), []

    def slow(v):
        runs.append(threading.get_ident())
        running.set()
        assert go.wait(60)
        return v + 1

    op = dop.value(1).map(slow).shared()
    assert clones_on_two_threads(op, running, go, device) == {"first": 2, "second": 2} and len(runs) == 1
    assert op.sync_on(device.new_stream()) == 2 and len(runs) == 1


def test_a_shared_op_whose_run_failed_gives_its_clones_no_result(device):
    """The run's exception reaches the execution that ran it; a clone waiting on
    another thread is woken and refused, and so is a clone executed later: an op
    describes one execution, so the failed one is not retried behind the caller's back."""
    running, go = threading.Event(), threading.Event()

    def fail(_):
        running.set()
        assert go.wait(60)
        raise ValueError("boom")

    op = dop.value(1).map(fail).shared()
    results = clones_on_two_threads(op, running, go, device)
    assert isinstance(results["first"], ValueError)
    assert isinstance(results["second"], dop.StateError) and "failed when it ran" in str(results["second"])
    with pytest.raises(dop.StateError, match="failed when it ran.*build the op again"):
        op.sync_on(device.new_stream())


def test_a_handle_released_after_the_launch_was_built_is_refused_when_it_runs(stream):
    """The launch-check cache does not bypass the handle's liveness: an identical launch
    checked before does not make a released handle readable."""
    out, a, w = dop.empty(256), dop.empty(256), dop.empty(256).into_shared()
    add(out.partition([128]), a, w).generics([128]).sync_on(stream)  # checked, and the verdict cached
    op = add(out.partition([128]), a, w).generics([128])
    w.release()
    with pytest.raises(dop.StateError, match="released"):
        op.sync_on(stream)


def test_launch_checks_are_cached_by_layout_not_by_tensor_object(stream, rng):
    """A new Tensor object over the same memory, shape, strides and dtype is the same
    launch to the check cache; another shape is not."""
    calls = []
    k = dop.Kernel("add_layouts", add.source, add.params, generics=["B"], block=lambda g: g["B"] // 4,
                   reference=add.reference, validate=lambda *a: calls.append(1), entry="add")
    a = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    out = dop.empty(256)
    assert a[:] is not a and a[:]._sig_id == a._sig_id and a.view([2, 128])._sig_id != a._sig_id
    k(out.partition([128]), a, a).generics([128]).sync_on(stream)
    k(out.partition([128]), a[:], a[:]).generics([128]).sync_on(stream)
    assert len(calls) == 1
    np.testing.assert_allclose(out.numpy(), 2 * a.numpy(), rtol=1e-6)
    from deviceop.tensor import _sig_ids
    _sig_ids.clear()  # what the bounded table does when full: a layout made again gets a new id
    b = a[:]
    assert b._sig_id != a._sig_id
    k(out.partition([128]), b, b).generics([128]).sync_on(stream)
    assert len(calls) == 2  # checked once more, not trusted on a stale id


def test_checks_of_a_repeated_launch_run_once(stream, rng):
    """Per-token rebuilds of one model pay the launch checks once per argument set: the
    verdict is cached by device, generics, tiles, each tensor's pointer, shape, strides and
    dtype, and each scalar's type and value (a kernel's rules may read its scalars)."""
    calls = []
    k = dop.Kernel("affine_counted", affine.source, affine.params, generics=["B"], block=lambda g: g["B"] // 4,
                   reference=affine.reference, validate=lambda g, out, x, alpha, beta: calls.append((alpha, beta)),
                   entry="affine")
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    out = dop.empty(256)
    for _ in range(3):
        k(out.partition([128]), x, 2.0, 1.0).generics([128]).sync_on(stream)
    assert calls == [(2.0, 1.0)]
    other = dop.from_numpy(rng.standard_normal(256).astype(np.float32))  # (not dop.empty: its garbage may overflow)
    k(out.partition([128]), other, 2.0, 1.0).generics([128]).sync_on(stream)  # a new tensor: checked again
    assert len(calls) == 2
    for alpha in (3.0, 2.0, 3.0, -0.0, 0.0, -0.0):  # a new scalar, or the sign of a zero: checked again
        k(out.partition([128]), x, alpha, 1.0).generics([128]).sync_on(stream)
    assert calls[2:] == [(3.0, 1.0), (-0.0, 1.0), (0.0, 1.0)]
    assert [str(a) for a, _ in calls[3:]] == ["-0.0", "0.0"]


def test_a_kernel_that_overflows_gives_inf_without_a_numpy_warning_as_on_the_gpu(stream, rng):
    # the reference device ran kernels' NumPy references with NumPy's warnings on: an overflow (or a
    # garbage input of dop.empty) printed a RuntimeWarning the GPU never gives
    import warnings
    big = np.full(256, 3e38, np.float32) * rng.choice([1, -1], 256).astype(np.float32)
    x, out = dop.from_numpy(big, stream=stream), dop.empty(256, stream=stream)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        add(out.partition([128]), x, x).generics([128]).sync_on(stream)
    np.testing.assert_array_equal(out.numpy(stream=stream), np.sign(big) * np.inf)
