"""Llama weights: Hugging Face names, random checkpoints, safetensors files, checks.

Weights are kept by their Hugging Face ``state_dict`` names, so a checkpoint
directory (``model.safetensors`` or sharded with ``model.safetensors.index.json``)
and a live ``LlamaForCausalLM.state_dict()`` load the same way.  Every
tensor's shape and dtype is checked against the config before anything is
copied to the device.
"""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

import deviceop as dop

from .config import LlamaConfig

BF16 = np.dtype(ml_dtypes.bfloat16)


def layer_names(i: int) -> dict:
    """Short name -> Hugging Face name of layer ``i``'s weights."""
    p = f"model.layers.{i}."
    return {"input_norm": p + "input_layernorm.weight", "post_norm": p + "post_attention_layernorm.weight",
            "q": p + "self_attn.q_proj.weight", "k": p + "self_attn.k_proj.weight",
            "v": p + "self_attn.v_proj.weight", "o": p + "self_attn.o_proj.weight",
            "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight", "down": p + "mlp.down_proj.weight"}


def expected_shapes(cfg: LlamaConfig) -> dict:
    """Every weight the model reads: Hugging Face name -> shape."""
    d, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    per_layer = {"input_norm": (d,), "post_norm": (d,), "q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q),
                 "gate": (i, d), "up": (i, d), "down": (d, i)}
    for layer in range(cfg.num_hidden_layers):
        shapes.update({name: per_layer[short] for short, name in layer_names(layer).items()})
    return shapes


def check_weights(cfg: LlamaConfig, weights: dict) -> None:
    """Every weight present, of its shape, in bfloat16: else a ShapeError/DTypeError naming it."""
    shapes = expected_shapes(cfg)
    missing = [n for n in shapes if n not in weights]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise dop.ShapeError(f"the checkpoint lacks {', '.join(missing[:3])}{more}: is it a Llama-family model "
                             "of this config?")
    for name, shape in shapes.items():
        w = weights[name]
        if tuple(w.shape) != shape:
            raise dop.ShapeError(f"{name} has shape {tuple(w.shape)}, the config needs {shape}: the config and "
                                 "the weights do not belong together")
        kind = str(getattr(w, "dtype", ""))
        if kind not in ("bfloat16", "torch.bfloat16"):
            raise dop.DTypeError(f"{name} is {kind}, the kernels read bfloat16 weights: convert the checkpoint "
                                 "(e.g. model.to(torch.bfloat16)) first")


def random_weights(cfg: LlamaConfig, seed: int = 0, std: float = 0.02) -> dict:
    """A seeded random checkpoint in bf16, initialised as Hugging Face initialises a
    LlamaForCausalLM (normal(0, ``std``) matrices), with norm weights near 1 so that
    they matter.  For tests and for running without a checkpoint (a larger ``std``
    makes a tiny model's greedy output wander instead of repeating one token)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            w = std * rng.standard_normal(shape, dtype=np.float32)
        out[name] = w.astype(BF16)
    return out


def save_checkpoint(cfg: LlamaConfig, weights: dict, directory, shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and the weights as safetensors (sharded above ``shard_bytes``,
    with the index file Hugging Face writes), as a Hugging Face checkpoint directory."""
    from safetensors.numpy import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    names = sorted(weights)
    if shard_bytes is None:
        save_file({n: np.ascontiguousarray(weights[n]) for n in names}, directory / "model.safetensors")
        return directory
    shards, current, size = [], [], 0
    for n in names:
        if current and size + weights[n].nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(n)
        size += weights[n].nbytes
    shards.append(current)
    index = {"metadata": {"total_size": sum(weights[n].nbytes for n in names)}, "weight_map": {}}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: np.ascontiguousarray(weights[n]) for n in shard}, directory / file)
        index["weight_map"].update({n: file for n in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory


def load_checkpoint(directory, progress: bool = True) -> dict:
    """The weights of a Hugging Face checkpoint directory, as NumPy arrays (bf16 stays bf16).

    Reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json``
    through the safetensors package (memory-mapped: nothing is read twice)."""
    from safetensors import safe_open
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise dop.StateError(f"{directory} holds no model.safetensors (nor an index of shards): pass a Hugging "
                             "Face checkpoint directory")
    out = {}
    bar = _progress(len(files), "loading shards", progress and len(files) > 1)
    for file in files:
        with safe_open(directory / file, framework="numpy") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
        bar.update(1)
    bar.close()
    return out


def _progress(total: int, what: str, enabled: bool):
    """A tqdm bar on a terminal (quiet when not attached to one, or disabled)."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: loading works the same without a bar
        enabled = False
    if not enabled:
        class _Quiet:
            def update(self, n=1):
                pass

            def close(self):
                pass
        return _Quiet()
    return tqdm(total=total, desc=what, unit="file", disable=None)
