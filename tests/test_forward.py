"""Seed 001's 22-layer forward, built with combinators and run eagerly, matches float64 NumPy."""
import sys
from pathlib import Path

import numpy as np
import pytest

import deviceop as dop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from token_model import Config, LayerBuffers, build_forward, numpy_forward, random_weights, sized  # noqa: E402
from deviceop.op import stats  # noqa: E402


# The seed's d=2048 costs seconds of float64 NumPy on the reference device (mostly the
# 184M random weights) and checks nothing d=512 does not: it runs in the full sweep (gpu-check).
@pytest.mark.parametrize("d", [512, pytest.param(2048, marks=pytest.mark.full_sweep)])
def test_22_layer_forward_matches_numpy(stream, rng, d):
    cfg = sized(d, 22)
    assert d != 2048 or cfg == Config(d=2048, n_layers=22)   # the seed's model, its launch shapes included
    weights, host = random_weights(cfg, seed=int(rng.integers(1 << 30)), stream=stream)
    x = rng.standard_normal(cfg.d).astype(np.float32)
    buffers = [LayerBuffers.allocate(cfg.d, stream) for _ in range(cfg.n_layers)]
    launches = stats["launches"]
    forward, out = build_forward(cfg, weights, dop.from_numpy(x, stream=stream), buffers)
    assert stats["launches"] == launches  # built, not run
    forward.sync_on(stream)
    assert stats["launches"] == launches + 4 * cfg.n_layers
    got = out.sync_on(stream).numpy()  # the shared output: cached, nothing re-runs
    assert stats["launches"] == launches + 4 * cfg.n_layers
    ref = numpy_forward(cfg, host, x)
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 1e-5


def test_buffers_claimed_by_a_forward_cannot_be_claimed_twice(stream):
    cfg = Config(d=256, n_layers=1, bk=2)
    weights, _ = random_weights(cfg, stream=stream)
    bufs = LayerBuffers.allocate(cfg.d, stream)
    keep = bufs.q.clone()  # someone else still holds the q buffer
    try:
        build_forward(cfg, weights, dop.empty(cfg.d), [bufs])
        raise AssertionError("expected an OwnershipError")
    except dop.OwnershipError as exc:
        assert "other live SharedTensor handle" in str(exc)
    keep.release()
