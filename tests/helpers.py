"""Helpers that several test files share, imported as ``helpers`` (pytest puts tests/
on sys.path, as running a test file as a script does)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def ranked_sum(xs, dtype, base=None):
    """What every rank of an all-reduce must hold: the fp32 sum in rank order, plus ``base``,
    rounded once to ``dtype``."""
    total = xs[0].astype(np.float32)
    for x in xs[1:]:
        total = total + x.astype(np.float32)
    if base is not None:
        total = base.astype(np.float32) + total
    return total.astype(dtype)


def calls_during(run, name) -> list:
    """What ``name(frame)`` says of each Python call ``run()`` makes, in order (a call it
    says None of is left out): a hot path's work counted, never timed."""
    calls = []

    def profile(frame, event, arg):
        if event == "call":
            said = name(frame)
            if said is not None:
                calls.append(said)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def gpu_count() -> int:
    """The CUDA devices this machine has (0 without a driver)."""
    from cuda.bindings import driver as cu
    return cu.cuDeviceGetCount()[1] if cu.cuInit(0)[0] == 0 else 0


def run_ranks(script: str, world: int, store) -> None:
    """``python script RANK WORLD STORE`` for every rank at once (the multi-GPU tests' rank
    processes, meeting through a file store; NVLink multicast off); fails naming each rank
    that did not exit 0, with the end of its output."""
    from deviceop.distributed.launch import NO_MULTICAST  # loads no NCCL
    env = dict(os.environ, **NO_MULTICAST, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, script, str(r), str(world), str(store)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0] + "\n[timed out]")
    failed = [(r, log) for r, (p, log) in enumerate(zip(procs, logs)) if p.returncode != 0]
    assert not failed, "\n".join(f"--- rank {r}:\n{log[-3000:]}" for r, log in failed)


def upload(a, stream):
    """``a`` as a float32 deviceop tensor on ``stream``."""
    import deviceop as dop
    return dop.from_numpy(np.asarray(a, dtype=np.float32), stream=stream)


class Boom(Exception):
    """The failure a test injects into an op or a capture."""


def boom(_=None):
    raise Boom("injected")
