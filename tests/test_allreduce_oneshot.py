"""The one-shot all-reduce (deviceop/distributed/peer.py, allreduce.cu) on the
reference backend: its NumPy reference runs the kernel's protocol (lines
carrying epochs pushed into the peers' buffers, parity slots, a bounded wait),
so these tests hold the protocol to its promises without a GPU: sums equal to
the rank-ordered fp32 sum bit for bit on every rank, graph replays and device
loops that never meet a stale line, a missing rank that yields NaN and an error
instead of a hang, and the refusals.  tests/test_allreduce_gpu.py runs the same
on 2 and 4 GPUs."""
import ml_dtypes
import numpy as np
import pytest

import deviceop as dop
from deviceop import api
import deviceop.distributed as dist
from deviceop.distributed.peer import PeerBuffers
from helpers import ranked_sum

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def same_bits(a, b) -> bool:
    return a.shape == b.shape and a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes()


@pytest.mark.parametrize("world, dtype", [(1, "float32"), (2, "bfloat16"), (3, "float32"), (3, "bfloat16")])
def test_every_rank_gets_the_rank_ordered_sum_bit_for_bit(rng, world, dtype):
    np_dt = DTYPES[dtype]
    n = int(rng.integers(1, 5)) * 512 // np.dtype(np_dt).itemsize
    xs = [rng.standard_normal(n).astype(np_dt) for _ in range(world)]
    res = rng.standard_normal(n).astype(np_dt)

    def rank(group):
        s = group.stream
        with PeerBuffers(group, max_bytes=4096) as bufs:
            x = dop.from_numpy(xs[group.rank], stream=s)
            out, fused = dop.empty(n, dtype, stream=s), dop.empty(n, dtype, stream=s)
            hidden = dop.from_numpy(res, stream=s)
            bufs.all_reduce(x, out).sync_on(s)
            bufs.all_reduce(x, fused, residual=hidden).sync_on(s)    # out = residual + sum
            bufs.all_reduce(x, hidden, residual=hidden).sync_on(s)   # hidden += sum
            bufs.all_reduce(x).sync_on(s)                            # in place
            bufs.check()
            return [t.numpy(stream=s) for t in (out, fused, hidden, x)]

    want, want_res = ranked_sum(xs, np_dt), ranked_sum(xs, np_dt, base=res)
    exact = ranked_sum([x.astype(np.float64) for x in xs], np.float64)
    for out, fused, hidden, x in dist.run_reference(world, rank):
        assert same_bits(out, want) and same_bits(x, want)
        assert same_bits(fused, want_res) and same_bits(hidden, want_res)
        tol = 1e-6 if dtype == "float32" else 2 ** -8  # fp32 summing error; one bfloat16 rounding
        np.testing.assert_allclose(out.astype(np.float64), exact, rtol=tol, atol=tol * np.abs(exact).max())


def test_graph_replays_eager_calls_and_device_loops_share_the_epochs(rng):
    """The epochs live in device memory and every launch advances them: replays of a
    captured all-reduce, eager ones between them and a device loop's iterations all
    see fresh data, never the previous call's lines (flashinfer #3053's stale flags)."""
    world, n, steps = 2, 256, 3
    rounds = [[rng.standard_normal(n).astype(np.float32) for _ in range(world)] for _ in range(4)]

    def rank(group):
        s, got = group.stream, []
        bufs = PeerBuffers(group, max_bytes=2048)
        x, out = dop.empty(n, stream=s), dop.empty(n, stream=s)
        graph = dop.DeviceOpVec([bufs.all_reduce(x, out) for _ in range(steps)]).graph_on(s)
        for data in rounds:
            dop.api.memcpy(x, dop.from_numpy(data[group.rank], stream=s)).sync_on(s)
            graph.replay(s)
            got.append(out.numpy(stream=s))
            bufs.all_reduce(x, out).sync_on(s)  # an eager call between replays
            got.append(out.numpy(stream=s))
        acc = dop.from_numpy(np.zeros(n, np.float32), stream=s)
        index = dop.from_numpy(np.array([0], np.int32), stream=s)
        dop.loop(steps, index, lambda i: bufs.all_reduce(x, acc, residual=acc)).graph_on(s).replay(s)
        got.append(acc.numpy(stream=s))
        bufs.check()
        bufs.close()
        return got

    for got in dist.run_reference(world, rank):
        for k, data in enumerate(rounds):
            assert same_bits(got[2 * k], ranked_sum(data, np.float32))
            assert same_bits(got[2 * k + 1], ranked_sum(data, np.float32))
        total = ranked_sum(rounds[-1], np.float32)
        np.testing.assert_allclose(got[-1], steps * total.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_a_rank_that_skips_an_all_reduce_gives_nan_and_an_error_not_a_hang(rng):
    n = 128
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]

    def rank(group):
        s = group.stream
        bufs = PeerBuffers(group, max_bytes=512, timeout=0.2)
        x, out = dop.from_numpy(xs[group.rank], stream=s), dop.empty(n, stream=s)
        if group.rank == 0:
            bufs.all_reduce(x, out).sync_on(s)  # rank 1 never issues it
            first = out.numpy(stream=s)
            with pytest.raises(dop.DistributedError, match="did not arrive within 0.2 s"):
                bufs.check()
            bufs.all_reduce(x, out).sync_on(s)  # every later call gives up at once
            return first, out.numpy(stream=s)
        bufs.group.agree(("one-shot all_reduce", "float32", n, "sum"), "the skipped all_reduce's check")
        return None

    first, later = dist.run_reference(2, rank)[0]
    assert np.isnan(first).all() and np.isnan(later).all()


def test_refusals_name_the_problem_and_the_fix():
    def rank(group):
        s = group.stream
        bufs = PeerBuffers(group, max_bytes=1024)
        x, big = dop.empty(256, stream=s), dop.empty(512, stream=s)
        cases = [
            (dop.DTypeError, "float32 and bfloat16", lambda: bufs.all_reduce(dop.empty(256, "int32", stream=s))),
            (dop.ShapeError, "multiple of 512 bytes", lambda: bufs.all_reduce(dop.empty(100, stream=s))),
            (dop.ShapeError, "max_bytes=1024", lambda: bufs.all_reduce(dop.empty(512, stream=s))),
            (dop.AliasingError, "out overlaps x", lambda: bufs.all_reduce(big[:256], big[128:384])),
            (dop.ShapeError, "must match", lambda: bufs.all_reduce(x, dop.empty(128, stream=s))),
            (dop.ShapeError, "needs an out", lambda: bufs.all_reduce(x, residual=x)),
            (dop.DTypeError, "Tensor or SharedTensor", lambda: bufs.all_reduce(np.zeros(256, np.float32))),
        ]
        for kind, words, build in cases:
            with pytest.raises(kind, match=words):
                build()
        with pytest.raises(dop.ShapeError, match="positive multiple of 512"):
            PeerBuffers(group, max_bytes=1000)
        bufs.close()
        with pytest.raises(dop.DistributedError, match="closed buffers"):
            bufs.all_reduce(x)
        return True

    assert dist.run_reference(2, rank) == [True, True]
    with pytest.raises(dop.DistributedError, match="at most 8"):
        dist.run_reference(9, lambda group: PeerBuffers(group), timeout=5)


def test_ranks_that_issue_different_sizes_are_refused_on_every_rank():
    def rank(group):
        bufs = PeerBuffers(group, max_bytes=2048)
        bufs.all_reduce(dop.empty(128 * (1 + group.rank), stream=group.stream))

    with pytest.raises(dop.DistributedError, match="different collectives"):
        dist.run_reference(2, rank, timeout=5)


def test_dist_all_reduce_picks_the_one_shot_kernel_where_the_group_has_peer_buffers(rng):
    n = 256
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    ints = [rng.integers(-100, 100, n).astype(np.int32) for _ in range(2)]

    def rank(group):
        s = group.stream
        x, i = dop.from_numpy(xs[group.rank], stream=s), dop.from_numpy(ints[group.rank], stream=s)
        with pytest.raises(dop.DistributedError, match=r"dist.PeerBuffers\(group\)"):
            dist.all_reduce(group, x, algorithm="oneshot")
        nccl = dist.all_reduce(group, x, algorithm="auto")
        assert isinstance(nccl, dist.Collective)  # no peer buffers yet: NCCL's path
        nccl.discard()
        with pytest.raises(dop.DistributedError, match="unknown algorithm"):
            dist.all_reduce(group, x, algorithm="ring")
        with PeerBuffers(group, max_bytes=1024) as bufs:
            auto = dist.all_reduce(group, x, dop.empty(n, stream=s))
            assert not isinstance(auto, dist.Collective)  # the one-shot kernel
            out = auto.sync_on(s)                         # whose value is the written tensor
            ints_sum = dist.all_reduce(group, i)          # int32: NCCL's path
            assert isinstance(ints_sum, dist.Collective)
            ints_sum.sync_on(s)
            with pytest.raises(dop.DistributedError, match="sums"):
                dist.all_reduce(group, x, op="max", algorithm="oneshot")
            assert bufs.accepts(x) and not bufs.accepts(i)
            return out.numpy(stream=s), i.numpy(stream=s)

    for out, summed in dist.run_reference(2, rank):
        assert same_bits(out, ranked_sum(xs, np.float32))
        assert np.array_equal(summed, ints[0] + ints[1])


def test_auto_picks_alike_for_a_tensor_and_an_op_that_produces_it(rng):
    """Rank 0 passes its tensor, rank 1 an op producing the same (memcpy's value is its
    destination): "auto" picked the one-shot kernel for the tensor and NCCL for the op, and
    the ranks' agreement check aborted both.  It now asks the tensors in both cases, when
    they exist: eagerly, and in a graph with the output given as an op too."""
    n = 256
    xs = [[rng.standard_normal(n).astype(np.float32) for _ in range(2)] for _ in range(2)]  # [rank][round]

    def rank(group):
        s = group.stream
        with PeerBuffers(group, max_bytes=1024):
            x, out = dop.empty(n, stream=s), dop.empty(n, stream=s)
            host = dop.from_numpy(xs[group.rank][0], stream=s)
            if group.rank == 0:
                api.memcpy(x, host).sync_on(s)
                op = dist.all_reduce(group, x, out)
            else:
                op = dist.all_reduce(group, api.memcpy(x, host), out)
            assert op.sync_on(s) is out
            eager = out.numpy(stream=s)
            host = dop.from_numpy(xs[group.rank][1], stream=s)
            written = api.fill(out, 0.0) if group.rank == 1 else out
            graph = dist.all_reduce(group, api.memcpy(x, host), written).graph_on(s)
            graph.replay()
            group.synchronize()
            return eager, out.numpy(stream=s)

    for eager, replayed in dist.run_reference(2, rank):
        # the one-shot kernel's rank-ordered fp32 sum, bit for bit, on both ranks
        assert same_bits(eager, ranked_sum([xs[0][0], xs[1][0]], np.float32))
        assert same_bits(replayed, ranked_sum([xs[0][1], xs[1][1]], np.float32))


@pytest.mark.parametrize("mode, dtype, world", [("sum", "bfloat16", 2), ("accumulate", "float32", 8),
                                                ("residual", "bfloat16", 4), ("in_place", "float32", 3)])
def test_the_kernels_compile_to_sm90_cubins_that_match_their_declarations(mode, dtype, world):
    from deviceop.distributed.oneshot import BLOCK_BYTES, CTYPES, KERNELS
    generics = [CTYPES[dtype], BLOCK_BYTES // dop.dtype(dtype).itemsize, world]
    if mode in ("sum", "accumulate"):
        generics.append(mode == "accumulate")
    KERNELS[(mode, dtype)].check_compiled("sm_90", tuple(generics))
