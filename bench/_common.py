"""Shared pieces of the benchmarks: versions, the result file format (shared/BENCH.md), timing."""
from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import json
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load_example(name: str):
    """examples/<name>.py imported as module ``example_<name>`` (a benchmark may share its name,
    as bench/token_loop.py does examples/token_loop.py's)."""
    import importlib.util
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def versions() -> dict:
    import deviceop as dop
    from deviceop.runtime import driver
    out = {"deviceop": dop.__version__, "cuda_driver": driver.driver_version()}
    try:
        out["nvrtc"] = dop.nvrtc_version()
    except dop.CompileError:
        out["nvrtc"] = None
    for name, dist in (("cuda_bindings", "cuda-bindings"), ("cuda_core", "cuda-core"), ("cupy", "cupy-cuda13x"),
                       ("torch", "torch"), ("numpy", "numpy")):
        try:
            out[name] = md.version(dist)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def headline(metric: str, value: float, target: float, better: str) -> dict:
    met = value <= target if better == "lower" else value >= target
    return {"metric": metric, "value": round(value, 4), "target": target, "better": better, "met": met}


def write_result(name: str, device, rows: list, headlines: list, extra: dict | None = None) -> Path:
    result = {
        "benchmark": name,
        "date": _dt.date.today().isoformat(),
        "device": device.name,
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], Path(__file__).parent.parent)] + sys.argv[1:]),
        "versions": versions(),
        "rows": rows,
        "headline": headlines,
    }
    if extra:
        result.update(extra)
    out_dir = Path(os.environ.get("DEVICEOP_BENCH_OUT", RESULTS))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def host_us_per_call(fn, calls: int, reps: int, sync) -> tuple[float, float, float]:
    """Median, min and max host microseconds per call of ``fn`` over ``reps``
    timed loops of ``calls`` calls each; ``sync`` drains the device between loops
    (outside the timed region)."""
    samples = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    sync()
    return statistics.median(samples), min(samples), max(samples)


def replay_us(graph, stream, *, per: int = 1, batch: int = 1, reps: int = 30, warmup: int = 5) -> float:
    """GPU microseconds of one replay of ``graph`` divided by ``per`` (e.g. the launches it
    holds): after ``warmup`` replays, the median over ``reps`` runs of ``batch`` back-to-back
    replays between two CUDA events."""
    for _ in range(warmup):
        graph.replay()
    stream.synchronize()
    runs = []
    for _ in range(reps):
        start = stream.record_event()
        for _ in range(batch):
            graph.replay()
        end = stream.record_event()
        end.synchronize()
        runs.append(start.elapsed_ms(end) * 1e3 / (batch * per))
    return statistics.median(runs)


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def gpu_device(benchmark: str):
    """Device(0) if it is a GPU; else None, after saying there is nothing to measure."""
    import deviceop as dop
    device = dop.Device(0)
    if device.is_reference:
        print(f"{benchmark} measures a GPU; this machine has only the reference device. Nothing to measure.")
        return None
    return device


def print_headlines(headlines: list, path) -> None:
    """One line per headline (its ``met`` is the verdict, decided once in ``headline``), then the file."""
    for h in headlines:
        op = "<=" if h["better"] == "lower" else ">="
        print(f"headline {h['metric']} = {h['value']} (target {op} {h['target']}: {'met' if h['met'] else 'MISSED'})")
    print(f"wrote {path}")
