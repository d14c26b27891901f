"""Host time per launch of one small kernel, four ways, in one process.

* deviceop: ``Function.launch(stream, config, *args)`` with Tensors and Python
  numbers, converted and checked on every call (the primitive users get).
* cuda.core: ``cuda.core.launch`` of the same CUBIN with pre-converted
  arguments (the bare baseline of the issue).
* cupy.RawKernel: the same source through CuPy.
* raw driver: ``cuLaunchKernel`` with a pre-packed parameter buffer — no
  checks at all — through cuda.bindings, and through CuPy's typed wrapper
  (``launchKernel``, what deviceop's launchers call): the floor for Python.

The kernel is tiny (1024 elements) so the device keeps up and the loop
measures host time.  Headline: deviceop / cuda.core (lower is better, target 1.2).

    python bench/launch_overhead.py [--calls 20000] [--reps 9]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import deviceop as dop  # noqa: E402
from _common import gpu_device, print_headlines, headline, host_us_per_call, print_table, write_result  # noqa: E402

SOURCE = r'''
extern "C" __global__ void saxpy(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()

    device = gpu_device("launch_overhead")
    if device is None:
        return 0
    stream = device.new_stream()
    n = 1024
    cfg = dop.LaunchConfig(grid=n // 256, block=256)
    rng = np.random.default_rng()
    x_host, y_host = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    x, y = dop.from_numpy(x_host, stream=stream), dop.from_numpy(y_host, stream=stream)

    prog = dop.compile_cubin(SOURCE)
    saxpy = dop.load_module(prog).get_function("saxpy", [dop.ptr("float32"), dop.ptr("float32"), dop.float32, dop.int32])

    # correctness first: one launch against a float64 reference
    saxpy.launch(stream, cfg, y, x, 0.5, n)
    got = y.numpy(stream=stream)
    ref = 0.5 * x_host.astype(np.float64) + y_host
    err = float(np.max(np.abs(got - ref)))
    assert err < 1e-5, f"saxpy wrong: max abs error {err}"

    # cuda.core, bare: same CUBIN, arguments converted once outside the loop
    import cuda.core as cc
    cdev = cc.Device(device.ordinal)
    cdev.set_current()
    core_stream = cc.Stream.from_handle(int(stream.handle))
    core_kernel = cc.Kernel.from_handle(int(saxpy.handle))
    core_cfg = cc.LaunchConfig(grid=n // 256, block=256)
    yp, xp, a32, n32 = y.data_ptr, x.data_ptr, np.float32(0.5), np.int32(n)

    # cupy.RawKernel on the same stream
    import cupy
    raw_kernel = cupy.RawKernel(SOURCE, "saxpy", options=(f"-arch={device.arch}",))
    cx, cy = x.to_cupy(), y.to_cupy()

    # raw driver with a pre-packed buffer: the floor
    from cuda.bindings import driver as cu
    buf = ctypes.create_string_buffer(struct.pack("@PPfi", yp, xp, 0.5, n))
    base = ctypes.addressof(buf)
    ptrs = (ctypes.c_void_p * 4)(base, base + 8, base + 16, base + 20)
    params = ctypes.addressof(ptrs)
    fn, sh = saxpy.handle, stream.handle
    from cupy_backends.cuda.api.driver import launchKernel
    fn_address, stream_address = int(fn), stream.ptr

    variants = {
        "deviceop Function.launch": lambda: saxpy.launch(stream, cfg, y, x, 0.5, n),
        "cuda.core launch (bare)": lambda: cc.launch(core_stream, core_cfg, core_kernel, yp, xp, a32, n32),
        "cupy.RawKernel": lambda: raw_kernel((n // 256,), (256,), (cy, cx, a32, n32)),
        "raw cuLaunchKernel (prepacked)": lambda: cu.cuLaunchKernel(fn, n // 256, 1, 1, 256, 1, 1, 0, sh, params, 0),
        "raw CuPy launchKernel (prepacked)": lambda: launchKernel(fn_address, n // 256, 1, 1, 256, 1, 1, 0,
                                                                  stream_address, params, 0),
    }
    # Interleave the variants within each repetition (A B C D, A B C D, ...) so
    # that drift of the shared machine hits all of them alike; the headline is
    # the median of the per-repetition ratios.
    with stream.cupy:  # CuPy launches on the same stream
        for fn_ in variants.values():
            for _ in range(2000):  # warm-up
                fn_()
        stream.synchronize()
        samples = {name: [] for name in variants}
        for _ in range(args.reps):
            for name, fn_ in variants.items():
                samples[name].append(host_us_per_call(fn_, args.calls, 1, stream.synchronize)[0])
    results = {name: (statistics.median(v), min(v), max(v)) for name, v in samples.items()}
    rep_ratios = [a / b for a, b in zip(samples["deviceop Function.launch"], samples["cuda.core launch (bare)"])]
    base_us = results["cuda.core launch (bare)"][0]
    rows, table = [], []
    for name, (med, lo, hi) in results.items():
        rows.append({"variant": name, "us_per_launch": round(med, 3), "min": round(lo, 3), "max": round(hi, 3),
                     "vs_cuda_core": round(med / base_us, 3)})
        table.append([name, f"{med:.2f}", f"{lo:.2f}-{hi:.2f}", f"{med / base_us:.2f}x"])
    ratio = statistics.median(rep_ratios)
    heads = [headline("deviceop_vs_cuda_core_launch", ratio, 1.2, "lower")]
    path = write_result("launch_overhead", device, rows, heads,
                        {"config": {"calls": args.calls, "reps": args.reps, "n": n, "check_max_abs_err": err},
                         "per_rep_ratio": [round(r, 3) for r in rep_ratios]})
    print_table(f"launch overhead on {device.name} (host us per launch, median of {args.reps} x {args.calls})",
                ["variant", "us/launch", "range", "vs cuda.core"], table)
    print_headlines(heads, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
