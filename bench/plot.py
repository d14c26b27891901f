"""Figures from the recorded benchmark results: bench/results/*.json -> docs/img/*.png.

    python bench/plot.py [--results bench/results] [--out docs/img]

Needs matplotlib (pip install -e '.[plot]').  Each figure names the device,
the date and the command of the results it shows; a results file that lacks
what a figure needs is reported, and the other figures are still drawn.

* token_loop.png: µs per token of each variant of the token loop, against the
  memory-bandwidth floor (bench/token_loop.py)
* exercise2_speedup.png: the tutorial's exercise 2, graph vs eager speedup as
  the number of layers grows (bench/token_loop.py)
* conv_gn_act.png: the fused Conv2D+GroupNorm+SiLU against its baselines, per
  shape (bench/conv_gn_act.py)
* graph_cache.png: the variable-batch token loop, graph cache vs eager and
  PyTorch, per batch size (bench/graph_cache.py)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# one colour per kind of result, the same in every figure
DEVICEOP, DEVICEOP_ALT, TORCH, TORCH_GRAPH, FLOOR = "#1f6fb4", "#7fb2e0", "#d9822b", "#a34d00", "#555555"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit("bench/plot.py needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)")
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    plt.rcParams.update({"figure.dpi": 110, "font.size": 10, "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _source(res: dict) -> str:
    return f"{res.get('device', '?')}, {res.get('date', '?')}: {res.get('command', '?')}"


def _finish(plt, fig, ax, res, path: Path) -> Path:
    fig.text(0.01, 0.01, _source(res), fontsize=7, color=FLOOR)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def token_loop(plt, res: dict, out: Path) -> Path:
    names = {"deviceop eager": "deviceop eager", "torch eager": "PyTorch eager",
             "torch.cuda.CUDAGraph": "torch.cuda.CUDAGraph", "deviceop graph (combinators)": "deviceop graph",
             "deviceop graph, fused fp32 + PDL": "deviceop graph, fused (2 kernels a layer)"}
    rows = {r["variant"]: r for r in res["rows"]}
    missing = [n for n in names if n not in rows]
    if missing:
        raise KeyError(f"rows {missing}")
    labels = list(names.values())
    us = [rows[n]["gpu_us_per_token"] for n in names]
    colours = [DEVICEOP_ALT, TORCH, TORCH_GRAPH, DEVICEOP, DEVICEOP]
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    bars = ax.barh(labels[::-1], us[::-1], color=colours[::-1])
    ax.bar_label(bars, fmt="%.0f µs", padding=3, fontsize=9)
    ax.axvline(res["floor_us"], color=FLOOR, linestyle="--", linewidth=1,
               label=f"floor: the weights read once, {res['floor_us']:.0f} µs")
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    ax.set_xlabel("GPU time per token, µs (lower is better)")
    ax.set_xlim(0, max(us) * 1.18)
    ax.set_title("Token loop: 22 layers, d=2048, fp32 weights")
    return _finish(plt, fig, ax, res, out / "token_loop.png")


def exercise2(plt, res: dict, out: Path) -> Path:
    rows = res["exercise2_speedup_vs_layers"]
    layers = [r["n_layers"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(layers, [r["speedup"] for r in rows], marker="o", color=DEVICEOP)
    for r in rows:
        ax.annotate(f"{r['speedup']:.1f}x", (r["n_layers"], r["speedup"]), textcoords="offset points",
                    xytext=(0, 7), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(layers, [str(n) for n in layers])
    ax.set_ylim(0, max(r["speedup"] for r in rows) * 1.25)
    ax.set_xlabel("n_layers (4 kernels a layer)")
    ax.set_ylabel("eager µs / graph µs")
    ax.set_title("Graph speedup over eager, one token with a synchronization")
    return _finish(plt, fig, ax, res, out / "exercise2_speedup.png")


def conv(plt, res: dict, out: Path) -> Path:
    import numpy as np
    series = [("fused_us", "deviceop fused conv+GN+SiLU", DEVICEOP), ("cudnn_conv_us", "cuDNN conv alone", TORCH_GRAPH),
              ("torch_compile_us", "torch.compile conv+GN+SiLU", TORCH), ("torch_eager_us", "PyTorch eager", "#f0b27a")]
    rows = res["rows"]
    x = np.arange(len(rows))
    width = 0.2
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for i, (key, label, colour) in enumerate(series):
        ax.bar(x + (i - 1.5) * width, [r[key] for r in rows], width, label=label, color=colour)
    ax.set_xticks(x, [f"C={r['C']}\n{r['HW']}x{r['HW']}, N={r['N']}" for r in rows], fontsize=8)
    ax.set_ylabel("µs (lower is better)")
    ax.set_title("Fused Conv2D 3x3 + GroupNorm + SiLU, fp16 NHWC, per shape")
    ax.legend(fontsize=8, frameon=False)
    return _finish(plt, fig, ax, res, out / "conv_gn_act.png")


def graph_cache(plt, res: dict, out: Path) -> Path:
    rows = [r for r in res["rows"] if isinstance(r["batch"], int) and r["batch"] == r["padded_to"]]
    batches = [r["batch"] for r in rows]
    series = [("deviceop graph cache us", "deviceop GraphCache", DEVICEOP, "o"),
              ("torch CUDAGraph per size us", "torch.cuda.CUDAGraph, one per size", TORCH_GRAPH, "s"),
              ("torch eager us", "PyTorch eager", TORCH, "^"),
              ("deviceop eager us", "deviceop eager", DEVICEOP_ALT, "v")]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for key, label, colour, marker in series:
        ax.plot(batches, [r[key] for r in rows], marker=marker, color=colour, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_ylim(0, None)
    ax.set_xlabel("batch size (tokens a step)")
    ax.set_ylabel("µs a step (lower is better)")
    ax.set_title("Variable batch: 22 layers, d=2048, one step")
    ax.legend(fontsize=8, frameon=False)
    return _finish(plt, fig, ax, res, out / "graph_cache.png")


FIGURES = [("token_loop", token_loop), ("token_loop", exercise2), ("conv_gn_act", conv), ("graph_cache", graph_cache)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"),
                    help="folder of the benchmarks' JSON (default: bench/results)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"), help="folder for the PNGs (default: docs/img)")
    args = ap.parse_args()
    plt = _pyplot()
    results, out = Path(args.results), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    missing = 0
    for bench, draw in FIGURES:
        path = results / f"{bench}.json"
        if not path.exists():
            print(f"skipped {draw.__name__}: no {path} (run bench/{bench}.py on the GPU)")
            missing += 1
            continue
        try:
            print(f"wrote {draw(plt, json.loads(path.read_text()), out)}")
        except KeyError as e:
            print(f"skipped {draw.__name__}: {path} has no {e.args[0]} (rerun bench/{bench}.py)")
            missing += 1
    return 1 if missing == len(FIGURES) else 0


if __name__ == "__main__":
    sys.exit(main())
