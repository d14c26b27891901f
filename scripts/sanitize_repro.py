#!/usr/bin/env python3
"""Reproducers for compute-sanitizer on the Llama kernels (issue 32 item 25).

Each *case* launches one thing on the GPU in one launch mode and checks its
result against NumPy; ``table`` runs every (case, tool) pair as its own
process under ``compute-sanitizer --tool TOOL`` (tool ``none``: no sanitizer,
the control) and prints one row per pair: exit status, the tool's error count,
whether the case's result matched, and the tool's first report.  One GPU call
answers many questions; docs/robustness.md ("Sanitizers") keeps what it showed.

    python3 scripts/sanitize_repro.py list
    python3 scripts/sanitize_repro.py case qkv-tiny:pdl          # one case, in this process
    python3 scripts/sanitize_repro.py table --group 'none,synccheck|sys|qkv-*:* stage-*:pdl'
    python3 scripts/sanitize_repro.py rows -k llama      # gpu-check's sanitizer rows, side by side

A group is ``TOOLS|SANITIZERS|PATTERNS[|OPTIONS]``; sanitizer ``sys`` is gpu-check's
find_sanitizer(), ``new`` the one ``--new-sanitizer`` names.  Logs: $OUT/repro-logs.

Cases (``KERNEL:MODE``):

* kernels: ``qkv-*`` (kernels/llama_proj.cu's rms_qkv_rope at a shape), ``stage-*``
  (llama_common.cuh's StageX alone: load_g, issue, commit, the staged x written
  out), ``cont-*`` (the same pattern in 20 lines without llama_common.cuh);
* ``bar-1w``, ``bar-3w`` (a barrier every thread reaches, converged: 1 or 3 warps) and
  ``nobar`` (no barrier, no shared memory): kernels correct by construction;
* modes: ``eager`` (one launch, no PDL), ``pdl`` (two launches, the second a
  programmatic dependent launch), ``graph`` (those two captured and replayed),
  ``loop`` (those two as the body of a 3-iteration ``dop.loop``: a conditional
  WHILE node whose control kernel is itself a PDL launch), ``loop-nopdl`` (the
  body's launches without PDL), ``loop-plain`` (no PDL at all, the control kernel
  too), ``if`` (those two in a ``dop.if_``: an IF node, run once); ``qkv-*`` also
  ``chain`` (``chain-nopdl``): after embed_gather writes its input, with (without) PDL;
* the tiny Llama decoder (examples/llama, tests/test_llama_model.py's model):
  ``llama:generate`` (one graph, a device loop), ``llama:eager`` (graph=False),
  ``llama:stream`` (one graph a token), ``llama:sample`` (a sampled generation),
  ``llama-nopdl:*`` the same without PDL, ``llama-plainctl:generate`` (``llama-nopdl-plainctl``)
  with the loop's control kernel launched without PDL, ``llama-prefill:*`` with the chunked
  prefill (chunks of 16: examples/llama/prefill.py);
* ``pytest:FILE`` runs tests/FILE.py (e.g. ``pytest:test_llama_attn``).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
sys.path.insert(0, str(ROOT))

# -- the standalone kernels ---------------------------------------------------------------------

MINI_SOURCE = Path(__file__).with_suffix(".cu")  # the standalone kernels


def _mini_kernels():
    import numpy as np
    from deviceop.kernel import In, InOut, Kernel, Out

    def stage_ref(g, ss, staged, x, gw):
        x64 = x.astype(np.float64)
        ss[...] = np.sum(x64 * x64)
        staged[...] = (x64 * gw.astype(np.float64))[None, :]

    def cont_ref(g, out, staged, x):
        x64 = x.astype(np.float64)
        out[...] = np.sum(x64 * x64)
        staged[...] = x64[::-1][None, :]

    stage = Kernel("stage_only", MINI_SOURCE,
                   [Out("ss", "float32", shape=("G",)), InOut("staged", "float32", shape=("G", "K")),
                    In("x", "float32", shape=("K",)), In("g", "bfloat16", shape=("K",))],
                   generics=["K", "W", "PDL", "MINB", "DYN"], block="32*W",
                   shared_mem=lambda g: 4 * g["K"] if g["DYN"] else 0, include_dirs=[KERNELS], reference=stage_ref)
    cont = Kernel("cont_sum", MINI_SOURCE,
                  [Out("out", "float32", shape=("G",)), InOut("staged", "float32", shape=("G", "Q")),
                   In("x", "float32", shape=("Q",))],
                  generics=["T", "Q", "PDL"], block="T", include_dirs=[KERNELS], reference=cont_ref)
    def probe_ref(g, out, x):
        out[...] = x[::-1][None, :]

    probes = {name: Kernel(name, MINI_SOURCE, [Out("out", "float32", shape=("G", "T"), tile=(1, "T")),
                                               In("x", "float32", shape=("T",))],
                           generics=["T"], block="T", include_dirs=[KERNELS], reference=probe_ref)
              for name in ("probe_bar", "probe_nobar")}
    return stage, cont, probes


# generics of the standalone kernels: (K, W, PDL, MINB, DYN) and (T, Q, PDL)
STAGE = {"stage-tiny": (256, 3, 1, 5, 0),         # rms_qkv_rope's stage in the tiny config: warp 0 stages x
         "stage-tiny-nopdl": (256, 3, 0, 5, 0),   # no griddepcontrol instructions
         "stage-tiny-minb1": (256, 3, 1, 1, 0),   # no min-CTAs launch bound
         "stage-tiny-dyn": (256, 3, 1, 5, 1),     # the stage in dynamic shared memory
         "stage-big-dyn": (16384, 8, 1, 1, 1),    # 64 KB of dynamic shared memory (past the 48 KB opt-in)
         "stage-allwarps": (768, 3, 1, 5, 0),     # K/8 = 96 = threads: every thread stages (mine() constant)
         "stage-1b": (2048, 6, 1, 2, 0)}          # Llama-3.2-1B's K with the 1B plan's 6 warps
CONT = {"cont-tiny": (96, 32, 0), "cont-tiny-pdl": (96, 32, 1), "cont-allwarps": (96, 96, 0)}
PROBE = {"bar-1w": ("probe_bar", 32), "bar-3w": ("probe_bar", 96), "nobar": ("probe_nobar", 96)}
# rms_qkv_rope shapes: (d, hq, hkv, hd, plan)
QKV = {"qkv-tiny": (256, 8, 2, 64, {}),                           # examples/llama's TINY: 128 CTAs of 3 warps
       "qkv-test3w": (256, 4, 2, 32, dict(ctas=4, warps=3, nb=3)),  # test_llama_proj's "warps-take-several-pairs"
       "qkv-allwarps": (768, 8, 2, 64, {}),                       # 3 warps, K/8 = 96: every thread stages x
       "qkv-1b": (2048, 32, 8, 64, {})}                           # Llama-3.2-1B: 6 warps, K = 2048
MODES = ("eager", "pdl", "graph", "loop", "loop-nopdl", "loop-plain", "if")
QKV_MODES = MODES + ("chain", "chain-nopdl")
LLAMA_MODES = ("generate", "eager", "stream", "sample")
PYTEST = ("test_llama_proj", "test_llama_attn", "test_llama_prefill", "test_llama_step", "test_llama_model")


def all_cases() -> list[str]:
    return ([f"{k}:{m}" for k in QKV for m in QKV_MODES] + [f"{k}:{m}" for k in [*STAGE, *CONT, *PROBE] for m in MODES]
            + [f"llama:{m}" for m in LLAMA_MODES] + ["llama-plainctl:generate", "llama-nopdl-plainctl:generate"]
            + [f"llama-prefill:{m}" for m in LLAMA_MODES]
            + [f"llama-nopdl:{m}" for m in LLAMA_MODES] + [f"pytest:{f}" for f in PYTEST])


# -- running one case ---------------------------------------------------------------------------

def _plain_control():
    """Launch the loops' control kernel without PDL (deviceop launches it as a PDL launch
    after the body on sm_90): a loop with no programmatic edge at all."""
    from deviceop.graph import loops
    loops._control_launcher = lambda stream, fn, start: fn.launch


def _run_modes(mode: str, build, stream):
    """Launch ``build(pdl)`` (a fresh op each call) in ``mode``."""
    import numpy as np
    import deviceop as dop
    if mode == "eager":
        build(False).sync_on(stream)
    elif mode == "pdl":
        dop.zip_(build(True), build(True)).sync_on(stream)
    elif mode == "graph":
        g = dop.zip_(build(True), build(True)).graph_on(stream)
        g.replay()
        g.replay()
        stream.synchronize()
    elif mode.startswith("loop"):
        pdl = mode == "loop"
        if mode == "loop-plain":
            _plain_control()
        index = dop.from_numpy(np.array([-1], np.int32), stream=stream)
        g = dop.loop(3, index, lambda i: dop.zip_(build(pdl), build(pdl))).graph_on(stream)
        g.replay()
        stream.synchronize()
        if int(index.numpy(stream=stream)[0]) != 3:
            raise AssertionError("the loop did not run 3 iterations")
    elif mode == "if":
        cond = dop.from_numpy(np.ones(1, np.int32), stream=stream)
        g = dop.if_(cond, lambda: dop.zip_(build(True), build(True))).graph_on(stream)
        g.replay()
        stream.synchronize()
    else:
        raise SystemExit(f"unknown mode {mode}")


def _case_stage(name: str, mode: str, rng, stream):
    import ml_dtypes
    import numpy as np
    import deviceop as dop
    stage, cont, probes = _mini_kernels()
    G = 128
    if name in PROBE:
        kname, T = PROBE[name]
        x = rng.standard_normal(T, dtype=np.float32)
        ss = dop.from_numpy(np.full((G, T), np.nan, np.float32), stream=stream)
        staged, xd = ss, dop.from_numpy(x, stream=stream)
        build = lambda pdl: probes[kname](ss.partition([1, T]), xd).generics([T]).pdl(pdl)  # noqa: E731
        want_ss, want_staged = x[::-1][None, :], x[::-1]
    elif name in STAGE:
        K = STAGE[name][0]
        x = rng.standard_normal(K, dtype=np.float32)
        gw = (1 + 0.1 * rng.standard_normal(K)).astype(ml_dtypes.bfloat16)
        ss, staged = dop.empty([G], stream=stream), dop.from_numpy(np.full((G, K), np.nan, np.float32), stream=stream)
        xd, gd = dop.from_numpy(x, stream=stream), dop.from_numpy(gw, stream=stream)
        build = lambda pdl: stage(ss.partition([1]), staged, xd, gd).generics(list(STAGE[name])).pdl(pdl)  # noqa: E731
        want_ss = float(np.sum(x.astype(np.float64) ** 2))
        want_staged = x.astype(np.float64) * gw.astype(np.float64)
    else:
        T, Q, _ = CONT[name]
        x = rng.standard_normal(Q, dtype=np.float32)
        ss, staged = dop.empty([G], stream=stream), dop.from_numpy(np.full((G, Q), np.nan, np.float32), stream=stream)
        xd = dop.from_numpy(x, stream=stream)
        build = lambda pdl: cont(ss.partition([1]), staged, xd).generics(list(CONT[name])).pdl(pdl)  # noqa: E731
        want_ss = float(np.sum(x.astype(np.float64) ** 2))
        want_staged = x.astype(np.float64)[::-1]
    _run_modes(mode, build, stream)
    got_ss, got_staged = ss.numpy(stream=stream), staged.numpy(stream=stream)
    ok = np.allclose(got_ss, want_ss, rtol=1e-5) and np.allclose(got_staged, want_staged[None, :], rtol=1e-6, atol=0)
    return ok, f"max |err| {float(np.max(np.abs(got_ss - want_ss))):.3g}"


def _case_qkv(name: str, mode: str, rng, stream):
    """rms_qkv_rope at a shape; mode ``chain`` (``chain-nopdl``): after embed_gather writes
    its input, as in the decoder's first layer, with (without) PDL."""
    import ml_dtypes
    import numpy as np
    import deviceop as dop
    sys.path.insert(0, str(ROOT / "tests"))
    from test_llama_proj import EPS, Qkv, assert_bf16_close, rel, t
    from deviceop.kernels import llama_proj as lp
    d, hq, hkv, hd, plan = QKV[name]
    case = Qkv(rng, stream, d=d, hq=hq, hkv=hkv, hd=hd, cap=8, **plan)
    pos = int(rng.integers(1, case.cap - 1))
    s = stream
    kc, vc = t(case.k0, s), t(case.v0, s)
    q, error = dop.empty([hq * hd], stream=s), t(np.zeros(1, np.int32), s)
    args = [t(case.norm_w, s), t(case.w, s), t(case.inv_freq, s), t(np.array([pos], np.int32), s)]

    def build(pdl, hidden):
        return lp.rms_qkv_rope(q.partition([case.tile]), hidden, *args, kc, vc, error, EPS, case.cap) \
            .generics(case.gen).pdl(pdl)

    if mode.startswith("chain"):
        pdl, vocab = mode == "chain", 16
        token = int(rng.integers(vocab))
        embed = rng.standard_normal((vocab, d)).astype(ml_dtypes.bfloat16)
        case.hidden = embed[token].astype(np.float32)
        hidden, (tile, gen) = dop.empty([d], stream=s), lp.embed_plan(d)
        dop.zip_(lp.embed_gather(hidden.partition([tile]), t(embed, s), t(np.array([token], np.int32), s), error,
                                 vocab).generics(gen).pdl(pdl), build(pdl, hidden)).sync_on(s)
    else:
        hidden = t(case.hidden, s)
        _run_modes(mode, lambda pdl: build(pdl, hidden), stream)
    q_ref, k_ref, v_ref = case.expect(pos)
    got_q, got_k, got_v = q.numpy(stream=s), kc.numpy(stream=s), vc.numpy(stream=s)
    assert_bf16_close(got_k[:, pos], k_ref)
    assert_bf16_close(got_v[:, pos], v_ref)
    err = rel(got_q, q_ref)
    return err < 1e-4 and int(error.numpy(stream=s)[0]) == 0, f"q rel err {err:.2e}, generics {case.gen}"


def _case_llama(pdl: bool, mode: str, chunk: int | None = None):
    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT / "tests"))
    from llama.config import TINY
    from llama.generate import Llama
    from llama.model import Sampling
    from llama.weights import random_weights
    from test_llama_model import CAP, assert_greedy_under_the_reference
    weights = random_weights(TINY, seed=11, std=0.1)
    model = Llama(TINY, weights, capacity=CAP, pdl=pdl, prefill_chunk=chunk)
    prompt = [5, 17, 923, 4, 4, 61]
    if chunk:
        prompt += [8, 800, 3, 3, 77, 12, 19, 1, 400, 2, 9, 90, 5]  # 19 tokens: a chunk of 16 and one of 3
    if mode == "sample":
        s = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
        got = model.generate(prompt, max_new_tokens=8, sampling=s)
        again = model.generate(prompt, max_new_tokens=8, sampling=s)
        return got == again and all(0 <= x < TINY.vocab_size for x in got), f"tokens {got}"
    if mode == "stream":
        got = list(model.stream(prompt, max_new_tokens=8))
    else:
        got = model.generate(prompt, max_new_tokens=8, graph=mode == "generate")
    assert_greedy_under_the_reference(weights, prompt, got)
    return True, f"tokens {got}"


def run_case(spec: str) -> int:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    kind, _, mode = spec.partition(":")
    if kind == "pytest":
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                f"tests/{mode}.py"], cwd=ROOT)
    import numpy as np
    import deviceop as dop
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    stream = dop.Device(0).new_stream()
    if kind.startswith("llama"):
        if kind.endswith("plainctl"):
            _plain_control()
        ok, detail = _case_llama(kind in ("llama", "llama-plainctl", "llama-prefill"), mode,
                                 16 if kind == "llama-prefill" else None)
    elif kind in QKV:
        ok, detail = _case_qkv(kind, mode, rng, stream)
    elif kind in STAGE or kind in CONT or kind in PROBE:
        ok, detail = _case_stage(kind, mode, rng, stream)
    else:
        raise SystemExit(f"unknown case {spec}; `list` prints them")
    print(f"CASE {'ok' if ok else 'MISMATCH'}: {spec}: {detail}", flush=True)
    return 0 if ok else 3


# -- the table ----------------------------------------------------------------------------------

_PYTEST = re.compile(r"^=* ?((\d+ \w+, )*\d+ (passed|failed|errors?|skipped)(, \d+ \w+)*)", re.M)
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?$|hazards displayed \((\d+) error", re.M)
_REPORT = re.compile(r"^========= +(Barrier error|Invalid|Race reported|Error|Program hit|Warning|.*[Hh]azard)")


def _first_report(text: str) -> str:
    """The tool's first report, else the last Python exception the case raised."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _REPORT.match(line) and "SUMMARY" not in line:
            return " | ".join(l.replace("=========", "").strip() for l in lines[i:i + 4])
    raised = [l for l in lines if re.match(r"^[\w.]+(Error|Exception): ", l)]
    return f"raised {raised[-1]}" if raised else ""


def run_job(job: dict, logs: Path, deadline: float) -> dict:
    case, tool, label, sanitizer, timeout = job["case"], job["tool"], job["label"], job["sanitizer"], job["timeout"]
    timeout = min(timeout, deadline - time.time())
    row = dict(case=case, tool=tool, sanitizer=label + ("+" if job["extra"] else ""))
    if timeout < 5:
        return dict(row, status="not run")
    if tool != "none" and not sanitizer:
        return dict(row, status="no sanitizer")
    cmd = [sys.executable, str(Path(__file__).resolve()), "case", case]
    if tool != "none":
        cmd = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--print-limit", "20", *job["extra"], *cmd]
    log = logs / f"{case.replace(':', '_')}.{tool}.{label}{'.x' if job['extra'] else ''}.log"
    t0 = time.time()
    with log.open("w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the sanitizer and the process it runs: the group this job made
            p.wait()
            rc = "timeout"
    text = log.read_text(errors="replace")
    found = _SUMMARY.findall(text)
    errors = int(next(x for x in found[-1] if x)) if found else None
    result = ("ok" if "CASE ok" in text else "MISMATCH" if "CASE MISMATCH" in text else
              (m[-1][0] if (m := _PYTEST.findall(text)) else "-"))
    if isinstance(rc, int) and rc < 0:
        rc = f"signal {-rc}"
    return dict(row, rc=rc, errors=errors, result=result, secs=round(time.time() - t0, 1),
                report=_first_report(text), log=log.name)


def _jobs(group: str, sanitizers: dict, timeout: float) -> list[dict]:
    """``TOOLS|SANITIZERS|PATTERNS[|OPTIONS]``: each tool (comma-separated) of each
    sanitizer label (sys, new) over the cases matching any pattern (space-separated),
    with extra compute-sanitizer OPTIONS."""
    parts = group.split("|")
    if len(parts) not in (3, 4):
        raise SystemExit(f"--group {group!r}: write TOOLS|SANITIZERS|PATTERNS[|OPTIONS]")
    tools, labels, patterns = parts[0].split(","), parts[1].split(","), parts[2].split()
    extra = parts[3].split() if len(parts) == 4 else []
    cases = [c for c in all_cases() if any(fnmatch.fnmatchcase(c, pat) for pat in patterns)]
    if not cases:
        raise SystemExit(f"--group {group!r}: no case matches {patterns}")
    return [dict(case=c, tool=tool, label=label if tool != "none" else "-", sanitizer=sanitizers.get(label),
                 timeout=timeout, extra=extra)
            for tool in tools for label in (labels if tool != "none" else labels[:1]) for c in cases]


def table(args) -> int:
    out = Path(os.environ.get("OUT") or args.out)
    logs = out / "repro-logs"
    logs.mkdir(parents=True, exist_ok=True)
    sanitizers = {"sys": args.sanitizer or _find_sanitizer(), "new": args.new_sanitizer}
    for label, path in sanitizers.items():
        v = subprocess.run([path, "--version"], capture_output=True, text=True) if path else None
        print(f"sanitizer {label}: {path}: {v and ' '.join(v.stdout.split()[-6:])}", flush=True)
    jobs = [j for g in args.group for j in _jobs(g, sanitizers, args.timeout)]
    deadline = time.time() + args.budget
    os.environ.setdefault("DEVICEOP_CACHE_DIR", "/tmp/deviceop-repro-cache")
    os.environ.setdefault("DEVICEOP_FULL_SWEEP", "0")
    controls = [j for j in jobs if j["tool"] == "none"]   # first: they fill the compile cache
    rest = sorted((j for j in jobs if j["tool"] != "none"),  # the long ones first
                  key=lambda j: (not j["case"].startswith("pytest:"), not j["case"].startswith("llama")))
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda j: run_job(j, logs, deadline), controls))
        rows += list(pool.map(lambda j: run_job(j, logs, deadline), rest))
    print(f"\n{'case':26} {'tool':9} {'san':4} {'rc':>9} {'errors':>6} {'result':14} {'s':>5}  first report")
    for r in rows:
        print(f"{r['case']:26} {r['tool']:9} {r['sanitizer']:4} {str(r.get('rc', '-')):>9} "
              f"{str(r.get('errors', '-')):>6} {r.get('result', r.get('status', '')):14} {r.get('secs', 0):5.0f}  "
              f"{r.get('report', '')[:240]}")
    (out / "repro.json").write_text(json.dumps(rows, indent=1))
    return 0


def _gpu_check():
    """scripts/gpu-check as a module (its sanitizer rows and find_sanitizer)."""
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(ROOT / "scripts" / "gpu-check"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_check", loader))
    loader.exec_module(module)
    return module


def _find_sanitizer():
    return _gpu_check().find_sanitizer()


def rows(args) -> int:
    """gpu-check's --sanitize rows (the control and each tool, its SANITIZE_* settings), run
    side by side instead of one after the other: one GPU call measures them all."""
    gc = _gpu_check()
    sanitizer = args.sanitizer or gc.find_sanitizer()
    logs = Path(os.environ.get("OUT") or args.out) / "gpu-check-logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
               PYTHONUNBUFFERED="1", DEVICEOP_FULL_SWEEP="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env.setdefault("DEVICEOP_CACHE_DIR", "/tmp/deviceop-gpu-check-cache")
    tools = args.tools.split(",")
    with ThreadPoolExecutor(len(tools) + 1) as pool:
        control = pool.submit(gc.sanitize_control, sanitizer, logs, env, args.timeout)
        found = list(pool.map(lambda t: gc.sanitize(t, sanitizer, logs, env, args.k, args.timeout), tools))
    print(f"sanitize control: {control.result()}")
    for tool, (ok, errors, detail) in zip(tools, found):
        print(f"sanitize {tool}: {'PASS' if ok else 'FAIL'}: {detail}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    c = sub.add_parser("case")
    c.add_argument("spec")
    t = sub.add_parser("table")
    t.add_argument("--group", action="append", required=True,
                   help="TOOLS|SANITIZERS|PATTERNS[|OPTIONS], e.g. 'none,synccheck|sys|qkv-*:* llama:*' (repeatable)")
    t.add_argument("--sanitizer", default=None, help="compute-sanitizer (default: gpu-check's find_sanitizer)")
    t.add_argument("--new-sanitizer", default=None, help="a second compute-sanitizer to compare (label 'new')")
    t.add_argument("--jobs", type=int, default=8)
    t.add_argument("--timeout", type=float, default=120, help="seconds per job")
    t.add_argument("--budget", type=float, default=600, help="seconds for the whole table")
    t.add_argument("--out", default="sanitize-repro-out")
    r = sub.add_parser("rows", help="gpu-check's sanitizer rows, side by side")
    r.add_argument("-k", default=None, help="pytest -k expression (gpu-check's --sanitize-k)")
    r.add_argument("--tools", default="memcheck,racecheck,synccheck")
    r.add_argument("--sanitizer", default=None)
    r.add_argument("--timeout", type=int, default=600, help="seconds per tool")
    r.add_argument("--out", default="sanitize-repro-out")
    args = ap.parse_args()
    if args.cmd == "list":
        print("\n".join(all_cases()))
        return 0
    if args.cmd == "case":
        return run_case(args.spec)
    return rows(args) if args.cmd == "rows" else table(args)


if __name__ == "__main__":
    sys.exit(main())
