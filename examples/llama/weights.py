"""Llama weights: Hugging Face names, random checkpoints, safetensors files, checks.

Weights are kept by their Hugging Face ``state_dict`` names, so a checkpoint
directory (``model.safetensors`` or sharded with ``model.safetensors.index.json``)
and a live ``LlamaForCausalLM.state_dict()`` load the same way.  Every
tensor's shape and dtype is checked against the config before anything is
copied to the device.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import numbers
import os
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

import deviceop as dop

from .config import LlamaConfig, as_path

BF16 = np.dtype(ml_dtypes.bfloat16)


def layer_names(i: int) -> dict:
    """Short name -> Hugging Face name of layer ``i``'s weights."""
    p = f"model.layers.{i}."
    return {"input_norm": p + "input_layernorm.weight", "post_norm": p + "post_attention_layernorm.weight",
            "q": p + "self_attn.q_proj.weight", "k": p + "self_attn.k_proj.weight",
            "v": p + "self_attn.v_proj.weight", "o": p + "self_attn.o_proj.weight",
            "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight", "down": p + "mlp.down_proj.weight"}


def weight_count(cfg: LlamaConfig) -> int:
    """How many tensors the model reads (without naming them)."""
    return 2 + (0 if cfg.tie_word_embeddings else 1) + len(layer_names(0)) * cfg.num_hidden_layers


DIGEST_RUNS, DIGEST_RUN = 16, 256  # runs of elements of each weight weights_digest reads


def weights_digest(cfg: LlamaConfig, weights: dict, stream=None) -> str:
    """A digest of the weights the model reads, cheap enough for every tensor-parallel load
    (ranks compare it, so that ranks that loaded different checkpoints are refused): each
    weight's name, shape and dtype, and DIGEST_RUNS evenly spaced runs of DIGEST_RUN
    elements, read in place from a host array (a memory-mapped checkpoint reads a page or
    two a run, not the file) and copied from a device tensor (torch, CuPy, deviceop: a
    small copy a run, on ``stream``), so a host load and a device load of the same weights
    digest alike.  A difference confined to elements it skips is not seen:
    ``group.check_same`` a digest of the files for that."""
    h = hashlib.blake2b(digest_size=16)
    for name, _ in iter_expected(cfg):
        w = weights[name]
        host = isinstance(w, np.ndarray)
        t = w if host else dop.from_dlpack(w, stream=stream)
        h.update(f"{name} {tuple(t.shape)} {t.dtype if host else t.dtype.name}|".encode())
        if t.size:
            # a device tensor laid out otherwise (a transposed view) is copied dense once, on the device
            flat = t.reshape(-1) if host else t.contiguous(stream=stream).view(t.size)
            for start in np.unique(np.linspace(0, max(t.size - DIGEST_RUN, 0), DIGEST_RUNS).astype(np.int64)):
                run = flat[int(start):int(start) + DIGEST_RUN]
                h.update((np.ascontiguousarray(run) if host else run.numpy(stream=stream)).view(np.uint8).tobytes())
    return h.hexdigest()


def iter_expected(cfg: LlamaConfig):
    """Every weight the model reads, (Hugging Face name, shape), named lazily: a config of
    a billion layers costs nothing until its names are walked."""
    d, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    yield "model.embed_tokens.weight", (cfg.vocab_size, d)
    yield "model.norm.weight", (d,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (cfg.vocab_size, d)
    per_layer = {"input_norm": (d,), "post_norm": (d,), "q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q),
                 "gate": (i, d), "up": (i, d), "down": (d, i)}
    for layer in range(cfg.num_hidden_layers):
        for short, name in layer_names(layer).items():
            yield name, per_layer[short]


def expected_shapes(cfg: LlamaConfig) -> dict:
    """Every weight the model reads: Hugging Face name -> shape."""
    return dict(iter_expected(cfg))


def check_weights(cfg: LlamaConfig, weights: dict) -> None:
    """Every weight present, of its shape, in bfloat16, and (host arrays) finite: else a
    ShapeError/DTypeError naming it.  The count is compared first, so a config that names
    more weights than the checkpoint holds is refused without naming them all."""
    if not isinstance(weights, Mapping):
        raise dop.DTypeError(f"the weights are a {type(weights).__name__}, not a mapping of Hugging Face names to "
                             "arrays: pass load_checkpoint(dir), a state_dict() or random_weights(cfg)")
    need = weight_count(cfg)
    if len(weights) < need:
        missing = []
        for name, _ in iter_expected(cfg):  # stops at the third: cheap whatever the layer count
            if name not in weights:
                missing.append(name)
                if len(missing) == 3:
                    break
        raise dop.ShapeError(f"the checkpoint holds {len(weights)} tensors and the config needs {need}: it lacks "
                             f"{', '.join(missing)}{' ...' if len(missing) == 3 else ''}: is it a Llama-family "
                             "model of this config?")
    bias = next((n for n in weights if isinstance(n, str) and n.endswith(".bias")), None)
    if bias is not None:  # a Qwen2-style checkpoint passes the shape checks, then decodes without its biases
        raise dop.ShapeError(f"the checkpoint holds {bias}, a bias a Llama decoder does not add: it is a model of "
                             "another architecture (Qwen2, GPT-2 ...), which these kernels do not serve")
    for name, shape in iter_expected(cfg):
        w = weights.get(name)
        if w is None:
            raise dop.ShapeError(f"the checkpoint lacks {name}: is it a Llama-family model of this config?")
        if not hasattr(w, "shape") or not hasattr(w, "dtype"):
            raise dop.DTypeError(f"{name} is a {type(w).__name__}, not an array: pass NumPy (bf16), torch or CuPy "
                                 "arrays, or deviceop tensors")
        if tuple(w.shape) != shape:
            raise dop.ShapeError(f"{name} has shape {tuple(w.shape)}, the config needs {shape}: the config and "
                                 "the weights do not belong together")
        kind = str(getattr(w, "dtype", ""))
        if kind not in ("bfloat16", "torch.bfloat16", "dop.bfloat16"):  # (a deviceop Tensor: used in place)
            raise dop.DTypeError(f"{name} is {kind}, the kernels read bfloat16 weights: convert the checkpoint "
                                 "(e.g. model.to(torch.bfloat16)) first")
        if isinstance(w, np.ndarray):
            bad = first_nonfinite(w)
            if bad is not None:
                raise dop.StateError(f"{name} holds a non-finite value ({float(w.reshape(-1)[bad])}) at flat "
                                     f"index {bad}: the checkpoint is damaged; every logit would be garbage")


def first_nonfinite(w: np.ndarray, block: int = 1 << 22) -> int | None:
    """The flat index of ``w``'s (bf16) first NaN or infinity, or None: its exponent bits all
    set, read a block at a time (no temporary of the whole tensor)."""
    bits = np.ascontiguousarray(w).reshape(-1).view(np.uint16)
    for start in range(0, bits.size, block):
        hit = np.flatnonzero((bits[start:start + block] & 0x7F80) == 0x7F80)
        if hit.size:
            return start + int(hit[0])
    return None


def random_weights(cfg: LlamaConfig, seed: int = 0, std: float = 0.02) -> dict:
    """A seeded random checkpoint in bf16, initialised as Hugging Face initialises a
    LlamaForCausalLM (normal(0, ``std``) matrices), with norm weights near 1 so that
    they matter.  For tests and for running without a checkpoint (a larger ``std``
    makes a tiny model's greedy output wander instead of repeating one token).
    A model larger than this machine's memory is refused before anything is made."""
    if not isinstance(cfg, LlamaConfig):
        raise dop.DTypeError(f"the config is a {type(cfg).__name__}, not a LlamaConfig: pass "
                             "LlamaConfig.from_dict(d) or LlamaConfig.from_json(path)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        raise dop.ShapeError(f"random_weights: seed={seed!r} must be an integer >= 0 (or None for a fresh one)")
    if isinstance(std, bool) or not isinstance(std, numbers.Real) or not 0 <= float(std) < float("inf"):
        raise dop.ShapeError(f"random_weights: std={std!r} must be a finite number >= 0 (the matrices' "
                             "standard deviation)")
    have = host_memory_bytes()
    if have and cfg.weight_bytes() > have:
        raise dop.ShapeError(f"random weights of this config take {cfg.weight_bytes() / 1e9:.1f} GB and this "
                             f"machine has {have / 1e9:.1f} GB of memory: use a smaller config")
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in iter_expected(cfg):
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            w = std * rng.standard_normal(shape, dtype=np.float32)
        out[name] = w.astype(BF16)
    return out


def host_memory_bytes() -> int:
    """This machine's physical memory in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def save_checkpoint(cfg: LlamaConfig, weights: dict, directory, shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and the weights as safetensors (sharded above ``shard_bytes``,
    with the index file Hugging Face writes), as a Hugging Face checkpoint directory."""
    from safetensors.numpy import save_file
    directory = as_path(directory, "checkpoint directory")
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

    Reads ``model.safetensors``, or each tensor from the shard that
    ``model.safetensors.index.json`` names for it, through the safetensors package
    (memory-mapped: nothing is read twice).  A file that cannot be read or parsed, a
    shard the index names that is missing or lacks a tensor, and a tensor stored in two
    shards are StateErrors naming the file."""
    directory = as_path(directory, "checkpoint directory")
    if not directory.is_dir():
        raise dop.StateError(f"{directory} is not a directory: pass a Hugging Face checkpoint directory")
    index = directory / "model.safetensors.index.json"
    if index.exists():
        plan = _shard_plan(index)
    elif (directory / "model.safetensors").exists():
        plan = {"model.safetensors": None}  # every tensor of the one file
    else:
        raise dop.StateError(f"{directory} holds no model.safetensors (nor an index of shards): pass a Hugging "
                             "Face checkpoint directory")
    where: dict = {}
    for file, names in plan.items():  # headers only: every file checked before a tensor is read
        with _opened(directory / file) as f:
            stored = set(f.keys())
        for name in sorted(stored):
            if name in where:
                raise dop.StateError(f"{name} is stored in two shards, {where[name]} and {file}: the checkpoint is "
                                     f"ambiguous; keep each tensor in the one shard {index.name} names")
            where[name] = file
        lacking = sorted(set(names or ()) - stored)
        if lacking:
            raise dop.StateError(f"{index.name} puts {lacking[0]} in {file}, which lacks it: the index and the "
                                 "shards do not belong together")
    out = {}
    bar = _progress(len(plan), "loading shards", progress and len(plan) > 1)
    for file, names in plan.items():
        with _opened(directory / file) as f:
            for name in (names if names is not None else f.keys()):
                out[name] = _read(f, name, directory / file)
        bar.update(1)
    bar.close()
    return out


@contextlib.contextmanager
def _opened(path: Path):
    """``safe_open(path)``, whose failures (unreadable, truncated, not safetensors) are StateErrors."""
    from safetensors import SafetensorError, safe_open
    try:
        f = safe_open(path, framework="numpy")
    except (OSError, SafetensorError) as exc:
        raise _unreadable(path, exc) from None
    with f:
        yield f


def _read(f, name: str, path: Path):
    from safetensors import SafetensorError
    try:
        return f.get_tensor(name)
    except (OSError, SafetensorError) as exc:  # the header promised bytes the file does not hold
        raise _unreadable(path, exc) from None


def _unreadable(path: Path, exc) -> dop.StateError:
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return dop.StateError(f"cannot read {path}: {why}; is the checkpoint complete?")


def _shard_plan(index: Path) -> dict:
    """Shard file -> the tensor names the index puts there."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except OSError as exc:
        raise dop.StateError(f"cannot read {index}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise dop.StateError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc}); it needs a "
                             "\"weight_map\" of tensor name -> shard file") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise dop.StateError(f"{index}'s weight_map must map tensor names to shard file names")
    plan: dict = {}
    for name, file in weight_map.items():
        if Path(file).name != file:
            raise dop.StateError(f"{index} names the shard {file!r}, which is not a file of this directory")
        plan.setdefault(file, []).append(name)
    missing = [f for f in plan if not (index.parent / f).is_file()]
    if missing:
        raise dop.StateError(f"{index.name} names the shard {missing[0]}, which is not in {index.parent}: "
                             "the checkpoint is incomplete")
    return dict(sorted(plan.items()))


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
