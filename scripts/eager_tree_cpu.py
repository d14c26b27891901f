"""The host cost of executing the eager forward's op tree, measured without a GPU.

bench/eager_overhead.py times the 22-layer forward (88 launches, the tree of
examples/token_model.build_forward) executed with ``async_on`` on the H100.
There the loop is host-bound, and what deviceop adds over a bare launch loop
is Python: walking the op tree (shared/clone, first/unpartition, reshape,
zip, map, boxed), each launch's lookup of its prepared launch (argument
checks and packing happen once per argument layout) and the call into it.  This script measures exactly that, on any machine:

* the tree is built by the real ``build_forward`` over Device(0) tensors
  (``dop.empty``: nothing is computed or read, so any ``--d`` is cheap);
* it executes on a *fake GPU device* (``is_reference`` False), so each
  launch takes its GPU path — the kernel's generated ``_run``: one key
  lookup into ``kernel._prepared`` and the prepared launch — not the
  reference device's path (which would run the NumPy kernels);
* each kernel's ``Function`` is a real one (generated launcher and prepared
  launches) whose only fake part is the driver call: ``launch_kernel``
  (cuLaunchKernel) returns at once.

So "eager" below is what executing the tree costs this host apart from the
driver's own ``cuLaunchKernel`` (and its Python wrapper), and "eager - launcher" is what the op tree
adds over calling ``Function.launch`` (argument checks and packing each time)
with the arguments at hand; it can go below zero.  The fakes live in this process only; the library
runs unmodified.  The numbers are this CPU's: compare before/after on one
machine, and never read them as GPU timings.  (A script, not a benchmark in
bench/: it measures no device, and writes no result file.)

    python scripts/eager_tree_cpu.py [--d 2048] [--layers 22] [--tokens 200] [--reps 21] [--profile]
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

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import deviceop as dop  # noqa: E402
from deviceop.runtime import launch as launch_mod  # noqa: E402
from deviceop.runtime.launch import Function, LaunchConfig  # noqa: E402
from deviceop.runtime.device import device_key  # noqa: E402
from token_model import Config, LayerBuffers, LayerWeights, build_forward  # noqa: E402
from deviceop.kernels import add, matvec, rms_norm  # noqa: E402


# Stands in for launch_kernel (cuLaunchKernel): the driver call is the one cost not
# measured.  A C function that takes any arguments and does nothing, like the real
# one (CuPy's typed wrapper) is a C function: a Python stub would add a frame the
# real launch does not have.
_no_driver = "".format


class FakeGpuDevice:
    """A device that is not the reference device, so launches take the GPU path."""

    is_reference = False
    ordinal = -1  # never a real ordinal: the kernels' function caches keep our fakes apart
    name = "fake GPU (no driver calls)"
    arch = "sm_90"

    label = "fake GPU"

    def bind(self) -> None:
        pass

    def __getattr__(self, name):  # memory: the reference device's (a launch needs tensors of its stream's device)
        return getattr(dop.Device(0), name)


class FakeStream:
    def __init__(self, device):
        self.device, self.ptr = device, 0

    def synchronize(self) -> None:
        pass


class HostFunction(Function):
    """A real Function (generated launcher and all) over no CUBIN: the layout
    check is skipped (and launch_kernel, in this process, is _no_driver)."""

    def _verify_layout(self, offsets) -> None:
        pass

    def _default_dynamic_shared_memory(self) -> int:   # no CUBIN to ask; none of these has static shared memory
        return 48 * 1024


def install_fake_functions(device, cfg: Config) -> dict:
    """Give each kernel a HostFunction for ``device`` (what ``Kernel.function`` returns)."""
    launch_mod.launch_kernel = _no_driver  # what the launchers and prepared launches made from now on call
    fns = {}
    for name, kernel, gen in (("rms", rms_norm, cfg.rms_generics()), ("mv", matvec, cfg.mv_generics()),
                              ("add", add, [cfg.block])):
        gen = kernel.check_generics(gen)
        fn = HostFunction(None, 0, kernel.name_expression(gen), kernel.signature)
        kernel._functions[(*device_key(device), gen)] = fns[name] = fn
    return fns


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--tokens", type=int, default=200, help="trees executed per timed loop (as eager_overhead.py)")
    ap.add_argument("--reps", type=int, default=21, help="timed loops; the median is reported")
    ap.add_argument("--profile", action="store_true", help="also cProfile the execution of --tokens trees")
    args = ap.parse_args()

    cfg = Config(d=args.d, n_layers=args.layers, bk=max(1, min(16, args.d // 128)))
    device = FakeGpuDevice()
    stream = FakeStream(device)
    fns = install_fake_functions(device, cfg)
    d = cfg.d
    # np.empty memory: the kernels never run, so the contents do not matter
    weights = [LayerWeights(*(dop.empty(s, device=device).into_shared() for s in ([d], [d, d], [d, d])))
               for _ in range(cfg.n_layers)]
    raw = [[dop.empty(shape, device=device) for shape in ([1, d], [d], [d], [d])] for _ in range(cfg.n_layers)]
    x = dop.empty([d], device=device)
    n_launch = 4 * cfg.n_layers

    def build():
        bufs = [LayerBuffers(*(t.into_shared() for t in r)) for r in raw]
        return build_forward(cfg, weights, x, bufs)

    before = dop.op.stats["launches"]
    build()[0].async_on(stream)  # warm-up: the first execution checks every launch and caches its plan
    assert dop.op.stats["launches"] - before == n_launch, "the tree did not launch every kernel once"

    # the launcher alone, same Functions and arguments, configs made once (the
    # "deviceop Function.launch loop" of eager_overhead.py)
    mv_cfg = LaunchConfig(d // cfg.bn, 32 * cfg.bn)
    prim, hidden = [], x
    for w, (norm, q, o, res) in zip(weights, raw):
        prim += [(fns["rms"].launch, LaunchConfig(1, cfg.rms_generics()[1]), (norm, hidden.view([1, d]),
                                                                              w.norm_w.tensor, cfg.eps)),
                 (fns["mv"].launch, mv_cfg, (q, norm, w.wq.tensor)),
                 (fns["mv"].launch, mv_cfg, (o, q.view([1, d]), w.wo.tensor)),
                 (fns["add"].launch, LaunchConfig(d // cfg.block, cfg.block // 4), (res, hidden, o))]
        hidden = res

    def prim_token():
        for f, c, a in prim:
            f(stream, c, *a)

    def timed(fn, tokens):
        t0 = time.perf_counter()
        for _ in range(tokens):
            fn()
        return (time.perf_counter() - t0) / tokens * 1e6

    samples = {"build": [], "eager": [], "prim": []}
    for _ in range(args.reps):  # as a token loop does: build a token's tree, execute it, next token
        spent_build = spent_exec = 0.0
        for _ in range(args.tokens):
            t0 = time.perf_counter()
            forward, _ = build()
            t1 = time.perf_counter()
            forward.async_on(stream)
            spent_exec += time.perf_counter() - t1
            spent_build += t1 - t0
        samples["build"].append(spent_build / args.tokens * 1e6)
        samples["eager"].append(spent_exec / args.tokens * 1e6)
        samples["prim"].append(timed(prim_token, args.tokens))
        gc.collect()
    med = {k: statistics.median(v) for k, v in samples.items()}
    tree = statistics.median([e - p for e, p in zip(samples["eager"], samples["prim"])])

    print(f"eager forward op tree on the host: {cfg.n_layers} layers, d={d}, {n_launch} launches a token; "
          f"median of {args.reps} x {args.tokens} tokens; driver call stubbed")
    print(f"{'variant':<44}{'us/token':>10}{'us/launch':>11}{'min':>8}{'max':>8}")
    names = {"prim": "launcher loop (Function.launch)", "eager": "deviceop eager (execute the tree)",
             "build": "deviceop eager (build the tree)"}
    for k in ("prim", "eager", "build"):
        print(f"{names[k]:<44}{med[k]:>10.1f}{med[k] / n_launch:>11.3f}"
              f"{min(samples[k]) / n_launch:>8.3f}{max(samples[k]) / n_launch:>8.3f}")
    print(f"{'op-tree overhead (eager - launcher)':<44}{tree:>10.1f}{tree / n_launch:>11.3f}")

    if args.profile:
        trees = [build() for _ in range(args.tokens)]
        prof = cProfile.Profile()
        prof.enable()
        for t in trees:
            t[0].async_on(stream)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
