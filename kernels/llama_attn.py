"""Llama decode attention and sampling kernels: declarations and NumPy references.

* ``attn_decode<HD, G, S, MINL, LMAX, PREFETCH, RG>(out [Hq*HD] tile [G*HD/S], q [Hq*HD], k [Hkv, cap, HD],
  v [Hkv, cap, HD], pos int32 [1], ws, counters, cap)``: grouped-query decode attention over cache entries
  0..pos, split over the sequence (flash-decoding), the length read on the device (kernels/llama_attn.cu).
  :func:`attn_plan` picks the generics for a capacity; ``PREFETCH=1`` is the caller's promise that pos
  and entries < pos are stable before the launch's PDL chain (see the kernel's header).
* ``sample<C>(part [B, 2C+4] tile [1, 2C+4], logits [V], token int32 [1], state int32 [1], step int32 [1],
  vocab, temperature, top_k, top_p, seed)``: greedy / temperature / top-k / top-p sampling with a
  Philox-4x32-10 Gumbel-max draw (kernels/llama_sample.cu).

Both are PDL-ready (``.pdl()``) and serve graph replays at any device-side position.  ``ws``,
``counters``, ``token`` and ``state`` are written although declared as inputs (deviceop's output
partition sets the grid); the references write ``out``/``token`` and leave the counters at zero, as the
kernels do.  Use :func:`attn_buffers` and :func:`sample_buffers` to make the scratch.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

import deviceop as dop
from deviceop.kernel import In, InOut, Kernel, Out, Scalar

from . import _checks
from ._checks import _need
from .llama_tuned import choose

HERE = Path(__file__).resolve().parent
LOG2E = 1.4426950408889634



def _aligned(name: str, *tensors) -> None:
    _checks._aligned(*tensors, who=f"{name} uses")


# -- attn_decode ---------------------------------------------------------------------------------

def attn_chunks(n: int, splits: int, min_chunk: int) -> tuple[int, int]:
    """(chunk length, active chunks) the kernel uses for a length of ``n`` = pos + 1 entries."""
    length = max(min_chunk, (-(-n // splits) + 15) // 16 * 16)
    return length, -(-n // length)


def attn_plan(cap: int, head_dim: int, group: int, *, splits: int | None = None, min_chunk: int | None = None,
              prefetch: bool = False, warps: int | None = None, max_smem: int = 64 * 1024,
              kv_heads: int | None = None, tuned: bool = True) -> tuple[int, list]:
    """(out tile, generics) of attn_decode for a KV capacity: ``splits`` (16) chunks a KV head
    (doubled, up to 64, while a chunk of the capacity needs more than ``max_smem`` bytes of K and
    V), chunks of at least ``min_chunk`` (64) rows, LMAX the rows of the longest chunk, about
    ``warps`` (16) warps a CTA (RG = warps // group row groups).  ``prefetch``: the caller keeps
    the PREFETCH contract.  With ``kv_heads`` (the grid is kv_heads x splits), what the caller
    leaves None llama_tuned.TUNED may choose for (head_dim, group, kv_heads)."""
    _need(cap >= 1, f"attn_plan: capacity {cap} must be at least 1")
    t = choose("attn", (head_dim, group, kv_heads), dict(splits=splits, min_chunk=min_chunk, warps=warps),
               tuned and kv_heads is not None)
    splits, min_chunk, warps = t["splits"] or 16, t["min_chunk"] or 64, t["warps"] or 16
    s = splits
    lmax = max(min_chunk, _round16(-(-cap // s)))
    while _smem(lmax, head_dim) > max_smem and s < 64 and (group * head_dim) % (2 * s) == 0:
        s *= 2
        lmax = max(min_chunk, _round16(-(-cap // s)))
    rg = max(1, min(warps, 32) // group)
    return group * head_dim // s, [head_dim, group, s, min_chunk, lmax, int(bool(prefetch)), rg]


def _round16(x: int) -> int:
    return (x + 15) // 16 * 16


def _smem(lmax: int, head_dim: int) -> int:
    """Dynamic shared memory of attn_decode: a chunk's K and V rows (bf16)."""
    return 4 * lmax * head_dim


def _static_smem(head_dim: int, group: int, splits: int, rg: int) -> int:
    return 4 * (rg * group * head_dim + 2 * rg * group + 3 * splits * group + 1)


SMEM_LIMIT = 227 * 1024  # shared memory a CTA may opt into on sm_90
HEAD_DIMS = (64, 128)    # what attn_decode (and the prefill's pf_attn) compile for
MAX_GROUP = 8            # query heads a KV head, at most


def check_heads(head_dim: int, heads: int, kv_heads: int) -> None:
    """Refuse an attention shape attn_decode does not serve (a ShapeError naming the limit)."""
    _need(head_dim in HEAD_DIMS, f"head_dim {head_dim} is not supported (the attention kernels serve "
                                 f"{', '.join(map(str, HEAD_DIMS))})")
    _need(kv_heads >= 1 and heads % kv_heads == 0,
          f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    _need(1 <= heads // kv_heads <= MAX_GROUP, f"a group of {heads // kv_heads} query heads per KV head (the "
                                               f"attention kernel serves 1 to {MAX_GROUP})")


def attn_smem(cap: int, head_dim: int, group: int, **plan) -> int:
    """Shared memory (dynamic + static) of attn_decode as attn_plan(cap, ...) launches it."""
    hd, g, s, _, lmax, _, rg = attn_plan(cap, head_dim, group, **plan)[1]
    return _smem(lmax, hd) + _static_smem(hd, g, s, rg)


def check_capacity(cap: int, head_dim: int, group: int, **plan) -> None:
    """Refuse a KV capacity whose chunks attn_plan cannot stage in the shared memory a CTA may
    have (at most 64 chunks a KV head), naming the largest capacity served."""
    if attn_smem(cap, head_dim, group, **plan) <= SMEM_LIMIT:
        return
    lo, hi = 1, cap  # the largest capacity that fits: attn_smem grows with cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if attn_smem(mid, head_dim, group, **plan) <= SMEM_LIMIT else (lo, mid - 1)
    raise dop.ShapeError(f"a KV capacity of {cap} needs {attn_smem(cap, head_dim, group, **plan)} bytes of shared "
                         f"memory in attn_decode at head_dim {head_dim} (a chunk's K and V rows, 64 chunks at "
                         f"most), more than the {SMEM_LIMIT} a CTA may have; the largest capacity served is {lo}")


def attn_ws_size(kv_heads: int, head_dim: int, group: int, splits: int) -> int:
    """Floats of attn_decode's workspace (per-chunk partial accumulators, maxima and sums)."""
    return kv_heads * splits * group * (head_dim + 2)


def attn_buffers(kv_heads: int, head_dim: int, group: int, splits: int, *, stream=None):
    """``(ws, counters)`` for attn_decode: scratch shared by every layer's launch on one stream
    (the counters start at zero and the kernel leaves them at zero)."""
    ws = dop.empty([attn_ws_size(kv_heads, head_dim, group, splits)], stream=stream)
    counters = dop.from_numpy(np.zeros(kv_heads, np.int32), stream=stream)
    return ws, counters


def _attn_ref(g, out, q, k, v, pos, ws, counters, cap):
    HD, G, S, MINL = g["HD"], g["G"], g["S"], g["MINL"]
    hkv = k.shape[0]
    p = int(pos[0])
    if not 0 <= p < cap:
        out[...] = np.nan
        return
    n = p + 1
    length, nch = attn_chunks(n, S, MINL)
    # scores in log2 units, as the kernel keeps them (its partial maxima are log2 too)
    q64 = q.astype(np.float64).reshape(hkv, G, HD) * (LOG2E / math.sqrt(HD))
    k64, v64 = k[:, :n].astype(np.float64), v[:, :n].astype(np.float64)
    s = np.einsum("hgd,htd->hgt", q64, k64)
    w = np.exp2(s - s.max(axis=-1, keepdims=True))
    out[...] = (np.einsum("hgt,htd->hgd", w, v64) / w.sum(axis=-1, keepdims=True)).reshape(-1)
    if nch > 1:  # the partials the kernel leaves in ws
        acc = ws[: hkv * S * G * HD].reshape(hkv, S, G, HD)
        m = ws[hkv * S * G * HD: hkv * S * G * (HD + 1)].reshape(hkv, S, G)
        lsum = ws[hkv * S * G * (HD + 1): hkv * S * G * (HD + 2)].reshape(hkv, S, G)
        for c in range(nch):
            sc = s[:, :, c * length: min(n, (c + 1) * length)]
            mc = sc.max(axis=-1)
            e = np.exp2(sc - mc[..., None])
            m[:, c], lsum[:, c] = mc, e.sum(axis=-1)
            acc[:, c] = np.einsum("hgt,htd->hgd", e, v64[:, c * length: min(n, (c + 1) * length)])


def _attn_name(g) -> str:
    return "attn_decode<" + ", ".join(f"{n}={g[n]}" for n in ("HD", "G", "S", "MINL", "LMAX", "PREFETCH", "RG")) + ">"


def _attn_limits(g):
    HD, G, S, MINL, LMAX, PF, RG = g["HD"], g["G"], g["S"], g["MINL"], g["LMAX"], g["PREFETCH"], g["RG"]
    name = _attn_name(g)
    _need(HD in (64, 128), f"{name}: head dim {HD} is not supported; HD must be 64 or 128")
    _need(1 <= G <= 8, f"{name}: G={G} query heads per KV head is not supported; G must be in [1, 8]")
    _need(1 <= S <= 64 and (G * HD) % S == 0,
          f"{name}: S={S} splits must be in [1, 64] and divide G*HD={G * HD}")
    _need(MINL >= 16 and MINL % 16 == 0, f"{name}: MINL={MINL} must be a multiple of 16, at least 16")
    _need(LMAX >= MINL and LMAX % 16 == 0, f"{name}: LMAX={LMAX} must be a multiple of 16, at least MINL={MINL}")
    _need(PF in (0, 1), f"{name}: PREFETCH={PF} must be 0 or 1 (1: the caller keeps the contract of "
                        "kernels/llama_attn.cu's header)")
    _need(RG >= 1 and G * RG <= 32, f"{name}: G*RG = {G * RG} warps a CTA; RG must be at least 1 and G*RG at most 32")
    need_smem = _smem(LMAX, HD) + _static_smem(HD, G, S, RG)
    _need(need_smem <= SMEM_LIMIT, f"{name}: a chunk of LMAX={LMAX} rows needs {need_smem} bytes of shared "
                                   f"memory, more than the {SMEM_LIMIT} a CTA may have; use more splits "
                                   f"(attn_plan picks them)")


def _attn_check(g, out, q, k, v, pos, ws, counters, cap):
    HD, G, S, LMAX = g["HD"], g["G"], g["S"], g["LMAX"]
    name, hkv = _attn_name(g), k.shape[0]
    _need(S * LMAX >= cap, f"{name}: S*LMAX = {S * LMAX} rows cannot cover a capacity of {cap}; LMAX must be "
                           f"at least {_round16(-(-cap // S))} (attn_plan(cap, ...) picks it)")
    need = attn_ws_size(hkv, HD, G, S)
    _need(ws.shape[0] >= need, f"{name}: ws {ws.shape} must hold {need} floats; make it with attn_buffers(...)")
    _need(counters.shape[0] >= hkv,
          f"{name}: counters {counters.shape} must hold {hkv} int32 (one per KV head), zero initially")
    _aligned(name, out.tensor, q, k, v)  # ws and counters are InOut: the launch refuses their overlaps


attn_decode = Kernel(  # out and q: Hq*HD = HKV*G*HD; a tile per CTA, Hkv*S CTAs; k, v: the layer's cache slices
    "attn_decode", HERE / "llama_attn.cu",
    [Out("out", "float32", shape=("HKV*G*HD",), tile=("G*HD//S",)), In("q", "float32", shape=("HKV*G*HD",)),
     In("k", "bfloat16", shape=("HKV", "cap", "HD")), In("v", "bfloat16", shape=("HKV", "cap", "HD")),
     In("pos", "int32", shape=(1,)), InOut("ws", "float32", rank=1), InOut("counters", "int32", rank=1),
     Scalar("cap", "int32")],
    generics=["HD", "G", "S", "MINL", "LMAX", "PREFETCH", "RG"], block="32*G*RG", shared_mem="4*LMAX*HD",
    reference=_attn_ref, limits=_attn_limits, validate=_attn_check)


def attn_reference(q, k, v, pos: int) -> np.ndarray:
    """Float64 attention of every query head over entries 0..pos (NaN for pos outside the cache)."""
    hkv, cap, hd = k.shape
    if not 0 <= pos < cap:
        return np.full(q.shape, np.nan)
    g = q.shape[0] // (hkv * hd)
    qh = q.astype(np.float64).reshape(hkv * g, hd)
    kh = np.repeat(k[:, : pos + 1].astype(np.float64), g, axis=0)
    vh = np.repeat(v[:, : pos + 1].astype(np.float64), g, axis=0)
    s = np.einsum("hd,htd->ht", qh, kh) / math.sqrt(hd)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (np.einsum("ht,htd->hd", p / p.sum(axis=1, keepdims=True), vh)).reshape(-1)


# -- sample ------------------------------------------------------------------------------------------

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox-4x32-10 (Random123), vectorised: counter [..., 4] and key [2] uint32 -> [..., 4] uint32."""
    c = [np.asarray(counter, np.uint64)[..., i].copy() for i in range(4)]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for _ in range(10):
        p0, p1 = np.uint64(_M0) * c[0], np.uint64(_M1) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & _MASK, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _MASK]
        k0, k1 = (k0 + np.uint64(_W0)) & _MASK, (k1 + np.uint64(_W1)) & _MASK
    return np.stack(c, axis=-1).astype(np.uint32)


def gumbel_noise(indices, step: int, seed: int) -> np.ndarray:
    """The kernel's Gumbel noise of tokens ``indices`` at draw ``step`` for ``seed`` (float64)."""
    idx = np.asarray(indices, np.uint64)
    ctr = np.zeros(idx.shape + (4,), np.uint64)
    ctr[..., 0], ctr[..., 1] = idx, np.uint64(step & 0xFFFFFFFF)
    r = philox4x32_10(ctr, (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))[..., 0].astype(np.uint64)
    u = (2 * (r >> np.uint64(9)) + 1).astype(np.float64) * 2.0 ** -24
    return -np.log(-np.log(u))


def sample_reference(logits, temperature: float, top_k: int, top_p: float, seed: int, step: int) -> int:
    """The token the sample kernel draws, computed in float64 (see kernels/llama_sample.cu)."""
    x = np.asarray(logits, np.float32).astype(np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    V = x.shape[0]
    if not temperature > 0 or top_k == 1:
        return int(np.argmax(x))
    keep = np.ones(V, bool)
    if 0 < top_k < V:
        keep = x >= np.sort(x)[::-1][top_k - 1]
    if top_p < 1:
        mass = np.exp((x - x.max()) / temperature)
        vals = np.sort(x[keep])[::-1]
        cum = np.cumsum(np.exp((vals - x.max()) / temperature))
        j = min(int(np.searchsorted(cum, max(top_p * mass[keep].sum(), 0.0), side="left")), len(vals) - 1)
        keep &= x >= vals[j]
    score = np.where(keep, x / temperature + gumbel_noise(np.arange(V), step, seed), -np.inf)
    return int(np.argmax(score))


def sample_distribution(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The probabilities the sampler draws from (float64): softmax(x/T) over the kept tokens."""
    x = np.asarray(logits, np.float32).astype(np.float64)
    V = x.shape[0]
    keep = np.ones(V, bool)
    if 0 < top_k < V:
        keep = x >= np.sort(x)[::-1][top_k - 1]
    w = np.where(keep, np.exp((x - x.max()) / temperature), 0.0)
    if top_p < 1:
        vals = np.sort(x[keep])[::-1]
        cum = np.cumsum(np.exp((vals - x.max()) / temperature))
        j = min(int(np.searchsorted(cum, max(top_p * w.sum(), 0.0), side="left")), len(vals) - 1)
        w = np.where(x >= vals[j], w, 0.0)
    return w / w.sum()


def sample_rows(vocab: int) -> int:
    """CTAs (rows of ``part``) for a vocabulary: the fewest that leave each at most 1024 logits
    (126 for 128256: 32 candidates each fit the finishing CTA's 4096)."""
    return max(1, -(-vocab // 1024))


MAX_VOCAB = 1024 * 1024  # sample: at most 1024 CTAs of 1024 logits


def sample_candidates(vocab: int, most: int = 32) -> int:
    """Candidates a CTA keeps for a vocabulary: ``most`` (32), halved while the CTAs' candidates
    would pass the finishing CTA's 4096 (16 from 131073 logits on, 4 at MAX_VOCAB)."""
    _need(1 <= vocab <= MAX_VOCAB, f"sample: a vocabulary of {vocab} is not served (1 to {MAX_VOCAB}: at most 1024 "
                                   "CTAs of 1024 logits)")
    rows, c = sample_rows(vocab), most
    while rows * c > 4096 and c > 1:
        c //= 2
    return c


def sample_buffers(vocab: int, candidates: int = 32, *, stream=None):
    """``(part, token, state)`` for sample<candidates>: part is [sample_rows(vocab), 2C+4] scratch
    (partition it with [1, 2C+4]); state starts at zero and the kernel leaves it at zero."""
    part = dop.empty([sample_rows(vocab), 2 * candidates + 4], stream=stream)
    token = dop.from_numpy(np.zeros(1, np.int32), stream=stream)
    state = dop.from_numpy(np.zeros(1, np.int32), stream=stream)
    return part, token, state


def _sample_ref(g, part, logits, token, state, step, vocab, temperature, top_k, top_p, seed):
    token[0] = sample_reference(logits, temperature, top_k, top_p, seed, int(step[0]))


def _sample_check(g, part, logits, token, state, step, vocab, temperature, top_k, top_p, seed):
    C = g["C"]
    name = f"sample<C={C}>"
    B = part.tensor.shape[0]
    _need(-(-vocab // B) <= 1024, f"{name}: {B} CTAs leave {-(-vocab // B)} logits to one; at most 1024: "
                                  f"part needs at least {-(-vocab // 1024)} rows (sample_rows(vocab))")
    _need(B * C <= 4096 and B <= 1024,
          f"{name}: {B} rows * C={C} candidates = {B * C} > 4096 (the finishing CTA's shared memory); "
          f"lower C or use fewer rows")
    # token and state are InOut: the launch refuses their overlaps with each other and the reads
    if not (math.isfinite(temperature) and temperature >= 0):
        raise dop.LaunchError(f"{name}: temperature={temperature} must be finite and >= 0 (0 = greedy)")
    if top_k < 0:
        raise dop.LaunchError(f"{name}: top_k={top_k} must be >= 0 (0 = off)")
    if not 0 <= top_p <= 1:
        raise dop.LaunchError(f"{name}: top_p={top_p} must be in [0, 1] (1 = off)")


def _sample_limits(g):
    C = g["C"]
    _need(1 <= C <= 1024, f"sample<C={C}>: C={C} candidates per CTA must be in [1, 1024]")


sample = Kernel(  # part: B rows of 2C+4, one a CTA (sample_buffers(vocab, C) makes it)
    "sample", HERE / "llama_sample.cu",
    [Out("part", "float32", shape=("B", "2*C+4"), tile=(1, "2*C+4")), In("logits", "float32", shape=("vocab",)),
     InOut("token", "int32", shape=(1,)), InOut("state", "int32", shape=(1,)), In("step", "int32", shape=(1,)),
     Scalar("vocab", "int32"), Scalar("temperature", "float32"), Scalar("top_k", "int32"),
     Scalar("top_p", "float32"), Scalar("seed", "uint64")],
    generics=["C"], block=1024, reference=_sample_ref, limits=_sample_limits, validate=_sample_check)

__all__ = ["attn_decode", "attn_plan", "attn_buffers", "attn_ws_size", "attn_chunks", "attn_reference",
           "sample", "sample_buffers", "sample_rows", "sample_candidates", "MAX_VOCAB", "check_heads",
           "check_capacity", "attn_smem", "sample_reference", "sample_distribution",
           "philox4x32_10", "gumbel_noise"]
