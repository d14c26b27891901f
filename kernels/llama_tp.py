"""The greedy choice across vocabulary shards of tensor-parallel Llama decode (kernels/llama_tp.cu).

* ``tp_argmax_key(key uint64 [1] tile [1], logits fp32 [Vp], token int32 [1], offset)``: this rank's
  pick (the local argmax ``token``, from rms_lm_head_argmax) as one 64-bit key of its logit and its
  global index ``offset + token``;
* ``tp_argmax_pick(token int32 [1] tile [1], keys uint64 [N], n)``: the global token of the largest
  of the ranks' keys (gathered with an all-gather of 8 bytes a rank).

The key orders as rms_lm_head_argmax orders (:func:`argmax_key`): the largest logit, NaN counting
as largest, the lowest index on ties; so the token is the one TP=1 picks from the same logits.
"""
from pathlib import Path

import numpy as np

from deviceop.kernel import In, Kernel, Out, Scalar

from ._checks import _need

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "llama_tp.cu"


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


def _key_ref(g, key, logits, token, offset):
    t = int(token[0])
    key[0] = argmax_key(logits[t], offset + t)


def _key_check(g, key, logits, token, offset):
    _need(key.tile_shape == (1,) and key.tensor.shape == (1,), "tp_argmax_key runs one thread: key must be a "
                                                               "uint64 [1] partitioned with [1]")
    _need(token.shape == (1,), f"tp_argmax_key: token {token.shape} must be this rank's int32 [1] argmax")
    _need(offset >= 0, f"tp_argmax_key: offset={offset} (the shard's first global row) must be >= 0")


def _pick_ref(g, token, keys, n):
    best = int(np.max(keys[:n]))
    token[0] = 0xFFFFFFFF - (best & 0xFFFFFFFF)


def _pick_check(g, token, keys, n):
    _need(token.tile_shape == (1,) and token.tensor.shape == (1,), "tp_argmax_pick runs one thread: token must be "
                                                                   "an int32 [1] partitioned with [1]")
    _need(1 <= n <= keys.shape[0], f"tp_argmax_pick: n={n} ranks but keys holds {keys.shape[0]}; pass the "
                                   "world size")


tp_argmax_key = Kernel(
    "tp_argmax_key", SOURCE,
    [Out("key", "uint64", rank=1), In("logits", "float32", rank=1), In("token", "int32", rank=1),
     Scalar("offset", "int32")],
    block=1, reference=_key_ref, validate=_key_check)

tp_argmax_pick = Kernel(
    "tp_argmax_pick", SOURCE,
    [Out("token", "int32", rank=1), In("keys", "uint64", rank=1), Scalar("n", "int32")],
    block=1, reference=_pick_ref, validate=_pick_check)

__all__ = ["tp_argmax_key", "tp_argmax_pick", "argmax_key"]
