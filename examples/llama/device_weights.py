"""A Llama model's weights on the device, laid out as the decode kernels read them, and the
memory check that refuses a model before any of it is allocated."""
from __future__ import annotations

import numpy as np

import deviceop as dop
from deviceop import api

from .config import LlamaConfig
from .tp import Shard, shard_weights
from .weights import check_weights, host_memory_bytes, layer_names


class DeviceWeights:
    """A model's weights on the device, laid out as the kernels read them: q, k and v
    rows in one matrix, gate and up rows in one matrix (the rest as given).  With a
    ``shard`` of a tensor-parallel group, only that rank's blocks (examples/llama/tp.py)."""

    def __init__(self, cfg: LlamaConfig, weights: dict, stream, shard: Shard | None = None, *,
                 check: bool = True):
        if check:  # LlamaDecoder checks first, before it sizes anything
            check_weights(cfg, weights)
        self.cfg = cfg
        shard = shard or Shard(cfg)
        part = shard_weights(cfg, weights, shard, layer_names)

        def put(w):
            return _to_device(w, stream)

        def cat(*ws):
            return _concat(list(ws), stream)

        self.embed = put(part["embed"])
        self.final_norm = put(part["final_norm"])
        self.head = self.embed if part["head"] is part["embed"] else put(part["head"])
        self.layers = []
        for w in part["layers"]:
            self.layers.append({"input_norm": put(w["input_norm"]), "post_norm": put(w["post_norm"]),
                                "qkv": cat(w["q"], w["k"], w["v"]), "o": put(w["o"]),
                                "gate_up": cat(w["gate"], w["up"]), "down": put(w["down"])})


def _to_device(w, stream) -> dop.Tensor:
    """A host array is copied; a device tensor (torch, CuPy: anything with DLPack) is used in place."""
    if isinstance(w, np.ndarray):
        return dop.from_numpy(np.ascontiguousarray(w), stream=stream)
    return dop.from_dlpack(w, stream=stream)  # onto the decoder's device (a rank's, in tensor parallel)


def _concat(parts: list, stream) -> dop.Tensor:
    """Rows of ``parts`` stacked into one new device matrix."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return dop.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=0)), stream=stream)
    rows = sum(p.shape[0] for p in parts)
    out = dop.empty([rows, parts[0].shape[1]], dop.bfloat16, stream=stream)
    start = 0
    for p in parts:
        src = _to_device(p, stream)
        api.memcpy(out[start:start + src.shape[0]], src).sync_on(stream)
        start += src.shape[0]
    return out


def check_memory(cfg: LlamaConfig, weights: dict, capacity: int, device) -> None:
    """Refuse, before anything is allocated, a model whose KV cache and host weights (copied
    to the device) exceed the device's free memory (the reference device: this machine's)."""
    need = cfg.kv_bytes(capacity) + sum(w.nbytes for w in weights.values() if isinstance(w, np.ndarray))
    free = host_memory_bytes() if device.is_reference else device.memory_info()[0]
    if free and need > free:
        raise dop.OutOfMemoryError(
            "Llama(...)", 2, "CUDA_ERROR_OUT_OF_MEMORY",
            f"the weights and a KV cache of {capacity} entries need {need / 2**30:.2f} GiB; "
            f"{free / 2**30:.2f} GiB are free", "Use a smaller capacity or model, or free device memory")
