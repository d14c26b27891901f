"""Generation: a whole generation in one graph launch, or one launch per token.

    llama = Llama(cfg, weights, capacity=4096)
    tokens = llama.generate(prompt, max_new_tokens=128)          # one graph launch
    tokens = llama.generate(prompt, 128, prefill_chunk=16)       # the prompt 16 tokens a pass, still one launch
    for token in llama.stream(prompt, max_new_tokens=128):        # one graph launch a token
        print(token)

    llama = Llama(cfg, weights, tp=2)    # one process per GPU (torchrun / mpirun): this rank's share

Both capture their graph on first use and keep it for requests of the same
prompt length, token budget and sampling (the only values the graph bakes in;
the prompt itself, the position and the KV cache live in device memory).
"""
from __future__ import annotations

import numbers
import statistics
import threading
import time
from collections import OrderedDict

import numpy as np

import deviceop as dop

from .config import LlamaConfig
from .model import NONFINITE, LlamaDecoder, Sampling


STREAM_INTERRUPTED = ("this stream was interrupted: another generate, stream or logits_along on this Llama reloaded "
                      "its KV cache and decode state since the stream began; its next tokens would be garbage. "
                      "Start a new stream (one Llama serves one request at a time)")
MAX_GRAPHS = 16  # captured generations (and steps) a Llama keeps, the most recently used


class _Graphs(OrderedDict):
    """Captured graphs by request key, the MAX_GRAPHS most recently used kept, the others closed:
    every new seed, prompt length or token budget captures one, so a server's would otherwise
    grow with its requests."""

    def get(self, key, default=None):
        g = super().get(key, default)
        if g is not default:
            self.move_to_end(key)
        return g

    def __setitem__(self, key, graph) -> None:
        super().__setitem__(key, graph)
        self.move_to_end(key)
        while len(self) > MAX_GRAPHS:
            _, oldest = self.popitem(last=False)
            oldest.close()


NO_TP_PREFILL = ("chunked prefill is not tensor parallel yet: pass prefill_chunk=None with tp > 1 (the prompt is "
                 "then ingested token by token)")


class Llama:
    """``tp=N`` (or a ``group``): tensor parallel over the N ranks of a ``deviceop.distributed``
    group, one process per GPU; ``dist.init()`` makes the group from torchrun's or mpirun's
    environment when none is given.  Every rank passes the whole checkpoint (host arrays are
    memory-mapped; only the rank's blocks reach its GPU) and makes the same calls.
    ``allreduce``: "auto" (the O and down projections all-reduce their rows in their own epilogue,
    the other all-reduces are the one-shot kernel over peer memory, deviceop.distributed's
    PeerBuffers; NCCL where neither applies), "oneshot" (the one-shot kernel after each
    projection, unfused) or "nccl"."""

    def __init__(self, cfg: LlamaConfig, weights: dict, capacity: int = 4096, *, stream=None, pdl: bool = True,
                 prefill_chunk: int | None = None, tp: int | None = None, group=None, allreduce: str = "auto"):
        prefill_chunk = _numpy_int(prefill_chunk)
        _check_arguments(cfg, stream, pdl, prefill_chunk)  # of the right kind, before any group or buffer is made
        made = group is None
        group = self._group(cfg, tp, group)
        self._own_group = group if made else None  # made here from the launcher's environment: closed by close()
        try:
            if group is not None and group.world_size > 1 and prefill_chunk:  # (a group of one is TP=1)
                raise dop.ShapeError(NO_TP_PREFILL)
            self.group = group
            self.device = group.device if group is not None else dop.Device(0)
            if group is not None and stream is not None and getattr(stream, "device", None) is not group.device:
                raise dop.DistributedError(f"stream={stream!r} is not a stream of the group's device "
                                           f"({group.device.label}): pass group.stream, a stream of group.device, "
                                           "or none")
            self.cuda_stream = stream if stream is not None else self.device.new_stream()
            self._decoder = LlamaDecoder(cfg, weights, capacity, stream=self.cuda_stream, pdl=pdl, group=group,
                                         allreduce=allreduce)
        except BaseException as exc:  # the others must not wait for this rank in the group it made
            if self._own_group is not None:
                self._own_group.abort(f"Llama(...) failed on rank {group.rank}: {type(exc).__name__}")
            raise
        self.cfg = cfg
        self._loops = _Graphs()  # (prompt_len, max_new, sampling) -> graph of the whole generation
        self._steps = _Graphs()  # same key -> graph of one step
        self.prefill_chunk = prefill_chunk  # generate's default: None ingests the prompt token by token
        self._prefills: dict = {}  # chunk -> ChunkedPrefill (examples/llama/prefill.py)
        # One request at a time: the KV cache, the token buffer and the decode state are shared by every
        # call, so concurrent calls (threads) are serialised, and each request that loads a prompt bumps
        # the epoch, so that a stream started before it refuses to go on instead of yielding garbage.
        self._lock = threading.RLock()
        self._epoch = 0

    @property
    def decoder(self) -> LlamaDecoder:
        if self._decoder is None:
            raise dop.StateError("this Llama was closed: make a new one (Llama(cfg, weights, ...))")
        return self._decoder

    def close(self) -> None:
        """Free what the model holds besides its tensors: a tensor-parallel rank's private peer
        buffers, and the group (with its peer buffers) when ``tp=N`` made it (collective: every
        rank of the group calls it, after its last generation).  The captured generations are
        dropped; any later call raises StateError.  Idempotent."""
        with self._lock:  # after a request running on another thread, not in the middle of it
            self._close()

    def _close(self) -> None:
        if self._decoder is None:
            return
        self._epoch += 1  # a live stream now refuses to go on
        self.cuda_stream.synchronize()
        self._loops.clear()
        self._steps.clear()
        self._prefills.clear()
        decoder, self._decoder = self._decoder, None
        decoder.close()
        if self._own_group is not None:
            from deviceop.distributed.peer import peer_buffers
            bufs = peer_buffers(self._own_group)
            if bufs is not None:
                bufs.close()
            self._own_group.close()

    def __enter__(self) -> "Llama":
        self.decoder  # noqa: B018 (a closed Llama is refused here, not at its first request)
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    @staticmethod
    def _group(cfg: LlamaConfig, tp: int | None, group):
        """The tensor-parallel group (None at TP=1), checked against ``tp`` and the config."""
        import deviceop.distributed as dist

        from .tp import check_tp
        if tp is not None:
            check_tp(cfg, tp)  # before any process group is made (and tp=True is no tp=1)
        if group is not None and not isinstance(group, dist.Group):
            raise dop.DistributedError(f"group={group!r}: pass the group of dist.init() (or dist.run_reference's), "
                                       "or tp=N to make one from the launcher's environment")
        if group is None and tp in (None, 1):
            return None
        made = group is None
        if made:
            group = dist.init()
        try:
            if tp is not None and tp != group.world_size:
                raise dop.ShapeError(f"tp={tp} but the group has {group.world_size} ranks: launch {tp} processes "
                                     f"(torchrun --nproc-per-node {tp}) or pass tp={group.world_size}")
            check_tp(cfg, group.world_size)
        except BaseException:
            if made:  # refused: the group made for it is not left open
                group.abort("Llama(tp=...) refused the launcher's group")
            raise
        return group

    def _agree(self, *request) -> None:
        """Tensor parallel: every rank asks for the same thing, else all raise (see tp.agree)."""
        if self.group is not None:
            from .tp import agree
            agree(self.group, "the request (prompt, token budget, sampling)", request)

    def _key(self, prompt_len: int, max_new: int, sampling: Sampling) -> tuple:
        return prompt_len, max_new, sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed

    def generate(self, prompt, max_new_tokens: int = 128, sampling: Sampling | None = None, *,
                 graph: bool = True, prefill_chunk: int | None = None) -> list:
        """Prompt in, generated tokens out (stopping at EOS or ``max_new_tokens``).
        ``graph=False`` runs the same ops eagerly (a host loop, for checking).
        ``prefill_chunk`` (default: the constructor's): ingest the prompt that many tokens a
        pass over the weights (examples/llama/prefill.py) instead of one token a step.
        Thread-safe: concurrent requests on one Llama run one after the other."""
        with self._lock:
            return self._generate(prompt, max_new_tokens, sampling, graph, prefill_chunk)

    def _generate(self, prompt, max_new_tokens, sampling, graph, prefill_chunk) -> list:
        sampling = _sampling(sampling)
        if not isinstance(graph, bool):
            raise dop.ShapeError(f"graph={graph!r}: pass True (one graph launch) or False (the ops eagerly)")
        dec = self.decoder
        chunk = _numpy_int(prefill_chunk) if prefill_chunk is not None else self.prefill_chunk
        prefill = self._prefill(chunk) if chunk else None  # an unsupported chunk is refused here
        prompt = dec.check_request(prompt, max_new_tokens)
        self._agree(prompt.tobytes(), max_new_tokens, self._key(0, 0, sampling), chunk, graph)

        def generation():
            return (prefill or dec).generation(sampling, prompt.size, max_new_tokens)

        self._epoch += 1
        dec.load_prompt(prompt)
        if not graph:
            generation().sync_on(self.cuda_stream)
            return dec.read_generated(prompt.size)
        key = self._key(prompt.size, max_new_tokens, sampling) + ((chunk,) if chunk else ())
        g = self._loops.get(key)
        if g is None:
            g = self._loops[key] = generation().graph_on(self.cuda_stream)
        g.replay()
        self.cuda_stream.synchronize()
        return dec.read_generated(prompt.size)

    def _prefill(self, chunk: int):
        from .prefill import ChunkedPrefill
        if self.group is not None and self.group.world_size > 1:  # (its kernels read whole heads)
            raise dop.ShapeError(NO_TP_PREFILL)
        p = self._prefills.get(chunk)
        if p is None:
            p = self._prefills[chunk] = ChunkedPrefill(self.decoder, chunk)
        return p

    def logits_along(self, tokens, positions=None):
        """Teacher forcing: the decoder reads ``tokens`` one position at a time (the per-token
        graph, whatever it would have chosen) and returns the float32 logits it computed at each
        of ``positions`` (default: every position; a sequence of ints, repeats allowed),
        ``[len(positions), vocab]``; row i predicts the token after ``positions[i]``."""
        with self._lock:
            return self._logits_along(tokens, positions)

    def _logits_along(self, tokens, positions):
        dec = self.decoder
        try:
            n = len(tokens)
        except TypeError:  # no sequence at all: check_request names it
            n = 0
        if n >= dec.capacity:  # (check_request would speak of a prompt and "1 new" token the caller never asked for)
            raise dop.ShapeError(f"teacher forcing {n} tokens takes {n + 1} KV entries (the step after the last "
                                 f"token appends one) and the cache holds {dec.capacity}: build the Llama with "
                                 f"capacity >= {n + 1}, or pass fewer tokens")
        tokens = dec.check_request(tokens, 1)
        if positions is None:
            positions = range(tokens.size)
        elif isinstance(positions, (str, bytes)) or not hasattr(positions, "__iter__"):
            raise dop.ShapeError(f"positions={positions!r} must be a sequence of token positions "
                                 f"(e.g. [{tokens.size - 1}]), not a single value")
        positions = list(positions)
        bad = [p for p in positions if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Integral)
               or not 0 <= p < tokens.size]
        if not positions or bad:
            raise dop.ShapeError(f"positions must name tokens of the sequence [0, {tokens.size}); got "
                                 f"{bad[0] if bad else 'none'} (each an integer)")
        positions = [int(p) for p in positions]
        self._agree(tokens.tobytes(), positions)
        wanted: dict = {}  # position -> the rows asking for it (a position may be asked for twice)
        for i, p in enumerate(positions):
            wanted.setdefault(p, []).append(i)
        out = np.empty((len(positions), self.cfg.vocab_size), np.float32)
        logits = dec.vocab_logits
        greedy = Sampling()
        self._epoch += 1
        dec.load_prompt(tokens)
        key = self._key(tokens.size, 1, greedy) + ("logits",)
        g = self._steps.get(key)
        if g is None:
            g = self._steps[key] = dec.step(greedy, tokens.size, 1, gather_logits=True).graph_on(self.cuda_stream)
        dec.start().sync_on(self.cuda_stream)
        for pos in range(max(positions) + 1):
            g.replay()
            if pos in wanted:
                out[wanted[pos]] = logits.numpy(stream=self.cuda_stream)
        self.cuda_stream.synchronize()
        dec.check_errors(logits=False)  # raises if the device flagged a token or a position
        if not np.isfinite(out).all():
            raise dop.StateError(NONFINITE)
        return out

    def time_generation(self, prompt, max_new_tokens: int, sampling: Sampling | None = None,
                        reps: int = 5) -> dict:
        """A whole generation in one graph launch, timed: GPU µs per generated token over the
        steps after the prompt (a generation of ``max_new_tokens`` minus one of 1 token, over
        the tokens it generated less one), the host µs of the launch, medians of ``reps``."""
        with self._lock:
            return self._time_generation(prompt, max_new_tokens, sampling, reps)

    def _time_generation(self, prompt, max_new_tokens, sampling, reps) -> dict:
        sampling = _sampling(sampling)
        prompt = self.decoder.check_request(prompt, max_new_tokens)
        if isinstance(reps, bool) or not isinstance(reps, numbers.Integral) or reps < 1:
            raise dop.ShapeError(f"reps={reps!r}: time at least one replay (an integer >= 1)")
        stream = self.cuda_stream

        def timed(n):
            tokens = self.generate(prompt, n, sampling)  # captures and warms up
            graph = self._loops[self._key(prompt.size, n, sampling)]
            gpu, host = [], []
            for _ in range(int(reps)):
                self.decoder.load_prompt(prompt)
                start = stream.record_event()
                t0 = time.perf_counter()
                graph.replay()
                host.append((time.perf_counter() - t0) * 1e6)
                end = stream.record_event()
                end.synchronize()
                gpu.append(start.elapsed_ms(end) * 1e3)
            return statistics.median(gpu), statistics.median(host), tokens

        full, host, tokens = timed(max_new_tokens)
        one, _, _ = timed(1)
        return {"us_per_token": (full - one) / max(1, len(tokens) - 1), "host_us": host, "tokens": tokens,
                "generation_us": full}

    def stream(self, prompt, max_new_tokens: int = 128, sampling: Sampling | None = None):
        """Yield each generated token as soon as its step is done (one graph launch per token).
        The request is checked here, when ``stream`` is called; the generation starts at the
        first ``next``.  Another request on this Llama (any thread) before the stream ends
        interrupts it: its next ``next`` raises StateError rather than yield garbage."""
        sampling = _sampling(sampling)
        prompt = self.decoder.check_request(prompt, max_new_tokens)
        return self._stream(prompt, max_new_tokens, sampling)

    def _stream(self, prompt: np.ndarray, max_new_tokens: int, sampling: Sampling):
        with self._lock:
            dec = self.decoder
            self._agree(prompt.tobytes(), max_new_tokens, self._key(0, 0, sampling), "stream")
            self._epoch += 1
            mine = self._epoch
            dec.load_prompt(prompt)
            key = self._key(prompt.size, max_new_tokens, sampling)
            g = self._steps.get(key)
            if g is None:
                g = self._steps[key] = dec.step(sampling, prompt.size, max_new_tokens).graph_on(self.cuda_stream)
            dec.start().sync_on(self.cuda_stream)
        seen = 0
        while True:
            with self._lock:  # not held while the caller has a token: an abandoned stream blocks nobody
                dec = self.decoder  # closed meanwhile: StateError
                if self._epoch != mine:
                    raise dop.StateError(STREAM_INTERRUPTED)
                g.replay()
                self.cuda_stream.synchronize()
                state = dec.state.numpy(stream=self.cuda_stream)
                new = []
                if state[3] > seen:  # a new token: checked (error word, finite logits) before it is given out
                    new = dec.read_generated(prompt.size)[seen:]
                    seen = int(state[3])
            yield from new
            if state[1] == 0:
                return


def _check_arguments(cfg, stream, pdl, prefill_chunk) -> None:
    """Llama(...)'s arguments of the wrong kind, refused naming the fix (they failed later as raw
    AttributeErrors, or, for a chunk, only at the first generate)."""
    if not isinstance(cfg, LlamaConfig):
        raise dop.DTypeError(f"the config is a {type(cfg).__name__}, not a LlamaConfig: pass "
                             "LlamaConfig.from_dict(d) or LlamaConfig.from_json(path)")
    if stream is not None and not isinstance(stream, dop.Stream):
        raise dop.DTypeError(f"stream={stream!r} is not a deviceop stream: pass device.new_stream(), or none")
    if not isinstance(pdl, (bool, np.bool_)):
        raise dop.DTypeError(f"pdl={pdl!r}: pass True (programmatic dependent launch) or False")
    if prefill_chunk is not None and prefill_chunk is not False and prefill_chunk != 0:
        from deviceop.kernels import llama_prefill as pf

        from .config import kernel_limits
        kernel_limits(cfg)  # (the chunk's plans assume a served shape)
        pf.check_chunk(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                       cfg.head_dim, prefill_chunk)


def _numpy_int(v):
    """A NumPy integer as the int it holds (a chunk read from an array was refused as "not an int",
    where capacity and max_new_tokens take one); anything else as given, for the checks to judge."""
    return int(v) if isinstance(v, np.integer) else v


def _sampling(sampling) -> Sampling:
    """``sampling=`` as a Sampling (None: greedy), or a ShapeError saying how to make one."""
    if sampling is None:
        return Sampling()
    if not isinstance(sampling, Sampling):
        raise dop.ShapeError(f"sampling={sampling!r} is not a Sampling: pass Sampling(temperature=..., top_k=..., "
                             "top_p=..., seed=...) from examples/llama/model.py, or None for greedy")
    return sampling
