"""The projection kernels of the Llama decode step (kernels/llama_proj.cu).

Batch 1, bf16 weights in Hugging Face layout ``[out_features, in_features]``,
fp32 activations and accumulation; every kernel is PDL-ready (``.pdl()``).

* ``embed_gather<B>(hidden [D] tile [B], embed bf16 [V, D], token int32 [1], error int32 [1], vocab)``
* ``rms_qkv_rope<K, HD, HQ, HKV, W, CH, NB>(q [HQ*HD] tile [T], hidden [K], norm_w bf16 [K],
  w_qkv bf16 [(HQ+2*HKV)*HD, K], inv_freq [HD/2], pos int32 [1], k_cache bf16 [HKV, cap, HD],
  v_cache bf16 [HKV, cap, HD], error int32 [1], eps, cap)``: also writes k_cache, v_cache (row pos), error
* ``matvec_residual<K, NR, CH, W, RPC, KS, NB>(out [N] tile [RPC], x [K], w bf16 [N, K], residual [N])``
* ``rms_gate_up_silu<K, CH, W, PPC>(act [I] tile [PPC], hidden [K], norm_w bf16 [K], w_gate_up bf16 [2I, K], eps)``
* ``rms_lm_head_argmax<K, NR, CH, W, RPC>(logits [Vp] tile [RPC], hidden [K], norm_w bf16 [K], w bf16 [V, K],
  token int32 [1], work uint64 [2], eps, vocab)``: also writes token; ``work`` zeroed once by the caller

Generics: K the input width, CH the 16-byte loads per lane per row per chunk
(K a multiple of 256*CH), W warps a CTA, NR rows a warp streams together, RPC /
PPC rows / pairs a CTA (= the output tile), NB the chunks a warp keeps in flight
(register buffers; the first NB are loaded before griddepcontrol.wait), KS the
slices of K that the warps of a row group split (partial sums added in shared
memory).  The ``*_plan`` functions give the tile and generics for a shape.

Errors the device reports: ``error`` is a sticky int32 word (zero it once);
``embed_gather`` ORs ``ERR_TOKEN`` (1) into it when the token is outside
[0, vocab) and leaves ``hidden`` unwritten; ``rms_qkv_rope`` ORs ``ERR_POS`` (2)
when pos is outside [0, cap) and appends nothing to the cache (q is written).
"""
from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np

import deviceop as dop
from deviceop.kernel import In, Kernel, Out, Scalar

from . import _checks
from ._checks import _need

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "llama_proj.cu"
ERR_TOKEN, ERR_POS = 1, 2     # llama::ERR_* in llama_common.cuh
SHARED_LIMIT = 48 * 1024      # static shared memory a CTA may declare
MAX_LOADS = 32                # NB * NR * CH: 16-byte loads a lane holds in flight (4 registers each)
H100_SMS = 132



def _aligned(name: str, *tensors) -> None:
    _checks._aligned(*tensors, who=f"{name} uses")



def _one(name: str, **tensors) -> None:
    for label, t in tensors.items():
        _need(t.shape == (1,), f"{name}: {label} must be a [1] device scalar, got shape {t.shape}")


def _stream_checks(name: str, k: int, ch: int, nr: int, w: int, extra_shared: int, nb: int = 2, ks: int = 1) -> None:
    _need(ch >= 1 and ks >= 1 and k % (256 * ch * ks) == 0,
          f"{name}: K={k} must be a multiple of 256*CH*KS={256 * ch * ks} "
          f"(CH 16-byte loads of 8 bf16 per lane per chunk, K cut in KS slices)")
    _need(1 <= nb <= 8, f"{name}: NB={nb} buffers must be in [1, 8]")
    _need(1 <= nb * nr * ch <= MAX_LOADS, f"{name}: NB*NR*CH={nb * nr * ch} loads a lane holds must be in "
                                          f"[1, {MAX_LOADS}] (4 registers each)")
    _need(w % ks == 0, f"{name}: KS={ks} slices must divide the W={w} warps")
    _need(1 <= w <= 32, f"{name}: W={w} warps a CTA must be in [1, 32]")
    _need(4 * k + extra_shared <= SHARED_LIMIT,
          f"{name}: K={k} does not fit the CTA's {SHARED_LIMIT // 1024} KB shared-memory copy of x "
          f"(4*K = {4 * k} bytes); the largest K served is {(SHARED_LIMIT - extra_shared) // 4 // 256 * 256}")


def _rms(x: np.ndarray, eps: float) -> float:
    x64 = x.astype(np.float64)
    return 1.0 / math.sqrt(float(np.mean(x64 * x64)) + float(np.float32(eps)))


def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16)


# -- embed_gather ------------------------------------------------------------------

def _embed_gather_ref(g, hidden, embed, token, error, vocab):
    t = int(token[0])
    if 0 <= t < vocab:
        hidden[...] = embed[t].astype(np.float64)
    else:
        error[0] |= ERR_TOKEN


def _embed_gather_check(g, hidden, embed, token, error, vocab):
    B, name = g["B"], "embed_gather"
    t = hidden.tensor
    d = t.shape[0]
    _need(embed.ndim == 2 and embed.shape[1] == d, f"{name}: embed {embed.shape} must be [vocab, {d}] for hidden "
                                                   f"{t.shape}")
    _need(vocab == embed.shape[0], f"{name}: vocab={vocab} but embed has {embed.shape[0]} rows; pass embed.shape[0]")
    _need(B % 8 == 0 and 8 <= B <= 8192, f"{name}: B={B} must be a multiple of 8 in [8, 8192] (8 elements a thread)")
    _need(hidden.tile_shape == (B,), f"{name}<B={B}>: partition hidden with [{B}], not {list(hidden.tile_shape)}")
    _one(name, token=token, error=error)
    _aligned(name, t, embed)


embed_gather = Kernel(
    "embed_gather", SOURCE,
    [Out("hidden", "float32", rank=1), In("embed", "bfloat16", rank=2), In("token", "int32", rank=1),
     In("error", "int32", rank=1), Scalar("vocab", "int32")],
    generics=["B"], block=lambda g: g["B"] // 8, reference=_embed_gather_ref, validate=_embed_gather_check)


def embed_plan(d: int) -> tuple[int, list]:
    """(tile, generics) of embed_gather for hidden size ``d``: one CTA up to 8192 elements."""
    _need(d % 8 == 0 and d > 0, f"embed_gather: D={d} must be a positive multiple of 8")
    b = next(b for b in (2048, 1024, 512, 256, 128, 64, 32, 16, 8) if d % b == 0) if d > 8192 else d
    return b, [b]


# -- rms_qkv_rope --------------------------------------------------------------------

def rope_angles(pos: int, inv_freq: np.ndarray) -> np.ndarray:
    """The RoPE angles as Hugging Face computes them: float32(pos) * inv_freq in float32."""
    return np.float32(pos) * inv_freq.astype(np.float32)


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """rotate_half RoPE of heads x [H, hd] (float64), pairs (i, i + hd/2)."""
    half = x.shape[1] // 2
    x0, x1 = x[:, :half], x[:, half:]
    return np.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=1)


def _rms_qkv_rope_ref(g, q, hidden, norm_w, w_qkv, inv_freq, pos, k_cache, v_cache, error, eps, cap):
    hd, hq, hkv = g["HD"], g["HQ"], g["HKV"]
    xn = hidden.astype(np.float64) * norm_w.astype(np.float64) * _rms(hidden, eps)
    y = w_qkv.astype(np.float64) @ xn
    p = int(pos[0])
    ang = rope_angles(p, inv_freq).astype(np.float64)
    cos, sin = np.cos(ang), np.sin(ang)
    qh = _rope(y[: hq * hd].reshape(hq, hd), cos, sin)
    kh = _rope(y[hq * hd: (hq + hkv) * hd].reshape(hkv, hd), cos, sin)
    vh = y[(hq + hkv) * hd:].reshape(hkv, hd)
    q[...] = qh.reshape(-1)
    if 0 <= p < cap:
        k_cache[:, p, :] = _bf16(kh)
        v_cache[:, p, :] = _bf16(vh)
    else:
        error[0] |= ERR_POS


def qkv_pairs(hq: int, hkv: int, hd: int) -> int:
    return (hq + 2 * hkv) * hd // 2


def qkv_cache_checks(name: str, w_qkv, inv_freq, k_cache, v_cache, cap: int, K: int, HD: int, HQ: int,
                     HKV: int) -> None:
    """The operands a QKV + RoPE + cache-append kernel shares with the others of its kind
    (rms_qkv_rope here, pf_qkv_rope in llama_prefill.py): the concatenated weight, the
    RoPE table, this layer's K and V cache slices (separate memory) and their capacity."""
    rows = (HQ + 2 * HKV) * HD
    _need(w_qkv.shape == (rows, K), f"{name}: w_qkv {w_qkv.shape} must be [(HQ + 2*HKV)*HD, K] = [{rows}, {K}] "
                                    "(cat of q_proj, k_proj, v_proj)")
    _need(inv_freq.shape == (HD // 2,), f"{name}: inv_freq {inv_freq.shape} must be [HD/2] = [{HD // 2}]")
    _need(k_cache.ndim == 3 and k_cache.shape[0] == HKV and k_cache.shape[2] == HD and k_cache.shape == v_cache.shape,
          f"{name}: k_cache {k_cache.shape} and v_cache {v_cache.shape} must both be this layer's [HKV={HKV}, cap, "
          f"HD={HD}] slices")
    _need(cap == k_cache.shape[1], f"{name}: cap={cap} but the cache holds {k_cache.shape[1]} rows; pass "
                                   "k_cache.shape[1]")
    if k_cache.overlaps(v_cache):
        raise dop.AliasingError(f"{name}: k_cache and v_cache overlap; give each its own memory")


def _rms_qkv_rope_check(g, q, hidden, norm_w, w_qkv, inv_freq, pos, k_cache, v_cache, error, eps, cap):
    K, HD, HQ, HKV, W, CH, NB = (g[n] for n in ("K", "HD", "HQ", "HKV", "W", "CH", "NB"))
    name = "rms_qkv_rope"
    t = q.tensor
    _need(HD % 2 == 0 and HD >= 2 and HQ >= 1 and HKV >= 1, f"{name}: HD={HD} must be even, HQ={HQ} and HKV={HKV} "
                                                            "positive")
    _need(t.shape == (HQ * HD,), f"{name}<HQ={HQ}, HD={HD}>: q {t.shape} must be [{HQ * HD}]")
    _need(hidden.shape == (K,) and norm_w.shape == (K,), f"{name}<K={K}>: hidden {hidden.shape} and norm_w "
                                                          f"{norm_w.shape} must be [{K}]")
    qkv_cache_checks(name, w_qkv, inv_freq, k_cache, v_cache, cap, K, HD, HQ, HKV)
    _one(name, pos=pos, error=error)
    _stream_checks(name, K, CH, 2, W, 4 * W, NB)
    pairs, grid = qkv_pairs(HQ, HKV, HD), q.num_tiles
    _need(pairs % grid == 0, f"{name}: q's partition makes {grid} CTAs, which must divide the {pairs} RoPE pairs; "
                             f"use qkv_plan(...) for the tile")
    _aligned(name, hidden, norm_w, w_qkv)


rms_qkv_rope = Kernel(
    "rms_qkv_rope", SOURCE,
    [Out("q", "float32", rank=1), In("hidden", "float32", rank=1), In("norm_w", "bfloat16", rank=1),
     In("w_qkv", "bfloat16", rank=2), In("inv_freq", "float32", rank=1), In("pos", "int32", rank=1),
     In("k_cache", "bfloat16", rank=3), In("v_cache", "bfloat16", rank=3), In("error", "int32", rank=1),
     Scalar("eps", "float32"), Scalar("cap", "int32")],
    generics=["K", "HD", "HQ", "HKV", "W", "CH", "NB"], block=lambda g: 32 * g["W"], reference=_rms_qkv_rope_ref,
    validate=_rms_qkv_rope_check)


def qkv_plan(d: int, hq: int, hkv: int, hd: int, *, sms: int = H100_SMS, ctas: int | None = None,
             ch: int | None = None, warps: int | None = None, nb: int = 2) -> tuple[int, list]:
    """(q tile, generics) of rms_qkv_rope: the CTA count (a divisor of both the q
    size and the pair count) nearest 2 per SM (or ``ctas``), a warp per pair (or
    ``warps`` warps taking every warps-th pair), ``nb`` chunks in flight a warp.
    H100, 1B shape, 16 launches with PDL (two runs): 256 CTAs of 6 warps 5.48 /
    5.47 us (this), 128 of 12 5.49 / 5.51, 256 of 3 6.33, 128 of 8 with NB=3 6.25."""
    pairs, nq = qkv_pairs(hq, hkv, hd), hq * hd
    common = math.gcd(pairs, nq)
    options = [c for c in range(1, common + 1) if common % c == 0 and pairs // c <= 32]
    _need(bool(options), f"rms_qkv_rope: no CTA count divides both {nq} (q) and {pairs} (pairs) with <= 32 pairs a CTA")
    target = ctas if ctas is not None else 2 * sms
    grid = min(options, key=lambda c: (abs(c - target), -c))
    ch = ch if ch is not None else _chunk(d, 2)
    return nq // grid, [d, hd, hq, hkv, warps or pairs // grid, ch, nb]


def _chunk(k: int, nr: int) -> int:
    """The largest CH <= 4 dividing K/256 with NR*CH <= 8 (CH = 8 holds 16 floats of x
    a lane besides the weights: 128+ registers, spills at two CTAs a SM)."""
    _need(k % 256 == 0 and k > 0, f"the Llama projections stream rows in 16-byte loads of 32 lanes: K={k} must be a "
                                  "positive multiple of 256 (SmolLM2's 576 is not served)")
    return next(c for c in (4, 2, 1) if nr * c <= 8 and k % (256 * c) == 0)


# -- matvec_residual -------------------------------------------------------------------

def _matvec_residual_ref(g, out, x, w, residual):
    out[...] = residual.astype(np.float64) + w.astype(np.float64) @ x.astype(np.float64)


def _matvec_residual_check(g, out, x, w, residual):
    K, NR, CH, W, RPC, KS, NB = (g[n] for n in ("K", "NR", "CH", "W", "RPC", "KS", "NB"))
    name = "matvec_residual"
    t = out.tensor
    n = t.shape[0]
    _need(out.tile_shape == (RPC,), f"{name}<RPC={RPC}>: partition out with [{RPC}], not {list(out.tile_shape)}")
    _need(x.shape == (K,) and w.shape == (n, K), f"{name}<K={K}>: x {x.shape} must be [{K}] and w {w.shape} "
                                                 f"[{n}, {K}]")
    _need(residual.shape == (n,), f"{name}: residual {residual.shape} must match out {t.shape}")
    _need(1 <= NR <= 32 and RPC % NR == 0, f"{name}: RPC={RPC} must be a multiple of NR={NR} (NR in [1, 32])")
    _stream_checks(name, K, CH, NR, W, 4 * RPC * (1 + (KS if KS > 1 else 0)), NB, KS)
    _aligned(name, x, w)


matvec_residual = Kernel(
    "matvec_residual", SOURCE,
    [Out("out", "float32", rank=1), In("x", "float32", rank=1), In("w", "bfloat16", rank=2),
     In("residual", "float32", rank=1)],
    generics=["K", "NR", "CH", "W", "RPC", "KS", "NB"], block=lambda g: 32 * g["W"], reference=_matvec_residual_ref,
    validate=_matvec_residual_check)


def matvec_residual_plan(n: int, k: int, *, sms: int = H100_SMS, ctas: int | None = None, nr: int | None = None,
                         ch: int | None = None, warps: int | None = None, ks: int | None = None,
                         nb: int = 2) -> tuple[int, list]:
    """(tile, generics) of matvec_residual: the CTA count dividing N nearest one a SM
    (or ``ctas``) of 16 warps (or fewer when the CTA has fewer row groups); rows of
    K >= 4096 go in pairs (NR=2) with K cut in KS slices of >= 2048 (KS <= 4),
    shorter ones alone.  H100, 1B shapes, 16 launches with PDL, us: O (K=2048) 128
    CTAs NR=1 W=16 3.88 / 3.93 (this, two runs), 256 NR=1 W=8 4.03 / 4.04, 128 NR=2
    W=8 4.04 / 4.06; down (K=8192) 128 KS=4 NR=2 W=16 11.78 (this), KS=2 11.89 /
    11.88, 256 KS=2 NR=2 W=8 12.02 / 12.03, 256 NR=1 W=8 12.51 / 12.49."""
    long = k >= 4096
    nr = nr or (2 if long else 1)
    if ks is None:
        ks = next((s for s in (4, 2) if long and k % (256 * s) == 0 and k // s >= 2048), 1)
    _need(ks >= 1 and k % ks == 0, f"matvec_residual: KS={ks} must divide K={k}")
    grid = _grid(n, ctas if ctas is not None else sms, nr)
    rpc = n // grid
    w = warps or ks * max(1, min(16 // ks, rpc // nr))
    return rpc, [k, nr, ch or _chunk(k // ks, nr), w, rpc, ks, nb]


def _grid(n: int, target: int, unit: int) -> int:
    options = [c for c in range(1, n + 1) if n % c == 0 and (n // c) % unit == 0]
    _need(bool(options), f"no CTA count gives a whole number of {unit}-row groups per CTA for {n} rows")
    return min(options, key=lambda c: (abs(c - target), -c))


# -- rms_gate_up_silu ------------------------------------------------------------------

def _silu(x):
    return x / (1.0 + np.exp(-x))


def _rms_gate_up_silu_ref(g, act, hidden, norm_w, w_gate_up, eps):
    inter = act.shape[0]
    xn = hidden.astype(np.float64) * norm_w.astype(np.float64) * _rms(hidden, eps)
    # gate and up as two products: one of 2I rows crosses OpenBLAS's threaded-gemv size at small
    # shapes already (I = 1024, K = 256), which costs ~12 ms a call on a busy 2-core host, not 0.1
    gate, up = (w_gate_up[rows].astype(np.float64) @ xn for rows in (slice(0, inter), slice(inter, None)))
    act[...] = _silu(gate) * up


def _rms_gate_up_silu_check(g, act, hidden, norm_w, w_gate_up, eps):
    K, CH, W, PPC = (g[n] for n in ("K", "CH", "W", "PPC"))
    name = "rms_gate_up_silu"
    t = act.tensor
    inter = t.shape[0]
    _need(act.tile_shape == (PPC,), f"{name}<PPC={PPC}>: partition act with [{PPC}], not {list(act.tile_shape)}")
    _need(hidden.shape == (K,) and norm_w.shape == (K,), f"{name}<K={K}>: hidden {hidden.shape} and norm_w "
                                                          f"{norm_w.shape} must be [{K}]")
    _need(w_gate_up.shape == (2 * inter, K), f"{name}: w_gate_up {w_gate_up.shape} must be [2*I, K] = "
                                             f"[{2 * inter}, {K}] (cat of gate_proj and up_proj)")
    _stream_checks(name, K, CH, 2, W, 4 * W)
    _aligned(name, hidden, norm_w, w_gate_up)


rms_gate_up_silu = Kernel(
    "rms_gate_up_silu", SOURCE,
    [Out("act", "float32", rank=1), In("hidden", "float32", rank=1), In("norm_w", "bfloat16", rank=1),
     In("w_gate_up", "bfloat16", rank=2), Scalar("eps", "float32")],
    generics=["K", "CH", "W", "PPC"], block=lambda g: 32 * g["W"], reference=_rms_gate_up_silu_ref,
    validate=_rms_gate_up_silu_check)


def gate_up_plan(d: int, inter: int, *, sms: int = H100_SMS, ctas: int | None = None, ch: int | None = None,
                 warps: int | None = None) -> tuple[int, list]:
    """(tile, generics) of rms_gate_up_silu: the CTA count dividing I nearest 2 per SM (or ``ctas``)."""
    grid = _grid(inter, ctas if ctas is not None else 2 * sms, 1)
    ppc = inter // grid
    return ppc, [d, ch or _chunk(d, 2), warps or min(8, ppc), ppc]


# -- rms_lm_head_argmax --------------------------------------------------------------------

def _rms_lm_head_argmax_ref(g, logits, hidden, norm_w, w, token, work, eps, vocab):
    xn = hidden.astype(np.float64) * norm_w.astype(np.float64) * _rms(hidden, eps)
    full = w.astype(np.float64) @ xn
    logits[:vocab] = full
    logits[vocab:] = -np.inf
    token[0] = int(np.argmax(logits[:vocab]))  # the first maximum of what was written (NaN counts as largest)
    work[...] = 0


def _rms_lm_head_argmax_check(g, logits, hidden, norm_w, w, token, work, eps, vocab):
    K, NR, CH, W, RPC = (g[n] for n in ("K", "NR", "CH", "W", "RPC"))
    name = "rms_lm_head_argmax"
    t = logits.tensor
    vp = t.shape[0]
    _need(logits.tile_shape == (RPC,), f"{name}<RPC={RPC}>: partition logits with [{RPC}], "
                                       f"not {list(logits.tile_shape)}")
    _need(hidden.shape == (K,) and norm_w.shape == (K,), f"{name}<K={K}>: hidden {hidden.shape} and norm_w "
                                                          f"{norm_w.shape} must be [{K}]")
    _need(w.ndim == 2 and w.shape[1] == K, f"{name}<K={K}>: w {w.shape} must be [vocab, {K}]")
    _need(vocab == w.shape[0] and vocab >= 1, f"{name}: vocab={vocab} but w has {w.shape[0]} rows; pass w.shape[0]")
    _need(vocab <= vp < vocab + RPC, f"{name}: logits has {vp} rows; it needs vocab={vocab} rows padded to a "
                                     f"multiple of RPC={RPC}, less than one tile more ({lm_head_rows(vocab, RPC)})")
    _need(1 <= NR <= 32 and RPC % NR == 0, f"{name}: RPC={RPC} must be a multiple of NR={NR} (NR in [1, 32])")
    _one(name, token=token)
    _need(work.shape == (2,), f"{name}: work must be a uint64 [2] workspace (zeroed once), got shape {work.shape}")
    _stream_checks(name, K, CH, NR, W, 12 * W)
    if work.overlaps(token):
        raise dop.AliasingError(f"{name}: work and token overlap; give each its own memory")
    _aligned(name, hidden, norm_w, w, work)


rms_lm_head_argmax = Kernel(
    "rms_lm_head_argmax", SOURCE,
    [Out("logits", "float32", rank=1), In("hidden", "float32", rank=1), In("norm_w", "bfloat16", rank=1),
     In("w", "bfloat16", rank=2), In("token", "int32", rank=1), In("work", "uint64", rank=1),
     Scalar("eps", "float32"), Scalar("vocab", "int32")],
    generics=["K", "NR", "CH", "W", "RPC"], block=lambda g: 32 * g["W"], reference=_rms_lm_head_argmax_ref,
    validate=_rms_lm_head_argmax_check)


def lm_head_rows(vocab: int, rpc: int) -> int:
    """The logits buffer's length for ``vocab`` rows and RPC rows a CTA (padded; the pad reads -inf)."""
    return -(-vocab // rpc) * rpc


def lm_head_plan(d: int, vocab: int, *, sms: int = H100_SMS, ctas_per_sm: int = 1, nr: int = 2,
                 ch: int | None = None, warps: int = 16) -> tuple[int, int, list]:
    """(tile, logits length, generics) of rms_lm_head_argmax: ``ctas_per_sm`` CTAs a
    SM, all resident at once with equal rows, so every CTA streams the same bytes
    (a warp at most NR rows more than another); the rows past ``vocab`` are padding.
    H100, 1B shape, with PDL: 1 CTA of 16 warps a SM, NR=2: 172.8 us (3.04 TB/s,
    1.00x the copy rate); 2, 3 or 4 a SM, NR 1 or 2: 173.9-176.0 us."""
    rpc = -(-vocab // (sms * ctas_per_sm * nr)) * nr
    return rpc, lm_head_rows(vocab, rpc), [d, nr, ch or _chunk(d, nr), warps, rpc]


__all__ = ["embed_gather", "rms_qkv_rope", "matvec_residual", "rms_gate_up_silu", "rms_lm_head_argmax",
           "embed_plan", "qkv_plan", "matvec_residual_plan", "gate_up_plan", "lm_head_plan", "lm_head_rows",
           "rope_angles", "qkv_pairs", "qkv_cache_checks", "ERR_TOKEN", "ERR_POS"]
