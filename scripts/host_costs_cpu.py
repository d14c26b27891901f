"""Host costs of deviceop's hot calls, measured without a GPU (driver calls stubbed).

What bench/eager_overhead.py, bench/launch_overhead.py and bench/token_loop.py
guard on the GPU is mostly Python; this script times that Python on any
machine, so two commits can be compared on one CPU:

* ``eager add`` / ``eager lm_head``: one warm eager launch (``async_on``) of
  ``add`` and of the Llama ``rms_lm_head_argmax`` (three InOut words), on a fake
  GPU device whose kernels are real ``Function``s over no CUBIN, ``launch_kernel``
  stubbed (scripts/eager_tree_cpu.py says how);
* ``replay``: ``graph.replay(stream)`` of the token model's forward (88 nodes)
  captured on the reference device, the driver's graph launch stubbed;
* ``forward``: ``GraphModel.forward_async`` of that graph (copy in, replay), the
  stream's copy and the graph launch stubbed; ``bare`` is the same two stubbed calls;
* ``node set``: ``graph.node(launch).set(alpha=...)`` of a dynamic scalar,
  the driver's node update stubbed.

Every stub is a C function taking any arguments (``"".format``), as the
driver's Python wrappers are C functions.  Numbers are this CPU's, per call, the
median of ``--reps`` loops of ``--n`` calls: compare commits on one machine
(alternate the runs), never read them as GPU timings.

    python scripts/host_costs_cpu.py [--n 2000] [--reps 15] [--profile NAME]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "scripts")]
import deviceop as dop  # noqa: E402
from deviceop.runtime.device import device_key  # noqa: E402
from deviceop.kernels import add, affine, llama_proj as lp  # noqa: E402
from eager_tree_cpu import FakeGpuDevice, FakeStream, HostFunction, _no_driver  # noqa: E402
from deviceop.runtime import launch as launch_mod  # noqa: E402
from token_model import Config, LayerBuffers, LayerWeights, build_forward  # noqa: E402


class NoDriverGraphs:
    """The graph driver calls the hot paths make, each a C no-op."""
    launch = set_kernel_node = set_enabled = _no_driver


def fake_function(kernel, device, generics):
    gen = kernel.check_generics(generics)
    fn = HostFunction(None, 0, kernel.name_expression(gen), kernel.signature)
    kernel._functions[(*device_key(device), gen)] = fn
    return fn


def eager_cases():
    launch_mod.launch_kernel = _no_driver
    device = FakeGpuDevice()
    stream = FakeStream(device)
    n = 4096
    fake_function(add, device, [256])
    y, a, b = (dop.empty([n], device=device) for _ in range(3))  # the fake GPU's (its memory is host)
    yp = y.partition([256])

    d, vocab = 2048, 32000
    tile, rows, gen = lp.lm_head_plan(d, vocab)
    fake_function(lp.rms_lm_head_argmax, device, gen)
    logits, x = dop.empty([rows], device=device), dop.empty([d], device=device)
    norm_w = dop.empty([d], dtype="bfloat16", device=device)
    w = dop.empty([vocab, d], dtype="bfloat16", device=device)
    token, work, error = (dop.empty([k], dtype=t, device=device) for k, t in ((1, "int32"), (2, "uint64"), (1, "int32")))
    lp_ = logits.partition([tile])

    def build_add():
        return add(yp, a, b).generics([256])

    def build_lm_head():  # (no .pdl(): cuLaunchKernelEx has no C no-op stand-in)
        return lp.rms_lm_head_argmax(lp_, x, norm_w, w, token, work, error, 1e-5, vocab).generics(gen)

    return {"add": (build_add, stream), "lm_head": (build_lm_head, stream)}


def graph_cases():
    device = dop.Device()
    stream = device.new_stream()
    cfg = Config(d=256, n_layers=22, bk=2)
    d = cfg.d
    weights = [LayerWeights(*(dop.empty(s, stream=stream).into_shared() for s in ([d], [d, d], [d, d])))
               for _ in range(cfg.n_layers)]
    x = dop.empty([d], stream=stream)
    bufs = [LayerBuffers.allocate(d, stream) for _ in range(cfg.n_layers)]
    forward, out = build_forward(cfg, weights, x, bufs)
    graph = forward.graph_on(stream)
    model = dop.GraphModel(graph, x, out.sync_on(stream))
    graph._graphs = NoDriverGraphs()
    stream.memcpy = _no_driver  # (an instance attribute: the class's copy is untouched)
    emb = [dop.empty([d], stream=stream) for _ in range(8)]

    y2, x2 = dop.empty([1024], stream=stream), dop.empty([1024], stream=stream)
    step = affine(y2.partition([256]), x2, 2.0, 0.0).generics([256]).dynamic("alpha")
    g2 = step.graph_on(stream)
    node = g2.node(step)
    g2._graphs = NoDriverGraphs()
    node.set(alpha=1.5)
    node_fast = node.handle is not None  # the scalar fast path (_set_fast) is taken only with a driver handle

    inp, g_exec = model.input, graph._exec
    bare_launch, bare_copy = NoDriverGraphs.launch, _no_driver
    state = {"i": 0}

    def replay():
        graph.replay(stream)

    def fwd():
        state["i"] += 1
        model.forward_async(emb[state["i"] & 7])

    def bare():
        state["i"] += 1
        bare_copy(inp._ptr, emb[state["i"] & 7]._ptr, 1024)
        bare_launch(g_exec, stream)

    alphas = [float(v) for v in np.linspace(0.5, 1.5, 16)]

    def node_set(_graph=g2):  # (nodes hold their graph weakly: keep it alive)
        state["i"] += 1
        node.set(alpha=alphas[state["i"] & 15])

    return {"replay": replay, "forward": fwd, "bare": bare, "node set": node_set}, node_fast


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="calls per timed loop")
    ap.add_argument("--reps", type=int, default=15, help="timed loops; the median is reported")
    ap.add_argument("--profile", help="cProfile --n calls of this case")
    args = ap.parse_args()
    graphs, node_fast = graph_cases()
    cases, pending = {}, []
    for name, (build, stream) in eager_cases().items():
        ops = []  # built before the timed loop: "eager X" times executing a built launch alone
        pending.append(ops)

        def execute(ops=ops, build=build, stream=stream):
            if not ops:
                ops.extend(build() for _ in range(args.n + 1))
            ops.pop().async_on(stream)

        def build_and_execute(build=build, stream=stream):
            build().async_on(stream)
        cases[f"eager {name}"], cases[f"build+eager {name}"] = execute, build_and_execute
    cases.update(graphs)
    for fn in cases.values():  # warm: first launches check and cache their plans
        for _ in range(20):
            fn()
    samples = {k: [] for k in cases}
    for _ in range(args.reps):
        for k, fn in cases.items():
            fn()  # (an eager case builds its next --n launches here, untimed)
            t0 = time.perf_counter()
            for _ in range(args.n):
                fn()
            samples[k].append((time.perf_counter() - t0) / args.n * 1e6)
        gc.collect()
    print(f"host cost per call (us), median of {args.reps} x {args.n} calls; driver calls stubbed; "
          f"node set via the scalar fast path: {node_fast}")
    for k, v in samples.items():
        print(f"{k:<16}{statistics.median(v):>8.3f}  (min {min(v):.3f}, max {max(v):.3f})")
    if args.profile:
        prof = cProfile.Profile()
        fn = cases[args.profile]
        prof.enable()
        for _ in range(args.n):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    for op in (op for ops in pending for op in ops):  # built, never timed
        op.discard()
    return 0


if __name__ == "__main__":
    sys.exit(main())
