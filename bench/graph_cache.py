"""The variable-batch token loop (22 layers, d = 2048, fp32) on the GPU: a
GraphCache with padding vs deviceop eager vs capture-every-step, and PyTorch
eager vs torch.cuda.CUDAGraph captured per padded size (the same size list,
the same padding, one memory pool), all in one process on the same weights.

Per-step time = median over steps of (copy the batch in, run, synchronize).
Per fixed batch, then over a random mix of batches 1..64.  Also the capture
time and the memory of the whole cache (every size), for both libraries.

    python bench/graph_cache.py [--steps 30]
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
from _common import gpu_device, headline, load_example, print_headlines, print_table, write_result  # noqa: E402
from token_model import Config, random_weights  # noqa: E402

ex = load_example("variable_batch")

BATCHES = [1, 2, 4, 8, 5, 13, 16, 32, 64]


def per_step_us(step, inputs, sync) -> float:
    step(inputs[0])
    sync()
    times = []
    for x in inputs:
        t0 = time.perf_counter()
        step(x)
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


class TorchGraphs:
    """torch.cuda.CUDAGraph per padded size, captured largest first into one pool."""

    def __init__(self, forward, sizes, d):
        import torch
        self.torch, self.sizes = torch, sizes
        self.static_in = torch.zeros((max(sizes), d), device="cuda")
        self.graphs, self.outs = {}, {}
        pool = None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture, as torch's docs ask
            for _ in range(2):
                forward(self.static_in[:1])
        torch.cuda.current_stream().wait_stream(side)
        t0 = time.perf_counter()
        for s in sorted(sizes, reverse=True):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outs[s] = forward(self.static_in[:s])
            pool = g.pool()
            self.graphs[s] = g
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    def __call__(self, x):
        b = x.shape[0]
        s = next(s for s in self.sizes if s >= b)
        self.static_in[:b].copy_(x)
        if s > b:
            self.static_in[b:s].zero_()
        self.graphs[s].replay()
        return self.outs[s][:b]


def torch_forward(cfg, weights):
    import torch
    tw = [(torch.from_dlpack(w.norm_w.tensor), torch.from_dlpack(w.wq.tensor), torch.from_dlpack(w.wo.tensor))
          for w in weights]

    def forward(h):
        for norm_w, wq, wo in tw:
            n = h * torch.rsqrt(torch.mean(h * h, dim=-1, keepdim=True) + cfg.eps) * norm_w
            h = h + (n @ wq.T) @ wo.T
        return h
    return forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-batch", type=int, default=64)
    args = ap.parse_args()
    device = gpu_device("graph_cache")
    if device is None:
        return 0
    import torch
    cfg = Config()
    stream = device.new_stream()
    weights, _ = random_weights(cfg, stream=stream)
    rng = np.random.default_rng(0)

    def inputs_of(batches):
        return [dop.from_numpy(rng.standard_normal((b, cfg.d)).astype(np.float32), stream=stream) for b in batches]

    free0 = device.memory_info()[0]
    cache = ex.make_cache(cfg, weights, stream, args.max_batch)
    t0 = time.perf_counter()
    cache.warmup(inputs_of([1])[0])
    capture_s = time.perf_counter() - t0
    stream.synchronize()
    cache_mem = free0 - device.memory_info()[0]

    tforward = torch_forward(cfg, weights)
    tfree0 = torch.cuda.mem_get_info()[0]
    tgraphs = TorchGraphs(tforward, cache.sizes, cfg.d)
    torch_mem = tfree0 - torch.cuda.mem_get_info()[0]
    tstream = torch.cuda.current_stream()

    sync = stream.synchronize
    ways = {
        "deviceop graph cache": lambda x: cache(x),
        "deviceop eager": lambda x: ex.eager_step(cfg, weights, x, stream),
        "torch eager": lambda x: tforward(torch.from_dlpack(x)),
        "torch CUDAGraph per size": lambda x: tgraphs(torch.from_dlpack(x)),
    }

    def both_sync():
        stream.synchronize()
        tstream.synchronize()

    rows, table, speedups = [], [], {}
    for b in BATCHES:
        xs = inputs_of([b] * args.steps)
        ref = ex.eager_step(cfg, weights, xs[0], stream).numpy()
        assert np.array_equal(cache(xs[0]).numpy(), ref), f"cache != eager at batch {b}"
        tg = tgraphs(torch.from_dlpack(xs[0])).cpu().numpy()
        torch_err = float(np.max(np.abs(tg - ref)) / np.max(np.abs(ref)))
        us = {name: per_step_us(fn, xs, both_sync if name.startswith("torch") else sync) for name, fn in ways.items()}
        if b in (1, 8, 64):
            us["deviceop capture every step"] = per_step_us(lambda x: ex.capture_step(cfg, weights, x, stream),
                                                            xs[:5], sync)
        speedups[b] = us["deviceop eager"] / us["deviceop graph cache"]
        rows.append({"batch": b, "padded_to": cache.size_for(b), **{f"{k} us": round(v, 1) for k, v in us.items()},
                     "cache_vs_eager": round(speedups[b], 3),
                     "cache_vs_torch_graph": round(us["torch CUDAGraph per size"] / us["deviceop graph cache"], 3),
                     "torch_graph_rel_err_vs_deviceop": torch_err})
        table.append([b, cache.size_for(b), *(f"{us[k]:.1f}" for k in ways),
                      f"{us.get('deviceop capture every step', float('nan')):.0f}", f"{speedups[b]:.2f}x"])

    mix = rng.integers(1, args.max_batch + 1, size=4 * args.steps)
    xs = inputs_of(mix)
    mix_us = {name: per_step_us(fn, xs, both_sync if name.startswith("torch") else sync) for name, fn in ways.items()}
    rows.append({"batch": "random 1..64", **{f"{k} us": round(v, 1) for k, v in mix_us.items()},
                 "cache_vs_eager": round(mix_us["deviceop eager"] / mix_us["deviceop graph cache"], 3)})
    table.append(["mix", "-", *(f"{mix_us[k]:.1f}" for k in ways), "-",
                  f"{mix_us['deviceop eager'] / mix_us['deviceop graph cache']:.2f}x"])

    print(f"{cfg.n_layers} layers, d={cfg.d}, fp32, on {device.name}; {args.steps} steps per batch")
    print_table("us per step (median)", ["batch", "padded", *ways, "capture/step", "cache vs eager"], table)
    s = cache.stats
    print(f"whole cache: {s.graphs} graphs, captured in {capture_s * 1e3:.0f} ms, {s.bytes / 2**20:.1f} MiB of "
          f"buffers ({cache_mem / 2**20:.1f} MiB device memory); torch: captured in {tgraphs.capture_s * 1e3:.0f} "
          f"ms, {torch_mem / 2**20:.1f} MiB")
    small = min(speedups[b] for b in speedups if b <= 8)
    heads = [headline("cache_speedup_vs_eager", small, 2.0, "higher")]
    path = write_result("graph_cache", device, rows, heads, {
        "cache": {"graphs": s.graphs, "sizes": list(cache.sizes), "capture_ms": round(capture_s * 1e3, 1),
                  "buffer_mib": round(s.bytes / 2**20, 2), "device_mib": round(cache_mem / 2**20, 2)},
        "torch_graphs": {"capture_ms": round(tgraphs.capture_s * 1e3, 1), "device_mib": round(torch_mem / 2**20, 2)},
        "headline_note": "cache_speedup_vs_eager is the smallest eager/cache ratio over batches <= 8"})
    print_headlines(heads, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
