"""Llama-3.2-1B decode attention and the device sampler, alone: GPU time from CUDA-graph replays.

Attention: a graph of the 16 layers' attn_decode launches (each on its own layer's cache slice of a
[16, 8, 4096, 64] bf16 K and V: 134 MB, more than the 50 MB L2, so long contexts stream from HBM),
replayed after warm-up at pos 32, 160, 1024 and 4095 (set in device memory, no recapture); time per
layer = median replay time / 16, with and without PDL.  Bytes per layer = the K and V entries 0..pos
plus q and the output; floor = bytes / the device-to-device copy rate measured in the same run.
Sampler: a graph of 16 sample launches over fp32 logits [128256], per launch, for each mode.

    python bench/llama_kernels_attn.py      (writes JSON only when DEVICEOP_BENCH_OUT is set)
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import deviceop as dop  # noqa: E402
from deviceop import DeviceOpVec, api  # noqa: E402
from _common import gpu_device, print_table, write_result  # noqa: E402
from _copy import copy_rate  # noqa: E402
from kernels.llama_attn import attn_buffers, attn_decode, sample, sample_buffers  # noqa: E402

LAYERS, HKV, G, HD, CAP, V = 16, 8, 4, 64, 4096, 128256


def replay_us(graph, stream, per: int, reps: int = 30) -> float:
    for _ in range(5):
        graph.launch().sync_on(stream)
    times = []
    for _ in range(reps):
        start = stream.record_event()
        graph.replay()
        end = stream.record_event()
        end.synchronize()
        times.append(start.elapsed_ms(end) * 1e3 / per)
    return statistics.median(times)


def main() -> int:
    device = gpu_device("llama_kernels_attn")
    if device is None:
        return 0
    stream = device.new_stream()
    rate = copy_rate(stream)
    rng = np.random.default_rng(0)
    import ml_dtypes
    kc = dop.from_numpy(rng.standard_normal((LAYERS, HKV, CAP, HD)).astype(ml_dtypes.bfloat16), stream=stream)
    vc = dop.from_numpy(rng.standard_normal((LAYERS, HKV, CAP, HD)).astype(ml_dtypes.bfloat16), stream=stream)
    per_layer = HKV * CAP * HD
    kl = [kc.view([-1])[i * per_layer:(i + 1) * per_layer].view([HKV, CAP, HD]) for i in range(LAYERS)]
    vl = [vc.view([-1])[i * per_layer:(i + 1) * per_layer].view([HKV, CAP, HD]) for i in range(LAYERS)]
    q = [dop.from_numpy(rng.standard_normal(HKV * G * HD).astype(np.float32), stream=stream) for _ in range(LAYERS)]
    out = [dop.empty([HKV * G * HD], stream=stream) for _ in range(LAYERS)]
    pos = dop.from_numpy(np.zeros(1, np.int32), stream=stream)

    def set_pos(p):
        api.memcpy(pos, dop.from_numpy(np.array([p], np.int32), stream=stream)).sync_on(stream)

    rows, table = [], []
    configs = [(32, 64, True), (32, 64, False), (32, 16, True), (32, 32, True), (16, 64, True), (64, 64, True)]
    for splits, minl, pdl in configs:
        ws, counters = attn_buffers(HKV, HD, G, splits, stream=stream)
        ops = []
        for i in range(LAYERS):
            launch = attn_decode(out[i].partition([G * HD // splits]), q[i], kl[i], vl[i], pos, ws, counters, CAP) \
                .generics([HD, G, splits, minl])
            ops.append(launch.pdl() if pdl else launch)
        graph = DeviceOpVec(ops).graph_on(stream)
        for p in (32, 160, 1024, 4095):
            set_pos(p)
            us = replay_us(graph, stream, LAYERS)
            nbytes = 2 * (p + 1) * HKV * HD * 2 + 2 * HKV * G * HD * 4
            floor_us = nbytes / rate * 1e6
            rows.append({"kernel": "attn_decode", "splits": splits, "min_chunk": minl, "pdl": pdl, "pos": p,
                         "us_per_layer": round(us, 3), "bytes": nbytes, "GBps": round(nbytes / us / 1e3, 1),
                         "floor_us": round(floor_us, 3), "vs_floor": round(us / floor_us, 3)})
            table.append([f"attn S={splits} MINL={minl}{' pdl' if pdl else ''}", p, f"{us:.2f}",
                          f"{nbytes / us / 1e3:.0f}", f"{floor_us:.2f}", f"{us / floor_us:.2f}"])
        graph.close()
    print_table(f"attn_decode per layer, 16-layer graph ({device.name}; copy rate {rate / 1e12:.2f} TB/s)",
                ["config", "pos", "us/layer", "GB/s", "floor us", "x floor"], table)

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
            us = replay_us(graph, stream, 16)
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
