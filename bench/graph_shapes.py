"""Graphs of more shapes on the GPU (issue 36): parallel branches, and the SWITCH GraphCache.

1. **Fork/join**: four independent bf16 matvecs (``matvec_add_bf16``, 2048 x 2048, 32 rows a
   block: 64 blocks each, under half of an H100's 132 SMs) captured serially
   (``graph_on(stream)``: a chain) and in parallel (``graph_on(stream, parallel=True)``:
   four roots).  GPU µs per replay (CUDA events, median), and the ratio.
   Headline ``fork_join_speedup_vs_serial`` (target >= 1.5).
2. **Work that fills the GPU**: the same with 16384 x 2048 matvecs (1024 blocks each):
   parallel branches must not cost anything (``fills_gpu_speedup_vs_serial``, target >= 0.97).
3. **SWITCH GraphCache**: examples/variable_batch.py's token model (22 layers, d = 2048,
   fp32) behind ``GraphCache`` (a graph per padded size) and ``SwitchGraphCache`` (one
   graph, a branch per size): host µs per call (enqueue only: copy in, pick, replay) and
   per step (the call and the wait), over random batches 1..64; device memory of each
   cache after capturing every size.

Every parallel graph's output is checked bit-equal to the serial one's, and each cache's
against the other.

    python bench/graph_shapes.py [--steps 200]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "examples")]
import deviceop as dop  # noqa: E402
from _common import (gpu_device, headline, load_example, print_headlines, print_table, replay_us,  # noqa: E402
                     write_result)
from deviceop.kernels import matvec_add_bf16  # noqa: E402

ex = load_example("variable_batch")


def branches(stream, rng, n_rows: int, k: int, bn: int, count: int = 4):
    """``count`` independent matvecs (out_i = W_i x + r_i), as a function that builds the zip_ op,
    and the outputs."""
    import ml_dtypes
    x = dop.from_numpy(rng.standard_normal((1, k)).astype(np.float32), stream=stream)
    ws = [dop.from_numpy((rng.standard_normal((n_rows, k)) / np.sqrt(k)).astype(ml_dtypes.bfloat16), stream=stream)
          for _ in range(count)]
    rs = [dop.from_numpy(rng.standard_normal(n_rows).astype(np.float32), stream=stream) for _ in range(count)]
    outs = [dop.empty(n_rows, stream=stream) for _ in range(count)]

    def build():
        return dop.zip_(*[matvec_add_bf16(o.partition([bn]), x, w, r).generics([bn, 8, k])
                          for o, w, r in zip(outs, ws, rs)])
    return build, outs


def fork_join(stream, rng, n_rows: int, k: int, bn: int) -> dict:
    build, outs = branches(stream, rng, n_rows, k, bn)
    serial, parallel = build().graph_on(stream), build().graph_on(stream, parallel=True)
    assert serial.edges() == [(0, 1), (1, 2), (2, 3)] and parallel.edges() == [], (serial.edges(), parallel.edges())
    results = []
    for g in (serial, parallel):
        for o in outs:
            dop.api.fill(o, np.nan).sync_on(stream)
        g.replay()
        stream.synchronize()
        results.append([o.numpy(stream=stream) for o in outs])
    for a, b in zip(*results):
        assert np.array_equal(a, b), "the parallel graph's output differs from the serial one's"
    us = {"serial": replay_us(serial, stream, batch=20, reps=30), "parallel": replay_us(parallel, stream, batch=20,
                                                                                          reps=30)}
    return {"rows": n_rows, "k": k, "blocks_each": n_rows // bn, "serial_us": round(us["serial"], 2),
            "parallel_us": round(us["parallel"], 2), "speedup": round(us["serial"] / us["parallel"], 3)}


def cache_costs(device, stream, steps: int) -> tuple[list, dict]:
    cfg = ex.sized(2048, 22)
    weights, _ = ex.random_weights(cfg, stream=stream)
    rng = np.random.default_rng(1)
    batches = rng.integers(1, 65, size=steps)
    inputs = [dop.from_numpy(rng.standard_normal((int(b), cfg.d)).astype(np.float32), stream=stream)
              for b in batches]
    caches, memory, capture = {}, {}, {}
    for name, kind in (("GraphCache", dop.GraphCache), ("SwitchGraphCache", dop.SwitchGraphCache)):
        stream.synchronize()
        free0 = device.memory_info()[0]
        t0 = time.perf_counter()
        cache = ex.make_cache(cfg, weights, stream, 64, kind)
        cache.warmup(inputs[0])
        stream.synchronize()
        capture[name] = time.perf_counter() - t0
        memory[name] = free0 - device.memory_info()[0]
        caches[name] = cache
    for x in inputs[:8]:
        a, b = caches["GraphCache"](x).numpy(stream=stream), caches["SwitchGraphCache"](x).numpy(stream=stream)
        assert np.array_equal(a, b), "SwitchGraphCache differs from GraphCache"
    rows, table = [], []
    for name, cache in caches.items():
        host, step = [], []
        for x in inputs:
            stream.synchronize()
            t0 = time.perf_counter()
            cache(x)
            t1 = time.perf_counter()
            stream.synchronize()
            t2 = time.perf_counter()
            host.append((t1 - t0) * 1e6)
            step.append((t2 - t0) * 1e6)
        row = {"cache": name, "graphs": len(cache), "host_us_per_call": round(statistics.median(host), 2),
               "us_per_step": round(statistics.median(step), 1), "capture_ms": round(capture[name] * 1e3, 1),
               "device_mib": round(memory[name] / 2**20, 1), "buffer_mib": round(cache.stats.bytes / 2**20, 1)}
        rows.append(row)
        table.append([name, row["graphs"], row["host_us_per_call"], row["us_per_step"], row["capture_ms"],
                      row["device_mib"]])
        cache.close()
    print_table(f"GraphCache vs SwitchGraphCache, 22 layers d=2048 fp32, {steps} random batches 1..64 (medians)",
                ["cache", "graphs", "host us/call", "us/step", "capture ms", "device MiB"], table)
    return rows, {"host_ratio": rows[1]["host_us_per_call"] / rows[0]["host_us_per_call"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="random batches timed per cache")
    args = ap.parse_args()
    device = gpu_device("graph_shapes")
    if device is None:
        return 0
    stream = device.new_stream()
    rng = np.random.default_rng(0)
    small = fork_join(stream, rng, 2048, 2048, 32)
    full = fork_join(stream, rng, 16384, 2048, 16)
    print_table(f"four independent bf16 matvecs (matvec_add_bf16), GPU us per replay on {device.name}",
                ["rows x K", "blocks each", "serial (chain)", "parallel (4 roots)", "speedup"],
                [[f"{r['rows']} x {r['k']}", r["blocks_each"], r["serial_us"], r["parallel_us"], f"{r['speedup']}x"]
                 for r in (small, full)])
    cache_rows, ratios = cache_costs(device, stream, args.steps)
    print(f"SwitchGraphCache host time per call / GraphCache's: {ratios['host_ratio']:.3f}")
    heads = [headline("fork_join_speedup_vs_serial", small["speedup"], 1.5, "higher"),
             headline("fills_gpu_speedup_vs_serial", full["speedup"], 0.97, "higher")]
    path = write_result("graph_shapes", device, [{"case": "fork_join_small", **small},
                                                 {"case": "fork_join_fills_gpu", **full},
                                                 *({"case": "cache", **r} for r in cache_rows)], heads,
                        {"switch_cache_host_ratio": round(ratios["host_ratio"], 3)})
    print_headlines(heads, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
