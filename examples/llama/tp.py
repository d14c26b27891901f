"""Tensor parallelism for Llama decode: how a rank's share of the model is cut (Megatron).

Rank r of N holds, of every layer, the query heads [r*Hq/N, (r+1)*Hq/N) and the KV heads
[r*Hkv/N, ...) (the rows of q_proj, k_proj, v_proj and its KV cache), the same columns of
o_proj, the rows [r*I/N, ...) of gate_proj and up_proj and those columns of down_proj, and
the vocabulary rows [r*V/N, ...) of the LM head.  Norms and the embedding are whole on every
rank.  A layer then needs two all-reduces of the hidden vector: after the O projection and
after the down projection, each rank having computed its partial sum (rank 0 adds the
residual, the others a zero vector).  The head's argmax is each rank's (logit, global index)
key, all-gathered (8 bytes a rank) and reduced with TP=1's tie rule (kernels/llama_tp.cu).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

import deviceop as dop

from .config import VECTOR, LlamaConfig


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``'s share of ``cfg``: local sizes and where its rows start."""
    cfg: LlamaConfig
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        check_tp(self.cfg, self.size)
        object.__setattr__(self, "size", operator.index(self.size))  # NumPy's integers as ints: rows() are ints
        rank = _index(self.rank)  # (a float rank cut float rows, which failed later as a raw TypeError)
        if rank is None or not 0 <= rank < self.size:
            raise dop.ShapeError(f"rank {self.rank!r} is outside a tensor-parallel group of {self.size}: pass an int "
                                 f"in 0..{self.size - 1} (group.rank)")
        object.__setattr__(self, "rank", rank)

    @property
    def heads(self) -> int:
        return self.cfg.num_attention_heads // self.size

    @property
    def kv_heads(self) -> int:
        return self.cfg.num_key_value_heads // self.size

    @property
    def q_size(self) -> int:
        return self.heads * self.cfg.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.cfg.head_dim

    @property
    def inter(self) -> int:
        return self.cfg.intermediate_size // self.size

    @property
    def vocab(self) -> int:
        return self.cfg.vocab_size // self.size

    @property
    def vocab_offset(self) -> int:
        return self.rank * self.vocab

    def rows(self, n: int) -> tuple[int, int]:
        """This rank's block of ``n`` rows (or columns) cut in ``size`` equal blocks."""
        b = n // self.size
        return self.rank * b, (self.rank + 1) * b


def _index(v) -> int | None:
    """``v`` as an int (NumPy's integers too), or None for a bool or anything else."""
    try:
        return None if isinstance(v, bool) else operator.index(v)
    except TypeError:
        return None


def check_tp(cfg: LlamaConfig, size: int) -> None:
    """Refuse a split the decode kernels cannot serve at the shard's shapes, naming the limit."""
    n = _index(size)  # NumPy's integers too, never a bool
    if n is None or n < 1:
        raise dop.ShapeError(f"tp={size!r}: the tensor-parallel size is a positive int (the number of GPUs)")
    size = n
    if size == 1:
        return

    def need(ok, message):
        if not ok:
            raise dop.ShapeError(f"tensor parallelism over {size} GPUs: {message}; use a tp that divides it")
    need(cfg.num_key_value_heads % size == 0, f"the {cfg.num_key_value_heads} KV heads do not split evenly")
    need(cfg.vocab_size % size == 0, f"the vocabulary of {cfg.vocab_size} does not split evenly")
    unit = 32 * VECTOR  # a warp of 16-byte bf16 loads: the row length every projection streams
    for what, n in (("intermediate size", cfg.intermediate_size), ("attention width (heads x head_dim)",
                                                                     cfg.q_size)):
        need(n % (size * unit) == 0, f"the {what} {n} must split into multiples of {unit} (the O and down "
                                     f"projections stream rows of that many), {n // size} is not")


def _slice(w, rows=None, cols=None):
    """The block ``w[rows, cols]`` (``None``: all) as a compact array: a host array stays a NumPy
    array (copied to the device later), a device tensor (torch, CuPy) becomes its own copy, so
    that the whole matrix can be freed once every shard is taken."""
    if rows is None and cols is None:
        return w
    index = (slice(*rows) if rows else slice(None), slice(*cols) if cols else slice(None))
    if isinstance(w, np.ndarray):
        return np.ascontiguousarray(w[index])
    part = w[index]
    if hasattr(part, "is_contiguous"):  # torch: a column block is copied by contiguous(), a row block is a view
        return part.clone() if part.is_contiguous() else part.contiguous()
    if hasattr(part, "copy"):   # CuPy
        return part.copy(order="C")
    raise dop.DTypeError(f"a weight of type {type(w).__name__} cannot be cut for tensor parallelism: pass NumPy "
                         "arrays or torch/CuPy tensors")


def shard_weights(cfg: LlamaConfig, weights: dict, shard: Shard, layer_names) -> dict:
    """Short name -> this rank's block of each weight, q/k/v and gate/up still separate:
    ``{"embed", "final_norm", "head", "layers": [{"input_norm", "post_norm", "q", "k", "v", "o",
    "gate", "up", "down"}, ...]}``.  At size 1 every entry is the given weight itself."""
    hd = cfg.head_dim
    q_rows = tuple(hd * h for h in shard.rows(cfg.num_attention_heads))
    kv_rows = tuple(hd * h for h in shard.rows(cfg.num_key_value_heads))
    i_rows = shard.rows(cfg.intermediate_size)
    v_rows = shard.rows(cfg.vocab_size) if shard.size > 1 else None
    whole = shard.size == 1
    embed = weights["model.embed_tokens.weight"]
    head = embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
    out = {"embed": embed, "final_norm": weights["model.norm.weight"], "head": _slice(head, v_rows), "layers": []}
    for i in range(cfg.num_hidden_layers):
        n = layer_names(i)
        w = {k: weights[n[k]] for k in ("input_norm", "post_norm")}
        if whole:
            w.update({k: weights[n[k]] for k in ("q", "k", "v", "o", "gate", "up", "down")})
        else:
            w.update(q=_slice(weights[n["q"]], q_rows), k=_slice(weights[n["k"]], kv_rows),
                     v=_slice(weights[n["v"]], kv_rows), o=_slice(weights[n["o"]], cols=q_rows),
                     gate=_slice(weights[n["gate"]], i_rows), up=_slice(weights[n["up"]], i_rows),
                     down=_slice(weights[n["down"]], cols=i_rows))
        out["layers"].append(w)
    return out


def agree(group, what: str, value) -> None:
    """Every rank of ``group`` passes the same ``value`` (a small picklable summary of a
    request or a config), else each raises naming the ranks that differ: ranks that built
    different graphs would issue different collectives and wait for each other forever."""
    values = group.exchange(value)
    if any(v != values[0] for v in values):
        differ = [r for r, v in enumerate(values) if v != values[0]]
        raise dop.StateError(f"the ranks disagree on {what}: rank 0 has {values[0]!r}, rank(s) {differ} another; "
                             "every rank of a tensor-parallel model must build the same model and serve the same "
                             "requests")


# A shape small enough for the reference device that splits over 1, 2 and 4 ranks at the kernels'
# limits: 4 KV heads, and 1024-wide attention and MLP (the O and down projections of a rank of 4
# stream rows of 256).
TINY_TP = LlamaConfig(
    hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
    vocab_size=1000, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=(2,))
