"""Seed 004's launch-bound workflow, three ways in one process: no graph,
recapture + cuGraphExecUpdate, and kernel-node parameter updates
(cuGraphExecKernelNodeSetParams).  The blog measured 1.00 / 1.22 / 1.63 on an
A100 in C++.

Each iteration: 8 short kernels in a chain (n = 1024 floats, 4 blocks each),
4 of them with a scalar that changes every iteration (examples/dynamic_params.py).
Time per iteration = wall time of ``iters`` iterations enqueued back to back,
then one synchronization; the median of ``reps`` such runs.  Also the GPU
time of one iteration in a graph (events around 1000 replays) — the floor a
host-bound loop cannot beat — and host µs of one node update.

    python bench/dynamic_params.py [--iters 2000] [--reps 7]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import numpy as np  # noqa: E402

from _common import gpu_device, headline, load_example, print_headlines, print_table, write_result  # noqa: E402

ex = load_example("dynamic_params")


def timed(run, iters: int, reps: int, stream) -> tuple[float, float, float]:
    samples = []
    for _ in range(reps):
        stream.synchronize()
        t0 = time.perf_counter()
        run(iters)
        stream.synchronize()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples), min(samples), max(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--n", type=int, default=1024)
    args = ap.parse_args()
    device = gpu_device("dynamic_params")
    if device is None:
        return 0
    stream = device.new_stream()
    wf = ex.Workflow(args.n, stream)

    graph = ex.run_recapture(wf, 2)              # captured and updated once, outside the timing
    gn = ex.run_node_updates(wf, 2)
    fn = ex.affine.function(device, (ex.TILE,))
    config = ex.affine.config((args.n // ex.TILE,), (ex.TILE,))

    def run_bare(k):
        """No graph, no ops: the launcher of a loaded kernel called directly (the floor of Python launches)."""
        launch, bufs = fn.launch, wf.bufs
        for i in range(k):
            src = wf.x
            for j, a in enumerate(ex.alphas(i)):
                launch(stream, config, bufs[2 * j], src, *ex.STATIC)
                launch(stream, config, bufs[2 * j + 1], bufs[2 * j], a, 0.0)
                src = bufs[2 * j + 1]

    ways = {"no graph (deviceop eager)": lambda k: ex.run_no_graph(wf, k),
            "no graph (bare Function.launch)": run_bare,
            "recapture + exec update": lambda k: ex.run_recapture(wf, k, graph),
            "node parameter updates": lambda k: ex.run_node_updates(wf, k, gn)}
    outputs, stats = {}, {}
    for name, run in ways.items():
        run(50)  # warm
        stats[name] = timed(run, args.iters, args.reps, stream)
        outputs[name] = wf.out.numpy()
    same = all(np.array_equal(outputs["no graph (deviceop eager)"], o) for o in outputs.values())
    ref = wf.reference(args.iters - 1)
    err = float(np.max(np.abs(outputs["node parameter updates"] - ref)) / np.max(np.abs(ref)))

    # the GPU's own time for one iteration in a graph: what a host-bound loop cannot beat
    g, _ = gn
    start = stream.record_event()
    for _ in range(1000):
        g.replay()
    end = stream.record_event()
    end.synchronize()
    gpu_us = start.elapsed_ms(end)  # ms for 1000 replays = us per replay
    node = gn[1][0]
    upd = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(2000):
            node.set(alpha=1.0 + i * 1e-4)
        upd.append((time.perf_counter() - t0) / 2000 * 1e6)
    stream.synchronize()

    base = stats["no graph (deviceop eager)"][0]
    rows, table = [], []
    for name, (med, lo, hi) in stats.items():
        rows.append({"variant": name, "us_per_iteration": round(med, 2), "spread_us": [round(lo, 2), round(hi, 2)],
                     "speedup_vs_no_graph": round(base / med, 3)})
        table.append([name, f"{med:.2f}", f"{lo:.2f}-{hi:.2f}", f"{base / med:.2f}x"])
    print(f"8 kernels an iteration (4 dynamic), n={args.n}, {args.iters} iterations x {args.reps} runs on {device.name}")
    print_table("us per iteration (median of runs)", ["way", "us/iter", "spread", "vs no graph"], table)
    print(f"outputs identical: {same}; vs float64 NumPy: {err:.1e}")
    bare = stats["no graph (bare Function.launch)"][0]
    print(f"node updates vs the bare launch loop: {bare / stats['node parameter updates'][0]:.2f}x")
    print(f"GPU time of one iteration as a graph: {gpu_us:.2f} us; one node.set(alpha=...): "
          f"{statistics.median(upd):.2f} us host")
    nu, rc = stats["node parameter updates"][0], stats["recapture + exec update"][0]
    heads = [headline("node_update_speedup_vs_no_graph", base / nu, 2.0, "higher"),
             headline("node_update_speedup_vs_recapture", rc / nu, 1.0, "higher")]
    path = write_result("dynamic_params", device, rows, heads,
                        {"gpu_us_per_iteration_graph": round(gpu_us, 2),
                         "node_update_speedup_vs_bare_launch_loop": round(bare / stats["node parameter updates"][0], 3),
                         "node_set_host_us": round(statistics.median(upd), 3),
                         "blog_a100_cpp": {"no graph": 1.0, "recapture + update": 1.22, "combined": 1.63},
                         "outputs_identical": same})
    print_headlines(heads, path)
    return 0 if same and err < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
