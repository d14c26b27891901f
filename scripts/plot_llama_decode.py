#!/usr/bin/env python3
"""docs/img/llama_decode.png from a run of bench/llama_decode.py (its JSON): time per
generated token of each variant against the memory floor measured in the same run.

    python scripts/plot_llama_decode.py [bench/results/llama_decode.json] [--out docs/img/llama_decode.png]

The two published anchors (msaroufim/megakernels-vs-cuda-graphs, llama/docs/RESULTS.md,
H100, as issue 27 quotes them) are drawn hatched: they come from another run, not this one.
Needs matplotlib.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = [("Hazy Research megakernel (published)", 972.78), ("CUDA graphs + PDL (published)", 979.51)]
SHORT = {"deviceop, one launch (device loop)": "deviceop, whole generation in one launch",
         "deviceop, a graph launch per token": "deviceop, one graph launch a token",
         "torch.cuda.CUDAGraph, plain PyTorch step": "torch.cuda.CUDAGraph of a PyTorch step",
         "Hugging Face generate, eager": "Hugging Face generate (eager)",
         "Hugging Face generate, static cache + torch.compile": "HF generate, static cache + compile"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", nargs="?", default=str(ROOT / "bench" / "results" / "llama_decode.json"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "llama_decode.png"))
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(Path(args.result).read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    floor = result["floor_us"]
    bars = [("memory floor (this run)", floor, "floor")]
    for variant, label in SHORT.items():
        r = rows.get(variant, {})
        if "us_per_token" in r:
            bars.append((label, r["us_per_token"], "deviceop" if variant.startswith("deviceop") else "other"))
        elif variant in rows:
            bars.append((label, "failed: " + r["error"].split(". ")[0].removeprefix("RuntimeError: Error: "), "failed"))
    bars[3:3] = [(label, us, "published") for label, us in PUBLISHED]
    ctx = next((r for v, r in rows.items() if v.startswith("deviceop, context")), None)

    colors = {"floor": "#999999", "deviceop": "#1f77b4", "published": "#ffffff", "other": "#ff7f0e"}
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ys = list(range(len(bars)))[::-1]
    for y, (label, us, kind) in zip(ys, bars):
        if kind == "failed":
            ax.text(floor * 1.1, y, us, va="center", fontsize=7.5, color="#aa0000")
            continue
        ax.barh(y, us, color=colors[kind], edgecolor="#333333", hatch="//" if kind == "published" else None)
        ax.text(us * 1.04, y, f"{us:,.0f} us  ({us / floor:.2f}x floor)", va="center", fontsize=8)
    ax.set_yticks(ys, [b[0] for b in bars], fontsize=8)
    ax.set_ylim(-0.7, len(bars) - 0.3)
    ax.set_xscale("log")
    ax.set_xlim(floor * 0.5, max(b[1] for b in bars if b[2] != "failed") * 4)
    ax.axvline(floor, color="#666666", lw=0.8, ls="--")
    ax.set_xlabel("microseconds per generated token (log scale; lower is better)")
    title = (f"Llama-3.2-1B decode, batch 1, 32-token prompt + 128 tokens, bf16 weights\n"
             f"{result['device']}, {result['date']}")
    if ctx:
        title += (f"; at context 4096: deviceop {ctx['us_per_token']:,.0f} us vs floor {ctx['floor_us']:,.0f} us "
                  f"({ctx['vs_floor']:.2f}x)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
