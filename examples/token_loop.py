"""Seed 001's token loop end to end: a 22-layer, d=2048 model captured as one
CUDA graph, in both styles, replayed once per token.

* combinators: ``build_forward`` (examples/token_model.py) + ``graph_on``
* scope: ``CudaGraph.scope`` recording each launch imperatively

Warm-up, capture, a check of each graph against eager execution (max abs
difference printed), then tokens/s for eager and for each graph.  Without a
GPU it runs a small configuration on the reference device and says so.

``--device-loop``: all the tokens in one graph launch (``dop.loop``: a
conditional WHILE node runs the fused forward once per token, reading token t's
embedding from a preloaded [T, d] buffer and writing its output row), checked
row by row against the unfused eager path and timed against one graph launch
per token.

    python examples/token_loop.py [--d 2048] [--layers 22] [--tokens 512] [--fused] [--device-loop]

Flags are checked first: ``--d`` must be a multiple of 128 (256 with
``--fused``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import deviceop as dop  # noqa: E402
from deviceop import CudaGraph, GraphModel, api  # noqa: E402
from deviceop.kernels import add, matvec, rms_norm  # noqa: E402
from token_model import (HelpFormatter, LayerBuffers, bf16_weights, build_device_loop, build_forward,  # noqa: E402
                         build_fused_forward, fused_buffers, numpy_forward, positive, random_weights, size_problem,
                         sized)


def capture_combinators(cfg, weights, stream):
    """GraphModel over the combinator forward: input buffer -> graph -> output buffer."""
    x = dop.empty(cfg.d, stream=stream)
    buffers = [LayerBuffers.allocate(cfg.d, stream) for _ in range(cfg.n_layers)]
    forward, out = build_forward(cfg, weights, x, buffers)
    graph = forward.graph_on(stream)
    return GraphModel(graph, x, out.sync_on(stream))


def capture_scope(cfg, weights, stream):
    """The same model recorded imperatively; the hidden state lives in ``inp``."""
    d = cfg.d
    inp = dop.empty(d, stream=stream)
    raw = [[dop.empty(s, stream=stream) for s in ([1, d], [d], [d], [d])] for _ in range(cfg.n_layers)]

    def body(s):
        for w, (norm, q, o, res) in zip(weights, raw):
            s.record(rms_norm(norm.partition([1, d]), inp.view([1, d]), w.norm_w, cfg.eps).generics(cfg.rms_generics()))
            s.record(matvec(q.partition([cfg.bn]), norm, w.wq).generics(cfg.mv_generics()))
            s.record(matvec(o.partition([cfg.bn]), q.view([1, d]), w.wo).generics(cfg.mv_generics()))
            s.record(add(res.partition([cfg.block]), inp, o).generics([cfg.block]))
            s.record(api.memcpy(inp, res))

    graph = CudaGraph.scope(stream, body)
    return GraphModel(graph, inp, raw[-1][3])


def eager_forward(cfg, weights, x, raw, stream):
    """Build the combinator forward over fresh handles to ``raw`` buffers and run it eagerly."""
    bufs = [LayerBuffers(*(t.into_shared() for t in r)) for r in raw]
    forward, out = build_forward(cfg, weights, x, bufs)
    forward.async_on(stream)
    return out


def capture_fused(cfg, weights, host, embeddings, stream):
    """The fused model as graphs with PDL: fp32 weights, and bf16 weights (checked
    against float64 NumPy over the same bf16-rounded weights)."""
    import ml_dtypes
    models = {}
    for name, ws in [("graph fused fp32 + PDL", weights), ("graph fused bf16 + PDL", bf16_weights(weights))]:
        x = dop.empty(cfg.d, stream=stream)
        graph = build_fused_forward(cfg, ws, x, fused_buffers(cfg, stream), pdl=True).graph_on(stream)
        models[name] = GraphModel(graph, x, graph.take_output())
    hb = [(n, wq.astype(ml_dtypes.bfloat16), wo.astype(ml_dtypes.bfloat16)) for n, wq, wo in host]
    e = embeddings[0].numpy()
    ref = numpy_forward(cfg, hb, e)
    got = models["graph fused bf16 + PDL"].forward(embeddings[0]).numpy(stream=stream)
    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    print(f"graph fused bf16 + PDL: max |graph - float64 ref with bf16 weights| / max |ref| = {err:.2e}")
    if err > 1e-5:
        raise SystemExit("FAILED: the bf16 fused graph does not match its reference")
    return models


def run_device_loop(cfg, weights, raw, stream, tokens: int, timed: bool) -> int:
    """All ``tokens`` tokens in one graph launch, vs one graph launch per token."""
    d = cfg.d
    rng = np.random.default_rng(2)
    inputs = dop.from_numpy(rng.standard_normal((tokens, d)).astype(np.float32), stream=stream)
    outputs = dop.from_numpy(np.zeros((tokens, d), np.float32), stream=stream)
    index = dop.from_numpy(np.zeros(1, np.int32), stream=stream)
    loop = build_device_loop(cfg, weights, inputs, outputs, index, tokens, fused_buffers(cfg, stream), pdl=True,
                             stream=stream)
    graph = loop.graph_on(stream)
    t0 = time.perf_counter()
    graph.replay()
    host_us = (time.perf_counter() - t0) * 1e6
    stream.synchronize()
    wall = time.perf_counter() - t0
    got = outputs.numpy(stream=stream)
    worst = 0.0
    for t in sorted({0, 1, tokens // 2, tokens - 1}):  # rows checked against the unfused eager path
        ref = eager_forward(cfg, weights, inputs.view([tokens * d])[t * d:(t + 1) * d], raw, stream)
        ref = ref.sync_on(stream).numpy(stream=stream)
        worst = max(worst, float(np.max(np.abs(got[t] - ref)) / np.max(np.abs(ref))))
    print(f"device loop: max |row - eager| / max |eager| over 4 rows = {worst:.2e}")
    if worst > 1e-5:
        print("FAILED: the device loop does not reproduce eager execution")
        return 1

    # one graph launch per token: copy the row in, replay, copy the row out
    x = dop.empty(d, stream=stream)
    per_token = build_fused_forward(cfg, weights, x, fused_buffers(cfg, stream), pdl=True).graph_on(stream)
    h = per_token.take_output()
    rows_in = [inputs.view([tokens * d])[t * d:(t + 1) * d] for t in range(tokens)]
    rows_out = [outputs.view([tokens * d])[t * d:(t + 1) * d] for t in range(tokens)]

    def launches():
        for t in range(tokens):
            per_token.update(dop.api.memcpy(x, rows_in[t]))
            per_token.replay()
            per_token.update(dop.api.memcpy(rows_out[t], h))

    launches()
    stream.synchronize()
    if not np.array_equal(outputs.numpy(stream=stream), got):
        print("FAILED: one launch per token and the device loop disagree")
        return 1
    print(f"device loop: {tokens} tokens in one graph launch = {tokens} graph launches, bit for bit")
    if timed:
        t0 = time.perf_counter()
        launches()
        stream.synchronize()
        per_launch = time.perf_counter() - t0
        print(f"{tokens} tokens, fused + PDL: device loop {wall / tokens * 1e6:.1f} us/token "
              f"(one launch, {host_us:.0f} us of host time), one graph launch per token "
              f"{per_launch / tokens * 1e6:.1f} us/token")
    graph.close()
    per_token.close()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--d", type=positive, default=None,
                    help="hidden size, a multiple of 128 (of 256 with --fused) (default: 2048 on a GPU, "
                         "256 on the reference device)")
    ap.add_argument("--layers", type=positive, default=22, help="number of layers")
    ap.add_argument("--tokens", type=positive, default=None,
                    help="tokens timed (and run by --device-loop) (default: 512 on a GPU, 64 on the reference device)")
    ap.add_argument("--fused", action="store_true",
                    help="also the fused model (2 kernels a layer, PDL), fp32 and bf16 weights (default: off)")
    ap.add_argument("--device-loop", action="store_true",
                    help="also every token in one graph launch (a device-side loop), vs a launch per token "
                         "(default: off)")
    args = ap.parse_args()
    if args.d is not None:   # the flags first: a bad size is a usage error, not a traceback from a kernel
        problem = size_problem(args.d, fused=args.fused)
        if problem:
            ap.error(problem)
    device = dop.Device(0)
    small = device.is_reference
    d = args.d or (256 if small else 2048)
    tokens = args.tokens or (64 if small else 512)
    cfg = sized(d, args.layers)
    where = "the reference device (no GPU: NumPy; small defaults, no timings)" if small else device.name
    launches = f"{4 * cfg.n_layers} launches a token" + (f" ({2 * cfg.n_layers} fused)" if args.fused else "")
    print(f"{cfg.n_layers} layers, d={d}, {launches}, {tokens} tokens, on {where}")
    stream = device.new_stream()
    weights, host = random_weights(cfg, seed=0, stream=stream)
    rng = np.random.default_rng(1)
    embeddings = [dop.from_numpy(rng.standard_normal(d).astype(np.float32), stream=stream) for _ in range(8)]
    raw = [[dop.empty(s, stream=stream) for s in ([1, d], [d], [d], [d])] for _ in range(cfg.n_layers)]

    # warm-up: compile and load every kernel, then capture both styles
    eager_forward(cfg, weights, embeddings[0], raw, stream)
    stream.synchronize()
    models = {"graph (combinators)": capture_combinators(cfg, weights, stream),
              "graph (scope)": capture_scope(cfg, weights, stream)}

    if args.fused:
        models.update(capture_fused(cfg, weights, host, embeddings, stream))

    # each graph against eager execution on the same inputs
    for name, model in models.items():
        if "bf16" in name:
            continue  # checked against its own reference in capture_fused
        worst = 0.0
        for e in embeddings[:3]:
            ref = eager_forward(cfg, weights, e, raw, stream).sync_on(stream).numpy(stream=stream)
            got = model.forward(e).numpy(stream=stream)
            worst = max(worst, float(np.max(np.abs(got - ref))))
        print(f"{name}: max |graph - eager| = {worst:.3e}")
        if worst > 1e-3 * max(1.0, float(np.max(np.abs(ref)))):
            print("FAILED: the graph does not reproduce eager execution")
            return 1

    def rate(step):
        step(0)
        stream.synchronize()
        t0 = time.perf_counter()
        for i in range(tokens):
            step(i)
        stream.synchronize()
        return tokens / (time.perf_counter() - t0)

    if args.device_loop and run_device_loop(cfg, weights, raw, stream, tokens, timed=not small):
        return 1
    if small:   # the reference device runs NumPy: its timings say nothing about a GPU
        print("ok: every graph reproduces eager execution (timings only on a GPU)")
        return 0
    results = {"eager": rate(lambda i: eager_forward(cfg, weights, embeddings[i % 8], raw, stream))}
    for name, model in models.items():
        results[name] = rate(lambda i, m=model: m.forward(embeddings[i % 8]))
    print(f"{tokens} tokens on {device.name}, each ending in a synchronization:")
    for name, r in results.items():
        print(f"  {name:<24} {r:10.1f} tokens/s  ({1e6 / r:8.1f} us/token, {r / results['eager']:.2f}x eager)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
