"""deviceop.distributed on GPUs, through NCCL (nccl4py).  A one-rank
communicator runs on one GPU; the multi-GPU tests start one process per GPU
(tests/dist_worker.py, explicit ranks and a file store) and skip, saying so,
where fewer GPUs are visible.  Each worker checks its results against NumPy
float64 references on random data; here we check that every rank said OK.

On 2 GPUs (the lead's device command; scripts/gpu-check runs these with the
other gpu tests):  python3 -m pytest -q tests/test_distributed_gpu.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import deviceop as dop
from deviceop.distributed.launch import NO_MULTICAST

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "dist_worker.py"
pytestmark = pytest.mark.gpu


def _gpus() -> int:
    from cuda.bindings import driver as cu
    cu.cuInit(0)
    return cu.cuDeviceGetCount()[1]


def _nccl4py():
    pytest.importorskip("nccl.core", reason="nccl4py is not installed (scripts/gpu-check installs it from .whl/)")


def spawn(scenario: str, world: int, tmp_path, seed: int, timeout: float = 60, deadline: float = 240) -> list:
    """Run ``scenario`` on ``world`` processes, one per GPU; each rank's (exit code, output)."""
    _nccl4py()
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, {_gpus()} visible: run on a multi-GPU machine (nvidia-h100-x{world})")
    env = dict(os.environ, **NO_MULTICAST,
               DEVICEOP_DIST_TIMEOUT=str(timeout), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    store = tmp_path / f"store-{scenario}"
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(r), str(world), str(store), str(seed)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(world)]
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=deadline)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: a rank still ran after {deadline} s: a hang the group's timeout should end")
        results.append((p.returncode, out))
    return results


def _ok(results) -> list:
    found = []
    for rank, (code, out) in enumerate(results):
        lines = [line for line in out.splitlines() if line.startswith("OK ")]
        assert code == 0 and lines, f"rank {rank} exited {code}:\n{out[-4000:]}"
        found.append(json.loads(lines[-1][3:]))
    return found


def test_a_one_rank_nccl_group_runs_every_collective_eagerly_and_in_graphs(rng, tmp_path):
    _nccl4py()
    import deviceop.distributed as dist
    data = rng.standard_normal((3, 4096)).astype(np.float32)
    with dist.init(rank=0, world_size=1, timeout=60) as group:  # one rank needs no store
        assert group.backend == "nccl" and group.device.ordinal == 0
        s = group.stream
        x, out = dop.from_numpy(data[0], stream=s), dop.empty(4096, stream=s)
        assert np.array_equal(dist.all_reduce(group, x, out).sync_on(s).numpy(stream=s), data[0])
        graph = dist.all_gather(group, x, out).graph_on(s)
        for k in (1, 2):
            dop.api.memcpy(x, dop.from_numpy(data[k], stream=s)).sync_on(s)
            graph.replay()
            group.synchronize()
            assert np.array_equal(out.numpy(stream=s), data[k])
        index = dop.from_numpy(np.zeros(1, np.int32), stream=s)
        dop.loop(4, index, lambda i: dist.all_reduce(group, x, op="max")).graph_on(s).replay()
        group.synchronize()
        assert np.array_equal(x.numpy(stream=s), data[2])
        with pytest.raises(dop.DistributedError, match="peer=0 is this rank itself"):
            dist.send(group, x, 0)


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_on_several_gpus_eagerly_in_graphs_and_loops(world, rng, tmp_path):
    checked = _ok(spawn("collectives", world, tmp_path, int(rng.integers(1 << 31))))
    assert all(c == ["eager float32", "graph float32", "eager bfloat16", "graph bfloat16", "loop"] for c in checked)


@pytest.mark.parametrize("scenario", ["symmetric_window_output", "stale_flags", "host_syncs"])
def test_the_known_problems_of_collectives_in_graphs(scenario, rng, tmp_path):
    """TRT-LLM #17048 (a symmetric window as a graph's output), flashinfer #3053 (stale flags: 500
    back-to-back replays), pytorch #196133 (a captured all-reduce meeting host syncs), on 2 GPUs."""
    _ok(spawn(scenario, 2, tmp_path, int(rng.integers(1 << 31))))


def test_a_rank_that_dies_makes_the_others_fail_within_the_timeout(tmp_path):
    results = spawn("rank_dies", 2, tmp_path, 0, timeout=10, deadline=120)
    assert results[1][0] == 3, results[1][1][-2000:]
    survivor = _ok(results[:1])[0]
    assert survivor["failed_after_s"] < 30, survivor  # the timeout (10 s) and a few watchdog periods


def test_a_rank_that_raises_makes_the_others_fail_at_once(tmp_path):
    found = _ok(spawn("rank_raises", 2, tmp_path, 0, timeout=60, deadline=120))
    assert "weights do not match" in found[1]["raised"]
    assert found[0]["failed_after_s"] < 10 and "aborted" in found[0]["error"], found[0]
