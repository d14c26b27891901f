"""Seed 004's workflow: a graph whose kernels' scalars change every iteration.

Each iteration runs 8 short kernels in a chain: 4 *static* ones (fixed
scalars) and 4 *dynamic* ones whose scalar ``alpha`` changes every iteration.
Three ways to run it:

* **no graph**: build the 8 launches and execute them eagerly;
* **recapture + exec update**: capture the iteration again and update the
  executable graph in place (``graph.recapture(op)`` → cuGraphExecUpdate);
* **node updates**: capture once with the dynamic launches marked
  ``.dynamic("alpha")``, then per iteration ``graph.node(launch).set(alpha=...)``
  (cuGraphExecKernelNodeSetParams) and replay — seed 004's combined approach.

All three must leave the same bytes in the output; the first is checked
against float64 NumPy.  Then µs per iteration for each.

    python examples/dynamic_params.py [--iters 2000] [--n 1024]

Flags are checked first: ``--n`` must be a multiple of 256.  Timings are
printed on a GPU only.
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
from deviceop.kernels import affine  # noqa: E402
from token_model import HelpFormatter, positive  # noqa: E402

TILE = 256
STATIC = (0.5, 0.25)  # the static kernels' (alpha, beta)


def alphas(i: int) -> list[float]:
    """The dynamic kernels' scalars at iteration i (a new value every iteration)."""
    return [1.0 + 0.001 * ((i + k) % 97) for k in range(4)]


class Workflow:
    """Buffers for the 8-kernel chain x -> b1 -> ... -> b8."""

    def __init__(self, n: int, stream, seed: int = 0):
        self.stream, self.n = stream, n
        self.host_x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
        self.x = dop.from_numpy(self.host_x, stream=stream)
        self.bufs = [dop.empty([n], stream=stream) for _ in range(8)]

    @property
    def out(self):
        return self.bufs[-1]

    def launches(self, i: int):
        """The iteration's 8 launches: (all of them, the 4 dynamic ones)."""
        src, ops, dynamic = self.x, [], []
        for k, a in enumerate(alphas(i)):
            s_out, d_out = self.bufs[2 * k], self.bufs[2 * k + 1]
            ops.append(affine(s_out.partition([TILE]), src, *STATIC).generics([TILE]))
            step = affine(d_out.partition([TILE]), s_out, a, 0.0).generics([TILE]).dynamic("alpha")
            ops.append(step)
            dynamic.append(step)
            src = d_out
        return ops, dynamic

    def op(self, i: int):
        return dop.zip_(*self.launches(i)[0])

    def reference(self, i: int) -> np.ndarray:
        h = self.host_x.astype(np.float64)
        for a in alphas(i):
            h = np.float64(np.float32(a)) * (np.float64(STATIC[0]) * h + np.float64(STATIC[1]))
        return h


def run_no_graph(wf: Workflow, iters: int) -> None:
    for i in range(iters):
        wf.op(i).async_on(wf.stream)


def run_recapture(wf: Workflow, iters: int, graph=None):
    graph = graph or wf.op(0).graph_on(wf.stream)
    for i in range(iters):
        graph.recapture(wf.op(i))
        graph.replay()
    return graph


def run_node_updates(wf: Workflow, iters: int, graph_and_nodes=None):
    if graph_and_nodes is None:
        ops, dynamic = wf.launches(0)
        graph = dop.zip_(*ops).graph_on(wf.stream)
        graph_and_nodes = graph, [graph.node(s) for s in dynamic]
    graph, nodes = graph_and_nodes
    for i in range(iters):
        for node, a in zip(nodes, alphas(i)):
            node.set(alpha=a)
        graph.replay()
    return graph_and_nodes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--iters", type=positive, default=2000,
                    help="iterations of each way (at most 200 on the reference device)")
    ap.add_argument("--n", type=positive, default=1024, help=f"elements a kernel, a multiple of {TILE}")
    args = ap.parse_args()
    if args.n % TILE:   # the flags first: a usage error, not a kernel's traceback
        ap.error(f"--n {args.n}: affine<{TILE}> needs a multiple of {TILE} (one tile of {TILE} elements a block)")
    device = dop.Device(0)
    stream = device.new_stream()
    wf = Workflow(args.n, stream)
    small = device.is_reference
    iters = args.iters if not small else min(args.iters, 200)
    where = "the reference device (no GPU: NumPy; at most 200 iterations, no timings)" if small else device.name
    print(f"8 kernels an iteration (4 with a scalar that changes every iteration), n={args.n}, "
          f"{iters} iterations, on {where}")

    results, us = {}, {}
    state = {"recapture + exec update": None, "node updates": None}
    for name, run in [("no graph", run_no_graph), ("recapture + exec update", run_recapture),
                      ("node updates", run_node_updates)]:
        if name in state:
            state[name] = run(wf, 1)  # capture outside the timing
        stream.synchronize()
        t0 = time.perf_counter()
        if name in state:
            run(wf, iters, state[name])
        else:
            run(wf, iters)
        stream.synchronize()
        us[name] = (time.perf_counter() - t0) / iters * 1e6
        results[name] = wf.out.numpy()
    ref = wf.reference(iters - 1)
    err = float(np.max(np.abs(results["no graph"] - ref)) / np.max(np.abs(ref)))
    same = all(np.array_equal(results["no graph"], r) for r in results.values())
    print(f"outputs identical across the three: {same}; vs float64 NumPy: {err:.2e}")
    if not small:   # the reference device runs NumPy: its timings say nothing about a GPU
        for name, v in us.items():
            print(f"  {name:<24} {v:8.2f} us/iteration  ({us['no graph'] / v:.2f}x no graph)")
    graph = state["recapture + exec update"]
    print(f"recapture path: {graph.exec_updates} exec updates, {graph.reinstantiations} re-instantiations")
    return 0 if same and err < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
