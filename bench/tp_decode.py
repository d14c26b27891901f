"""Tensor-parallel Llama decode (issue 35): deviceop at TP=1, 2 and 4 against the step a
PyTorch user would write, and the latency of the all-reduce they both wait on; one run, one machine.

* deviceop: ``Llama(cfg, weights, group=...)`` (examples/llama), one process per GPU; a whole
  generation (32-token prompt, 128 new tokens) is one graph launch per rank, the all-reduces and the
  vocabulary-shard argmax inside its device loop; the O and down projections all-reduce in their
  epilogue and the others are the one-shot kernel over peer memory (``allreduce="auto"``); as more
  columns, the one-shot kernel after each projection, unfused (``"oneshot"``), and NCCL's
  (``"nccl"``); per token = (generation of N - generation of 1) / (N - 1), GPU time between CUDA
  events on rank 0, median of the reps (``Llama.time_generation``).
* PyTorch: examples/llama/hf.py's plain decode step cut Megatron-style (q/k/v heads, gate/up rows,
  o/down columns, vocabulary rows), an NCCL all-reduce (torch.distributed) after the O and down
  projections, the argmax across vocabulary shards as an all-gather of each rank's (max, index);
  captured in one torch.cuda.CUDAGraph per rank (nothing in the step syncs with the host: no
  indexing with a 0-d tensor); 127 replays after the prompt, median of 5.
* all-reduce: 8 KB (2048 float32, the 1B hidden vector) in a CUDA graph of 64 back to back,
  per op: torch.distributed's NCCL, deviceop's ``dist.all_reduce(algorithm="nccl")`` and its
  one-shot kernel over peer memory (``PeerBuffers.all_reduce``), without and with PDL
  (bench/allreduce.py is the all-reduce's own benchmark: sizes, bf16, NCCL symmetric windows).
* Weights: random bf16 (normal(0, 0.02) matrices, norms 1 + 0.1 normal) made on each GPU from a
  seeded generator per tensor, so every rank and every TP holds the same model; each rank keeps
  its share.  Greedy tokens of every TP are compared with TP=1's, up to the first step where
  TP=1's own top two logits are closer than bf16 resolves (its tie step: another summation order
  may pick either there).
* Fidelity at every TP: bench/llama_decode.py's protocol (``--kl-prompts`` prompts, ``--kl-steps``
  steps; examples/llama/hf.py's compare) on a Hugging Face model initialised from the seed: the
  mean KL of deviceop's teacher-forced logits against the float32 model, beside Hugging Face
  bf16's; headline ``tp_kl_excess_vs_hf_bf16`` (the largest over TP > 1) must be at most 0.

    python bench/tp_decode.py                                   # 1B and 8B at every TP the GPUs allow
    python bench/tp_decode.py --models 1b --tp 1 2 --new 32 --reps 3   # a short run
The parent starts one ``python -m torch.distributed.run --standalone --nproc-per-node N`` worker group
per (model, TP); rank 0 of each writes its results to a file the parent gathers into
bench/results/tp_decode.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "examples")]

from deviceop.distributed.launch import NO_MULTICAST  # noqa: E402 - after sys.path; loads no NCCL
from llama import hf  # noqa: E402 - NumPy only until a worker asks for torch
# NCCL's default graph-mixing support puts event nodes in a captured collective, which a conditional
# (dop.while_) body refuses: the "NCCL all-reduces" row's cuGraphInstantiate failed with INVALID_VALUE
# on 2x H200 (2026-11-27) and ran with this set to 0 (this benchmark never mixes graphs and eager NCCL)
NCCL_IN_LOOPS = {"NCCL_GRAPH_MIXING_SUPPORT": "0"}
os.environ.update(NO_MULTICAST)  # before NCCL loads, in the parent and in every worker
os.environ.update(NCCL_IN_LOOPS)

ALLREDUCE_FLOATS, ALLREDUCE_OPS = 2048, 64
SAMPLING_ARGS = dict(temperature=0.8, top_k=50, top_p=0.9, seed=7)
TARGETS = {"tp2_speedup_vs_tp1": 1.6, "tp2_speedup_vs_tp1_8b": 1.85, "tp4_speedup_vs_tp1_8b": 3.2,
           "allreduce_us_8kb_2gpu": 3.0}


def configs():
    from llama.config import LLAMA_3_1_8B, LLAMA_3_2_1B
    return {"1b": LLAMA_3_2_1B, "8b": LLAMA_3_1_8B}


# -- the worker: one rank of one (model, TP) --------------------------------------------------------

def gpu_weights(cfg, seed: int) -> dict:
    """Random bf16 weights made on this process's GPU, the same on every rank (a generator per tensor)."""
    import torch
    from llama.weights import expected_shapes
    out = {}
    gen = torch.Generator(device="cuda")
    for i, (name, shape) in enumerate(sorted(expected_shapes(cfg).items())):
        gen.manual_seed(seed * 1_000_003 + i)
        w = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32)
        out[name] = (1.0 + 0.1 * w if len(shape) == 1 else 0.02 * w).to(torch.bfloat16)
    torch.cuda.synchronize()
    return out


def torch_tp_step(cfg, weights: dict, capacity: int, rank: int, size: int):
    """examples/llama/hf.py's TorchDecodeStep on this rank's Megatron share, with NCCL all-reduces."""
    import torch
    import torch.distributed as tdist
    from llama.tp import Shard, shard_weights
    from llama.weights import layer_names

    class TorchTPStep(hf.TorchDecodeStep):
        """This rank's heads and vocabulary block; NCCL all-reduces after o and down; the argmax across ranks."""

        def __init__(self):
            sh = self.shard = Shard(cfg, rank, size)
            part = shard_weights(cfg, weights, sh, layer_names)
            self.embed, self.head, self.final_norm = part["embed"], part["head"], part["final_norm"]
            self.layers = [self._layer(w) for w in part["layers"]]
            self._allocate(cfg, capacity, sh.heads, sh.kv_heads, sh.vocab)
            self.pairs = torch.zeros(2 * size, dtype=torch.float32, device=self.embed.device)

        def _reduce(self, x):
            if size > 1:
                tdist.all_reduce(x)
            return x

        def _pick(self, logits):
            if size == 1:
                return super()._pick(logits)
            # each rank's (max, global index); the first rank of the largest wins (its index is lower)
            best, idx = logits.max(dim=0)
            tdist.all_gather_into_tensor(self.pairs, torch.stack([best, (idx + self.shard.vocab_offset).float()]))
            pairs = self.pairs.view(size, 2)
            self.tok.copy_(pairs[:, 1].gather(0, pairs[:, 0].argmax().view(1)).long())

    return TorchTPStep()


def time_torch(step, prompt, n: int, reps: int) -> float:
    """GPU us per token of n - 1 replays of the captured step after the prompt (this rank's events)."""
    import torch
    runs = []
    for _ in range(reps):
        for pos, t in enumerate(prompt):
            step.feed(t, pos)
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(n - 1):
            step.run()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / (n - 1))
    return statistics.median(runs)


def allreduce_rows(group, size: int, reps: int) -> list:
    """8 KB all-reduces in a graph of ALLREDUCE_OPS back to back: us per op, this rank's GPU time."""
    import numpy as np
    import torch
    import torch.distributed as tdist

    import deviceop as dop
    import deviceop.distributed as dist
    from _common import replay_us
    from deviceop.distributed.peer import peer_buffers
    rows = []
    x = torch.rand(ALLREDUCE_FLOATS, device="cuda") * 1e-3
    tdist.all_reduce(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(ALLREDUCE_OPS):
            tdist.all_reduce(x)
    runs = []
    for _ in range(reps + 2):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / ALLREDUCE_OPS)
    rows.append({"variant": f"all-reduce 8 KB fp32, {size} GPUs: torch.distributed NCCL in a torch.cuda.CUDAGraph",
                 "us_per_op": round(statistics.median(runs[2:]), 2)})
    stream = group.stream
    y = dop.from_numpy(np.random.default_rng(0).random(ALLREDUCE_FLOATS, dtype=np.float32) * 1e-3, stream=stream)
    bufs = peer_buffers(group) or dist.PeerBuffers(group, max_bytes=4 * ALLREDUCE_FLOATS)
    for name, build in (("deviceop dist.all_reduce, NCCL", lambda: dist.all_reduce(group, y, algorithm="nccl")),
                        ("deviceop one-shot (peer memory)", lambda: bufs.all_reduce(y)),
                        ("deviceop one-shot (peer memory), PDL", lambda: bufs.all_reduce(y).pdl())):
        try:
            graph = dop.zip_(*[build() for _ in range(ALLREDUCE_OPS)]).graph_on(stream)
            us = round(replay_us(graph, stream, per=ALLREDUCE_OPS, reps=reps), 2)
            rows.append({"variant": f"all-reduce 8 KB fp32, {size} GPUs: {name}, in a graph", "us_per_op": us})
        except Exception as exc:  # a row that failed says why; the others still run
            rows.append({"variant": f"all-reduce 8 KB fp32, {size} GPUs: {name}, in a graph", "us_per_op": None,
                         "reason": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:300]})
    bufs.check()
    return rows


def fidelity(cfg, group, args) -> dict:
    """bench/llama_decode.py's protocol at this TP (examples/llama/hf.py's compare): a Hugging Face
    model of ``cfg`` initialised from ``args.seed`` (the same on every rank), its float32 copy as the
    reference; deviceop's teacher-forced logits on the reference's greedy tokens against it, beside
    Hugging Face bf16's; every rank runs the same Hugging Face models on its GPU."""
    import numpy as np
    import torch

    from llama.generate import Llama
    model = hf.build_hf_model(cfg, args.seed, device="cuda")
    weights, _ = hf.deviceop_weights(model)
    llama = Llama(cfg, weights, capacity=args.prompt_len + args.kl_steps + 1, group=group)
    reference = hf.reference_copy(model)
    prompts = np.random.default_rng(args.seed + 1).integers(0, cfg.vocab_size, (args.kl_prompts, args.prompt_len))
    report = hf.compare(llama, reference, model, prompts, args.kl_steps)
    llama.close()  # every rank: its private peer buffers
    del llama, reference, model, weights
    torch.cuda.empty_cache()
    return {"prompts": args.kl_prompts, "steps": args.kl_steps, "mean_kl": report["mean_kl"],
            "kl_excess_vs_hf_bf16": report["kl_excess_vs_hf_bf16"],
            "greedy_agrees": [hf.greedy_agrees(r) for r in report["per_prompt"]]}


def worker(args) -> int:
    import numpy as np
    import torch

    import deviceop as dop
    from llama.generate import Llama
    from llama.model import Sampling
    from llama.plans import decode_kernels
    from llama.tp import Shard
    SAMPLING = Sampling(**SAMPLING_ARGS)
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    cfg = configs()[args.model]
    result = {"model": args.model, "tp": size, "device": torch.cuda.get_device_name()}
    began = time.perf_counter()

    def log(*a):
        if rank == 0:
            print(f"[{args.model} tp={size} {time.perf_counter() - began:5.0f} s]", *a, flush=True)
    try:
        group = None
        if size > 1:
            import torch.distributed as tdist

            import deviceop.distributed as dist
            tdist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
            group = dist.init()
        weights = gpu_weights(cfg, args.seed)
        prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, args.prompt_len)
        log(f"weights made ({cfg.weight_bytes() / 1e9:.2f} GB)")
        try:
            t0 = time.perf_counter()  # every kernel compiled at once, in parallel (not one by one at the capture)
            dop.precompile(decode_kernels(cfg, args.capacity, Shard(cfg, rank, size)))
            log(f"kernels compiled or loaded from the cache in {time.perf_counter() - t0:.1f} s")
            llama = Llama(cfg, weights, capacity=args.capacity, group=group)
            t = llama.time_generation(prompt, args.new, Sampling(), args.reps)
            result["deviceop"] = {"us_per_token": round(t["us_per_token"], 1), "host_us": round(t["host_us"], 1),
                                  "tokens": t["tokens"]}
            log(f"deviceop: {t['us_per_token']:.1f} us/token, host {t['host_us']:.1f} us")
            if size == 1:  # where TP=1's own top two logits are closer than bf16 resolves, another TP may differ
                first = args.prompt_len - 1
                rows = llama.logits_along(np.concatenate([prompt, t["tokens"]]),
                                          range(first, first + len(t["tokens"])))
                result["deviceop"]["tie_step"] = hf.tie_step(rows)
            result["sampled_tokens"] = llama.generate(prompt, 16, SAMPLING)
            llama.close()  # every rank: its private peer buffers
            for variant in ("oneshot", "nccl") if size > 1 else ():
                # the same with unfused one-shot and with NCCL's all-reduces (a failure is this row's: every
                # rank meets it alike)
                key = "deviceop_" + variant
                try:
                    llama = Llama(cfg, weights, capacity=args.capacity, group=group, allreduce=variant)
                    t = llama.time_generation(prompt, args.new, Sampling(), args.reps)
                    result[key] = {"us_per_token": round(t["us_per_token"], 1), "tokens": t["tokens"]}
                    log(f"deviceop, {variant} all-reduces: {t['us_per_token']:.1f} us/token")
                    llama.close()  # every rank: its private peer buffers
                except dop.DeviceOpError as exc:
                    result[key] = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"}
                    log(f"deviceop, {variant} all-reduces failed: {result[key]['error']}")
        except Exception as exc:  # e.g. a shape the kernels do not serve yet: reported, the rest still runs
            result["deviceop"] = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"}
            log(f"deviceop failed: {result['deviceop']['error']}")
            if size > 1:
                raise  # a TP rank that failed alone would leave the others in a collective
        step = torch_tp_step(cfg, weights, args.capacity, rank, size)
        step.capture()
        result["torch_graph_us_per_token"] = round(time_torch(step, prompt, args.new, args.reps), 1)
        log(f"torch.cuda.CUDAGraph TP step: {result['torch_graph_us_per_token']:.1f} us/token")
        del step
        if group is not None and args.model == args.models[0]:
            result["allreduce"] = allreduce_rows(group, size, args.reps)
            for r in result["allreduce"]:
                log(f"{r['variant']}: {r['us_per_op']} us")
        if args.kl_prompts:
            del weights
            torch.cuda.empty_cache()
            result["fidelity"] = fidelity(cfg, group, args)
            log(f"KL(float32 || .): {result['fidelity']['mean_kl']}")
    except Exception:
        traceback.print_exc()
        return 1
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))
    return 0


# -- the parent: every (model, TP), then the results file -----------------------------------------------

def launch(args, model: str, tp: int) -> dict:
    out = Path(tempfile.mkdtemp()) / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", __file__,
           "--worker", "--model", model, "--out", str(out), "--models", *args.models]
    for flag in ("seed", "prompt_len", "new", "reps", "capacity", "kl_prompts", "kl_steps"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, **NO_MULTICAST, **NCCL_IN_LOOPS, "PYTHONUNBUFFERED": "1"},
                          timeout=args.worker_timeout)
    if proc.returncode or not out.exists():
        return {"model": model, "tp": tp, "error": f"the worker group exited with status {proc.returncode}"}
    result = json.loads(out.read_text())
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["1b", "8b"], choices=["1b", "8b"])
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 2, 4], help="TP sizes (those above the GPU count "
                                                                         "are reported as not run)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=128, help="tokens generated (default 128)")
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5, help="timed runs per variant (medians)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kl-prompts", type=int, default=2, help="prompts of the KL protocol at every TP (0: none)")
    ap.add_argument("--kl-steps", type=int, default=16, help="decode steps a prompt of the KL protocol")
    ap.add_argument("--worker-timeout", type=float, default=900.0, help="seconds a worker group may take")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    import torch

    import deviceop as dop
    from _common import headline, print_headlines, print_table, write_result
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("tp_decode measures GPUs; this machine has none. Nothing to measure.")
        return 0
    results = {}
    for model in args.models:
        for tp in sorted(set(args.tp)):
            if tp > gpus:
                results[(model, tp)] = {"model": model, "tp": tp, "error": f"not run: {gpus} GPU(s) here"}
                continue
            print(f"== {model}, TP={tp}", flush=True)
            results[(model, tp)] = launch(args, model, tp)

    def us(model, tp, who="deviceop"):
        r = results.get((model, tp), {})
        return r.get(who, {}).get("us_per_token") if who == "deviceop" else r.get("torch_graph_us_per_token")

    rows, failures = [], []
    for (model, tp), r in results.items():
        row = {"variant": f"{model}, TP={tp}", "deviceop_us_per_token": us(model, tp),
               "deviceop_oneshot_unfused_us_per_token": r.get("deviceop_oneshot", {}).get("us_per_token"),
               "deviceop_nccl_allreduce_us_per_token": r.get("deviceop_nccl", {}).get("us_per_token"),
               "torch_graph_us_per_token": us(model, tp, "torch"),
               "deviceop_speedup_vs_tp1": ratio(us(model, 1), us(model, tp)) if tp > 1 else None,
               "torch_speedup_vs_tp1": ratio(us(model, 1, "torch"), us(model, tp, "torch")) if tp > 1 else None,
               "deviceop_vs_torch_graph": ratio(us(model, tp, "torch"), us(model, tp))}
        fid = r.get("fidelity")
        if fid:
            row.update(kl_deviceop=fid["mean_kl"]["deviceop"], kl_hf_bf16=fid["mean_kl"]["hf_bf16"],
                       kl_excess_vs_hf_bf16=fid["kl_excess_vs_hf_bf16"], greedy_agrees=all(fid["greedy_agrees"]))
            if not all(fid["greedy_agrees"]):
                failures.append(f"{model} TP={tp}: greedy tokens differ from the float32 reference's before its "
                                "first tie")
        for arm in ("deviceop_oneshot", "deviceop_nccl"):
            if "error" in r.get(arm, {}):
                row[f"{arm}_error"] = r[arm]["error"]
        if "error" in r or "error" in r.get("deviceop", {}):
            row["error"] = r.get("error") or r["deviceop"]["error"]
        base = results.get((model, 1), {}).get("deviceop", {})
        for arm in ("deviceop", "deviceop_oneshot", "deviceop_nccl"):
            mine = r.get(arm, {}).get("tokens")
            if tp > 1 and base.get("tokens") and mine:
                mismatch = hf.first_mismatch(base["tokens"], mine)
                if mismatch is None and len(base["tokens"]) != len(mine):
                    mismatch = min(len(base["tokens"]), len(mine))
                row[f"{arm}_greedy_first_mismatch_vs_tp1"], row["tp1_tie_step"] = mismatch, base.get("tie_step")
                if not hf.greedy_agrees({"deviceop_first_mismatch": mismatch, "tie_step": base.get("tie_step")}):
                    failures.append(f"{model} TP={tp} ({arm}): greedy tokens differ from TP=1's at step {mismatch}, "
                                    f"before TP=1's first bf16 tie ({base.get('tie_step')})")
        sampled, base_sampled = r.get("sampled_tokens"), results.get((model, 1), {}).get("sampled_tokens")
        if tp > 1 and sampled and base_sampled:
            row["sampled_tokens_equal_tp1"] = sampled == base_sampled
            if sampled != base_sampled:
                failures.append(f"{model} TP={tp}: sampled tokens ({SAMPLING_ARGS}) differ from TP=1's")
        rows.append(row)
        rows += r.get("allreduce", [])

    def head(metric, model, tp):
        value = ratio(us(model, 1), us(model, tp))
        if value is not None:
            return headline(metric, value, TARGETS[metric], "higher")
        why = (results.get((model, tp), {}).get("error") or results.get((model, tp), {}).get("deviceop", {})
               .get("error") or results.get((model, 1), {}).get("error")
               or results.get((model, 1), {}).get("deviceop", {}).get("error") or "not run")
        return {"metric": metric, "value": None, "target": TARGETS[metric], "better": "higher", "met": False,
                "reason": why if (model in args.models) else "not run (--models)"}
    heads = [head("tp2_speedup_vs_tp1", "1b", 2), head("tp2_speedup_vs_tp1_8b", "8b", 2),
             head("tp4_speedup_vs_tp1_8b", "8b", 4)]
    excess = [r["kl_excess_vs_hf_bf16"] for r in rows
              if "kl_excess_vs_hf_bf16" in r and not r["variant"].endswith("TP=1")]
    if excess:  # the issue's rule: at every TP, KL against float32 at most Hugging Face bf16's
        heads.append({**headline("tp_kl_excess_vs_hf_bf16", max(excess), 0.0, "lower"),
                      "note": "the largest over the models and TP > 1 run"})
    ar = [r for r in rows if r["variant"].startswith("all-reduce 8 KB fp32, 2 GPUs: deviceop") and r["us_per_op"]]
    if ar:
        best = min(ar, key=lambda r: r["us_per_op"])
        heads.append({**headline("allreduce_us_8kb_2gpu", best["us_per_op"], TARGETS["allreduce_us_8kb_2gpu"],
                                 "lower"), "variant": best["variant"]})
    else:
        heads.append({"metric": "allreduce_us_8kb_2gpu", "value": None, "target": TARGETS["allreduce_us_8kb_2gpu"],
                      "better": "lower", "met": False, "reason": "no 2-GPU run"})
    device = type("D", (), {"name": f"{gpus}x {torch.cuda.get_device_name(0)}"})()
    print_table(f"Tensor-parallel Llama decode, {args.prompt_len}-token prompt + {args.new} new, on {device.name}",
                ["variant", "deviceop us/token (or us/op)", "unfused one-shot", "NCCL all-reduces",
                 "torch graph us/token", "deviceop vs TP=1", "torch vs TP=1", "KL vs fp32: deviceop / HF bf16",
                 "note"],
                [[r["variant"], r.get("deviceop_us_per_token", r.get("us_per_op")),
                  r.get("deviceop_oneshot_unfused_us_per_token") or "",
                  r.get("deviceop_nccl_allreduce_us_per_token") or "",
                  r.get("torch_graph_us_per_token", ""), r.get("deviceop_speedup_vs_tp1") or "",
                  r.get("torch_speedup_vs_tp1") or "",
                  f"{r['kl_deviceop']:.3e} / {r['kl_hf_bf16']:.3e}" if "kl_deviceop" in r else "",
                  (r.get("error") or r.get("reason") or "")[:80]] for r in rows])
    for f in failures:
        print("FAILED:", f)
    path = write_result("tp_decode", device, rows, heads, {"gpus": gpus, "failures": failures,
                                                           "workers": [r for r in results.values()],
                                                           "deviceop_version": dop.__version__})
    print_headlines(heads, path)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
