"""The greedy choice across vocabulary shards of tensor-parallel Llama decode (kernels/llama_tp.cu).

* ``tp_argmax_pair(pairs fp32 [n_pairs] tile [n_pairs], logits fp32 [Vp], token int32 [1], n_pairs, rank, offset)``:
  ``pairs`` zero but for this rank's pick: ``pairs[2 rank] = logits[token]`` (``token``: its local
  argmax, from rms_lm_head_argmax) and ``pairs[2 rank + 1] = offset + token``, its global index;
* an all-reduce *sum* of ``pairs`` over the ranks (adding zeros is exact in any order: the sum is
  every rank's pair, and a small-message all-reduce carries it);
* ``tp_argmax_pick(token int32 [1] tile [1], pairs fp32 [P], n)``: the global index of the largest
  of the ``n`` pairs, ordered by :func:`argmax_key` as rms_lm_head_argmax orders (the largest
  logit, NaN counting as largest, the lowest index on ties): the token TP=1 picks.
* ``tp_place<B>(out fp32 [Vp] tile [B], src fp32 [n], offset, n)``: a rank's logits at their global
  rows of a zero vector; an all-reduce sum of those is the whole vocabulary's logits (for sampling
  and teacher forcing), again exact.
* ``matvec_allreduce<K,NR,CH,W,RPC,KS,NB,WORLD>(out fp32 [N] tile [RPC], x fp32 [K], w bf16 [N, K],
  residual fp32 [N], peers uint64 [WORLD], state uint32, rank, slot_lines, line0, epoch0, timeout_ns)``:
  ``out = residual + sum over the ranks of w_r @ x_r``, the O and down projections of a layer with
  the all-reduce of their partial sums in the epilogue (each CTA exchanges its rows with the same
  CTA of the peers through a private ``dist.PeerBuffers``, in the one-shot all-reduce's protocol).
"""
from pathlib import Path

import numpy as np

from deviceop.distributed.oneshot import MAX_WORLD, check_buffers, claim_lines, exchange
from deviceop.kernel import In, InOut, Kernel, Out, Scalar

from ._checks import _aligned, _need
from ._refmath import matvec64
from .llama_proj import H100_SMS, _fp32_semantics, _grid, _stream_checks, matvec_residual_plan, x_shared

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "llama_tp.cu"
PAIRS = 128          # floats of the pairs vector: 512 bytes (the one-shot all-reduce's unit), 64 ranks
MAX_INDEX = 1 << 24  # a global index travels as a float32: exact below 2^24


def argmax_key(value: float, index: int) -> int:
    """llama::argmax_key: the float's order-preserving bits (NaN largest, -0 as +0) above the
    complement of the index (a lower index wins a tie)."""
    v = np.float32(value)
    if np.isnan(v):
        u = 0xFFFFFFFF
    else:
        u = 0 if v == 0 else int(np.array(v, np.float32).view(np.uint32))
        u = (~u & 0xFFFFFFFF) if u & 0x80000000 else (u | 0x80000000)
    return (u << 32) | (0xFFFFFFFF - int(index))


def _pair_ref(g, pairs, logits, token, n_pairs, rank, offset):
    t = int(token[0])
    pairs[...] = 0
    pairs[2 * rank], pairs[2 * rank + 1] = logits[t], np.float32(offset + t)


def _pair_check(g, pairs, logits, token, n_pairs, rank, offset):
    # the shapes say pairs is [n_pairs] partitioned whole (one CTA) and token an int32 [1]
    _need(0 <= rank and 2 * rank + 1 < n_pairs, f"tp_argmax_pair: rank {rank} has no pair in {n_pairs} floats")
    _need(0 <= offset and offset + logits.shape[0] <= MAX_INDEX,
          f"tp_argmax_pair: global indices up to {offset + logits.shape[0]} do not all fit a float32 exactly "
          f"(vocabularies below {MAX_INDEX} do)")


def _pick_ref(g, token, pairs, n):
    keys = [argmax_key(pairs[2 * r], int(pairs[2 * r + 1])) for r in range(n)]
    token[0] = 0xFFFFFFFF - (max(keys) & 0xFFFFFFFF)


def _pick_check(g, token, pairs, n):  # the shapes say token is an int32 [1] partitioned with [1] (one thread)
    _need(1 <= n and 2 * n <= pairs.shape[0], f"tp_argmax_pick: n={n} ranks but pairs holds {pairs.shape[0]} "
                                              "floats (two a rank); pass the world size")


tp_argmax_pair = Kernel(
    "tp_argmax_pair", SOURCE,
    [Out("pairs", "float32", shape=("n_pairs",), tile=("n_pairs",)), In("logits", "float32", rank=1),
     In("token", "int32", shape=(1,)), Scalar("n_pairs", "int32"), Scalar("rank", "int32"), Scalar("offset", "int32")],
    block=128, reference=_pair_ref, validate=_pair_check)

tp_argmax_pick = Kernel(
    "tp_argmax_pick", SOURCE,
    [Out("token", "int32", shape=(1,), tile=(1,)), In("pairs", "float32", rank=1), Scalar("n", "int32")],
    block=1, reference=_pick_ref, validate=_pick_check)

def _place_ref(g, out, src, offset, n):
    out[...] = 0
    lo, hi = max(0, offset), min(out.shape[0], offset + n)
    if hi > lo:
        out[lo:hi] = src[lo - offset:hi - offset]


def _place_limits(g):
    B = g["B"]
    _need(B % 128 == 0 and 128 <= B <= 4096, f"tp_place: B={B} must be a multiple of 128 in [128, 4096] "
                                             "(4 elements a thread)")


def _place_check(g, out, src, offset, n):  # the shapes say out's tile is [B] and src is [n]
    _need(0 <= offset and offset + n <= out.tensor.shape[0],
          f"tp_place: rows [{offset}, {offset + n}) of src {src.shape} must lie in out {out.tensor.shape}")


tp_place = Kernel(  # B is out's tile: a launch may leave out .generics()
    "tp_place", SOURCE,
    [Out("out", "float32", shape=(-1,), tile=("B",)), In("src", "float32", shape=("n",)), Scalar("offset", "int32"),
     Scalar("n", "int32")],
    generics=["B"], block=lambda g: g["B"] // 4, reference=_place_ref, limits=_place_limits, validate=_place_check)

PLACE_TILE = 1024  # tp_place's tile: a gathered vocabulary vector is padded to a multiple of it


def placed_rows(vocab: int) -> int:
    """The length of the gathered-logits vector for ``vocab`` (a multiple of PLACE_TILE floats,
    hence of the one-shot all-reduce's 512 bytes)."""
    return -(-vocab // PLACE_TILE) * PLACE_TILE



# -- matvec_allreduce -------------------------------------------------------------------

@_fp32_semantics
def _matvec_allreduce_ref(g, out, x, w, residual, peers, state, rank, slot_lines, line0, epoch0, timeout_ns):
    partial = matvec64(w, x).astype(np.float32)
    exchange(out, partial, residual, peers, state, rank, slot_lines, timeout_ns, group_lines=g["RPC"] // 2,
             line0=line0, epoch0=epoch0)


def _matvec_allreduce_limits(g):
    K, NR, CH, W, RPC, KS, NB, WORLD = (g[n] for n in ("K", "NR", "CH", "W", "RPC", "KS", "NB", "WORLD"))
    _need(1 <= NR <= 32 and RPC % NR == 0 and RPC % 2 == 0,
          f"matvec_allreduce: RPC={RPC} must be even and a multiple of NR={NR} (NR in [1, 32]): rows travel in pairs")
    _need(RPC // 2 <= 32 * W, f"matvec_allreduce: RPC={RPC} rows are {RPC // 2} lines, more than the {32 * W} threads")
    _need(1 <= WORLD <= MAX_WORLD, f"matvec_allreduce: WORLD={WORLD} ranks, at most {MAX_WORLD}")
    _stream_checks("matvec_allreduce", K, CH, NR, W, 4 * KS * RPC + 4, NB, KS)


def _matvec_allreduce_check(g, out, x, w, residual, peers, state, rank, slot_lines, line0, epoch0, timeout_ns):
    _aligned(x, w, who="matvec_allreduce uses")
    for name, t in (("residual", residual), ("out", out.tensor)):  # a thread's two rows: one float2 load / store
        _need(t.data_ptr % 8 == 0, f"matvec_allreduce moves rows in pairs (8-byte loads and stores): {name} must "
                                   "start 8-byte aligned; pass a view an even number of floats in, or a fresh tensor")
    grid, rpc = out.tensor.shape[0] // g["RPC"], g["RPC"]
    resident = min(MAX_RESIDENT, getattr(out.tensor.device, "sm_count", 0) or MAX_RESIDENT)  # reference: 0 SMs
    _need(grid <= resident, f"matvec_allreduce: {grid} CTAs, but every CTA waits for its peers' and all must be "
                            f"resident at once: at most {resident} here (one a SM); give fewer, longer tiles")
    _need(0 <= rank < g["WORLD"], f"matvec_allreduce: rank {rank} is not in 0..{g['WORLD'] - 1}")
    _need(line0 + grid * rpc // 2 <= slot_lines, f"matvec_allreduce: lines [{line0}, {line0 + grid * rpc // 2}) do "
                                                 f"not fit slots of {slot_lines} lines; make larger PeerBuffers")
    _need(1 <= epoch0 and epoch0 + grid <= state.shape[0], f"matvec_allreduce: epochs [{epoch0}, {epoch0 + grid}) "
                                                           f"are past the state's {state.shape[0]} words")
    check_buffers(peers, state, rank, slot_lines, g["WORLD"], "matvec_allreduce")
    claim_lines(state, epoch0, grid, line0, rpc // 2, "matvec_allreduce")


MAX_RESIDENT = H100_SMS  # CTAs of up to 16 warps, one a SM: what an H100 or H200 keeps resident at once

matvec_allreduce = Kernel(
    "matvec_allreduce", SOURCE,
    [Out("out", "float32", shape=("N",), tile=("RPC",)), In("x", "float32", shape=("K",)),
     In("w", "bfloat16", shape=("N", "K")), In("residual", "float32", shape=("N",)),
     In("peers", "uint64", shape=("WORLD",)), InOut("state", "uint32", shape=(-1,)), Scalar("rank", "int32"),
     Scalar("slot_lines", "uint32"), Scalar("line0", "uint32"), Scalar("epoch0", "uint32"),
     Scalar("timeout_ns", "uint64")],
    generics=["K", "NR", "CH", "W", "RPC", "KS", "NB", "WORLD"], block="32*W", shared_mem=lambda g: x_shared(g["K"]),
    reference=_matvec_allreduce_ref, limits=_matvec_allreduce_limits, validate=_matvec_allreduce_check)


def matvec_allreduce_plan(n: int, k: int, world: int, *, sms: int = H100_SMS, tuned: bool = True) -> tuple[int, list]:
    """(tile, generics) of matvec_allreduce: matvec_residual's plan for this shape where every
    CTA of it can be resident at once and its rows travel in pairs a thread (llama_tuned.TUNED's
    choice may not), else its rules' (the CTA count dividing N nearest one a SM), the row tile
    made even."""
    rpc, gen = matvec_residual_plan(n, k, sms=sms, tuned=tuned)
    if n // rpc > min(sms, MAX_RESIDENT) or rpc % 2 or rpc // 2 > 32 * gen[3]:
        rpc, gen = matvec_residual_plan(n, k, sms=sms, tuned=False)
    if rpc % 2:  # rows travel in pairs: whole pairs of NR-row groups a CTA
        rpc, gen = matvec_residual_plan(n, k, sms=sms, ctas=_grid(n, sms, 2 * gen[1]), tuned=False)
    return rpc, gen + [world]


__all__ = ["tp_argmax_pair", "tp_argmax_pick", "tp_place", "matvec_allreduce", "matvec_allreduce_plan", "argmax_key",
           "placed_rows", "PAIRS", "PLACE_TILE", "MAX_RESIDENT"]
