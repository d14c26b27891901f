"""Memory that may be read and not written (issue 32).

* A read-only import (a DLPack export flagged read-only, a
  ``__cuda_array_interface__`` with ``readonly``) is readable only: a kernel
  output into it, ``api.memcpy`` into it, a loop index in it or a node update
  that writes it is an OwnershipError naming the fix, and nothing is written.
* A loop borrows its index and count read-only for its duration: a body that
  writes either (a kernel output, a copy, a nested loop's index; known when the
  body is built or only when it runs; eagerly or captured) is an OwnershipError,
  and nothing of the loop is left half-done.

Unmarked tests run on ``dop.Device()`` (the reference device here, the H100 under
scripts/gpu-check); the ``gpu`` ones import CuPy memory.
"""
from __future__ import annotations

import numpy as np
import pytest

import deviceop as dop
from deviceop import CudaGraph, api, zip_
from deviceop.kernels import affine
from deviceop.testing import ForeignArray
from helpers import upload

N = 256


def scale(out, x, alpha=2.0):
    return affine(out.partition([128]), x, alpha, 0.0).generics([128])


# -- read-only imports -----------------------------------------------------------------------------

def read_only_import(host):
    """``host`` imported as another framework's read-only memory (DLPack's read-only flag), on
    the reference device (host memory; the GPU's twin uses __cuda_array_interface__)."""
    host = np.array(host)
    host.flags.writeable = False
    return dop.from_dlpack(ForeignArray(host), device=dop.ReferenceDevice(0)), host


def test_a_read_only_import_is_read_and_never_written(rng):
    device = dop.ReferenceDevice(0)
    stream = device.new_stream()
    xs = rng.standard_normal(N).astype(np.float32)
    ro, host = read_only_import(xs)
    y = dop.empty(N, device=device, stream=stream)
    scale(y, ro).sync_on(stream)  # reading it is fine
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * xs)
    src = upload(rng.standard_normal(N), dop.ReferenceDevice(0).new_stream())
    fix = "read-only.*api.dup"
    with pytest.raises(dop.OwnershipError, match=rf"api.memcpy .*{fix}"):
        api.memcpy(ro, src)
    with pytest.raises(dop.OwnershipError, match=rf"affine.*writes out.*{fix}"):
        scale(ro, src)
    with pytest.raises(dop.OwnershipError, match=fix):  # the partition made by an op, known when it runs
        affine(dop.value(ro).map(lambda t: t.partition([128])), src, 2.0, 0.0).generics([128]).sync_on(stream)
    with pytest.raises(dop.OwnershipError, match=fix):  # the destination made by an op
        api.memcpy(dop.value(ro), src).sync_on(stream)
    with pytest.raises(dop.OwnershipError, match=fix):
        ro.into_shared().try_partition([128])
    with pytest.raises(dop.OwnershipError, match=fix):
        ro[:128].into_shared().check_writable("a write")  # a view of it is read-only too
    np.testing.assert_array_equal(host, xs)  # nothing was written
    own = api.dup(ro).sync_on(stream)  # the fix the message names: a copy deviceop owns
    scale(own, ro, 3.0).sync_on(stream)
    np.testing.assert_array_equal(own.numpy(stream=stream), 3 * xs)


def test_a_read_only_int32_import_is_no_loop_index(rng):
    index, _ = read_only_import(np.zeros(1, np.int32))
    with pytest.raises(dop.OwnershipError, match="dop.loop's index.*read-only"):
        dop.loop(2, index, lambda i: dop.value(None))
    count, _ = read_only_import(np.array([2], np.int32))  # a count is only read: fine
    cell = dop.from_numpy(np.zeros(1, np.int32), device=dop.ReferenceDevice(0))
    dop.loop(count, cell, lambda i: dop.value(None)).sync_on(dop.ReferenceDevice(0).new_stream())
    assert cell.numpy()[0] == 2


def test_a_node_update_into_a_read_only_import_is_refused_and_the_graph_keeps_its_work(rng):
    device = dop.ReferenceDevice(0)
    stream = device.new_stream()
    xs = rng.standard_normal(N).astype(np.float32)
    x, y = upload(xs, stream), dop.empty(N, device=device, stream=stream)
    ro, host = read_only_import(rng.standard_normal(N).astype(np.float32))
    step = scale(y, x).dynamic()
    graph = step.graph_on(stream)
    with pytest.raises(dop.OwnershipError, match="read-only"):
        graph.node(step).set(out=ro.partition([128]))
    graph.replay()
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * xs)
    assert host.flags.writeable is False and not np.array_equal(host, 2 * xs)


def test_a_writable_import_is_still_writable(rng):
    xs = rng.standard_normal(N).astype(np.float32)
    foreign = ForeignArray(xs.copy())
    t = dop.from_dlpack(foreign, device=dop.ReferenceDevice(0))
    scale(t, upload(xs, dop.ReferenceDevice(0).new_stream())).sync_on(dop.ReferenceDevice(0).new_stream())
    np.testing.assert_array_equal(foreign.array, 2 * xs)


class ReadOnlyCudaArray:
    """A CuPy array exported through __cuda_array_interface__ with ``readonly`` set."""

    def __init__(self, array):
        self.array = array
        iface = dict(array.__cuda_array_interface__)
        iface["data"] = (iface["data"][0], True)
        self.__cuda_array_interface__ = iface


@pytest.mark.gpu
def test_a_read_only_cuda_array_import_is_never_written_on_the_gpu(rng):
    import cupy
    device = dop.CudaDevice(0)
    stream = device.new_stream()
    xs = rng.standard_normal(N).astype(np.float32)
    c = cupy.asarray(xs)
    ro = dop.Tensor.from_cuda_array_interface(ReadOnlyCudaArray(c), device=device)
    src = dop.from_numpy(rng.standard_normal(N).astype(np.float32), device=device, stream=stream)
    with pytest.raises(dop.OwnershipError, match="read-only"):
        api.memcpy(ro, src)
    with pytest.raises(dop.OwnershipError, match="read-only"):
        scale(ro, src)
    y = dop.empty(N, device=device, stream=stream)
    scale(y, ro).sync_on(stream)
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * xs)
    np.testing.assert_array_equal(cupy.asnumpy(c), xs)


# -- a loop borrows its index and count read-only ------------------------------------------------------

_BUMP = r"""extern "C" __global__ void bump_cell(int* c) { c[0] += 1; }"""


def _bump_ref(g, c):
    c[0] += 1


bump = dop.Kernel("bump_cell", _BUMP, [dop.Out("c", "int32", rank=1)], block=1, reference=_bump_ref)


def int32_cell(v, stream):
    return dop.from_numpy(np.array([v], np.int32), stream=stream)


def _run(op, mode, stream):
    if mode == "eager":
        op.sync_on(stream)
    elif mode == "graph_on":
        op.graph_on(stream).replay()
    else:
        with CudaGraph.scope(stream) as s:
            s.record(op)
        s.graph.replay()
    stream.synchronize()


def _writers(stream, index, count, other):
    """Bodies that write the loop's index or count: (what is written, body builder)."""
    src = int32_cell(7, stream)
    return [
        ("its index", lambda i: bump(i.partition([1]))),                                   # known when built
        ("its count", lambda i: zip_(bump(other.partition([1])), api.memcpy(count, src))),
        ("its index", lambda i: dop.value(i).then(lambda t: bump(t.partition([1])))),      # known when it runs
        ("its count", lambda i: dop.value(None).then(lambda _: api.memcpy(count, src))),
        ("its index", lambda i: dop.loop(2, i, lambda j: dop.value(None))),                # a nested loop's index
        ("its index", lambda i: dop.loop(2, other, lambda j: bump(i.partition([1])))),      # inside a nested loop
        ("its count", lambda i: dop.while_(other, lambda: api.memcpy(count, src))),        # inside a nested while_
    ]


@pytest.mark.parametrize("mode", ["eager", "graph_on", "scope"])
def test_a_loop_body_that_writes_its_index_or_count_is_refused(stream, mode):
    for k in range(7):
        index, count, other = int32_cell(-5, stream), int32_cell(3, stream), int32_cell(0, stream)
        what, body = _writers(stream, index, count, other)[k]
        with pytest.raises(dop.OwnershipError, match=rf"loop\(count tensor\)'s body writes {what}.*read-only"):
            _run(dop.loop(count, index, body), mode, stream)
        assert not stream.is_capturing()
        assert count.numpy(stream=stream)[0] == 3, f"body {k}: the count was written"
        if k < 2 or mode != "eager":  # refused before the loop began (an eager loop sets the index first)
            assert index.numpy(stream=stream)[0] == -5, f"body {k}: the loop began"


@pytest.mark.parametrize("mode", ["eager", "graph_on", "scope"])
def test_a_loop_body_that_writes_a_view_of_the_count_is_refused(stream, mode):
    cells = dop.from_numpy(np.array([0, 4, 0, 0], np.int32), stream=stream)
    count, index = cells[1:2], int32_cell(0, stream)
    body = lambda i: bump(cells[0:2].partition([2]))  # noqa: E731 (overlaps the count)
    with pytest.raises(dop.OwnershipError, match="writes its count"):
        _run(dop.loop(count, index, body), mode, stream)
    np.testing.assert_array_equal(cells.numpy(stream=stream), [0, 4, 0, 0])


@pytest.mark.parametrize("mode", ["eager", "graph_on", "scope"])
def test_a_loop_body_reads_its_index_and_writes_elsewhere_the_same_way_eagerly_and_captured(stream, mode):
    index, count, seen, last = (int32_cell(v, stream) for v in (0, 4, 0, -1))
    cond = int32_cell(0, stream)
    outer = dop.loop(count, index, lambda i: zip_(bump(seen.partition([1])), api.memcpy(last, i),
                                                  dop.while_(cond, lambda: bump(seen.partition([1])))))
    _run(outer, mode, stream)
    assert seen.numpy(stream=stream)[0] == 4 and last.numpy(stream=stream)[0] == 3
    assert index.numpy(stream=stream)[0] == 4  # the iterations run, counted by the loop alone
    with pytest.raises(dop.OwnershipError, match="writes its index"):  # a body never run is checked too
        _run(dop.loop(count, index, lambda i: dop.while_(cond, lambda: bump(i.partition([1])))), mode, stream)


@pytest.mark.parametrize("mode", ["eager", "graph_on", "scope"])
def test_what_a_then_returns_in_a_loop_body_follows_the_body_rules_eagerly_as_captured(stream, rng, mode):
    """(A graph launch there is a child graph of the body: tests/test_child_graphs.py.)"""
    cond, sink = int32_cell(-2, stream), int32_cell(0, stream)
    unsafe = lambda: api.zeros([4])  # noqa: E731
    body = lambda: zip_(bump(cond.partition([1])), bump(sink.partition([1])),  # noqa: E731 (two iterations)
                        dop.value(None).then(lambda _: unsafe()))
    with pytest.raises(dop.GraphSafetyError, match="it allocates"):
        _run(dop.while_(cond, body), mode, stream)
    assert not stream.is_capturing()
    assert sink.numpy(stream=stream)[0] == (1 if mode == "eager" else 0)  # eagerly, what came before it ran


def _poke(s, t):  # a foreign body (its reference below runs on the reference device)
    raise AssertionError("never runs: the write is refused first")


@pytest.mark.parametrize("mode", ["eager", "graph_on", "scope"])
def test_a_foreign_op_in_a_loop_body_that_writes_the_index_is_refused(stream, mode):
    """dop.foreign declares its writes: a loop body's foreign op writing the loop's index is
    refused as a kernel output into it is, before the body runs."""
    index, count = int32_cell(-5, stream), int32_cell(3, stream)
    body = lambda i: dop.foreign(_poke, writes=[i], reference=lambda t: t.fill(7))  # noqa: E731
    with pytest.raises(dop.OwnershipError, match=r"body writes its index \(dop.foreign\(_poke\) writes into it\)"):
        _run(dop.loop(count, index, body), mode, stream)
    assert not stream.is_capturing()
    assert index.numpy(stream=stream)[0] in (-5, 0)  # an eager loop sets the index before its first body


def test_a_collective_in_a_loop_body_that_writes_the_index_is_refused():
    import deviceop.distributed as dist

    def rank(group):
        s = group.stream
        index, count = int32_cell(0, s), int32_cell(2, s)
        with pytest.raises(dop.OwnershipError, match=r"body writes its index \(dist.all_reduce"):
            dop.loop(count, index, lambda i: dist.all_reduce(group, i)).sync_on(s)
        return int(count.numpy(stream=s)[0])
    assert dist.run_reference(2, rank) == [2, 2]


def test_a_foreign_op_never_writes_a_read_only_import(rng):
    x, host = read_only_import(rng.standard_normal(N).astype(np.float32))
    with pytest.raises(dop.OwnershipError, match=r"dop.foreign\(_poke\) writes writes\[0\].*read-only memory"):
        dop.foreign(_poke, writes=[x], reference=lambda t: t.fill(0))
    np.testing.assert_array_equal(x.numpy(), host)


@pytest.mark.parametrize("mode", ["eager", "graph_on", "scope"])
def test_a_branch_in_a_loop_body_that_writes_the_index_is_refused(stream, mode):
    """The branch's op is built when the branch runs (or is captured), after the loop's body was
    checked, so the loop's guard must reach the branch's context too."""
    index, count, on = int32_cell(-5, stream), int32_cell(3, stream), int32_cell(1, stream)
    body = lambda i: dop.if_(on, lambda: bump(i.partition([1])))  # noqa: E731
    with pytest.raises(dop.OwnershipError, match=r"loop\(count tensor\)'s body writes its index.*read-only"):
        _run(dop.loop(count, index, body), mode, stream)
    assert not stream.is_capturing()
    assert count.numpy(stream=stream)[0] == 3
