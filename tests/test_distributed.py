"""deviceop.distributed on the reference backend: thread-ranks computing the
collectives with NumPy, checked against NumPy float64 references on random
data; the refusals (dtype, size, aliasing, ownership) and the faults (a rank
that raises, hangs, skips a collective or disagrees) each fail every rank
within the group's timeout, naming the cause."""
import time

import numpy as np
import pytest

import deviceop as dop
import deviceop.distributed as dist
from deviceop import CudaGraph, api
from deviceop.kernel import Kernel, Out


def _upload(group, array):
    return dop.from_numpy(array, stream=group.stream)


def test_all_reduce_all_gather_broadcast_eagerly_compute_what_numpy_does(rng):
    world, n = 3, 12
    data = rng.standard_normal((world, n)).astype(np.float32)
    ints = rng.integers(-1000, 1000, (world, n)).astype(np.int32)
    root = int(rng.integers(world))

    def rank(group):
        s = group.stream
        x = _upload(group, data[group.rank])
        summed = dist.all_reduce(group, x, dop.empty(n, stream=s)).sync_on(s)
        gathered = dist.all_gather(group, x, dop.empty((world * n,), stream=s)).sync_on(s)
        peak = dist.all_reduce(group, _upload(group, ints[group.rank]), op="max").sync_on(s)  # in place
        b = dist.broadcast(group, _upload(group, data[group.rank]), root=root).sync_on(s)
        return [t.numpy(stream=s) for t in (x, summed, gathered, peak, b)]

    for r, (x, summed, gathered, peak, b) in enumerate(dist.run_reference(world, rank)):
        assert np.array_equal(x, data[r])  # out of place: the input is untouched
        np.testing.assert_allclose(summed, data.astype(np.float64).sum(0), rtol=1e-6, atol=1e-6)
        assert np.array_equal(gathered, data.reshape(-1))
        assert np.array_equal(peak, ints.max(0))
        assert np.array_equal(b, data[root])


def test_reduce_scatter_send_recv_and_every_reduction(rng):
    world, n = 2, 8
    data = rng.uniform(0.5, 2.0, (world, world * n))

    def rank(group):
        s, x = group.stream, _upload(group, data[group.rank])
        out = {op: dist.reduce_scatter(group, x, dop.empty(n, "float64", stream=s), op=op).sync_on(s).numpy(stream=s)
               for op in ("sum", "prod", "max", "min", "avg")}
        if group.rank == 0:
            dist.send(group, x, peer=1).sync_on(s)
            return out, None
        got = dist.recv(group, dop.empty(world * n, "float64", stream=s), peer=0).sync_on(s)
        return out, got.numpy(stream=s)

    results = dist.run_reference(world, rank)
    want = {"sum": data.sum(0), "prod": data.prod(0), "max": data.max(0), "min": data.min(0), "avg": data.mean(0)}
    for r, (out, _) in enumerate(results):
        for op, total in want.items():
            np.testing.assert_allclose(out[op], total[r * n:(r + 1) * n], rtol=1e-12)
    assert np.array_equal(results[1][1], data[0])



def test_a_ring_that_sends_before_it_receives_completes_with_what_each_send_held_when_it_ran(rng):
    world, n = 3, 6
    data = rng.standard_normal((world, n)).astype(np.float32)

    def rank(group):  # legal on NCCL for small messages (it buffers them); the reference backend hung here
        s, r = group.stream, group.rank
        x = _upload(group, data[r])
        dist.send(group, x, peer=(r + 1) % world).sync_on(s)
        dist.all_reduce(group, x).sync_on(s)  # overwrites what was sent, before anyone receives it
        got = dist.recv(group, dop.empty(n, stream=s), peer=(r - 1) % world).sync_on(s)
        return got.numpy(stream=s), x.numpy(stream=s)

    start = time.monotonic()
    for r, (got, x) in enumerate(dist.run_reference(world, rank, timeout=1.0)):
        assert np.array_equal(got, data[(r - 1) % world])  # the message was copied when the send ran
        np.testing.assert_allclose(x, data.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
    assert time.monotonic() - start < 1.0


def test_a_recv_still_waits_bounded_naming_its_peer_and_checks_dtype_and_count(rng):
    data = rng.standard_normal(4).astype(np.float32)

    def hangs(group):  # rank 0 never sends (it is busy elsewhere): rank 1's recv times out naming it
        if group.rank == 1:
            dist.recv(group, dop.empty(4, stream=group.stream), peer=0).sync_on(group.stream)
        else:
            time.sleep(0.5)

    with pytest.raises(dop.DistributedError, match=r"dist.recv\(4 x float32, peer=0\) timed out after 0.3 s on "
                                                   r"rank 1: rank 0 never sent it"):
        dist.run_reference(2, hangs, timeout=0.3)

    def leaves(group):
        if group.rank == 1:
            dist.recv(group, dop.empty(4, stream=group.stream), peer=0).sync_on(group.stream)

    start = time.monotonic()
    with pytest.raises(dop.DistributedError, match="rank 0 closed its group without sending it"):
        dist.run_reference(2, leaves, timeout=30)
    assert time.monotonic() - start < 2  # at once, not after the timeout

    def disagree(group):  # the sender goes on; the receiver refuses, and the sender learns at its next meeting
        s = group.stream
        if group.rank == 0:
            dist.send(group, _upload(group, data), peer=1).sync_on(s)
            with pytest.raises(dop.DistributedError, match="which expected 4 x float64"):
                group.barrier()
        else:
            dist.recv(group, dop.empty(4, "float64", stream=s), peer=0).sync_on(s)

    with pytest.raises(dop.DistributedError, match=r"rank 0 sent 4 x float32 to rank 1, which expected 4 x float64: "
                                                   "a send and its recv must match in dtype and count"):
        dist.run_reference(2, disagree, timeout=30)


def test_a_send_that_no_recv_takes_is_an_error_not_a_lost_message(rng):
    data = rng.standard_normal(4).astype(np.float32)

    def extra(group):  # rank 0 sends twice, rank 1 receives once: run_reference returned as if all was well
        s = group.stream
        if group.rank == 0:
            for _ in range(2):
                dist.send(group, _upload(group, data), peer=1).sync_on(s)
            group.barrier()
            return None
        got = dist.recv(group, dop.empty(4, stream=s), peer=0).sync_on(s).numpy(stream=s)
        group.barrier()
        return got

    with pytest.raises(dop.DistributedError, match=r"rank 0's send #1 to rank 1 \(4 x float32\) was never received: "
                                                   "the ranks' sends and receives do not pair up"):
        dist.run_reference(2, extra, timeout=30)

    def late(group):  # rank 1 is gone before rank 0 sends: the send fails at once, naming it
        if group.rank == 0:
            deadline = time.monotonic() + 5
            while 1 not in group._exchanger.hub.closed and time.monotonic() < deadline:  # (the hub's record)
                time.sleep(0.001)
            dist.send(group, _upload(group, data), peer=1).sync_on(group.stream)

    start = time.monotonic()
    with pytest.raises(dop.DistributedError, match="rank 1 already closed its group, so nothing will receive this send"):
        dist.run_reference(2, late, timeout=30)
    assert time.monotonic() - start < 2


def test_exchange_and_barrier_meet_every_rank_in_rank_order(rng):
    tokens = rng.integers(0, 1 << 30, 4).tolist()
    results = dist.run_reference(4, lambda g: (g.barrier(), g.exchange({"rank": g.rank, "t": tokens[g.rank]}))[1])
    assert all(r == [{"rank": i, "t": t} for i, t in enumerate(tokens)] for r in results)


def test_a_one_rank_group_without_a_gpu_is_the_reference_backend(rng, device):
    if not device.is_reference:
        pytest.skip("on a GPU machine a group is NCCL's (tests/test_distributed_gpu.py's one-rank group)")
    data = rng.standard_normal(16).astype(np.float32)
    with dist.init(rank=0, world_size=1) as group:
        assert (group.rank, group.world_size, group.backend) == (0, 1, "reference")
        x = dop.from_numpy(data, stream=group.stream)
        assert np.array_equal(dist.all_reduce(group, x).sync_on(group.stream).numpy(stream=group.stream), data)
    with pytest.raises(dop.DistributedError, match="run_reference"):
        dist.init(rank=0, world_size=2)


# -- refusals: what a GPU would refuse, refused alike -------------------------------------------

def test_collectives_refuse_wrong_dtypes_sizes_aliases_and_shared_outputs():
    def rank(group):
        s = group.stream
        x = dop.zeros(8, stream=s)
        with pytest.raises(dop.DTypeError, match="dtypes must match"):
            dist.all_reduce(group, x, dop.empty(8, "float16", stream=s))
        with pytest.raises(dop.ShapeError, match="world_size .2. x the input's: 16"):
            dist.all_gather(group, x, dop.empty(8, stream=s))
        with pytest.raises(dop.ShapeError, match="multiple of the world size"):
            dist.reduce_scatter(group, dop.empty(7, stream=s), dop.empty(3, stream=s))
        with pytest.raises(dop.AliasingError, match="overlaps the input"):
            dist.all_gather(group, x[:4], x)
        with pytest.raises(dop.DTypeError, match="bool"):
            dist.all_reduce(group, dop.empty(8, "bool", stream=s))
        with pytest.raises(dop.DTypeError, match="average needs a floating-point"):
            dist.all_reduce(group, dop.empty(8, "int32", stream=s), op="avg")
        with pytest.raises(dop.ShapeError, match="contiguous"):
            dist.all_reduce(group, dop.empty((4, 4), stream=s)[:, :2])
        with pytest.raises(dop.DistributedError, match="root=5 is not a rank"):
            dist.broadcast(group, x, root=5)
        with pytest.raises(dop.DistributedError, match="unknown reduction"):
            dist.all_reduce(group, x, op="mean")
        with pytest.raises(dop.DTypeError, match="from_numpy"):
            dist.all_reduce(group, np.zeros(8, np.float32))
        handle = x.into_shared()
        other = handle.clone()
        with pytest.raises(dop.OwnershipError, match="1 other live SharedTensor"):
            dist.all_reduce(group, handle)  # in place: the buffer is written, and another handle reaches it
        other.release()
        with pytest.warns(dop.UnexecutedOpWarning, match="dist.all_reduce.*never executed"):
            dist.all_reduce(group, x)  # built and dropped: its work would silently never run
        return dist.all_reduce(group, handle).sync_on(s) is x
    assert dist.run_reference(2, rank) == [True, True]


# -- faults: no rank waits forever -----------------------------------------------------------

def test_a_rank_that_raises_makes_the_others_fail_at_once():
    def rank(group):
        x = dop.empty(4, stream=group.stream)
        if group.rank == 1:
            raise ValueError("rank 1 could not load its weights")
        dist.all_reduce(group, x).sync_on(group.stream)

    start = time.monotonic()
    with pytest.raises(ValueError, match="could not load") as info:
        dist.run_reference(3, rank, timeout=30)
    assert time.monotonic() - start < 5  # the others did not wait for the timeout
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "rank 0: DistributedError" in notes and "rank 1 failed: ValueError" in notes


def test_a_collective_issued_by_only_some_ranks_fails_naming_it():
    def rank(group):
        if group.rank == 0:
            dist.all_reduce(group, dop.empty(4, stream=group.stream)).sync_on(group.stream)
        else:
            time.sleep(5)  # hangs (or does something else) instead

    start = time.monotonic()
    with pytest.raises(dop.DistributedError, match=r"dist.all_reduce\(4 x float32, sum\).*timed out after 0.3 s.*"
                                                   r"rank\(s\) \[1\] never issued it"):
        dist.run_reference(2, rank, timeout=0.3)
    assert time.monotonic() - start < 4


def test_a_rank_that_returns_early_fails_the_collective_it_skipped_at_once():
    def rank(group):
        if group.rank == 0:
            dist.broadcast(group, dop.empty(4, stream=group.stream)).sync_on(group.stream)

    with pytest.raises(dop.DistributedError, match=r"rank\(s\) \[1\] closed their group without issuing it"):
        dist.run_reference(2, rank, timeout=30)


def test_ranks_that_issue_different_collectives_are_refused_naming_both():
    def rank(group):
        n = 4 if group.rank == 0 else 6
        dist.all_reduce(group, dop.empty(n, stream=group.stream)).sync_on(group.stream)

    with pytest.raises(dop.DistributedError, match=r"collective #0: ranks issued different collectives: rank\(s\) \[0\]: "
                                                   r"\{'kind': 'all_reduce', 'dtype': 'float32', 'count': 4.*rank\(s\) \[1\].*'count': 6"):
        dist.run_reference(2, rank)


def test_check_same_refuses_ranks_whose_configs_or_weights_differ(rng):
    weights = rng.standard_normal(32).astype(np.float32)

    def rank(group):
        group.check_same("config", {"layers": 16, "d": 2048})
        group.check_same("weights", weights)
        mine = weights.copy()
        mine[7] += group.rank  # rank 1's copy differs in one element
        group.check_same("weights", dop.from_numpy(mine, stream=group.stream))

    with pytest.raises(dop.DistributedError, match=r"check_same: ranks disagree on 'weights': rank\(s\) \[1\]"):
        dist.run_reference(2, rank)


# -- collectives inside graphs: replays compute what eager execution computes ----------------------

def _countdown_ref(g, c):
    c[0] -= 1


countdown = Kernel("dist_countdown", 'extern "C" __global__ void dist_countdown(int* c) { c[0] -= 1; }',
                   [Out("c", "int32", rank=1)], block=1, reference=_countdown_ref)


def _set(group, t, array):
    """New contents for ``t`` before a replay (the graph reads the buffer, not the values of the capture)."""
    api.memcpy(t, dop.from_numpy(array, stream=group.stream)).sync_on(group.stream)


def test_graph_on_scope_and_recapture_replay_what_eager_computes(rng):
    world, n, replays = 3, 10, 3
    data = rng.standard_normal((replays + 1, world, n))

    def rank(group):
        s, r = group.stream, group.rank
        x, out, gathered = (dop.empty(size, "float64", stream=s) for size in (n, n, world * n))
        graph = dist.all_reduce(group, x, out).graph_on(s)  # captured: nothing is reduced yet
        scoped = CudaGraph.scope(s, lambda sc: sc.record(dist.all_gather(group, x, gathered)))
        assert [node["type"] for node in scoped.nodes()] == ["KERNEL"]
        seen = []
        for k in range(replays):
            _set(group, x, data[k, r])
            graph.replay()
            scoped.replay()
            group.synchronize()  # bounded: a replay stuck on a peer would abort the group instead
            seen.append((out.numpy(stream=s), gathered.numpy(stream=s)))
        out2 = dop.empty(n, "float64", stream=s)
        assert graph.recapture(dist.all_reduce(group, x, out2, op="max")) == "updated"
        _set(group, x, data[replays, r])
        graph.replay()
        return seen, out2.numpy(stream=s)

    for seen, maxed in dist.run_reference(world, rank):
        for k, (summed, gathered) in enumerate(seen):
            np.testing.assert_allclose(summed, data[k].sum(0), rtol=1e-12)
            assert np.array_equal(gathered, data[k].reshape(-1))
        assert np.array_equal(maxed, data[replays].max(0))


def test_collectives_inside_loop_and_while_bodies_run_at_every_iteration(rng):
    world, n, steps = 2, 6, 3
    data = rng.standard_normal((world, n))

    def rank(group):
        s, r = group.stream, group.rank
        results = []
        for captured in (False, True):
            x = dop.from_numpy(data[r], stream=s)
            index = dop.from_numpy(np.zeros(1, np.int32), stream=s)
            op = dop.loop(steps, index, lambda i: dist.all_reduce(group, x))  # x <- sum over ranks, each time
            if captured:
                op.graph_on(s).replay()
            else:
                op.sync_on(s)
            cond = dop.from_numpy(np.array([steps], np.int32), stream=s)
            y = dop.from_numpy(data[r], stream=s)
            op = dop.while_(cond, lambda: dop.zip_(dist.all_reduce(group, y, op="max"),
                                                   countdown(cond.partition([1]))))
            if captured:
                op.graph_on(s).replay()
            else:
                op.sync_on(s)
            results.append((x.numpy(stream=s), y.numpy(stream=s), int(cond.numpy(stream=s)[0])))
        return results

    for eager, captured in dist.run_reference(world, rank):
        for x, y, cond in (eager, captured):
            np.testing.assert_allclose(x, data.sum(0) * world ** (steps - 1), rtol=1e-12)
            assert np.array_equal(y, data.max(0)) and cond == 0


def test_a_failed_capture_leaves_the_collective_unexecuted_and_the_stream_usable(rng):
    data = rng.standard_normal((2, 4))

    def rank(group):
        s = group.stream
        x = dop.from_numpy(data[group.rank], stream=s)
        op = dist.all_reduce(group, x)

        def fails(_):
            raise RuntimeError("a host callback failed during the capture")
        with pytest.raises(RuntimeError, match="callback failed"):
            op.map(fails).graph_on(s)
        assert not s.is_capturing()
        return op.sync_on(s).numpy(stream=s)  # not marked executed: it runs (once) now

    for out in dist.run_reference(2, rank):
        np.testing.assert_allclose(out, data.sum(0), rtol=1e-12)


def test_a_collective_runs_only_on_its_group_s_device():
    def rank(group):
        x = dop.empty(4, stream=group.stream)
        with pytest.raises(dop.DistributedError, match="group's device is reference .rank"):
            dist.all_reduce(group, x).sync_on(dop.Device(0).new_stream())
        return True
    assert dist.run_reference(1, rank) == [True]
