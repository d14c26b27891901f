"""A Llama-family decoder's shape, read from a Hugging Face ``config.json``.

Only the fields the decode kernels depend on are kept; anything the kernels
cannot serve is refused here, before a byte is allocated, with the limit named.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import deviceop as dop
from deviceop.kernels import llama_attn as attn_k
from deviceop.kernels import llama_proj as proj

# What the decode kernels serve (kernels/llama_*.cu): head dims they are compiled
# for, and the width their 16-byte bf16 loads need.
HEAD_DIMS = attn_k.HEAD_DIMS
VECTOR = 8  # bf16 elements per 16-byte load: every row length must be a multiple


def check_kernel_limits(cfg: "LlamaConfig") -> None:
    """Every limit of the decode kernels, from the config's numbers alone (no weight read, no
    buffer made): attention's head dims and groups, the row widths of the 16-byte loads, each
    projection's plan and shared memory (kernels/llama_proj.py's check_decode_shapes) and the
    sampler's vocabulary.  A ShapeError names the field and the limit."""
    try:
        attn_k.check_heads(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
        for name in ("hidden_size", "intermediate_size"):
            v = getattr(cfg, name)
            if not v > 0 or v % VECTOR:
                raise dop.ShapeError(f"{name}={v} must be a positive multiple of {VECTOR} (rows are read in "
                                     "16-byte loads of 8 bf16)")
        proj.check_decode_shapes(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                                 cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)
        attn_k.sample_candidates(cfg.vocab_size)
    except dop.ShapeError as exc:
        raise dop.ShapeError(f"Llama config: {exc}") from None


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple = ()

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        """From the fields of a Hugging Face ``LlamaConfig`` (``config.json``)."""
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if k not in d]
        if missing:
            raise dop.ShapeError(f"config is missing {', '.join(missing)}: pass a Llama-family config.json")
        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        cfg = cls(hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
                  num_hidden_layers=int(d["num_hidden_layers"]), num_attention_heads=heads,
                  num_key_value_heads=int(d.get("num_key_value_heads") or heads), vocab_size=int(d["vocab_size"]),
                  head_dim=int(head_dim), rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                  rope_theta=float(d.get("rope_theta", 10000.0)), rope_scaling=d.get("rope_scaling"),
                  tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                  bos_token_id=d.get("bos_token_id"), eos_token_id=eos)
        cfg.check()
        return cfg

    @classmethod
    def from_json(cls, path) -> "LlamaConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except OSError as exc:
            raise dop.StateError(f"cannot read the config {path}: {exc.strerror}; pass a config.json "
                                 "or the directory holding one") from None

    def to_dict(self) -> dict:
        """The Hugging Face ``LlamaConfig`` fields (what ``from_dict`` reads)."""
        d = {"model_type": "llama", "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
             "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
             "num_key_value_heads": self.num_key_value_heads, "vocab_size": self.vocab_size,
             "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
             "rope_scaling": self.rope_scaling, "tie_word_embeddings": self.tie_word_embeddings,
             "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_id:
            d["eos_token_id"] = list(self.eos_token_id) if len(self.eos_token_id) > 1 else self.eos_token_id[0]
        return d

    # -- the shapes the kernels serve -----------------------------------------------
    def check(self) -> None:
        """Refuse what the decode kernels cannot serve, naming the limit."""
        def need(ok, message):
            if not ok:
                raise dop.ShapeError(f"Llama config: {message}")
        need(self.vocab_size > 0 and self.num_hidden_layers > 0, "vocab_size and num_hidden_layers must be positive")
        check_kernel_limits(self)
        need(self.rms_norm_eps > 0, f"rms_norm_eps={self.rms_norm_eps} must be positive")
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        need(kind in ("default", "llama3"), f"rope_scaling type {kind!r} is not supported (default or llama3)")

    @property
    def group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def weight_bytes(self) -> int:
        """bf16 bytes of every weight a token reads once (the tied head counted once, as the head)."""
        d, i = self.hidden_size, self.intermediate_size
        layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * i + 2 * d
        return 2 * (self.num_hidden_layers * layer + self.vocab_size * d + d)

    def kv_bytes(self, length: int) -> int:
        """bf16 bytes of K and V that attention reads at ``length`` cached entries, over every layer."""
        return 2 * 2 * self.num_hidden_layers * self.kv_size * length

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies ``[head_dim / 2]`` as float32, computed as Hugging Face
        computes them (float32 arithmetic), llama3 scaling included."""
        dim = self.head_dim
        inv = (1.0 / (np.float32(self.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
        inv = inv.astype(np.float32)
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) != "llama3":
            return inv
        factor = np.float32(scaling["factor"])
        low, high = np.float32(scaling["low_freq_factor"]), np.float32(scaling["high_freq_factor"])
        old = np.float32(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
        smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)


LLAMA_3_2_1B = LlamaConfig(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=(128001, 128008, 128009))

# A shape small enough for the reference device (seconds on a CPU), with every
# structural feature of the 1B model: GQA, llama3 RoPE, tied embeddings.
TINY = LlamaConfig(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    vocab_size=1000, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(LLAMA_3_2_1B.rope_scaling), tie_word_embeddings=True, bos_token_id=1, eos_token_id=(2,))

# Llama-3.1-8B's shape (meta-llama/Llama-3.1-8B's config.json): head_dim 128, an
# untied head, K = 14336 in the down projection.
LLAMA_3_1_8B = LlamaConfig(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=(128001, 128008, 128009))

# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M-Instruct): rows of 576 and 1536
# (multiples of 64, not of 256), 9 query heads in groups of 3, vocabulary 49152.
SMOLLM2_135M = LlamaConfig(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=(2,))
