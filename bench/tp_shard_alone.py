"""Where tensor-parallel decode's time goes: one rank's share of the model run alone on one GPU.

A TP=N rank of Llama-3.2-1B or Llama-3.1-8B runs the decode kernels at its shard's shapes
(hidden unchanged; heads, KV heads, intermediate size and vocabulary / N) and adds the
all-reduces.  Run alone, at TP=1, a model of exactly those shapes costs what the rank's
kernels cost without any exchange: bench/tp_decode.py's TP=N time less this is what the
all-reduces and the ranks' skew cost, and TP=1's time over this bounds the speedup any
all-reduce could give.  Per token over a whole generation in one graph launch (32-token
prompt, 48 new, median of 3), against the floor (weights + KV read / copy rate).

    python bench/tp_shard_alone.py      # prints one line a (model, N)
"""
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "examples")]

import numpy as np  # noqa: E402

import deviceop as dop  # noqa: E402
from llama.config import LLAMA_3_1_8B, LLAMA_3_2_1B  # noqa: E402
from llama.generate import Llama  # noqa: E402
from llama.model import Sampling  # noqa: E402
from llama.plans import decode_kernels  # noqa: E402
from tp_decode import gpu_weights  # noqa: E402


def shard_config(base, n: int):
    """A model of the shapes a TP=n rank of ``base`` runs (token ids 1 and 2 for BOS and EOS, inside
    the shrunk vocabulary)."""
    return dataclasses.replace(base, intermediate_size=base.intermediate_size // n,
                               num_attention_heads=base.num_attention_heads // n,
                               num_key_value_heads=base.num_key_value_heads // n,
                               vocab_size=base.vocab_size // n, bos_token_id=1, eos_token_id=(2,))


def main() -> int:
    import torch
    from _copy import copy_rate
    device = dop.Device(0)
    if device.is_reference:
        print("tp_shard_alone measures a GPU; this machine has none. Nothing to measure.")
        return 0
    rate = copy_rate(device.new_stream())
    print(f"{device.name}: copy rate {rate / 1e12:.3f} TB/s", flush=True)
    for name, base in (("1b", LLAMA_3_2_1B), ("8b", LLAMA_3_1_8B)):
        for n in (1, 2, 4):
            cfg = shard_config(base, n)
            weights = gpu_weights(cfg, 0)
            prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 32)
            dop.precompile(decode_kernels(cfg, 4096))
            llama = Llama(cfg, weights, capacity=4096)
            us = llama.time_generation(prompt, 48, Sampling(), 3)["us_per_token"]
            floor = (cfg.weight_bytes() + cfg.kv_bytes(32 + 24)) / rate * 1e6
            print(f"{name} shard 1/{n}: {us:.1f} us/token, floor {floor:.1f} us, {us / floor:.3f}x, above floor "
                  f"{us - floor:.1f} us ({(us - floor) / cfg.num_hidden_layers:.2f} us a layer)", flush=True)
            del llama, weights
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
