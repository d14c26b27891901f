"""The token loop with a batch that changes every step (1 to 64 tokens), three ways:

* **graph cache**: ``GraphCache`` replays a graph captured per padded batch
  size (1, 2, 4, 8, 16, ... 64), copying the batch in and slicing the output;
  ``SwitchGraphCache`` (its SWITCH mode) holds one graph with a branch per size
  and lets the device pick the branch from the batch;
* **eager**: build the batched forward for the exact batch and run it;
* **capture every step**: build, capture, replay and close a graph per step
  (what a naive user of CUDA graphs does with changing shapes).

Every step's output of the cache and of per-step capture is checked against
eager (max abs difference printed), and the first step against float64 NumPy.
Then µs per step for each.  Without a GPU it runs a small configuration on
the reference device and says so.

    python examples/variable_batch.py [--d 2048] [--layers 22] [--steps 48] [--max-batch 64]

Flags are checked first: ``--d`` must be a multiple of 128.  Timings are
printed on a GPU only.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import deviceop as dop  # noqa: E402
from deviceop import GraphCache, SwitchGraphCache  # noqa: E402
from token_model import (HelpFormatter, build_batched_forward, numpy_forward, positive, random_weights,  # noqa: E402
                         size_problem, sized)


def make_cache(cfg, weights, stream, max_batch, kind=GraphCache):
    """The batched forward behind a graph cache: ``cache(x)`` for any batch up to max_batch
    (``kind``: GraphCache, a graph per size, or SwitchGraphCache, one graph of branches)."""
    def forward(ws, x):
        return build_batched_forward(cfg, weights, x, ws.empty)
    return kind(forward, stream=stream, max_size=max_batch)


def eager_step(cfg, weights, x, stream):
    alloc = lambda shape: dop.empty(shape, stream=stream)  # noqa: E731
    return build_batched_forward(cfg, weights, x, alloc).sync_on(stream)


def capture_step(cfg, weights, x, stream):
    """Capture a graph for exactly this batch, replay it once, close it."""
    staged = dop.empty(x.shape, stream=stream)
    bufs = []
    alloc = lambda shape: bufs.append(dop.empty(shape, stream=stream)) or bufs[-1]  # noqa: E731
    with build_batched_forward(cfg, weights, staged, alloc).graph_on(stream) as graph:
        out = graph.take_output()
        dop.api.memcpy(staged, x).async_on(stream)
        graph.launch().sync_on(stream)
    return out


def timed(fn, inputs, stream):
    t0 = time.perf_counter()
    for x in inputs:
        fn(x)
        stream.synchronize()
    return (time.perf_counter() - t0) / len(inputs) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--d", type=positive, default=None,
                    help="hidden size, a multiple of 128 (default: 2048 on a GPU, 256 on the reference device)")
    ap.add_argument("--layers", type=positive, default=None,
                    help="number of layers (default: 22 on a GPU, 2 on the reference device)")
    ap.add_argument("--steps", type=positive, default=48, help="steps, each with a random batch size")
    ap.add_argument("--max-batch", type=positive, default=64, help="the largest batch (and the cache's largest graph)")
    args = ap.parse_args()
    if args.d is not None and size_problem(args.d):   # the flags first: a usage error, not a kernel's traceback
        ap.error(size_problem(args.d))
    device = dop.Device(0)
    small = device.is_reference
    cfg = sized(args.d or (256 if small else 2048), args.layers or (2 if small else 22))
    stream = device.new_stream()
    weights, host = random_weights(cfg, stream=stream)
    rng = np.random.default_rng(0)
    batches = rng.integers(1, args.max_batch + 1, size=args.steps)
    host_inputs = [rng.standard_normal((b, cfg.d)).astype(np.float32) for b in batches]
    inputs = [dop.from_numpy(h, stream=stream) for h in host_inputs]
    where = "the reference device (no GPU: NumPy; small defaults, no timings)" if small else device.name
    print(f"{cfg.n_layers} layers, d={cfg.d}, batch 1..{args.max_batch} over {args.steps} steps, on {where}")

    cache = make_cache(cfg, weights, stream, args.max_batch)
    t0 = time.perf_counter()
    cache.warmup(inputs[0])
    warm = time.perf_counter() - t0
    took = "" if small else f" in {warm * 1e3:.0f} ms"
    print(f"graph cache: {len(cache)} graphs (sizes {list(cache.sizes)}) captured{took}, "
          f"{cache.stats.bytes / 2**20:.1f} MiB of buffers")

    switched = make_cache(cfg, weights, stream, args.max_batch, SwitchGraphCache)
    switched.warmup(inputs[0])
    print(f"switch cache: one graph with a branch per size, {switched.stats.bytes / 2**20:.1f} MiB of buffers")

    worst_cache = worst_capture = 0.0
    for x in inputs:
        ref = eager_step(cfg, weights, x, stream).numpy()
        worst_cache = max(worst_cache, float(np.max(np.abs(cache(x).numpy() - ref))),
                          float(np.max(np.abs(switched(x).numpy() - ref))))
        worst_capture = max(worst_capture, float(np.max(np.abs(capture_step(cfg, weights, x, stream).numpy() - ref))))
    exact = numpy_forward(cfg, host, host_inputs[0])
    got = cache(inputs[0]).numpy()
    rel = float(np.max(np.abs(got - exact)) / np.max(np.abs(exact)))
    print(f"max |cache - eager| (either cache) = {worst_cache:.2e}, max |capture-every-step - eager| = {worst_capture:.2e}, "
          f"cache vs float64 NumPy (batch {batches[0]}): {rel:.2e}")

    if not small:   # the reference device runs NumPy: its timings say nothing about a GPU
        us = {"graph cache": timed(cache, inputs, stream),
              "switch cache": timed(switched, inputs, stream),
              "eager": timed(lambda x: eager_step(cfg, weights, x, stream), inputs, stream),
              "capture every step": timed(lambda x: capture_step(cfg, weights, x, stream), inputs, stream)}
        for name, v in us.items():
            print(f"  {name:<20} {v:9.1f} us/step  ({us['eager'] / v:.2f}x eager)")
    s = cache.stats
    print(f"cache stats: {s.hits} hits, {s.misses} misses, {s.captures} captures, {s.fallbacks} fallbacks")
    # on the GPU the cache computes every row exactly as eager does (same kernels, same
    # summation order); NumPy's float64 matmul may round differently per batch shape
    tol = 1e-5 * float(np.max(np.abs(exact))) if small else 0.0
    ok = worst_cache <= tol and worst_capture <= tol and rel < 1e-5
    print("ok: the cache and per-step capture match eager" if ok else f"FAILED: above the tolerance {tol:.1e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
