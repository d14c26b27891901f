"""The shapes and plan variants bench/llama_kernels_shard.py times (no GPU needed here).

A tensor-parallel rank's share of Llama-3.2-1B and Llama-3.1-8B (and SmolLM2-135M whole), run alone (TP=1 at the shard's
shapes: hidden unchanged; heads, KV heads, intermediate and vocabulary divided by N), and for
each decode kernel the plans the sweep tries: every variant is its plan function's keyword
arguments (so a winner is an entry of kernels/llama_tuned.py's TUNED as it stands), legal by the
kernel's limits, and covering the shape's rows.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import deviceop as dop
from deviceop.kernels import llama_attn as la
from deviceop.kernels import llama_proj as lp
from deviceop.kernels.llama_tp import MAX_RESIDENT

MODELS = {"1b": dict(d=2048, inter=8192, hq=32, hkv=8, hd=64, vocab=128256, layers=16),
          "8b": dict(d=4096, inter=14336, hq=32, hkv=8, hd=128, vocab=128256, layers=32),
          "smollm2": dict(d=576, inter=1536, hq=9, hkv=3, hd=64, vocab=49152, layers=30)}
SHAPES = ("1b", "1b/2", "1b/4", "8b", "8b/2", "8b/4", "smollm2")
CAP = 4096                     # the examples' KV capacity
POSITIONS = (56, 1023)         # attention's: the middle of a 32-token prompt + 48 new tokens; a long context
TARGET = 160 << 20             # bytes a timed graph streams at least (3x the L2)
KINDS = ("qkv", "attn", "o", "gate_up", "down", "lm_head")
LAYER = ("qkv", "attn", "o", "gate_up", "down")   # a decoder layer's launches, in order
KERNELS = {"qkv": lp.rms_qkv_rope, "attn": la.attn_decode, "o": lp.matvec_residual,
           "gate_up": lp.rms_gate_up_silu, "down": lp.matvec_residual, "lm_head": lp.rms_lm_head_argmax}


def shape(name: str) -> dict:
    """'1b', '8b/4', ...: the numbers a rank of N runs with."""
    model, _, n = name.partition("/")
    m, n = MODELS[model], int(n or 1)
    s = dict(name=name, tp=n, d=m["d"], hd=m["hd"], hq=m["hq"] // n, hkv=m["hkv"] // n, inter=m["inter"] // n,
             vocab=m["vocab"] // n, layers=m["layers"])
    s["q"], s["group"] = s["hq"] * s["hd"], m["hq"] // m["hkv"]   # group: query heads a KV head
    return s


def launch_bytes(kind: str, s: dict, pos: int = POSITIONS[0]) -> int:
    """Bytes a launch must move: weights, the vectors read and written (attention: K and V 0..pos)."""
    d, q, inter, hd, hkv = s["d"], s["q"], s["inter"], s["hd"], s["hkv"]
    return {"qkv": (q + 2 * hkv * hd) * d * 2 + 2 * d + 4 * (d + q) + 4 * hkv * hd,
            "o": d * q * 2 + 4 * (q + 2 * d), "down": d * inter * 2 + 4 * (inter + 2 * d),
            "gate_up": 2 * inter * d * 2 + 2 * d + 4 * (d + inter),
            "lm_head": s["vocab"] * d * 2 + 2 * d + 4 * (d + s["vocab"]),
            "attn": 2 * (pos + 1) * hkv * hd * 2 + 8 * q}[kind]


def launches(kind: str, s: dict) -> int:
    """Launches in a timed graph: >= 16 (the LM head >= 4), enough to stream TARGET bytes, <= 64
    (attention <= 128: its launches move little)."""
    nbytes = launch_bytes(kind, s, POSITIONS[-1])
    return max(4 if kind == "lm_head" else 16, min(128 if kind == "attn" else 64, -(-TARGET // nbytes)))


def table_key(kind: str, s: dict) -> tuple:
    """The llama_tuned.TUNED key of ``kind``'s plan at shape ``s``."""
    return {"qkv": ("qkv", (s["d"], s["hq"], s["hkv"], s["hd"])), "o": ("matvec", (s["d"], s["q"])),
            "down": ("matvec", (s["d"], s["inter"])), "gate_up": ("gate_up", (s["d"], s["inter"])),
            "lm_head": ("lm_head", (s["d"], s["vocab"])), "attn": ("attn", (s["hd"], s["group"], s["hkv"]))}[kind]


def plan(kind: str, s: dict, kw: dict | None = None):
    """``kind``'s plan at shape ``s``: the shipped one (``kw`` None: the rules and TUNED, as the
    model launches it), else the rules' with the keyword arguments ``kw``."""
    args = dict(kw or {}, tuned=kw is None)
    d = s["d"]
    if kind == "qkv":
        return lp.qkv_plan(d, s["hq"], s["hkv"], s["hd"], **args)
    if kind in ("o", "down"):
        return lp.matvec_residual_plan(d, s["q"] if kind == "o" else s["inter"], **args)
    if kind == "gate_up":
        return lp.gate_up_plan(d, s["inter"], **args)
    if kind == "lm_head":
        return lp.lm_head_plan(d, s["vocab"], **args)
    return la.attn_plan(CAP, s["hd"], s["group"], prefetch=True, kv_heads=s["hkv"], **args)


@dataclass(frozen=True)
class Variant:
    kind: str
    plan: tuple
    lm_cps: int = 1          # the LM head's CTAs a SM (its grid is not a generic)

    @property
    def gen(self) -> list:
        return list(self.plan[-1])

    @property
    def tile(self) -> int:
        return self.plan[0]

    def grid(self, s: dict) -> int:
        g, k = self.gen, self.kind
        rows = {"qkv": s["q"], "o": s["d"], "down": s["d"], "gate_up": s["inter"]}
        if k == "attn":
            return s["hkv"] * g[2]
        return (self.plan[1] if k == "lm_head" else rows[k]) // self.tile

    @property
    def warps(self) -> int:
        g = self.gen
        return g[1] * g[6] if self.kind == "attn" else g[{"qkv": 4, "gate_up": 2}.get(self.kind, 3)]

    def kwargs(self, s: dict) -> dict:
        """The plan function's keyword arguments that give exactly this plan (a TUNED entry)."""
        g, k, grid = self.gen, self.kind, self.grid(s)
        if k == "qkv":
            return dict(ctas=grid, ch=g[5], warps=g[4], nb=g[6])
        if k in ("o", "down"):
            return dict(ctas=grid, nr=g[1], ch=g[2], warps=g[3], ks=g[5], nb=g[6])
        if k == "gate_up":
            return dict(ctas=grid, ch=g[1], warps=g[2])
        if k == "lm_head":
            return dict(ctas_per_sm=self.lm_cps, nr=g[1], ch=g[2], warps=g[3])
        return dict(splits=g[2], min_chunk=g[3], warps=g[1] * g[6])

    def label(self, s: dict) -> str:
        g, k = self.gen, self.kind
        head = f"{self.grid(s)}x{self.warps}w"
        if k == "qkv":
            return f"{head} CH{g[5]} NB{g[6]}"
        if k in ("o", "down"):
            return f"{head} NR{g[1]} KS{g[5]} CH{g[2]} NB{g[6]}"
        if k == "gate_up":
            return f"{head} CH{g[1]}"
        if k == "lm_head":
            return f"{head} NR{g[1]} CH{g[2]}"
        return f"S{g[2]} MINL{g[3]} {self.warps}w"

    def tp_ok(self, s: dict) -> bool:
        """O and down: matvec_allreduce (the fused TP epilogue) could launch this plan (every CTA
        resident at once, rows in pairs a thread); the other kernels: always."""
        if self.kind not in ("o", "down"):
            return True
        rpc = self.tile
        return self.grid(s) <= MAX_RESIDENT and rpc % 2 == 0 and rpc // 2 <= 32 * self.warps


def legal(v: Variant, s: dict) -> bool:
    """The kernel's limits pass and the tiles cover the shape's rows exactly."""
    kernel = KERNELS[v.kind]
    try:
        kernel.limits(dict(zip(kernel.generic_names, v.gen)))
    except dop.ShapeError:
        return False
    g, k, grid = v.gen, v.kind, v.grid(s)
    if k == "qkv":
        return grid * v.tile == s["q"] and lp.qkv_pairs(s["hq"], s["hkv"], s["hd"]) % grid == 0
    if k == "attn":
        return g[2] * g[4] >= CAP and v.tile * g[2] == s["group"] * s["hd"]
    if k == "lm_head":
        return v.plan[1] >= s["vocab"] and v.plan[1] % v.tile == 0
    return grid * v.tile == {"o": s["d"], "down": s["d"], "gate_up": s["inter"]}[k]


def current(kind: str, s: dict) -> Variant:
    return Variant(kind, plan(kind, s), 1)


def _variants(kind: str, s: dict, options) -> list[Variant]:
    out, seen = [], set()
    for kw in options:
        try:
            v = Variant(kind, plan(kind, s, kw), kw.get("ctas_per_sm", 1))
        except dop.ShapeError:
            continue
        key = (v.tile, tuple(v.gen))
        if key not in seen and legal(v, s):
            seen.add(key)
            out.append(v)
    return out


def sweep(kind: str, s: dict) -> list[Variant]:
    """Stage 1: the grid and CTA shape (CTAs x warps; row groups and K slices for O and down;
    splits, shortest chunk and warps for attention) at the rules' buffers and chunk."""
    if kind == "qkv":
        pairs = lp.qkv_pairs(s["hq"], s["hkv"], s["hd"])
        opts = [dict(ctas=c, warps=w) for c, w in itertools.product((32, 64, 128, 256, 512), (None, 2, 4, 8, 16))]
        return [v for v in _variants(kind, s, opts) if v.warps <= pairs // v.grid(s)]
    if kind in ("o", "down"):
        k = s["q"] if kind == "o" else s["inter"]
        opts = [dict(ctas=c, warps=w, nr=nr, ks=ks) for c, w, nr, ks in
                itertools.product((64, 128, 256, 512), (4, 8, 16), (1, 2), (1, 2, 4))
                if w % ks == 0 and k % (8 * ks) == 0 and k // ks >= 256]
        return [v for v in _variants(kind, s, opts) if v.warps // v.gen[5] <= v.tile // v.gen[1]]
    if kind == "gate_up":
        opts = [dict(ctas=c, warps=w) for c, w in itertools.product((64, 128, 256, 512, 1024), (2, 4, 8, 16))]
        return [v for v in _variants(kind, s, opts) if v.warps <= v.tile]
    if kind == "lm_head":
        return _variants(kind, s, [dict(ctas_per_sm=c, nr=nr, warps=w)
                                   for c, nr, w in itertools.product((1, 2), (1, 2, 4), (8, 16))])
    return _variants(kind, s, [dict(splits=sp, min_chunk=m, warps=w)
                               for sp, m, w in itertools.product((16, 32, 64), (16, 32, 64, 128), (4, 8, 16))])


def refine(v: Variant, s: dict) -> list[Variant]:
    """Stage 2, around ``v``: the loads in flight (NB buffers, CH loads a row a chunk)."""
    base, k = v.kwargs(s), v.kind
    if k == "attn":
        return []
    opts = [dict(base, ch=ch) for ch in (1, 2, 4, 8) if ch != base["ch"]]
    if "nb" in base:
        opts += [dict(base, nb=nb) for nb in (1, 3, 4) if nb != base["nb"]]
    return _variants(k, s, opts)
