"""The Llama projection kernels (kernels/llama_proj.cu) on the GPU, at the
Llama-3.2-1B shapes: bandwidth of each kernel against the device-to-device copy
rate measured in the same run, and a 16-layer chain of them in one graph.

Timing: each kernel is launched 16 times in one CUDA graph, each launch with
its own weights (16 layers' worth, so that nothing is served from L2 except for
the 525 MB LM head, which cannot be), with PDL (the plan's default also without);
the graph is replayed back to back, timed with CUDA events (median of 5 runs of
R replays); a kernel's time is the graph's / 16 (so it includes its share of the
gaps).  Bytes = the weights + the vectors read and written.  Variants of each
kernel's grid, buffers and K split are timed in the same way.

Latency probe: matvec_residual over a 1 MB matrix (N=2048, K=256), 16 launches
with PDL: what one dependent launch costs when the bytes do not.

The chain: embed, then 16 x (rms_qkv_rope, O + residual, rms_gate_up_silu,
down + residual), then the LM head with its argmax -- the decode step without
attention (O reads q as if it were the attention output), against its floor
(bytes / copy rate), for several sets of plans: the defaults (with and without
PDL), each kernel's fastest variant, and the sets named in CHAIN_SETS.  With
``--before DIR`` (a directory holding an earlier llama_proj.py, .cu and
llama_common.cuh), that code's default chain is timed in the same run too.
No JSON unless DEVICEOP_BENCH_OUT is set.

    python bench/llama_kernels_proj.py [--before DIR]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import ml_dtypes  # noqa: E402

import deviceop as dop  # noqa: E402
from _common import gpu_device, print_table, replay_us, write_result  # noqa: E402
from _copy import copy_rate  # noqa: E402
from deviceop import api, zip_  # noqa: E402
from deviceop.kernels import llama_proj as lp  # noqa: E402

D, I, HQ, HKV, HD, V, L, CAP = 2048, 8192, 32, 8, 64, 128256, 16, 4096
QKV_ROWS = (HQ + 2 * HKV) * HD
EPS = 1e-5
KINDS = ("qkv", "o", "gate_up", "down", "lm_head")
TITLES = {"qkv": "rms_qkv_rope", "o": "o_proj (matvec_residual K=2048)", "gate_up": "rms_gate_up_silu",
          "down": "down (matvec_residual K=8192)", "lm_head": "rms_lm_head_argmax"}
VEC = 4 * (2 * D)
BYTES = {"qkv": QKV_ROWS * D * 2 + 2 * D + VEC + 4 * HQ * HD + 4 * HKV * HD,
         "o": D * HQ * HD * 2 + 4 * (HQ * HD + 2 * D),
         "gate_up": 2 * I * D * 2 + 2 * D + 4 * (D + I),
         "down": D * I * 2 + 4 * (I + 2 * D),
         "lm_head": V * D * 2 + 2 * D + 4 * (D + V)}


def defaults(m) -> dict:
    """The plans a model gets from module ``m`` (this code or an earlier one) at the 1B shape."""
    return {"qkv": m.qkv_plan(D, HQ, HKV, HD), "o": m.matvec_residual_plan(D, HQ * HD),
            "gate_up": m.gate_up_plan(D, I), "down": m.matvec_residual_plan(D, I), "lm_head": m.lm_head_plan(D, V)}


def variants() -> dict:
    """Per kind: label -> plan, the first being the default.  "/SM" counts CTAs a SM
    the grid puts at once (132 SMs); 1/SM of <= half the register file lets the
    next kernel's CTAs in beside it (co-residency)."""
    mv = lp.matvec_residual_plan
    return {
        "qkv": {"default": lp.qkv_plan(D, HQ, HKV, HD),
                "128 W=12 (before)": lp.qkv_plan(D, HQ, HKV, HD, ctas=128),
                "256 W=3 NB=2": lp.qkv_plan(D, HQ, HKV, HD, ctas=256, warps=3)},
        "o": {"default": mv(D, HQ * HD),
              "256 NR=1 W=8": mv(D, HQ * HD, ctas=256, nr=1, ks=1, warps=8),
              "128 NR=2 W=8": mv(D, HQ * HD, ctas=128, nr=2, ks=1, warps=8),
              "128 KS=2 NR=1 W=16": mv(D, HQ * HD, ctas=128, nr=1, ks=2, warps=16),
              "128 NR=1 W=16 NB=3": mv(D, HQ * HD, ctas=128, nr=1, ks=1, warps=16, nb=3)},
        "gate_up": {"default": lp.gate_up_plan(D, I)},
        "down": {"default": mv(D, I),
                 "256 NR=1 W=8 (before)": mv(D, I, ctas=256, nr=1, ks=1, warps=8),
                 "256 KS=2 NR=2 W=8": mv(D, I, ctas=256, ks=2, nr=2, warps=8),
                 "128 KS=2 NR=2 W=16": mv(D, I, ctas=128, ks=2, nr=2, warps=16),
                 "128 KS=2 NR=1 W=16 NB=3": mv(D, I, ctas=128, ks=2, nr=1, warps=16, nb=3),
                 "128 KS=2 NR=2 W=16 NB=3": mv(D, I, ctas=128, ks=2, nr=2, warps=16, nb=3)},
        "lm_head": {"default": lp.lm_head_plan(D, V)},
    }


# Chains beside the defaults and the per-kernel fastest: kind -> variant label (default if absent).
CHAIN_SETS = {
    "qkv 128 W=12": {"qkv": "128 W=12 (before)"},
    "down KS=2": {"down": "128 KS=2 NR=2 W=16"},
    "down 256 KS=2 NR=2 W=8": {"down": "256 KS=2 NR=2 W=8"},
    "O and down as before (256 CTAs of 8 warps)": {"o": "256 NR=1 W=8", "down": "256 NR=1 W=8 (before)"},
}


def load_module(directory: Path):
    """An earlier llama_proj.py (beside its .cu and llama_common.cuh) as a module of its own."""
    spec = importlib.util.spec_from_file_location("llama_proj_before", directory / "llama_proj.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Pool:
    """Random bf16 weights (~N(0, 0.02)) cut from one host pool: fast to make, distinct memory on the device."""

    def __init__(self, stream, seed=0):
        self.host = (np.random.default_rng(seed).standard_normal(1 << 26, dtype=np.float32) * 0.02).astype(
            ml_dtypes.bfloat16)
        self.stream, self.at = stream, 0

    def __call__(self, *shape):
        n = int(np.prod(shape))
        if n <= self.host.size:
            start = self.at % (self.host.size - n + 1)
            self.at += 7919 * 16
            arr = self.host[start:start + n]
        else:
            arr = np.resize(self.host, n)
        return dop.from_numpy(arr.reshape(shape), stream=self.stream)


def time_graph(graph, stream, replays: int) -> float:
    """GPU microseconds of one replay: median of 5 runs of ``replays`` back-to-back replays."""
    return replay_us(graph, stream, batch=replays, reps=5, warmup=3)


class Step:
    """The buffers and 16 layers of weights of the decode step; ``op(kind, m, i, plan, pdl)``
    is one launch of module ``m``'s kernel for ``kind`` on layer i's weights."""

    def __init__(self, stream):
        self.stream = stream
        pool = Pool(stream)
        f32 = lambda *s: dop.from_numpy(np.random.default_rng(1).standard_normal(s, dtype=np.float32),  # noqa: E731
                                        stream=stream)
        self.layers = [dict(norm1=pool(D), wqkv=pool(QKV_ROWS, D), wo=pool(D, HQ * HD), norm2=pool(D),
                            wgu=pool(2 * I, D), wd=pool(D, I)) for _ in range(L)]
        self.probe_w = [pool(D, 256) for _ in range(L)]
        self.embed, self.norm_f = pool(V, D), pool(D)
        self.kcache = dop.empty([L, HKV, CAP, HD], "bfloat16", stream=stream)
        self.vcache = dop.empty([L, HKV, CAP, HD], "bfloat16", stream=stream)
        self.inv_freq = dop.from_numpy((1.0 / 500000 ** (np.arange(0, HD, 2) / HD)).astype(np.float32),
                                       stream=stream)
        self.pos = dop.from_numpy(np.array([CAP // 2 + 1], np.int32), stream=stream)
        self.token = dop.from_numpy(np.array([123], np.int32), stream=stream)
        self.error = dop.from_numpy(np.zeros(1, np.int32), stream=stream)
        self.work = dop.from_numpy(np.zeros(2, np.uint64), stream=stream)
        self.h_a, self.h_b, self.q, self.act = f32(D), f32(D), f32(HQ * HD), f32(I)
        self.probe_x, self.probe_h = f32(256), (f32(D), f32(D))
        self.logits = {}

    def op(self, kind, m, i, plan, pdl):
        w = self.layers[i]
        if kind == "qkv":
            tile, gen = plan
            launch = m.rms_qkv_rope(self.q.partition([tile]), self.h_a, w["norm1"], w["wqkv"], self.inv_freq,
                                    self.pos, self.kcache[i], self.vcache[i], self.error, EPS, CAP)
        elif kind == "o":
            tile, gen = plan
            launch = m.matvec_residual(self.h_b.partition([tile]), self.q, w["wo"], self.h_a)
        elif kind == "gate_up":
            tile, gen = plan
            launch = m.rms_gate_up_silu(self.act.partition([tile]), self.h_b, w["norm2"], w["wgu"], EPS)
        elif kind == "down":
            tile, gen = plan
            launch = m.matvec_residual(self.h_a.partition([tile]), self.act, w["wd"], self.h_b)
        elif kind == "lm_head":
            tile, rows, gen = plan
            if rows not in self.logits:
                self.logits[rows] = dop.empty([rows], stream=self.stream)
            launch = m.rms_lm_head_argmax(self.logits[rows].partition([tile]), self.h_a, self.norm_f, self.embed,
                                          self.token, self.work, self.error, EPS, V)
        elif kind == "embed":
            tile, gen = plan
            launch = m.embed_gather(self.h_a.partition([tile]), self.embed, self.token, self.error, V)
        elif kind == "probe":
            tile, gen = plan
            out, res = self.probe_h[i % 2], self.probe_h[1 - i % 2]   # each launch reads the one before
            launch = m.matvec_residual(out.partition([tile]), self.probe_x, self.probe_w[i], res)
        else:
            raise ValueError(kind)
        return launch.generics(gen).pdl(pdl)

    def chain(self, m, plans: dict, pdl: bool):
        ops = [self.op("embed", m, 0, m.embed_plan(D), pdl)]
        for i in range(L):
            ops += [self.op(k, m, i, plans[k], pdl) for k in KINDS[:4]]
        ops.append(self.op("lm_head", m, 0, plans["lm_head"], pdl))
        return zip_(*ops).graph_on(self.stream)


def kernel_of(m, kind):
    return {"qkv": m.rms_qkv_rope, "o": m.matvec_residual, "gate_up": m.rms_gate_up_silu, "down": m.matvec_residual,
            "lm_head": m.rms_lm_head_argmax, "probe": m.matvec_residual}[kind]


def precompile(device, jobs) -> None:
    """Compile every (kernel, generics) once, on threads (NVRTC runs without the GIL)."""
    todo = {(k.name, tuple(g)): (k, tuple(g)) for k, g in jobs}
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda kg: kg[0].function(device, kg[1]), todo.values()))


def num_regs(device, kernel, gen) -> int:
    return kernel.function(device, tuple(gen)).attributes["num_regs"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a directory with an earlier llama_proj.py/.cu/.cuh to compare")
    args = parser.parse_args()
    device = gpu_device("llama_kernels_proj")
    if device is None:
        return 0
    stream = device.new_stream()
    rate = copy_rate(stream)
    print(f"device {device.name}; device-to-device copy rate {rate / 1e9:.0f} GB/s (read + write)")
    before = load_module(args.before) if args.before else None
    var = variants()
    probe_plan = lp.matvec_residual_plan(D, 256)
    jobs = [(kernel_of(lp, k), p[-1]) for k, vs in var.items() for p in vs.values()]
    jobs.append((lp.matvec_residual, probe_plan[-1]))
    if before is not None:
        jobs += [(kernel_of(before, k), p[-1]) for k, p in defaults(before).items()]
    precompile(device, jobs)
    step = Step(stream)

    # -- per kernel, by variant --------------------------------------------------------------
    rows, best = [], {}
    for kind, vs in var.items():
        for label, plan in vs.items():
            gen = plan[-1]
            regs = num_regs(device, kernel_of(lp, kind), gen)
            for pdl in ((False, True) if label == "default" else (True,)):
                n = min(4, L) if kind == "lm_head" else L
                graph = zip_(*[step.op(kind, lp, i, plan, pdl) for i in range(n)]).graph_on(stream)
                us = time_graph(graph, stream, 5 if kind == "lm_head" else 20) / n
                graph.close()
                gbs = BYTES[kind] / us / 1e3
                rows.append({"kernel": TITLES[kind], "variant": label, "generics": list(gen), "regs": regs, "pdl": pdl,
                             "us": round(us, 2), "bytes": BYTES[kind], "GB/s": round(gbs),
                             "vs_copy": round(gbs * 1e9 / rate, 3)})
                if pdl and (kind not in best or us < best[kind][1]):
                    best[kind] = (label, us)
    print_table("per kernel (graph of 16 launches, distinct weights; LM head: 4 launches)",
                ["kernel", "variant", "generics", "regs", "pdl", "us", "GB/s", "vs copy"],
                [[r["kernel"], r["variant"], r["generics"], r["regs"], r["pdl"], r["us"], r["GB/s"], r["vs_copy"]]
                 for r in rows])
    print("\nfastest with PDL: " + "; ".join(f"{k}: {v[0]} {v[1]:.2f} us" for k, v in best.items()))

    # -- latency probe: 16 dependent launches over 1 MB matrices ----------------------------------
    probe = {}
    for name, m in (("this code", lp), ("before", before)):
        if m is None:
            continue
        plan = m.matvec_residual_plan(D, 256)
        graph = zip_(*[step.op("probe", m, i, plan, True) for i in range(L)]).graph_on(stream)
        probe[name] = time_graph(graph, stream, 20) / L
        graph.close()
    print("\nlatency probe (matvec_residual N=2048 K=256, 1 MB, 16 launches with PDL): "
          + "; ".join(f"{k} {v:.2f} us a launch" for k, v in probe.items()))

    # -- the chain: embed, 16 layers, LM head + argmax, one graph ---------------------------------
    chain_bytes = 2 * D + L * sum(BYTES[k] for k in KINDS[:4]) + BYTES["lm_head"]
    floor_us = chain_bytes / rate * 1e6
    sets = {"defaults": (lp, defaults(lp), (False, True)),
            "fastest": (lp, {k: var[k][best[k][0]] for k in KINDS}, (True,))}
    for name, choice in CHAIN_SETS.items():
        sets[name] = (lp, {k: var[k][choice.get(k, "default")] for k in KINDS}, (True,))
    if before is not None:
        sets["before (--before code, its defaults)"] = (before, defaults(before), (False, True))
    start_token = dop.from_numpy(np.array([123], np.int32), stream=stream)
    chain, outputs = [], {}
    for name, (m, plans, pdls) in sets.items():
        for pdl in pdls:
            graph = step.chain(m, plans, pdl)
            api.memcpy(step.token, start_token).sync_on(stream)   # one step from a known token
            graph.replay()
            stream.synchronize()
            outputs[(name, pdl)] = (step.h_a.numpy(stream=stream), int(step.token.numpy(stream=stream)[0]))
            us = time_graph(graph, stream, 20)
            graph.close()
            chain.append({"set": name, "pdl": pdl, "us": round(us, 1), "vs_floor": round(us / floor_us, 4),
                          "plans": {k: (list(p[-1]) if k != "lm_head" else list(p[2])) for k, p in plans.items()}})
    print_table(f"chain: embed + 16 x (qkv_rope, o, gate_up, down) + lm_head/argmax, {chain_bytes / 1e9:.3f} GB, "
                f"floor {floor_us:.1f} us",
                ["set", "pdl", "us/step", "vs floor", "GB/s"],
                [[c["set"], c["pdl"], c["us"], c["vs_floor"], round(chain_bytes / c["us"] / 1e3)] for c in chain])
    h_ref, t_ref = outputs[("defaults", False)]
    for (name, pdl), (h, tok) in outputs.items():
        diff = float(np.max(np.abs(h.astype(np.float64) - h_ref)) / np.max(np.abs(h_ref)))
        print(f"{name}, pdl={pdl}: hidden vs defaults without PDL, max rel diff {diff:.2e}; token {tok} "
              f"(defaults {t_ref}); finite {bool(np.isfinite(h).all())}")
        assert np.isfinite(h).all() and diff < 1e-3, f"the {name} chain computes something else"
    for name, (m, plans, pdls) in sets.items():
        if len(pdls) == 2:
            (h0, t0), (h1, t1) = outputs[(name, False)], outputs[(name, True)]
            same = bool(np.array_equal(h0, h1)) and t0 == t1
            print(f"{name}: one step with PDL equals one without, bit for bit: {same}")
            assert same, f"the {name} chain computes differently with PDL"
    assert int(step.error.numpy(stream=stream)[0]) == 0, "a kernel flagged a device-side error"
    if os.environ.get("DEVICEOP_BENCH_OUT"):
        path = write_result("llama_kernels_proj", device, rows, [], extra={
            "copy_rate_GBps": round(rate / 1e9, 1), "chain_bytes": chain_bytes, "chain_floor_us": round(floor_us, 2),
            "chain": chain, "latency_probe_us": {k: round(v, 2) for k, v in probe.items()},
            "fastest": {k: {"variant": v[0], "us": round(v[1], 2)} for k, v in best.items()}})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
