#!/usr/bin/env python3
"""Soak: replay the token-loop graph for a while, then create and close many graphs
and graph caches; memory must stay flat and every sampled output must be right.

    python scripts/soak.py [--seconds 60] [--graphs 10000] [--caches 10000] [--d 2048] [--layers 22]

1. GraphModel.forward of seed 001's token loop (22 layers, d=2048 on a GPU;
   small on the reference device) replayed for ``--seconds``: every 1000th
   output is compared bit for bit with the first output for the same input
   (4 inputs in turn; the first outputs are checked against float64 NumPy),
   and device memory in use, the CuPy pool and host RSS are sampled.
2. ``--graphs`` graphs captured, replayed once, closed.
3. ``--caches`` GraphCaches made, called at two batch sizes (two captures), closed.

After phase 1's first sample (warm-up) memory must not grow: device memory by
at most 2 MiB, host RSS by at most 32 MiB; graph handles created must all be
destroyed (counted by deviceop.testing.DriverSpy) and no module may be left
loaded by phases 2 and 3.  Results go to ``$DEVICEOP_BENCH_OUT/soak.json`` (else
bench/results/), in the benchmarks' format; exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "bench")]
import deviceop as dop  # noqa: E402
from deviceop import GraphCache, GraphModel  # noqa: E402
from deviceop.testing import DriverSpy, device_used_bytes, host_rss_bytes, loaded_modules  # noqa: E402
from deviceop.kernels import affine  # noqa: E402
from token_model import Config, LayerBuffers, build_forward, numpy_forward, random_weights  # noqa: E402

MIB = 2**20
DEVICE_SLACK, HOST_SLACK = 2 * MIB, 32 * MIB


def pool_bytes(device) -> int:
    if device.is_reference:
        return 0
    import cupy
    return cupy.get_default_memory_pool().total_bytes()


def sample(device) -> dict:
    return {"device_used": device_used_bytes(device), "pool": pool_bytes(device), "host_rss": host_rss_bytes()}


def soak_token_loop(cfg, seconds, device, stream, check_every=1000):
    weights, host = random_weights(cfg, stream=stream)
    x = dop.empty(cfg.d, stream=stream)
    buffers = [LayerBuffers.allocate(cfg.d, stream) for _ in range(cfg.n_layers)]
    forward, out = build_forward(cfg, weights, x, buffers)
    model = GraphModel(forward.graph_on(stream), x, out.sync_on(stream))
    rng = np.random.default_rng(0)
    host_inputs = [rng.standard_normal(cfg.d).astype(np.float32) for _ in range(4)]
    inputs = [dop.from_numpy(a, stream=stream) for a in host_inputs]
    first = []
    for a, t in zip(host_inputs, inputs):
        got = model.forward(t).numpy(stream=stream)
        ref = numpy_forward(cfg, host, a)
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        assert err < 1e-5, f"the token loop's output differs from float64 NumPy by {err:.2e}"
        first.append(got)
    samples, checked, n, bad = [], 0, 0, 0
    t0 = time.perf_counter()
    while True:
        for _ in range(check_every):
            model.forward(inputs[n % 4])
            n += 1
        i = (n - 1) % 4
        if not np.array_equal(model.output.numpy(stream=stream), first[i]):
            bad += 1
        checked += 1
        gc.collect()
        samples.append({"replays": n, "seconds": round(time.perf_counter() - t0, 2), **sample(device)})
        if time.perf_counter() - t0 >= seconds:
            break
    model.graph.close()
    return {"replays": n, "seconds": round(time.perf_counter() - t0, 1), "outputs_checked": checked,
            "outputs_wrong": bad, "us_per_forward": round((time.perf_counter() - t0) / n * 1e6, 1),
            "samples": samples}


def churn_graphs(count, device, stream):
    x = dop.from_numpy(np.arange(1024, dtype=np.float32), stream=stream)
    y = dop.empty(1024, stream=stream)
    bad = 0
    for i in range(count):
        graph = affine(y.partition([256]), x, float(i % 7), 1.0).generics([256]).graph_on(stream)
        graph.replay()
        if i % 1000 == 0 and not np.array_equal(y.numpy(stream=stream), (i % 7) * np.arange(1024) + 1.0):
            bad += 1
        graph.close()
    return bad


def churn_caches(count, device, stream):
    def fn(ws, x):
        y = ws.empty([ws.size, 256])
        return affine(y.view([-1]).partition([256]), x.view([-1]), 2.0, 0.0).generics([256]).map(lambda _: y)

    xs = [dop.from_numpy(np.full((b, 256), b, np.float32), stream=stream) for b in (1, 3)]
    bad = 0
    for i in range(count):
        with GraphCache(fn, stream=stream, sizes=[1, 4]) as cache:
            for x in xs:
                out = cache(x)
            if i % 1000 == 0 and not np.array_equal(out.numpy(stream=stream), np.full((3, 256), 6.0)):
                bad += 1
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--graphs", type=int, default=10_000)
    ap.add_argument("--caches", type=int, default=10_000)
    ap.add_argument("--d", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    device = dop.Device(0)
    stream = device.new_stream()
    small = device.is_reference
    d = args.d or (256 if small else 2048)
    cfg = Config(d=d, n_layers=args.layers or (3 if small else 22), bk=max(1, min(16, d // 128)))

    loop = soak_token_loop(cfg, args.seconds, device, stream)
    s = loop["samples"]
    warm, last = s[0], s[-1]
    growth = {k: last[k] - warm[k] for k in ("device_used", "pool", "host_rss")}

    churn_graphs(1, device, stream)  # first use: compiles and loads the churn's kernel, not a leak
    churn_caches(1, device, stream)
    gc.collect()
    before = {**sample(device), "modules": loaded_modules()}
    t0 = time.perf_counter()
    with DriverSpy() as spy:
        bad_graphs = churn_graphs(args.graphs, device, stream)
        t_graphs = time.perf_counter() - t0
        bad_caches = churn_caches(args.caches, device, stream)
        gc.collect()
    t_caches = time.perf_counter() - t0 - t_graphs
    stream.synchronize()
    after = {**sample(device), "modules": loaded_modules()}
    churn = {"graphs": args.graphs, "graph_seconds": round(t_graphs, 1), "caches": args.caches,
             "cache_seconds": round(t_caches, 1), "graph_handles_created": spy.calls["cuGraphInstantiate"],
             "leaked_handles": spy.leaked(), "wrong_outputs": bad_graphs + bad_caches,
             "before": before, "after": after}

    failures = []
    if loop["outputs_wrong"] or churn["wrong_outputs"]:
        failures.append("wrong outputs")
    if growth["device_used"] > DEVICE_SLACK or after["device_used"] - before["device_used"] > DEVICE_SLACK:
        failures.append("device memory grew")
    if growth["host_rss"] > HOST_SLACK or after["host_rss"] - before["host_rss"] > HOST_SLACK:
        failures.append("host memory grew")
    if spy.leaked():
        failures.append(f"graph handles leaked: {spy.leaked()}")
    if after["modules"] != before["modules"]:
        failures.append("modules were left loaded")

    where = "reference device (nothing about a GPU)" if small else device.name
    print(f"soak on {where}: token loop d={cfg.d}, {cfg.n_layers} layers")
    print(f"  {loop['replays']} GraphModel.forward replays in {loop['seconds']} s ({loop['us_per_forward']} us each), "
          f"{loop['outputs_checked']} outputs checked, {loop['outputs_wrong']} wrong")
    for k in ("device_used", "pool", "host_rss"):
        print(f"  {k:12s} after warm-up {warm[k] / MIB:10.1f} MiB, at the end {last[k] / MIB:10.1f} MiB "
              f"(growth {growth[k] / MIB:+.2f} MiB)")
    print(f"  {args.graphs} graphs in {churn['graph_seconds']} s and {args.caches} graph caches in "
          f"{churn['cache_seconds']} s: {churn['graph_handles_created']} executable graphs made, leaked "
          f"{spy.leaked() or 'none'}; device {before['device_used'] / MIB:.1f} -> {after['device_used'] / MIB:.1f} MiB, "
          f"host RSS {before['host_rss'] / MIB:.1f} -> {after['host_rss'] / MIB:.1f} MiB, "
          f"modules {before['modules']} -> {after['modules']}")
    print("soak: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))

    from _common import headline, write_result
    heads = [headline("device memory growth over the replays (MiB)", growth["device_used"] / MIB, 2.0, "lower"),
             headline("host RSS growth over the replays (MiB)", growth["host_rss"] / MIB, 32.0, "lower"),
             headline("graph handles leaked", float(sum(spy.leaked().values())), 0.0, "lower")]
    rows = [{"phase": "token loop replays", **{k: v for k, v in loop.items() if k != "samples"},
             "growth_bytes": growth},
            {"phase": "create and close", **churn}]
    path = write_result("soak", device, rows, heads, {"samples": s, "failures": failures})
    print(f"wrote {path}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
