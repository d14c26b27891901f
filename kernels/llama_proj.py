"""The projection kernels of the Llama decode step (kernels/llama_proj.cu).

Batch 1, bf16 weights in Hugging Face layout ``[out_features, in_features]``,
fp32 activations and accumulation; every kernel is PDL-ready (``.pdl()``).

* ``embed_gather<B>(hidden [D] tile [B], embed bf16 [V, D], token int32 [1], error int32 [1], vocab)``
* ``rms_qkv_rope<K, HD, HQ, HKV, W, CH, NB>(q [HQ*HD] tile [T], hidden [K], norm_w bf16 [K],
  w_qkv bf16 [(HQ+2*HKV)*HD, K], inv_freq [HD/2], pos int32 [1], k_cache bf16 [HKV, cap, HD],
  v_cache bf16 [HKV, cap, HD], error int32 [1], eps, cap)``: also writes k_cache, v_cache (row pos), error
* ``matvec_residual<K, NR, CH, W, RPC, KS, NB>(out [N] tile [RPC], x [K], w bf16 [N, K], residual [N])``
* ``rms_gate_up_silu<K, CH, W, PPC>(act [I] tile [PPC], hidden [K], norm_w bf16 [K], w_gate_up bf16 [2I, K], eps)``
* ``rms_lm_head_argmax<K, NR, CH, W, RPC>(logits [(vocab+RPC-1)//RPC*RPC] tile [RPC], hidden [K], norm_w bf16 [K],
  w bf16 [vocab, K], token int32 [1], work uint64 [2], error int32 [1], eps, vocab)``: also writes token (and
  error); ``work`` zeroed once by the caller; the logits past vocab are padding

Generics: K the input width (a multiple of 8; where 256*CH does not divide it,
the last chunk of a row is partial), CH the 16-byte loads per lane per row per
chunk, W warps a CTA, NR rows a warp streams together, RPC /
PPC rows / pairs a CTA (= the output tile), NB the chunks a warp keeps in flight
(register buffers; the first NB are loaded before griddepcontrol.wait), KS the
slices of K that the warps of a row group split (partial sums added in shared
memory).  The ``*_plan`` functions give the tile and generics for a shape.
x is staged in static shared memory up to K = 10240 (40 KB), in dynamic shared
memory beyond (the declarations ask for it and the launch opts in past 48 KB):
K is bounded by the 227 KB a CTA may have on sm_90 (about 56K), not by 48 KB.

Errors the device reports: ``error`` is a sticky int32 word (zero it once);
``embed_gather`` ORs ``ERR_TOKEN`` (1) into it when the token is outside
[0, vocab) and leaves ``hidden`` unwritten; ``rms_qkv_rope`` ORs ``ERR_POS`` (2)
when pos is outside [0, cap) and appends nothing to the cache (q is written);
``rms_lm_head_argmax`` ORs ``ERR_LOGITS`` (4) when a logit is NaN or infinite.
"""
from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np

import deviceop as dop
from deviceop.kernel import In, InOut, Kernel, Out, Scalar

from . import _checks
from ._checks import _need
from .llama_tuned import choose
from ._refmath import matvec64

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "llama_proj.cu"
ERR_TOKEN, ERR_POS, ERR_LOGITS = 1, 2, 4   # llama::ERR_* in llama_common.cuh
SHARED_LIMIT = 48 * 1024      # static shared memory a CTA may declare
X_STATIC_MAX = 40 * 1024      # llama::X_STATIC_MAX: x (4*K bytes) goes to dynamic shared memory beyond it
SMEM_OPTIN = 227 * 1024       # shared memory a CTA may opt into on sm_90 (static + dynamic)
MAX_LOADS = 32                # NB * NR * CH: 16-byte loads a lane holds in flight (4 registers each)
H100_SMS = 132



def _aligned(name: str, *tensors) -> None:
    _checks._aligned(*tensors, who=f"{name} uses")



def x_shared(k: int) -> int:
    """Dynamic shared memory of a projection of input width K: x's stage (4*K bytes) once it
    is past X_STATIC_MAX, else 0 (x is static)."""
    return 4 * k if 4 * k > X_STATIC_MAX else 0


def _stream_checks(name: str, k: int, ch: int, nr: int, w: int, extra_shared: int, nb: int = 2, ks: int = 1) -> None:
    """extra_shared: the kernel's static shared memory besides x."""
    _need(1 <= ch <= 8 and ks >= 1 and k >= 8 * ks and k % (8 * ks) == 0,
          f"{name}: K={k} must be a positive multiple of 8*KS={8 * ks} (16-byte loads of 8 bf16, K cut in KS "
          f"slices) and CH={ch} in [1, 8]")
    _need(1 <= nb <= 8, f"{name}: NB={nb} buffers must be in [1, 8]")
    _need(1 <= nb * nr * ch <= MAX_LOADS, f"{name}: NB*NR*CH={nb * nr * ch} loads a lane holds must be in "
                                          f"[1, {MAX_LOADS}] (4 registers each)")
    _need(w % ks == 0, f"{name}: KS={ks} slices must divide the W={w} warps")
    _need(1 <= w <= 32, f"{name}: W={w} warps a CTA must be in [1, 32]")
    limit = SMEM_OPTIN if x_shared(k) else SHARED_LIMIT
    _need(4 * k + extra_shared <= limit,
          f"{name}: K={k} needs {4 * k + extra_shared} bytes of shared memory (x: 4*K = {4 * k}, the rest "
          f"{extra_shared}), more than the {limit // 1024} KB a CTA may have; the largest K served is "
          f"{max(0, SMEM_OPTIN - extra_shared) // 4 // 8 * 8}")


def _fp32_semantics(ref):
    """A reference that, like the kernel, lets an overflow become inf and inf * 0 NaN silently
    (the LM head reports non-finite logits in the error word)."""
    def quiet(*args):
        with np.errstate(over="ignore", invalid="ignore"):
            return ref(*args)
    return quiet


def _rms(x: np.ndarray, eps: float) -> float:
    return _rms64(x.astype(np.float64), eps)


def _rms64(x64: np.ndarray, eps: float) -> float:
    sq = x64 * x64  # np.mean's sum and division without its Python wrapper (a launch's cost, the same bits)
    return 1.0 / math.sqrt(float(np.add.reduce(sq)) / sq.size + float(np.float32(eps)))


def _normed(hidden: np.ndarray, norm_w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of ``hidden`` times ``norm_w``, in float64."""
    x64 = hidden.astype(np.float64)
    return x64 * norm_w.astype(np.float64) * _rms64(x64, eps)


def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16)


# -- embed_gather ------------------------------------------------------------------

def _embed_gather_ref(g, hidden, embed, token, error, vocab):
    t = int(token[0])
    if 0 <= t < vocab:
        hidden[...] = embed[t].astype(np.float64)
    else:
        error[0] |= ERR_TOKEN


def _embed_gather_limits(g):
    B = g["B"]
    _need(B % 8 == 0 and 8 <= B <= 8192, f"embed_gather: B={B} must be a multiple of 8 in [8, 8192] (8 elements a "
                                         "thread)")


embed_gather = Kernel(
    "embed_gather", SOURCE,
    [Out("hidden", "float32", shape=("D",), tile=("B",)), In("embed", "bfloat16", shape=("vocab", "D")),
     In("token", "int32", shape=(1,)), InOut("error", "int32", shape=(1,)), Scalar("vocab", "int32")],
    generics=["B"], block="B//8", reference=_embed_gather_ref, limits=_embed_gather_limits,
    validate=lambda g, hidden, embed, *rest: _aligned("embed_gather", hidden.tensor, embed))


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


@_fp32_semantics
def _rms_qkv_rope_ref(g, q, hidden, norm_w, w_qkv, inv_freq, pos, k_cache, v_cache, error, eps, cap):
    hd, hq, hkv = g["HD"], g["HQ"], g["HKV"]
    xn = _normed(hidden, norm_w, eps)
    y = matvec64(w_qkv, xn)
    p = int(pos[0])
    ang = rope_angles(p, inv_freq).astype(np.float64)
    cos, sin = np.cos(ang), np.sin(ang)
    qk = _rope(y[: (hq + hkv) * hd].reshape(hq + hkv, hd), cos, sin)  # q's heads and k's, one rotation
    qh, kh = qk[:hq], qk[hq:]
    vh = y[(hq + hkv) * hd:].reshape(hkv, hd)
    q[...] = qh.reshape(-1)
    if 0 <= p < cap:
        k_cache[:, p, :] = _bf16(kh)
        v_cache[:, p, :] = _bf16(vh)
    else:
        error[0] |= ERR_POS


def qkv_pairs(hq: int, hkv: int, hd: int) -> int:
    return (hq + 2 * hkv) * hd // 2


def heads_limits(name: str, HD: int, HQ: int, HKV: int) -> None:
    """The heads a QKV + RoPE kernel serves (rms_qkv_rope here, pf_qkv_rope in llama_prefill.py)."""
    _need(HD % 2 == 0 and HD >= 2 and HQ >= 1 and HKV >= 1, f"{name}: HD={HD} must be even, HQ={HQ} and HKV={HKV} "
                                                            "positive")


def qkv_params(first, position, rows=()) -> list:
    """The parameters of a QKV + RoPE + cache-append kernel (rms_qkv_rope here, pf_qkv_rope in
    llama_prefill.py), its output ``first`` and position ``position`` given, its activations
    ``[*rows, K]``: the concatenated weight (cat of q_proj, k_proj, v_proj), the RoPE table,
    this layer's K and V cache slices and the error word (in-out: each its own memory) and the
    caches' capacity."""
    return [first, In("hidden", "float32", shape=(*rows, "K")), In("norm_w", "bfloat16", shape=("K",)),
            In("w_qkv", "bfloat16", shape=("(HQ+2*HKV)*HD", "K")), In("inv_freq", "float32", shape=("HD//2",)),
            position, InOut("k_cache", "bfloat16", shape=("HKV", "cap", "HD")),
            InOut("v_cache", "bfloat16", shape=("HKV", "cap", "HD")), InOut("error", "int32", shape=(1,)),
            Scalar("eps", "float32"), Scalar("cap", "int32")]


def _qkv_limits(K, CH, W, NB):
    _stream_checks("rms_qkv_rope", K, CH, 2, W, 4 * W, NB)


def _rms_qkv_rope_limits(g):
    heads_limits("rms_qkv_rope", g["HD"], g["HQ"], g["HKV"])
    _qkv_limits(g["K"], g["CH"], g["W"], g["NB"])


def _rms_qkv_rope_check(g, q, hidden, norm_w, w_qkv, *rest):
    pairs, grid = qkv_pairs(g["HQ"], g["HKV"], g["HD"]), q.num_tiles
    _need(pairs % grid == 0, f"rms_qkv_rope: q's partition makes {grid} CTAs, which must divide the {pairs} RoPE "
                             "pairs; use qkv_plan(...) for the tile")
    _aligned("rms_qkv_rope", hidden, norm_w, w_qkv)


rms_qkv_rope = Kernel(
    "rms_qkv_rope", SOURCE,
    qkv_params(Out("q", "float32", shape=("HQ*HD",)), In("pos", "int32", shape=(1,))),
    generics=["K", "HD", "HQ", "HKV", "W", "CH", "NB"], block="32*W", shared_mem=lambda g: x_shared(g["K"]),
    reference=_rms_qkv_rope_ref, limits=_rms_qkv_rope_limits, validate=_rms_qkv_rope_check)


def qkv_plan(d: int, hq: int, hkv: int, hd: int, *, sms: int = H100_SMS, ctas: int | None = None,
             ch: int | None = None, warps: int | None = None, nb: int | None = None,
             tuned: bool = True) -> tuple[int, list]:
    """(q tile, generics) of rms_qkv_rope: the CTA count (a divisor of both the q
    size and the pair count) nearest 2 per SM (or ``ctas``), a warp per pair (or
    ``warps`` warps taking every warps-th pair), ``nb`` (2) chunks in flight a warp;
    what the caller leaves None, llama_tuned.TUNED may choose for this shape.
    H100, 1B shape, 16 launches with PDL (two runs): 256 CTAs of 6 warps 5.48 /
    5.47 us (this), 128 of 12 5.49 / 5.51, 256 of 3 6.33, 128 of 8 with NB=3 6.25."""
    t = choose("qkv", (d, hq, hkv, hd), dict(ctas=ctas, ch=ch, warps=warps, nb=nb), tuned)
    ctas, ch, warps, nb = t["ctas"], t["ch"], t["warps"], t["nb"] or 2
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
    a lane besides the weights: 128+ registers, spills at two CTAs a SM); 1 when 256 does
    not divide K (the last chunk of a row is partial: the fewest idle lanes)."""
    _need(k % 8 == 0 and k > 0, f"the Llama projections stream rows in 16-byte loads of 8 bf16: K={k} must be a "
                                "positive multiple of 8")
    return next((c for c in (4, 2, 1) if nr * c <= 8 and k % (256 * c) == 0), 1)


# -- matvec_residual -------------------------------------------------------------------

@_fp32_semantics
def _matvec_residual_ref(g, out, x, w, residual):
    out[...] = residual.astype(np.float64) + matvec64(w, x)


def _matvec_limits(K, NR, CH, W, RPC, KS, NB):
    _stream_checks("matvec_residual", K, CH, NR, W, 4 * RPC * (1 + (KS if KS > 1 else 0)), NB, KS)


def _matvec_residual_limits(g):
    K, NR, CH, W, RPC, KS, NB = (g[n] for n in ("K", "NR", "CH", "W", "RPC", "KS", "NB"))
    _need(1 <= NR <= 32 and RPC % NR == 0, f"matvec_residual: RPC={RPC} must be a multiple of NR={NR} (NR in [1, 32])")
    _matvec_limits(K, NR, CH, W, RPC, KS, NB)


matvec_residual = Kernel(
    "matvec_residual", SOURCE,
    [Out("out", "float32", shape=("N",), tile=("RPC",)), In("x", "float32", shape=("K",)),
     In("w", "bfloat16", shape=("N", "K")), In("residual", "float32", shape=("N",))],
    generics=["K", "NR", "CH", "W", "RPC", "KS", "NB"], block="32*W", shared_mem=lambda g: x_shared(g["K"]),
    reference=_matvec_residual_ref, limits=_matvec_residual_limits,
    validate=lambda g, out, x, w, residual: _aligned("matvec_residual", x, w))


def matvec_residual_plan(n: int, k: int, *, sms: int = H100_SMS, ctas: int | None = None, nr: int | None = None,
                         ch: int | None = None, warps: int | None = None, ks: int | None = None,
                         nb: int | None = None, tuned: bool = True) -> tuple[int, list]:
    """(tile, generics) of matvec_residual: the CTA count dividing N nearest one a SM
    (or ``ctas``) of 16 warps (or fewer when the CTA has fewer row groups); rows of
    K >= 4096 go in pairs (NR=2) with K cut in KS slices of >= 2048 (KS <= 4),
    shorter ones alone; NB=2 buffers.  What the caller leaves None, llama_tuned.TUNED
    may choose for this shape.  H100, 1B shapes, 16 launches with PDL, us: O (K=2048) 128
    CTAs NR=1 W=16 3.88 / 3.93 (this, two runs), 256 NR=1 W=8 4.03 / 4.04, 128 NR=2
    W=8 4.04 / 4.06; down (K=8192) 128 KS=4 NR=2 W=16 11.78 (this), KS=2 11.89 /
    11.88, 256 KS=2 NR=2 W=8 12.02 / 12.03, 256 NR=1 W=8 12.51 / 12.49."""
    t = choose("matvec", (n, k), dict(ctas=ctas, nr=nr, ch=ch, warps=warps, ks=ks, nb=nb), tuned)
    ctas, nr, ch, warps, ks, nb = t["ctas"], t["nr"], t["ch"], t["warps"], t["ks"], t["nb"] or 2
    long = k >= 4096
    nr = nr or (2 if long else 1)
    if ks is None:
        ks = next((s for s in (4, 2) if long and k % (256 * s) == 0 and k // s >= 2048), 1)
    _need(ks >= 1 and k % (8 * ks) == 0, f"matvec_residual: KS={ks} slices of K={k} must each be a multiple of 8")
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


@_fp32_semantics
def _rms_gate_up_silu_ref(g, act, hidden, norm_w, w_gate_up, eps):
    inter = act.shape[0]
    xn = _normed(hidden, norm_w, eps)
    y = matvec64(w_gate_up, xn)
    act[...] = _silu(y[:inter]) * y[inter:]


def _gate_up_limits(K, CH, W):
    _stream_checks("rms_gate_up_silu", K, CH, 2, W, 4 * W)


rms_gate_up_silu = Kernel(  # w_gate_up: the cat of gate_proj and up_proj
    "rms_gate_up_silu", SOURCE,
    [Out("act", "float32", shape=("I",), tile=("PPC",)), In("hidden", "float32", shape=("K",)),
     In("norm_w", "bfloat16", shape=("K",)), In("w_gate_up", "bfloat16", shape=("2*I", "K")),
     Scalar("eps", "float32")],
    generics=["K", "CH", "W", "PPC"], block="32*W", shared_mem=lambda g: x_shared(g["K"]),
    reference=_rms_gate_up_silu_ref, limits=lambda g: _gate_up_limits(g["K"], g["CH"], g["W"]),
    validate=lambda g, act, hidden, norm_w, w, eps: _aligned("rms_gate_up_silu", hidden, norm_w, w))


def gate_up_plan(d: int, inter: int, *, sms: int = H100_SMS, ctas: int | None = None, ch: int | None = None,
                 warps: int | None = None, tuned: bool = True) -> tuple[int, list]:
    """(tile, generics) of rms_gate_up_silu: the CTA count dividing I nearest 2 per SM (or ``ctas``)
    of up to 8 warps; what the caller leaves None, llama_tuned.TUNED may choose for this shape."""
    t = choose("gate_up", (d, inter), dict(ctas=ctas, ch=ch, warps=warps), tuned)
    ctas, ch, warps = t["ctas"], t["ch"], t["warps"]
    grid = _grid(inter, ctas if ctas is not None else 2 * sms, 1)
    ppc = inter // grid
    return ppc, [d, ch or _chunk(d, 2), warps or min(8, ppc), ppc]


# -- rms_lm_head_argmax --------------------------------------------------------------------

@_fp32_semantics
def _rms_lm_head_argmax_ref(g, logits, hidden, norm_w, w, token, work, error, eps, vocab):
    xn = _normed(hidden, norm_w, eps)
    full = matvec64(w, xn)
    logits[:vocab] = full
    logits[vocab:] = -np.inf
    token[0] = int(np.argmax(logits[:vocab]))  # the first maximum of what was written (NaN counts as largest)
    work[...] = 0
    if not np.all(np.abs(full) <= np.finfo(np.float32).max):  # NaN, or infinite as a float32
        error[0] |= ERR_LOGITS


def _lm_head_limits(K, NR, CH, W):
    _stream_checks("rms_lm_head_argmax", K, CH, NR, W, 12 * W)


def _rms_lm_head_argmax_limits(g):
    K, NR, CH, W, RPC = (g[n] for n in ("K", "NR", "CH", "W", "RPC"))
    _need(1 <= NR <= 32 and RPC % NR == 0, f"rms_lm_head_argmax: RPC={RPC} must be a multiple of NR={NR} (NR in "
                                           "[1, 32])")
    _lm_head_limits(K, NR, CH, W)


def _rms_lm_head_argmax_check(g, logits, hidden, norm_w, w, token, work, error, eps, vocab):
    # logits' length (vocab padded to whole tiles) is its shape's; token, work and error are
    # InOut, so the launch's own checks refuse any overlap of the words it writes
    name = "rms_lm_head_argmax"
    _need(vocab >= 1, f"{name}: vocab={vocab} must be at least 1")
    _aligned(name, hidden, norm_w, w, work)


LOGITS_ROWS = "(vocab+RPC-1)//RPC*RPC"  # vocab rows padded to whole tiles of RPC (lm_head_rows)

rms_lm_head_argmax = Kernel(  # work: a uint64 [2] workspace, zeroed once
    "rms_lm_head_argmax", SOURCE,
    [Out("logits", "float32", shape=(LOGITS_ROWS,), tile=("RPC",)), In("hidden", "float32", shape=("K",)),
     In("norm_w", "bfloat16", shape=("K",)), In("w", "bfloat16", shape=("vocab", "K")),
     InOut("token", "int32", shape=(1,)), InOut("work", "uint64", shape=(2,)), InOut("error", "int32", shape=(1,)),
     Scalar("eps", "float32"), Scalar("vocab", "int32")],
    generics=["K", "NR", "CH", "W", "RPC"], block="32*W", shared_mem=lambda g: x_shared(g["K"]),
    reference=_rms_lm_head_argmax_ref, limits=_rms_lm_head_argmax_limits, validate=_rms_lm_head_argmax_check)


def lm_head_rows(vocab: int, rpc: int) -> int:
    """The logits buffer's length for ``vocab`` rows and RPC rows a CTA (padded; the pad reads -inf)."""
    return -(-vocab // rpc) * rpc


def lm_head_plan(d: int, vocab: int, *, sms: int = H100_SMS, ctas_per_sm: int | None = None, nr: int | None = None,
                 ch: int | None = None, warps: int | None = None, tuned: bool = True) -> tuple[int, int, list]:
    """(tile, logits length, generics) of rms_lm_head_argmax: ``ctas_per_sm`` (1) CTAs a
    SM of ``warps`` (16), all resident at once with equal rows, so every CTA streams the same bytes
    (a warp at most NR (2) rows more than another); the rows past ``vocab`` are padding.
    What the caller leaves None, llama_tuned.TUNED may choose for this shape.
    H100, 1B shape, with PDL: 1 CTA of 16 warps a SM, NR=2: 172.8 us (3.04 TB/s,
    1.00x the copy rate); 2, 3 or 4 a SM, NR 1 or 2: 173.9-176.0 us."""
    t = choose("lm_head", (d, vocab), dict(ctas_per_sm=ctas_per_sm, nr=nr, ch=ch, warps=warps), tuned)
    ctas_per_sm, nr, ch, warps = t["ctas_per_sm"] or 1, t["nr"] or 2, t["ch"], t["warps"] or 16
    rpc = -(-vocab // (sms * ctas_per_sm * nr)) * nr
    return rpc, lm_head_rows(vocab, rpc), [d, nr, ch or _chunk(d, nr), warps, rpc]


def check_decode_shapes(d: int, inter: int, hq: int, hkv: int, hd: int, vocab: int) -> None:
    """Refuse a model shape whose projections the plans above cannot serve, from the numbers
    alone (before any weight is read or buffer made): each plan, and the limits its launch
    would check (a ShapeError naming the kernel and the limit).  d: hidden size, inter: the
    MLP's, hq/hkv: query/KV heads, hd: head dim."""
    steps = [("hidden_size", lambda: embed_plan(d)),
             ("hidden_size and the heads (QKV)", lambda: _qkv_limits(*(qkv_plan(d, hq, hkv, hd)[1][i]
                                                                       for i in (0, 5, 4, 6)))),
             ("num_attention_heads * head_dim (O)", lambda: _matvec_limits(*matvec_residual_plan(d, hq * hd)[1])),
             ("hidden_size and intermediate_size (gate/up)", lambda: _gate_up_limits(*gate_up_plan(d, inter)[1][:3])),
             ("intermediate_size (down)", lambda: _matvec_limits(*matvec_residual_plan(d, inter)[1])),
             ("hidden_size and vocab_size (LM head)", lambda: _lm_head_limits(*lm_head_plan(d, vocab)[2][:4]))]
    for what, check in steps:
        try:
            check()
        except dop.ShapeError as exc:
            raise dop.ShapeError(f"{what}: {exc}") from None


__all__ = ["embed_gather", "rms_qkv_rope", "matvec_residual", "rms_gate_up_silu", "rms_lm_head_argmax",
           "embed_plan", "qkv_plan", "matvec_residual_plan", "gate_up_plan", "lm_head_plan", "lm_head_rows",
           "rope_angles", "qkv_pairs", "qkv_params", "heads_limits", "x_shared", "check_decode_shapes", "ERR_TOKEN", "ERR_POS", "ERR_LOGITS"]
