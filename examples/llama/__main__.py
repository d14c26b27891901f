"""Llama decode with deviceop: a whole generation in one graph launch.

    python -m examples.llama                       # tiny config without a GPU, Llama-3.2-1B's shape with one
    python -m examples.llama --config DIR/config.json --weights DIR   # a Hugging Face checkpoint
    python -m examples.llama --prompt-len 32 --max-new 128 --temperature 0.8 --top-k 50 --top-p 0.9
    torchrun --nproc-per-node 2 -m examples.llama --tp 2      # tensor parallel, one process per GPU

Without ``--weights`` the weights are random (seeded).  Prints the tokens, the
time per generated token against the memory floor (every weight read once per
token, at the device-to-device copy rate measured here), and the host time of
the one launch.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
import deviceop as dop  # noqa: E402

from .config import LLAMA_3_2_1B, TINY, LlamaConfig  # noqa: E402
from .generate import Llama  # noqa: E402
from .model import Sampling  # noqa: E402
from .weights import load_checkpoint, random_weights  # noqa: E402


def copy_rate(stream, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting the bytes read and written (as
    bench/_copy.py does): what a kernel streaming its weights can hope to read at."""
    from deviceop import api
    n = nbytes // 4
    a = dop.from_numpy(np.random.default_rng(0).standard_normal(n, dtype=np.float32), stream=stream)
    b = dop.empty([n], stream=stream)
    times = []
    for _ in range(12):
        start, end = stream.record_event(), None
        api.memcpy(b, a).async_on(stream)
        end = stream.record_event()
        end.synchronize()
        times.append(start.elapsed_ms(end) * 1e-3)
    return 2 * nbytes / float(np.median(times[2:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.llama", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="a Hugging Face config.json (default: Llama-3.2-1B on a GPU, a tiny "
                                     "config on the reference device)")
    ap.add_argument("--weights", help="a checkpoint directory of safetensors files (default: random weights)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt (default 0)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--max-new", type=int, default=128, help="tokens to generate (default 128)")
    ap.add_argument("--capacity", type=int, default=4096, help="KV cache entries (default 4096)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off (default 0)")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 = off (default 1)")
    ap.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="ingest the prompt this many tokens a pass over the weights (8 or 16 at the 1B shape; "
                         "default 0: token by token), still in the one launch")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (launch that many processes with "
                                                      "torchrun or mpirun; default 1)")
    args = ap.parse_args(argv)
    for name in ("prompt_len", "max_new", "capacity"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.prefill_chunk < 0:
        ap.error("--prefill-chunk must be 0 (token by token) or a chunk size")
    if args.prompt_len + args.max_new > args.capacity:
        ap.error(f"--prompt-len {args.prompt_len} + --max-new {args.max_new} exceed --capacity {args.capacity}")

    device = dop.Device(0)
    say = print
    if args.tp > 1:  # one process per GPU: rank 0 speaks for the group
        import os
        rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
        say = print if rank == 0 else (lambda *a, **k: None)
    cfg = LlamaConfig.from_json(args.config) if args.config else TINY if device.is_reference else LLAMA_3_2_1B
    say(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size} "
          f"({cfg.weight_bytes() / 1e9:.3f} GB of bf16 weights); device: "
          f"{'reference (NumPy; no timing)' if device.is_reference else device.name}")
    t0 = time.perf_counter()
    weights = load_checkpoint(args.weights) if args.weights else random_weights(cfg, args.seed)
    try:
        llama = Llama(cfg, weights, capacity=args.capacity, pdl=not args.no_pdl,
                      prefill_chunk=args.prefill_chunk or None, tp=args.tp)
    except dop.DeviceOpError as exc:  # a split or a chunk the model cannot serve: the flag's constraint
        ap.error(str(exc))
    say(f"weights on the device in {time.perf_counter() - t0:.1f} s")
    prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, args.prompt_len)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)

    try:
        tokens = llama.generate(prompt, args.max_new, sampling)
    except dop.DeviceOpError as exc:  # a request the model cannot serve: the flag's constraint, no traceback
        ap.error(str(exc))
    say(f"generated {len(tokens)} tokens: {tokens[:16]}{' ...' if len(tokens) > 16 else ''}")
    if device.is_reference:
        return 0
    timing = llama.time_generation(prompt, args.max_new, sampling)
    per_token, host_us = timing["us_per_token"] * 1e-6, timing["host_us"]
    # the floor: the bytes a token reads (one rank's share, at TP > 1) at the copy rate
    floor = (cfg.weight_bytes() + cfg.kv_bytes(args.prompt_len + args.max_new // 2)) / args.tp / copy_rate(
        llama.cuda_stream)
    say(f"{per_token * 1e6:.1f} us/token ({1 / per_token:.0f} tokens/s), floor {floor * 1e6:.1f} us: "
          f"{per_token / floor:.3f}x; host time of the one launch: {host_us:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
