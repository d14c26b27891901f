"""Which kernels a decode step launches, with which tiles and generics: pure arithmetic on the
config, the KV capacity and a tensor-parallel shard (so a shape the kernels cannot serve is refused
before anything is allocated, and every kernel can be compiled at start-up)."""
from __future__ import annotations

from deviceop.kernels import llama_attn as attn_k
from deviceop.kernels import llama_proj as proj
from deviceop.kernels.llama_step import llama_step, llama_step_start
from deviceop.kernels.llama_tp import (PLACE_TILE, matvec_allreduce, matvec_allreduce_plan, tp_argmax_pair,
                                       tp_argmax_pick, tp_place)

from .config import LlamaConfig
from .tp import Shard

# Launch shapes measured on the H100 (kernels/llama_attn.cu, llama_sample.cu headers): attention
# takes attn_plan's choices (16 splits, chunks of >= 64 rows, 16 warps) or those measured better at
# a shard's KV heads (kernels/llama_tuned.py).
# The decode loop keeps attn_decode's PREFETCH contract: the position is written only by the control
# step that ends an iteration, and each step's QKV kernel appends entry pos alone, so attention loads
# the older entries before its griddepcontrol.wait.
ATTN_PREFETCH = True
SAMPLE_CANDIDATES = 32  # a CTA's candidates, fewer past 131072 logits (llama_attn.sample_candidates)


def launch_plans(cfg: LlamaConfig, capacity: int, shard: Shard) -> dict:
    """Launch name -> (tile, generics) of a decode step (the head's: (tile, logits rows, generics))."""
    d, hd = cfg.hidden_size, cfg.head_dim
    plans = {"embed": proj.embed_plan(d), "qkv": proj.qkv_plan(d, shard.heads, shard.kv_heads, hd),
             "o": proj.matvec_residual_plan(d, shard.q_size), "gate_up": proj.gate_up_plan(d, shard.inter),
             "down": proj.matvec_residual_plan(d, shard.inter), "head": proj.lm_head_plan(d, shard.vocab),
             # attention: a fixed grid of splits a KV head (the chunks follow the device-side length)
             "attn": attn_k.attn_plan(capacity, hd, cfg.group, **attn_args(shard))}
    if shard.size > 1:  # the O and down projections with the all-reduce in their epilogue
        plans["o_ar"] = matvec_allreduce_plan(d, shard.q_size, shard.size)
        plans["down_ar"] = matvec_allreduce_plan(d, shard.inter, shard.size)
    return plans


def attn_args(shard: Shard) -> dict:
    """attn_plan's keyword arguments for a shard (its KV heads set the grid with the splits)."""
    return dict(prefetch=ATTN_PREFETCH, kv_heads=shard.kv_heads)


def decode_kernels(cfg: LlamaConfig, capacity: int, shard: Shard | None = None) -> list:
    """(kernel, generics) of every kernel a decode loop launches, greedy or sampling (the same on
    every rank of a tensor-parallel group): what ``dop.precompile`` takes, to compile them all
    at start-up in parallel instead of one by one at the first capture."""
    shard = shard or Shard(cfg)
    p = launch_plans(cfg, capacity, shard)
    items = [(proj.embed_gather, p["embed"][1]), (proj.rms_qkv_rope, p["qkv"][1]), (attn_k.attn_decode, p["attn"][1]),
             (proj.matvec_residual, p["o"][1]), (proj.rms_gate_up_silu, p["gate_up"][1]),
             (proj.matvec_residual, p["down"][1]), (proj.rms_lm_head_argmax, p["head"][2]),
             (attn_k.sample, [attn_k.sample_candidates(cfg.vocab_size, SAMPLE_CANDIDATES)]),
             (llama_step, ()), (llama_step_start, ())]
    if shard.size > 1:
        items += [(tp_argmax_pair, ()), (tp_argmax_pick, ()), (tp_place, [PLACE_TILE]),
                  (matvec_allreduce, p["o_ar"][1]), (matvec_allreduce, p["down_ar"][1])]
    unique = {(k.name, tuple(g)): (k, list(g)) for k, g in items}
    return list(unique.values())
