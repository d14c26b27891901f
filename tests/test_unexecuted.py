"""An op that does device work and is dropped without ever executing warns
(issue 26, item 3), as asyncio does for a coroutine never awaited.

The rule: a kernel launch (or its ``.first()`` / ``.unpartition()`` node), an
``api.memcpy`` or a ``graph.launch()`` that is collected without having executed,
without having been taken into a larger op (which then answers for it) and
without ``op.discard()`` warns ``dop.UnexecutedOpWarning``."""
import gc
import warnings

import numpy as np
import pytest

import deviceop as dop
from deviceop import api
from deviceop.kernels import add


def unexecuted_warnings(build) -> list[str]:
    """The UnexecutedOpWarning messages emitted while ``build()`` runs and its garbage is collected."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, dop.UnexecutedOpWarning)]


@pytest.fixture
def setup(stream, rng):
    xs = rng.standard_normal(256).astype(np.float32)
    a = dop.from_numpy(xs, stream=stream)
    out = dop.empty(256, stream=stream)
    graph = add(out.partition([128]), a, a).graph_on(stream)
    return xs, a, out, graph


def test_graph_launch_alone_warns_naming_the_fix_and_replay_runs_it(stream, setup):
    xs, a, out, graph = setup
    api.memcpy(out, dop.from_numpy(np.zeros(256, np.float32), stream=stream)).sync_on(stream)
    msgs = unexecuted_warnings(lambda: graph.launch())   # builds the replay op and drops it
    assert len(msgs) == 1 and "graph.launch was never executed" in msgs[0]
    assert "sync_on(stream)" in msgs[0] and "graph.replay()" in msgs[0] and "op.discard()" in msgs[0]
    assert np.all(out.numpy(stream=stream) == 0)         # nothing ran: that is what the warning is for
    graph.replay()
    assert np.array_equal(out.numpy(stream=stream), 2 * xs)


def test_a_dropped_memcpy_or_kernel_launch_warns(stream, setup):
    _, a, out, _ = setup
    assert ["api.memcpy" in m for m in unexecuted_warnings(lambda: api.memcpy(out, a))] == [True]
    msgs = unexecuted_warnings(lambda: add(dop.empty(256, stream=stream).partition([128]), a, a))
    assert len(msgs) == 1 and msgs[0].startswith("add was never executed")
    msgs = unexecuted_warnings(lambda: add(dop.empty(256, stream=stream).partition([128]), a, a)
                               .first().unpartition())
    assert len(msgs) == 1 and msgs[0].startswith("add.first().unpartition() was never executed")


def test_executed_composed_discarded_or_refused_ops_do_not_warn(stream, setup):
    _, a, out, graph = setup

    def build():
        graph.launch().sync_on(stream)                                     # executed
        add(out.partition([128]), a, a).first().unpartition().sync_on(stream)
        dop.zip_(api.memcpy(out, a), graph.launch()).sync_on(stream)       # run by their parent
        graph.launch().discard()                                           # dropped on purpose
        with pytest.raises(dop.StateError):                                # executed twice: an error
            _run_twice(add(out.partition([128]), a, a), stream)
        closed = stream.device.new_stream()
        closed.close()
        with pytest.raises(dop.StateError):                                # refused: the error says so
            api.memcpy(out, a).sync_on(closed)
        with pytest.raises(dop.LaunchError):
            add(out.partition([128]), a, a).pdl().cooperative()

    assert unexecuted_warnings(build) == []


def _run_twice(op, stream):
    op.sync_on(stream)
    op.sync_on(stream)


def test_a_failed_capture_hands_its_ops_back_without_a_warning(stream, setup):
    _, a, out, _ = setup

    def build():
        def boom(_):
            raise RuntimeError("boom")
        op = add(out.partition([128]), a, a).first().unpartition().map(boom)
        with pytest.raises(RuntimeError, match="boom"):
            op.graph_on(stream)

    assert unexecuted_warnings(build) == []
