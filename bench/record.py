"""Add the headline rows of benchmark result files to bench/RESULTS.md (newest first).

    python bench/record.py bench/results/launch_overhead.json [...]

Results come only from real runs (scripts/gpu-check writes the JSON); this
script copies their numbers, it never makes one up.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"
HEADER = """# Benchmark results

One row per headline metric, newest first. Each comes from a run of the named
command on the named device (through `scripts/gpu-check`); the full rows are in
`bench/results/<benchmark>.json`. Ratios carry between runs; absolute times
hold only for the named GPU.

| date | benchmark | metric | value | target | met | device | command |
|---|---|---|---|---|---|---|---|
"""


def rows_of(result: dict) -> list[str]:
    out = []
    for h in result["headline"]:
        op = "<=" if h["better"] == "lower" else ">="
        out.append(f"| {result['date']} | {result['benchmark']} | {h['metric']} | {h['value']} | {op} {h['target']} "
                   f"| {'yes' if h['met'] else 'no'} | {result['device']} | `{result['command']}` |")
    return out


def main(paths: list[str]) -> int:
    existing = RESULTS_MD.read_text().splitlines() if RESULTS_MD.exists() else []
    old_rows = [l for l in existing if l.startswith("| 2")]
    new_rows = [r for p in paths for r in rows_of(json.loads(Path(p).read_text())) if r not in old_rows]
    RESULTS_MD.write_text(HEADER + "\n".join(new_rows + old_rows) + "\n")
    print(f"{len(new_rows)} new row(s) in {RESULTS_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
