"""Llama-3.2-1B decode (issue 27): deviceop against its memory floor, a
torch.cuda.CUDAGraph of the same step in plain PyTorch, Hugging Face generate,
and the float32 reference (KL), all in one process on the same weights.

The weights are Hugging Face's: a seeded random ``LlamaForCausalLM`` made on the
GPU in bf16 (examples/llama/hf.py), handed to deviceop through DLPack.

* Floor: bytes a token must read (every weight once, the tied head counted once,
  plus the K and V entries attention reads, averaged over the timed steps) / the
  device-to-device copy rate (bench/_copy.py, measured in this run).
* deviceop, one launch: a whole generation (32-token prompt, 128 new tokens) is one
  graph launch (a device loop); per token = (generation of 128 - generation of 1)
  / 127, GPU time between CUDA events, median of 5; host time of the launch.
  Per-token launches: the one-step graph replayed back to back (127 replays after
  the prompt, events around them), and ``Llama.stream`` (a host sync and a state
  read every token; wall time).
* torch.cuda.CUDAGraph: examples/llama/hf.py's TorchDecodeStep (bf16, static KV
  cache of the same capacity, SDPA with GQA over the masked cache, F.linear), one
  step captured, reading the token and position from device tensors; 127 replays
  after the prompt, median of 5.
* Hugging Face generate, eager (DynamicCache) and static cache + torch.compile
  (mode="reduce-overhead") in a child process (compiles while the KL runs; its
  failure's first line is reported); (generate of 128 - generate of 1) / 127.
* KL: the protocol of msaroufim/megakernels-vs-cuda-graphs (examples/llama/hf.py):
  8 seeded 32-token prompts, the float32 model's 128 greedy tokens, the 127 decode
  steps teacher-forced; mean KL(float32 || arm) over the vocabulary; greedy
  agreement up to the reference's first bf16 tie.
* Context 4096: a 3968-token prompt ingested by one generation (token by token),
  then 128 decode steps from that pre-filled cache in one launch (positions
  3967-4094), against the floor with those KV bytes.

    python bench/llama_decode.py [--prompts 8] [--seed 0]
    python bench/llama_decode.py --model 8b --no-torch-graph --no-compile   # Llama-3.1-8B's shape
    python bench/llama_decode.py --model smollm2 --no-compile               # SmolLM2-135M's shape
  The JSON: bench/results/llama_decode[_MODEL][_GPU].json (result_name: 1B on the H100 is
  llama_decode.json, 8B on an H200 llama_decode_8b_h200.json).
    python bench/llama_decode.py --smoke     # tiny config, a few steps; runs on the reference device too; no JSON
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "examples")]
import deviceop as dop  # noqa: E402
from _common import headline, print_headlines, print_table, write_result  # noqa: E402
from deviceop import api  # noqa: E402
from llama import hf  # noqa: E402
from llama.config import LLAMA_3_1_8B, LLAMA_3_2_1B, SMOLLM2_135M, TINY  # noqa: E402
from llama.generate import Llama  # noqa: E402
from llama.model import Sampling  # noqa: E402

GREEDY = Sampling()
# --config: the shapes the benchmark runs (random weights Hugging Face makes on the GPU)
CONFIGS = {"1b": LLAMA_3_2_1B, "8b": LLAMA_3_1_8B, "smollm2": SMOLLM2_135M}


# issue 37's targets, per (model, GPU kind): decode time / floor, and SmolLM2 against the torch graph
FLOOR_TARGETS = {("1b", "h100"): 1.06, ("1b", "h200"): 1.10, ("8b", "h100"): 1.05, ("8b", "h200"): 1.05,
                 ("smollm2", "h100"): 2.0, ("smollm2", "h200"): 2.0}
CTX_TARGET, SMOLLM2_VS_TORCH_GRAPH, TORCH_GRAPH_TARGET = 1.12, 5.0, 2.5


def bench_config(args):
    return TINY if args.smoke else CONFIGS[args.config]


def gpu_kind(name: str) -> str:
    """"h100", "h200", or the device's name in lower case: the suffix of its results."""
    for kind in ("H100", "H200", "B200", "A100"):
        if kind in name:
            return kind.lower()
    return "".join(c if c.isalnum() else "_" for c in name.lower())


def result_name(model: str, gpu: str) -> str:
    """bench/results/<this>.json: llama_decode for 1B on the H100 (the record before kinds were
    named), else the model and the GPU kind other than the H100 appended (llama_decode_8b_h200)."""
    return "llama_decode" + ("" if model == "1b" else f"_{model}") + ("" if gpu == "h100" else f"_{gpu}")


def headlines(model: str, gpu: str, vs_floor: float, vs_torch_graph: float | None, ctx: dict | None) -> list:
    """The headline names of issue 37: decode_vs_floor (1B on the H100), decode_vs_floor_h200,
    decode_vs_floor_8b, decode_vs_floor_smollm2 (each recorded with its GPU), _ctx4096 (1B),
    smollm2_speedup_vs_torch_graph; targets per (model, GPU) where the issue gives one."""
    name = "decode_vs_floor" + {"1b": "" if gpu == "h100" else f"_{gpu}"}.get(model, f"_{model}")
    heads = [headline(name, vs_floor, FLOOR_TARGETS.get((model, gpu), 1.10), "lower")]
    if vs_torch_graph is not None:
        heads.append(headline("smollm2_speedup_vs_torch_graph", vs_torch_graph, SMOLLM2_VS_TORCH_GRAPH, "higher")
                     if model == "smollm2" else headline("speedup_vs_torch_graph", vs_torch_graph,
                                                         TORCH_GRAPH_TARGET, "higher"))
    if ctx:
        heads.append(headline("decode_vs_floor_ctx4096", ctx["us_per_token"] / ctx["floor_us"], CTX_TARGET, "lower"))
    return heads


def median(xs) -> float:
    return float(statistics.median(xs))


# -- deviceop ---------------------------------------------------------------------------------

def time_device_loop(llama: Llama, prompt, n: int, reps: int) -> dict:
    """A whole generation in one graph launch (Llama.time_generation): GPU us per token over
    the steps after the prompt, and the host time of the launch."""
    return llama.time_generation(prompt, n, GREEDY, reps)


def time_step_launches(llama: Llama, prompt, n: int, reps: int) -> dict:
    """One graph launch per token: the step graph replayed back to back (GPU us per token
    over the n - 1 steps after the prompt), and Llama.stream's wall time per token."""
    stream, dec = llama.cuda_stream, llama.decoder
    prompt = np.asarray(prompt, np.int32)
    streamed = list(llama.stream(prompt, n))  # captures the step graph
    graph = llama._steps[llama._key(prompt.size, n, GREEDY)]
    gpu = []
    for _ in range(reps):
        dec.load_prompt(prompt)
        dec.start().sync_on(stream)
        for _ in range(prompt.size):  # the prompt; its last step samples the first token
            graph.replay()
        stream.synchronize()
        start = stream.record_event()
        for _ in range(len(streamed) - 1):
            graph.replay()
        end = stream.record_event()
        end.synchronize()
        gpu.append(start.elapsed_ms(end) * 1e3 / max(1, len(streamed) - 1))
    launched = dec.read_generated(prompt.size)
    walls = []
    for _ in range(max(1, reps // 2)):
        stamps = [time.perf_counter() for _ in llama.stream(prompt, n)]
        walls.append((stamps[-1] - stamps[0]) * 1e6 / max(1, len(stamps) - 1))
    return {"us_per_token": median(gpu), "stream_wall_us_per_token": median(walls), "tokens": launched,
            "stream_tokens": streamed}


def time_prefilled_decode(llama: Llama, prompt_len: int, n: int, reps: int, rng) -> dict:
    """Decode at a long context: a prompt of ``prompt_len`` tokens ingested once (one
    launch, token by token), then ``n`` decode steps from the filled cache in one launch
    (a device loop started at the prompt's last position), GPU us per step."""
    cfg, stream, dec = llama.cfg, llama.cuda_stream, llama.decoder
    prompt = rng.integers(0, cfg.vocab_size, prompt_len).astype(np.int32)
    t0 = time.perf_counter()
    llama.generate(prompt, 1)  # ingests the prompt: fills the cache at 0..prompt_len-1
    ingest_s = time.perf_counter() - t0  # (the first call also captures its graph)
    loop = dop.while_(dec.cond, lambda: dec.step(GREEDY, prompt_len, n)).graph_on(stream)
    state = dop.from_numpy(np.array([prompt_len - 1, 1, prompt[-1], 0], np.int32), stream=stream)
    runs = []
    for _ in range(reps):
        api.memcpy(dec.state, state).sync_on(stream)
        start = stream.record_event()
        loop.replay()
        end = stream.record_event()
        end.synchronize()
        generated = int(dec.state.numpy(stream=stream)[3])
        runs.append(start.elapsed_ms(end) * 1e3 / max(1, generated))
    dec.read_generated(prompt_len)  # raises if the device flagged a position or a token
    first, last = prompt_len - 1, prompt_len - 1 + generated - 1
    return {"us_per_token": median(runs), "generated": generated, "positions": [first, last],
            "mean_kv_length": (first + last) / 2 + 1, "ingest_s_with_capture": ingest_s}


# -- PyTorch and Hugging Face -----------------------------------------------------------------

class TorchTimer:
    """GPU time between CUDA events on a GPU; wall time on the CPU (the smoke run)."""

    def __init__(self, device):
        import torch
        self.torch, self.cuda = torch, device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def __call__(self, fn) -> float:
        """Microseconds of ``fn()``."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3


def time_torch_graph(step: hf.TorchDecodeStep, prompt, n: int, reps: int, timer: TorchTimer) -> float:
    """GPU us per token of n - 1 replays of the captured step after the prompt."""
    def decode():
        for _ in range(n - 1):
            step.run()
    runs = []
    for _ in range(reps):
        for pos, t in enumerate(prompt):
            step.feed(t, pos)
        timer.sync()
        runs.append(timer(decode) / (n - 1))
    return median(runs)


def hf_generate(model, prompt, k: int):
    import torch
    ids = torch.as_tensor(np.asarray(prompt)[None], dtype=torch.long, device=model.device)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                          do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()


def time_hf_generate(model, prompts, n: int, timer: TorchTimer) -> dict:
    """(generate n tokens - generate 1) / (n - 1), wall time ended by a sync; median over prompts."""
    hf_generate(model, prompts[0], 2)  # warm-up
    per, tokens = [], []
    for prompt in prompts:
        t1 = _wall(lambda: hf_generate(model, prompt, 1), timer)[0]
        tn, out = _wall(lambda: hf_generate(model, prompt, n), timer)
        per.append((tn - t1) / (n - 1))
        tokens.append(out)
    return {"us_per_token": median(per), "tokens": tokens}


def _wall(fn, timer: TorchTimer):
    timer.sync()
    t0 = time.perf_counter()
    out = fn()
    timer.sync()
    return (time.perf_counter() - t0) * 1e6, out


def compile_child(args) -> int:
    """The child process: Hugging Face generate with a static cache under
    torch.compile(mode="reduce-overhead").  Compiles and warms up, says ``ready``, waits
    for ``go`` on stdin (so that the parent's timings never overlap), then times."""
    import torch
    cfg = bench_config(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    say = lambda **kw: print(json.dumps(kw), flush=True)  # noqa: E731
    try:
        model = hf.build_hf_model(cfg, args.seed, device=device)
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, args.prompt_len)
        timer = TorchTimer(torch.device(device))
        t0 = time.perf_counter()
        for i, k in enumerate((args.new, 1, args.new)):  # compiles prefill and decode, then replays them
            hf_generate(model, prompt, k)
            say(stage=f"generate {i + 1} of 3 ({k} tokens) done at {time.perf_counter() - t0:.0f} s")
        say(ready=True, compile_s=time.perf_counter() - t0)
        if sys.stdin.readline().strip() != "go":
            return 0
        res = time_hf_generate(model, [prompt] * 3, args.new, timer)
        say(us_per_token=res["us_per_token"])
    except Exception as exc:  # the failure is the result: its first line goes to the parent
        say(error=f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}")
    return 0


class CompileRun:
    """The compile child, started early (it compiles on the CPU while the parent's
    untimed KL runs) and told to time only once the parent's timings are done."""

    def __init__(self, args, limit_s: float):
        import queue
        import tempfile
        import threading
        cmd = [sys.executable, __file__, "--compile-child", "--seed", str(args.seed), "--new", str(args.new),
               "--prompt-len", str(args.prompt_len), "--config", args.config] + (["--smoke"] if args.smoke else [])
        self.t0, self.limit = time.perf_counter(), limit_s
        self.errors = tempfile.TemporaryFile("w+")  # a file, not a pipe: compile logs cannot block the child
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors,
                                     text=True)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)  # the child's stdout closed

    def _next(self) -> dict | None:
        import queue
        try:
            msg = self.lines.get(timeout=max(0.0, self.limit - (time.perf_counter() - self.t0)))
        except queue.Empty:
            return None
        if msg is None:
            self.errors.seek(0)
            tail = [ln for ln in self.errors.read().splitlines() if ln.strip()]
            return {"error": tail[-1] if tail else f"the child exited with status {self.proc.wait()}"}
        return msg

    def result(self) -> dict:
        stage = "compiling the first generate"
        while True:
            msg = self._next()
            if msg is None or "error" in msg:
                self.proc.kill()
                self.proc.wait()
                return {"stage": stage, **(msg or {"error": f"not ready within {self.limit:.0f} s (stopped)"})}
            if "ready" in msg:
                break
            stage = msg["stage"]
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        out = self._next()
        self.proc.kill()
        self.proc.wait()
        return {**msg, **(out or {"error": f"not timed within {self.limit:.0f} s (stopped)"})}


# -- the benchmark ----------------------------------------------------------------------------

def run(args) -> int:
    import torch
    device = dop.Device(0)
    if device.is_reference and not args.smoke:
        print("llama_decode measures a GPU; this machine has only the reference device (try --smoke).")
        return 0
    cfg = bench_config(args)
    P, N, reps = args.prompt_len, args.new, args.reps
    tdev = torch.device("cpu" if device.is_reference else "cuda")
    timer = TorchTimer(tdev)
    began = time.perf_counter()
    log = lambda *a: print(f"[{time.perf_counter() - began:5.0f} s]", *a, flush=True)  # noqa: E731
    failures = []

    stream = device.new_stream()
    if device.is_reference:
        rate = 1e12  # the smoke run has no copy rate; its ratios mean nothing
    else:
        from _copy import copy_rate
        rate = copy_rate(stream)
    t0 = time.perf_counter()
    model = hf.build_hf_model(cfg, args.seed, device=tdev.type)
    weights, how = hf.deviceop_weights(model)
    llama = Llama(cfg, weights, capacity=args.capacity, stream=stream)
    setup_s = time.perf_counter() - t0
    log(f"weights: {cfg.weight_bytes() / 1e9:.3f} GB, {how}; set up in {setup_s:.1f} s; copy rate "
        f"{rate / 1e12:.3f} TB/s")
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, cfg.vocab_size, (args.prompts, P))
    floor_us = (cfg.weight_bytes() + cfg.kv_bytes(P + N // 2)) / rate * 1e6

    loop = time_device_loop(llama, prompts[0], N, reps)
    log(f"deviceop one launch: {loop['us_per_token']:.1f} us/token, host {loop['host_us']:.1f} us")
    steps = time_step_launches(llama, prompts[0], N, reps)
    log(f"deviceop per-token launches: {steps['us_per_token']:.1f} us/token; stream() "
        f"{steps['stream_wall_us_per_token']:.1f} us/token (wall)")
    if steps["tokens"] != loop["tokens"] or steps["stream_tokens"] != loop["tokens"]:
        failures.append("the per-token launches generated other tokens than the one launch")

    torch_step, torch_us = None, float("nan")
    if not args.no_torch_graph:
        torch_step = hf.TorchDecodeStep(cfg, model.state_dict(), capacity=args.capacity)
        if timer.cuda:
            torch_step.capture()
        torch_us = time_torch_graph(torch_step, prompts[0], N, reps, timer)
        log(f"torch.cuda.CUDAGraph (plain PyTorch step): {torch_us:.1f} us/token")

    hf_eager = time_hf_generate(model, list(prompts[:args.hf_prompts]), N, timer)
    log(f"Hugging Face generate, eager: {hf_eager['us_per_token']:.1f} us/token")

    ctx = time_prefilled_decode(llama, args.capacity - N, N, max(2, reps - 2), rng) if not args.no_ctx else None
    if ctx:
        ctx["floor_us"] = (cfg.weight_bytes() + cfg.kv_bytes(ctx["mean_kv_length"])) / rate * 1e6
        log(f"context {args.capacity}: {ctx['us_per_token']:.1f} us/token, floor {ctx['floor_us']:.1f} us")

    child = None if args.no_compile else CompileRun(args, args.compile_limit)
    t0 = time.perf_counter()
    reference = hf.reference_copy(model)
    report = hf.compare(llama, reference, model, prompts, N, torch_step=torch_step)
    del reference
    kl_s = time.perf_counter() - t0
    kl = report["mean_kl"]
    log(f"KL(fp32 || .) over {args.prompts} prompts x {N - 1} steps: " +
        ", ".join(f"{k} {v:.3e}" for k, v in kl.items()) + f" ({kl_s:.0f} s)")
    for i, row in enumerate(report["per_prompt"]):
        if i < len(hf_eager["tokens"]):
            row["hf_bf16_first_mismatch"] = hf.first_mismatch(hf_eager["tokens"][i], row["reference_tokens"])
        if not row["finite_deviceop"]:
            failures.append(f"prompt {i}: deviceop's logits are not finite")
    agree = [hf.greedy_agrees(row) for row in report["per_prompt"]]
    if not all(agree):
        failures.append(f"greedy tokens leave the reference before its bf16 tie for prompts "
                        f"{[i for i, a in enumerate(agree) if not a]}")
    compiled = child.result() if child else {"error": "not run (--no-compile)"}
    log(f"Hugging Face generate, static cache + torch.compile: {compiled}")

    # -- results ---------------------------------------------------------------------------------
    dl, pt = loop["us_per_token"], steps["us_per_token"]
    rows = [{"variant": "floor (weights + KV read / copy rate)", "us_per_token": round(floor_us, 1),
             "weight_bytes": cfg.weight_bytes(), "kv_bytes": cfg.kv_bytes(P + N // 2),
             "copy_rate_TBps": round(rate / 1e12, 3)},
            {"variant": "deviceop, one launch (device loop)", "us_per_token": round(dl, 1),
             "vs_floor": round(dl / floor_us, 3), "host_us_launch": round(loop["host_us"], 1),
             "generated": len(loop["tokens"])},
            {"variant": "deviceop, a graph launch per token", "us_per_token": round(pt, 1),
             "vs_floor": round(pt / floor_us, 3), "stream_wall_us_per_token": round(steps["stream_wall_us_per_token"], 1)},
            {"variant": "Hugging Face generate, eager", "us_per_token": round(hf_eager["us_per_token"], 1),
             "vs_floor": round(hf_eager["us_per_token"] / floor_us, 3)}]
    if torch_step is not None:
        rows.insert(3, {"variant": "torch.cuda.CUDAGraph, plain PyTorch step", "us_per_token": round(torch_us, 1),
                        "vs_floor": round(torch_us / floor_us, 3)})
    if "us_per_token" in compiled:
        rows.append({"variant": "Hugging Face generate, static cache + torch.compile", "us_per_token":
                     round(compiled["us_per_token"], 1), "vs_floor": round(compiled["us_per_token"] / floor_us, 3)})
    else:
        rows.append({"variant": "Hugging Face generate, static cache + torch.compile", "error": compiled["error"]})
    if ctx:
        rows.append({"variant": f"deviceop, context {args.capacity} (pre-filled cache, one launch)",
                     "us_per_token": round(ctx["us_per_token"], 1), "floor_us": round(ctx["floor_us"], 1),
                     "vs_floor": round(ctx["us_per_token"] / ctx["floor_us"], 3), "positions": ctx["positions"],
                     "kv_bytes": cfg.kv_bytes(ctx["mean_kv_length"])})
    for name, value in kl.items():
        rows.append({"variant": f"KL(float32 || {name})", "mean_kl": value})
    heads = headlines(args.config, gpu_kind(device.name), dl / floor_us, torch_us / dl if torch_step else None, ctx)
    heads += [headline("kl_excess_vs_hf_bf16", report["kl_excess_vs_hf_bf16"], 0.0, "lower"),
              headline("device_loop_host_us_128_tokens", loop["host_us"], 100, "lower")]
    per_prompt = [{k: v for k, v in row.items() if k not in ("prompt", "deviceop_tokens")}
                  for row in report["per_prompt"]]
    import transformers
    extra = {"transformers": transformers.__version__, "floor_us": round(floor_us, 1), "copy_rate_TBps": round(rate / 1e12, 3), "weights": how,
             "setup_s": round(setup_s, 1), "device_loop_vs_step_launches": round(dl / pt, 4),
             "kl": {"prompts": args.prompts, "steps": N - 1, "mean": kl,
                    "excess_vs_hf_bf16": report["kl_excess_vs_hf_bf16"], "per_prompt": per_prompt},
             "hf_compile": compiled, "context": ctx, "failures": failures}

    table = [[r["variant"], "failed" if "error" in r else r["us_per_token"] if "us_per_token" in r
              else f"{r['mean_kl']:.3e}",
              f"{r['vs_floor']:.3f}x" if "vs_floor" in r else "",
              f"{torch_us / r['us_per_token']:.2f}x" if r.get("us_per_token") and "deviceop" in r["variant"]
              and "context" not in r["variant"] and torch_step is not None else "",
              r.get("error", "")[:90]] for r in rows]
    print_table(f"Llama decode, {cfg.num_hidden_layers} layers, {P}-token prompt + {N} new, on {device.name}",
                ["variant", "us/token (or KL)", "vs floor", "speedup vs torch graph", "note"], table)
    print("tie steps (reference's first bf16 tie) / deviceop first mismatch: " +
          ", ".join(f"{r['tie_step']}/{r['deviceop_first_mismatch']}" for r in report["per_prompt"]))
    for f in failures:
        print("FAILED:", f)
    if args.smoke:
        print("smoke run: no JSON written")
        return 1 if failures else 0
    path = write_result(result_name(args.config, gpu_kind(device.name)), device, rows, heads,
                        {"config": args.config, "gpu": gpu_kind(device.name), **extra})
    print_headlines(heads, path)
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts of the KL protocol (default 8)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=128, help="tokens generated (default 128)")
    ap.add_argument("--capacity", type=int, default=4096, help="KV capacity, and the long context (default 4096)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5, help="timed runs per variant (medians)")
    ap.add_argument("--hf-prompts", type=int, default=3, help="prompts timed with Hugging Face generate")
    ap.add_argument("--compile-limit", type=float, default=150.0, help="seconds the compile child may take")
    ap.add_argument("--no-compile", action="store_true", help="skip Hugging Face + torch.compile")
    ap.add_argument("--no-ctx", action="store_true", help="skip the long-context decode")
    ap.add_argument("--model", "--config", dest="config", choices=sorted(CONFIGS), default="1b",
                    help="the model shape: Llama-3.2-1B (default), Llama-3.1-8B or SmolLM2-135M")
    ap.add_argument("--no-torch-graph", action="store_true", help="skip the plain-PyTorch CUDA-graph step "
                    "(its stacked weights cost another copy of q/k/v and gate/up: 9 GB at 8B)")
    ap.add_argument("--smoke", action="store_true", help="tiny config, 2 prompts x 8 tokens (no JSON)")
    ap.add_argument("--compile-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.prompt_len, args.new, args.capacity, args.reps, args.hf_prompts = 2, 8, 8, 64, 2, 1
    if args.compile_child:
        return compile_child(args)
    try:
        return run(args)
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
