"""Property tests: a random DAG of ops computes the same thing however it runs.

Hypothesis draws a *program*: a few input vectors, then steps that each read
earlier values — ``add``, ``affine``, ``matvec`` (which changes the length),
``rms_norm`` and ``memcpy`` — with random lengths, random fan-out (a value read
by several later steps, hence ``shared()`` with clones) and a random way of
composing each step (its arguments as ops, through ``then``, through
``zip_(...).then``, or followed by ``map``/``inspect``/``boxed``).  The same
program then runs five ways:

1. eagerly on ``dop.Device()`` (``sync_on``),
2. captured by ``graph_on`` over NaN-poisoned buffers, inputs copied in, replayed (twice),
3. recorded step by step in ``CudaGraph.scope``, replayed,
4. eagerly on the reference device (NumPy references of the kernels),
5. as a float64 NumPy model written here, independent of deviceop.

1, 2 and 3 must agree bit for bit (same kernels, same device); 1 and 4 agree
exactly on a machine without a GPU and to float32 rounding on the GPU; 4
agrees with 5 to float32 rounding.  Every step runs exactly once per
execution, however many clones read it.

Each property draws 30 examples in CI, 100 under scripts/gpu-check and 1000
with ``DEVICEOP_HYPOTHESIS_PROFILE=long`` (tests/conftest.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import example, given, strategies as st

import deviceop as dop
from deviceop import CudaGraph, GraphCache, api, shared, zip_
from deviceop.op import stats
from deviceop.kernels import add, affine, matvec, rms_norm

LENGTHS = (128, 256, 512)  # every kernel here takes multiples of 128 (16-byte loads, 128-element tiles)
KINDS = ("add", "affine", "matvec", "rms_norm", "memcpy")
WRAPS = ("direct", "then", "zip", "map")
EPS = 1e-5


@dataclass(frozen=True)
class Step:
    kind: str                # "input" or one of KINDS
    args: tuple = ()         # indices of the earlier steps it reads
    n: int = 128             # length of the vector it produces
    alpha: float = 1.0       # affine's scalars
    beta: float = 0.0
    wrap: str = "direct"     # how the combinators compose it (WRAPS)
    claim: bool = False      # output claimed through SharedTensor.try_partition (else Tensor.partition)


@dataclass(frozen=True)
class Program:
    steps: tuple
    seed: int

    def __repr__(self) -> str:  # what Hypothesis prints for a counterexample: paste into @example
        return f"Program(steps={self.steps!r}, seed={self.seed})"


f32 = st.floats(-2.0, 2.0, width=32, allow_subnormal=False)


@st.composite
def programs(draw) -> Program:
    steps = [Step("input", n=draw(st.sampled_from(LENGTHS))) for _ in range(draw(st.integers(1, 3)))]
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(KINDS))
        i = draw(st.integers(0, len(steps) - 1))
        n = steps[i].n
        common = dict(wrap=draw(st.sampled_from(WRAPS)), claim=draw(st.booleans()))
        if kind == "add":
            j = draw(st.sampled_from([j for j, s in enumerate(steps) if s.n == n]))
            steps.append(Step("add", (i, j), n, **common))
        elif kind == "affine":
            steps.append(Step("affine", (i,), n, alpha=draw(f32), beta=draw(f32), **common))
        elif kind == "matvec":
            steps.append(Step("matvec", (i,), draw(st.sampled_from(LENGTHS)), **common))
        else:
            steps.append(Step(kind, (i,), n, **common))
    return Program(tuple(steps), draw(st.integers(0, 2**32 - 1)))


def host_data(prog: Program) -> dict:
    """Per step: the input vector, the matvec weight [m, n] or the rms_norm weight [n]."""
    rng = np.random.default_rng(prog.seed)
    data = {}
    for k, s in enumerate(prog.steps):
        if s.kind == "input":
            data[k] = rng.standard_normal(s.n).astype(np.float32)
        elif s.kind == "matvec":
            n_in = prog.steps[s.args[0]].n
            data[k] = (rng.standard_normal((s.n, n_in)) / np.sqrt(n_in)).astype(np.float32)
        elif s.kind == "rms_norm":
            data[k] = (1 + 0.1 * rng.standard_normal(s.n)).astype(np.float32)
    return data


def numpy_model(prog: Program, data: dict) -> list:
    """The program in float64 NumPy, rounded to float32 where a kernel stores."""
    vals = []
    for k, s in enumerate(prog.steps):
        x = [vals[j].astype(np.float64) for j in s.args]
        if s.kind == "input":
            v = data[k]
        elif s.kind == "add":
            v = x[0] + x[1]
        elif s.kind == "affine":
            v = s.alpha * x[0] + s.beta
        elif s.kind == "matvec":
            v = data[k].astype(np.float64) @ x[0]
        elif s.kind == "rms_norm":
            v = x[0] / np.sqrt(np.mean(x[0] * x[0]) + EPS) * data[k].astype(np.float64)
        else:
            v = x[0]
        vals.append(np.asarray(v).astype(np.float32))
    return vals


class Buffers:
    """One run's device buffers: a vector per step (inputs included) and the weights."""

    def __init__(self, prog, data, device, stream, poison_inputs: bool):
        def upload(a):
            return dop.from_numpy(a, device=device, stream=stream)

        nan = lambda n: upload(np.full(n, np.nan, np.float32))  # noqa: E731 - poison: a missed write shows
        self.prog, self.stream = prog, stream
        self.vec = [nan(s.n) if s.kind != "input" or poison_inputs else upload(data[k])
                    for k, s in enumerate(prog.steps)]
        self.weights = {k: upload(a) for k, a in data.items() if prog.steps[k].kind != "input"}
        self.host_inputs = {k: upload(a) for k, a in data.items() if prog.steps[k].kind == "input"}

    def write_inputs(self, graph) -> None:
        for k, src in self.host_inputs.items():
            graph.update(api.memcpy(self.vec[k], src))

    def results(self) -> list:
        self.stream.synchronize()
        return [t.numpy(stream=self.stream) for t in self.vec]

    # -- one step as a launch over its arguments (tensors, or ops producing them) --
    def launch(self, k: int, *xs):
        s, out = self.prog.steps[k], self.vec[k]
        if s.kind == "memcpy":
            return api.memcpy(out, xs[0])
        if s.kind == "rms_norm":
            out = out.view([1, s.n])
        tile = {"matvec": [16], "rms_norm": [1, s.n]}.get(s.kind, [128])
        part = out.into_shared().try_partition(tile) if s.claim else out.partition(tile)
        if s.kind == "add":
            return add(part, xs[0], xs[1]).generics([128])
        if s.kind == "affine":
            return affine(part, xs[0], s.alpha, s.beta).generics([128])
        n_in = self.prog.steps[s.args[0]].n
        if s.kind == "matvec":
            return matvec(part, xs[0].reshape([1, n_in]), self.weights[k]).generics([16, 1, n_in])
        return rms_norm(part, xs[0].reshape([1, n_in]), self.weights[k], EPS).generics([s.n, 32])

    def step_value(self, k: int, *xs):
        """The launch as an op producing the step's [n] vector."""
        s = self.prog.steps[k]
        op = self.launch(k, *xs)
        if s.kind == "memcpy":
            return op
        op = op.first().unpartition()
        return op.reshape([s.n]) if s.kind == "rms_norm" else op

    # -- the whole program, two ways ---------------------------------------------
    def as_op(self):
        """Every step a shared op, composed as the step's ``wrap`` says; one zip runs them all."""
        return zip_(*[n.clone() for n in self.shared_steps()])

    def shared_steps(self) -> list:
        """Every step as a shared op (inputs: shared tensors), composed as its ``wrap`` says."""
        nodes = []
        for k, s in enumerate(self.prog.steps):
            if s.kind == "input":
                nodes.append(shared(self.vec[k]))
                continue
            args = [nodes[j].clone() for j in s.args]
            if s.wrap == "direct":
                op = self.step_value(k, *args)
            elif s.wrap == "then":
                op = args[0].then(lambda x0, k=k, rest=args[1:]: self.step_value(k, x0, *rest))
            elif s.wrap == "zip":
                op = zip_(*args).then(lambda xs, k=k: self.step_value(k, *xs))
            else:
                op = self.step_value(k, *args).map(lambda t: t).inspect(lambda t: None).boxed()
            nodes.append(op.shared())
        return nodes

    def record(self, s) -> None:
        """The scope body: each step recorded with concrete tensors, in order."""
        for k, step in enumerate(self.prog.steps):
            if step.kind != "input":
                s.record(self.launch(k, *[self.vec[j] for j in step.args]))


def assert_close(got, ref, what):
    for k, (g, r) in enumerate(zip(got, ref)):
        scale = float(np.max(np.abs(r))) + 1.0
        err = float(np.max(np.abs(g.astype(np.float64) - r))) if g.size else 0.0
        assert err <= 1e-4 * scale, f"{what}: step {k} differs by {err:.3g} (scale {scale:.3g})"


def run_everywhere(prog: Program) -> None:
    device = dop.Device()
    stream = device.new_stream()
    data = host_data(prog)
    kernel_steps = sum(s.kind not in ("input", "memcpy") for s in prog.steps)

    eager = Buffers(prog, data, device, stream, poison_inputs=False)
    before = stats["launches"]
    eager.as_op().sync_on(stream)
    assert stats["launches"] - before == kernel_steps, "a shared step ran more (or less) than once"
    want = eager.results()

    captured = Buffers(prog, data, device, stream, poison_inputs=True)
    graph = captured.as_op().graph_on(stream)
    assert all(np.isnan(v).all() for v in captured.results()), "capturing computed something"
    captured.write_inputs(graph)
    for _ in range(2):  # replays are idempotent
        graph.launch().sync_on(stream)
        for k, (g, w) in enumerate(zip(captured.results(), want)):
            np.testing.assert_array_equal(g, w, err_msg=f"graph_on replay, step {k}")

    scoped = Buffers(prog, data, device, stream, poison_inputs=True)
    sgraph = CudaGraph.scope(stream, scoped.record)
    scoped.write_inputs(sgraph)
    sgraph.launch().sync_on(stream)
    for k, (g, w) in enumerate(zip(scoped.results(), want)):
        np.testing.assert_array_equal(g, w, err_msg=f"scope replay, step {k}")
    graph.close()
    sgraph.close()

    ref_device = dop.ReferenceDevice(0)
    ref_stream = ref_device.new_stream()
    reference = Buffers(prog, data, ref_device, ref_stream, poison_inputs=False)
    reference.as_op().sync_on(ref_stream)
    ref = reference.results()
    if device is ref_device:
        for k, (g, r) in enumerate(zip(want, ref)):
            np.testing.assert_array_equal(g, r, err_msg=f"eager vs reference device, step {k}")
    else:
        assert_close(want, [r.astype(np.float64) for r in ref], "GPU vs reference device")
    assert_close(ref, numpy_model(prog, data), "reference device vs NumPy model")


@given(programs())
@example(Program(steps=(Step("input", n=128), Step("add", (0, 0), 128)), seed=0))  # one input read twice
@example(Program(steps=(Step("input", n=256), Step("matvec", (0,), 128, wrap="zip", claim=True),
                        Step("rms_norm", (1,), 128, wrap="then"), Step("add", (2, 1), 128, wrap="map"),
                        Step("memcpy", (3,), 128)), seed=1))  # a length change, fan-out, every wrap
def test_eager_graph_scope_and_reference_agree(prog):
    run_everywhere(prog)


# -- GraphCache: any sequence of batches gives what eager execution gives ---------------

D = 256


def scale_rows(ws, x):
    """y = 2x + 1, row by row (rows never mix, so padding cannot leak)."""
    y = ws.empty([ws.size, D])
    return affine(y.view([-1]).partition([128]), x.view([-1]), 2.0, 1.0).generics([128]).map(lambda _: y)


@given(st.lists(st.integers(1, 12), min_size=1, max_size=8), st.integers(0, 2**32 - 1))
def test_graph_cache_any_batch_sequence_matches_eager(batches, seed):
    """Batches 1..12 against sizes 1, 2, 4, 8: padded replays, and eager fallback above 8."""
    device = dop.Device()
    stream = device.new_stream()
    rng = np.random.default_rng(seed)
    with GraphCache(scale_rows, stream=stream, max_size=8, max_graphs=3) as cache:
        for b in batches:
            xs = rng.standard_normal((b, D)).astype(np.float32)
            x = dop.from_numpy(xs, device=device, stream=stream)
            got = cache(x).numpy(stream=stream)
            eager = cache(x, eager=True).numpy(stream=stream)
            np.testing.assert_array_equal(got, eager)
            np.testing.assert_allclose(got, 2.0 * xs.astype(np.float64) + 1.0, rtol=1e-6, atol=1e-6)
        s = cache.stats
        assert s.hits + s.misses + s.fallbacks == 2 * len(batches) and s.graphs <= 3


# -- checks that must run whatever ran before (issue 24) ----------------------------------
#
# A random history of launches over fixed buffers, each through one of three ways
# (eager with plain scalars, eager with scalars computed by ops, or a captured
# node updated with ``set`` and replayed), with an input that is a dense view or
# not, and a scalar that is valid or not.  Whatever came before, each launch is
# refused exactly when the model says (and then changes nothing), else it
# computes what the model computes: no check is ever skipped because an earlier
# launch of the same layouts passed it.

SAFETY_VIEWS = ("dense", "reversed", "every_other")
ROWS = (4, 4, 3, 1000, 2**40, True, 4.0)       # store_row's rows: the table has 4
ALPHAS = (1.5, -0.0, 0.25, True)               # affine's alpha
HOW = ("eager", "op", "node")


@st.composite
def launch_histories(draw):
    steps = []
    for _ in range(draw(st.integers(1, 10))):
        kernel = draw(st.sampled_from(("store_row", "affine")))
        scalar = draw(st.sampled_from(ROWS if kernel == "store_row" else ALPHAS))
        steps.append((kernel, draw(st.sampled_from(SAFETY_VIEWS)), scalar, draw(st.sampled_from(HOW))))
    return steps, draw(st.integers(0, 3)), draw(st.integers(0, 2**32 - 1))


def _expected_refusal(kernel, view, scalar):
    """The exception a launch must raise, or None: the shared checks in parameter
    order (the input's layout before the scalar's type), then the kernel's rules."""
    if view != "dense":
        return dop.ShapeError
    if kernel == "store_row":
        if type(scalar) is not int or not -2**31 <= scalar < 2**31:
            return dop.DTypeError
        return dop.ShapeError if scalar != 4 else None
    return dop.DTypeError if type(scalar) is bool else None


@given(launch_histories())
def test_every_launch_is_checked_whatever_launched_before(history):
    from deviceop.kernels import store_row
    steps, row, seed = history
    device = dop.Device()
    stream = device.new_stream()
    rng = np.random.default_rng(seed)
    n = {"store_row": 128, "affine": 256}
    hosts = {k: rng.standard_normal(2 * m).astype(np.float32) for k, m in n.items()}
    bases = {k: dop.from_numpy(h, device=device, stream=stream) for k, h in hosts.items()}
    views = {k: {"dense": (b[0:n[k]], hosts[k][0:n[k]]), "reversed": (b[n[k] - 1::-1], hosts[k][n[k] - 1::-1]),
                 "every_other": (b[0::2], hosts[k][0::2])} for k, b in bases.items()}
    table_host = rng.standard_normal((4, 128)).astype(np.float32)
    table = dop.from_numpy(table_host, device=device, stream=stream)
    index = dop.from_numpy(np.array([row], np.int32), device=device, stream=stream)
    out = dop.from_numpy(np.full(256, np.nan, np.float32), device=device, stream=stream)
    model = {"store_row": table_host.copy(), "affine": np.full(256, np.nan, np.float32)}
    result = {"store_row": table, "affine": out}

    def launch(kernel, x, scalar):
        if kernel == "store_row":
            return store_row(table.partition([4, 128]), x, index, scalar).generics([128])
        return affine(out.partition([128]), x, scalar, 0.5).generics([128])

    dense = {k: v["dense"][0] for k, v in views.items()}
    nodes, graphs = {}, []
    for kernel, scalar in (("store_row", 4), ("affine", 1.0)):
        step = launch(kernel, dense[kernel], scalar).dynamic()
        graphs.append(step.graph_on(stream))  # captured, not replayed: the model is unchanged
        nodes[kernel] = graphs[-1].node(step), graphs[-1]
    for kernel, view, scalar, how in steps:
        x, x_host = views[kernel][view]
        refusal = _expected_refusal(kernel, view, scalar)
        before = result[kernel].numpy(stream=stream)
        name = "rows" if kernel == "store_row" else "alpha"
        try:
            if how == "node":
                node, graph = nodes[kernel]
                node.set(x=x, **{name: scalar})
                graph.launch().sync_on(stream)
            else:
                launch(kernel, x, dop.value(scalar) if how == "op" else scalar).sync_on(stream)
        except (dop.ShapeError, dop.DTypeError) as exc:
            assert refusal is not None and type(exc) is refusal, f"{kernel} {view} {scalar!r} {how}: {exc}"
            np.testing.assert_array_equal(result[kernel].numpy(stream=stream), before)
            continue
        assert refusal is None, f"{kernel} {view} {scalar!r} {how}: accepted, but should raise {refusal.__name__}"
        if kernel == "store_row":
            model[kernel][row] = x_host
        else:
            model[kernel] = (np.float64(scalar) * x_host.astype(np.float64) + 0.5).astype(np.float32)
        np.testing.assert_allclose(result[kernel].numpy(stream=stream), model[kernel], rtol=1e-6, atol=1e-6)
    for graph in graphs:
        graph.close()


# -- a capture that fails midway hands every op back -------------------------------------

class Injected(Exception):
    """The fault a property test injects into a capture."""


def one_shot_fault():
    """An op that raises the first time it runs and is a no-op after."""
    fired = []

    def fire(_):
        if not fired:
            fired.append(True)
            raise Injected("injected into the capture")
    return dop.value(None).inspect(fire)


@given(programs(), st.integers(0, 9), st.sampled_from(["graph_on", "scope", "recapture"]))
@example(Program(steps=(Step("input", n=128), Step("affine", (0,), 128, alpha=2.0, beta=1.0),
                        Step("add", (1, 0), 128, wrap="then")), seed=3), 2, "graph_on")  # fault after two steps
def test_a_capture_that_fails_midway_leaves_every_step_to_compute(prog, at, how):
    """After a capture that raised part-way (``graph_on``, a scope body, ``recapture``),
    running the same ops eagerly computes what a fresh eager run computes, each
    shared step exactly once: nothing the failed capture ran counts as done."""
    device = dop.Device()
    stream = device.new_stream()
    data = host_data(prog)
    kernel_steps = sum(s.kind not in ("input", "memcpy") for s in prog.steps)
    fresh = Buffers(prog, data, device, stream, poison_inputs=False)
    fresh.as_op().sync_on(stream)
    want = fresh.results()

    bufs = Buffers(prog, data, device, stream, poison_inputs=False)
    nodes = bufs.shared_steps()
    k = at % (len(nodes) + 1)  # the fault comes after k steps
    clones = [n.clone() for n in nodes]
    root = zip_(*clones[:k], one_shot_fault(), *clones[k:])
    if how == "graph_on":
        with pytest.raises(Injected):
            root.graph_on(stream)
    elif how == "scope":
        with pytest.raises(Injected):
            with CudaGraph.scope(stream) as s:
                for i, n in enumerate(clones):
                    if i == k:
                        raise Injected("injected into the scope body")
                    s.record(n)
                raise Injected("injected after the last record")
        root = zip_(*[n.clone() for n in nodes])
    else:
        other = Buffers(prog, data, device, stream, poison_inputs=True)
        graph = other.as_op().graph_on(stream)
        with pytest.raises(Injected):
            graph.recapture(root)
        graph.close()
    assert not stream.is_capturing()
    assert not any(n.is_done for n in nodes[len([s for s in prog.steps if s.kind == "input"]):]), \
        "a step the failed capture ran is still marked done"
    before = stats["launches"]
    root.sync_on(stream)
    assert stats["launches"] - before == kernel_steps, "a shared step ran more (or less) than once"
    for j, (g, w) in enumerate(zip(bufs.results(), want)):
        np.testing.assert_array_equal(g, w, err_msg=f"eager after a failed {how}, step {j}")
