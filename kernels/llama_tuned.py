"""Decode-kernel plans measured faster than the plan rules at particular shapes.

The plan functions of kernels/llama_proj.py and kernels/llama_attn.py pick grids, warps and
buffers by rules measured at the full Llama-3.2-1B shape on an H100.  A tensor-parallel rank
runs the same kernels at its shard's shapes (heads/N, KV heads/N, intermediate/N, vocab/N),
where a launch's fixed costs weigh more; where bench/llama_kernels_shard.py measured a faster
plan at such a shape, ``TUNED`` holds it: ``(plan, shape) -> keyword arguments`` of the plan
function, which takes them for every argument its caller leaves unset (None).  A caller's own
argument always wins, and ``tuned=False`` asks a plan function for its rules alone.

Keys (every number the plan function is given):

* ``("qkv", (hidden, heads, kv_heads, head_dim))``: qkv_plan's ctas, ch, warps, nb
* ``("matvec", (n, k))``: matvec_residual_plan's ctas, nr, ch, warps, ks, nb (the O projection is
  ``(hidden, heads * head_dim)``, down ``(hidden, intermediate)``); matvec_allreduce_plan takes
  the entry where its own limits allow (a grid every CTA of which is resident at once)
* ``("gate_up", (hidden, intermediate))``: gate_up_plan's ctas, ch, warps
* ``("lm_head", (hidden, vocab))``: lm_head_plan's ctas_per_sm, nr, ch, warps
* ``("attn", (head_dim, group, kv_heads))``: attn_plan's splits, min_chunk, warps

Empty until measured: bench/llama_kernels_shard.py prints the entries its sweep supports (for
Llama-3.2-1B and 3.1-8B whole and as ranks of TP 2 and 4); tests/test_llama_tuned.py checks that
every plan those ranks launch, entries included, is legal and covers its rows.
"""
from __future__ import annotations

from ._checks import _need

TUNED: dict[tuple[str, tuple], dict] = {}


def choose(plan: str, shape: tuple, given: dict, tuned: bool = True) -> dict:
    """``given`` (a plan function's keyword arguments, None where the caller chose nothing) with
    each None replaced by TUNED's choice for ``plan`` at ``shape``, if any (and ``tuned``)."""
    entry = TUNED.get((plan, tuple(shape)), {}) if tuned else {}
    unknown = set(entry) - set(given)
    _need(not unknown, f"llama_tuned.TUNED[{(plan, tuple(shape))!r}] names {sorted(unknown)}, which the {plan} plan "
                       f"does not take (it takes {sorted(given)}); fix the entry")
    return {k: entry.get(k) if v is None else v for k, v in given.items()}
