"""Fused Conv2D -> GroupNorm -> SiLU (issue 6) on the GPU, against PyTorch, in one process.

For C in {320, 640, 1280} at H=W in {64, 32, 16} (7.55 GFLOP per image, 3x3,
G=32) and N in {1, 2, 8}, every variant is timed as CUDA-graph replays
(median over repetitions of a loop of replays between CUDA events; the
variants of one shape take turns within each repetition):

* bare conv: deviceop's conv kernel without statistics (on the H100 the WGMMA
  kernel, kernels/conv_wgmma.cu) vs cuDNN (torch F.conv2d)
* fused: deviceop (two launches) vs torch eager conv+GN+SiLU and torch.compile
  of the same function (both captured with torch.cuda.CUDAGraph)

torch.compile failing here is reported as a failed baseline, never a number.

    python bench/conv_gn_act.py [--reps 11] [--sweep {wgmma,cutlass}]

``--sweep`` also times the bare conv for every tile and split-K of one kernel's
menu at N=1 and 2 (what chose kernels/conv.py's heuristics) and writes it to
bench/results/conv_gn_act_{wgmma,tile}_sweep.json.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import deviceop as dop  # noqa: E402
from _common import gpu_device, headline, print_headlines, print_table, write_result  # noqa: E402
from deviceop.kernels.conv import MAX_SPLIT_K, SPLIT_FIXUPS, TILES, WGMMA_MAX_SPLIT_K, WGMMA_TILES, ConvGnAct  # noqa: E402

SHAPES = [(c, hw, n) for c, hw in ((320, 64), (640, 32), (1280, 16)) for n in (1, 2, 8)]
PEAK_TFLOPS = 989.4


def gflop(c, hw, n):
    return 2 * n * hw * hw * c * c * 9 / 1e9


def time_graphs(replays: dict, sync, reps: int, inner: int) -> dict:
    """Median microseconds of one replay of each graph: `reps` rounds, each timing
    `inner` replays of every graph in turn between CUDA events, so that whatever
    drifts during the run (clocks, the host) lands on every variant alike.
    Everything runs on one stream (torch's current stream is deviceop's, see
    main), so the events bracket the replays themselves."""
    import torch
    for replay in replays.values():
        for _ in range(3):
            replay()
    sync()
    samples = {name: [] for name in replays}
    for _ in range(reps):
        for name, replay in replays.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                replay()
            b.record()
            b.synchronize()
            samples[name].append(a.elapsed_time(b) * 1e3 / inner)
    return {name: statistics.median(v) for name, v in samples.items()}


def time_graph(replay, sync, reps: int, inner: int) -> float:
    """Median microseconds of one replay of one graph (see time_graphs)."""
    return time_graphs({"graph": replay}, sync, reps, inner)["graph"]


def torch_graph(fn, stream):
    """Capture fn() (already warmed up) with torch.cuda.CUDAGraph; returns replay."""
    import torch
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    return g.replay


def sweep_one(n, hw, c, tile, split, fixup, tensors, stream, sync, args) -> dict:
    """One configuration of the --sweep menu: bare conv and fused, or why it cannot run."""
    Y, X, W, B, GA, BE, OUT = tensors
    row = {"C": c, "HW": hw, "N": n, "tile": tile, "split_k": split, "split_fixup": fixup}
    try:
        p = ConvGnAct(n, hw, hw, c, c, groups=32, tile=tile, split_k=split, split_fixup=fixup, stream=stream)
    except dop.DeviceOpError as exc:
        return {**row, "error": str(exc)[:120]}
    row["ctas"] = p.mt * p.nt * split
    for key, op in (("bare_conv_us", p.conv(Y, X, W, B)), ("fused_us", p(OUT, X, W, B, GA, BE))):
        graph = op.graph_on(stream)
        row[key] = time_graph(graph.replay, sync, args.reps, args.inner)
        graph.close()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--sweep", choices=("wgmma", "cutlass"))
    ap.add_argument("--compile-budget-s", type=float, default=150.0,
                    help="stop compiling torch.compile baselines after this long (the rest are reported as skipped)")
    args = ap.parse_args()
    device = gpu_device("conv_gn_act")
    if device is None:
        return 0
    import torch
    import torch.nn.functional as F
    torch.backends.cudnn.benchmark = True
    try:  # one compiled function, 9 shapes: let dynamo keep a graph per shape instead of falling back to eager
        torch._dynamo.config.recompile_limit = 64
    except AttributeError:
        torch._dynamo.config.cache_size_limit = 64
    stream = device.new_stream()
    tstream = torch.cuda.ExternalStream(int(stream.handle))
    torch.cuda.set_stream(tstream)   # torch's work, its graphs and the timing events share deviceop's stream
    sync = stream.synchronize
    rows, sweep_rows = [], []
    compile_spent = 0.0
    t_start = time.time()

    for c, hw, n in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(c + hw + n)
        with torch.cuda.stream(tstream):
            x = torch.randn(n, c, hw, hw, device="cuda", generator=g).half().to(memory_format=torch.channels_last)
            w = (torch.randn(c, c, 3, 3, device="cuda", generator=g) / math.sqrt(9 * c)).half() \
                .to(memory_format=torch.channels_last)
            b = torch.randn(c, device="cuda", generator=g).half()
            gamma = 1 + 0.1 * torch.randn(c, device="cuda", generator=g)
            beta = 0.1 * torch.randn(c, device="cuda", generator=g)
            out_t = torch.empty(n, hw, hw, c, device="cuda", dtype=torch.half)
        torch.cuda.synchronize()
        # deviceop views of the same memory (NHWC / KRSC, channels-last torch tensors are exactly that)
        X = dop.from_dlpack(x.permute(0, 2, 3, 1))
        W = dop.from_dlpack(w.permute(0, 2, 3, 1))
        B, GA, BE, OUT = (dop.from_dlpack(t) for t in (b, gamma, beta, out_t))
        plan = ConvGnAct(n, hw, hw, c, c, groups=32, act="silu", stream=stream)
        Y = dop.empty([n, hw, hw, c], "float16", stream=stream)
        conv_graph = plan.conv(Y, X, W, B).graph_on(stream)
        fused_graph = plan(OUT, X, W, B, GA, BE).graph_on(stream)
        graphs = {"bare_conv_us": conv_graph.replay, "fused_us": fused_graph.replay}

        def eager():
            return F.silu(F.group_norm(F.conv2d(x, w, b, padding=1), 32, gamma.half(), beta.half(), 1e-5))

        def cudnn():
            return F.conv2d(x, w, b, padding=1)

        row = {"C": c, "HW": hw, "N": n, "tile": plan.tile.name, "split_k": plan.split_k,
               "split_fixup": plan.split_fixup}
        with torch.cuda.stream(tstream):
            for name, fn in (("cudnn_conv_us", cudnn), ("torch_eager_us", eager)):
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                graphs[name] = torch_graph(fn, tstream)
            if compile_spent < args.compile_budget_s:
                t0 = time.time()
                try:
                    compiled = torch.compile(eager, dynamic=False)
                    for _ in range(3):
                        compiled()
                    torch.cuda.synchronize()
                    graphs["torch_compile_us"] = torch_graph(compiled, tstream)
                except Exception as exc:  # a failed baseline is reported, never invented
                    row["torch_compile_us"] = None
                    row["torch_compile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                compile_spent += time.time() - t0
            else:
                row["torch_compile_us"] = None
                row["torch_compile_error"] = f"skipped: torch.compile budget of {args.compile_budget_s:.0f} s spent"
            row.update(time_graphs(graphs, torch.cuda.synchronize, args.reps, args.inner))
            # correctness of this very run against torch eager in fp32
            ref = F.silu(F.group_norm(F.conv2d(x.float(), w.float(), b.float(), padding=1), 32, gamma, beta, 1e-5))
        torch.cuda.synchronize()
        fused_graph.replay()
        sync()
        got = out_t.float().permute(0, 3, 1, 2)
        row["max_abs_err"] = float((got - ref).abs().max())
        row["rel_rms_err"] = float(((got - ref) ** 2).mean().sqrt() / (ref ** 2).mean().sqrt())
        t_conv = row["bare_conv_us"]
        row.update({"conv_tflops": gflop(c, hw, n) / t_conv * 1e3,  # GFLOP / us = PFLOP/s
                    "conv_pct_of_peak": 100 * gflop(c, hw, n) / t_conv * 1e3 / PEAK_TFLOPS})
        rows.append(row)

        if args.sweep and n <= 2:
            menu, max_split = (WGMMA_TILES, WGMMA_MAX_SPLIT_K) if args.sweep == "wgmma" else (TILES, MAX_SPLIT_K)
            for name in menu:
                for split in range(1, max_split + 1):
                    for fixup in (SPLIT_FIXUPS if args.sweep == "wgmma" and split > 1 else (None,)):
                        sweep_rows.append(sweep_one(n, hw, c, name, split, fixup, (Y, X, W, B, GA, BE, OUT), stream,
                                                    sync, args))

    r2 = lambda v: None if v is None else round(v, 1)  # noqa: E731
    fix = lambda r: f"/{r['split_fixup'][0]}" if r.get("split_fixup") else ""  # noqa: E731  (c)luster, (w)orkspace
    print_table("conv -> GN -> SiLU, NHWC fp16, 3x3, G=32 (us per graph replay, medians; split /c: in a cluster, "
                "/w: through the workspace)",
                ["C", "HW", "N", "tile", "split", "bare", "cuDNN", "bare/cuDNN", "fused", "eager", "compile",
                 "vs eager", "vs compile", "%peak", "max err", "rel rms"],
                [[r["C"], r["HW"], r["N"], r["tile"], f"{r['split_k']}{fix(r)}", r2(r["bare_conv_us"]),
                  r2(r["cudnn_conv_us"]),
                  f"{r['cudnn_conv_us'] / r['bare_conv_us']:.2f}x", r2(r["fused_us"]), r2(r["torch_eager_us"]),
                  r2(r["torch_compile_us"]) if r["torch_compile_us"] else "failed",
                  f"{r['torch_eager_us'] / r['fused_us']:.2f}x",
                  f"{r['torch_compile_us'] / r['fused_us']:.2f}x" if r["torch_compile_us"] else "-",
                  f"{r['conv_pct_of_peak']:.0f}", f"{r['max_abs_err']:.1e}", f"{r['rel_rms_err']:.1e}"]
                 for r in rows])
    if sweep_rows:
        print_table("tile sweep (bare conv / fused, us)", ["C", "HW", "N", "tile", "split", "ctas", "bare", "fused"],
                    [[r["C"], r["HW"], r["N"], r["tile"], f"{r['split_k']}{fix(r)}", r.get("ctas", "-"),
                      r2(r.get("bare_conv_us")),
                      r2(r.get("fused_us"))] for r in sweep_rows])
    for r in rows:
        if r.get("torch_compile_error"):
            print(f"torch.compile C={r['C']} HW={r['HW']} N={r['N']}: {r['torch_compile_error']}")

    eager_ratios = [r["torch_eager_us"] / r["fused_us"] for r in rows]
    compile_n12 = [r["torch_compile_us"] / r["fused_us"] for r in rows if r["N"] <= 2 and r["torch_compile_us"]]
    conv_n12 = [r["cudnn_conv_us"] / r["bare_conv_us"] for r in rows if r["N"] <= 2]
    headlines = [headline("fused_vs_torch_eager_geomean", math.exp(statistics.mean(map(math.log, eager_ratios))),
                          1.5, "higher"),
                 headline("bare_conv_vs_cudnn_min_n12", min(conv_n12), 0.85, "higher")]
    n12_total = sum(1 for r in rows if r["N"] <= 2)
    if compile_n12:
        h = headline("fused_vs_torch_compile_min_n12", min(compile_n12), 1.0, "higher")
        if len(compile_n12) < n12_total:  # a failed baseline cannot count as met
            h["met"] = False
            h["note"] = f"torch.compile measured for {len(compile_n12)} of {n12_total} N<=2 shapes"
        headlines.insert(1, h)
    else:
        headlines.insert(1, {"metric": "fused_vs_torch_compile_min_n12", "value": None, "target": 1.0,
                             "better": "higher", "met": False, "note": "torch.compile failed on every shape"})
    accuracy_ok = all(r["max_abs_err"] <= 1e-2 and r["rel_rms_err"] <= 1e-3 for r in rows)
    if sweep_rows:
        import json
        sweep_path = ROOT / "bench" / "results" / f"conv_gn_act_{'wgmma' if args.sweep == 'wgmma' else 'tile'}_sweep.json"
        record = {"device": device.name, "command": " ".join(sys.argv), "tile_sweep": sweep_rows}
        if args.sweep == "wgmma":   # what the cost model counts rounds of clusters against
            from deviceop.kernels.conv import cluster_capacity
            record["cluster_capacity"] = cluster_capacity(device)
        sweep_path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"sweep written to {sweep_path}")
    path = write_result("conv_gn_act", device, rows, headlines,
                        {"tile_sweep": sweep_rows, "accuracy_ok": accuracy_ok,
                         "roofline": {"gflop_per_image": 7.55, "peak_tflops_fp16_dense": PEAK_TFLOPS},
                         "wall_s": round(time.time() - t_start, 1)})
    print_headlines(headlines, path)
    print(f"accuracy vs torch fp32 (max abs <= 1e-2, rel rms <= 1e-3): {'ok' if accuracy_ok else 'FAILED'}")
    return 0 if accuracy_ok else 1


if __name__ == "__main__":
    sys.exit(main())
