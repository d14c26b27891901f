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

The entries are the ones bench/llama_kernels_shard.py's sweep supported (for Llama-3.2-1B and
3.1-8B whole and as ranks of TP 2 and 4, and SmolLM2-135M whole); tests/test_llama_tuned.py checks
that every plan those models launch, entries included, is legal and covers its rows.
"""
from __future__ import annotations

from ._checks import _need

# From bench/llama_kernels_shard.py's sweep on an H100 (its numbers: bench/RESULTS.md and
# bench/results/llama_kernels_shard.json); an entry is kept where its shape's layer chain got
# faster, not only the kernel alone, which is why the sweep's TP=4 Llama-3.2-1B qkv and O entries
# are not here.
TUNED: dict[tuple[str, tuple], dict] = {
    # Llama-3.2-1B: O (TP=1) and down (TP=4)
    ("matvec", (2048, 2048)): {"ctas": 128, "nr": 2, "ch": 4, "warps": 16, "ks": 2, "nb": 1},
    # Llama-3.2-1B at TP=2: qkv, O and down
    ("qkv", (2048, 16, 4, 64)): {"ctas": 64, "ch": 8, "warps": 12, "nb": 2},
    ("matvec", (2048, 1024)): {"ctas": 128, "nr": 2, "ch": 4, "warps": 8, "ks": 1, "nb": 2},
    ("matvec", (2048, 4096)): {"ctas": 128, "nr": 1, "ch": 4, "warps": 16, "ks": 2, "nb": 2},
    # Llama-3.1-8B: down
    ("matvec", (4096, 14336)): {"ctas": 128, "nr": 2, "ch": 4, "warps": 16, "ks": 1, "nb": 2},
    # Llama-3.1-8B at TP=2: qkv, and down where the all-reduce is not fused
    ("qkv", (4096, 16, 4, 128)): {"ctas": 128, "ch": 4, "warps": 12, "nb": 3},
    ("matvec", (4096, 7168)): {"ctas": 256, "nr": 2, "ch": 4, "warps": 8, "ks": 1, "nb": 2},
    # Llama-3.1-8B at TP=4: qkv, O, and down where the all-reduce is not fused
    ("qkv", (4096, 8, 2, 128)): {"ctas": 64, "ch": 4, "warps": 12, "nb": 3},
    ("matvec", (4096, 1024)): {"ctas": 128, "nr": 2, "ch": 4, "warps": 16, "ks": 1, "nb": 2},
    ("matvec", (4096, 3584)): {"ctas": 512, "nr": 2, "ch": 1, "warps": 8, "ks": 2, "nb": 2},
    # SmolLM2-135M: qkv, O, gate/up, down and the LM head (its layer chain 12.49 -> 10.95 us)
    ("qkv", (576, 9, 3, 64)): {"ctas": 96, "ch": 2, "warps": 5, "nb": 2},
    ("matvec", (576, 576)): {"ctas": 72, "nr": 2, "ch": 2, "warps": 8, "ks": 2, "nb": 2},
    ("gate_up", (576, 1536)): {"ctas": 768, "ch": 4, "warps": 2},
    ("matvec", (576, 1536)): {"ctas": 72, "nr": 2, "ch": 2, "warps": 16, "ks": 4, "nb": 2},
    ("lm_head", (576, 49152)): {"ctas_per_sm": 2, "nr": 4, "ch": 4, "warps": 8},
}


def choose(plan: str, shape: tuple, given: dict, tuned: bool = True) -> dict:
    """``given`` (a plan function's keyword arguments, None where the caller chose nothing) with
    each None replaced by TUNED's choice for ``plan`` at ``shape``, if any (and ``tuned``)."""
    entry = TUNED.get((plan, tuple(shape)), {}) if tuned else {}
    unknown = set(entry) - set(given)
    _need(not unknown, f"llama_tuned.TUNED[{(plan, tuple(shape))!r}] names {sorted(unknown)}, which the {plan} plan "
                       f"does not take (it takes {sorted(given)}); fix the entry")
    return {k: entry.get(k) if v is None else v for k, v in given.items()}
