"""Hugging Face's ``LlamaForCausalLM`` beside deviceop's ``Llama``: the same weights, and
the comparisons of issue 27 (the protocol of msaroufim/megakernels-vs-cuda-graphs).

    model = build_hf_model(cfg, seed=0)                 # random bf16 weights, made on the GPU
    weights, how = deviceop_weights(model)              # its state_dict, for Llama(cfg, weights)
    reference = reference_copy(model)                   # the same weights promoted to float32
    report = compare(llama, reference, model, prompts, steps=128)

The protocol: the float32 model (eager attention, no TF32) generates ``steps`` greedy
tokens from each prompt: the first from the prompt's last position, the others from
``steps - 1`` decode steps.  Every other implementation then reads that same history
(teacher forcing) and its logits at each decode step are compared with the reference's:
KL(reference || other) over the whole vocabulary, in float64.  Hugging Face's own bf16
run calibrates what bf16 costs.  Separately, each implementation's own greedy tokens are
compared with the reference's, up to the first step where the reference's top two
logits are closer than bf16 resolves (``tie_step``).

Needs torch and transformers (on the GPU machine); the metrics alone need only NumPy.
"""
from __future__ import annotations

import contextlib
import copy

import numpy as np

from .config import LlamaConfig

# Two logits closer than one bf16 step (8 significant bits: a relative 2^-7 at most)
# of the larger cannot be ordered by a bf16 model: greedy choices there are ties.
BF16_RESOLUTION = 2.0 ** -7


# -- the metrics (NumPy, float64) -------------------------------------------------------------

def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities in float64."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_rows(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(reference || other) of each row's softmax, over the full vocabulary, in float64."""
    lp, lq = log_softmax(reference), log_softmax(other)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def top2_gaps(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(top1 - top2, top1) of each row."""
    top = -np.partition(-np.asarray(logits, np.float64), 1, axis=-1)[..., :2]
    return top[..., 0] - top[..., 1], top[..., 0]


def tie_step(reference_logits: np.ndarray) -> int | None:
    """The first row whose top two logits are closer than bf16 resolves
    (gap < 2^-7 * |top1|), or None: greedy tokens are comparable before it."""
    gap, top1 = top2_gaps(reference_logits)
    close = np.flatnonzero(gap < BF16_RESOLUTION * np.abs(top1))
    return int(close[0]) if close.size else None


def first_mismatch(a, b) -> int | None:
    """The first index where two token sequences differ (over their common length), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if int(x) != int(y):
            return i
    return None


# -- Hugging Face -------------------------------------------------------------------------------

def hf_config(cfg: LlamaConfig):
    """The transformers ``LlamaConfig`` of ``cfg``, with eager attention (the protocol's)."""
    from transformers import LlamaConfig as HFConfig
    d = cfg.to_dict()
    scaling = cfg.rope_scaling or {}
    # llama3 RoPE expects a context longer than its original one (Llama-3.2 ships 131072)
    d["max_position_embeddings"] = int(scaling.get("factor", 1) * scaling.get("original_max_position_embeddings",
                                                                               8192))
    hf = HFConfig(**d)
    hf._attn_implementation = "eager"
    return hf


def build_hf_model(cfg: LlamaConfig, seed: int, device: str = "cuda"):
    """A random ``LlamaForCausalLM`` of ``cfg``, initialised as Hugging Face initialises it
    (normal(0, 0.02) matrices, unit norms) from ``torch.manual_seed(seed)`` on ``device``,
    then cast to bf16: the weights every implementation runs."""
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(hf_config(cfg))
    # .to() casts every floating buffer, RoPE's inverse frequencies too; they stay float32,
    # as from_pretrained(dtype=torch.bfloat16) leaves them
    model = to_bf16(model)
    if device != "cpu":
        torch.cuda.synchronize()
    return model


def to_bf16(model):
    """``model`` cast to bf16 for inference, RoPE's inverse frequencies left in float32 (as
    from_pretrained(dtype=torch.bfloat16) leaves them; .to() would cast every buffer)."""
    import torch
    rope = {(m, n): b.clone() for m in model.modules() for n, b in m._buffers.items() if n.endswith("inv_freq")}
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    for (module, name), buf in rope.items():
        module._buffers[name] = buf
    return model


def hf_from_weights(cfg: LlamaConfig, weights: dict, dtype: str = "float32", device: str = "cpu"):
    """Hugging Face's ``LlamaForCausalLM`` of ``cfg`` holding ``weights`` (bf16 NumPy arrays by
    Hugging Face name, as ``read_gguf`` or ``load_checkpoint`` give them), promoted to float32,
    then in ``dtype`` ("float32" or "bfloat16") on ``device``: the same weights as deviceop's."""
    import torch
    from transformers import LlamaForCausalLM
    with torch.device(device):
        model = LlamaForCausalLM(hf_config(cfg)).eval().requires_grad_(False)
    state = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"the weights do not fit the model: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return to_bf16(model) if dtype == "bfloat16" else model


def reference_copy(model):
    """The same model with its bf16 weights promoted to float32 (the protocol's reference)."""
    return copy.deepcopy(model).float()


def deviceop_weights(model) -> tuple[dict, str]:
    """``model.state_dict()`` for ``Llama(cfg, weights)`` and how it travelled: zero-copy
    through DLPack (``dop.from_dlpack`` of the CUDA bf16 tensors), else, where that import
    fails, host bf16 copies (the first line of the error is in the returned note)."""
    import ml_dtypes
    import torch

    import deviceop as dop
    state = {k: v.detach() for k, v in model.state_dict().items()}
    probe = state["model.embed_tokens.weight"]
    try:
        t = dop.from_dlpack(probe)
        if str(t.dtype.name) != "bfloat16" or tuple(t.shape) != tuple(probe.shape):
            raise dop.DTypeError(f"from_dlpack gave {t.dtype.name} {tuple(t.shape)}")
        return state, "zero-copy (dop.from_dlpack of the state_dict's bf16 tensors)"
    except Exception as exc:  # any failure of the import is reported, and the copy path taken
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    host = {k: v.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16) for k, v in state.items()}
    return host, f"host copies (dop.from_dlpack failed: {why})"


@contextlib.contextmanager
def protocol_precision():
    """The protocol's torch settings: float32 matmuls in full float32 (no TF32), bf16
    reductions in float32; the previous settings come back afterwards."""
    import torch
    m = torch.backends.cuda.matmul
    saved = (torch.get_float32_matmul_precision(), m.allow_tf32, torch.backends.cudnn.allow_tf32,
             m.allow_bf16_reduced_precision_reduction)
    torch.set_float32_matmul_precision("highest")
    m.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    m.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        m.allow_tf32, torch.backends.cudnn.allow_tf32, m.allow_bf16_reduced_precision_reduction = saved[1:]


def rollout(model, prompt, steps: int, forced=None) -> tuple[list, np.ndarray]:
    """Hugging Face decode with a fresh cache: the prompt at once, then ``steps - 1`` single
    tokens.  Returns (tokens, float32 logits ``[steps, vocab]``): row 0 is the prompt's last
    position, row i the decode step that read token i - 1.  Greedy, or the ``forced`` tokens
    (teacher forcing).  Tokens stay on the device between steps (no host round trip)."""
    import torch
    from transformers import DynamicCache
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(prompt), dtype=torch.long, device=device)[None]
    forced_t = None if forced is None else torch.as_tensor(np.asarray(forced[:steps]), dtype=torch.long,
                                                           device=device)
    cache = DynamicCache(config=model.config)
    rows, tokens = [], []
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        for i in range(steps):
            logits = out.logits[0, -1].float()
            rows.append(logits)
            nxt = logits.argmax() if forced_t is None else forced_t[i]
            tokens.append(nxt)
            if i + 1 < steps:
                out = model(input_ids=nxt.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
        return [int(t) for t in torch.stack(tokens).cpu()], torch.stack(rows).cpu().numpy()


# -- a decode step in plain PyTorch (the benchmark's CUDA-graph baseline) ------------------------

class TorchDecodeStep:
    """One decode step of the model written in plain PyTorch: bf16 weights (q/k/v and gate/up
    rows stacked, as deviceop's), ``F.linear``, a static KV cache of ``capacity`` entries,
    ``F.scaled_dot_product_attention`` with GQA over the whole cache under a mask of the
    filled entries.  It reads the token and the position from device tensors and advances
    them (token = argmax, pos += 1), so one captured ``torch.cuda.CUDAGraph`` of ``step()``
    is every step: ``graph()`` captures it, ``replay`` runs one."""

    def __init__(self, cfg: LlamaConfig, state: dict, capacity: int):
        from .weights import layer_names
        emb = state["model.embed_tokens.weight"]
        self.embed = emb
        self.head = emb if cfg.tie_word_embeddings else state["lm_head.weight"]
        self.final_norm = state["model.norm.weight"]
        self.layers = [self._layer({k: state[n] for k, n in layer_names(i).items()})
                       for i in range(cfg.num_hidden_layers)]
        self._allocate(cfg, capacity, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size)

    @staticmethod
    def _layer(w: dict) -> tuple:
        """A layer's weights (short names, as weights.layer_names) as ``step`` reads them:
        q/k/v and gate/up rows stacked, as deviceop's."""
        import torch
        return (w["input_norm"], torch.cat([w["q"], w["k"], w["v"]]), w["o"], w["post_norm"],
                torch.cat([w["gate"], w["up"]]), w["down"])

    def _allocate(self, cfg: LlamaConfig, capacity: int, heads: int, kv_heads: int, vocab: int) -> None:
        """The step's state beside its weights, on their device: ``heads`` query and ``kv_heads``
        KV heads (a tensor-parallel rank's share: bench/tp_decode.py), logits over ``vocab``."""
        import torch
        self.cfg, self.capacity, self.heads, self.kv_heads = cfg, capacity, heads, kv_heads
        dev = self.embed.device
        shape = (cfg.num_hidden_layers, 1, kv_heads, capacity, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.embed.dtype, device=dev)  # bf16 (float32 only to test)
        self.v_cache = torch.zeros(shape, dtype=self.embed.dtype, device=dev)
        self.inv_freq = torch.as_tensor(cfg.inv_freq(), device=dev)
        self.slots = torch.arange(capacity, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.logits = torch.zeros(vocab, dtype=torch.float32, device=dev)
        self.graph = None

    def _rms(self, x, w):
        # Hugging Face's LlamaRMSNorm: statistics in float32, the product in the weights' dtype
        import torch
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def _rope(x, cos, sin):
        import torch
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def step(self) -> None:
        import torch
        import torch.nn.functional as F
        cfg = self.cfg
        hq, hkv, hd = self.heads, self.kv_heads, cfg.head_dim
        h = F.embedding(self.tok, self.embed)                                  # [1, D] bf16
        freqs = self.pos.float()[:, None] * self.inv_freq[None]                # float32, as Hugging Face
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        mask = (self.slots <= self.pos)[None, None, None]                      # the filled entries
        for layer, (n_in, w_qkv, w_o, n_post, w_gu, w_down) in enumerate(self.layers):
            qkv = F.linear(self._rms(h, n_in), w_qkv)
            q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
            q = self._rope(q.view(1, hq, 1, hd), cos, sin)
            k = self._rope(k.view(1, hkv, 1, hd), cos, sin)
            self.k_cache[layer].index_copy_(2, self.pos, k)
            self.v_cache[layer].index_copy_(2, self.pos, v.view(1, hkv, 1, hd))
            a = F.scaled_dot_product_attention(q, self.k_cache[layer], self.v_cache[layer], attn_mask=mask,
                                               enable_gqa=True)
            h = h + self._reduce(F.linear(a.reshape(1, hq * hd), w_o))
            gate, up = F.linear(self._rms(h, n_post), w_gu).chunk(2, dim=-1)
            h = h + self._reduce(F.linear(F.silu(gate) * up, w_down))
        logits = F.linear(self._rms(h, self.final_norm), self.head).float()[0]
        self.logits.copy_(logits)
        self._pick(logits)
        self.pos.add_(1)

    def _reduce(self, x):
        """The sum over tensor-parallel ranks of a projection's partial output (o, down); one rank's is its own."""
        return x

    def _pick(self, logits) -> None:
        """The next token: the argmax of the logits (a tensor-parallel rank's, across the shards)."""
        self.tok.copy_(logits.argmax().view(1))

    def capture(self) -> None:
        """Capture ``step()`` in a ``torch.cuda.CUDAGraph`` (after warm-up steps on a side
        stream, as torch asks); the cache and the position are reset afterwards."""
        import torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()
        self.reset()

    def reset(self) -> None:
        self.pos.zero_()
        self.k_cache.zero_()
        self.v_cache.zero_()

    def run(self) -> None:
        """One step: a graph replay once captured, else eager."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()

    def feed(self, token: int, pos: int) -> None:
        self.tok.fill_(int(token))
        self.pos.fill_(int(pos))
        self.run()

    def logits_along(self, tokens, positions) -> np.ndarray:
        """Teacher forcing: ``tokens`` read one position at a time; the logits at ``positions``."""
        import torch
        wanted = {p: i for i, p in enumerate(positions)}
        rows = [None] * len(wanted)
        for pos in range(max(wanted) + 1):
            self.feed(tokens[pos], pos)
            if pos in wanted:
                rows[wanted[pos]] = self.logits.clone()
        return torch.stack(rows).cpu().numpy()

    def greedy(self, prompt, steps: int) -> list:
        """``steps`` greedy tokens after ``prompt`` (the step chains token and position itself)."""
        out = []
        for pos, t in enumerate(prompt):
            self.feed(t, pos)
        out.append(self.tok.clone())
        for _ in range(steps - 1):
            self.run()
            out.append(self.tok.clone())
        import torch
        return [int(t) for t in torch.cat(out).cpu()]


# -- the whole comparison -----------------------------------------------------------------------

def compare(llama, reference, bf16_model, prompts, steps: int, *, torch_step: TorchDecodeStep | None = None,
            bf16_greedy: bool = False) -> dict:
    """The protocol over ``prompts``: per prompt, the reference's greedy tokens, the mean KL
    of each implementation's decode steps (rows 1..steps-1) on the reference's history, the
    reference's tie step and each implementation's first greedy mismatch; then the means
    over every (prompt, step).  ``llama``: deviceop's ``Llama``; ``torch_step``: the plain
    PyTorch step, if given; ``bf16_greedy``: also Hugging Face bf16's own greedy tokens."""
    per_prompt, kls = [], {"deviceop": [], "hf_bf16": []}
    if torch_step is not None:
        kls["torch_graph"] = []
    with protocol_precision():
        for prompt in prompts:
            prompt = [int(t) for t in prompt]
            p = len(prompt)
            canonical, ref_logits = rollout(reference, prompt, steps)
            history = prompt + canonical[:steps - 1]
            positions = range(p - 1, p + steps - 1)  # row i of each arm predicts canonical[i]
            arms = {"hf_bf16": rollout(bf16_model, prompt, steps, forced=canonical)[1],
                    "deviceop": llama.logits_along(history, positions)}
            if torch_step is not None:
                arms["torch_graph"] = torch_step.logits_along(history, positions)
            row = {"prompt": prompt, "reference_tokens": canonical, "tie_step": tie_step(ref_logits)}
            for name, logits in arms.items():
                kl = kl_rows(ref_logits[1:], logits[1:])
                kls[name].append(kl)
                row[f"kl_{name}"] = float(kl.mean())
                row[f"finite_{name}"] = bool(np.isfinite(logits).all())
            own = llama.generate(prompt, steps)
            row["deviceop_tokens"] = own
            row["deviceop_first_mismatch"] = first_mismatch(own, canonical)
            if bf16_greedy:
                row["hf_bf16_first_mismatch"] = first_mismatch(rollout(bf16_model, prompt, steps)[0], canonical)
            if torch_step is not None:
                row["torch_graph_first_mismatch"] = first_mismatch(torch_step.greedy(prompt, steps), canonical)
            per_prompt.append(row)
    means = {name: float(np.concatenate(v).mean()) for name, v in kls.items()}
    return {"steps": steps, "prompts": len(per_prompt), "mean_kl": means,
            "kl_excess_vs_hf_bf16": means["deviceop"] - means["hf_bf16"], "per_prompt": per_prompt}


def greedy_agrees(row: dict, who: str = "deviceop") -> bool:
    """``who``'s greedy tokens equal the reference's up to the reference's tie step."""
    mismatch, tie = row[f"{who}_first_mismatch"], row["tie_step"]
    return mismatch is None or (tie is not None and mismatch >= tie)
