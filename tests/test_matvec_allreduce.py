"""matvec_allreduce (kernels/llama_tp.cu): a tensor-parallel projection whose all-reduce runs in
its own epilogue, each CTA exchanging its rows with the same CTA of every peer.  On the
reference backend (thread-ranks) here, and on 1, 2 and 4 GPUs as processes of this file
(``python tests/test_matvec_allreduce.py RANK WORLD STORE``) meeting through a file store.

Checked on random data: out = residual + the sum over the ranks of w_r @ x_r against float64;
the same bits on every rank; two projections on one set of buffers (their own lines and
epochs) replayed in a graph with fresh inputs, eagerly between replays, with PDL and in a
device loop (the epochs advance on the device: no replay meets a stale line); a rank that
skips a call leaves the others NaN and an error within the timeout, not a hang."""
import hashlib
import os
import sys

import numpy as np
import pytest

import helpers
from deviceop.distributed.launch import NO_MULTICAST  # loads no NCCL


def _bf16(a):
    import ml_dtypes
    return a.astype(ml_dtypes.bfloat16)


class Projection:
    """One rank's share of ``out[N] = residual + sum_r w_r[N, K] @ x_r`` and its matvec_allreduce."""

    def __init__(self, group, bufs, n, k, line0, epoch0, seed):
        import deviceop as dop
        from deviceop.kernels.llama_tp import matvec_allreduce_plan
        s, world = group.stream, group.world_size
        rng = np.random.default_rng([seed, n, k])
        self.ws = [_bf16(rng.standard_normal((n, k)) * 0.05) for _ in range(world)]  # every rank's block
        self.tile, self.gen = matvec_allreduce_plan(n, k, world)
        self.grid = n // self.tile
        self.x, self.out = dop.empty(k, stream=s), dop.empty(n, stream=s)
        self.w = dop.from_numpy(self.ws[group.rank], stream=s)
        self.residual = dop.empty(n, stream=s)
        self.group, self.bufs, self.line0, self.epoch0 = group, bufs, line0, epoch0

    def op(self, out=None, residual=None):
        from deviceop.kernels.llama_tp import matvec_allreduce
        b = self.bufs
        return matvec_allreduce((out or self.out).partition([self.tile]), self.x, self.w, residual or self.residual,
                                b.peers, b.state, self.group.rank, b.slot_lines, self.line0, self.epoch0,
                                b.timeout_ns).generics(self.gen)

    def load(self, rng):
        """Fresh x for every rank and a fresh residual: (xs, residual) as host arrays."""
        import deviceop as dop
        s = self.group.stream
        xs = [rng.standard_normal(self.ws[0].shape[1]).astype(np.float32) for _ in self.ws]
        res = rng.standard_normal(self.ws[0].shape[0]).astype(np.float32)
        dop.api.memcpy(self.x, dop.from_numpy(xs[self.group.rank], stream=s)).sync_on(s)
        dop.api.memcpy(self.residual, dop.from_numpy(res, stream=s)).sync_on(s)
        return xs, res

    def check(self, xs, res, what):
        got = self.out.numpy(stream=self.group.stream)
        exact = res.astype(np.float64) + sum(w.astype(np.float64) @ x.astype(np.float64) for w, x in zip(self.ws, xs))
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max(), err_msg=what)
        digests = self.group.exchange(hashlib.sha256(got.tobytes()).hexdigest())
        assert len(set(digests)) == 1, f"{what}: the ranks hold different bits"


def check_projections(group, seed, n=256, ks=(512, 1024), replays=12):
    """Two projections (an O-like and a down-like) on one private PeerBuffers, eagerly and replayed."""
    import deviceop as dop
    import deviceop.distributed as dist
    s = group.stream
    from deviceop.kernels.llama_tp import matvec_allreduce_plan
    grids = [n // matvec_allreduce_plan(n, k, group.world_size)[0] for k in ks]
    bufs = dist.PeerBuffers(group, max_bytes=-(-8 * n // 512) * 512, epochs=sum(grids), attach=False, timeout=20.0)
    from deviceop.distributed.peer import peer_buffers
    assert peer_buffers(group) is not bufs  # private: dist.all_reduce's "auto" does not take them
    a = Projection(group, bufs, n, ks[0], 0, 1, seed)
    b = Projection(group, bufs, n, ks[1], n // 2, 1 + grids[0], seed)
    rng = np.random.default_rng([seed, 7])
    for p in (a, b):
        xs, res = p.load(rng)
        p.op().sync_on(s)
        p.check(xs, res, "eager")
    graph = dop.zip_(a.op(), b.op()).graph_on(s)
    pdl = dop.zip_(a.op().pdl(), b.op().pdl()).graph_on(s)
    for step in range(replays):
        (xa, ra), (xb, rb) = a.load(rng), b.load(rng)
        (pdl if step % 2 else graph).replay(s)
        if step % 4 == 3:  # eager calls between replays share the epochs
            a.op().sync_on(s)
        a.check(xa, ra, f"replay {step} (a)")
        b.check(xb, rb, f"replay {step} (b)")
    # a device loop: hidden += the ranks' sums, 5 times (out and residual are separate buffers)
    xs, _ = a.load(rng)
    acc, tmp = dop.from_numpy(np.zeros(n, np.float32), stream=s), dop.empty(n, stream=s)
    index = dop.from_numpy(np.array([0], np.int32), stream=s)
    dop.loop(5, index, lambda i: dop.zip_(a.op(out=tmp, residual=acc), dop.api.memcpy(acc, tmp))).graph_on(s).replay(s)
    step = sum(w.astype(np.float64) @ x.astype(np.float64) for w, x in zip(a.ws, xs))
    np.testing.assert_allclose(acc.numpy(stream=s), 5 * step, rtol=1e-4, atol=1e-4 * np.abs(step).max())
    bufs.check()
    bufs.close()


def check_a_skipped_call(group, seed):
    """Rank 1 skips one: the others write NaN and report it within the timeout."""
    import deviceop as dop
    import deviceop.distributed as dist
    n, k = 256, 512
    from deviceop.kernels.llama_tp import matvec_allreduce_plan
    grid = n // matvec_allreduce_plan(n, k, group.world_size)[0]
    bufs = dist.PeerBuffers(group, max_bytes=4096, epochs=grid, attach=False, timeout=0.5)
    p = Projection(group, bufs, n, k, 0, 1, seed)
    p.load(np.random.default_rng(seed))
    if group.rank != 1:
        p.op().sync_on(group.stream)
        assert np.isnan(p.out.numpy(stream=group.stream)).all()
        with pytest.raises(dop.DistributedError, match="did not arrive"):
            bufs.check()
    group.barrier()
    bufs.close()


# -- the reference backend ---------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_gets_residual_plus_the_ranks_products_replayed_and_in_loops(world):
    import deviceop.distributed as dist
    seed = int.from_bytes(os.urandom(4), "little")
    dist.run_reference(world, lambda group: check_projections(group, seed, replays=4 if world > 1 else 2))


def test_a_rank_that_skips_a_call_gives_nan_and_an_error_not_a_hang():
    import deviceop.distributed as dist
    dist.run_reference(2, lambda group: check_a_skipped_call(group, 3))


def test_refusals_name_the_limit():
    import deviceop as dop
    import deviceop.distributed as dist
    from deviceop.kernels.llama_tp import MAX_RESIDENT, matvec_allreduce

    def rank(group):
        s = group.stream
        bufs = dist.PeerBuffers(group, max_bytes=4096, epochs=300, attach=False)
        x = dop.empty(256, stream=s)

        def launch(n, rpc, line0=0, epoch0=1, warps=1, out=None, res=None):
            w = dop.from_numpy(_bf16(np.ones((n, 256))), stream=s)
            out = dop.empty(n, stream=s) if out is None else out
            res = dop.empty(n, stream=s) if res is None else res
            matvec_allreduce(out.partition([rpc]), x, w, res, bufs.peers, bufs.state, group.rank, bufs.slot_lines,
                             line0, epoch0, bufs.timeout_ns).generics([256, 1, 1, warps, rpc, 1, 2, 2]).sync_on(s)
        with pytest.raises(dop.ShapeError, match=f"resident at once: at most {MAX_RESIDENT}"):
            launch(512, 2)  # 256 CTAs
        with pytest.raises(dop.ShapeError, match="must be even"):
            launch(3 * 64, 3)
        with pytest.raises(dop.ShapeError, match="do not fit slots"):
            launch(512, 8, line0=bufs.slot_lines, warps=4)
        with pytest.raises(dop.ShapeError, match="past the state"):
            launch(512, 8, epoch0=290, warps=4)
        # rows travel as float2 (8-byte loads of the residual, stores of out): a view one float in is refused
        shifted = dop.empty(513, stream=s)[1:]
        with pytest.raises(dop.ShapeError, match="residual must start 8-byte aligned"):
            launch(512, 8, warps=4, res=shifted)
        with pytest.raises(dop.ShapeError, match="out must start 8-byte aligned"):
            launch(512, 8, warps=4, out=shifted)
        launch(512, 8, warps=4, out=dop.empty(514, stream=s)[2:], res=dop.empty(514, stream=s)[2:])  # 8 bytes in
        with pytest.raises(dop.ShapeError, match="epochs=10"):
            dist.PeerBuffers(group, max_bytes=8192, epochs=10)
        bufs.close()
        return True
    assert dist.run_reference(2, rank) == [True, True]


def test_a_counter_always_stands_for_the_same_lines(rng):
    """An epoch tells a line's writes apart only while its counter serves the same lines: another
    row tile on the same epochs (CTA i's lines move, and counter i may meet a line another counter
    wrote with the epoch it waits for: stale data, silently), a second channel over the same lines,
    or the one-shot all-reduce on these buffers is refused; the same layout again, and a second
    channel on its own epochs and lines, run."""
    import deviceop as dop
    import deviceop.distributed as dist
    from deviceop.kernels.llama_tp import matvec_allreduce

    def rank(group):
        s = group.stream
        bufs = dist.PeerBuffers(group, max_bytes=4096, epochs=64, attach=False)
        x = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=s)
        w = dop.from_numpy(_bf16(rng.standard_normal((256, 256))), stream=s)
        res = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=s)

        def launch(rpc, line0, epoch0, n=256):
            out = dop.empty(n, stream=s)
            matvec_allreduce(out.partition([rpc]), x, w[:n], res[:n], bufs.peers, bufs.state, group.rank,
                             bufs.slot_lines, line0, epoch0, bufs.timeout_ns).generics([256, 2, 1, 4, rpc, 1, 2, 1]) \
                .sync_on(s)
            return out.numpy(stream=s)
        first = launch(8, 0, 1)  # 32 CTAs: counters 1..32, 4 lines each from line 0
        np.testing.assert_array_equal(launch(8, 0, 1), first)  # the same layout again
        with pytest.raises(dop.ShapeError, match="always stand for the same lines"):
            launch(16, 0, 1)  # 16 CTAs of 8 lines on counters 1..16
        with pytest.raises(dop.ShapeError, match="always stand for the same lines"):
            launch(8, 64, 33)  # its own counters, but lines 64.. are counters 17..32's
        with pytest.raises(dop.ShapeError, match="always stand for the same lines"):
            bufs.all_reduce(dop.empty(128, stream=s)).sync_on(s)  # counter 1 for lines 0..63
        launch(16, 128, 33)  # its own counters and lines: a second channel
        launch(8, 0, 1, n=128)  # a prefix of the first layout: the same counters, the same lines
        bufs.close()
        return True
    assert dist.run_reference(1, rank) == [True]


# -- GPUs ----------------------------------------------------------------------------------

def rank_main(rank: int, world: int, store: str) -> int:
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    import deviceop.distributed as dist
    with dist.init(rank=rank, world_size=world, store=store, timeout=60) as group:
        seed = group.exchange(int.from_bytes(os.urandom(4), "little") if rank == 0 else None)[0]
        # the 1B and 8B hidden sizes, O- and down-like row lengths of a rank
        check_projections(group, seed, n=2048, ks=(1024, 4096), replays=40)
        check_projections(group, seed + 1, n=4096, ks=(2048, 7168), replays=10)
        if world > 1:
            check_a_skipped_call(group, seed)
    print(f"rank {rank}/{world}: ok (seed {seed})")
    return 0


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4])
def test_on_gpus(world, tmp_path):
    pytest.importorskip("nccl.core", reason="nccl4py is not installed (scripts/gpu-check installs it from .whl/)")
    if helpers.gpu_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {helpers.gpu_count()}")
    helpers.run_ranks(__file__, world, tmp_path / "store")


if __name__ == "__main__":
    sys.exit(rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))


def test_a_grid_larger_than_the_devices_sms_is_refused(monkeypatch):
    """Every CTA waits for its peers' same CTA: on a GPU of fewer SMs than CTAs some could never
    be resident, and the call would only end at the timeout, in NaN."""
    import deviceop as dop
    import deviceop.distributed as dist
    from deviceop.kernels.llama_tp import matvec_allreduce, matvec_allreduce_plan
    from deviceop.runtime.reference import ReferenceDevice
    monkeypatch.setattr(ReferenceDevice, "sm_count", 64)  # as a GPU with 64 SMs reports it

    def rank(group):
        s = group.stream
        tile, gen = matvec_allreduce_plan(2048, 256, 2)  # 128 CTAs
        bufs = dist.PeerBuffers(group, max_bytes=16384, epochs=2048 // tile, attach=False)
        w = dop.from_numpy(_bf16(np.ones((2048, 256))), stream=s)
        out, res, x = dop.empty(2048, stream=s), dop.empty(2048, stream=s), dop.empty(256, stream=s)
        with pytest.raises(dop.ShapeError, match="at most 64 here"):
            matvec_allreduce(out.partition([tile]), x, w, res, bufs.peers, bufs.state, group.rank, bufs.slot_lines,
                             0, 1, bufs.timeout_ns).generics(gen).sync_on(s)
        bufs.close()
        return True
    assert dist.run_reference(2, rank) == [True, True]
