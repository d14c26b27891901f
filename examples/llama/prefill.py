"""Chunked prefill: the prompt ingested T tokens a pass over the weights, then decode.

Token by token, every prompt token costs a whole decode step (every weight read
once, ~830 µs at the 1B shape on an H100).  A chunk multiplies each weight row
with T activation rows at once (kernels/llama_prefill.cu, on the tensor cores),
so a pass over the weights ingests T tokens.  The whole generation is still one
graph launch: a device loop over the chunks, the LM head on the last prompt
token, then the decode loop of model.py.

    prefill_start       chunk = [0, min(T, P), 1]
    while chunk.cond:
      pf_embed          x0[t] = embed[tokens[p0 + t]]
      per layer:
        pf_qkv_rope     qkv[t] = rope(Wqkv n(x0[t])); k, v of t < n -> cache[p0 + t]
        pf_attn         a[t] = causal attention of query t over cache[0 .. p0 + t]
        pf_matmul_res.  x1 = x0 + a Wo^T
        pf_gate_up_silu m = silu(n(x1) Wg^T) * (n(x1) Wu^T)
        pf_matmul_res.  x0 = x1 + m Wd^T
      prefill_step      the next chunk, or cond = 0
    prefill_finish      h_last = x0[n - 1]; state = [P - 1, 1, tokens[P - 1], 0]
    rms_lm_head_argmax  (then sample)  -> the first generated token
    llama_step          tokens[P] = it; stop on EOS / max_new
    while state.cond: the decode step (model.py)
"""
from __future__ import annotations

import numpy as np

import deviceop as dop
from deviceop.kernels import llama_attn as attn_k
from deviceop.kernels import llama_prefill as pf
from deviceop.kernels import llama_proj as proj
from deviceop.kernels.llama_step import llama_step

from .model import LlamaDecoder, Sampling


class ChunkedPrefill:
    """Buffers and ops of a chunked prefill of ``chunk`` tokens for a LlamaDecoder (its weights,
    KV cache, token buffer and decode state are shared)."""

    def __init__(self, decoder: LlamaDecoder, chunk: int):
        cfg = decoder.cfg
        d, hq, hkv, hd, inter = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                 cfg.intermediate_size)
        pf.check_chunk(d, inter, hq, hkv, hd, chunk)  # an unsupported chunk is refused before any allocation
        self.dec, self.cfg, self.chunk = decoder, cfg, chunk
        stream = decoder.stream

        def buf(*shape):
            return dop.empty(list(shape), stream=stream)

        t = chunk
        self.x0, self.x1 = buf(t, d), buf(t, d)
        self.qkv, self.attn, self.act = buf(t, pf.qkv_width(hq, hkv, hd)), buf(t, cfg.q_size), buf(t, inter)
        self.h_last = buf(d)
        self.state = dop.from_numpy(np.zeros(3, np.int32), stream=stream)  # [p0, n, cond]
        self.embed_tile, self.embed_gen = pf.embed_plan(d, t)
        self.qkv_tile, self.qkv_gen = pf.qkv_plan(d, hq, hkv, hd, t)
        self.attn_tile, self.attn_gen = pf.attn_plan(hd, cfg.group, t)
        self.o_tile, self.o_gen = pf.matmul_residual_plan(d, cfg.q_size, t)
        self.gu_tile, self.gu_gen = pf.gate_up_plan(d, inter, t)
        self.down_tile, self.down_gen = pf.matmul_residual_plan(d, inter, t)

    @property
    def cond(self) -> dop.Tensor:
        return self.state[2:3]

    # -- the ops -------------------------------------------------------------------------------
    def layer_ops(self, i: int) -> list:
        """Layer ``i``'s five launches (QKV, attention, O, gate/up, down), in order."""
        dec, cfg, p = self.dec, self.cfg, self.dec.pdl
        w, eps, cap = dec.w.layers[i], cfg.rms_norm_eps, dec.capacity
        k, v = dec.k_cache[i], dec.v_cache[i]
        return [
            pf.pf_qkv_rope(self.qkv.partition(self.qkv_tile), self.x0, w["input_norm"], w["qkv"], dec.inv_freq,
                           self.state, k, v, dec.error, eps, cap).generics(self.qkv_gen).pdl(p),
            pf.pf_attn(self.attn.partition(self.attn_tile), self.qkv, k, v, self.state, cap)
            .generics(self.attn_gen).pdl(p),
            pf.pf_matmul_residual(self.x1.partition(self.o_tile), self.attn, w["o"], self.x0)
            .generics(self.o_gen).pdl(p),
            pf.pf_gate_up_silu(self.act.partition(self.gu_tile), self.x1, w["post_norm"], w["gate_up"], eps)
            .generics(self.gu_gen).pdl(p),
            pf.pf_matmul_residual(self.x0.partition(self.down_tile), self.act, w["down"], self.x1)
            .generics(self.down_gen).pdl(p)]

    def chunk_step(self, prompt_len: int) -> dop.DeviceOp:
        """One chunk: the prompt tokens at positions p0 .. p0 + n - 1 through every layer (their
        K and V into the cache), then the next chunk's state."""
        dec, cfg, p = self.dec, self.cfg, self.dec.pdl
        ops = [pf.pf_embed(self.x0.partition(self.embed_tile), dec.w.embed, dec.tokens, self.state, dec.error,
                           cfg.vocab_size, dec.capacity).generics(self.embed_gen).pdl(p)]
        ops += [dop.zip_(*self.layer_ops(i)) for i in range(cfg.num_hidden_layers)]
        ops.append(pf.prefill_step(self.state.partition([3]), prompt_len, self.chunk).pdl(p))
        return dop.zip_(*ops)

    def ingest(self, sampling: Sampling, prompt_len: int, max_new: int) -> dop.DeviceOp:
        """The prompt in chunks, then the first generated token chosen and appended (the decode
        state then stands where token-by-token ingestion leaves it)."""
        dec, cfg, p = self.dec, self.cfg, self.dec.pdl
        ops = [pf.prefill_start(self.state.partition([3]), prompt_len, self.chunk),
               dop.while_(self.cond, lambda: self.chunk_step(prompt_len)),
               # after a conditional node: a full dependency, not a programmatic one
               pf.prefill_finish(self.h_last.partition([cfg.hidden_size]), self.x0, self.state, dec.state,
                                 dec.tokens, prompt_len, cfg.hidden_size).generics([self.chunk]),
               proj.rms_lm_head_argmax(dec.logits.partition([dec.head_tile]), self.h_last, dec.w.final_norm,
                                       dec.w.head, dec.token, dec.head_work, dec.error, cfg.rms_norm_eps,
                                       cfg.vocab_size)
               .generics(dec.head_gen).pdl(p)]
        if not sampling.greedy:
            ops.append(attn_k.sample(dec.sample_part.partition([1, dec.sample_part.shape[1]]),
                                     dec.logits[:cfg.vocab_size], dec.token, dec.sample_state, dec.pos,
                                     cfg.vocab_size, sampling.temperature, sampling.top_k, sampling.top_p,
                                     sampling.seed).generics([dec.sample_candidates]).pdl(p))
        ops.append(llama_step(dec.tokens.partition([dec.capacity]), dec.state, dec.token, dec.eos,
                              len(cfg.eos_token_id), prompt_len, max_new, dec.capacity).pdl(p))
        return dop.zip_(*ops)

    def generation(self, sampling: Sampling, prompt_len: int, max_new: int) -> dop.DeviceOp:
        """Chunked prefill and decode in one op: captured, two conditional WHILE nodes in one graph."""
        dec = self.dec
        return dop.zip_(self.ingest(sampling, prompt_len, max_new),
                        dop.while_(dec.cond, lambda: dec.step(sampling, prompt_len, max_new)))
