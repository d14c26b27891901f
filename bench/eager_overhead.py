"""The 22-layer, d=2048 forward of seed 001 (88 launches), executed eagerly.

Three ways, one process, same CUBINs, same buffers:

* deviceop eager: the combinator op tree built per token (``build_forward``)
  and executed with ``async_on``; build time and execution time are timed
  separately (host µs per token and per launch).
* bare cuda.core loop: 88 ``cuda.core.launch`` calls per token with every
  argument converted once, outside the loop — what a hand-written loop costs.
* deviceop Function.launch loop: the launch primitive alone, for reference.

Each is timed in two regimes, each variant against the bare loop of its own regime:

* token loop (the headline): every token first builds its tree (the baselines
  build it too, and drop it), then launches, as a program that builds and runs
  each token does.  Every variant starts its token with the GPU idle (the
  build outlasts the previous token's kernels) and a fresh tree in the caches.
* back to back: 200 trees built beforehand, executed one after the other,
  against the bare loop back to back: the GPU stays busy, and the trees have
  long left the CPU's caches.

The launch path's cost depends on the regime (a launch into an idle GPU costs
the host more than one queued behind others), so a ratio is only read within one.
Host time is what is measured: the GPU runs each token in ~0.3 ms, faster
than Python can issue 88 launches, so the loops are host-bound.
Headline: eager_vs_bare_launch_loop = deviceop execution / bare loop in the
token loop (lower, target 1.3).  Without a GPU, scripts/eager_tree_cpu.py
times the same execution's host cost with the driver call stubbed (the part
deviceop's Python adds).

    python bench/eager_overhead.py [--tokens 200] [--reps 5]
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
from _common import gpu_device, print_headlines, headline, print_table, write_result  # noqa: E402
from token_model import Config, LayerBuffers, build_forward, numpy_forward, random_weights  # noqa: E402
from deviceop.kernels import add, matvec, rms_norm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    device = gpu_device("eager_overhead")
    if device is None:
        return 0
    cfg = Config()
    stream = device.new_stream()
    weights, host_w = random_weights(cfg, seed=0, stream=stream)
    raw = [[dop.empty(shape, stream=stream) for shape in ([1, cfg.d], [cfg.d], [cfg.d], [cfg.d])]
           for _ in range(cfg.n_layers)]
    x_host = np.random.default_rng(1).standard_normal(cfg.d).astype(np.float32)
    x = dop.from_numpy(x_host, stream=stream)
    n_launch = 4 * cfg.n_layers

    def build():
        bufs = [LayerBuffers(*(t.into_shared() for t in r)) for r in raw]
        return build_forward(cfg, weights, x, bufs)

    # correctness, and warm-up (compile + load every module)
    forward, out = build()
    forward.sync_on(stream)
    got = out.sync_on(stream).numpy()
    ref = numpy_forward(cfg, host_w, x_host)
    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    assert err < 1e-5, f"deviceop eager forward is wrong: rel err {err}"

    # the bare loop: same functions (CUBINs), every argument converted once
    import cuda.core as cc
    cc.Device(device.ordinal).set_current()
    core_stream = cc.Stream.from_handle(int(stream.handle))
    fns = {name: k.function(device, tuple(g)) for name, k, g in
           (("rms", rms_norm, cfg.rms_generics()), ("mv", matvec, cfg.mv_generics()), ("add", add, [cfg.block]))}
    kern = {n: cc.Kernel.from_handle(int(f.handle)) for n, f in fns.items()}
    ccfg = {"rms": cc.LaunchConfig(grid=1, block=cfg.rms_generics()[1]),
            "mv": cc.LaunchConfig(grid=cfg.d // cfg.bn, block=32 * cfg.bn),
            "add": cc.LaunchConfig(grid=cfg.d // cfg.block, block=cfg.block // 4)}
    eps = np.float32(cfg.eps)
    plan = []
    hidden = x
    for w, (norm, q, o, res) in zip(weights, raw):
        plan += [(kern["rms"], ccfg["rms"], (norm.data_ptr, hidden.data_ptr, w.norm_w.tensor.data_ptr, eps)),
                 (kern["mv"], ccfg["mv"], (q.data_ptr, norm.data_ptr, w.wq.tensor.data_ptr)),
                 (kern["mv"], ccfg["mv"], (o.data_ptr, q.data_ptr, w.wo.tensor.data_ptr)),
                 (kern["add"], ccfg["add"], (res.data_ptr, hidden.data_ptr, o.data_ptr))]
        hidden = res

    def bare_token():
        for k, c, a in plan:
            cc.launch(core_stream, c, k, *a)

    bare_token()
    stream.synchronize()
    bare_err = float(np.max(np.abs(raw[-1][3].numpy(stream=stream) - ref)) / np.max(np.abs(ref)))
    assert bare_err < 1e-5, f"bare loop is wrong: rel err {bare_err}"

    # the primitive alone: Function.launch with Tensors, configs made once
    dcfg = {n: dop.LaunchConfig(c.grid, c.block) for n, c in ccfg.items()}
    prim = []
    hidden = x
    for w, (norm, q, o, res) in zip(weights, raw):
        prim += [(fns["rms"].launch, dcfg["rms"], (norm, hidden, w.norm_w.tensor, cfg.eps)),
                 (fns["mv"].launch, dcfg["mv"], (q, norm, w.wq.tensor)),
                 (fns["mv"].launch, dcfg["mv"], (o, q, w.wo.tensor)),
                 (fns["add"].launch, dcfg["add"], (res, hidden, o))]
        hidden = res

    def prim_token():
        for f, c, a in prim:
            f(stream, c, *a)

    def timed(fn, tokens):
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(tokens):
            fn()
        t = time.perf_counter() - t0
        stream.synchronize()
        return t / tokens * 1e6

    def token_loop(execute, tokens):
        """(build, execute) host µs per token: each token builds its tree, then
        ``execute(tree)`` launches (the baselines ignore the tree)."""
        stream.synchronize()
        spent_build = spent_exec = 0.0
        for _ in range(tokens):
            t0 = time.perf_counter()
            tree = build()
            t1 = time.perf_counter()
            execute(tree)
            spent_exec += time.perf_counter() - t1
            spent_build += t1 - t0
        stream.synchronize()
        return spent_build / tokens * 1e6, spent_exec / tokens * 1e6

    samples = {k: [] for k in ("bare", "prim", "eager", "build", "bare_b2b", "eager_b2b")}
    for _ in range(args.reps):
        b, e = token_loop(lambda tree: tree[0].async_on(stream), args.tokens)
        samples["build"].append(b)
        samples["eager"].append(e)
        samples["bare"].append(token_loop(lambda _: bare_token(), args.tokens)[1])
        samples["prim"].append(token_loop(lambda _: prim_token(), args.tokens)[1])
        samples["bare_b2b"].append(timed(bare_token, args.tokens))
        trees = [build() for _ in range(args.tokens)]
        it = iter(trees)
        samples["eager_b2b"].append(timed(lambda: next(it)[0].async_on(stream), args.tokens))
        del trees, it
    med = {k: statistics.median(v) for k, v in samples.items()}

    def pair_ratio(a, b):  # the median of the per-repetition ratios
        return statistics.median([x / y for x, y in zip(samples[a], samples[b])])

    ratio = pair_ratio("eager", "bare")
    names = {"bare": ("bare cuda.core loop", "token loop", "bare"),
             "prim": ("deviceop Function.launch loop", "token loop", "bare"),
             "eager": ("deviceop eager (execute)", "token loop", "bare"),
             "build": ("deviceop eager (build the op tree)", "token loop", "bare"),
             "bare_b2b": ("bare cuda.core loop", "back to back", "bare_b2b"),
             "eager_b2b": ("deviceop eager (execute trees built beforehand)", "back to back", "bare_b2b")}
    rows, table = [], []
    for k, (name, regime, base) in names.items():
        rows.append({"variant": name, "regime": regime, "us_per_token": round(med[k], 1),
                     "us_per_launch": round(med[k] / n_launch, 3),
                     "spread_us_per_token": [round(min(samples[k]), 1), round(max(samples[k]), 1)],
                     "vs_bare": round(pair_ratio(k, base), 3)})
        table.append([name, regime, f"{med[k]:.0f}", f"{med[k] / n_launch:.2f}", f"{pair_ratio(k, base):.2f}x"])
    heads = [headline("eager_vs_bare_launch_loop", ratio, 1.3, "lower")]
    path = write_result("eager_overhead", device, rows, heads,
                        {"config": {"d": cfg.d, "n_layers": cfg.n_layers, "launches_per_token": n_launch,
                                    "tokens": args.tokens, "reps": args.reps, "rel_err_vs_float64": err}})
    print_table(f"eager 22-layer forward on {device.name} (host time, median of {args.reps} x {args.tokens} tokens)",
                ["variant", "regime", "us/token", "us/launch", "vs bare"], table)
    print_headlines(heads, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
