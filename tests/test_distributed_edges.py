"""deviceop.distributed used as a demanding user would, on the reference
backend: arguments NumPy and torch users pass (numpy integers, None, a
Partition), memory a collective must not write (a read-only import), groups
used after close or abort, from two threads, or replayed after close, and
check_same / exchange with what pickle does and does not serialize.  Each
test failed before the fix it documents."""
import threading
import time

import numpy as np
import pytest

import deviceop as dop
import deviceop.distributed as dist


def _up(group, array):
    return dop.from_numpy(array, stream=group.stream)


# -- arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda g, x: dist.all_reduce(g, x, op=None),
    lambda g, x: dist.all_reduce(g, x, op=3),
    lambda g, x: dist.reduce_scatter(g, x, dop.empty(x.size // g.world_size, stream=g.stream), op=None),
])
def test_a_reduction_that_is_not_one_of_the_five_names_is_refused(make):
    def rank(group):  # op=None computed the min on the reference backend and raised KeyError on NCCL
        with pytest.raises(dop.DistributedError, match="unknown reduction .*use one of sum, prod, max, min, avg"):
            make(group, dop.zeros(4, stream=group.stream))
        return True
    assert dist.run_reference(2, rank) == [True, True]


def test_roots_and_peers_are_any_integer_and_never_none_or_a_bool(rng):
    data = rng.standard_normal((2, 4)).astype(np.float32)

    def rank(group):
        s, x = group.stream, _up(group, data[group.rank])
        got = dist.broadcast(group, x, root=np.int64(1)).sync_on(s).numpy(stream=s)  # a NumPy integer is a rank
        for bad in (None, True, 1.0, "1"):
            with pytest.raises(dop.DistributedError, match=f"root={bad!r} is not a rank of this group"):
                dist.broadcast(group, x, root=bad)
            with pytest.raises(dop.DistributedError, match=f"peer={bad!r} is not a rank of this group"):
                dist.send(group, x, peer=bad)
        return got

    assert all(np.array_equal(r, data[1]) for r in dist.run_reference(2, rank))


def test_a_missing_output_says_to_allocate_one():
    def rank(group):
        with pytest.raises(dop.DTypeError, match="needs an output tensor.*allocate it"):
            dist.all_gather(group, dop.zeros(4, stream=group.stream), None)
        return True
    assert dist.run_reference(2, rank) == [True, True]


def test_a_partition_is_the_tensor_it_cuts(rng):
    data = rng.standard_normal((2, 8)).astype(np.float32)

    def rank(group):  # what a kernel launch's .first() gives, or handle.try_partition: a claim to write
        s = group.stream
        out = dop.empty(8, stream=s).into_shared().try_partition([4])
        return dist.all_reduce(group, _up(group, data[group.rank]), out).sync_on(s).numpy(stream=s)

    for r in dist.run_reference(2, rank):
        np.testing.assert_allclose(r, data.astype(np.float64).sum(0), rtol=1e-6)


def test_the_same_buffer_in_another_shape_reduces_in_place(rng):
    data = rng.standard_normal((2, 8)).astype(np.float32)

    def rank(group):  # NCCL's in place is sendbuff == recvbuff: the shapes need not match
        x = _up(group, data[group.rank])
        return dist.all_reduce(group, x, x.view([2, 4])).sync_on(group.stream).numpy(stream=group.stream)

    for r in dist.run_reference(2, rank):
        np.testing.assert_allclose(r.reshape(-1), data.astype(np.float64).sum(0), rtol=1e-6)


def test_a_read_only_import_is_never_written(rng):
    class Foreign:  # another framework's read-only array, imported without a copy
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    data = rng.standard_normal((2, 4)).astype(np.float32)

    def rank(group):
        frozen = data[group.rank].copy()
        frozen.flags.writeable = False
        x = dop.from_dlpack(Foreign(frozen), stream=group.stream)
        with pytest.raises(dop.OwnershipError, match="read-only"):
            dist.all_reduce(group, x)  # (raised a raw ValueError from NumPy, after writing the other rank)
        out = dop.empty(4, stream=group.stream)
        return dist.all_reduce(group, x, out).sync_on(group.stream).numpy(stream=group.stream)  # reading is fine

    for r in dist.run_reference(2, rank):
        np.testing.assert_allclose(r, data.astype(np.float64).sum(0), rtol=1e-6)


def test_a_root_only_reads_its_broadcast_buffer(rng):
    data = rng.standard_normal((2, 4)).astype(np.float32)

    def rank(group):
        handle = _up(group, data[group.rank]).into_shared()
        model = handle.clone()  # the root's weights are shared with its model: a broadcast only reads them
        if group.rank == 1:
            with pytest.raises(dop.OwnershipError, match="1 other live SharedTensor"):
                dist.broadcast(group, handle, root=0)
            model.release()
        got = dist.broadcast(group, handle, root=0).sync_on(group.stream)
        return got.numpy(stream=group.stream)

    assert all(np.array_equal(r, data[0]) for r in dist.run_reference(2, rank))
