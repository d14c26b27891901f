"""Branches a device value picks: ``dop.if_(cond, then, else_=None)`` and ``dop.switch(index, branches)``.

Eagerly a branch is a host branch; captured it is one conditional node (IF,
IF/ELSE, SWITCH) whose branch the GPU picks at every replay, from the value
then.  These tests run on the reference device here and on the H100 under
gpu-check (the unmarked ones too); the ``gpu`` ones look at what only a GPU
shows, and the last ones check the driver calls through a fake driver.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import deviceop as dop
from deviceop import api
from deviceop.kernel import Kernel, Out
from deviceop.kernels import affine
from deviceop.runtime import graphs as driver_graphs

_cu = driver_graphs.cu  # the real bindings (FakeCaptureDriver stands in for them)
D, B = 512, 128

# Small kernels for these tests: a counter a branch bumps, a flag a loop body flips.
_SOURCE = r"""
extern "C" __global__ void tick(int* c) { c[0] += 1; }
extern "C" __global__ void flip(int* f) { f[0] = !f[0]; }
extern "C" __global__ void countdown(int* c) { c[0] -= 1; }
"""
tick = Kernel("tick", _SOURCE, [Out("c", "int32", rank=1)], block=1,
              reference=lambda g, c: c.__setitem__(0, c[0] + 1))
flip = Kernel("flip", _SOURCE, [Out("f", "int32", rank=1)], block=1,
              reference=lambda g, f: f.__setitem__(0, int(not f[0])))
countdown = Kernel("countdown", _SOURCE, [Out("c", "int32", rank=1)], block=1,
                   reference=lambda g, c: c.__setitem__(0, c[0] - 1))


def cell(v, stream):
    return dop.from_numpy(np.array([v], np.int32), stream=stream)


def set_cell(c, v, stream):
    api.fill(c, int(v)).sync_on(stream)


class Affines:
    """One input, one output, and a branch per (alpha, beta): out = alpha * x + beta."""

    def __init__(self, rng, stream, params):
        self.stream, self.params = stream, params
        self.xs = rng.standard_normal(D).astype(np.float32)
        self.x = dop.from_numpy(self.xs, stream=stream)
        self.out = dop.empty([D], stream=stream)
        self.built = []  # the branch of each build

    def branch(self, k):
        def build():
            self.built.append(k)
            alpha, beta = self.params[k]
            return affine(self.out.partition([B]), self.x, alpha, beta).generics([B])
        return build

    def branches(self):
        return [self.branch(k) for k in range(len(self.params))]

    def clear(self):
        api.fill(self.out, float("nan")).sync_on(self.stream)

    def result(self):
        self.stream.synchronize()
        return self.out.numpy(stream=self.stream)

    def expect(self, k):
        """Branch k's result in float64, or all NaN for no branch."""
        if k is None:
            return np.full(D, np.nan)
        alpha, beta = self.params[k]
        return alpha * self.xs.astype(np.float64) + beta


def assert_result(got, ref):
    assert np.array_equal(np.isnan(got), np.isnan(ref)), "a branch ran where none should (or none ran)"
    done = ~np.isnan(ref)
    np.testing.assert_allclose(got[done], ref[done], rtol=1e-6, atol=1e-6)


# -- eagerly: host branches ---------------------------------------------------------------

def test_if_eagerly_runs_the_branch_the_value_picks_and_builds_only_that_one(stream, rng):
    a = Affines(rng, stream, [(2.0, 1.0), (-0.5, 0.25)])
    then, else_ = a.branches()
    for v, picked in [(1, 0), (0, 1), (-9, 0)]:
        a.clear()
        dop.if_(cell(v, stream), then, else_).sync_on(stream)
        assert_result(a.result(), a.expect(picked))
    assert a.built == [0, 1, 0]
    a.clear()
    dop.if_(cell(0, stream), then).sync_on(stream)  # no else: nothing runs
    assert_result(a.result(), a.expect(None))


def test_switch_eagerly_runs_branch_i_and_none_out_of_range(stream, rng):
    a = Affines(rng, stream, [(1.0, 0.0), (3.0, -1.0), (-2.0, 0.5)])
    for i in (2, 0, 3, -1, 1):
        a.clear()
        dop.switch(cell(i, stream), a.branches()).sync_on(stream)
        assert_result(a.result(), a.expect(i if 0 <= i < 3 else None))
    assert a.built == [2, 0, 1]


# -- captured: one conditional node ------------------------------------------------------------

def test_a_captured_if_else_is_one_node_whose_branch_follows_the_value_between_replays(stream, rng):
    a = Affines(rng, stream, [(2.0, 1.0), (-0.5, 0.25)])
    cond = cell(1, stream)
    graph = dop.if_(cond, *a.branches()).graph_on(stream)
    assert sorted(a.built) == [0, 1]                                 # captured: both branches built, once
    top = graph.summary()
    assert top["by_type"]["CONDITIONAL"] == 1                        # one node (and, on a GPU, its select kernel)
    assert "affine" not in " ".join(top["kernels"])                  # the branches are inside the node
    for v in (1, 0, 0, 5, -1, 0):
        set_cell(cond, v, stream)
        a.clear()
        graph.replay()
        assert_result(a.result(), a.expect(0 if v else 1))
    assert sorted(a.built) == [0, 1]                                 # no recapture
    graph.close()


def test_a_captured_if_without_else_runs_nothing_when_the_condition_is_zero(stream, rng):
    a = Affines(rng, stream, [(4.0, -3.0)])
    cond = cell(0, stream)
    graph = dop.if_(cond, a.branch(0)).graph_on(stream)
    for v in (0, 1, 0):
        set_cell(cond, v, stream)
        a.clear()
        graph.replay()
        assert_result(a.result(), a.expect(0 if v else None))
    graph.close()


def test_a_captured_switch_takes_the_branch_of_each_replays_index(stream, rng):
    a = Affines(rng, stream, [(1.0, 0.0), (3.0, -1.0), (-2.0, 0.5), (0.5, 2.0)])
    index = cell(0, stream)
    graph = dop.switch(index, a.branches()).graph_on(stream)
    for i in (3, 0, 2, 7, 1, -4, 2):
        set_cell(index, i, stream)
        a.clear()
        graph.replay()
        assert_result(a.result(), a.expect(i if 0 <= i < 4 else None))
    graph.close()


def test_without_several_bodies_a_node_each_branch_is_an_if_node_and_results_do_not_change(stream, rng,
                                                                                               monkeypatch):
    """Drivers before CUDA 12.8: one IF node per branch, every handle set before the
    first node.  On the GPU this runs that path for real (the driver would allow one node)."""
    device = stream.device
    monkeypatch.setattr(type(device), "conditional_branches",
                        lambda self: (False, "the driver supports CUDA 12.4 (IF/ELSE and SWITCH need 12.8)"))
    a = Affines(rng, stream, [(1.0, 0.0), (3.0, -1.0), (-2.0, 0.5)])
    index = cell(0, stream)
    graph = dop.switch(index, a.branches()).graph_on(stream)
    conditionals = graph.summary()["by_type"]["CONDITIONAL"]
    assert conditionals == (1 if device.is_reference else 3)   # the tape has one step whatever the driver
    for i in (2, 0, 1, 3):
        set_cell(index, i, stream)
        a.clear()
        graph.replay()
        assert_result(a.result(), a.expect(i if i < 3 else None))
    graph.close()
    # a branch that changes the value does not make a later one run: each handle was set before
    flag, hits = cell(1, stream), dop.from_numpy(np.zeros(2, np.int32), stream=stream)
    graph = dop.if_(flag, lambda: dop.zip_(flip(flag.partition([1])), tick(hits[0:1].partition([1]))),
                    lambda: tick(hits[1:2].partition([1]))).graph_on(stream)
    graph.replay()
    stream.synchronize()
    assert list(hits.numpy(stream=stream)) == [1, 0] and flag.numpy(stream=stream)[0] == 0
    graph.close()


def test_branches_nest_in_loops_and_the_loop_body_changes_the_value_each_iteration(stream):
    # while_: five iterations; the body flips the flag, so then and else alternate
    steps, flag = cell(5, stream), cell(1, stream)
    hits = dop.from_numpy(np.zeros(2, np.int32), stream=stream)
    then_hits, else_hits = hits[0:1], hits[1:2]

    def body():
        return dop.zip_(dop.if_(flag, lambda: tick(then_hits.partition([1])),
                                lambda: tick(else_hits.partition([1]))),
                        flip(flag.partition([1])), countdown(steps.partition([1])))
    graph = dop.while_(steps, body).graph_on(stream)
    graph.replay()
    stream.synchronize()
    assert list(hits.numpy(stream=stream)) == [3, 2] and steps.numpy(stream=stream)[0] == 0
    graph.close()
    # loop: the index is the switch's, so iteration i runs branch i (and the last, none)
    seen = dop.from_numpy(np.zeros(3, np.int32), stream=stream)
    index = cell(0, stream)
    op = dop.loop(4, index, lambda i: dop.switch(i, [lambda k=k: tick(seen[k:k + 1].partition([1]))
                                                     for k in range(3)]))
    graph = op.graph_on(stream)
    graph.replay()
    graph.replay()
    stream.synchronize()
    assert list(seen.numpy(stream=stream)) == [2, 2, 2] and index.numpy(stream=stream)[0] == 4
    graph.close()


def test_branches_record_in_a_scope_after_other_work(stream, rng):
    a = Affines(rng, stream, [(2.0, 0.0), (0.0, 1.0)])
    cond, copy = cell(3, stream), dop.empty([D], stream=stream)
    with dop.CudaGraph.scope(stream) as s:
        s.record(api.fill(cond, 0))                  # the value the node reads is written in the graph itself
        s.record(dop.if_(cond, *a.branches()))
        s.record(api.memcpy(copy, a.out))
    a.clear()
    s.graph.replay()
    stream.synchronize()
    assert_result(a.result(), a.expect(1))
    assert_result(copy.numpy(stream=stream), a.expect(1))
    s.graph.close()


# -- what is refused ---------------------------------------------------------------------

def test_the_value_must_be_an_int32_cell_on_the_device(stream):
    then = lambda: None  # noqa: E731
    with pytest.raises(dop.DTypeError, match="int32"):
        dop.if_(dop.empty([1], "float32", stream=stream), then)
    with pytest.raises(dop.DTypeError, match="device tensor"):
        dop.if_(np.ones(1, np.int32), then)
    with pytest.raises(dop.ShapeError, match="one element"):
        dop.switch(dop.empty([2], "int32", stream=stream), [then])


def test_branches_are_functions_that_build_the_op(stream, recwarn):
    c = cell(1, stream)
    with pytest.raises(dop.LaunchError, match="function that builds"):
        dop.if_(c, tick(c.partition([1])))
    with pytest.raises(dop.LaunchError, match="function that builds"):
        dop.if_(c, lambda: None, tick(c.partition([1])))
    with pytest.raises(dop.LaunchError, match="list of functions"):
        dop.switch(c, lambda: tick(c.partition([1])))
    with pytest.raises(dop.LaunchError, match="at least one branch"):
        dop.switch(c, [])
    with pytest.raises(dop.LaunchError, match="branch 1"):
        dop.switch(c, [lambda: None, tick(c.partition([1]))])
    assert not [w for w in recwarn if issubclass(w.category, dop.UnexecutedOpWarning)]  # refused, not dropped


@pytest.mark.parametrize("capture", [False, True])
def test_a_branch_that_allocates_is_refused_and_the_stream_stays_usable(stream, capture):
    c = cell(1, stream)
    op = dop.if_(c, lambda: api.zeros([16]), lambda: None)
    with pytest.raises(dop.GraphSafetyError, match="allocate before"):
        op.graph_on(stream) if capture else op.sync_on(stream)
    assert not stream.is_capturing()
    dop.if_(c, lambda: tick(c.partition([1]))).sync_on(stream)   # the stream still works
    assert c.numpy(stream=stream)[0] == 2


def test_without_conditional_nodes_capture_says_so_and_eager_branches_still_run(stream, rng, monkeypatch):
    device = stream.device
    monkeypatch.setattr(type(device), "conditional_nodes",
                        lambda self: (False, "the driver supports CUDA 12.2 (conditional nodes need 12.4)"))
    a = Affines(rng, stream, [(2.0, 1.0), (-1.0, 0.0)])
    with pytest.raises(dop.CapabilityError, match="12.4"):
        dop.switch(cell(1, stream), a.branches()).graph_on(stream)
    assert not stream.is_capturing()
    dop.switch(cell(1, stream), a.branches()).sync_on(stream)
    assert_result(a.result(), a.expect(1))


def test_the_select_kernel_compiles_for_sm_90_with_the_layout_it_is_launched_with():
    """No GPU needed: CI compiles what a captured branch launches, and checks its
    parameters against the signature its launches pack (as loading it on a GPU does)."""
    from deviceop.graph.branches import _SELECT_SIGNATURE, _SELECT_SOURCE
    from deviceop.runtime.params import ParamLayout, check_param_layout
    prog = dop.compile_cubin(_SELECT_SOURCE, arch="sm_90", filename="deviceop_select.cu")
    assert prog.cubin[:4] == b"\x7fELF"
    declared = ParamLayout("deviceop_select", _SELECT_SIGNATURE)
    check_param_layout("deviceop_select", declared.signature, prog.param_layout("deviceop_select"))


# -- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_replays_are_bit_equal_to_eager_execution_for_every_branch(stream, rng):
    a = Affines(rng, stream, [(1.7, -0.3), (-2.5, 1.25), (0.125, 3.0)])
    index = cell(0, stream)
    graph = dop.switch(index, a.branches()).graph_on(stream)
    assert stream.device.conditional_branches()[0], "the H100's driver (CUDA 13) holds SWITCH nodes"
    assert graph.summary()["by_type"] == {"KERNEL": 1, "CONDITIONAL": 1}
    for i in (2, 1, 0, 1, 2):
        set_cell(index, i, stream)
        a.clear()
        dop.switch(index, a.branches()).sync_on(stream)       # eagerly: the host reads the index
        eager = a.result().copy()
        a.clear()
        graph.replay()
        replayed = a.result()
        assert replayed.tobytes() == eager.tobytes()
        assert_result(replayed, a.expect(i))
    graph.close()


@pytest.mark.gpu
def test_gpu_an_if_else_is_one_node_and_its_replays_are_bit_equal_to_eager_execution(stream, rng):
    a = Affines(rng, stream, [(2.0, 1.0), (-0.5, 0.25)])
    cond = cell(1, stream)
    graph = dop.if_(cond, *a.branches()).graph_on(stream)
    assert graph.summary()["by_type"] == {"KERNEL": 1, "CONDITIONAL": 1}  # the select kernel, one IF/ELSE node
    for v in (1, 0, 3, 0, 0, 1):
        set_cell(cond, v, stream)
        a.clear()
        dop.if_(cond, *a.branches()).sync_on(stream)
        eager = a.result().copy()
        a.clear()
        graph.replay()
        replayed = a.result()
        assert replayed.tobytes() == eager.tobytes()
        assert_result(replayed, a.expect(0 if v else 1))
    graph.close()


# -- the driver calls, through a fake driver ------------------------------------------------

class FakeCaptureDriver:
    """cuda.bindings.driver as runtime/graphs.py's conditional capture sees it: graphs are
    lists of node records, each stream captures into one, and a node's dependencies are
    what the stream's were when it was added."""

    def __init__(self):
        self.graphs = {"outer": []}
        self.capturing = {}      # stream handle -> [graph name, dependencies]
        self.handles = 0
        self.ended = []

    def node(self, stream, what):
        graph, deps = self.capturing[stream.handle]
        name = f"{graph}.{len(self.graphs[graph])}"
        self.graphs[graph].append((name, what, tuple(deps)))
        self.capturing[stream.handle][1] = [name]
        return name

    # the calls
    def cuStreamGetCaptureInfo(self, handle):
        graph, deps = self.capturing[handle]
        return 0, "ACTIVE", 1, graph, list(deps), None, len(deps)

    def cuGraphConditionalHandleCreate(self, graph, ctx, default, flags):
        assert ctx == "ctx" and graph in self.graphs
        self.handles += 1
        return 0, f"h{self.handles}"

    @staticmethod
    def CUgraphNodeParams():
        return SimpleNamespace(conditional=SimpleNamespace())

    def cuGraphAddNode(self, graph, deps, edges, n, params):
        c = params.conditional
        assert params.type == _cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL and c.ctx == "ctx"
        name = f"{graph}.{len(self.graphs[graph])}"
        c.phGraph_out = [f"{name}/body{i}" for i in range(c.size)]
        for body in c.phGraph_out:
            self.graphs[body] = []
        self.graphs[graph].append((name, (c.type.name.removeprefix("CU_GRAPH_COND_TYPE_"), c.handle, c.size),
                                   tuple(deps[:n])))
        return 0, name

    def cuStreamUpdateCaptureDependencies(self, handle, nodes, edges, n, flags):
        self.capturing[handle][1] = list(nodes[:n])
        return (0,)

    def cuStreamBeginCaptureToGraph(self, handle, graph, deps, edges, n, mode):
        self.capturing[handle] = [graph, []]
        return (0,)

    def cuStreamEndCapture(self, handle):
        self.ended.append(self.capturing.pop(handle)[0])
        return 0, None

    def __getattr__(self, name):
        return getattr(_cu, name)


class FakeStream:
    def __init__(self, device, handle):
        self.device, self.handle = device, handle


class FakeDevice:
    context = "ctx"

    def __init__(self):
        self.made = 0

    def new_stream(self):
        self.made += 1
        return FakeStream(self, f"s{self.made}")


def fake_capture(monkeypatch):
    fake, device = FakeCaptureDriver(), FakeDevice()
    monkeypatch.setattr(driver_graphs, "cu", fake)
    outer = FakeStream(device, "outer-stream")
    fake.capturing[outer.handle] = ["outer", []]
    select = lambda stream, handle, case: fake.node(stream, ("select", handle, case))  # noqa: E731
    work = lambda i, stream: fake.node(stream, ("work", i))  # noqa: E731
    return fake, outer, select, work


def test_driver_wiring_of_an_if_else_on_a_12_8_driver(monkeypatch):
    fake, outer, select, work = fake_capture(monkeypatch)
    driver_graphs.capture_branches(outer, "if_/else_", "if", 2, True, select, None, work)
    assert fake.graphs["outer"] == [("outer.0", ("select", "h1", -1), ()),
                                    ("outer.1", ("IF", "h1", 2), ("outer.0",))]
    assert fake.graphs["outer.1/body0"] == [("outer.1/body0.0", ("work", 0), ())]
    assert fake.graphs["outer.1/body1"] == [("outer.1/body1.0", ("work", 1), ())]
    assert fake.ended == ["outer.1/body0", "outer.1/body1"]           # each body's capture ended
    assert fake.capturing["outer-stream"][1] == ["outer.1"]           # the outer stream's work follows the node


def test_driver_wiring_of_a_switch_with_and_without_switch_nodes(monkeypatch):
    fake, outer, select, work = fake_capture(monkeypatch)
    driver_graphs.capture_branches(outer, "switch(3)", "switch", 3, True, select, None, work)
    assert [n[1] for n in fake.graphs["outer"]] == [("select", "h1", -1), ("SWITCH", "h1", 3)]
    assert [fake.graphs[f"outer.1/body{i}"][0][1] for i in range(3)] == [("work", 0), ("work", 1), ("work", 2)]

    fake, outer, select, work = fake_capture(monkeypatch)
    driver_graphs.capture_branches(outer, "switch(3)", "switch", 3, False, select, None, work)
    assert fake.graphs["outer"] == [
        ("outer.0", ("select", "h1", 0), ()), ("outer.1", ("select", "h2", 1), ("outer.0",)),
        ("outer.2", ("select", "h3", 2), ("outer.1",)),                    # every handle set first,
        ("outer.3", ("IF", "h1", 1), ("outer.2",)), ("outer.4", ("IF", "h2", 1), ("outer.3",)),
        ("outer.5", ("IF", "h3", 1), ("outer.4",))]                        # then one IF node per branch
    assert [fake.graphs[f"outer.{3 + i}/body0"][0][1] for i in range(3)] == [("work", 0), ("work", 1), ("work", 2)]
    # an if_ without else_ is one IF node on every driver
    fake, outer, select, work = fake_capture(monkeypatch)
    driver_graphs.capture_branches(outer, "if_", "if", 1, False, select, None, work)
    assert [n[1] for n in fake.graphs["outer"]] == [("select", "h1", -1), ("IF", "h1", 1)]


def test_driver_wiring_of_a_while_loop(monkeypatch):
    fake, outer, select, work = fake_capture(monkeypatch)
    control = lambda stream, handle, start: fake.node(stream, ("control", handle, start))  # noqa: E731
    driver_graphs.capture_while(outer, "while_", control, None, lambda stream: work(0, stream))
    assert fake.graphs["outer"] == [("outer.0", ("control", "h1", True), ()),
                                    ("outer.1", ("WHILE", "h1", 1), ("outer.0",))]
    assert fake.graphs["outer.1/body0"] == [("outer.1/body0.0", ("work", 0), ()),
                                            ("outer.1/body0.1", ("control", "h1", False), ("outer.1/body0.0",))]


def test_a_branch_that_fails_while_captured_still_ends_its_body_capture(monkeypatch):
    fake, outer, select, work = fake_capture(monkeypatch)

    def failing(i, stream):
        raise dop.ShapeError("a wrong shape in branch 0")
    with pytest.raises(dop.ShapeError, match="branch 0"):
        driver_graphs.capture_branches(outer, "if_", "if", 1, True, select, None, failing)
    assert fake.ended == ["outer.1/body0"] and list(fake.capturing) == ["outer-stream"]
