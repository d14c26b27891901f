"""The reference device's float64 copies of weight matrices (deviceop/runtime/refcache.py).

kernels/_refmath.py's ``matvec64`` reads a kept float64 copy of a matrix instead of
promoting it at every launch.  A copy is right only while the memory under it is
unchanged, so every way the reference device writes memory drops it, and memory
handed out (DLPack, a foreign op's reference, a collective) is never copied again.
Each test keeps a copy, writes the matrix one way, and checks that the next product
is, bit for bit, the one of promoting the new values (what every launch did before).
"""
import ml_dtypes
import numpy as np
import pytest

import deviceop as dop
from deviceop import InOut, Kernel, Out, Scalar, api
from deviceop import distributed as dist
from deviceop.kernels import affine
from deviceop.runtime import refcache
from deviceop.kernels._refmath import BLOCK, matvec64

R, K = 8, 128  # a float32 matrix [R, K]: its flat view is what the write paths write
B = 256


@pytest.fixture
def ref():
    return dop.ReferenceDevice(0).new_stream()


def fresh(rng, stream, dtype=np.float32, shape=(R, K)):
    return dop.from_numpy(rng.standard_normal(shape).astype(dtype), stream=stream)


def promoted(values, x):
    """``matvec64`` of a matrix not kept (a host array the device does not own): the promotion path."""
    return matvec64(np.array(values), x)


def kept(w) -> bool:
    """Does the device hold a float64 copy of ``w`` now?  (The first product makes it.)"""
    return refcache.is_kept(w._array)


def product_after(write, w, x, stream):
    """Keep a copy of ``w``, write it with ``write()``, and return (the product now, the promoted one)."""
    before = matvec64(w._array, x)
    assert kept(w) and np.array_equal(before, promoted(w.numpy(stream=stream), x))
    write()
    after = w.numpy(stream=stream)
    return matvec64(w._array, x), promoted(after, x), before


def check(write, w, x, stream):
    got, want, before = product_after(write, w, x, stream)
    assert np.array_equal(got, want), "a kept float64 copy outlived a write"
    assert not np.array_equal(got, before)  # the write changed the matrix


def test_a_kept_copy_gives_the_same_bits_as_promoting_at_every_launch(ref, rng):
    """SmolLM2's shapes, bf16: split over two threads or not, the same block products."""
    for n, k in [(960, 576), (1536, 576), (576, 1536), (3 * BLOCK // 576 + 5, 576)]:
        w, x = fresh(rng, ref, ml_dtypes.bfloat16, (n, k)), rng.standard_normal(k)
        first = matvec64(w._array, x)  # promotes, and keeps the copy
        assert kept(w)
        assert np.array_equal(matvec64(w._array, x), first)
        assert np.array_equal(first, promoted(w.numpy(stream=ref), x))


def test_a_kernel_out_write_drops_the_copy(ref, rng):
    w, x, src = fresh(rng, ref), rng.standard_normal(K), fresh(rng, ref, shape=(R * K,))
    matvec64(w._array, x)
    y = dop.empty(R * K, stream=ref)
    affine(y.partition([B]), w.view(R * K), 2.0, 1.0).generics([B]).sync_on(ref)  # reads w: the copy stays
    assert kept(w)
    check(lambda: affine(w.view(R * K).partition([B]), src, 2.0, 1.0).generics([B]).sync_on(ref), w, x, ref)


def test_a_kernel_inout_write_drops_the_copy(ref, rng):
    source = r"""
extern "C" __global__ void twice(float* acc, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { acc[i] *= 2.0f; out[i] = acc[i]; }
}
"""

    def reference(g, acc, out, n):
        acc[...] = acc * np.float32(2.0)
        out[...] = acc

    twice = Kernel("twice", source, [InOut("acc", "float32", shape=("N",)),
                                     Out("out", "float32", shape=("N",), tile=(B,)), Scalar("N", "int32")],
                   block=B, reference=reference)
    w, x, out = fresh(rng, ref), rng.standard_normal(K), dop.empty(R * K, stream=ref)
    check(lambda: twice(w.view(R * K), out.partition([B]), R * K).sync_on(ref), w, x, ref)


def test_memcpy_and_fill_drop_the_copy(ref, rng):
    w, x = fresh(rng, ref), rng.standard_normal(K)
    check(lambda: api.memcpy(w, fresh(rng, ref)).sync_on(ref), w, x, ref)
    check(lambda: api.fill(w, float(rng.standard_normal())).sync_on(ref), w, x, ref)


def test_a_replayed_copy_and_an_updated_node_drop_the_copy(ref, rng):
    w, x, y, src = fresh(rng, ref), rng.standard_normal(K), fresh(rng, ref), fresh(rng, ref, shape=(R * K,))
    graph = api.memcpy(w, src).graph_on(ref)
    check(lambda: (api.memcpy(src, fresh(rng, ref, shape=(R * K,))).sync_on(ref), graph.launch().sync_on(ref)),
          w, x, ref)
    # a kernel node whose output is switched to w: the replay writes w
    step = affine(y.view(R * K).partition([B]), src, 3.0, -1.0).generics([B]).dynamic("out")
    graph = step.graph_on(ref)
    graph.node(step).set(out=w.view(R * K).partition([B]))
    check(lambda: graph.launch().sync_on(ref), w, x, ref)


def test_memory_handed_out_is_never_copied(ref, rng):
    x = rng.standard_normal(K)
    w = fresh(rng, ref)
    matvec64(w._array, x)
    assert kept(w)
    w.__dlpack__()  # a consumer may now write it unseen
    assert not kept(w)
    matvec64(w._array, x)
    assert not kept(w)

    w = fresh(rng, ref)
    matvec64(w._array, x)

    def reference(w):
        w[...] = -w
    check(lambda: dop.foreign(lambda *_: None, writes=[w], reference=reference).sync_on(ref), w, x, ref)
    assert not kept(w)


def test_a_collective_drops_the_copy_and_its_memory_is_never_copied(rng):
    data = [rng.standard_normal((R, K)).astype(np.float32) for _ in range(2)]
    x = rng.standard_normal(K)

    def rank(group):
        s = group.stream
        w = dop.from_numpy(data[group.rank], stream=s)
        before = matvec64(w._array, x)
        dist.all_reduce(group, w).sync_on(s)  # in place
        return before, matvec64(w._array, x), w.numpy(stream=s), kept(w)

    for before, got, values, still in dist.run_reference(2, rank):
        assert np.array_equal(got, promoted(values, x)) and not np.array_equal(got, before) and not still


def test_a_budget_that_is_not_a_number_is_refused(ref, rng, monkeypatch):
    monkeypatch.setenv("DEVICEOP_REFERENCE_CACHE_MB", "lots")
    w = fresh(rng, ref)
    with pytest.raises(dop.ConfigError, match="DEVICEOP_REFERENCE_CACHE_MB='lots' is not a number of MiB"):
        matvec64(w._array, rng.standard_normal(K))
    monkeypatch.setenv("DEVICEOP_REFERENCE_CACHE_MB", "0")  # none kept: promoted at every product
    got = matvec64(w._array, np.ones(K))
    assert not kept(w) and np.array_equal(got, promoted(w.numpy(stream=ref), np.ones(K)))


@pytest.mark.parametrize("n", [40, 113, 5 * 113, 200 * 113 + 7])
def test_a_shared_product_is_every_block_once_whichever_thread_takes_it(ref, rng, n):
    """A kept copy's product is shared between the caller and a helper thread a block at a
    time; one partial block, whole blocks only, many blocks: the promoted bits."""
    w, x = fresh(rng, ref, ml_dtypes.bfloat16, (n, 576)), rng.standard_normal(576)
    assert np.array_equal(matvec64(w._array, x), promoted(w.numpy(stream=ref), x))
    assert kept(w) and np.array_equal(matvec64(w._array, x), promoted(w.numpy(stream=ref), x))


def test_the_caller_does_not_wait_for_a_helper_that_has_not_started(ref, rng):
    """On a busy machine the helper thread may start late: the caller takes every block itself."""
    import threading
    from deviceop.kernels import _refmath
    idle = _refmath._Helper.__new__(_refmath._Helper)  # a helper whose thread never runs
    idle.jobs = __import__("queue").SimpleQueue()
    w, x = fresh(rng, ref, ml_dtypes.bfloat16, (3072, 576)), rng.standard_normal(576)
    want = matvec64(w._array, x)
    rows = BLOCK // 576
    out = np.empty(3072)
    done = threading.Thread(target=idle.share, args=(refcache.float64_of(w._array), x, out, rows,
                                                       -(-3072 // rows)))
    done.start()
    done.join(timeout=30)
    assert not done.is_alive() and np.array_equal(out, want)


def test_a_view_given_another_dtype_in_place_is_not_served_the_old_copy(ref, rng):
    """float64_of remembers its answer per view object; a view's dtype (or shape) can be
    reassigned in place, and then it is another matrix."""
    w, x = fresh(rng, ref, ml_dtypes.bfloat16, (R, K)), rng.standard_normal(K)
    view = w._array[:]
    matvec64(view, x)
    assert refcache.is_kept(view)
    view.dtype = np.float16  # the same bytes read as float16
    assert np.array_equal(matvec64(view, x), promoted(view, x))
