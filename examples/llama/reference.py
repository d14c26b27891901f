"""The Llama decoder in float64 NumPy: the oracle the device model is tested against.

It computes what Hugging Face's ``LlamaForCausalLM`` computes, one token at a
time with a KV cache, from the same bf16 weights promoted to float64.  It is
slow and clear on purpose: every step of a decoder layer is one line.
"""
from __future__ import annotations

import numpy as np

from .config import LlamaConfig
from .weights import layer_names


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, pos: int, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate each head of ``x`` [heads, hd] by position ``pos`` (Hugging Face's rotate_half pairs)."""
    half = x.shape[-1] // 2
    angle = np.float32(pos) * inv_freq.astype(np.float32)  # the product in float32, as Hugging Face forms it
    cos, sin = np.cos(angle.astype(np.float64)), np.sin(angle.astype(np.float64))
    lo, hi = x[..., :half], x[..., half:]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class ReferenceLlama:
    """``step(token, pos)`` -> float64 logits, appending to its own float64 KV cache."""

    def __init__(self, cfg: LlamaConfig, weights: dict, capacity: int):
        self.cfg, self.capacity = cfg, capacity
        self.w = {k: np.asarray(v).astype(np.float64) for k, v in weights.items()}
        self.inv_freq = cfg.inv_freq()
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.k_cache, self.v_cache = np.zeros(shape), np.zeros(shape)

    def head_weight(self) -> np.ndarray:
        return self.w["model.embed_tokens.weight"] if self.cfg.tie_word_embeddings else self.w["lm_head.weight"]

    def step(self, token: int, pos: int) -> np.ndarray:
        cfg, w = self.cfg, self.w
        hd, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        h = w["model.embed_tokens.weight"][token].copy()
        for layer in range(cfg.num_hidden_layers):
            n = layer_names(layer)
            x = rms_norm(h, w[n["input_norm"]], cfg.rms_norm_eps)
            q = rope((w[n["q"]] @ x).reshape(hq, hd), pos, self.inv_freq)
            k = rope((w[n["k"]] @ x).reshape(hkv, hd), pos, self.inv_freq)
            self.k_cache[layer, :, pos] = k
            self.v_cache[layer, :, pos] = (w[n["v"]] @ x).reshape(hkv, hd)
            keys, values = self.k_cache[layer, :, :pos + 1], self.v_cache[layer, :, :pos + 1]
            attn = np.empty((hq, hd))
            for head in range(hq):
                g = head // cfg.group
                scores = keys[g] @ q[head] / np.sqrt(hd)
                p = np.exp(scores - scores.max())
                attn[head] = (p / p.sum()) @ values[g]
            h = h + w[n["o"]] @ attn.reshape(-1)
            x = rms_norm(h, w[n["post_norm"]], cfg.rms_norm_eps)
            h = h + w[n["down"]] @ (silu(w[n["gate"]] @ x) * (w[n["up"]] @ x))
        return self.head_weight() @ rms_norm(h, w["model.norm.weight"], cfg.rms_norm_eps)

    def greedy(self, prompt, max_new_tokens: int) -> list:
        """Prompt tokens in, then ``max_new_tokens`` argmax tokens out (no EOS stop: a fixed count)."""
        out, pos = [], 0
        for pos, t in enumerate(prompt):
            logits = self.step(int(t), pos)
        for _ in range(max_new_tokens):
            nxt = int(np.argmax(logits))
            out.append(nxt)
            pos += 1
            if len(out) == max_new_tokens:
                break
            logits = self.step(nxt, pos)
        return out
