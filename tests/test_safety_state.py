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
from deviceop.testing import ForeignArray
from deviceop import CudaGraph, api, zip_
from deviceop.op import stats
from deviceop.kernels import add, affine
from helpers import Boom, boom, upload

N = 256


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
        stream.device.graphs.destroy(graph)
        raise dop.OutOfMemoryError("cuGraphInstantiate", 2, "CUDA_ERROR_OUT_OF_MEMORY", "injected", "free memory")
    monkeypatch.setattr(stream.device.graphs, "instantiate", refuse)  # the device's GraphBackend
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


# -- 9. ownership beyond handles (docs/robustness.md, "Ownership") ------------------------

def test_try_partition_waits_for_views_made_through_a_handle(stream):
    h = dop.empty(N, stream=stream).into_shared()
    v = h.view(2, 128)
    with pytest.raises(dop.OwnershipError, match="1 live borrow.*view made through a handle"):
        h.try_partition([128])
    v2 = v[1:]          # a view made from the borrowed view carries its borrow
    del v
    with pytest.raises(dop.OwnershipError, match="view made through a handle"):
        h.try_partition([128])
    del v2
    assert h.try_partition([128]).grid == (2,)


def test_a_reshape_of_a_handle_in_an_op_is_a_borrow_while_its_value_lives(stream, rng):
    xs = rng.standard_normal(N).astype(np.float32)
    h = upload(xs, stream).into_shared()
    out = dop.empty(N, stream=stream)
    value = affine(out.partition([128]), dop.shared(h).clone().reshape(N), 2.0, 0.0).generics([128]).sync_on(stream)
    with pytest.raises(dop.OwnershipError, match="view made through a handle"):
        h.try_partition([128])  # value[1] is a view of h's buffer
    assert value[1] is not h.tensor and value[1].data_ptr == h.tensor.data_ptr
    del value
    assert h.try_partition([128]).grid == (2,)


Foreign = ForeignArray  # another framework's memory, exported through DLPack


def test_memory_imported_from_another_framework_is_never_claimed(rng):
    """On the reference device (host memory; test_imports_on_the_gpu_... is the GPU's)."""
    device = dop.ReferenceDevice(0)
    stream = device.new_stream()
    xs = rng.standard_normal(N).astype(np.float32)
    for import_ in (dop.from_dlpack, dop.as_tensor):
        foreign = Foreign(xs.copy())
        imported = import_(foreign, device=device)
        h = imported.into_shared()
        with pytest.raises(dop.OwnershipError, match="imported from another framework.*api.dup"):
            h.try_partition([128])
        with pytest.raises(dop.OwnershipError, match="imported from another framework"):
            api.memcpy(h, dop.empty(N, device=device))
        assert h.live_handles == 1  # refused, not consumed: the handle still reads
        # the two ways out the message names: a copy deviceop owns, or an explicit plain borrow
        own = api.dup(h).sync_on(stream)
        affine(own.into_shared().try_partition([128]), imported, 2.0, 0.0).generics([128]).sync_on(stream)
        np.testing.assert_array_equal(own.numpy(), 2 * xs)
        affine(h.tensor.partition([128]), own, 3.0, 0.0).generics([128]).sync_on(stream)
        np.testing.assert_array_equal(foreign.array, 6 * xs)  # the other framework sees the write


def test_an_import_of_deviceop_memory_is_a_borrow_of_its_buffer(rng):
    """Memory deviceop allocated that comes back through DLPack is counted while the import lives
    (on the reference device, whose memory NumPy can hold; the GPU twin uses CuPy)."""
    device = dop.ReferenceDevice(0)
    t = dop.from_numpy(rng.standard_normal(N).astype(np.float32), device=device)
    h = t.into_shared()
    alias = dop.from_dlpack(Foreign(np.from_dlpack(t)), device=device)  # another framework's view of t, imported again
    assert alias.data_ptr == t.data_ptr
    with pytest.raises(dop.OwnershipError, match="an import of its memory"):
        h.try_partition([128])
    half = alias[:128]
    del alias
    with pytest.raises(dop.OwnershipError, match="an import of its memory"):
        h.try_partition([128])  # a view of the import keeps the borrow
    del half
    assert h.try_partition([128]).grid == (2,)


def test_memcpy_into_a_shared_handle_needs_the_only_handle(stream, rng):
    xs = rng.standard_normal(N).astype(np.float32)
    src = upload(xs, stream)
    h = dop.empty(N, stream=stream).into_shared()
    reader = h.clone()
    with pytest.raises(dop.OwnershipError, match="api.memcpy into a SharedTensor.*1 other live SharedTensor handle"):
        api.memcpy(h, src)
    reader.release()
    op = api.memcpy(h, src)       # the only handle now: allowed (Arc::get_mut), and not consumed
    late = h.clone()              # ... until a clone appears before it runs
    with pytest.raises(dop.OwnershipError, match="1 other live SharedTensor handle"):
        op.sync_on(stream)
    late.release()
    api.memcpy(h, src).sync_on(stream)
    np.testing.assert_array_equal(h.tensor.numpy(), xs)
    assert h.live_handles == 1
    shared_dst = dop.shared(h)    # an op producing the handle: checked when it runs
    keep = h.clone()
    with pytest.raises(dop.OwnershipError):
        api.memcpy(shared_dst.clone(), src).sync_on(stream)
    keep.release()


def test_a_loop_index_that_is_a_shared_handle_must_be_the_only_one(stream):
    index = dop.from_numpy(np.zeros(1, np.int32), stream=stream).into_shared()
    other = index.clone()
    with pytest.raises(dop.OwnershipError, match="dop.loop's index"):
        dop.loop(3, index, lambda i: dop.value(None))
    other.release()
    dop.loop(3, index, lambda i: dop.value(None)).sync_on(stream)
    assert index.tensor.numpy()[0] == 3


@pytest.mark.gpu
def test_imports_on_the_gpu_are_external_or_borrows(rng):
    import cupy
    device = dop.CudaDevice(0)
    stream = device.new_stream()
    c = cupy.asarray(rng.standard_normal(N).astype(np.float32))
    for imported in (dop.from_dlpack(c, device=device), dop.as_tensor(c, device=device),
                     dop.Tensor.from_cuda_array_interface(c, device=device)):
        with pytest.raises(dop.OwnershipError, match="imported from another framework"):
            imported.into_shared().try_partition([128])
    t = dop.from_numpy(rng.standard_normal(N).astype(np.float32), device=device, stream=stream)
    h = t.into_shared()
    alias = dop.from_dlpack(cupy.from_dlpack(t), device=device)
    with pytest.raises(dop.OwnershipError, match="an import of its memory"):
        h.try_partition([128])
    del alias
    gc.collect()
    assert h.try_partition([128]).grid == (2,)
