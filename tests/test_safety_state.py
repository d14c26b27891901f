"""State a failure must not corrupt, and shapes and counts that must be refused or defined.

* A failed capture (``graph_on``, ``CudaGraph.scope``, ``recapture``, a graph
  that cannot be instantiated) leaves no op marked as executed: a shared op
  that completed inside it is unclaimed again, so a clone run later computes
  the value instead of returning a buffer whose work was only recorded.
* ``view`` refuses negative sizes on every path.
* ``dop.loop`` with a negative device-side count runs nothing and leaves the
  index at 0, eagerly, captured and on the reference device.
* Ownership beyond handles: views made through a handle, memory imported
  from another framework, and ``memcpy`` into a shared handle
  (docs/robustness.md, "Ownership").

Unmarked tests run on ``dop.Device()`` (the reference device here, the H100
under scripts/gpu-check); the ``gpu`` ones need the GPU's driver-level capture.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import deviceop as dop
from deviceop import CudaGraph, api, zip_
from deviceop.op import stats
from kernels import add, affine

N = 256


class Boom(Exception):
    """The fault injected into a capture."""


def boom(_=None):
    raise Boom("injected")


def upload(a, stream):
    return dop.from_numpy(np.asarray(a, dtype=np.float32), stream=stream)


def nan_buffer(stream, n=N):
    return upload(np.full(n, np.nan), stream)


def scaled(out, x, alpha=2.0):
    """``out = alpha * x`` as a shared op producing ``out``."""
    return affine(out.partition([128]), x, alpha, 0.0).generics([128]).first().unpartition().shared()


# -- 3. a failed capture leaves no op marked as executed ---------------------------------

def _issue_example(stream, rng):
    """The issue's example: a shared op completes inside a graph_on whose op then
    raises; a clone run eagerly afterwards must compute 2x (the bug returned the
    buffer the discarded graph would have filled: 0.0, or NaN here)."""
    xs = rng.uniform(1, 10, N).astype(np.float32)
    x, out = upload(xs, stream), nan_buffer(stream)
    s = scaled(out, x)
    with pytest.raises(Boom):
        zip_(s.clone(), dop.value(None).inspect(boom)).graph_on(stream)
    assert not s.is_done, "the failed capture left the shared op marked executed"
    before = stats["launches"]
    got = s.clone().sync_on(stream)
    assert stats["launches"] - before == 1, "the clone did not run the shared op"
    assert got is out
    np.testing.assert_array_equal(out.numpy(stream=stream), 2 * xs)


def test_a_clone_run_after_a_failed_graph_on_computes_the_value(stream, rng):
    _issue_example(stream, rng)


@pytest.mark.gpu
def test_a_clone_run_after_a_failed_graph_on_computes_the_value_on_the_gpu(rng):
    device = dop.CudaDevice(0)
    assert not device.is_reference
    _issue_example(device.new_stream(), rng)


def test_the_failed_op_itself_can_run_again(stream, rng):
    """Every op the failed capture executed is executable again (DESIGN: no op marked executed)."""
    xs = rng.standard_normal(N).astype(np.float32)
    x, a, b = upload(xs, stream), nan_buffer(stream), nan_buffer(stream)
    fired = []

    def once(_):
        if not fired:
            fired.append(1)
            raise Boom("only the first time")
    first = affine(a.partition([128]), x, 2.0, 1.0).generics([128])
    op = zip_(first, dop.value(None).inspect(once), add(b.partition([128]), x, a).generics([128]))
    with pytest.raises(Boom):
        op.graph_on(stream)
    op.sync_on(stream)
    np.testing.assert_array_equal(a.numpy(stream=stream), 2 * xs + 1)
    np.testing.assert_array_equal(b.numpy(stream=stream), xs + (2 * xs + 1))
    with pytest.raises(dop.StateError, match="already executed"):  # ran for real now: consumed
        op.sync_on(stream)


def test_nested_shared_ops_are_reset_by_a_failed_capture(stream, rng):
    xs = rng.standard_normal(N).astype(np.float32)
    x, inner_buf, outer_buf = upload(xs, stream), nan_buffer(stream), nan_buffer(stream)
    inner = scaled(inner_buf, x, 3.0)
    outer = add(outer_buf.partition([128]), inner.clone(), x).generics([128]).first().unpartition().shared()
    with pytest.raises(Boom):
        zip_(outer.clone(), inner.clone(), dop.value(None).inspect(boom)).graph_on(stream)
    assert not inner.is_done and not outer.is_done
    before = stats["launches"]
    outer.clone().sync_on(stream)  # recomputes inner too, once
    assert stats["launches"] - before == 2
    np.testing.assert_array_equal(inner_buf.numpy(stream=stream), 3 * xs)
    np.testing.assert_array_equal(outer_buf.numpy(stream=stream), 3 * xs + xs)


def test_a_shared_op_reached_only_through_then_is_reset(stream, rng):
    xs = rng.standard_normal(N).astype(np.float32)
    x, out = upload(xs, stream), nan_buffer(stream)
    s = scaled(out, x)
    op = dop.value(None).then(lambda _: s.clone()).inspect(boom)  # s is not in the op's tree
    with pytest.raises(Boom):
        op.graph_on(stream)
    assert not s.is_done
    s.clone().sync_on(stream)
    np.testing.assert_array_equal(out.numpy(stream=stream), 2 * xs)


def test_a_failed_scope_resets_the_shared_ops_it_recorded(stream, rng):
    xs = rng.standard_normal(N).astype(np.float32)
    x, out = upload(xs, stream), nan_buffer(stream)
    s = scaled(out, x)
    with pytest.raises(Boom):
        with CudaGraph.scope(stream) as scope:
            scope.record(s.clone())
            boom()
    assert not s.is_done
    np.testing.assert_array_equal(s.clone().sync_on(stream).numpy(stream=stream), 2 * xs)


def test_a_failed_recapture_resets_the_shared_ops_it_ran(stream, rng):
    xs = rng.standard_normal(N).astype(np.float32)
    x, a, b = upload(xs, stream), nan_buffer(stream), nan_buffer(stream)
    graph = affine(a.partition([128]), x, 2.0, 0.0).generics([128]).graph_on(stream)
    s = scaled(b, x, 5.0)
    with pytest.raises(Boom):
        graph.recapture(zip_(s.clone(), dop.value(None).inspect(boom)))
    # and a recapture that records fine but cannot replace the graph's work
    s2 = scaled(b, x, 7.0)
    with pytest.raises(dop.GraphUpdateError):
        graph.recapture(zip_(s2.clone(), add(a.partition([128]), x, x).generics([128])), reinstantiate=False)
    assert not s.is_done and not s2.is_done
    np.testing.assert_array_equal(s.clone().sync_on(stream).numpy(stream=stream), 5 * xs)
    np.testing.assert_array_equal(s2.clone().sync_on(stream).numpy(stream=stream), 7 * xs)
    graph.launch().sync_on(stream)  # the old graph does its old work
    np.testing.assert_array_equal(a.numpy(stream=stream), 2 * xs)
    graph.close()


def test_a_capture_whose_graph_cannot_be_made_resets_its_shared_ops(stream, rng, monkeypatch):
    xs = rng.standard_normal(N).astype(np.float32)
    x, out = upload(xs, stream), nan_buffer(stream)
    s = scaled(out, x)

    def refuse(stream, graph, label):  # as the real one does on failure: the graph is destroyed
        if graph is not None:
            from cuda.bindings import driver as cu
            cu.cuGraphDestroy(graph)
        raise dop.OutOfMemoryError("cuGraphInstantiate", 2, "CUDA_ERROR_OUT_OF_MEMORY", "injected", "free memory")
    monkeypatch.setattr(CudaGraph, "_instantiate", staticmethod(refuse))
    with pytest.raises(dop.OutOfMemoryError):
        s.clone().graph_on(stream)
    s2 = scaled(nan_buffer(stream), x, 3.0)
    with pytest.raises(dop.OutOfMemoryError):
        with CudaGraph.scope(stream) as scope:
            scope.record(s2.clone())
    monkeypatch.undo()
    assert not s.is_done and not s2.is_done
    np.testing.assert_array_equal(s.clone().sync_on(stream).numpy(stream=stream), 2 * xs)
    np.testing.assert_array_equal(s2.clone().sync_on(stream).numpy(stream=stream), 3 * xs)


def test_a_successful_capture_still_hands_its_output_buffer_to_clones(stream, rng):
    """What a *successful* capture produced stays done: clones see the buffer a replay fills."""
    xs = rng.standard_normal(N).astype(np.float32)
    x, out = upload(xs, stream), nan_buffer(stream)
    s = scaled(out, x)
    graph = s.clone().graph_on(stream)
    assert s.is_done
    before = stats["launches"]
    assert s.clone().sync_on(stream) is out and stats["launches"] == before  # retrieved, not recomputed
    assert np.isnan(out.numpy(stream=stream)).all()
    graph.launch().sync_on(stream)
    np.testing.assert_array_equal(out.numpy(stream=stream), 2 * xs)
    graph.close()


def test_a_shared_op_that_failed_inside_then_runs_again_and_fails_again(stream):
    """Reset, not remembered: its clone runs it again (and meets the same error), never a value."""
    s = dop.value(None).inspect(boom).shared()
    with pytest.raises(Boom):
        dop.value(None).then(lambda _: s.clone()).graph_on(stream)
    with pytest.raises(Boom):
        s.clone().sync_on(stream)
    with pytest.raises(dop.StateError, match="failed when it ran"):  # an eager failure is remembered
        s.clone().sync_on(stream)


def test_a_shared_op_that_failed_in_the_capture_tree_can_run_again(stream, rng):
    fired = []

    def once(v):
        if not fired:
            fired.append(1)
            raise Boom("only the first time")
        return v
    s = dop.value(41).map(once).map(lambda v: v + 1).shared()
    with pytest.raises(Boom):
        zip_(s.clone(), s.clone()).graph_on(stream)
    assert s.clone().sync_on(stream) == 42


# -- 6. view refuses negative sizes on every path -----------------------------------------

@pytest.mark.parametrize("shape", [(-2, -128), (-1, -256), (-2, 128, -1), (2, -2, -64)])
def test_a_view_with_negative_sizes_is_a_shape_error_on_every_path(stream, shape):
    t = dop.empty(N, stream=stream)
    t.view(2, 128)  # the view cache is warm: a cached shape must not open a way around the check
    for make in (lambda: t.view(shape), lambda: t.view(*shape), lambda: t.reshape(list(shape)),
                 lambda: t.view(tuple(np.int64(d) for d in shape)), lambda: t.into_shared().view(shape),
                 lambda: dop.value(t).reshape(shape).sync_on(stream),
                 lambda: dop.shared(t).clone().reshape(*shape).sync_on(stream)):
        with pytest.raises(dop.ShapeError, match="one -1 and otherwise non-negative"):
            make()
    assert (-2, -128) not in (t._views or {})


def test_a_negative_view_could_have_fooled_the_overlap_check(stream):
    """Why it matters: a view of extent (-2, -128) had a memory range outside its buffer."""
    t = dop.empty(N, stream=stream)
    with pytest.raises(dop.ShapeError):
        v = t.view((-2, -128))
        assert v.overlaps(t), "a view of t's memory that does not overlap t"


# -- 7. a negative device-side loop count: no iteration, index 0, in every mode --------------

def _count_down_loop(device, mode, count_value, rng):
    stream = device.new_stream()
    xs = rng.standard_normal(N).astype(np.float32)
    x = dop.from_numpy(xs, device=device, stream=stream)
    y = dop.from_numpy(np.full(N, np.nan, np.float32), device=device, stream=stream)
    count = dop.from_numpy(np.array([count_value], np.int32), device=device, stream=stream)
    index = dop.from_numpy(np.array([-7], np.int32), device=device, stream=stream)

    def body(i):
        return affine(y.partition([128]), x, 2.0, 0.0).generics([128])
    op = dop.loop(count, index, body)
    if mode == "eager":
        op.sync_on(stream)
    elif mode == "graph_on":
        graph = op.graph_on(stream)
        graph.replay()
        graph.close()
    else:
        with CudaGraph.scope(stream) as s:
            s.record(op)
        s.graph.replay()
        s.graph.close()
    stream.synchronize()
    return int(index.numpy(stream=stream)[0]), y.numpy(stream=stream), xs


@pytest.mark.parametrize("mode", ["eager", "graph_on", "scope"])
@pytest.mark.parametrize("where", ["device", "reference"])
def test_a_negative_count_tensor_runs_no_iteration_and_leaves_index_zero(mode, where, rng):
    device = dop.Device() if where == "device" else dop.ReferenceDevice(0)
    for count_value in (-3, -(2**31)):
        index, y, _ = _count_down_loop(device, mode, count_value, rng)
        assert index == 0, f"{mode}: count {count_value} left index {index}"
        assert np.isnan(y).all(), f"{mode}: the body ran"
    index, y, xs = _count_down_loop(device, mode, 2, rng)  # and a positive count still counts
    assert index == 2
    np.testing.assert_array_equal(y, 2 * xs)
