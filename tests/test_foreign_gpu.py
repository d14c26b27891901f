"""dop.foreign on a GPU: a cuBLAS GEMM through torch (torch.cuda.ExternalStream), a
cuBLAS GEMM through CuPy (cupy.cuda.ExternalStream) and a Triton kernel, each run
eagerly and captured, the graph replayed with new input data: every replay
bit-equal to the eager op on the same data, and close to float64.  Then bodies a
graph cannot replay (a synchronization, an allocation, work on the legacy default
stream, a torch temporary, work on another stream or on the capturing stream
itself, an exception of the body's own): each refused when captured, with the
capture ended, nothing recorded, and the stream (and the next capture) usable.

CPU tests of the same op: tests/test_foreign.py."""
import numpy as np
import pytest

import deviceop as dop
from deviceop import api

try:
    import triton
    import triton.language as tl
except ImportError:  # the Triton test says so when it skips
    triton = None

if triton is not None:
    @triton.jit
    def _scale_shift(x_ptr, y_ptr, n, a, b, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = i < n
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=keep) * a + b, mask=keep)

M, K, N = 64, 256, 96


def torch_matmul(s, x, w, y):
    import torch
    with torch.cuda.stream(s.torch):  # torch.cuda.ExternalStream of the handed stream
        torch.matmul(torch.from_dlpack(x), torch.from_dlpack(w), out=torch.from_dlpack(y))


def cupy_scale_shift(s, x, y):
    """CuPy's elementwise kernels capture (its cuBLAS routines refuse a capturing stream: docs/interop.md)."""
    import cupy
    with s.cupy:
        cupy.add(cupy.multiply(x.to_cupy(), 1.5, out=y.to_cupy()), -0.25, out=y.to_cupy())


def triton_scale_shift(s, x, y):
    import torch
    n = x.shape[0]
    with torch.cuda.stream(s.torch):  # Triton launches on torch's current stream
        _scale_shift[(triton.cdiv(n, 256),)](torch.from_dlpack(x), torch.from_dlpack(y), n, 1.5, -0.25, BLOCK=256)


def gemm64(x, w):
    return x.astype(np.float64) @ w.astype(np.float64)


def scale_shift64(x):
    return x.astype(np.float64) * 1.5 - 0.25


def replays_match_eager(stream, rng, body, shapes, out_shape, exact64, rtol):
    """Eager, then captured (warm-up first) and replayed 3 times with new inputs: each
    replay bit-equal to the eager op on the same inputs, and close to float64."""
    reads = [dop.from_numpy(rng.standard_normal(s).astype(np.float32), stream=stream) for s in shapes]
    y, eager = dop.empty(out_shape, stream=stream), dop.empty(out_shape, stream=stream)
    dop.foreign(body, reads=reads, writes=[eager]).sync_on(stream)
    hosts = [r.numpy(stream=stream) for r in reads]
    np.testing.assert_allclose(eager.numpy(stream=stream), exact64(*hosts), rtol=rtol, atol=rtol)
    graph = dop.foreign(body, reads=reads, writes=[y], warmup=True).graph_on(stream)
    assert [n["type"] for n in graph.nodes()] == ["GRAPH"]  # the library's work: one child-graph node
    nan = dop.from_numpy(np.full(out_shape, np.nan, np.float32), stream=stream)
    for _ in range(3):
        hosts = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        for r, h in zip(reads, hosts):
            api.memcpy(r, dop.from_numpy(h, stream=stream)).sync_on(stream)
        api.memcpy(y, nan).sync_on(stream)  # the replay must write every element
        graph.launch().sync_on(stream)
        dop.foreign(body, reads=reads, writes=[eager]).sync_on(stream)
        got = y.numpy(stream=stream)
        np.testing.assert_array_equal(got.view(np.uint32), eager.numpy(stream=stream).view(np.uint32))
        np.testing.assert_allclose(got, exact64(*hosts), rtol=rtol, atol=rtol)
    graph.close()


@pytest.mark.gpu
def test_a_torch_matmul_eager_and_replayed(stream, rng):
    pytest.importorskip("torch")
    replays_match_eager(stream, rng, torch_matmul, [(M, K), (K, N)], (M, N), gemm64, 1e-3)


@pytest.mark.gpu
def test_a_cupy_kernel_eager_and_replayed(stream, rng):
    pytest.importorskip("cupy")
    replays_match_eager(stream, rng, cupy_scale_shift, [(5000,)], (5000,), scale_shift64, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(triton is None, reason="triton is not installed here")
def test_a_triton_kernel_eager_and_replayed(stream, rng):
    replays_match_eager(stream, rng, triton_scale_shift, [(5000,)], (5000,), scale_shift64, 1e-6)


@pytest.mark.gpu
def test_foreign_work_between_kernels_in_one_graph(stream, rng):
    """A torch GEMM between two deviceop kernels: the graph orders them as the op does."""
    pytest.importorskip("torch")
    from deviceop.kernels import affine
    x, w = (dop.from_numpy(rng.standard_normal(s).astype(np.float32), stream=stream) for s in [(M, K), (K, N)])
    x2, y, z = dop.empty((M, K), stream=stream), dop.empty((M, N), stream=stream), dop.empty((M, N), stream=stream)
    scaled = affine(x2.view(M * K).partition([512]), x.view(M * K), 2.0, 0.0).first().unpartition().reshape(M, K)
    gemm = dop.foreign(torch_matmul, reads=[scaled, w], writes=[y], warmup=True)
    shifted = affine(z.view(M * N).partition([512]), gemm.first().reshape(M * N), 1.0, 1.0)
    graph = shifted.graph_on(stream)
    assert [n["type"] for n in graph.nodes()].count("GRAPH") == 1
    for _ in range(2):
        host = rng.standard_normal((M, K)).astype(np.float32)
        api.memcpy(x, dop.from_numpy(host, stream=stream)).sync_on(stream)
        graph.launch().sync_on(stream)
        np.testing.assert_allclose(z.numpy(stream=stream), gemm64(2 * host, w.numpy(stream=stream)) + 1, rtol=1e-3,
                                   atol=1e-3)


@pytest.mark.gpu
def test_a_body_that_returns_its_result_instead_of_writing_it_is_refused(stream, rng):
    """Eagerly the new array's result was dropped and y kept what it held (the reference device
    refuses a reference that returns its result); returning the write, as out= does, is fine."""
    torch = pytest.importorskip("torch")
    x, w = (dop.from_numpy(rng.standard_normal(s).astype(np.float32), stream=stream) for s in [(M, K), (K, N)])
    y = dop.empty((M, N), stream=stream)

    def returns_a_new_array(s, x, w, y):
        with torch.cuda.stream(s.torch):
            return torch.matmul(torch.from_dlpack(x), torch.from_dlpack(w))

    def returns_its_write(s, x, w, y):
        with torch.cuda.stream(s.torch):
            return torch.matmul(torch.from_dlpack(x), torch.from_dlpack(w), out=torch.from_dlpack(y))

    with pytest.raises(dop.LaunchError, match=r"dop.foreign\(returns_a_new_array\)'s body returned a Tensor that is "
                                              r"none of its writes=.*out=torch.from_dlpack\(y\)"):
        dop.foreign(returns_a_new_array, reads=[x, w], writes=[y]).sync_on(stream)
    expected = gemm64(x.numpy(stream=stream), w.numpy(stream=stream))
    dop.foreign(returns_its_write, reads=[x, w], writes=[y]).sync_on(stream)
    np.testing.assert_allclose(y.numpy(stream=stream), expected, rtol=1e-3, atol=1e-3)
    api.memcpy(y, dop.from_numpy(np.full((M, N), np.nan, np.float32), stream=stream)).sync_on(stream)
    dop.foreign(returns_its_write, reads=[x, w], writes=[y], warmup=True).graph_on(stream).launch().sync_on(stream)
    np.testing.assert_allclose(y.numpy(stream=stream), expected, rtol=1e-3, atol=1e-3)


# -- what a capture cannot record ------------------------------------------------------------------------

def syncs(s, x, y):
    s.synchronize()  # deviceop's own sync: cuStreamSynchronize


def cupy_syncs(s, x, y):
    import cupy
    cupy.cuda.runtime.streamSynchronize(s.ptr)


def allocates(s, x, y):
    import cupy
    cupy.cuda.runtime.malloc(1 << 20)  # cudaMalloc


def uses_the_legacy_stream(s, x, y):
    import cupy
    cupy.multiply(x.to_cupy(), 2.0, out=y.to_cupy())  # CuPy's current stream: the legacy default stream


def torch_temporary(s, x, y):
    import torch
    with torch.cuda.stream(s.torch):
        torch.from_dlpack(y).copy_(torch.from_dlpack(x) * 2)  # x * 2 is a block of torch's allocator


def raises(s, x, y):
    raise ValueError("the body's own error")


CASES = {
    "a deviceop sync": (syncs, dop.CaptureError, r"broke its capture \(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED.*"
                                                  r"a synchronization.*warmup=True"),
    "a cudaStreamSynchronize": (cupy_syncs, dop.CaptureError, r"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED.*"
                                                             r"cudaErrorStreamCaptureUnsupported"),
    "a cudaMalloc": (allocates, dop.CaptureError, r"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED.*an allocation"),
    "the legacy stream": (uses_the_legacy_stream, dop.CaptureError, r"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT.*legacy "
                                                                   r"default stream.*s\.torch"),
    "a torch temporary": (torch_temporary, dop.CaptureError, r"allocated \d+ block\(s\) through torch's caching "
                                                            r"allocator.*out="),
    "the body's error": (raises, ValueError, "the body's own error"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_what_a_capture_cannot_record_is_refused_and_the_stream_goes_on(stream, rng, case):
    body, error, says = CASES[case]
    pytest.importorskip("torch")
    x, y = dop.from_numpy(rng.standard_normal(4096).astype(np.float32), stream=stream), dop.empty(4096, stream=stream)
    if body in (uses_the_legacy_stream, torch_temporary):
        dop.foreign(body, reads=[x], writes=[y]).sync_on(stream)  # eagerly first: kernels compiled, torch ready
        dop.Device(0).synchronize()
    before = api.memcpy(dop.empty(4096, stream=stream), x)
    with pytest.raises(error, match=says) as refused:
        dop.foreign(body, reads=[before], writes=[y], name=case).graph_on(stream)
    if error is dop.CaptureError:  # deviceop's own error names the op; the body's goes on unchanged
        assert f"dop.foreign({case})" in str(refused.value)
    assert not stream.is_capturing()
    before.sync_on(stream)  # handed back unexecuted by the failed capture: it runs now
    graph = dop.foreign(cupy_double, reads=[x], writes=[y], warmup=True).graph_on(stream)  # a capture works
    graph.launch().sync_on(stream)
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * x.numpy(stream=stream))


def cupy_double(s, x, y):  # a body a capture records: y = 2 x on the handed stream
    import cupy
    with s.cupy:
        cupy.multiply(x.to_cupy(), 2.0, out=y.to_cupy())


@pytest.mark.gpu
def test_work_on_another_stream_or_on_the_capturing_stream_is_refused(stream, rng):
    torch = pytest.importorskip("torch")
    x, y = dop.from_numpy(rng.standard_normal(4096).astype(np.float32), stream=stream), dop.empty(4096, stream=stream)
    stream.synchronize()
    other = torch.cuda.Stream()
    xt, yt = torch.from_dlpack(x), torch.from_dlpack(y)  # views made before: the body only launches

    def elsewhere(s, x, y):
        with torch.cuda.stream(other):
            yt.copy_(xt)

    def on_the_capturing_stream(s, x, y):
        with stream.cupy:  # the op's stream, which deviceop is capturing, not the handed one
            import cupy
            cupy.multiply(x.to_cupy(), 2.0, out=y.to_cupy())

    dop.foreign(on_the_capturing_stream, reads=[x], writes=[y]).sync_on(stream)  # compiles CuPy's kernel
    with pytest.raises(dop.CaptureError, match=r"captured no work on the stream the body is handed: its work went "
                                               r"to another stream"):
        dop.foreign(elsewhere, reads=[x], writes=[y]).graph_on(stream)
    assert not stream.is_capturing()
    torch.cuda.synchronize()
    with pytest.raises(dop.CaptureError, match=r"enqueued work on .*the stream deviceop is capturing, instead of on "
                                               r"the stream the body is handed"):
        dop.foreign(on_the_capturing_stream, reads=[x], writes=[y]).graph_on(stream)
    assert not stream.is_capturing()
