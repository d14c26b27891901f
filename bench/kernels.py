"""Each kernel of the tutorial model alone: GPU time per launch and achieved
bandwidth, against the measured device-to-device copy rate.

A graph of 100 back-to-back launches of one kernel is replayed; time per
launch = replay time / 100 (launch gaps inside a graph included, as in the
token loop).  Inputs rotate over 8 weight matrices (134 MB > the 50 MB L2),
so matvec streams from HBM as it does in the model.

    python bench/kernels.py
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import deviceop as dop  # noqa: E402
from deviceop import DeviceOpVec  # noqa: E402
from _common import gpu_device, print_table, write_result  # noqa: E402
from deviceop.kernels import add, matvec, rms_norm  # noqa: E402


def graph_us_per_launch(make_launch, stream, n=100, reps=20) -> float:
    graph = DeviceOpVec([make_launch(i) for i in range(n)]).graph_on(stream)
    for _ in range(3):
        graph.launch().sync_on(stream)
    times = []
    for _ in range(reps):
        start = stream.record_event()
        graph.launch().async_on(stream)
        end = stream.record_event()
        end.synchronize()
        times.append(start.elapsed_ms(end) * 1e3 / n)
    graph.close()
    return statistics.median(times)


def main() -> int:
    device = gpu_device("kernels")
    if device is None:
        return 0
    d = 2048
    stream = device.new_stream()
    rng = np.random.default_rng(0)
    mats = [dop.from_numpy(rng.standard_normal((d, d)).astype(np.float32), stream=stream) for _ in range(8)]
    vecs = [dop.from_numpy(rng.standard_normal((1, d)).astype(np.float32), stream=stream) for _ in range(8)]
    outs = [dop.empty((1, d), stream=stream) for _ in range(8)]
    w = dop.from_numpy(rng.standard_normal(d).astype(np.float32), stream=stream)
    from _copy import copy_rate  # noqa: E402
    rate = copy_rate(stream)

    cases = {
        "rms_norm<2048, 256>": (lambda i: rms_norm(outs[i % 8].partition([1, d]), vecs[i % 8], w, 1e-5)
                                .generics([d, 256]), 3 * d * 4),
        "rms_norm<2048, 512>": (lambda i: rms_norm(outs[i % 8].partition([1, d]), vecs[i % 8], w, 1e-5)
                                .generics([d, 512]), 3 * d * 4),
        "add<128>": (lambda i: add(outs[i % 8].view(d).partition([128]), vecs[i % 8].view(d), w)
                     .generics([128]), 3 * d * 4),
    }
    for bn, bk in ((16, 16), (8, 16), (16, 8), (32, 8)):
        cases[f"matvec<{bn}, {bk}, 2048>"] = (
            lambda i, bn=bn, bk=bk: matvec(outs[i % 8].view(d).partition([bn]), vecs[(i + 1) % 8], mats[i % 8])
            .generics([bn, bk, d]), d * d * 4 + 2 * d * 4)
    rows, table = [], []
    for name, (make, nbytes) in cases.items():
        us = graph_us_per_launch(make, stream)
        bw = nbytes / (us * 1e-6)
        rows.append({"kernel": name, "us_per_launch": round(us, 2), "bytes": nbytes, "TBps": round(bw / 1e12, 3),
                     "vs_copy_rate": round(bw / rate, 3)})
        table.append([name, f"{us:.2f}", f"{bw / 1e12:.2f}", f"{bw / rate:.2f}"])
    write_result("kernels", device, rows, [], {"copy_rate_TBps": round(rate / 1e12, 3)})
    print_table(f"tutorial kernels on {device.name} (graph of 100 launches; copy rate {rate / 1e12:.2f} TB/s)",
                ["kernel", "us/launch", "TB/s", "vs copy"], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
