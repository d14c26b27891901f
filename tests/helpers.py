"""Helpers that several test files share, imported as ``helpers`` (pytest puts tests/
on sys.path, as running a test file as a script does)."""
from __future__ import annotations

import sys

import numpy as np


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
