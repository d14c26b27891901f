"""A Llama-family decoder's shape, read from a Hugging Face ``config.json``.

Only the fields the decode kernels depend on are kept.  Every field is checked
for type and range when a config is made (``LlamaConfig(...)``, ``from_dict``,
``from_json``), naming the field: a config that is not a Llama decoder never
gets as far as a weight.  What the kernels cannot serve is a separate, named
check (``kernel_limits``), run before a byte is allocated.
"""
from __future__ import annotations

import json
import math
import numbers
import os
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
INT32_MAX = 2 ** 31 - 1  # sizes and token ids live in int32 on the device
ROPE_TYPES = ("default", "llama3")
MAX_CHECKED_HEAD_DIM = 1 << 16  # RoPE tables checked finite up to this head_dim
MODEL_TYPES = ("llama", "mistral")  # Hugging Face model types whose decoder is this one (Mistral: without a window)
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def as_path(path, what: str) -> Path:
    """``path`` (a str or os.PathLike) as a Path, or a DTypeError naming ``what`` it should be
    (None or a number failed as pathlib's raw TypeError)."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise dop.DTypeError(f"{what} is a path (a str or pathlib.Path), not {type(path).__name__}: pass "
                             f"the {what}'s location")
    return Path(path)


def _bad(message: str):
    raise dop.ShapeError(f"Llama config: {message}")


def _integer(name: str, v, low: int = 1, high: int = INT32_MAX) -> int:
    """``v`` as an int in [low, high], or a ShapeError naming ``name`` (a bool or a float is no count)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        _bad(f"{name}={v!r} must be an integer in [{low}, {high}], not {type(v).__name__}")
    if not low <= int(v) <= high:
        _bad(f"{name}={int(v)} is outside [{low}, {high}]")
    return int(v)


def _positive_real(name: str, v) -> float:
    """``v`` as a float > 0 that stays finite and positive in float32 (the kernels' and
    Hugging Face's RoPE arithmetic), or a ShapeError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        _bad(f"{name}={v!r} must be a finite positive number, not {type(v).__name__}")
    with np.errstate(over="ignore", under="ignore"):
        as_float32 = np.float32(v)
    if not (math.isfinite(float(v)) and float(v) > 0 and np.isfinite(as_float32) and as_float32 > 0):
        _bad(f"{name}={float(v)} must be a finite positive number (in float32 too)")
    return float(v)


def _token_ids(name: str, v, vocab: int) -> tuple:
    """None, an id or a list of ids, each in [0, vocab), as a tuple."""
    ids = () if v is None else tuple(v) if isinstance(v, (list, tuple)) else (v,)
    return tuple(_integer(name, i, 0, vocab - 1) for i in ids)


def _rope_scaling(v) -> dict | None:
    """None or a default / llama3 ``rope_scaling`` dict whose llama3 fields are finite, in order."""
    if v is None:
        return None
    if not isinstance(v, dict):
        _bad(f"rope_scaling={v!r} must be a dict (or null), not {type(v).__name__}")
    kind = v.get("rope_type", v.get("type", "default"))
    if kind not in ROPE_TYPES:
        _bad(f"rope_scaling type {kind!r} is not supported (default or llama3)")
    # keys in one order and plain numbers: equal scalings compare equal (tensor-parallel ranks compare configs)
    out = dict(sorted(v.items(), key=lambda item: str(item[0])))
    if kind == "llama3":
        missing = [k for k in LLAMA3_KEYS if k not in v]
        if missing:
            _bad(f"rope_scaling of type llama3 lacks {', '.join(missing)}")
        for k in LLAMA3_KEYS[:3]:
            out[k] = _positive_real(f"rope_scaling.{k}", v[k])
        out["original_max_position_embeddings"] = _integer("rope_scaling.original_max_position_embeddings",
                                                           v["original_max_position_embeddings"])
        if not out["high_freq_factor"] > out["low_freq_factor"]:
            _bad(f"rope_scaling.high_freq_factor={v['high_freq_factor']} must exceed low_freq_factor="
                 f"{v['low_freq_factor']} (llama3 RoPE interpolates between them)")
    return out


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

    def __post_init__(self):
        """Type and range of every field, naming it: cheap, whatever the sizes (no weight is named here)."""
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "head_dim"):
            # as ints: a NumPy integer's repr differs, and tensor-parallel ranks compare configs by value
            object.__setattr__(self, name, _integer(name, getattr(self, name)))
        if self.num_attention_heads % self.num_key_value_heads:
            _bad(f"{self.num_attention_heads} query heads are not a multiple of {self.num_key_value_heads} KV "
                 "heads (num_attention_heads, num_key_value_heads)")
        if self.head_dim % 2:
            _bad(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if not isinstance(self.tie_word_embeddings, bool):
            _bad(f"tie_word_embeddings={self.tie_word_embeddings!r} must be true or false")
        bos = self.bos_token_id
        normalized = {"rms_norm_eps": _positive_real("rms_norm_eps", self.rms_norm_eps),
                      "rope_theta": _positive_real("rope_theta", self.rope_theta),
                      "rope_scaling": _rope_scaling(self.rope_scaling),
                      "bos_token_id": None if bos is None else _integer("bos_token_id", bos, 0, self.vocab_size - 1),
                      "eos_token_id": _token_ids("eos_token_id", self.eos_token_id, self.vocab_size)}
        for name, value in normalized.items():
            object.__setattr__(self, name, value)
        if self.head_dim <= MAX_CHECKED_HEAD_DIM:  # larger ones no kernel serves: not worth the table
            with np.errstate(all="ignore"):
                inv = self.inv_freq()
            if not np.all(np.isfinite(inv) & (inv > 0)):
                _bad(f"rope_theta={self.rope_theta} with rope_scaling={self.rope_scaling} gives RoPE frequencies "
                     "that are not finite and positive in float32")

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, *, kernels: bool = True) -> "LlamaConfig":
        """From the fields of a Hugging Face ``LlamaConfig`` (``config.json``, transformers 4's
        ``rope_theta``/``rope_scaling`` or 5's ``rope_parameters``).  ``kernels``: also refuse
        what the kernels cannot serve (``kernel_limits``); False for a config only read (the
        NumPy decoder, Hugging Face)."""
        if not isinstance(kernels, bool):  # "no" would be truthy: the kernels' limits silently applied
            raise dop.DTypeError(f"LlamaConfig.from_dict(kernels={kernels!r}): pass True (refuse what the kernels "
                                 "cannot serve) or False (a config only read)")
        if not isinstance(d, dict):
            _bad(f"a config is a JSON object of fields, got {type(d).__name__}")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if k not in d]
        if missing:
            _bad(f"config is missing {', '.join(missing)}: pass a Llama-family config.json")
        heads, hidden = _integer("num_attention_heads", d["num_attention_heads"]), _integer("hidden_size",
                                                                                             d["hidden_size"])
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                _bad(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}: give head_dim")
            head_dim = hidden // heads
        theta, scaling = d.get("rope_theta", 10000.0), d.get("rope_scaling")
        params = d.get("rope_parameters")
        if params is not None:
            if not isinstance(params, dict):
                _bad(f"rope_parameters={params!r} must be a dict")
            theta = params.get("rope_theta", theta)
            kind = params.get("rope_type", params.get("type", "default"))
            scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
        kind = d.get("model_type", "llama")
        if kind not in MODEL_TYPES:
            _bad(f"model_type={kind!r}: this decoder reads Llama-family configs ({', '.join(MODEL_TYPES)}); "
                 f"{kind!r} differs in what the kernels compute (biases, norms, attention)")
        if d.get("sliding_window") is not None:
            _bad(f"sliding_window={d['sliding_window']!r}: the kernels attend to the whole cache (give null, as "
                 "a Llama config has)")
        if d.get("hidden_act", "silu") != "silu":
            _bad(f"hidden_act={d['hidden_act']!r}: the kernels compute SiLU (silu)")
        for name in ("attention_bias", "mlp_bias"):
            if d.get(name, False) is not False:
                _bad(f"{name}={d[name]!r}: the kernels add no biases (a Llama decoder has none)")
        kv = d.get("num_key_value_heads")
        cfg = cls(hidden_size=hidden, intermediate_size=d["intermediate_size"],
                  num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
                  num_key_value_heads=heads if kv is None else kv, vocab_size=d["vocab_size"], head_dim=head_dim,
                  rms_norm_eps=d.get("rms_norm_eps", 1e-6),  # Hugging Face's default
                  rope_theta=theta, rope_scaling=scaling,
                  tie_word_embeddings=d.get("tie_word_embeddings", False),
                  bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"))
        if kernels:
            kernel_limits(cfg)
        return cfg

    @classmethod
    def from_json(cls, path, *, kernels: bool = True) -> "LlamaConfig":
        path = as_path(path, "config.json")
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except OSError as exc:
            raise dop.StateError(f"cannot read the config {path}: {exc.strerror}; pass a config.json "
                                 "or the directory holding one") from None
        except ValueError as exc:  # JSONDecodeError, and bytes that are not UTF-8
            raise dop.StateError(f"the config {path} is not valid JSON ({exc}); pass a Hugging Face "
                                 "config.json") from None
        return cls.from_dict(d, kernels=kernels)

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

    def check(self) -> None:
        """Refuse what the decode kernels cannot serve, naming the limit (the fields themselves
        were checked when the config was made)."""
        kernel_limits(self)

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


def kernel_limits(cfg: LlamaConfig) -> None:
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
