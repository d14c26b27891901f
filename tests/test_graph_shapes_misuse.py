"""Graph shapes used as a demanding user would misuse them: branches holding ops built
before their function ran (alone, and in a loop's body), one op in two branches, and
child graphs of graphs updated since their capture (a recapture's in-place update, a
node set in a branch body).  Unmarked: they run on the reference device here and on
the H100 under gpu-check, which must agree."""
import warnings

import numpy as np
import pytest

import deviceop as dop
from deviceop import api
from deviceop.kernel import Kernel, Out
from deviceop.kernels import affine

D, B = 512, 128

_SOURCE = r"""
extern "C" __global__ void tick(int* c) { c[0] += 1; }
"""
_tick = Kernel("tick", _SOURCE, [Out("c", "int32", rank=1)], block=1,
               reference=lambda g, c: c.__setitem__(0, c[0] + 1))


def tick(c):
    return _tick(c.partition([1]))


def cell(v, stream):
    return dop.from_numpy(np.array([v], np.int32), stream=stream)


def read(t, stream):
    stream.synchronize()
    return t.numpy(stream=stream)


def scaled(out, x, alpha):
    return affine(out.partition([B]), x, alpha, 0.0).generics([B]).dynamic("alpha")


def upload(rng, stream):
    return dop.from_numpy(rng.standard_normal(D).astype(np.float32), stream=stream)


def run(op, stream, captured: bool):
    if captured:
        op.graph_on(stream).replay()
    else:
        op.sync_on(stream)


# -- branches and ops built before their function was called --------------------------------

@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("shape", ["if_", "switch", "shared"])
def test_a_branch_in_a_loop_body_holding_an_op_built_before_the_body_is_refused_in_both_modes(stream, captured,
                                                                                            shape):
    # Eagerly the body (and its branch) is built at every iteration, so the op ran once and
    # the second iteration failed half-way (a shared one silently ran once); captured it ran
    # at every iteration.  Refused before any iteration, as a loop body holding it is.
    count, i, on = cell(0, stream), cell(0, stream), cell(1, stream)
    early = tick(count)
    if shape == "if_":
        body = lambda i: dop.if_(on, lambda: early)  # noqa: E731
    elif shape == "switch":
        body = lambda i: dop.switch(i, [lambda: early, lambda: dop.zip_()])  # noqa: E731
    else:
        early = early.shared()
        body = lambda i: dop.if_(on, lambda: early.clone())  # noqa: E731
    says = r"holds shared\(tick\), which has not run and was built before the body" if shape == "shared" else \
        r"holds tick, built before the body"
    with pytest.raises(dop.LaunchError, match=r"loop\(3\) \(branch 0 of .*\) " + says):
        run(dop.loop(3, i, body), stream, captured)
    assert not stream.is_capturing()
    assert read(count, stream)[0] == 0  # nothing ran
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dop.loop(3, i, lambda i: dop.if_(on, lambda: tick(count))).sync_on(stream)  # built in the branch: fine
    assert read(count, stream)[0] == 3


@pytest.mark.parametrize("captured", [False, True])
def test_a_branch_holding_a_shared_op_made_before_it_is_refused_as_its_clones_would_part(stream, rng, captured):
    # Captured, the shared op would run only at the replays that take the branch while the
    # clone after it took its result as computed (replays with cond 0 read a stale buffer);
    # eagerly that clone computes it.  Refused, eagerly when the branch is taken, and captured.
    x, y, z = upload(rng, stream), dop.empty([D], stream=stream), dop.empty([D], stream=stream)
    early = scaled(y, x, 2.0).shared()
    op = dop.zip_(dop.if_(cell(1, stream), lambda: early.clone()),
                  early.clone().then(lambda _: scaled(z, y, 3.0)))
    with pytest.raises(dop.LaunchError, match="branch 0 of if_ holds shared.*made before the branch function"):
        run(op, stream, captured)
    assert not stream.is_capturing()
    early.clone().sync_on(stream)  # nothing claimed it: it runs, and a branch may then hand its value on
    dop.if_(cell(1, stream), lambda: early.clone().then(lambda _: scaled(z, y, 3.0))).graph_on(stream).replay()
    np.testing.assert_allclose(read(z, stream), 6 * read(x, stream), rtol=1e-6, atol=1e-6)


def test_one_op_in_two_branches_is_refused_naming_both_and_nothing_stays_executed(stream, rng):
    # Captured, every branch is recorded and an op only once: the second branch failed with
    # "already executed ... make it .shared()" (and a shared op there is refused above).
    x, y = upload(rng, stream), dop.empty([D], stream=stream)
    op = scaled(y, x, 2.0)
    with pytest.raises(dop.LaunchError, match=r"branches 0 and 2 of switch\(3\) both hold affine"):
        dop.switch(cell(0, stream), [lambda: op, lambda: dop.zip_(), lambda: op]).graph_on(stream)
    assert not stream.is_capturing()
    op.sync_on(stream)  # handed back: it never ran
    np.testing.assert_allclose(read(y, stream), 2 * read(x, stream), rtol=1e-6)


# -- child graphs of graphs updated since their capture ---------------------------------------

def test_a_graph_updated_in_place_by_a_recapture_launches_as_a_child_with_its_new_work(stream, rng):
    # The reference device raised a raw KeyError here: the copy looked up the recapture's
    # nodes in the tape the update kept.
    x, y = upload(rng, stream), dop.empty([D], stream=stream)
    inner = scaled(y, x, 2.0).graph_on(stream)
    now = scaled(y, x, 3.0)
    assert inner.recapture(now) == "updated"
    outer = dop.zip_(inner.launch()).graph_on(stream)
    outer.replay()
    np.testing.assert_allclose(read(y, stream), 3 * read(x, stream), rtol=1e-6)
    outer.node(now).set(alpha=-1.5)  # the outer graph's copy of the recaptured node
    outer.replay()
    np.testing.assert_allclose(read(y, stream), -1.5 * read(x, stream), rtol=1e-6)
    inner.replay()  # the inner graph kept its own
    np.testing.assert_allclose(read(y, stream), 3 * read(x, stream), rtol=1e-6)


def _branch_of_a_child(stream, rng):
    """x, y, the launches the branch builds (y = 2x, one per call) and the branch function."""
    x, y = upload(rng, stream), dop.empty([D], stream=stream)
    built = []

    def branch():
        built.append(scaled(y, x, 2.0))
        return built[-1]
    return x, y, built, branch


def test_an_update_of_a_node_in_a_branch_body_is_in_the_copy_a_child_graph_node_makes(stream, rng):
    # A node update changes the executable graph only, and a child-graph node copies the graph's
    # definition; the copy of a node in a branch body cannot be rewritten (the clone does not find
    # it), so its update was lost: the child ran the captured alpha.  (On the reference device
    # the definition differs from the work only after a recapture's in-place update.)
    x, y, built, branch = _branch_of_a_child(stream, rng)
    flag = cell(1, stream)
    inner = dop.if_(flag, branch).graph_on(stream)
    assert inner.recapture(dop.if_(flag, branch)) == "updated"
    inner.node(built[-1]).set(alpha=5.0)
    outer = dop.zip_(inner.launch()).graph_on(stream)
    outer.replay()
    np.testing.assert_allclose(read(y, stream), 5 * read(x, stream), rtol=1e-6)


def test_the_outer_copy_of_a_node_in_a_branch_body_of_a_child_is_refused_on_both_devices(stream, rng):
    # On a GPU cuGraphNodeFindInClone finds only the graph's own nodes, so the outer graph has no
    # handle for a node in a branch body of the child; the reference device found one and took
    # the update.  Both refuse it now, naming where to update it.
    x, y, built, branch = _branch_of_a_child(stream, rng)
    inner = dop.if_(cell(1, stream), branch).graph_on(stream)
    outer = dop.zip_(inner.launch()).graph_on(stream)
    with pytest.raises(dop.StateError, match="sits in a loop or branch of that graph"):
        outer.node(built[0]).set(alpha=4.0)
    outer.replay()
    np.testing.assert_allclose(read(y, stream), 2 * read(x, stream), rtol=1e-6)


# -- reentrancy from branch functions ---------------------------------------------------------

@pytest.mark.parametrize("where", ["branch", "then"])
def test_a_graph_closed_by_its_own_recapture_is_refused_and_its_ops_handed_back(stream, rng, where):
    # A branch function (or a then callback) closing the graph whose recapture runs it: the
    # update then met no executable graph (a raw TypeError on the reference device).
    x, y = upload(rng, stream), dop.empty([D], stream=stream)
    graph = scaled(y, x, 2.0).graph_on(stream)
    built = []

    def build():
        graph.close()
        built.append(scaled(y, x, 3.0))
        return built[-1]

    op = dop.if_(cell(1, stream), build) if where == "branch" else dop.value(0).then(lambda _: build())
    with pytest.raises(dop.StateError, match="closed while recapture"):
        graph.recapture(op)
    assert not stream.is_capturing()
    built[0].sync_on(stream)  # handed back: it never ran
    np.testing.assert_allclose(read(y, stream), 3 * read(x, stream), rtol=1e-6)


# -- what a then callback returns in a body or branch -----------------------------------------

@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("shape", ["loop", "while_", "branch in loop"])
def test_a_then_in_a_loop_body_returning_an_op_built_before_the_body_is_refused(stream, captured, shape):
    # The op a then returns is not in the body's tree, so the body check did not see it: eagerly
    # the second iteration failed half-way ("already executed"), captured it ran every iteration.
    count, i, on = cell(0, stream), cell(0, stream), cell(1, stream)
    early = tick(count)
    late = lambda: dop.value(0).then(lambda _: early)  # noqa: E731
    if shape == "loop":
        op = dop.loop(3, i, lambda i: late())
    elif shape == "while_":  # (the body ends the loop after one iteration, whatever it holds)
        op = dop.while_(on, lambda: dop.zip_(api.fill(on, 0), late()))
    else:
        op = dop.loop(3, i, lambda i: dop.if_(on, late))
    with pytest.raises(dop.LaunchError, match=r"the body of (loop\(3\)|while_).* holds tick, built before"):
        run(op, stream, captured)
    assert not stream.is_capturing()
    assert read(count, stream)[0] == 0
    dop.loop(3, i, lambda i: dop.value(0).then(lambda _: tick(count))).sync_on(stream)  # built in the then: fine
    assert read(count, stream)[0] == 3


@pytest.mark.parametrize("captured", [False, True])
def test_a_then_in_a_branch_returning_a_shared_op_made_before_it_is_refused(stream, rng, captured):
    x, y, z = upload(rng, stream), dop.empty([D], stream=stream), dop.empty([D], stream=stream)
    early = scaled(y, x, 2.0).shared()
    op = dop.zip_(dop.if_(cell(1, stream), lambda: dop.value(0).then(lambda _: early.clone())),
                  early.clone().then(lambda _: scaled(z, y, 3.0)))
    with pytest.raises(dop.LaunchError, match="branch 0 of if_ holds shared.*made before the branch function"):
        run(op, stream, captured)
    assert not stream.is_capturing()


def test_a_then_in_an_eager_branch_returning_an_allocation_is_refused_as_captured(stream, rng):
    # A branch may not allocate, eagerly and captured (docs/loops.md); what a then returned in an
    # eager branch escaped that check (captured, the capture refused it).
    x = upload(rng, stream)
    for captured in (False, True):
        op = dop.if_(cell(1, stream), lambda: dop.value(0).then(lambda _: api.zeros([D])))
        with pytest.raises(dop.GraphSafetyError):
            run(op, stream, captured)
        assert not stream.is_capturing()
    y = dop.empty([D], stream=stream)
    dop.if_(cell(1, stream), lambda: dop.value(0).then(lambda _: scaled(y, x, 2.0))).sync_on(stream)
    np.testing.assert_allclose(read(y, stream), 2 * read(x, stream), rtol=1e-6)


@pytest.mark.parametrize("shape", ["switch", "while_"])
def test_a_scope_going_on_after_a_branch_or_loop_body_failed_mid_capture_fails_on_both_devices(stream, rng, shape):
    # A GPU adds the conditional node before capturing into its bodies, so a body that fails has
    # changed the capture: the scope cannot end well (CaptureError).  The reference device
    # recorded the step after its bodies, and the scope went on to a graph without it.
    x, y = upload(rng, stream), dop.empty([D], stream=stream)

    def boom(_):
        raise RuntimeError("fails as the body runs")

    late = lambda: dop.value(0).then(boom)  # noqa: E731
    op = dop.switch(cell(1, stream), [lambda: dop.zip_(), late]) if shape == "switch" else \
        dop.while_(cell(1, stream), late)
    with pytest.raises(dop.CaptureError, match="after recording part of its work"):
        with dop.CudaGraph.scope(stream) as s:
            s.record(scaled(y, x, 2.0))
            with pytest.raises(RuntimeError):
                s.record(op)
            s.record(scaled(y, x, 3.0))
    assert not stream.is_capturing()
