"""The chunked-prefill kernels of the Llama decoder (kernels/llama_prefill.cu).

A chunk is T prompt tokens; ``chunk`` int32 [3] = [p0, n, cond] in device memory
holds its first position, its valid tokens (a partial last chunk has n < T) and
the prefill loop's condition, so one captured chunk serves every chunk.
Activations are fp32 ``[T, width]``, row t the token at position p0 + t.

* ``pf_embed<T, B>(hidden [T, D] tile [T, B], embed bf16 [V, D], tokens int32 [ntok], chunk [3],
  error [1], vocab, ntok)``
* ``pf_qkv_rope<K, HD, HQ, HKV, T, PB, WR, WK, NB>(qkv [T, (HQ+2HKV)*HD] tile [T, 32*PB], hidden [T, K],
  norm_w bf16 [K], w_qkv bf16 [(HQ+2HKV)*HD, K], inv_freq [HD/2], chunk [3], k_cache bf16 [HKV, cap, HD],
  v_cache bf16 [HKV, cap, HD], error [1], eps, cap)``: also writes the caches (rows t < n at p0 + t), error
* ``pf_attn<HD, G, T, NW>(out [T, HQ*HD] tile [1, G*HD], qkv [T, (HQ+2HKV)*HD], k_cache, v_cache, chunk, cap)``
* ``pf_matmul_residual<K, KC, T, RT, WR, WK, NB>(out [T, N] tile [T, 16*RT], x [T, K], w bf16 [N, K],
  residual [T, N])``
* ``pf_gate_up_silu<K, T, RT, WR, WK, NB>(act [T, I] tile [T, 8*RT], hidden [T, K], norm_w bf16 [K],
  w_gate_up bf16 [2I, K], eps)``
* ``prefill_start`` / ``prefill_step(chunk [3] tile [3], prompt_len, chunk_len)``: the loop's control
* ``prefill_finish<T>(h_last [D] tile [D], hidden [T, D], chunk, state int32 [4], tokens, prompt_len, d)``:
  also writes ``state`` = [prompt_len - 1, 1, tokens[prompt_len - 1], 0]

Generics of the projections: K the input width, KC the columns of x staged in
shared memory at once (KC = K for the RMSNorm kernels), T the chunk, RT tiles of
16 weight rows a CTA, WR x WK warps (tiles split WR ways, K split WK ways), NB
32-column steps in flight a warp, PB blocks of 16 RoPE pairs a CTA.  The
``*_plan`` functions give tile and generics for a shape; the checks refuse what
the kernels cannot serve, naming the limit.

Errors the device reports (the decode kernels' sticky word): ``pf_embed`` ORs
``ERR_TOKEN`` (1) for a valid row whose token is outside [0, vocab) (the row is
not written); ``pf_qkv_rope`` ORs ``ERR_POS`` (2) when a valid row's position is
outside [0, cap) (nothing of it is appended); ``pf_attn`` writes NaN rows then.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from deviceop.kernel import In, InOut, Kernel, Out, Scalar

from . import _checks
from ._checks import _need
from .llama_attn import LOG2E
from .llama_proj import ERR_POS, ERR_TOKEN, _bf16, _rope, _silu, heads_limits, qkv_params, rope_angles

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "llama_prefill.cu"
SMEM_LIMIT = 227 * 1024   # shared memory a CTA may opt into on sm_90
STATIC_SMEM = 48 * 1024   # static shared memory a CTA may declare
MAX_ACC = 64              # fp32 accumulators a lane holds (RW * T / 2)
MAX_LOADS = 16            # 16-byte weight loads a lane holds in flight (NB * RW * 2)
CHUNKS = (8, 16, 32, 64)  # the chunk sizes the kernels compile for (multiples of the mma's 8 tokens)


def _aligned(name: str, *tensors) -> None:
    _checks._aligned(*tensors, who=f"{name} uses")


def _chunk_state():
    """The int32 [3] chunk state [p0, n, cond]."""
    return In("chunk", "int32", shape=(3,))


def _read_chunk(chunk, t: int) -> tuple[int, int]:
    return int(chunk[0]), min(max(int(chunk[1]), 0), t)


def _need_chunk(name: str, t: int) -> None:
    _need(t in CHUNKS, f"{name}: a chunk of T={t} tokens is not supported; T must be one of {CHUNKS} "
                       "(the tensor cores take tokens 8 at a time)")


def gemm_smem(kc: int, t: int, wk: int, rows: int, warps: int) -> int:
    """Dynamic shared memory of a projection: x staged as bf16 hi/lo (4*KC*T bytes), the warps'
    partial sums (4*WK*R*T) and their partial row norms (4*8*W)."""
    return 4 * kc * t + 4 * wk * rows * t + 32 * warps


def _gemm_checks(name: str, k: int, kc: int, t: int, rt: int, wr: int, wk: int, nb: int) -> None:
    _need_chunk(name, t)
    _need(all(isinstance(v, int) and v >= 1 for v in (k, kc, rt, wr, wk, nb)),
          f"{name}: K, KC, RT, WR, WK and NB must be positive ints")
    _need(rt % wr == 0, f"{name}: WR={wr} must divide the RT={rt} row tiles")
    _need(k % kc == 0 and kc % (32 * wk) == 0,
          f"{name}: KC={kc} must divide K={k} and be a multiple of 32*WK={32 * wk} (32-column steps a warp)")
    _need(1 <= wr * wk <= 32, f"{name}: WR*WK={wr * wk} warps a CTA must be in [1, 32]")
    rw = rt // wr
    _need(rw * t // 2 <= MAX_ACC, f"{name}: {rw} row tiles a warp at T={t} need {rw * t // 2} accumulators a lane, "
                                  f"more than {MAX_ACC}; raise WR")
    _need(nb * rw * 2 <= MAX_LOADS, f"{name}: NB*RW*2={nb * rw * 2} loads a lane holds must be at most {MAX_LOADS}")
    _need((wr * wk) % (t // 8) == 0, f"{name}: WR*WK={wr * wk} warps must be a multiple of T/8={t // 8} (a warp "
                                      "stages 8 rows of x)")
    smem = gemm_smem(kc, t, wk, 16 * rt, wr * wk)
    _need(smem <= SMEM_LIMIT, f"{name}: T={t} tokens of KC={kc} columns need {smem} bytes of shared memory, more "
                              f"than the {SMEM_LIMIT} a CTA may have; use a smaller chunk")


def _rms64(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of the rows of x [T, K] (fp32) times g, in float64."""
    x64 = x.astype(np.float64)
    rs = 1.0 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + float(np.float32(eps)))
    return x64 * rs * g.astype(np.float64)


# -- pf_embed -----------------------------------------------------------------------------------

def _embed_ref(g, hidden, embed, tokens, chunk, error, vocab, ntok):
    p0, n = _read_chunk(chunk, g["T"])
    for t in range(g["T"]):
        if t >= n:
            hidden[t] = 0.0
            continue
        p = p0 + t
        tok = int(tokens[p]) if 0 <= p < ntok else -1
        if 0 <= tok < vocab:
            hidden[t] = embed[tok].astype(np.float64)
        else:
            error[0] |= ERR_TOKEN


def _embed_limits(g):
    T, B, name = g["T"], g["B"], "pf_embed"
    _need_chunk(name, T)
    _need(B % 8 == 0 and 8 <= B <= 8192, f"{name}: B={B} must be a multiple of 8 in [8, 8192] (8 columns a thread)")


pf_embed = Kernel(
    "pf_embed", SOURCE,
    [Out("hidden", "float32", shape=("T", "D"), tile=("T", "B")), In("embed", "bfloat16", shape=("vocab", "D")),
     In("tokens", "int32", shape=("ntok",)), _chunk_state(), InOut("error", "int32", shape=(1,)),
     Scalar("vocab", "int32"), Scalar("ntok", "int32")],
    generics=["T", "B"], block="B//8", reference=_embed_ref, limits=_embed_limits,
    validate=lambda g, hidden, embed, *rest: _aligned("pf_embed", hidden.tensor, embed))


def embed_plan(d: int, t: int) -> tuple[list, list]:
    """(tile, generics) of pf_embed: 32 threads (256 columns) a CTA; where 256 does not divide
    D, the largest multiple of 64 below it that does (SmolLM2's 576: 192)."""
    _need(d % 64 == 0 and d > 0, f"pf_embed: D={d} must be a positive multiple of 64")
    b = next(b for b in (256, 192, 128, 64) if d % b == 0)
    return [t, b], [t, b]


def _split_k(k: int, wk: int) -> int:
    """The largest WK <= wk (halving) whose 32-column steps divide K evenly (K % (32 WK) == 0)."""
    while wk > 1 and k % (32 * wk):
        wk //= 2
    return wk


def _rows_for(wk: int, t: int, wr: int) -> int:
    """WR >= wr (doubling) so that the WR*WK warps cover the T/8 row groups that stage x."""
    while (wr * wk) % (t // 8):
        wr *= 2
    return wr


# -- pf_qkv_rope --------------------------------------------------------------------------------

def qkv_width(hq: int, hkv: int, hd: int) -> int:
    return (hq + 2 * hkv) * hd


def _qkv_ref(g, qkv, hidden, norm_w, w_qkv, inv_freq, chunk, k_cache, v_cache, error, eps, cap):
    T, hd, hq, hkv = g["T"], g["HD"], g["HQ"], g["HKV"]
    p0, n = _read_chunk(chunk, T)
    y = _rms64(hidden, norm_w, eps) @ w_qkv.astype(np.float64).T
    if n > 0 and (p0 < 0 or p0 + n > cap):
        error[0] |= ERR_POS
    for t in range(T):
        pos = p0 + t
        ang = rope_angles(pos, inv_freq).astype(np.float64)
        cos, sin = np.cos(ang), np.sin(ang)
        qh = _rope(y[t, : hq * hd].reshape(hq, hd), cos, sin)
        kh = _rope(y[t, hq * hd: (hq + hkv) * hd].reshape(hkv, hd), cos, sin)
        vh = y[t, (hq + hkv) * hd:].reshape(hkv, hd)
        qkv[t] = np.concatenate([qh.reshape(-1), kh.reshape(-1), vh.reshape(-1)])
        if t < n and 0 <= pos < cap:
            k_cache[:, pos, :] = _bf16(kh)
            v_cache[:, pos, :] = _bf16(vh)


def _qkv_limits(g):
    K, HD, HQ, HKV, T, PB, WR, WK, NB = (g[n] for n in ("K", "HD", "HQ", "HKV", "T", "PB", "WR", "WK", "NB"))
    name = "pf_qkv_rope"
    _need_chunk(name, T)
    _need(HD in (64, 128), f"{name}: HD={HD} must be 64 or 128 (RoPE pairs in tiles of 16)")
    heads_limits(name, HD, HQ, HKV)
    _gemm_checks(name, K, K, T, 2 * PB, WR, WK, NB)


pf_qkv_rope = Kernel(  # qkv: PB blocks of 16 RoPE pairs a CTA
    "pf_qkv_rope", SOURCE,
    qkv_params(Out("qkv", "float32", shape=("T", "(HQ+2*HKV)*HD"), tile=("T", "32*PB")), _chunk_state(),
               rows=("T",)),
    generics=["K", "HD", "HQ", "HKV", "T", "PB", "WR", "WK", "NB"], block="32*WR*WK",
    shared_mem=lambda g: gemm_smem(g["K"], g["T"], g["WK"], 32 * g["PB"], g["WR"] * g["WK"]),
    reference=_qkv_ref, limits=_qkv_limits,
    validate=lambda g, qkv, hidden, norm_w, w_qkv, *rest: _aligned("pf_qkv_rope", qkv.tensor, hidden, norm_w, w_qkv))


def qkv_plan(d: int, hq: int, hkv: int, hd: int, t: int, *, pb: int = 1, nb: int = 4) -> tuple[list, list]:
    """(qkv tile, generics) of pf_qkv_rope: PB blocks of 16 pairs a CTA (96 CTAs at the 1B
    shape), 8 warps (the two row tiles split 2 ways, K 4 ways).  A K that 128 does not
    divide (SmolLM2's 576) is split 2 ways (or 1), with more row warps (and blocks) where
    the warps must cover the chunk's T/8 row groups."""
    _need(d % 32 == 0 and d > 0, f"pf_qkv_rope: K={d} must be a positive multiple of 32 (32-column steps)")
    _need_chunk("pf_qkv_rope", t)
    wk = _split_k(d, 4)
    wr = _rows_for(wk, t, 2)
    pb = max(pb, wr // 2)
    _need(qkv_width(hq, hkv, hd) % (32 * pb) == 0, f"pf_qkv_rope: PB={pb} blocks of 16 pairs must divide the "
                                                   f"{qkv_width(hq, hkv, hd) // 2} RoPE pairs")
    return [t, 32 * pb], [d, hd, hq, hkv, t, pb, wr, wk, nb]


# -- pf_attn ------------------------------------------------------------------------------------

def _attn_ref(g, out, qkv, k, v, chunk, cap):
    HD, G, T = g["HD"], g["G"], g["T"]
    hkv = k.shape[0]
    p0, n = _read_chunk(chunk, T)
    for t in range(T):
        pos = p0 + t
        if t >= n:
            out[t] = 0.0
        elif not 0 <= pos < cap:
            out[t] = np.nan
        else:
            q64 = qkv[t, : hkv * G * HD].astype(np.float64).reshape(hkv, G, HD) * (LOG2E / math.sqrt(HD))
            k64, v64 = k[:, : pos + 1].astype(np.float64), v[:, : pos + 1].astype(np.float64)
            s = np.einsum("hgd,hsd->hgs", q64, k64)
            w = np.exp2(s - s.max(axis=-1, keepdims=True))
            out[t] = (np.einsum("hgs,hsd->hgd", w, v64) / w.sum(axis=-1, keepdims=True)).reshape(-1)


def _attn_limits(g):
    HD, G, T, NW = g["HD"], g["G"], g["T"], g["NW"]
    name = f"pf_attn<HD={HD}, G={G}, T={T}, NW={NW}>"
    _need_chunk(name, T)
    _need(HD in (64, 128), f"{name}: head dim {HD} is not supported; HD must be 64 or 128")
    _need(1 <= G <= 8, f"{name}: G={G} query heads per KV head is not supported; G must be in [1, 8]")
    _need(1 <= NW <= 32, f"{name}: NW={NW} warps must be in [1, 32]")
    _need(attn_static_smem(HD, G, NW) <= STATIC_SMEM, f"{name}: NW={NW} warps' partial results need "
                                                      f"{attn_static_smem(HD, G, NW)} bytes of shared memory, more "
                                                      f"than {STATIC_SMEM}; use fewer warps (attn_plan picks them)")


pf_attn = Kernel(  # a CTA a token and KV head; qkv: pf_qkv_rope's; k, v: the layer's cache slices
    "pf_attn", SOURCE,
    [Out("out", "float32", shape=("T", "HKV*G*HD"), tile=(1, "G*HD")),
     In("qkv", "float32", shape=("T", "(HKV*G+2*HKV)*HD")), In("k", "bfloat16", shape=("HKV", "cap", "HD")),
     In("v", "bfloat16", shape=("HKV", "cap", "HD")), _chunk_state(), Scalar("cap", "int32")],
    generics=["HD", "G", "T", "NW"], block="32*NW", reference=_attn_ref, limits=_attn_limits,
    validate=lambda g, out, qkv, k, v, *rest: _aligned("pf_attn", out.tensor, qkv, k, v))


def attn_static_smem(head_dim: int, group: int, warps: int) -> int:
    return 4 * warps * group * (head_dim + 2)


def attn_plan(head_dim: int, group: int, t: int, *, warps: int | None = None) -> tuple[list, list]:
    """(out tile, generics) of pf_attn: a CTA a token and KV head, of 16 warps (fewer when their
    partial results would not fit 48 KB of static shared memory): the entries a query reads
    are split over the warps, so more warps keep more of them in flight."""
    if warps is None:
        warps = next(w for w in (16, 8, 4, 2, 1) if attn_static_smem(head_dim, group, w) <= STATIC_SMEM)
    return [1, group * head_dim], [head_dim, group, t, warps]


# -- pf_matmul_residual ---------------------------------------------------------------------------

def _matmul_ref(g, out, x, w, residual):
    out[...] = residual.astype(np.float64) + x.astype(np.float64) @ w.astype(np.float64).T


pf_matmul_residual = Kernel(
    "pf_matmul_residual", SOURCE,
    [Out("out", "float32", shape=("T", "N"), tile=("T", "16*RT")), In("x", "float32", shape=("T", "K")),
     In("w", "bfloat16", shape=("N", "K")), In("residual", "float32", shape=("T", "N"))],
    generics=["K", "KC", "T", "RT", "WR", "WK", "NB"], block="32*WR*WK",
    shared_mem=lambda g: gemm_smem(g["KC"], g["T"], g["WK"], 16 * g["RT"], g["WR"] * g["WK"]),
    reference=_matmul_ref, limits=lambda g: _gemm_checks("pf_matmul_residual", *(g[n] for n in (
        "K", "KC", "T", "RT", "WR", "WK", "NB"))),
    validate=lambda g, out, x, w, residual: _aligned("pf_matmul_residual", out.tensor, x, w))


def matmul_residual_plan(n: int, k: int, t: int, *, kc: int | None = None, nb: int = 4) -> tuple[list, list]:
    """(tile, generics) of pf_matmul_residual: 16 rows a CTA (128 CTAs at the 1B shapes), 8 warps
    splitting K, x staged 2048 columns at a time (or ``kc``)."""
    _need(n % 16 == 0, f"pf_matmul_residual: N={n} rows must be a multiple of 16 (a tile)")
    _need(k % 32 == 0 and k > 0, f"pf_matmul_residual: K={k} must be a positive multiple of 32 (32-column steps)")
    _need_chunk("pf_matmul_residual", t)
    kc = kc or next((c for c in (2048, 1024, 512, 256) if k % c == 0), k)
    wk = _split_k(kc, 8)            # a K of 576: 2 ways, and row tiles where the warps must cover T/8
    rt = _rows_for(wk, t, 1)
    _need(n % (16 * rt) == 0, f"pf_matmul_residual: N={n} rows must be a multiple of {16 * rt} ({rt} tiles a CTA "
                              f"at T={t})")
    return [t, 16 * rt], [k, kc, t, rt, rt, wk, nb]


# -- pf_gate_up_silu ------------------------------------------------------------------------------

def _gate_up_ref(g, act, hidden, norm_w, w_gate_up, eps):
    inter = act.shape[1]
    y = _rms64(hidden, norm_w, eps) @ w_gate_up.astype(np.float64).T
    act[...] = _silu(y[:, :inter]) * y[:, inter:]


def _gate_up_limits(g):
    K, T, RT, WR, WK, NB = (g[n] for n in ("K", "T", "RT", "WR", "WK", "NB"))
    name = "pf_gate_up_silu"
    _need_chunk(name, T)
    _need(RT % 2 == 0, f"{name}: RT={RT} must be even (gate tiles, then as many up tiles)")
    _gemm_checks(name, K, K, T, RT, WR, WK, NB)


pf_gate_up_silu = Kernel(  # w_gate_up: the cat of gate_proj and up_proj
    "pf_gate_up_silu", SOURCE,
    [Out("act", "float32", shape=("T", "I"), tile=("T", "8*RT")), In("hidden", "float32", shape=("T", "K")),
     In("norm_w", "bfloat16", shape=("K",)), In("w_gate_up", "bfloat16", shape=("2*I", "K")),
     Scalar("eps", "float32")],
    generics=["K", "T", "RT", "WR", "WK", "NB"], block="32*WR*WK",
    shared_mem=lambda g: gemm_smem(g["K"], g["T"], g["WK"], 16 * g["RT"], g["WR"] * g["WK"]),
    reference=_gate_up_ref, limits=_gate_up_limits,
    validate=lambda g, act, hidden, norm_w, w, eps: _aligned("pf_gate_up_silu", act.tensor, hidden, norm_w, w))


def gate_up_plan(d: int, inter: int, t: int, *, nb: int = 2) -> tuple[list, list]:
    """(tile, generics) of pf_gate_up_silu: 64 gate/up pairs a CTA (128 CTAs at the 1B shape;
    16 when I is not a multiple of 64), 8 warps (tiles split 2 ways, K 4 ways); at T > 16 the
    tiles are split 4 ways (accumulators)."""
    _need(inter % 16 == 0, f"pf_gate_up_silu: I={inter} must be a multiple of 16 (a tile)")
    _need(d % 32 == 0 and d > 0, f"pf_gate_up_silu: K={d} must be a positive multiple of 32 (32-column steps)")
    _need_chunk("pf_gate_up_silu", t)
    rt = 8 if inter % 64 == 0 else 2
    wr = min(rt, 2 if t <= 16 else 4 if t <= 32 else 8)
    wk = _split_k(d, 4 if wr <= 2 else 2)   # a K of 576: 2 ways, with more row warps where T/8 needs them
    wr = _rows_for(wk, t, wr)
    _need(wr <= rt, f"pf_gate_up_silu: K={d} splits {wk} ways, too few warps for T={t} (use a smaller chunk)")
    return [t, 8 * rt], [d, t, rt, wr, wk, nb]


# -- control ------------------------------------------------------------------------------------

def _start_ref(g, chunk, prompt_len, chunk_len):
    chunk[:] = [0, min(chunk_len, prompt_len), 1]


def _step_ref(g, chunk, prompt_len, chunk_len):
    nxt = int(chunk[0]) + chunk_len
    if nxt < prompt_len:
        chunk[0], chunk[1] = nxt, min(chunk_len, prompt_len - nxt)
    else:
        chunk[2] = 0


def _control_check(name):
    def check(g, chunk, prompt_len, chunk_len):
        _need(prompt_len >= 1 and chunk_len >= 1, f"{name}: prompt_len={prompt_len} and chunk_len={chunk_len} must "
                                                  "be at least 1")
    return check


def _control(name, reference):  # one thread: the int32 [3] chunk state partitioned whole
    return Kernel(name, SOURCE, [Out("chunk", "int32", shape=(3,), tile=(3,)), Scalar("prompt_len", "int32"),
                                 Scalar("chunk_len", "int32")],
                  block=1, reference=reference, validate=_control_check(name))


prefill_start = _control("prefill_start", _start_ref)
prefill_step = _control("prefill_step", _step_ref)


def _finish_ref(g, h_last, hidden, chunk, state, tokens, prompt_len, d):
    n = int(chunk[1])
    h_last[...] = hidden[n - 1] if 1 <= n <= g["T"] else np.nan
    state[:] = [prompt_len - 1, 1, tokens[prompt_len - 1], 0]


def _finish_check(g, h_last, hidden, chunk, state, tokens, prompt_len, d):
    _need(1 <= prompt_len <= tokens.shape[0], f"prefill_finish: prompt_len={prompt_len} must be in "
                                              f"[1, {tokens.shape[0]}] (the token buffer)")


prefill_finish = Kernel(  # one CTA: h_last partitioned whole; state: the int32 [4] decode state
    "prefill_finish", SOURCE,
    [Out("h_last", "float32", shape=("d",), tile=("d",)), In("hidden", "float32", shape=("T", "d")),
     _chunk_state(), InOut("state", "int32", shape=(4,)), In("tokens", "int32", rank=1), Scalar("prompt_len", "int32"),
     Scalar("d", "int32")],
    generics=["T"], block=256, reference=_finish_ref, validate=_finish_check)


__all__ = ["pf_embed", "pf_qkv_rope", "pf_attn", "pf_matmul_residual", "pf_gate_up_silu", "prefill_start",
           "prefill_step", "prefill_finish", "embed_plan", "qkv_plan", "attn_plan", "matmul_residual_plan",
           "gate_up_plan", "check_chunk", "qkv_width", "gemm_smem", "CHUNKS", "ERR_TOKEN", "ERR_POS"]


def check_chunk(d: int, inter: int, hq: int, hkv: int, hd: int, t: int) -> None:
    """Refuse a chunk of ``t`` tokens that the plans of a model's shape cannot serve (a deviceop
    ShapeError naming the limit), before any buffer is made."""
    _need(isinstance(t, int) and not isinstance(t, bool), f"a prefill chunk must be an int, got {t!r}")
    _need_chunk("chunked prefill", t)
    embed_plan(d, t)
    q = qkv_plan(d, hq, hkv, hd, t)[1]
    _gemm_checks("pf_qkv_rope", d, d, t, 2 * q[5], q[6], q[7], q[8])
    for name, (k, kc, tt, rt, wr, wk, nb) in (("pf_matmul_residual (O)", matmul_residual_plan(d, hq * hd, t)[1]),
                                              ("pf_matmul_residual (down)", matmul_residual_plan(d, inter, t)[1])):
        _gemm_checks(name, k, kc, tt, rt, wr, wk, nb)
    k, tt, rt, wr, wk, nb = gate_up_plan(d, inter, t)[1]
    _gemm_checks("pf_gate_up_silu", k, k, tt, rt, wr, wk, nb)
