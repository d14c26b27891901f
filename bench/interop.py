"""A decode-sized step that mixes everyone's GPU work, as one graph and eagerly.

One step (fp32, batch 1, hidden d = 2048, a 512-wide second projection), in order:

1. ``api.memcpy``: the residual stream reset from its source (so every step computes the same);
2. a deviceop kernel with several outputs and an in-out (NVRTC): ``resid += h``, then
   ``xn = rmsnorm(resid) * gamma`` and ``rstd`` (its InOut first, two Outs after it);
3. a cuBLAS GEMM through torch (``dop.foreign``): ``q = xn @ Wq``;
4. a cuBLAS GEMM on CuPy's cuBLAS handle (``dop.foreign``): ``k = xn @ Wk``.  CuPy 14's own
   wrappers refuse a capturing stream (``calling cuBLAS API during stream capture is
   currently unsupported``, docs/interop.md), so the body calls ``cublasSgemm_v2`` of the
   libcublas CuPy loaded, through ctypes, on the handle CuPy made, with a workspace of its own;
5. a Triton kernel, compiled here by Triton and declared with ``Kernel.from_triton``:
   ``g = a * q[:512] + b * k``;
6. a kernel nvcc built (tests/data/nvcc/saxpy.sm_90.cubin, ``Kernel.from_binary``):
   ``g += 0.5 * k``, g an InOut;
7. deviceop's ``matvec`` and ``add``: ``out = resid + Wo @ g``.

Timed: ``steps`` steps launched eagerly (each step's ops built and run with
``async_on``, one synchronization at the end) against the same steps as replays
of one graph captured from the same ops; host wall time per step, the median of
``reps`` runs.  Also the GPU time of one replay (events).  Checked: a replay is
bit-equal to an eager step on the same inputs (every output, NaN-filled before),
and both are within 1e-3 of a float64 NumPy step.

Headline: mixed_graph_speedup_vs_eager = eager µs / replay µs per step (target >= 2).

    python bench/interop.py [--steps 500] [--reps 7]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import deviceop as dop  # noqa: E402
from _common import gpu_device, headline, print_headlines, print_table, replay_us, write_result  # noqa: E402
from deviceop import In, InOut, Kernel, Out, Scalar, api  # noqa: E402
from deviceop.kernels import add, matvec  # noqa: E402

D, DKV, EPS, A, B = 2048, 512, 1e-5, 0.75, 0.25
SAXPY_CUBIN = ROOT / "tests" / "data" / "nvcc" / "saxpy.sm_90.cubin"

ADD_RMS_NORM = r"""
// One block: resid += h; rstd = 1/sqrt(mean(resid^2) + eps); xn = resid * rstd * gamma.
extern "C" __global__ void add_rms_norm(float* resid, float* xn, float* rstd, const float* h,
                                        const float* gamma, float eps, int d) {
    __shared__ float warp_sums[32];
    __shared__ float scale;
    float sq = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = resid[i] + h[i];
        resid[i] = v;
        sq += v * v;
    }
    for (int o = 16; o > 0; o /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sq;
    __syncthreads();
    if (threadIdx.x < 32) {
        float s = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (threadIdx.x == 0) scale = rsqrtf(s / d + eps);
    }
    __syncthreads();
    float r = scale;
    for (int i = threadIdx.x; i < d; i += blockDim.x) xn[i] = resid[i] * r * gamma[i];
    if (threadIdx.x == 0) rstd[0] = r;
}
"""


def _add_rms_norm_ref(g, resid, xn, rstd, h, gamma, eps, d):
    v = resid.astype(np.float64) + h
    resid[...] = v
    r = 1.0 / np.sqrt(np.mean(v * v) + eps)
    xn[...] = v * r * gamma
    rstd[...] = r


add_rms_norm = Kernel(   # written as its author would: the in-out first, two outputs after it
    "add_rms_norm", ADD_RMS_NORM,
    [InOut("resid", "float32", shape=("d",)), Out("xn", "float32", shape=(1, "d"), tile=(1, "d")),
     Out("rstd", "float32", shape=(1,), tile=(1,)), In("h", "float32", shape=("d",)),
     In("gamma", "float32", shape=("d",)), Scalar("eps", "float32"), Scalar("d", "int32")],
    block=1024, reference=_add_rms_norm_ref)

saxpy = Kernel.from_binary(
    "saxpy", SAXPY_CUBIN, [InOut("y", "float32", shape=("n",)), In("x", "float32", shape=("n",)),
                           Scalar("a", "float32"), Scalar("n", "int32")],
    grid=("(n+255)//256",), block=256, reference=lambda g, y, x, a, n: y.__setitem__(..., np.float32(a) * x + y))

TRITON_PARAMS = [In("q", "float32", shape=(1, "D")), In("k", "float32", shape=(1, "n")),
                 Out("g", "float32", shape=("n",), tile=("n",)), Scalar("n", "int32"), Scalar("a", "float32"),
                 Scalar("b", "float32")]


def triton_axpby(q, k, g):
    """``g = a * q[0, :n] + b * k[0]`` compiled by Triton for this GPU (a CompiledKernel)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def axpby(q_ptr, k_ptr, g_ptr, n, a, b, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = i < n
        tl.store(g_ptr + i, a * tl.load(q_ptr + i, mask=keep) + b * tl.load(k_ptr + i, mask=keep), mask=keep)

    args = (torch.from_dlpack(q), torch.from_dlpack(k), torch.from_dlpack(g), DKV, A, B)
    return axpby.warmup(*args, BLOCK=256, grid=(1,))   # compiles (no launch) for the current GPU


class CupyGemm:
    """``y = x @ w`` (row-major float32) by cuBLAS on CuPy's handle, callable under a capture."""

    def __init__(self, device):
        import cupy
        from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads CuPy's libcublas)
        self.handle = cupy.cuda.Device(device.ordinal).cublas_handle
        try:  # the library CuPy loaded: dlopen of a loaded soname returns it
            lib = ctypes.CDLL("libcublas.so.13")
        except OSError:
            lib = ctypes.CDLL(next(line.split()[-1] for line in open("/proc/self/maps") if "/libcublas.so" in line))
        vp, i = ctypes.c_void_p, ctypes.c_int
        self.set_stream, self.set_workspace = lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2
        self.set_pointer_mode, self.sgemm = lib.cublasSetPointerMode_v2, lib.cublasSgemm_v2
        self.set_stream.argtypes = [vp, vp]
        self.set_workspace.argtypes = [vp, vp, ctypes.c_size_t]
        self.set_pointer_mode.argtypes = [vp, i]
        fp = ctypes.POINTER(ctypes.c_float)
        self.sgemm.argtypes = [vp, i, i, i, i, i, fp, vp, i, vp, i, fp, vp, i]
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.workspace = dop.empty(4 << 20, dop.uint8, device=device)   # one fixed workspace: no allocation

    def __call__(self, s, x, w, y):
        (m, k), n = x.shape, w.shape[1]
        calls = (lambda: self.set_stream(self.handle, s.ptr),   # setStream resets the workspace: set it after
                 lambda: self.set_workspace(self.handle, self.workspace.data_ptr, self.workspace.nbytes),
                 lambda: self.set_pointer_mode(self.handle, 0),   # CUBLAS_POINTER_MODE_HOST
                 # row-major y[m, n] = x @ w is column-major y^T = w^T x^T
                 lambda: self.sgemm(self.handle, 0, 0, n, m, k, ctypes.byref(self.one), w.data_ptr, n,
                                    x.data_ptr, k, ctypes.byref(self.zero), y.data_ptr, n))
        for call in calls:
            code = call()
            if code:
                raise RuntimeError(f"cuBLAS returned status {code}")


def torch_gemm(s, x, w, y):
    import torch
    with torch.cuda.stream(s.torch):
        torch.matmul(torch.from_dlpack(x), torch.from_dlpack(w), out=torch.from_dlpack(y))


class Step:
    """The buffers of the step, its op (``op()``, built anew for each execution) and float64 twin."""

    def __init__(self, device, stream, rng):
        self.device, self.stream = device, stream
        up = lambda a: dop.from_numpy(np.ascontiguousarray(a, dtype=np.float32), stream=stream)
        self.inputs = {"h": rng.standard_normal(D), "res0": rng.standard_normal(D),
                       "gamma": 1.0 + 0.1 * rng.standard_normal(D)}
        self.weights = {"wq": rng.standard_normal((D, D)) / np.sqrt(D), "wk": rng.standard_normal((D, DKV)) / np.sqrt(D),
                        "wo": rng.standard_normal((D, DKV)) / np.sqrt(DKV)}
        self.t = {name: up(a) for name, a in {**self.inputs, **self.weights}.items()}
        shapes = {"resid": (D,), "xn": (1, D), "rstd": (1,), "q": (1, D), "k": (1, DKV), "g": (DKV,), "o": (D,),
                  "out": (D,)}
        self.out = {name: dop.empty(shape, stream=stream) for name, shape in shapes.items()}
        self.cupy_gemm = CupyGemm(device)
        self.triton = Kernel.from_triton(triton_axpby(self.out["q"], self.out["k"], self.out["g"]), TRITON_PARAMS,
                                         name="axpby", grid=("(n+255)//256",),
                                         reference=lambda g_, q, k, g, n, a, b: g.__setitem__(
                                             ..., np.float32(a) * q[0, :n] + np.float32(b) * k[0]))

    def op(self):
        t, o = self.t, self.out
        return dop.zip_(
            api.memcpy(o["resid"], t["res0"]),
            add_rms_norm(o["resid"], o["xn"].partition([1, D]), o["rstd"].partition([1]), t["h"], t["gamma"], EPS, D),
            dop.foreign(torch_gemm, reads=[o["xn"], t["wq"]], writes=[o["q"]], warmup=True, name="torch.matmul"),
            dop.foreign(self.cupy_gemm, reads=[o["xn"], t["wk"]], writes=[o["k"]], warmup=True, name="cublasSgemm"),
            self.triton(o["q"], o["k"], o["g"].partition([DKV]), DKV, A, B),
            saxpy(o["g"], o["k"].view(DKV), 0.5, DKV),
            matvec(o["o"].partition([8]), o["g"].view(1, DKV), t["wo"]).generics([8, 1, DKV]),
            add(o["out"].partition([1024]), o["resid"], o["o"]))

    def float64(self) -> dict:
        """The step in float64 NumPy, from the inputs as the GPU holds them (float32)."""
        f = {n: a.astype(np.float32).astype(np.float64) for n, a in {**self.inputs, **self.weights}.items()}
        v = f["res0"] + f["h"]
        r = 1.0 / np.sqrt(np.mean(v * v) + EPS)
        xn = v * r * f["gamma"]
        q, k = xn @ f["wq"], xn @ f["wk"]
        g = A * q[:DKV] + B * k
        g = 0.5 * k + g
        return {"resid": v, "xn": xn, "rstd": r, "q": q, "k": k, "g": g, "o": f["wo"] @ g, "out": v + f["wo"] @ g}

    def set_input(self, name: str, array) -> None:
        """New data for an input (h, res0, gamma) or weight, on the device and in the float64 twin."""
        (self.weights if name in self.weights else self.inputs)[name] = array
        api.memcpy(self.t[name], dop.from_numpy(np.asarray(array, np.float32), stream=self.stream)).sync_on(self.stream)

    def outputs(self) -> dict:
        return {n: t.numpy(stream=self.stream).reshape(-1) for n, t in self.out.items()}

    def poison(self) -> None:
        for t in self.out.values():
            api.fill(t, float("nan")).sync_on(self.stream)


def check(step: Step, graph) -> tuple[bool, float]:
    """A replay after NaN-filling every output, bit-equal to an eager step; both vs float64:
    ``(bit-equal, max error relative to each output's largest magnitude)``."""
    step.poison()
    step.op().sync_on(step.stream)
    eager = step.outputs()
    step.poison()
    graph.replay()
    step.stream.synchronize()
    replay = step.outputs()
    same = all(np.array_equal(eager[n].view(np.uint32), replay[n].view(np.uint32)) for n in eager)
    exact = step.float64()
    err = max(float(np.max(np.abs(replay[n] - np.reshape(exact[n], -1))) / np.max(np.abs(exact[n])))
              for n in exact)
    return same, err


def per_step_us(run, steps: int, reps: int, stream) -> float:
    samples = []
    for _ in range(reps):
        stream.synchronize()
        t0 = time.perf_counter()
        run(steps)
        stream.synchronize()
        samples.append((time.perf_counter() - t0) / steps * 1e6)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    device = gpu_device("interop")
    if device is None:
        return 0
    stream = device.new_stream()
    step = Step(device, stream, np.random.default_rng(0))
    graph = step.op().graph_on(stream)
    kinds = [n["type"] for n in graph.nodes()]
    same, err = check(step, graph)

    def eager(k):
        for _ in range(k):
            step.op().async_on(stream)

    def replay(k):
        for _ in range(k):
            graph.replay()

    eager(20), replay(20)  # warm
    eager_us = per_step_us(eager, args.steps, args.reps, stream)
    graph_us = per_step_us(replay, args.steps, args.reps, stream)
    gpu_us = replay_us(graph, stream)
    speedup = eager_us / graph_us
    counts = {k: kinds.count(k) for k in sorted(set(kinds))}
    print(f"one step: memcpy, NVRTC add_rms_norm (InOut + 2 Outs), torch GEMM, cuBLAS GEMM on CuPy's handle, "
          f"Triton axpby, nvcc saxpy, matvec, add (d={D}); graph nodes {counts}; {args.steps} steps x {args.reps} "
          f"runs on {device.name}")
    print_table("host wall µs per step (median of runs)", ["way", "µs/step", "vs eager"],
                [["eager (ops built and run each step)", f"{eager_us:.1f}", "1.00x"],
                 ["graph replay", f"{graph_us:.1f}", f"{speedup:.2f}x"]])
    print(f"GPU time of one replay: {gpu_us:.1f} µs; replay bit-equal to eager: {same}; vs float64: {err:.1e}")
    rows = [{"variant": "eager", "us_per_step": round(eager_us, 2)},
            {"variant": "graph replay", "us_per_step": round(graph_us, 2), "speedup_vs_eager": round(speedup, 3)}]
    heads = [headline("mixed_graph_speedup_vs_eager", speedup, 2.0, "higher")]
    path = write_result("interop", device, rows, heads,
                        {"graph_nodes": counts, "gpu_us_per_replay": round(gpu_us, 2), "replay_bit_equal_eager": same,
                         "max_rel_error_vs_float64": err, "d": D, "dkv": DKV})
    print_headlines(heads, path)
    graph.close()
    return 0 if same and err < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
