"""The one-shot all-reduce on GPUs: one rank on one GPU in this process, and 2 and 4
ranks as processes of this file (``python tests/test_allreduce_gpu.py RANK WORLD
STORE``), each on its GPU, meeting through a file store.  A rank checks, on random
data: every form in float32 and bfloat16 against the fp32 rank-ordered sum bit for
bit (so every rank holds the same bits) and against float64; a graph of 10
all-reduces replayed 100 times with fresh inputs between replays, eager calls
between replays, a PDL graph and a device loop (the epochs advance on the device:
no stale flags, flashinfer #3053); dist.all_reduce's "auto" choosing it; and a rank
that skips an all-reduce: the others get NaN and an error within the timeout, not a
hang, and fresh buffers work again."""
import os
import sys

import numpy as np
import pytest

from deviceop.distributed.launch import NO_MULTICAST  # loads no NCCL: nccl4py is imported at init
import helpers
from helpers import ranked_sum


def check_forms(group, bufs, seed):
    """Every form, both dtypes, several sizes: bit-exact against the fp32 rank-ordered sum."""
    import ml_dtypes
    import deviceop as dop
    s = group.stream
    for dtype, np_dt in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        for nbytes in (512, 4096, 8192, 65536):
            n = nbytes // np.dtype(np_dt).itemsize
            rng = np.random.default_rng([seed, nbytes])
            xs = [rng.standard_normal(n).astype(np_dt) for _ in range(group.world_size)]
            res = rng.standard_normal(n).astype(np_dt)
            x, out = dop.from_numpy(xs[group.rank], stream=s), dop.empty(n, dtype, stream=s)
            fused, hidden = dop.empty(n, dtype, stream=s), dop.from_numpy(res, stream=s)
            inplace = dop.from_numpy(xs[group.rank], stream=s)
            bufs.all_reduce(x, out).sync_on(s)
            bufs.all_reduce(x, fused, residual=hidden).sync_on(s)
            bufs.all_reduce(x, hidden, residual=hidden).sync_on(s)
            bufs.all_reduce(inplace).sync_on(s)
            bufs.check()
            want, want_res = ranked_sum(xs, np_dt), ranked_sum(xs, np_dt, res)
            for name, t, w in (("sum", out, want), ("in place", inplace, want), ("residual", fused, want_res),
                               ("accumulate", hidden, want_res)):
                got = t.numpy(stream=s)
                assert got.tobytes() == w.tobytes(), f"{name} {dtype} {nbytes} B on rank {group.rank}"
            exact = np.sum([a.astype(np.float64) for a in xs], axis=0)
            tol = 1e-6 if dtype == "float32" else 2 ** -8
            np.testing.assert_allclose(out.numpy(stream=s).astype(np.float64), exact, rtol=tol,
                                       atol=tol * np.abs(exact).max())


def check_replays(group, bufs, seed):
    """Graph replays with fresh inputs, eager calls between them, a PDL graph, a device loop."""
    import deviceop as dop
    import deviceop.distributed as dist
    s, n, world = group.stream, 2048, group.world_size
    x, out = dop.empty(n, stream=s), dop.empty(n, stream=s)
    graph = dop.DeviceOpVec([bufs.all_reduce(x, out) for _ in range(10)]).graph_on(s)
    pdl = dop.DeviceOpVec([bufs.all_reduce(x, out).pdl() for _ in range(10)]).graph_on(s)
    rng = np.random.default_rng([seed, 1])
    for step in range(100):
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
        dop.api.memcpy(x, dop.from_numpy(xs[group.rank], stream=s)).sync_on(s)
        (pdl if step % 2 else graph).replay(s)
        if step % 10 == 0:
            bufs.all_reduce(x, out).sync_on(s)
        assert out.numpy(stream=s).tobytes() == ranked_sum(xs, np.float32).tobytes(), f"replay {step}"
    acc = dop.from_numpy(np.zeros(n, np.float32), stream=s)
    index = dop.from_numpy(np.array([0], np.int32), stream=s)
    dop.loop(7, index, lambda i: bufs.all_reduce(x, acc, residual=acc)).graph_on(s).replay(s)
    np.testing.assert_allclose(acc.numpy(stream=s), 7 * ranked_sum(xs, np.float32).astype(np.float64),
                               rtol=1e-5, atol=1e-5)
    auto = dist.all_reduce(group, x, out)  # "auto": the one-shot kernel, since the group has PeerBuffers
    assert not isinstance(auto, dist.Collective)
    auto.sync_on(s)
    assert out.numpy(stream=s).tobytes() == ranked_sum(xs, np.float32).tobytes()
    bufs.check()


def check_a_skipped_all_reduce(group, seed):
    """Rank 1 skips one: the others write NaN and report it within the timeout; new buffers work."""
    import deviceop as dop
    import deviceop.distributed as dist
    s, n = group.stream, 1024
    bufs = dist.PeerBuffers(group, max_bytes=4096, timeout=0.5)
    x, out = dop.from_numpy(np.ones(n, np.float32), stream=s), dop.empty(n, stream=s)
    if group.rank != 1:
        bufs.all_reduce(x, out).sync_on(s)
        assert np.isnan(out.numpy(stream=s)).all()
        with pytest.raises(dop.DistributedError, match="did not arrive"):
            bufs.check()
    else:
        group.agree(("one-shot all_reduce", "float32", n, "sum"), "the skipped all-reduce's check")
    bufs.close()
    with dist.PeerBuffers(group, max_bytes=4096, timeout=5.0) as fresh:
        fresh.all_reduce(x, out).sync_on(s)
        assert np.array_equal(out.numpy(stream=s), np.full(n, group.world_size, np.float32))
        fresh.check()


def rank_main(rank: int, world: int, store: str) -> int:
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    import deviceop.distributed as dist
    with dist.init(rank=rank, world_size=world, store=store, timeout=60) as group:
        seed = group.exchange(int.from_bytes(os.urandom(4), "little") if rank == 0 else None)[0]
        with dist.PeerBuffers(group, timeout=10.0) as bufs:
            check_forms(group, bufs, seed)
            check_replays(group, bufs, seed)
        check_a_skipped_all_reduce(group, seed)
    print(f"rank {rank}/{world}: ok (seed {seed})")
    return 0


def _nccl4py():
    pytest.importorskip("nccl.core", reason="nccl4py is not installed (scripts/gpu-check installs it from .whl/)")


@pytest.mark.gpu
def test_one_rank_on_one_gpu(tmp_path):
    import deviceop.distributed as dist
    _nccl4py()
    with dist.init(rank=0, world_size=1, store=tmp_path, timeout=60) as group:  # a one-rank group: the kernel reads only its own x
        with dist.PeerBuffers(group) as bufs:
            check_forms(group, bufs, int(np.random.default_rng().integers(1 << 30)))
            check_replays(group, bufs, 7)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_on_several_gpus(world, tmp_path):
    _nccl4py()
    if helpers.gpu_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {helpers.gpu_count()}")
    helpers.run_ranks(__file__, world, tmp_path / "store")


if __name__ == "__main__":
    sys.exit(rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
