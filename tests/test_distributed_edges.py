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
from deviceop.testing import ForeignArray  # another framework's array, imported without a copy


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


def test_the_group_comes_first_and_a_torch_order_is_refused_by_name():
    def rank(group):
        x = dop.zeros(4, stream=group.stream)
        for call in (lambda: dist.all_reduce(x, group), lambda: dist.broadcast(None, x),
                     lambda: dist.all_gather(x, group, dop.empty(8, stream=group.stream)),
                     lambda: dist.all_reduce([group], x)):  # (raw AttributeError / TypeError before)
            with pytest.raises(dop.DistributedError, match=r"takes the group first: dist\.\w+\(group, ...\)"):
                call()
        return True
    assert dist.run_reference(2, rank) == [True, True]


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
    data = rng.standard_normal((2, 4)).astype(np.float32)

    def rank(group):
        frozen = data[group.rank].copy()
        frozen.flags.writeable = False
        x = dop.from_dlpack(ForeignArray(frozen), stream=group.stream)
        with pytest.raises(dop.OwnershipError, match="read-only"):
            dist.all_reduce(group, x)  # (raised a raw ValueError from NumPy, after writing the other rank)
        out = dop.empty(4, stream=group.stream)
        return dist.all_reduce(group, x, out).sync_on(group.stream).numpy(stream=group.stream)  # reading is fine

    for r in dist.run_reference(2, rank):
        np.testing.assert_allclose(r, data.astype(np.float64).sum(0), rtol=1e-6)

    def root(group):  # a read-only root broadcasts (it only reads): the reference wrote it, a raw ValueError
        frozen = data[group.rank].copy()
        frozen.flags.writeable = False
        x = dop.from_dlpack(ForeignArray(frozen), stream=group.stream)
        if group.rank == 1:  # a receiver's buffer is written: refused read-only
            with pytest.raises(dop.OwnershipError, match="read-only"):
                dist.broadcast(group, x, root=0)
            x = _up(group, data[1])
        return dist.broadcast(group, x, root=0).sync_on(group.stream).numpy(stream=group.stream)

    assert all(np.array_equal(r, data[0]) for r in dist.run_reference(2, root))


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


# -- a group after close or abort ------------------------------------------------------------

def test_a_closed_or_aborted_group_refuses_everything_with_a_state_error():
    def rank(group):
        s, x = group.stream, dop.zeros(4, stream=group.stream)
        built = dist.all_reduce(group, x)
        if group.rank == 0:
            group.close()
            group.close()  # idempotent
        else:
            with pytest.raises(dop.DistributedError, match=r"rank\(s\) \[0\] closed their group"):
                dist.all_gather(group, x, dop.empty(8, stream=s)).sync_on(s)  # the first error: the cause
        with pytest.raises(dop.StateError, match="on a group that was (closed|aborted).*make a new group") as info:
            built.sync_on(s)  # then the group is unusable, and says so at once
        assert isinstance(info.value, dop.DistributedError)
        for use in (group.barrier, lambda: group.exchange(1), lambda: group.check_same("c", 1),
                    lambda: dist.broadcast(group, x), lambda: group.synchronize()):
            with pytest.raises(dop.StateError, match="make a new group"):
                use()
        return True
    assert dist.run_reference(2, rank, timeout=5) == [True, True]


def test_a_graph_holding_a_collective_refuses_to_replay_once_its_group_is_closed(rng):
    data = rng.standard_normal((2, 4))

    def rank(group):
        s, x = group.stream, _up(group, data[group.rank])
        graph = dist.all_reduce(group, x).graph_on(s)
        graph.replay()
        group.synchronize()
        group.close()  # on a GPU the communicator is destroyed: a replay would run NCCL's kernels on freed state
        with pytest.raises(dop.StateError, match="graph holds collectives of rank .'s group, which was closed"):
            graph.replay()
        with pytest.raises(dop.StateError, match="graph holds collectives"):  # refused before its input is copied
            dop.GraphModel(graph, x, x).forward(_up(group, 2 * data[group.rank]))
        return x.numpy(stream=s)

    for r in dist.run_reference(2, rank):
        np.testing.assert_allclose(r, data.sum(0), rtol=1e-12)  # one replay's sum, not two


def test_a_group_used_from_two_threads_at_once_is_refused_not_mixed_up():
    def rank(group):
        s, errors = group.stream, []
        if group.rank == 0:  # rank 0's main thread waits in an exchange while another of its threads tries one
            inside, done = threading.Event(), threading.Event()
            original = group._exchanger.exchange

            def slow(*a):
                inside.set()
                done.wait(5)
                return original(*a)
            group._exchanger.exchange = slow

            def other_thread():
                inside.wait(5)
                try:
                    group.exchange("from another thread")
                except dop.DistributedError as exc:
                    errors.append(str(exc))
                done.set()
            t = threading.Thread(target=other_thread)
            t.start()
        got = group.exchange(group.rank)
        # one thread after another is fine (a worker thread that owns the model)
        worker = threading.Thread(target=lambda: dist.all_reduce(group, dop.zeros(2, stream=s)).sync_on(s))
        worker.start()
        worker.join(5)
        return got, errors, group.exchange("after")

    (got0, errors0, after0), (got1, errors1, after1) = dist.run_reference(2, rank, timeout=5)
    assert got0 == got1 == [0, 1] and after0 == after1 == ["after", "after"]
    assert len(errors0) == 1 and "used from two threads at once" in errors0[0] and errors1 == []


# -- host exchanges and check_same -------------------------------------------------------------

def test_exchange_gives_each_rank_its_own_copy_and_refuses_what_pickle_cannot_send():
    def rank(group):
        got = group.exchange({"rank": group.rank, "seen": []})
        got[0]["seen"].append(group.rank)  # a process gets its own copy; so does a thread-rank
        group.barrier()
        mine = got[0]["seen"]
        with pytest.raises(dop.DistributedError, match=r"rank\(s\) \[1\] passed .*pickle"):
            group.exchange((lambda: 0) if group.rank == 1 else 0)  # every rank fails, none waits
        return mine, group.exchange("still usable")

    for r, (seen, after) in enumerate(dist.run_reference(2, rank, timeout=5)):
        assert seen == [r] and after == ["still usable"] * 2


def test_check_same_compares_values_not_their_spelling(rng):
    weights = rng.standard_normal(16).astype(np.float32)

    def rank(group):
        order = ["a", "b", "c"] if group.rank == 0 else ["c", "a", "b"]
        config = {k: ord(k) for k in order}  # equal dicts, made in another order
        group.check_same("config", {"keys": config, "tags": set(order), "eps": 1e-5})
        state = {"w": _up(group, weights), "b": np.arange(3, dtype=np.int32), "names": ("q", "k")}
        digest = group.check_same("state dict", state)  # tensors inside containers are hashed by value
        objects = np.array([{"x": 1}, "y"], dtype=object)
        group.check_same("objects", objects)
        return digest

    d0, d1 = dist.run_reference(2, rank)
    assert d0 == d1 and len(d0) == 32
    assert dist.fingerprint({"a": 1, "b": 2}) == dist.fingerprint({"b": 2, "a": 1})
    assert dist.fingerprint(np.zeros(2, np.float32)) != dist.fingerprint(np.zeros(2, np.int32))
    assert dist.fingerprint([np.ones(2)]) != dist.fingerprint([np.ones(2), 0])


def test_check_same_fails_on_every_rank_when_one_cannot_hash_its_object():
    def rank(group):
        with pytest.raises(dop.DistributedError, match=r"check_same\('config'\): rank\(s\) \[1\] cannot hash"):
            group.check_same("config", (lambda: 1) if group.rank == 1 else {"layers": 2})
        return True
    start = time.monotonic()
    assert dist.run_reference(2, rank, timeout=5) == [True, True]
    assert time.monotonic() - start < 2  # rank 0 learnt it at the exchange, not from a timeout


def test_group_synchronize_inside_a_capture_says_so_and_leaves_the_group_usable(rng):
    data = rng.standard_normal((2, 4)).astype(np.float32)

    def rank(group):  # the error named an event query on an event the user never recorded
        s = group.stream
        x = _up(group, data[group.rank])

        def body(scope):
            scope.record(dist.all_reduce(group, x))
            group.synchronize()
        with pytest.raises(dop.CaptureError, match=r"group.synchronize\(\) was called while the stream is "
                                                        "capturing a graph"):
            dop.CudaGraph.scope(s, body)
        assert not s.is_capturing()
        return dist.all_reduce(group, x).sync_on(s).numpy(stream=s)  # the captured one never ran

    for got in dist.run_reference(2, rank, timeout=5):
        np.testing.assert_allclose(got, data.astype(np.float64).sum(0), rtol=1e-6)


def test_an_exchange_a_rank_skipped_is_named_by_its_kind():
    def rank(group):  # every kind was named "group.exchange() #n", a barrier or check_same too
        if group.rank == 0:
            with pytest.raises(dop.DistributedError, match=r"group.check_same\(\) #0 on rank 0: rank\(s\) \[1\] "):
                group.check_same("config", {"layers": 2})
        return True
    assert dist.run_reference(2, rank, timeout=5) == [True, True]


def test_check_same_of_a_list_that_contains_itself_fails_on_every_rank_not_with_a_recursion_error():
    def rank(group):  # pickle sends such a list, but hashing its value never ended: a raw RecursionError
        config = {"layers": [2, 3]}
        if group.rank == 1:
            config["layers"].append(config["layers"])
        with pytest.raises(dop.DistributedError, match=r"rank\(s\) \[1\] cannot hash.*contains itself"):
            group.check_same("config", config)
        return True
    start = time.monotonic()
    assert dist.run_reference(2, rank, timeout=5) == [True, True]
    assert time.monotonic() - start < 2  # rank 0 learnt it at the exchange


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), "10", True, 1e10])  # 1e10: a raw OverflowError
def test_timeouts_are_finite_positive_seconds(timeout):
    with pytest.raises(dop.DistributedError, match="timeout is a finite positive number of seconds"):
        dist.run_reference(2, lambda g: None, timeout=timeout)
    with pytest.raises(dop.DistributedError, match="timeout is a finite positive number of seconds"):
        dist.init(rank=0, world_size=1, timeout=timeout)
    if timeout != 0:  # (0: poll once)
        with dist.init(rank=0, world_size=1) as group:
            with pytest.raises(dop.DistributedError, match="timeout is a finite positive number of seconds"):
                group.synchronize(timeout=timeout)


# -- dist.init and the launcher's environment ---------------------------------------------------

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
                "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "DEVICEOP_DIST_TIMEOUT")


@pytest.fixture
def launcher_env(monkeypatch):
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, error", [
    ({"RANK": "1"}, r"RANK=.1. is set but WORLD_SIZE is not"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, r"OMPI_COMM_WORLD_SIZE=.2. is set but OMPI_COMM_WORLD_RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "gpu0"}, r"torchrun's LOCAL_RANK='gpu0' is not an int"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"torchrun's RANK=2 is not a rank of WORLD_SIZE=2"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, r"srun's SLURM_PROCID=0 is not a rank of SLURM_NTASKS=0"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1"}, r"torchrun's LOCAL_RANK=-1 names no GPU"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "3"}, r"LOCAL_RANK=3 names GPU 3, but this process sees"),
])
def test_init_refuses_a_launcher_environment_naming_the_variable(launcher_env, env, error):
    for name, value in env.items():
        launcher_env.setenv(name, value)
    with pytest.raises(dop.DistributedError, match=error):
        dist.init()


def test_init_takes_numpy_integers_and_refuses_other_ranks(launcher_env):
    with dist.init(rank=np.int64(0), world_size=np.int32(1)) as group:
        assert (group.rank, group.world_size) == (0, 1) and type(group.rank) is int
    for rank, size in ((True, 1), ("0", 1), (0, 1.0), (None, 1)):
        with pytest.raises(dop.DistributedError, match="is not a rank of a group|pass both rank= and world_size="):
            dist.init(rank=rank, world_size=size)
    launcher_env.setenv("DEVICEOP_DIST_TIMEOUT", "soon")
    with pytest.raises(dop.ConfigError, match="DEVICEOP_DIST_TIMEOUT='soon'.*finite positive number"):
        dist.init()


@pytest.mark.parametrize("port", ["http", "", "99999", "0", "-5"])
def test_a_master_port_that_is_no_port_is_refused_naming_it(launcher_env, port):
    from deviceop.distributed.store import open_store
    launcher_env.setenv("MASTER_ADDR", "127.0.0.1")
    launcher_env.setenv("MASTER_PORT", port)
    for serve_rank in (0, 1):  # rank 0 would serve on it, the others connect to it
        with pytest.raises(dop.DistributedError, match=f"MASTER_PORT={port!r} is not a TCP port"):
            open_store(None, "srun", serve_rank, 2, 0.5)
    for url in ("tcp://localhost", f"tcp://localhost:{port}", "tcp://:29500"):
        with pytest.raises(dop.DistributedError, match="is not tcp://host:port"):
            open_store(url, "explicit", 1, 2, 0.5)
