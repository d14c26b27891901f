"""Llama-3.2-1B chunked prefill (issue 27, item 3): prompt tokens/s, chunked against
token-by-token ingestion in the same run, and the chunk's time against its floor.

* Both arms are one graph launch of a whole generation of one new token (the prompt,
  the LM head on its last token, the control step); GPU time between CUDA events
  around the replay, median of ``--reps``.  Prompt tokens/s = prompt length / that time.
* Chunk time: (chunked generation of P tokens - of P/2) / the chunks between, so the
  LM head and the launch cancel; its floor: the bytes a chunk must read (every layer's
  weights once, plus the K and V entries its attention reads, averaged over those
  chunks) / the device-to-device copy rate (bench/_copy.py, measured in this run).
* The weights are a seeded random checkpoint (examples/llama/weights.py); both arms
  must generate the same first token.

    python bench/llama_prefill.py [--prompt-len 1024] [--chunk 16] [--reps 3]
    python bench/llama_prefill.py --smoke    # tiny config; runs on the reference device too; no JSON

JSON (bench/results format) only when DEVICEOP_BENCH_OUT is set.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "examples")]
import deviceop as dop  # noqa: E402
from _common import headline, print_headlines, print_table, write_result  # noqa: E402
from llama.config import LLAMA_3_2_1B, TINY  # noqa: E402
from llama.generate import Llama  # noqa: E402
from llama.model import Sampling  # noqa: E402
from llama.weights import random_weights  # noqa: E402

GREEDY = Sampling()


def time_ingestion(llama: Llama, prompt, chunk: int, reps: int) -> tuple[float, list]:
    """GPU µs of a one-launch generation of one token after ``prompt`` (chunk 0: token by
    token), median of ``reps`` replays after the capture and a warm-up; and its token."""
    stream = llama.cuda_stream
    tokens = llama.generate(prompt, 1, GREEDY, prefill_chunk=chunk)  # captures and warms up
    key = llama._key(len(prompt), 1, GREEDY) + ((chunk,) if chunk else ())
    graph = llama._loops[key]
    times = []
    for _ in range(reps):
        llama.decoder.load_prompt(np.asarray(prompt, np.int32))
        start = stream.record_event()
        graph.replay()
        end = stream.record_event()
        end.synchronize()
        times.append(start.elapsed_ms(end) * 1e3)
    return float(statistics.median(times)), tokens


def time_kernels(llama: Llama, chunk: int, p0: int, reps: int) -> dict:
    """GPU µs of each of a chunk's five layer kernels at chunk position ``p0``: a graph of the
    kernel of every layer (16 launches, distinct weights, with PDL) replayed, median of ``reps``."""
    from deviceop import api
    stream = llama.cuda_stream
    p = llama._prefill(chunk)
    api.memcpy(p.state, dop.from_numpy(np.array([p0, chunk, 1], np.int32), stream=stream)).sync_on(stream)
    out = {}
    for j, name in enumerate(("qkv_rope", "attn", "o_proj", "gate_up_silu", "down_proj")):
        layers = [p.layer_ops(i) for i in range(llama.cfg.num_hidden_layers)]
        for ops in layers:
            for k, op in enumerate(ops):
                if k != j:
                    op.discard()  # built with the layer, not timed here
        graph = dop.zip_(*(ops[j] for ops in layers)).graph_on(stream)
        graph.replay()
        times = []
        for _ in range(reps):
            start = stream.record_event()
            graph.replay()
            end = stream.record_event()
            end.synchronize()
            times.append(start.elapsed_ms(end) * 1e3 / llama.cfg.num_hidden_layers)
        out[name] = float(statistics.median(times))
    return out


def layer_weight_bytes(cfg) -> int:
    """bf16 bytes of every decoder layer's weights (what a chunk reads; not the embedding or head)."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    layer = d * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * d + 3 * d * i + 2 * d
    return 2 * cfg.num_hidden_layers * layer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny config, short prompt (reference device too)")
    args = ap.parse_args(argv)
    device = dop.Device(0)
    if device.is_reference and not args.smoke:
        print("llama_prefill measures a GPU; this machine has only the reference device (try --smoke).")
        return 0
    cfg = TINY if args.smoke else LLAMA_3_2_1B
    P = 40 if args.smoke else args.prompt_len
    T, reps = args.chunk, (1 if args.smoke else args.reps)
    if P % (2 * T):
        print(f"--prompt-len {P} must be a multiple of 2 x the chunk ({2 * T}) for the chunk time; rounding down")
        P = max(2 * T, P // (2 * T) * (2 * T))
    began = time.perf_counter()
    log = lambda *a: print(f"[{time.perf_counter() - began:5.0f} s]", *a, flush=True)  # noqa: E731

    stream = device.new_stream()
    if device.is_reference:
        rate = 1e12  # the smoke run has no copy rate; its ratios mean nothing
    else:
        from _copy import copy_rate
        rate = copy_rate(stream)
    llama = Llama(cfg, random_weights(cfg, seed=args.seed), capacity=P + 64, stream=stream)
    log(f"weights ready; copy rate {rate / 1e12:.3f} TB/s")
    prompt = [int(x) for x in np.random.default_rng(args.seed).integers(0, cfg.vocab_size, P)]

    chunked_us, chunked_tok = time_ingestion(llama, prompt, T, reps)
    log(f"chunked (T={T}): {chunked_us:.0f} us for {P} prompt tokens")
    half_us, _ = time_ingestion(llama, prompt[: P // 2], T, reps)
    log(f"chunked (T={T}), half the prompt: {half_us:.0f} us")
    token_us, token_tok = time_ingestion(llama, prompt, 0, reps)
    log(f"token by token: {token_us:.0f} us")
    same = chunked_tok == token_tok

    chunks = (P - P // 2) // T
    chunk_us = (chunked_us - half_us) / chunks
    mean_kv = (P // 2 + P) / 2 + T / 2  # entries attention reads in a chunk, averaged over the timed chunks
    floor_us = (layer_weight_bytes(cfg) + cfg.kv_bytes(int(mean_kv))) / rate * 1e6
    rows = [
        {"arm": f"chunked prefill, T={T}", "prompt_len": P, "us": round(chunked_us, 1),
         "prompt_tokens_per_s": round(P / chunked_us * 1e6, 1)},
        {"arm": "token by token (one decode step a prompt token)", "prompt_len": P, "us": round(token_us, 1),
         "prompt_tokens_per_s": round(P / token_us * 1e6, 1)},
        {"arm": f"one chunk of {T} (marginal, prompt {P // 2}..{P})", "us": round(chunk_us, 1),
         "floor_us": round(floor_us, 1), "vs_floor": round(chunk_us / floor_us, 3)},
    ]
    print_table(f"Llama prefill ({'tiny, reference device' if args.smoke else 'Llama-3.2-1B'}), prompt {P}",
                ["arm", "us", "prompt tok/s", "floor us", "vs floor"],
                [[r["arm"], r["us"], r.get("prompt_tokens_per_s", ""), r.get("floor_us", ""), r.get("vs_floor", "")]
                 for r in rows])
    speedup = token_us / chunked_us
    if not args.smoke:
        kernels = time_kernels(llama, T, 3 * P // 4, max(reps, 5))
        d, i = cfg.hidden_size, cfg.intermediate_size
        wbytes = {"qkv_rope": 2 * d * (cfg.q_size + 2 * cfg.kv_size), "attn": cfg.kv_bytes(3 * P // 4 + T) //
                  cfg.num_hidden_layers, "o_proj": 2 * cfg.q_size * d, "gate_up_silu": 4 * d * i, "down_proj": 2 * d * i}
        print_table(f"one layer's kernels in a chunk at position {3 * P // 4} (16 launches a graph, us a launch)",
                    ["kernel", "us", "bytes", "floor us", "vs floor"],
                    [[k, round(v, 2), wbytes[k], round(wbytes[k] / rate * 1e6, 2), round(v / (wbytes[k] / rate * 1e6), 2)]
                     for k, v in kernels.items()])
        rows.append({"arm": f"layer kernels at position {3 * P // 4}, us a launch",
                     **{k: round(v, 2) for k, v in kernels.items()}})
    print(f"\nchunked / token-by-token speed-up: {speedup:.2f}x; first generated token "
          f"{'equal' if same else 'DIFFERS'} ({chunked_tok} vs {token_tok})")
    if args.smoke or not os.environ.get("DEVICEOP_BENCH_OUT"):
        return 0 if same else 1
    heads = [headline("prefill_speedup_vs_token_by_token", speedup, 5.0, "higher"),
             headline("prefill_chunk_vs_floor", chunk_us / floor_us, 1.5, "lower")]
    path = write_result("llama_prefill", device, rows, heads, {"copy_rate_tbs": rate / 1e12, "chunk": T,
                                                              "same_first_token": same})
    print_headlines(heads, path)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
