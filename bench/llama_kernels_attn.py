"""Llama-3.2-1B decode attention and the device sampler: GPU time from CUDA-graph replays.

Attention alone: a graph of the 16 layers' attn_decode launches (each on its own layer's cache slice of a
[16, 8, 4096, 64] bf16 K and V: 134 MB, more than the 50 MB L2, so long contexts stream from HBM),
replayed after warm-up at pos 32, 160, 1024 and 4095 (set in device memory, no recapture); time per
layer = median replay time / 16, with PDL.  Bytes per layer = the K and V entries 0..pos plus q and the
output; floor = bytes / the device-to-device copy rate measured in the same run.

Attention in its chain: a graph of 16 x (rms_qkv_rope -> attn_decode -> matvec_residual (O)), every
launch PDL, at the same positions, against the same chain without attention: the difference is what
attention adds to a decode step, the number that matters (the QKV kernel appends entry pos and writes
q, as in the model, so the PREFETCH contract holds: pos is set before the replay).

Variants: attn_plan's generics for splits S and minimum chunk MINL, PREFETCH 0/1; with
DEVICEOP_ATTN_BASELINE=path/to/llama_attn.cu (an earlier attn_decode<HD, G, S, MINL> with the same
parameters) that kernel too, as the "before".
Sampler: a graph of 16 sample launches over fp32 logits [128256], per launch, for each mode.

    python bench/llama_kernels_attn.py      (writes JSON only when DEVICEOP_BENCH_OUT is set)
"""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import deviceop as dop  # noqa: E402
from deviceop import DeviceOpVec, api  # noqa: E402
from deviceop.kernel import Kernel  # noqa: E402
from _common import gpu_device, print_table, replay_us, write_result  # noqa: E402
from _copy import copy_rate  # noqa: E402
from deviceop.kernels import llama_proj as lp  # noqa: E402
from deviceop.kernels.llama_attn import attn_buffers, attn_decode, attn_plan, sample, sample_buffers  # noqa: E402

LAYERS, HKV, G, HD, CAP, V = 16, 8, 4, 64, 4096, 128256
HQ, D, EPS = HKV * G, 2048, 1e-5
POSITIONS = (32, 160, 1024, 4095)


def variants():
    """(label, kernel, generics, splits) of every attention launch measured."""
    out = []
    base = os.environ.get("DEVICEOP_ATTN_BASELINE")
    if base:
        old = Kernel("attn_decode", Path(base), attn_decode.params, generics=["HD", "G", "S", "MINL"], block=128,
                     reference=attn_decode.reference)
        out.append(("before S=16 MINL=64", old, [HD, G, 16, 64], 16))
    for splits, minl, pf, warps in ((16, 64, 0, 16), (16, 64, 1, 16), (16, 64, 1, 8), (16, 256, 1, 16),
                                    (16, 256, 1, 8), (32, 64, 1, 16), (32, 64, 1, 8)):
        gen = attn_plan(CAP, HD, G, splits=splits, min_chunk=minl, prefetch=pf, warps=warps)[1]
        out.append((f"S={splits} MINL={minl} PF={pf} warps={G * gen[6]}", attn_decode, gen, gen[2]))
    return out


def main() -> int:
    device = gpu_device("llama_kernels_attn")
    if device is None:
        return 0
    stream = device.new_stream()
    rate = copy_rate(stream)
    rng = np.random.default_rng(0)
    import ml_dtypes
    bf = ml_dtypes.bfloat16
    kc = dop.from_numpy(rng.standard_normal((LAYERS, HKV, CAP, HD), dtype=np.float32).astype(bf), stream=stream)
    vc = dop.from_numpy(rng.standard_normal((LAYERS, HKV, CAP, HD), dtype=np.float32).astype(bf), stream=stream)
    per_layer = HKV * CAP * HD
    kl = [kc.view([-1])[i * per_layer:(i + 1) * per_layer].view([HKV, CAP, HD]) for i in range(LAYERS)]
    vl = [vc.view([-1])[i * per_layer:(i + 1) * per_layer].view([HKV, CAP, HD]) for i in range(LAYERS)]
    f32 = lambda *shape: dop.from_numpy(rng.standard_normal(shape, dtype=np.float32), stream=stream)  # noqa: E731
    q = [f32(HQ * HD) for _ in range(LAYERS)]
    out = [dop.empty([HQ * HD], stream=stream) for _ in range(LAYERS)]
    pos = dop.from_numpy(np.zeros(1, np.int32), stream=stream)
    # the chain's projections (weights ~N(0, 0.02), distinct per layer: 336 MB, streamed from HBM)
    wbf = lambda *shape: dop.from_numpy((rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(bf),  # noqa: E731
                                        stream=stream)
    qkv_rows = (HQ + 2 * HKV) * HD
    w_qkv = [wbf(qkv_rows, D) for _ in range(LAYERS)]
    w_o = [wbf(D, HQ * HD) for _ in range(LAYERS)]
    norm = wbf(D)
    inv_freq = dop.from_numpy((1.0 / 500000 ** (np.arange(0, HD, 2) / HD)).astype(np.float32), stream=stream)
    error = dop.from_numpy(np.zeros(1, np.int32), stream=stream)
    h_a, h_b, qc, attn_out = f32(D), f32(D), f32(HQ * HD), f32(HQ * HD)
    qkv_tile, qkv_gen = lp.qkv_plan(D, HQ, HKV, HD)
    o_tile, o_gen = lp.matvec_residual_plan(D, HQ * HD)

    def set_pos(p):
        api.memcpy(pos, dop.from_numpy(np.array([p], np.int32), stream=stream)).sync_on(stream)

    def kv_bytes(p):
        return 2 * (p + 1) * HKV * HD * 2

    rows, table, ctable = [], [], []
    chain_none = {}

    def chain(attn):
        ops = []
        for i in range(LAYERS):
            ops.append(lp.rms_qkv_rope(qc.partition([qkv_tile]), h_a, norm, w_qkv[i], inv_freq, pos, kl[i], vl[i],
                                       error, EPS, CAP).generics(qkv_gen).pdl())
            if attn is not None:
                ops.append(attn(i))
            ops.append(lp.matvec_residual(h_b.partition([o_tile]), attn_out, w_o[i], h_a).generics(o_gen).pdl())
        return DeviceOpVec(ops).graph_on(stream)

    graph = chain(None)
    for p in POSITIONS:
        set_pos(p)
        chain_none[p] = replay_us(graph, stream, per=LAYERS)
        ctable.append(["no attention", p, f"{chain_none[p]:.2f}", "", ""])
        rows.append({"kernel": "chain qkv+o", "pos": p, "us_per_layer": round(chain_none[p], 3)})
    graph.close()

    for label, kern, gen, splits in variants():
        try:
            ws, counters = attn_buffers(HKV, HD, G, splits, stream=stream)
            tile = G * HD // splits
            alone = DeviceOpVec([kern(out[i].partition([tile]), q[i], kl[i], vl[i], pos, ws, counters, CAP)
                                 .generics(gen).pdl() for i in range(LAYERS)]).graph_on(stream)
            for p in POSITIONS:
                set_pos(p)
                us = replay_us(alone, stream, per=LAYERS)
                nbytes = kv_bytes(p) + 2 * HQ * HD * 4
                floor_us = nbytes / rate * 1e6
                rows.append({"kernel": "attn_decode", "variant": label, "generics": gen, "pos": p,
                             "us_per_layer": round(us, 3), "bytes": nbytes, "GBps": round(nbytes / us / 1e3, 1),
                             "floor_us": round(floor_us, 3), "vs_floor": round(us / floor_us, 3)})
                table.append([label, p, f"{us:.2f}", f"{nbytes / us / 1e3:.0f}", f"{floor_us:.2f}",
                              f"{us / floor_us:.2f}"])
            alone.close()
            graph = chain(lambda i: kern(attn_out.partition([tile]), qc, kl[i], vl[i], pos, ws, counters, CAP)
                          .generics(gen).pdl())
            for p in POSITIONS:
                set_pos(p)
                us = replay_us(graph, stream, per=LAYERS)
                rows.append({"kernel": "chain qkv+attn+o", "variant": label, "generics": gen, "pos": p,
                             "us_per_layer": round(us, 3), "attn_marginal_us": round(us - chain_none[p], 3)})
                ctable.append([label, p, f"{us:.2f}", f"{us - chain_none[p]:.2f}",
                               f"{kv_bytes(p) / rate * 1e6:.2f}"])
            graph.close()
            if int(error.numpy(stream=stream)[0]):
                print(f"{label}: the QKV kernel flagged an error word")
        except Exception:  # one variant failing must not cost the others' numbers
            print(f"{label} failed:")
            traceback.print_exc()
    print_table(f"attn_decode alone, per layer, 16-layer graph, PDL ({device.name}; copy rate {rate / 1e12:.2f} TB/s)",
                ["variant", "pos", "us/layer", "GB/s", "floor us", "x floor"], table)
    print_table("chain 16 x (rms_qkv_rope -> attn_decode -> O matvec_residual), PDL, per layer: attention's "
                "marginal cost = chain - chain without attention; KV floor = its K/V bytes at the copy rate",
                ["variant", "pos", "us/layer", "attn marginal us", "KV floor us"], ctable)

    # the sampler: 16 launches a graph, one logits vector (L2-resident, as after the LM head)
    logits_flat = dop.from_numpy((rng.standard_normal(V) * 0.05).astype(np.float32), stream=stream)
    logits = dop.from_numpy((rng.standard_normal(V) * 3).astype(np.float32), stream=stream)
    step = dop.from_numpy(np.array([5], np.int32), stream=stream)
    part, token, state = sample_buffers(V, 32, stream=stream)
    stable = []
    modes = [("greedy", logits, 0.0, 0, 1.0), ("temperature 1.0", logits, 1.0, 0, 1.0),
             ("top_k 50 top_p 0.9 T 0.6", logits, 0.6, 50, 0.9), ("top_k 1000 T 1.0", logits, 1.0, 1000, 1.0),
             ("top_p 0.9 flat logits (fallback)", logits_flat, 1.0, 0, 0.9)]
    for label, lg, t, k, p in modes:
        for pdl in (False, True):
            ops = [sample(part.partition([1, 68]), lg, token, state, step, V, t, k, p, 7).generics([32])
                   for _ in range(16)]
            graph = DeviceOpVec([o.pdl() if pdl else o for o in ops]).graph_on(stream)
            us = replay_us(graph, stream, per=16)
            graph.close()
            rows.append({"kernel": "sample", "mode": label, "pdl": pdl, "us": round(us, 3),
                         "bytes": V * 4, "GBps": round(V * 4 / us / 1e3, 1)})
            stable.append([label, "yes" if pdl else "no", f"{us:.2f}", f"{V * 4 / us / 1e3:.0f}"])
    print_table("sample<32> over 128256 logits (graph of 16 launches)", ["mode", "pdl", "us", "GB/s"], stable)
    if os.environ.get("DEVICEOP_BENCH_OUT"):
        print("wrote", write_result("llama_kernels_attn", device, rows, [], {"copy_rate_TBps": round(rate / 1e12, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
