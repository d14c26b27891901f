"""Plans chosen by shape (kernels/llama_tuned.py): a TUNED entry fills what a plan function's
caller leaves unset, a caller's own argument wins, the fused TP projection takes an entry only
where every CTA can be resident, the decoder picks attention's entry by its shard's KV heads,
and every plan a Llama-3.2-1B or 3.1-8B rank launches (TP 1, 2, 4; TUNED's entries included)
is legal and covers its rows."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import deviceop as dop  # noqa: E402
from deviceop.kernels import llama_attn as la  # noqa: E402
from deviceop.kernels import llama_proj as lp  # noqa: E402
from deviceop.kernels import llama_tp as ltp  # noqa: E402
from deviceop.kernels.llama_tuned import TUNED  # noqa: E402
from llama.config import LLAMA_3_1_8B, LLAMA_3_2_1B, SMOLLM2_135M  # noqa: E402
from llama.plans import decode_kernels, launch_plans  # noqa: E402
from llama.tp import Shard  # noqa: E402

CAP = 4096


def limits(kernel, gen) -> None:
    kernel.limits(dict(zip(kernel.generic_names, gen)))


@pytest.mark.parametrize("plan,shape,entry,call", [
    ("matvec", (2048, 512), dict(ctas=256, warps=8, nr=1, ks=1, nb=3), lambda **kw: lp.matvec_residual_plan(2048, 512, **kw)),
    ("qkv", (2048, 8, 2, 64), dict(ctas=64, warps=4, ch=2, nb=3), lambda **kw: lp.qkv_plan(2048, 8, 2, 64, **kw)),
    ("gate_up", (2048, 2048), dict(ctas=512, warps=4, ch=2), lambda **kw: lp.gate_up_plan(2048, 2048, **kw)),
    ("lm_head", (2048, 32064), dict(ctas_per_sm=2, nr=1, warps=8), lambda **kw: lp.lm_head_plan(2048, 32064, **kw)),
    ("attn", (64, 4, 2), dict(splits=32, min_chunk=16, warps=8),
     lambda **kw: la.attn_plan(CAP, 64, 4, prefetch=True, kv_heads=2, **kw)),
])
def test_a_tuned_entry_fills_what_the_caller_leaves_unset_and_the_callers_choice_wins(monkeypatch, plan, shape,
                                                                                         entry, call):
    rules = call()
    monkeypatch.setitem(TUNED, (plan, shape), entry)
    assert call() == call(tuned=False, **entry) != rules
    assert call(tuned=False) == rules
    first, value = next(iter(entry.items()))
    mine = {"ctas": 128, "ctas_per_sm": 1, "splits": 16}[first]
    assert call(**{first: mine}) == call(tuned=False, **dict(entry, **{first: mine}))


def test_attention_takes_an_entry_only_where_the_caller_names_its_kv_heads(monkeypatch):
    monkeypatch.setitem(TUNED, ("attn", (64, 4, 2)), dict(splits=32, min_chunk=16, warps=8))
    assert la.attn_plan(CAP, 64, 4) == la.attn_plan(CAP, 64, 4, tuned=False)
    assert la.attn_plan(CAP, 64, 4, kv_heads=8) == la.attn_plan(CAP, 64, 4, tuned=False)
    assert la.attn_plan(CAP, 64, 4, kv_heads=2)[1][2:4] == [32, 16]


def test_an_entry_naming_an_argument_the_plan_does_not_take_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setitem(TUNED, ("gate_up", (2048, 2048)), dict(nb=3))
    with pytest.raises(dop.ShapeError, match=r"names \['nb'\], which the gate_up plan does not take.*fix the entry"):
        lp.gate_up_plan(2048, 2048)


def test_the_fused_tp_projection_takes_an_entry_only_where_every_cta_is_resident(monkeypatch):
    rules = ltp.matvec_allreduce_plan(2048, 512, 4)
    monkeypatch.setitem(TUNED, ("matvec", (2048, 512)), dict(ctas=256, warps=8, nr=1, ks=1))
    assert lp.matvec_residual_plan(2048, 512)[0] == 8                  # 256 CTAs for matvec_residual
    assert ltp.matvec_allreduce_plan(2048, 512, 4) == rules             # more than MAX_RESIDENT: the rules'
    monkeypatch.setitem(TUNED, ("matvec", (2048, 512)), dict(ctas=64, warps=8, nr=1, ks=1))
    tile, gen = ltp.matvec_allreduce_plan(2048, 512, 4)
    assert (2048 // tile, gen[3]) == (64, 8) and gen[-1] == 4
    limits(ltp.matvec_allreduce, gen)


def test_the_decoder_launches_the_attention_entry_of_its_shards_kv_heads(monkeypatch):
    monkeypatch.setitem(TUNED, ("attn", (64, 4, 2)), dict(splits=32, min_chunk=16, warps=8))
    tp4 = launch_plans(LLAMA_3_2_1B, CAP, Shard(LLAMA_3_2_1B, 0, 4))["attn"][1]
    assert tp4[2:4] == [32, 16] and tp4[1] * tp4[6] == 8
    assert launch_plans(LLAMA_3_2_1B, CAP, Shard(LLAMA_3_2_1B))["attn"] == la.attn_plan(CAP, 64, 4, prefetch=True)
    assert (la.attn_decode.name, tuple(tp4)) in {(k.name, tuple(g)) for k, g in
                                                 decode_kernels(LLAMA_3_2_1B, CAP, Shard(LLAMA_3_2_1B, 0, 4))}


def check_plan(cfg, shard: Shard, name: str, plan) -> None:
    """``plan`` (launch_plans' entry ``name``) passes its kernel's limits and covers the rows."""
    d, hd, g = cfg.hidden_size, cfg.head_dim, cfg.group
    if name == "head":
        tile, rows, gen = plan
        limits(lp.rms_lm_head_argmax, gen)
        assert rows % tile == 0 and shard.vocab <= rows < shard.vocab + tile
        return
    tile, gen = plan
    if name == "qkv":
        limits(lp.rms_qkv_rope, gen)
        grid = shard.q_size // tile
        assert grid * tile == shard.q_size and lp.qkv_pairs(shard.heads, shard.kv_heads, hd) % grid == 0
    elif name == "attn":
        limits(la.attn_decode, gen)
        assert gen[2] * gen[4] >= CAP and tile * gen[2] == g * hd
        assert la.attn_smem(CAP, hd, g, prefetch=True, kv_heads=shard.kv_heads) <= la.SMEM_LIMIT
    elif name == "gate_up":
        limits(lp.rms_gate_up_silu, gen)
        assert shard.inter % tile == 0 and gen[0] == d
    elif name in ("o", "down", "o_ar", "down_ar"):
        limits(ltp.matvec_allreduce if name.endswith("_ar") else lp.matvec_residual, gen)
        assert d % tile == 0 and gen[0] == (shard.q_size if name.startswith("o") else shard.inter)
        if name.endswith("_ar"):
            assert d // tile <= ltp.MAX_RESIDENT
    else:
        assert name == "embed"


@pytest.mark.parametrize("cfg, tp", [(cfg, tp) for cfg in (LLAMA_3_2_1B, LLAMA_3_1_8B) for tp in (1, 2, 4)]
                         + [(SMOLLM2_135M, 1)], ids=["1b-1", "1b-2", "1b-4", "8b-1", "8b-2", "8b-4", "smollm2-1"])
def test_every_plan_a_llama_rank_launches_is_legal_and_covers_its_rows(cfg, tp):
    shard = Shard(cfg, 0, tp)
    plans = launch_plans(cfg, CAP, shard)
    assert set(plans) >= {"qkv", "attn", "o", "gate_up", "down", "head"}
    for name, plan in plans.items():
        check_plan(cfg, shard, name, plan)

