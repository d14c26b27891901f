"""The Llama decoder on deviceop: its buffers and the ops of a step (the weights as the kernels
read them: device_weights.py; which kernels launch, with which plans: plans.py).

One decode step is 5 launches a layer plus the embedding, the head and the
sampler, every one a programmatic dependent launch (``.pdl()``): a kernel
streams its weights while the previous one finishes.  The step reads the
position and the current token from a device-side ``state`` ([pos, cond, cur,
generated], see kernels/llama_step.cu), so one captured step serves every
position, and a ``dop.while_`` over it is a whole generation in one graph launch.

    embed_gather      h0 = embed[cur]
    per layer:
      rms_qkv_rope    q = rope(Wq n(h0)); k, v = rope(Wk n(h0)), Wv n(h0) -> cache[pos]
      attn_decode     a = softmax(q K^T / sqrt(hd)) V over cache[0..pos]
      matvec_residual h1 = h0 + Wo a
      rms_gate_up     m = silu(Wg n(h1)) * (Wu n(h1))
      matvec_residual h0 = h1 + Wd m
    rms_lm_head_argmax logits = W_head n(h0); token = argmax   (then `sample` if not greedy)
    llama_step        feed the prompt or append the token; stop on EOS / max_new
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

import deviceop as dop
from deviceop import api
from deviceop.distributed.peer import unreachable
from deviceop.kernels import llama_attn as attn_k
from deviceop.kernels import llama_proj as proj
from deviceop.kernels.llama_step import llama_step, llama_step_start
from deviceop.kernels.llama_tp import (MAX_RESIDENT, PAIRS, PLACE_TILE, matvec_allreduce,
                                       placed_rows, tp_argmax_pair, tp_argmax_pick, tp_place)

from .config import INT32_MAX, LlamaConfig, kernel_limits
from .device_weights import DeviceWeights, check_memory
from .plans import SAMPLE_CANDIDATES, attn_args, launch_plans
from .tp import Shard, agree
from .weights import BF16, check_weights, weights_digest


# tensor parallel: how the ranks' partial sums are added (LlamaDecoder's allreduce=)
ALLREDUCE = ("auto", "oneshot", "nccl")
# The device's error word (kernels/llama_common.cuh llama::ERR_*): bits OR-ed in by the kernels.
# ERR_NONFINITE is what the LM head kernel sets when a logit is NaN or inf (the host also
# checks the last logits, which a non-finite value anywhere in a generation reaches).
ERR_TOKEN, ERR_POS, ERR_NONFINITE = proj.ERR_TOKEN, proj.ERR_POS, proj.ERR_LOGITS
NONFINITE = ("the logits went non-finite (NaN or inf) during the generation: a weight or an activation is not "
             "finite, so the tokens are garbage; check the checkpoint (check_weights names a non-finite weight)")


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy (the head's own argmax).
    Every field is checked when made, greedy or not: ``top_k`` an int >= 0 (0 = off),
    ``top_p`` in [0, 1] (1 = off), ``temperature`` finite and >= 0, ``seed`` an int in
    [0, 2^64)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        def real(name, low, high):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not low <= float(v) <= high:
                raise dop.ShapeError(f"Sampling: {name}={v!r} must be a number in [{low}, {high}]")
            object.__setattr__(self, name, float(v))
        real("temperature", 0.0, float(np.finfo(np.float32).max))  # also refuses NaN and inf
        real("top_p", 0.0, 1.0)
        for name, high in (("top_k", INT32_MAX), ("seed", 2 ** 64 - 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= int(v) <= high:
                raise dop.ShapeError(f"Sampling: {name}={v!r} must be an integer in [0, {high}]")
            object.__setattr__(self, name, int(v))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class LlamaDecoder:
    """Buffers and launch plans for batch-1 decode of one model with a KV cache of ``capacity``.
    With a ``group`` (deviceop.distributed) of N ranks, this rank's share of a tensor-parallel
    decoder (examples/llama/tp.py): every rank builds the same ops, collectives included."""

    def __init__(self, cfg: LlamaConfig, weights: dict, capacity: int, *, stream, pdl: bool = True, group=None,
                 allreduce: str = "auto"):
        if allreduce not in ALLREDUCE:
            raise dop.ShapeError(f"allreduce={allreduce!r}: use 'auto' (the O and down projections' all-reduces "
                                 "fused into their epilogue, the others one-shot over peer memory, NCCL where "
                                 "neither applies), 'oneshot' (no fusion) or 'nccl'")
        # every refusal before a byte is allocated: the request, the kernels' limits, the weights, the memory
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or not 2 <= capacity <= INT32_MAX:
            raise dop.ShapeError(f"a KV capacity of {capacity!r} is not served: give an integer in [2, {INT32_MAX}] "
                                 "(positions live in int32 on the device)")
        capacity = int(capacity)
        kernel_limits(cfg)
        self.shard = sh = Shard(cfg, group.rank, group.world_size) if group is not None else Shard(cfg)
        plans = launch_plans(cfg, capacity, sh)
        check_weights(cfg, weights)
        check_memory(cfg, weights, capacity, stream.device)  # the rank's GPU (tensor parallel: not GPU 0)
        attn_k.check_capacity(capacity, cfg.head_dim, cfg.group, **attn_args(sh))
        if group is not None:  # before any allocation: ranks building different decoders would hang later
            agree(group, "the model (config, KV capacity, PDL, allreduce)", (repr(cfg.to_dict()), capacity, pdl,
                                                                             allreduce))
            agree(group, "the weights (a sample of each: load the same checkpoint on every rank)",
                  weights_digest(cfg, weights, stream))
        self.group = group if sh.size > 1 else None
        self.cfg, self.capacity, self.stream, self.pdl = cfg, capacity, stream, pdl
        self.w = DeviceWeights(cfg, weights, stream, sh, check=False)
        d, hkv, hd = cfg.hidden_size, sh.kv_heads, cfg.head_dim

        def buf(shape, dtype="float32"):
            return dop.empty(shape, dtype, stream=stream)

        def ints(values):
            return dop.from_numpy(np.asarray(values, np.int32), stream=stream)

        self.h0, self.h1 = buf([d]), buf([d])
        self.q, self.attn, self.act = buf([sh.q_size]), buf([sh.q_size]), buf([sh.inter])
        shape = [cfg.num_hidden_layers, hkv, capacity, hd]
        self.k_cache = dop.from_numpy(np.zeros(shape, BF16), stream=stream)
        self.v_cache = dop.from_numpy(np.zeros(shape, BF16), stream=stream)
        self.inv_freq = dop.from_numpy(cfg.inv_freq(), stream=stream)
        self.error = ints([0])
        self.state = ints([0, 1, 0, 0])        # [pos, cond, cur, generated]
        self.tokens = ints(np.zeros(capacity))
        self.token = ints([0])                  # the step's chosen token
        self.eos = ints(list(cfg.eos_token_id) or [0])

        self.plan, self.fused = plans, None
        self.embed_tile, self.embed_gen = plans["embed"]
        self.qkv_tile, self.qkv_gen = plans["qkv"]
        self.gu_tile, self.gu_gen = plans["gate_up"]
        self.head_tile, rows, self.head_gen = plans["head"]
        self.logits = buf([rows])
        self.head_work = dop.from_numpy(np.zeros(2, np.uint64), stream=stream)
        self.attn_tile, self.attn_gen = plans["attn"]
        self.attn_ws, self.attn_counters = attn_k.attn_buffers(hkv, hd, cfg.group, self.attn_gen[2], stream=stream)
        self.sample_candidates = attn_k.sample_candidates(cfg.vocab_size, SAMPLE_CANDIDATES)
        self.sample_part, _, self.sample_state = attn_k.sample_buffers(cfg.vocab_size, self.sample_candidates,
                                                                       stream=stream)
        if self.group is not None:
            # the partial sums' residual: rank 0 adds the hidden vector, the others nothing
            self.zeros = dop.from_numpy(np.zeros(d, np.float32), stream=stream)
            self.local_token = ints([0])       # this rank's argmax over its vocabulary rows
            self.picks = dop.from_numpy(np.zeros(PAIRS, np.float32), stream=stream)  # every rank's (logit, index)
            # the whole vocabulary's logits, gathered for sampling and teacher forcing (padded: tp_place)
            self.full_logits = buf([placed_rows(cfg.vocab_size)])
            self.allreduce = allreduce
            if allreduce == "auto" and unreachable(group) is not None:
                self.allreduce = "nccl"  # peer memory does not reach every rank (several machines, > 8 ranks)
            if self.allreduce != "nccl":
                self._peer_buffers(max(4 * d, 4 * self.full_logits.shape[0]))
            if self.allreduce == "auto":
                self._fused_buffers(plans)

    @staticmethod
    def plans(cfg: LlamaConfig, capacity: int, shard: Shard | None = None) -> dict:
        """Each kernel's plan for this model (``launch_plans``): pure arithmetic, so a shape the
        kernels' plans refuse is refused before anything is allocated."""
        return launch_plans(cfg, capacity, shard or Shard(cfg))

    # -- views of the state --------------------------------------------------------
    @property
    def pos(self) -> dop.Tensor:
        return self.state[0:1]

    @property
    def cond(self) -> dop.Tensor:
        return self.state[1:2]

    @property
    def cur(self) -> dop.Tensor:
        return self.state[2:3]

    # -- the ops of one step ----------------------------------------------------------
    def _residual(self, hidden: dop.Tensor) -> dop.Tensor:
        """What a projection adds its product to: the hidden vector, or (tensor parallel, rank > 0)
        zeros, so that the all-reduce of the ranks' outputs adds it once."""
        return self.zeros if self.group is not None and self.shard.rank > 0 else hidden

    def _peer_buffers(self, nbytes: int) -> None:
        """The group's peer buffers for the one-shot all-reduce (made on every rank, once, unless
        the group has ones that take ``nbytes``): dist.all_reduce's "auto" then uses them."""
        import deviceop.distributed as dist
        from deviceop.distributed.peer import peer_buffers
        bufs = peer_buffers(self.group)
        if bufs is None or bufs.max_bytes < nbytes:
            dist.PeerBuffers(self.group, max_bytes=-(-nbytes // 512) * 512)

    def _fused_buffers(self, plans: dict) -> None:
        """Private peer buffers for the projections that all-reduce in their epilogue
        (matvec_allreduce): the O projection's rows in lines [0, d/2) of each slot, the down
        projection's in [d/2, d), one epoch a CTA.  None where a grid would not be resident at
        once (fewer SMs than CTAs): those projections then all-reduce one-shot, unfused."""
        import deviceop.distributed as dist
        d, sms = self.cfg.hidden_size, self.group.device.sm_count
        grids = [d // plans[k][0] for k in ("o_ar", "down_ar")]
        if sms and max(grids) > min(sms, MAX_RESIDENT):
            return
        self.fused = dist.PeerBuffers(self.group, max_bytes=-(-8 * d // 512) * 512, epochs=sum(grids), attach=False)
        self.fused_at = {"o_ar": (0, 1), "down_ar": (d // 2, 1 + grids[0])}  # (line0, epoch0)

    def close(self) -> None:
        """Free the peer buffers this decoder made for itself (collective: every rank calls it,
        once the device finished its generations; graphs that captured its steps must not be
        replayed after).  Idempotent."""
        if self.fused is not None:
            fused, self.fused = self.fused, None
            fused.close()

    def _projection(self, kind: str, out: dop.Tensor, x: dop.Tensor, w, residual: dop.Tensor) -> list:
        """``out = residual + w @ x`` summed over the ranks: the O or down projection (``kind``)
        with its all-reduce fused where the decoder has buffers for it, else the projection and
        then the all-reduce."""
        if self.fused is not None:
            tile, gen = self.plan[kind + "_ar"]
            line0, epoch0 = self.fused_at[kind + "_ar"]
            f = self.fused
            return [matvec_allreduce(out.partition([tile]), x, w, residual, f.peers, f.state, self.shard.rank,
                                     f.slot_lines, line0, epoch0, f.timeout_ns).generics(gen).pdl(self.pdl)]
        tile, gen = self.plan[kind]
        return [proj.matvec_residual(out.partition([tile]), x, w, self._residual(residual)).generics(gen).pdl(self.pdl),
                *self._all_reduce(out)]

    def _all_reduce(self, x: dop.Tensor) -> list:
        """The sum of the ranks' ``x``, in place (tensor parallel; nothing at TP=1): the one-shot
        kernel where the group has peer buffers ("auto"), launched with PDL so that the next
        kernel streams its weights while the ranks exchange; else NCCL's all-reduce."""
        if self.group is None:
            return []
        import deviceop.distributed as dist
        bufs = self._one_shot(x)
        if bufs is not None:
            return [bufs.all_reduce(x).pdl(self.pdl)]
        return [dist.all_reduce(self.group, x, algorithm="nccl")]

    def _one_shot(self, x: dop.Tensor):
        """The group's peer buffers if the one-shot all-reduce is to sum ``x``, else None."""
        if self.group is None or self.allreduce == "nccl":
            return None
        from deviceop.distributed.peer import peer_buffers
        bufs = peer_buffers(self.group)
        return bufs if bufs is not None and bufs.accepts(x) else None

    def _layer(self, i: int) -> dop.DeviceOp:
        cfg, w, p = self.cfg, self.w.layers[i], self.pdl
        eps, cap = cfg.rms_norm_eps, self.capacity
        k, v = self.k_cache[i], self.v_cache[i]
        return dop.zip_(
            proj.rms_qkv_rope(self.q.partition([self.qkv_tile]), self.h0, w["input_norm"], w["qkv"], self.inv_freq,
                              self.pos, k, v, self.error, eps, cap).generics(self.qkv_gen).pdl(p),
            attn_k.attn_decode(self.attn.partition([self.attn_tile]), self.q, k, v, self.pos, self.attn_ws,
                               self.attn_counters, cap).generics(self.attn_gen).pdl(p),
            *self._projection("o", self.h1, self.attn, w["o"], self.h0),
            proj.rms_gate_up_silu(self.act.partition([self.gu_tile]), self.h1, w["post_norm"], w["gate_up"], eps)
            .generics(self.gu_gen).pdl(p),
            *self._projection("down", self.h0, self.act, w["down"], self.h1))

    @property
    def vocab_logits(self) -> dop.Tensor:
        """The last step's logits over the whole vocabulary (tensor parallel: gathered, so only
        after a step built with ``gather_logits``, or a sampling one)."""
        return (self.full_logits if self.group is not None else self.logits)[:self.cfg.vocab_size]

    def head(self, hidden: dop.Tensor, sampling: Sampling, gather_logits: bool = False) -> list:
        """The ops from the last hidden vector to ``self.token``: the LM head and its argmax, then
        the sampler; tensor parallel, each rank's pick or logits exchanged first (every rank ends
        with the same token, so the ranks' loops stay in step)."""
        cfg, p, sh = self.cfg, self.pdl, self.shard
        tp = self.group is not None
        ops = [proj.rms_lm_head_argmax(self.logits.partition([self.head_tile]), hidden, self.w.final_norm,
                                       self.w.head, self.local_token if tp else self.token, self.head_work,
                                       self.error, cfg.rms_norm_eps, sh.vocab).generics(self.head_gen).pdl(p)]
        if tp:
            import deviceop.distributed as dist
            if gather_logits or not sampling.greedy:  # as a sum of zero-padded vectors where the one-shot serves
                if self._one_shot(self.full_logits) is not None:
                    ops += [tp_place(self.full_logits.partition([PLACE_TILE]), self.logits[:sh.vocab], sh.vocab_offset,
                                     sh.vocab).generics([PLACE_TILE]).pdl(p), *self._all_reduce(self.full_logits)]
                else:
                    ops.append(dist.all_gather(self.group, self.logits[:sh.vocab], self.vocab_logits))
            if sampling.greedy:
                ops += [tp_argmax_pair(self.picks.partition([PAIRS]), self.logits, self.local_token, PAIRS, sh.rank,
                                       sh.vocab_offset).pdl(p),
                        *self._all_reduce(self.picks),
                        tp_argmax_pick(self.token.partition([1]), self.picks, sh.size).pdl(p)]
        if not sampling.greedy:
            ops.append(attn_k.sample(self.sample_part.partition([1, self.sample_part.shape[1]]),
                                     self.vocab_logits, self.token, self.sample_state, self.pos,
                                     cfg.vocab_size, sampling.temperature, sampling.top_k, sampling.top_p,
                                     sampling.seed).generics([self.sample_candidates]).pdl(p))
        return ops

    def forward(self, sampling: Sampling, gather_logits: bool = False) -> dop.DeviceOp:
        """The token at ``state.pos`` (``state.cur``) in, the next token in ``self.token`` out."""
        cfg, p = self.cfg, self.pdl
        ops = [proj.embed_gather(self.h0.partition([self.embed_tile]), self.w.embed, self.cur, self.error,
                                 cfg.vocab_size).generics(self.embed_gen).pdl(p)]
        ops += [self._layer(i) for i in range(cfg.num_hidden_layers)]
        ops += self.head(self.h0, sampling, gather_logits)
        return dop.zip_(*ops)

    def step(self, sampling: Sampling, prompt_len: int, max_new: int, gather_logits: bool = False) -> dop.DeviceOp:
        """One loop iteration: the forward, then the control step."""
        return dop.zip_(self.forward(sampling, gather_logits),
                        llama_step(self.tokens.partition([self.capacity]), self.state, self.token, self.eos,
                                   len(self.cfg.eos_token_id), prompt_len, max_new, self.capacity).pdl(self.pdl))

    def start(self) -> dop.DeviceOp:
        return llama_step_start(self.state.partition([4]), self.tokens)

    def generation(self, sampling: Sampling, prompt_len: int, max_new: int) -> dop.DeviceOp:
        """Prompt and generation in one op: captured, one conditional WHILE node."""
        return dop.zip_(self.start(), dop.while_(self.cond, lambda: self.step(sampling, prompt_len, max_new)))

    # -- host side ----------------------------------------------------------------------
    def check_request(self, prompt, max_new: int) -> np.ndarray:
        """The prompt as int32, or a deviceop error before anything launches."""
        if isinstance(prompt, (list, tuple)) and any(isinstance(t, (bool, np.bool_)) for t in prompt):
            raise dop.ShapeError("a prompt's token ids are integers, and this one holds a bool (NumPy would read "
                                 "True as id 1): pass the ids as ints")  # an all-bool array is refused below
        try:
            prompt = np.asarray(prompt)
        except (ValueError, TypeError):  # ragged nesting ([[1, 2], [3]]), objects NumPy cannot lay out
            raise dop.ShapeError(f"a prompt is a non-empty 1-D sequence of token ids, got {type(prompt).__name__} "
                                 "that is not one (ragged or nested)") from None
        if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
            raise dop.ShapeError(f"a prompt is a non-empty 1-D sequence of token ids, got shape {prompt.shape} "
                                 f"of {prompt.dtype}")
        bad = prompt[(prompt < 0) | (prompt >= self.cfg.vocab_size)]
        if bad.size:
            raise dop.ShapeError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if isinstance(max_new, bool) or not isinstance(max_new, numbers.Integral):
            raise dop.ShapeError(f"max_new_tokens={max_new!r} must be an integer (the tokens to generate)")
        if max_new < 1:
            raise dop.ShapeError(f"max_new_tokens={max_new}: ask for at least one token")
        if prompt.size + int(max_new) > self.capacity:
            raise dop.ShapeError(f"a prompt of {prompt.size} tokens and {max_new} new ones need "
                                 f"{prompt.size + int(max_new)} KV entries; the cache holds {self.capacity}: "
                                 "build the decoder with a larger capacity or ask for fewer tokens")
        return prompt.astype(np.int32)

    def load_prompt(self, prompt: np.ndarray) -> None:
        tokens = np.zeros(self.capacity, np.int32)
        tokens[:prompt.size] = prompt
        api.memcpy(self.tokens, dop.from_numpy(tokens, stream=self.stream)).sync_on(self.stream)
        api.memcpy(self.error, dop.from_numpy(np.zeros(1, np.int32), stream=self.stream)).sync_on(self.stream)

    def check_errors(self, logits: bool = True) -> None:
        """Raise if the device flagged the step (the error word) or, with ``logits``, if the
        last logits are not finite: a NaN or inf anywhere in a step reaches the KV cache, so
        every later step's logits, and the tokens chosen from them would be garbage."""
        if self.fused is not None:
            self.stream.synchronize()  # the buffers' error word is read on the group's stream
            self.fused.check()  # a projection's all-reduce gave up waiting for a peer: its outputs were NaN
        error = int(self.error.numpy(stream=self.stream)[0])
        if error:
            raise dop.StateError(
                f"the device reported error word {error} ({ERR_TOKEN}: a token outside the vocabulary, {ERR_POS}: a "
                f"position outside the KV cache, {ERR_NONFINITE}: a NaN or infinite logit, as a NaN weight or an "
                "overflow makes); the generation is not valid" + (f"; {NONFINITE}" if error & ERR_NONFINITE else ""))
        # this rank's logits only: past its shard of the vocabulary the buffer is padding, never written
        if logits and not np.isfinite(self.logits[:self.shard.vocab].numpy(stream=self.stream)).all():
            raise dop.StateError(NONFINITE)

    def read_generated(self, prompt_len: int) -> list:
        self.check_errors()
        state = self.state.numpy(stream=self.stream)
        return [int(t) for t in self.tokens.numpy(stream=self.stream)[prompt_len:prompt_len + int(state[3])]]
