"""The fused layer kernels (kernels/fused.cu): RMSNorm folded into Q, the
residual folded into O; fp32 and bfloat16 weights; with and without PDL.

Device-agnostic except where marked: the reference device runs the NumPy
references; the H100 runs the kernels, in graphs with programmatic edges.
"""
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import deviceop as dop
from deviceop.kernels import matvec_add, rms_matvec, rms_matvec_bf16

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from token_model import (Config, bf16_weights, build_fused_forward, fused_buffers, numpy_forward,  # noqa: E402
                         random_weights)


def rel(got, ref):
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("k,bk", [(256, 2), (2048, 16)])
def test_rms_matvec_and_matvec_add_vs_float64(stream, rng, k, bk):
    n = 128
    x = rng.standard_normal((1, k)).astype(np.float32) * 3 + 1
    g = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    r = rng.standard_normal(n).astype(np.float32)
    t = lambda a: dop.from_numpy(a, stream=stream)  # noqa: E731
    out = dop.empty([n], stream=stream)
    rms_matvec(out.partition([16]), t(x), t(g), t(w), 1e-5).generics([16, bk, k]).sync_on(stream)
    x64 = x[0].astype(np.float64)
    ref = (w.astype(np.float64) @ (x64 * g)) / np.sqrt(np.mean(x64 * x64) + 1e-5)
    assert rel(out.numpy(), ref) < 1e-5
    out2 = dop.empty([n], stream=stream)
    matvec_add(out2.partition([16]), t(x), t(w), t(r)).generics([16, bk, k]).pdl().sync_on(stream)
    assert rel(out2.numpy(), r + w.astype(np.float64) @ x64) < 1e-5


def test_bf16_weights_accumulate_in_fp32(stream, rng):
    k, n = 2048, 64
    x = rng.standard_normal((1, k)).astype(np.float32)
    g = np.ones(k, np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(ml_dtypes.bfloat16)
    out = dop.empty([n], stream=stream)
    t = lambda a: dop.from_numpy(a, stream=stream)  # noqa: E731
    rms_matvec_bf16(out.partition([16]), t(x), t(g), t(w), 1e-5).generics([16, 8, k]).sync_on(stream)
    x64 = x[0].astype(np.float64)
    ref = (w.astype(np.float64) @ x64) / np.sqrt(np.mean(x64 * x64) + 1e-5)
    assert rel(out.numpy(), ref) < 1e-5          # exact weights, fp32 accumulation


def test_declarations_refuse_what_the_kernel_cannot_do(stream):
    out, x = dop.empty([128], stream=stream), dop.empty([1, 256], stream=stream)
    w, g = dop.empty([128, 256], stream=stream), dop.empty([256], stream=stream)
    with pytest.raises(dop.ShapeError, match="multiple of 32\\*BK\\*4"):
        rms_matvec(out.partition([16]), x, g, w, 1e-5).generics([16, 4, 256]).sync_on(stream)
    with pytest.raises(dop.DTypeError, match="bfloat16"):
        rms_matvec_bf16(out.partition([16]), x, g, w, 1e-5)
    with pytest.raises(dop.ShapeError, match="residual"):
        matvec_add(out.partition([16]), x, w, dop.empty([64], stream=stream)).generics([16, 2, 256]).sync_on(stream)


@pytest.mark.parametrize("bf16,pdl", [(False, False), (False, True), (True, True)])
def test_fused_forward_graph_matches_the_unfused_model(stream, bf16, pdl):
    cfg = Config(d=256, n_layers=3, bk=2)
    weights, host = random_weights(cfg, seed=3, stream=stream)
    if bf16:
        weights = bf16_weights(weights)
        host = [(n, wq.astype(ml_dtypes.bfloat16), wo.astype(ml_dtypes.bfloat16)) for n, wq, wo in host]
    x = dop.empty([cfg.d], stream=stream)
    graph = build_fused_forward(cfg, weights, x, fused_buffers(cfg, stream), pdl=pdl).graph_on(stream)
    out = graph.take_output()
    assert graph.summary()["nodes"] == 2 * cfg.n_layers
    for seed in range(3):
        xs = np.random.default_rng(seed).standard_normal(cfg.d).astype(np.float32)
        model = dop.GraphModel(graph, x, out)
        got = model.forward(dop.from_numpy(xs, stream=stream)).numpy()
        assert rel(got, numpy_forward(cfg, host, xs)) < 1e-5
