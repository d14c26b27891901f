"""The Llama projection kernels (kernels/llama_proj.cu) on the GPU, at the
Llama-3.2-1B shapes: bandwidth of each kernel against the device-to-device copy
rate measured in the same run, and a 16-layer chain of them in one graph.

Timing: each kernel is launched 16 times in one CUDA graph, each launch with
its own weights (16 layers' worth, so that nothing is served from L2 except for
the 525 MB LM head, which cannot be), with and without PDL; the graph is
replayed back to back, timed with CUDA events (median of 5 runs of R replays);
a kernel's time is the graph's / 16 (so it includes its share of the gaps).
Bytes = the weights + the vectors read and written.  Variants of each kernel's
grid are timed in the same way; the chain uses each kernel's fastest.

The chain: embed, then 16 x (rms_qkv_rope, O + residual, rms_gate_up_silu,
down + residual), then the LM head with its argmax -- the decode step without
attention (O reads q as if it were the attention output), against its floor
(bytes / copy rate).  No JSON unless DEVICEOP_BENCH_OUT is set.

    python bench/llama_kernels_proj.py
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import ml_dtypes  # noqa: E402

import deviceop as dop  # noqa: E402
from _common import gpu_device, print_table, write_result  # noqa: E402
from _copy import copy_rate  # noqa: E402
from deviceop import api, zip_  # noqa: E402
from kernels import llama_proj as lp  # noqa: E402

D, I, HQ, HKV, HD, V, L, CAP = 2048, 8192, 32, 8, 64, 128256, 16, 4096
QKV_ROWS = (HQ + 2 * HKV) * HD
EPS = 1e-5


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
    for _ in range(3):
        graph.replay()
    stream.synchronize()
    runs = []
    for _ in range(5):
        start = stream.record_event()
        for _ in range(replays):
            graph.replay()
        end = stream.record_event()
        end.synchronize()
        runs.append(start.elapsed_ms(end) * 1e3 / replays)
    return statistics.median(runs)


def main() -> int:
    device = gpu_device("llama_kernels_proj")
    if device is None:
        return 0
    stream = device.new_stream()
    rate = copy_rate(stream)
    print(f"device {device.name}; device-to-device copy rate {rate / 1e9:.0f} GB/s (read + write)")
    pool = Pool(stream)
    f32 = lambda *s: dop.from_numpy(np.random.default_rng(1).standard_normal(s, dtype=np.float32), stream=stream)  # noqa: E731
    layers = [dict(norm1=pool(D), wqkv=pool(QKV_ROWS, D), wo=pool(D, HQ * HD), norm2=pool(D),
                   wgu=pool(2 * I, D), wd=pool(D, I)) for _ in range(L)]
    embed, norm_f = pool(V, D), pool(D)
    kcache, vcache = dop.empty([L, HKV, CAP, HD], "bfloat16", stream=stream), \
        dop.empty([L, HKV, CAP, HD], "bfloat16", stream=stream)
    inv_freq = dop.from_numpy((1.0 / 500000 ** (np.arange(0, HD, 2) / HD)).astype(np.float32), stream=stream)
    pos = dop.from_numpy(np.array([CAP // 2 + 1], np.int32), stream=stream)
    token = dop.from_numpy(np.array([123], np.int32), stream=stream)
    error = dop.from_numpy(np.zeros(1, np.int32), stream=stream)
    work = dop.from_numpy(np.zeros(2, np.uint64), stream=stream)
    h_a, h_b, q = f32(D), f32(D), f32(HQ * HD)
    act = f32(I)

    # -- one launch of each kernel, by variant (layer i's weights) --------------------------
    def qkv(i, plan, pdl):
        tile, gen = plan
        w = layers[i]
        return lp.rms_qkv_rope(q.partition([tile]), h_a, w["norm1"], w["wqkv"], inv_freq, pos, kcache[i], vcache[i],
                               error, EPS, CAP).generics(gen).pdl(pdl)

    def o_proj(i, plan, pdl):
        tile, gen = plan
        return lp.matvec_residual(h_b.partition([tile]), q, layers[i]["wo"], h_a).generics(gen).pdl(pdl)

    def gate_up(i, plan, pdl):
        tile, gen = plan
        w = layers[i]
        return lp.rms_gate_up_silu(act.partition([tile]), h_b, w["norm2"], w["wgu"], EPS).generics(gen).pdl(pdl)

    def down(i, plan, pdl):
        tile, gen = plan
        return lp.matvec_residual(h_a.partition([tile]), act, layers[i]["wd"], h_b).generics(gen).pdl(pdl)

    lm_rows = {}

    def lm_head(i, plan, pdl):
        tile, rows, gen = plan
        if rows not in lm_rows:
            lm_rows[rows] = dop.empty([rows], stream=stream)
        return lp.rms_lm_head_argmax(lm_rows[rows].partition([tile]), h_a, norm_f, embed, token, work, EPS, V) \
            .generics(gen).pdl(pdl)

    def embed_op(i, plan, pdl):
        tile, gen = plan
        return lp.embed_gather(h_a.partition([tile]), embed, token, error, V).generics(gen).pdl(pdl)

    vec = 4 * (2 * D)
    kernels = {"rms_qkv_rope": lp.rms_qkv_rope, "o_proj (matvec_residual K=2048)": lp.matvec_residual,
               "rms_gate_up_silu": lp.rms_gate_up_silu, "down (matvec_residual K=8192)": lp.matvec_residual,
               "rms_lm_head_argmax": lp.rms_lm_head_argmax}
    kinds = {
        "rms_qkv_rope": (qkv, QKV_ROWS * D * 2 + 2 * D + vec + 4 * HQ * HD + 4 * HKV * HD,
                         {f"ctas={c}": lp.qkv_plan(D, HQ, HKV, HD, ctas=c) for c in (128, 256, 512)}),
        "o_proj (matvec_residual K=2048)": (o_proj, D * HQ * HD * 2 + 4 * (HQ * HD + 2 * D),
                                            {f"ctas={c} nr={nr}": lp.matvec_residual_plan(D, HQ * HD, ctas=c, nr=nr)
                                             for c in (128, 256, 512) for nr in (1, 2)}),
        "rms_gate_up_silu": (gate_up, 2 * I * D * 2 + 2 * D + 4 * (D + I),
                             {f"ctas={c}": lp.gate_up_plan(D, I, ctas=c) for c in (128, 256, 512)}),
        "down (matvec_residual K=8192)": (down, D * I * 2 + 4 * (I + 2 * D),
                                          {f"ctas={c} nr={nr}": lp.matvec_residual_plan(D, I, ctas=c, nr=nr)
                                           for c in (128, 256, 512) for nr in (1, 2)}),
        "rms_lm_head_argmax": (lm_head, V * D * 2 + 2 * D + 4 * (D + V),
                               {f"{c}/SM nr={nr} W={w}": lp.lm_head_plan(D, V, ctas_per_sm=c, nr=nr, warps=w)
                                for c, w in ((1, 16), (2, 8), (3, 8), (4, 4)) for nr in (1, 2)}),
    }
    rows, best = [], {}
    for kind, (make, nbytes, plans) in kinds.items():
        for label, plan in plans.items():
            gen = plan[-1]
            regs = kernels[kind].function(device, tuple(gen)).attributes["num_regs"]
            for pdl in (False, True):
                n = 4 if kind.startswith("rms_lm_head") else L
                graph = zip_(*[make(i, plan, pdl) for i in range(n)]).graph_on(stream)
                us = time_graph(graph, stream, 5 if n == 4 else 20) / n
                gbs = nbytes / us / 1e3
                rows.append({"kernel": kind, "variant": label, "generics": list(gen), "regs": regs, "pdl": pdl,
                             "us": round(us, 2), "bytes": nbytes, "GB/s": round(gbs), "vs_copy": round(gbs * 1e9 / rate, 3)})
                if pdl and (kind not in best or us < best[kind][1]):
                    best[kind] = (plan, us, label)
                graph.close()
    print_table("per kernel (graph of 16 launches, distinct weights; LM head: 4 launches)",
                ["kernel", "variant", "regs", "pdl", "us", "GB/s", "vs copy"],
                [[r["kernel"], r["variant"], r["regs"], r["pdl"], r["us"], r["GB/s"], r["vs_copy"]] for r in rows])
    defaults = {"rms_qkv_rope": lp.qkv_plan(D, HQ, HKV, HD), "o_proj (matvec_residual K=2048)":
                lp.matvec_residual_plan(D, HQ * HD), "rms_gate_up_silu": lp.gate_up_plan(D, I),
                "down (matvec_residual K=8192)": lp.matvec_residual_plan(D, I), "rms_lm_head_argmax":
                lp.lm_head_plan(D, V)}
    print("\nfastest with PDL: " + "; ".join(f"{k}: {v[2]} {v[1]:.2f} us" for k, v in best.items()))

    # -- the chain: embed, 16 layers, LM head + argmax, one graph ---------------------------------
    makers = [kinds[k][0] for k in kinds]
    chain_bytes = 2 * D + L * sum(kinds[k][1] for k in list(kinds)[:4]) + kinds["rms_lm_head_argmax"][1]
    floor_us = chain_bytes / rate * 1e6
    chain, outputs = {}, {}
    start_token = dop.from_numpy(np.array([123], np.int32), stream=stream)
    for which, plans in (("fastest", {k: v[0] for k, v in best.items()}), ("defaults", defaults)):
        plan_list = [plans[k] for k in kinds]
        for pdl in (False, True):
            ops = [embed_op(0, lp.embed_plan(D), pdl)]
            for i in range(L):
                ops += [m(i, p, pdl) for m, p in zip(makers[:4], plan_list[:4])]
            ops.append(lm_head(0, plan_list[4], pdl))
            graph = zip_(*ops).graph_on(stream)
            api.memcpy(token, start_token).sync_on(stream)   # one step from a known token: PDL must not change it
            graph.replay()
            stream.synchronize()
            outputs[(which, pdl)] = (h_a.numpy(stream=stream), int(token.numpy(stream=stream)[0]))
            us = time_graph(graph, stream, 20)
            chain[f"{which}, pdl={pdl}"] = us
            graph.close()
    print_table(f"chain: embed + 16 x (qkv_rope, o, gate_up, down) + lm_head/argmax, {chain_bytes / 1e9:.3f} GB, "
                f"floor {floor_us:.1f} us",
                ["variant", "us/step", "vs floor", "GB/s"],
                [[k, round(v, 1), round(v / floor_us, 3), round(chain_bytes / v / 1e3)] for k, v in chain.items()])
    for which in ("fastest", "defaults"):
        (h0, t0), (h1, t1) = outputs[(which, False)], outputs[(which, True)]
        same = bool(np.array_equal(h0, h1)) and t0 == t1
        print(f"{which}: one step with PDL equals one without, bit for bit: {same} (token {t1}, "
              f"hidden finite: {bool(np.isfinite(h1).all())})")
        assert same, f"the {which} chain computes differently with PDL"
    assert int(error.numpy(stream=stream)[0]) == 0, "a kernel flagged a device-side error"
    if os.environ.get("DEVICEOP_BENCH_OUT"):
        path = write_result("llama_kernels_proj", device, rows, [], extra={
            "copy_rate_GBps": round(rate / 1e9, 1), "chain_bytes": chain_bytes, "chain_floor_us": round(floor_us, 2),
            "chain_us": {k: round(v, 2) for k, v in chain.items()},
            "fastest": {k: {"variant": v[2], "us": round(v[1], 2), "plan": [list(x) if isinstance(x, list) else x
                                                                             for x in v[0]]} for k, v in best.items()}})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
