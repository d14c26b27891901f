"""Loops on the device: ``dop.loop(count, index, body)`` and ``dop.while_(cond, body)``.

Eagerly a loop is a host loop; captured it is one conditional WHILE node, so
one graph launch runs every iteration.  These tests run on the reference
device here and on the H100 under gpu-check; the ``gpu`` ones look at the
driver-level graph.
"""
import numpy as np
import pytest

import deviceop as dop
from deviceop import api
from deviceop.kernel import In, Kernel, Out
from deviceop.kernels import affine, load_row, store_row

# Two small kernels for these tests: a countdown (the body of a while_ loop
# changes its own condition) and a 2-D visit counter for nested loops.
_TEST_SOURCE = r"""
extern "C" __global__ void countdown(int* c) { c[0] -= 1; }
extern "C" __global__ void visit(int* seen, const int* i, const int* j, const int* width) {
    atomicAdd(&seen[i[0] * width[0] + j[0]], 1);
}
"""


def _countdown_ref(g, c):
    c[0] -= 1


def _visit_ref(g, seen, i, j, width):
    seen[i[0] * width[0] + j[0]] += 1


countdown = Kernel("countdown", _TEST_SOURCE, [Out("c", "int32", rank=1)], block=1, reference=_countdown_ref)
visit = Kernel("visit", _TEST_SOURCE,
               [Out("seen", "int32", rank=1), In("i", "int32", rank=1), In("j", "int32", rank=1),
                In("width", "int32", rank=1)], block=1, reference=_visit_ref)


def int32_cell(v, stream):
    return dop.from_numpy(np.array([v], np.int32), stream=stream)


class Rows:
    """T input rows, T output rows, scratch vectors: out[t] = alpha * table[t] + beta."""

    def __init__(self, rng, stream, T=6, d=256):
        self.T, self.d = T, d
        self.host = rng.standard_normal((T, d)).astype(np.float32)
        self.table = dop.from_numpy(self.host, stream=stream)
        self.out = dop.from_numpy(np.full((T, d), np.nan, np.float32), stream=stream)
        self.x, self.y = dop.empty([d], stream=stream), dop.empty([d], stream=stream)
        self.index = int32_cell(-1, stream)
        self.launches = []  # the affine launch of each build of the body

    def body(self, alpha=2.0, beta=1.0):
        def build(i):
            scale = affine(self.y.partition([128]), self.x, alpha, beta).generics([128]).dynamic("alpha")
            self.launches.append(scale)
            return dop.zip_(load_row(self.x.partition([128]), self.table, i, self.T).generics([128]), scale,
                            store_row(self.out.partition([self.T, 128]), self.y, i, self.T).generics([128]))
        return build

    def expect(self, rows, alpha=2.0, beta=1.0):
        ref = np.full((self.T, self.d), np.nan)
        ref[:rows] = alpha * self.host[:rows].astype(np.float64) + beta
        return ref


def assert_rows(got, ref):
    assert np.array_equal(np.isnan(got), np.isnan(ref)), "rows written where they should not be (or missing)"
    done = ~np.isnan(ref)
    np.testing.assert_allclose(got[done], ref[done], rtol=1e-6, atol=1e-6)


def test_loop_runs_eagerly_as_a_host_loop(stream, rng):
    r = Rows(rng, stream)
    dop.loop(r.T, r.index, r.body()).sync_on(stream)
    assert_rows(r.out.numpy(stream=stream), r.expect(r.T))
    assert r.index.numpy(stream=stream)[0] == r.T  # after a loop the index holds the iteration count
    assert len(r.launches) == r.T                   # eagerly the body is built once per iteration


def test_a_captured_loop_is_one_node_replayed_with_one_launch(stream, rng):
    r = Rows(rng, stream)
    graph = dop.loop(r.T, r.index, r.body()).graph_on(stream)
    assert len(r.launches) == 1                     # captured: the body is built once
    assert np.isnan(r.out.numpy(stream=stream)).all()  # capture records, it does not run
    graph.replay()
    stream.synchronize()
    assert_rows(r.out.numpy(stream=stream), r.expect(r.T))
    assert r.index.numpy(stream=stream)[0] == r.T
    assert "CONDITIONAL" in graph.summary()["by_type"]
    graph.close()


def test_a_count_tensor_changes_the_iterations_without_recapture(stream, rng):
    r = Rows(rng, stream)
    count = int32_cell(r.T, stream)
    graph = dop.loop(count, r.index, r.body()).graph_on(stream)
    for n in (3, 0, r.T, 1):
        api.memcpy(r.out, dop.from_numpy(np.full((r.T, r.d), np.nan, np.float32), stream=stream)).sync_on(stream)
        api.memcpy(count, dop.from_numpy(np.array([n], np.int32), stream=stream)).sync_on(stream)
        graph.replay()
        stream.synchronize()
        assert_rows(r.out.numpy(stream=stream), r.expect(n))
        assert r.index.numpy(stream=stream)[0] == n
    graph.close()


def test_while_runs_until_the_body_clears_the_condition(stream, rng):
    x0 = rng.standard_normal(256).astype(np.float32)
    for capture in (False, True):
        cond, x = int32_cell(5, stream), dop.from_numpy(x0, stream=stream)
        y = dop.empty([256], stream=stream)

        def body():  # y = 2x + 0; x = y; cond -= 1
            return dop.zip_(affine(y.partition([128]), x, 2.0, 0.0).generics([128]), api.memcpy(x, y),
                            countdown(cond.partition([1])))
        op = dop.while_(cond, body)
        if capture:
            graph = op.graph_on(stream)
            graph.replay()
            stream.synchronize()
            graph.close()
        else:
            op.sync_on(stream)
        assert cond.numpy(stream=stream)[0] == 0
        np.testing.assert_allclose(x.numpy(stream=stream), x0 * 32.0, rtol=1e-6)


def test_a_while_loop_whose_condition_starts_false_runs_nothing(stream, rng):
    cond = int32_cell(0, stream)
    graph = dop.while_(cond, lambda: countdown(cond.partition([1]))).graph_on(stream)
    graph.replay()
    stream.synchronize()
    assert cond.numpy(stream=stream)[0] == 0


@pytest.mark.parametrize("capture", [False, True])
def test_nested_loops_visit_every_pair_once(stream, capture):
    rows, cols = 4, 3
    seen = dop.from_numpy(np.zeros(rows * cols, np.int32), stream=stream)
    i, j, width = int32_cell(0, stream), int32_cell(0, stream), int32_cell(cols, stream)
    op = dop.loop(rows, i, lambda i_: dop.loop(cols, j, lambda j_: visit(seen.partition([rows * cols]), i_, j_,
                                                                         width)))
    if capture:
        graph = op.graph_on(stream)
        graph.replay()
        graph.replay()
        stream.synchronize()
        graph.close()
        expected = 2
    else:
        op.sync_on(stream)
        expected = 1
    assert (seen.numpy(stream=stream) == expected).all()


def test_loops_compose_with_other_work_and_record_in_a_scope(stream, rng):
    r = Rows(rng, stream)
    first = dop.from_numpy(np.zeros(r.d, np.float32), stream=stream)
    with dop.CudaGraph.scope(stream) as s:
        s.record(dop.loop(r.T, r.index, r.body(alpha=-1.0, beta=0.5)))
        s.record(api.memcpy(first, r.out.view([r.T * r.d])[:r.d]))  # after the loop: its first row
    s.graph.replay()
    stream.synchronize()
    ref = r.expect(r.T, alpha=-1.0, beta=0.5)
    assert_rows(r.out.numpy(stream=stream), ref)
    np.testing.assert_allclose(first.numpy(stream=stream), ref[0], rtol=1e-6)
    s.graph.close()


# -- bad input ---------------------------------------------------------------------------

def test_the_index_and_condition_must_be_int32_cells_on_the_device(stream):
    body = lambda *_: None  # noqa: E731
    with pytest.raises(dop.DTypeError, match="int32"):
        dop.loop(3, dop.empty([1], "float32", stream=stream), body)
    with pytest.raises(dop.DTypeError, match="device tensor"):
        dop.loop(3, np.zeros(1, np.int32), body)  # a host array: the GPU could not read it
    with pytest.raises(dop.ShapeError, match="one element"):
        dop.loop(3, dop.empty([2], "int32", stream=stream), body)
    with pytest.raises(dop.DTypeError, match="int32"):
        dop.while_(dop.empty([1], "int64", stream=stream), body)
    with pytest.raises(dop.DTypeError, match="int32"):
        dop.loop(dop.empty([1], "float32", stream=stream), int32_cell(0, stream), body)
    with pytest.raises(dop.ShapeError, match="count"):
        dop.loop(-1, int32_cell(0, stream), body)
    cell = int32_cell(0, stream)
    with pytest.raises(dop.LaunchError, match="same buffer"):
        dop.loop(cell, cell, body)


def test_the_body_is_a_function_that_builds_the_op(stream):
    cond = int32_cell(1, stream)
    with pytest.raises(dop.LaunchError, match="function that builds"):
        dop.while_(cond, countdown(cond.partition([1])))


@pytest.mark.parametrize("capture", [False, True])
def test_a_body_that_allocates_is_refused_and_the_stream_stays_usable(stream, capture):
    op = dop.loop(2, int32_cell(0, stream), lambda i: api.zeros([16]))
    with pytest.raises(dop.GraphSafetyError, match="allocate before the loop"):
        op.graph_on(stream) if capture else op.sync_on(stream)
    assert not stream.is_capturing()
    cond = int32_cell(3, stream)
    dop.while_(cond, lambda: countdown(cond.partition([1]))).sync_on(stream)  # the stream still works
    assert cond.numpy(stream=stream)[0] == 0


def test_without_conditional_nodes_capture_says_so_and_eager_loops_still_run(stream, rng, monkeypatch):
    """Simulates a pre-12.4 driver: the capability check is what decides."""
    device = stream.device
    monkeypatch.setattr(type(device), "conditional_nodes",
                        lambda self: (False, "the driver supports CUDA 12.2 (conditional nodes need 12.4)"))
    r = Rows(rng, stream)
    with pytest.raises(dop.CapabilityError, match="12.4"):
        dop.loop(r.T, r.index, r.body()).graph_on(stream)
    assert not stream.is_capturing()
    dop.loop(r.T, r.index, r.body()).sync_on(stream)
    assert_rows(r.out.numpy(stream=stream), r.expect(r.T))


# -- inside a captured loop ----------------------------------------------------------------

def test_the_body_lives_in_the_conditional_node_and_its_kernels_can_be_updated(stream, rng):
    r = Rows(rng, stream)
    graph = dop.loop(r.T, r.index, r.body()).graph_on(stream)
    top = graph.summary()
    assert top["by_type"].get("CONDITIONAL") == 1
    assert "affine" not in " ".join(top["kernels"])  # the body's kernels are inside the node, not beside it
    graph.node(r.launches[0]).set(alpha=-3.0)         # a kernel node in the loop body, updated in place
    graph.replay()
    stream.synchronize()
    assert_rows(r.out.numpy(stream=stream), r.expect(r.T, alpha=-3.0))
    graph.close()


def test_the_loop_control_kernels_and_the_row_kernels_compile_for_sm_90():
    """No GPU needed: CI compiles what a captured loop launches (the control
    kernels call cudaGraphSetConditional, which the driver resolves at load)."""
    from deviceop.graph.loops import _CONTROL_SOURCE
    prog = dop.compile_cubin(_CONTROL_SOURCE, arch="sm_90", filename="deviceop_loop.cu")
    assert prog.cubin[:4] == b"\x7fELF"
    for kernel in (load_row, store_row):
        prog, expr = kernel.compile([128], arch="sm_90")
        assert prog.cubin[:4] == b"\x7fELF" and expr in prog.lowered_names


def test_row_kernels_refuse_a_table_that_does_not_fit(stream):
    table, x, out = dop.empty([4, 256], stream=stream), dop.empty([256], stream=stream), dop.empty([128], stream=stream)
    i = int32_cell(0, stream)
    with pytest.raises(dop.ShapeError, match="rows=3"):
        load_row(x.partition([128]), table, i, 3).generics([128]).sync_on(stream)
    with pytest.raises(dop.ShapeError, match=r"argument table has shape \[4, 256\], but its axis 1 is D: 128 "
                                             r"from out's shape, 256 here; pass a table of shape \[4, 128\]"):
        load_row(out.partition([128]), table, i, 4).generics([128]).sync_on(stream)
    with pytest.raises(dop.ShapeError, match=r"store_row<rows=4>: partition table with \[4, 128\], not \[1, 128\]"):
        store_row(table.partition([1, 128]), x, i, 4).generics([128]).sync_on(stream)
    with pytest.raises(dop.DTypeError):
        store_row(table.partition([4, 128]), x, dop.empty([1], "float32", stream=stream), 4)
