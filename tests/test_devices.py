"""Work of one device is never run with another device's stream or tensors.

On a GPU, a kernel given another GPU's pointer faults (the context is lost) or reads the
wrong memory, and a stream of GPU 0 taken by default opens GPU 0 in a process that drives
GPU 1.  Here the two devices are the reference backend's thread-rank devices
(``rank_device``: each rank's device is its own, told apart by identity, as each process's
GPU is), so every refusal runs on CPU; tests/test_two_devices_gpu.py runs the same on two GPUs.
"""
import numpy as np
import pytest

import deviceop as dop
from deviceop import api
from deviceop.distributed.reference import rank_device
from deviceop.kernels import add
from deviceop.tensor import Tensor


@pytest.fixture
def two():
    return rank_device(0), rank_device(1)


def _on(device, host):
    return dop.from_numpy(host, stream=device.new_stream())


def test_a_launch_with_a_tensor_of_another_device_is_refused_naming_both(two, rng):
    gpu0, gpu1 = two
    x = rng.standard_normal(256).astype(np.float32)
    a, b, out = _on(gpu0, x), _on(gpu1, x), _on(gpu0, x)
    with pytest.raises(dop.LaunchError, match=r"launching add: the stream is on reference \(rank 0\), argument b "
                                              r"on reference \(rank 1\); use a stream of the tensor's device"):
        add(out.partition([128]), a, b).sync_on(gpu0.new_stream())
    np.testing.assert_array_equal(out.numpy(), x)  # nothing ran
    add(out.partition([128]), a, a).sync_on(gpu0.new_stream())  # its own device's tensors: launched
    np.testing.assert_array_equal(out.numpy(), 2 * x)


def test_a_launch_key_tells_the_same_address_on_two_devices_apart(two, rng):
    # a plan checked for a tensor of device 0 was found for another at the same address on device 1
    # (addresses are reused across devices once freed): the second launch skipped the device check
    gpu0, gpu1 = two
    x = rng.standard_normal(256).astype(np.float32)
    a = _on(gpu0, x)
    out = _on(gpu0, x)
    twin = Tensor._wrap(a._base, gpu1, a.dtype, external=True)  # a's address, seen on device 1
    stream = gpu0.new_stream()
    add(out.partition([128]), a, a).sync_on(stream)
    with pytest.raises(dop.LaunchError, match=r"argument b on reference \(rank 1\)"):
        add(out.partition([128]), a, twin).sync_on(stream)


def test_a_stream_of_another_device_is_refused_for_a_tensor_of_this_one(two):
    gpu0, gpu1 = two
    with pytest.raises(dop.LaunchError, match=r"dop.empty: the stream is on reference \(rank 0\), the tensor on "
                                              r"reference \(rank 1\)"):
        dop.empty([4], device=gpu1, stream=gpu0.new_stream())


def test_sync_and_graph_without_a_stream_run_on_the_device_of_the_ops_tensors(two, rng):
    # Device(0)'s default stream was taken: on a GPU that opens GPU 0 and launches there with GPU 1's pointers
    _, gpu1 = two
    x = rng.standard_normal(256).astype(np.float32)
    a, b, out = _on(gpu1, x), _on(gpu1, 3 * x), _on(gpu1, x)
    add(out.partition([128]), a, a).sync()
    np.testing.assert_array_equal(out.numpy(), 2 * x)
    graph = add(out.partition([128]), a, b).graph()
    assert graph.stream is gpu1.default_stream()
    graph.replay()
    np.testing.assert_array_equal(out.numpy(), x + 3 * x)
    graph.close()
    api.fill(out, 1.5).sync()
    np.testing.assert_array_equal(out.numpy(), np.full(256, 1.5, np.float32))


def test_await_without_a_stream_runs_on_the_device_of_the_ops_tensors(two, rng):
    import asyncio
    _, gpu1 = two
    x = rng.standard_normal(256).astype(np.float32)
    a, out = _on(gpu1, x), _on(gpu1, x)

    async def main():
        return await add(out.partition([128]), a, a).first().unpartition()
    assert asyncio.run(main()) is out
    assert gpu1.__dict__.get("_default_stream") is not None  # its stream, not Device(0)'s
    np.testing.assert_array_equal(out.numpy(), 2 * x)


def test_sync_without_a_stream_refuses_an_op_on_two_devices_naming_the_fix(two, rng):
    gpu0, gpu1 = two
    x = rng.standard_normal(64).astype(np.float32)
    a, b = _on(gpu0, x), _on(gpu1, x)
    op = api.memcpy(a, b)
    with pytest.raises(dop.LaunchError, match=r"op.sync\(\): api.memcpy uses tensors of reference \(rank 0\) and of "
                                              r"reference \(rank 1\).*op.sync_on\(stream\)"):
        op.sync()
    op.sync_on(gpu0.new_stream())  # a stream chosen: the copy runs
    np.testing.assert_array_equal(a.numpy(), x)


def test_foreign_work_with_a_tensor_of_another_device_is_refused_before_its_body_runs(two, rng):
    gpu0, gpu1 = two
    x = rng.standard_normal(64).astype(np.float32)
    src, dst = _on(gpu1, x), _on(gpu1, x)
    ran = []

    def reference(s, d):
        ran.append(1)
        d[...] = 2 * s
    op = dop.foreign(lambda stream, s, d: None, reads=[src], writes=[dst], reference=reference)
    with pytest.raises(dop.LaunchError, match=r"executing dop.foreign\(<lambda>\): the stream is on reference "
                                              r"\(rank 0\), a tensor of its reads/writes on reference \(rank 1\)"):
        op.sync_on(gpu0.new_stream())
    assert not ran
    dop.foreign(lambda stream, s, d: None, reads=[src], writes=[dst], reference=reference).sync()  # its device's
    np.testing.assert_array_equal(dst.numpy(), 2 * x)


def test_a_graph_launch_runs_on_its_graphs_device_and_refuses_another_devices_stream(two, rng):
    # graph.launch() holds no tensor in its slots: sync() took Device(0)'s stream, and sync_on(a stream of
    # another device) launched the graph there, which graph.replay(stream) refuses
    gpu0, gpu1 = two
    x = rng.standard_normal(256).astype(np.float32)
    a, out = _on(gpu1, x), _on(gpu1, x)
    graph = add(out.partition([128]), a, a).graph_on(gpu1.new_stream())
    with pytest.raises(dop.LaunchError, match=r"executing graph.launch on a stream of reference \(rank 0\): the graph "
                                              r"was captured on reference \(rank 1\)"):
        graph.launch().sync_on(gpu0.new_stream())
    np.testing.assert_array_equal(out.numpy(), x)  # nothing ran
    graph.launch().sync()
    assert gpu1.__dict__.get("_default_stream") is not None  # the graph's device's default stream
    np.testing.assert_array_equal(out.numpy(), 2 * x)
    graph.close()


def test_sync_sees_the_tensors_of_a_shared_op_already_computed(two, rng):
    # a computed shared op has no children: its tensors were not seen, and sync() took Device(0)'s stream
    _, gpu1 = two
    x = rng.standard_normal(256).astype(np.float32)
    a, out = _on(gpu1, x), _on(gpu1, x)
    dop.shared(a).then(lambda t: add(out.partition([128]), t, t)).sync()
    np.testing.assert_array_equal(out.numpy(), 2 * x)


@pytest.mark.parametrize("make", ["loop", "while_", "if_"])
def test_a_loop_or_branch_whose_control_cell_is_another_devices_is_refused(two, rng, make):
    # the control kernel (captured) or the host loop (eager) was given the other device's cell:
    # a captured loop(3, index) ran with no error, an eager one set the index through the wrong stream
    gpu0, gpu1 = two
    x = rng.standard_normal(256).astype(np.float32)
    a, out = _on(gpu0, x), _on(gpu0, x)
    cell = _on(gpu1, np.ones(1, np.int32))

    def body(*_):
        return add(out.partition([128]), a, a)
    build = {"loop": lambda: dop.loop(3, cell, body), "while_": lambda: dop.while_(cell, body),
             "if_": lambda: dop.if_(cell, body)}[make]
    for run in (lambda op: op.sync_on(gpu0.new_stream()), lambda op: op.graph_on(gpu0.new_stream())):
        with pytest.raises(dop.LaunchError, match=r"the stream is on reference \(rank 0\), its count, index or "
                                                  r"condition on reference \(rank 1\)"):
            run(build())
    np.testing.assert_array_equal(out.numpy(), x)  # nothing ran


def test_a_replay_on_another_devices_stream_names_the_graph_not_a_tensor(two, rng):
    # graph.replay(stream) shares the tensors' device check, whose fix said to copy "the tensor"
    gpu0, gpu1 = two
    x = _on(gpu1, rng.standard_normal(256).astype(np.float32))
    y = _on(gpu1, rng.standard_normal(256).astype(np.float32))
    graph = add(y.partition([128]), x, x).graph_on(gpu1.new_stream())
    with pytest.raises(dop.LaunchError, match=r"graph.replay\(stream\): the stream is on reference \(rank 0\), the graph "
                                              r"on reference \(rank 1\); use a stream of the graph's device") as info:
        graph.replay(gpu0.new_stream())
    assert "api.memcpy" not in str(info.value) and "capture the work again" in str(info.value)
    graph.close()


def test_sync_sees_every_tensor_of_a_value_of_pairs(two, rng):
    # a 2-tuple was read as a (name, tensor) pair: dop.value(((a0, a1), (b0, b1))) saw a1 and b1 only
    gpu0, gpu1 = two
    x = rng.standard_normal(64).astype(np.float32)
    on1 = [_on(gpu1, x) for _ in range(3)]
    op = dop.value(((_on(gpu0, x), on1[0]), (on1[1], on1[2])))
    with pytest.raises(dop.LaunchError, match=r"uses tensors of reference \(rank 0\) and of reference \(rank 1\)"):
        op.sync()
    op.discard()
