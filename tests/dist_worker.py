"""One rank of the multi-GPU tests (tests/test_distributed_gpu.py starts one
process per GPU): ``python tests/dist_worker.py SCENARIO RANK WORLD STORE_DIR SEED``.

Each scenario checks its results itself, against NumPy float64 references on
random data every rank draws alike from SEED, and prints one line ``OK <json>``;
any failure is an exception (a non-zero exit with its traceback)."""
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deviceop.distributed.launch import NO_MULTICAST  # noqa: E402 - loads no NCCL (nccl4py comes at init)

os.environ.update(NO_MULTICAST)  # multicast stays off (the project's rule), before NCCL loads

import numpy as np  # noqa: E402

import deviceop as dop  # noqa: E402
import deviceop.distributed as dist  # noqa: E402
from deviceop import CudaGraph, api  # noqa: E402
from deviceop.kernels import affine  # noqa: E402


def upload(group, array):
    return dop.from_numpy(array, stream=group.stream)


def put(group, t, array):
    api.memcpy(t, upload(group, array)).sync_on(group.stream)


def close(a, b, dtype):
    tol = {"float32": 1e-5, "bfloat16": 2e-2, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=tol, atol=tol * 4)


def collectives(group, seed):
    """Every collective eagerly, in a graph replayed with new data, in a CudaGraph.scope and a device loop."""
    world, r, s, n = group.world_size, group.rank, group.stream, 1024
    rng = np.random.default_rng(seed)
    checked = []
    for dtype in ("float32", "bfloat16"):
        np_dt = dop.dtype(dtype).np
        data = rng.standard_normal((6, world, world * n)).astype(np_dt)
        ref = data.astype(np.float64)
        x = upload(group, data[0, r])
        out, gathered, scattered = dop.empty(world * n, dtype, stream=s), \
            dop.empty(world * world * n, dtype, stream=s), dop.empty(n, dtype, stream=s)
        # eager
        close(dist.all_reduce(group, x, out).sync_on(s).numpy(stream=s), ref[0].sum(0), dtype)
        close(dist.all_reduce(group, x, out, op="max").sync_on(s).numpy(stream=s), ref[0].max(0), dtype)
        close(dist.all_gather(group, x, gathered).sync_on(s).numpy(stream=s), ref[0].reshape(-1), dtype)
        close(dist.reduce_scatter(group, x, scattered).sync_on(s).numpy(stream=s),
              ref[0].sum(0)[r * n:(r + 1) * n], dtype)
        b = upload(group, data[1, r])
        close(dist.broadcast(group, b, root=world - 1).sync_on(s).numpy(stream=s), ref[1, world - 1], dtype)
        peer = (r + 1) % world
        got = dop.empty(world * n, dtype, stream=s)
        ops = [dist.send(group, x, peer), dist.recv(group, got, (r - 1) % world)]
        for op in (ops if r % 2 == 0 else ops[::-1]):  # even ranks send first, odd ranks receive first
            op.sync_on(s)
        close(got.numpy(stream=s), ref[0, (r - 1) % world], dtype)
        checked.append(f"eager {dtype}")
        print("done", checked[-1], flush=True)
        # a graph, replayed with new data each time
        graph = dop.zip_(dist.all_reduce(group, x, out), dist.all_gather(group, x, gathered)).graph_on(s)
        for k in range(2, 6):
            put(group, x, data[k, r])
            graph.replay()
            group.synchronize()
            close(out.numpy(stream=s), ref[k].sum(0), dtype)
            close(gathered.numpy(stream=s), ref[k].reshape(-1), dtype)
        scoped = CudaGraph.scope(s, lambda sc: sc.record(dist.reduce_scatter(group, x, scattered, op="max")))
        scoped.replay()
        group.synchronize()
        close(scattered.numpy(stream=s), ref[5].max(0)[r * n:(r + 1) * n], dtype)
        checked.append(f"graph {dtype}")
        print("done", checked[-1], flush=True)
    # a device loop: x <- sum over ranks, three times, in one graph launch
    data = rng.standard_normal((world, n))
    x = upload(group, data[r])
    index = upload(group, np.zeros(1, np.int32))
    dop.loop(3, index, lambda i: dist.all_reduce(group, x)).graph_on(s).replay()
    group.synchronize()
    close(x.numpy(stream=s), data.sum(0) * world ** 2, "float64")
    checked.append("loop")
    print("done", checked[-1], flush=True)
    return checked


def symmetric_window_output(group, seed):
    """TRT-LLM #17048's case: a registered symmetric window is a captured graph's output buffer."""
    import cupy
    import nccl.core as nccl
    world, r, s, n = group.world_size, group.rank, group.stream, 2048
    buf = nccl.mem_alloc(n * 4, group.device.ordinal)
    mem = cupy.cuda.UnownedMemory(int(buf.handle), n * 4, buf, group.device.ordinal)
    window = cupy.ndarray((n,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    handle = group._backend.comm.register_window(window, nccl.WindowFlag.COLL_SYMMETRIC)
    out = dop.from_dlpack(window, stream=s)  # deviceop writes NCCL's symmetric memory
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((20, world, n)).astype(np.float32)
    x = upload(group, data[0, r])
    graph = dist.all_reduce(group, x, out).graph_on(s)
    for k in range(20):
        put(group, x, data[k, r])
        graph.replay()
        group.synchronize()
        close(out.numpy(stream=s), data[k].astype(np.float64).sum(0), "float32")
    del graph
    handle.close()
    return {"replays": 20, "window_registered": bool(int(getattr(handle, "handle", 1) or 0))}


def stale_flags(group, seed):
    """flashinfer #3053's case: many back-to-back replays of a captured all-reduce (no host sync between);
    each replay must run exactly once: x <- mean over ranks of x, + 1."""
    world, r, s, n, replays = group.world_size, group.rank, group.stream, 4096, 500
    data = np.random.default_rng(seed).standard_normal((world, n)).astype(np.float32)
    x, y = upload(group, data[r]), dop.empty(n, stream=s)
    step = dop.zip_(dist.all_reduce(group, x, y),
                    affine(x.partition([256]), y, 1.0 / world, 1.0).generics([256]))
    graph = step.graph_on(s)
    for _ in range(replays):
        graph.replay()
    group.synchronize()
    close(x.numpy(stream=s), data.astype(np.float64).mean(0) + replays, "float32")
    return {"replays": replays}


def host_syncs(group, seed):
    """pytorch #196133's case: a captured all-reduce replayed while the host synchronizes."""
    world, r, s, n = group.world_size, group.rank, group.stream, 8192
    data = np.random.default_rng(seed).standard_normal((50, world, n)).astype(np.float32)
    x, y = upload(group, data[0, r]), dop.empty(n, stream=s)
    graph = dist.all_reduce(group, x, y).graph_on(s)
    for k in range(50):
        put(group, x, data[k, r])
        graph.replay()
        if k % 3 == 0:
            group.device.synchronize()      # the whole device (cuCtxSynchronize)
        elif k % 3 == 1:
            s.synchronize()
        close(y.numpy(), data[k].astype(np.float64).sum(0), "float32")  # numpy() without a stream: a device sync
    return {"replays": 50}


def rank_dies(group, seed):
    """Rank 1 dies between two all-reduces: the second waits on the GPU for a peer that is gone; the
    watchdog (rank 1's heartbeat stops) or group.synchronize's bound aborts the communicator, and every
    other rank gets DistributedError within the timeout."""
    x = upload(group, np.ones(1024, np.float32))
    dist.all_reduce(group, x).sync_on(group.stream)  # both alive: the signature is agreed, no host exchange next
    if group.rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        dist.all_reduce(group, x).async_on(group.stream)
        group.synchronize()
    except dop.DistributedError as exc:
        return {"failed_after_s": round(time.monotonic() - start, 2), "error": str(exc)[:200]}
    raise AssertionError("the all_reduce with a dead peer completed")


def rank_raises(group, seed):
    """Rank 1 raises inside ``with dist.init()``; the others fail at once, not after the timeout."""
    x = upload(group, np.ones(1024, np.float32))
    if group.rank == 1:
        raise ValueError("rank 1's weights do not match")
    start = time.monotonic()
    try:
        group.check_same("config", {"layers": 16})
    except dop.DistributedError as exc:
        return {"failed_after_s": round(time.monotonic() - start, 2), "error": str(exc)[:200]}
    raise AssertionError(f"check_same passed with rank 1 gone ({x})")


SCENARIOS = {f.__name__: f for f in (collectives, symmetric_window_output, stale_flags, host_syncs, rank_dies,
                                     rank_raises)}

if __name__ == "__main__":
    scenario, rank, world, store, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    timeout = float(os.environ.get("DEVICEOP_DIST_TIMEOUT", 60))
    try:
        with dist.init(rank=rank, world_size=world, local_rank=rank, store=store, timeout=timeout) as group:
            try:
                result = SCENARIOS[scenario](group, seed)
            except BaseException:  # printed before the group's abort, so the log names the failure
                traceback.print_exc()
                sys.stdout.flush()
                raise
    except ValueError as exc:
        if scenario == "rank_raises" and rank == 1:
            print(f"OK {json.dumps({'raised': str(exc)})}", flush=True)
            sys.exit(0)
        raise
    print(f"OK {json.dumps(result)}", flush=True)
