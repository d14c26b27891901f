"""Kernels declared as their authors wrote them: any number of outputs (Out) and
in-out tensors (InOut), at any position, each checked for ownership and aliasing.

* a layernorm written like llm.c's: ``(out, mean, rstd, inp, weight, bias, N, C)``,
  three outputs;
* a GEMM written like CUTLASS's reference GEMM: its output ``C`` is the 10th of 11
  parameters, read (beta * C) and written;
* an accumulator whose in-out ``acc`` comes first and whose output comes last.

Runs on Device(0): the kernels' NumPy references here, their CUDA on the H100."""
import gc

import numpy as np
import pytest

import deviceop as dop
from deviceop import In, InOut, Kernel, Out, Scalar, api

LAYERNORM = r"""
extern "C" __global__ void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                             const float* weight, const float* bias, int N, int C) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;   // one thread per row
    if (row >= N) return;
    const float* x = inp + (long long)row * C;
    float m = 0.0f;
    for (int i = 0; i < C; i++) m += x[i];
    m = m / C;
    float v = 0.0f;
    for (int i = 0; i < C; i++) { float d = x[i] - m; v += d * d; }
    float s = rsqrtf(v / C + 1e-5f);
    float* o = out + (long long)row * C;
    for (int i = 0; i < C; i++) o[i] = s * (x[i] - m) * weight[i] + bias[i];
    mean[row] = m;
    rstd[row] = s;
}
"""


def _layernorm_ref(g, out, mean, rstd, inp, weight, bias, n, c):
    x = inp.astype(np.float64)
    m = x.mean(axis=1)
    s = 1.0 / np.sqrt(((x - m[:, None]) ** 2).mean(axis=1) + 1e-5)
    out[...] = s[:, None] * (x - m[:, None]) * weight + bias
    mean[...], rstd[...] = m, s


layernorm = Kernel(
    "layernorm_forward", LAYERNORM,
    [Out("out", "float32", shape=("N", "C"), tile=(32, "C")), Out("mean", "float32", shape=("N",), tile=(32,)),
     Out("rstd", "float32", shape=("N",), tile=(32,)), In("inp", "float32", shape=("N", "C")),
     In("weight", "float32", shape=("C",)), In("bias", "float32", shape=("C",)),
     Scalar("N", "int32"), Scalar("C", "int32")],
    block=32, reference=_layernorm_ref)   # the scalars N and C are the sizes its shapes name

GEMM = r"""
template <int T>
__global__ void reference_gemm(int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                               float beta, float* C, int ldc) {
    int i = blockIdx.x * T + threadIdx.x / T, j = blockIdx.y * T + threadIdx.x % T;
    if (i >= M || j >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc += A[i * lda + k] * B[k * ldb + j];
    C[i * ldc + j] = alpha * acc + beta * C[i * ldc + j];
}
"""


def _gemm_ref(g, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    c[...] = alpha * (a.astype(np.float64) @ b.astype(np.float64)) + beta * c.astype(np.float64)


def _gemm_check(g, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    if (lda, ldb, ldc) != (k, n, n):   # M, N, K: the sizes its shapes name
        raise dop.ShapeError(f"reference_gemm: lda, ldb, ldc = {lda}, {ldb}, {ldc} must be K, N, N = {k}, {n}, {n} "
                             "(row-major, unpadded)")


reference_gemm = Kernel(
    "reference_gemm", GEMM,
    [Scalar("M", "int32"), Scalar("N", "int32"), Scalar("K", "int32"), Scalar("alpha", "float32"),
     In("A", "float32", shape=("M", "K")), Scalar("lda", "int32"), In("B", "float32", shape=("K", "N")),
     Scalar("ldb", "int32"), Scalar("beta", "float32"), Out("C", "float32", shape=("M", "N"), tile=("T", "T")),
     Scalar("ldc", "int32")],
    generics=["T"], block=lambda g: g["T"] * g["T"], reference=_gemm_ref, validate=_gemm_check)

ACCUMULATE = r"""
template <int B>
__global__ void accumulate(float* acc, const float* x, float a, float* out) {
    int i = blockIdx.x * B + threadIdx.x;
    float v = acc[i] + a * x[i];
    acc[i] = v;
    out[i] = v;
}
"""


def _accumulate_ref(g, acc, x, a, out):
    acc += np.float32(a) * x
    out[...] = acc


accumulate = Kernel(
    "accumulate", ACCUMULATE,
    [InOut("acc", "float32", shape=("N",)), In("x", "float32", shape=("N",)), Scalar("a", "float32"),
     Out("out", "float32", shape=("N",), tile=("B",))],
    generics=["B"], block=lambda g: g["B"], reference=_accumulate_ref)


def put(rng, shape, stream):
    return dop.from_numpy(rng.standard_normal(shape).astype(np.float32), stream=stream)


# -- several outputs: a layernorm as llm.c writes it ---------------------------------------------------------

def test_a_layernorm_with_three_outputs(stream, rng):
    n, c = 64, 48
    inp, weight, bias = put(rng, (n, c), stream), put(rng, c, stream), put(rng, c, stream)
    out, mean, rstd = dop.empty((n, c), stream=stream), dop.empty(n, stream=stream), dop.empty(n, stream=stream)
    launch = layernorm(out.partition([32, c]), mean.partition([32]), rstd.partition([32]), inp, weight, bias, n, c)
    assert "mean: out float32 [N] tile [32]" in repr(layernorm)
    part = launch.first().sync_on(stream)
    assert part.tensor is out and part.grid == (2, 1)  # the first Out: the grid's partition
    x = inp.numpy(stream=stream).astype(np.float64)
    m, s = x.mean(axis=1), 1 / np.sqrt(x.var(axis=1) + 1e-5)
    np.testing.assert_allclose(mean.numpy(stream=stream), m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rstd.numpy(stream=stream), s, rtol=1e-4)
    expect = s[:, None] * (x - m[:, None]) * weight.numpy(stream=stream) + bias.numpy(stream=stream)
    np.testing.assert_allclose(out.numpy(stream=stream), expect, rtol=1e-4, atol=1e-4)
    # captured: all three outputs written at every replay
    graph = layernorm(out.partition([32, c]), mean.partition([32]), rstd.partition([32]), inp, weight, bias, n,
                      c).graph_on(stream)
    host = rng.standard_normal((n, c)).astype(np.float32)
    api.memcpy(inp, dop.from_numpy(host, stream=stream)).sync_on(stream)
    graph.launch().sync_on(stream)
    np.testing.assert_allclose(mean.numpy(stream=stream), host.astype(np.float64).mean(axis=1), rtol=1e-5, atol=1e-5)


def test_each_output_is_checked_for_aliasing_and_ownership(stream, rng):
    n, c = 32, 16
    inp, weight, bias = put(rng, (n, c), stream), put(rng, c, stream), put(rng, c, stream)
    out, stats = dop.empty((n, c), stream=stream), dop.empty(2 * n, stream=stream)
    mean, rstd = stats[:n], stats[n:]
    with pytest.raises(dop.AliasingError, match="layernorm_forward writes mean and rstd, which overlap"):
        layernorm(out.partition([32, c]), mean.partition([32]), mean.partition([32]), inp, weight, bias, n, c) \
            .sync_on(stream)
    with pytest.raises(dop.AliasingError, match="writes out and reads inp from overlapping memory"):
        layernorm(inp.partition([32, c]), mean.partition([32]), rstd.partition([32]), inp, weight, bias, n, c) \
            .sync_on(stream)
    shared = dop.empty(n, stream=stream).into_shared()
    reader = shared.clone()
    with pytest.raises(dop.OwnershipError, match="1 other live SharedTensor handle"):
        shared.try_partition([32])  # an output of a launch is claimed as the first one is
    reader.release()
    layernorm(out.partition([32, c]), mean.partition([32]), shared.try_partition([32]), inp, weight, bias, n, c) \
        .sync_on(stream)
    with pytest.raises(dop.LaunchError, match="argument rstd of layernorm_forward must be a Partition"):
        layernorm(out.partition([32, c]), mean.partition([32]), rstd, inp, weight, bias, n, c)


# -- the output anywhere: a GEMM as CUTLASS's reference GEMM takes its arguments ----------------------------------

def test_a_gemm_whose_output_is_its_tenth_parameter(stream, rng):
    m, n, k, t = 32, 48, 40, 16
    a, b, c = put(rng, (m, k), stream), put(rng, (k, n), stream), put(rng, (m, n), stream)
    c0 = c.numpy(stream=stream).astype(np.float64)
    launch = reference_gemm(m, n, k, 1.5, a, k, b, n, -0.5, c.partition([t, t]), n)
    assert launch.describe() == "reference_gemm" and reference_gemm.grid_index == 9
    part = launch.first().sync_on(stream)  # T inferred from C's tile; first() is C
    assert part.tensor is c and part.grid == (2, 3)
    expect = 1.5 * (a.numpy(stream=stream).astype(np.float64) @ b.numpy(stream=stream)) - 0.5 * c0
    np.testing.assert_allclose(c.numpy(stream=stream), expect, rtol=1e-4, atol=1e-4)
    step = reference_gemm(m, n, k, 1.0, a, k, b, n, 0.0, c.partition([t, t]), n).dynamic("alpha")
    graph = step.graph_on(stream)
    graph.node(step).set(alpha=2.0)  # a node update of a kernel whose output is not first
    graph.launch().sync_on(stream)
    np.testing.assert_allclose(c.numpy(stream=stream), 2 * (a.numpy(stream=stream).astype(np.float64)
                                                            @ b.numpy(stream=stream)), rtol=1e-4, atol=1e-4)
    square, other = put(rng, (m, m), stream), put(rng, (m, m), stream)
    with pytest.raises(dop.AliasingError, match="reference_gemm writes C and reads A"):
        reference_gemm(m, m, m, 1.0, square, m, other, m, 0.0, square.partition([t, t]), m).sync_on(stream)
    with pytest.raises(dop.LaunchError, match="argument C of reference_gemm must be a Partition"):
        reference_gemm(m, n, k, 1.0, a, k, b, n, 0.0, c, n)


# -- in-out tensors ---------------------------------------------------------------------------------------------

def test_an_in_out_tensor_is_read_and_written(stream, rng):
    acc, x, out = put(rng, 256, stream), put(rng, 256, stream), dop.empty(256, stream=stream)
    start, xs = acc.numpy(stream=stream), x.numpy(stream=stream)
    assert "acc: inout float32 [N]" in repr(accumulate)
    assert accumulate(acc, x, 2.0, out.partition([128])).first().unpartition().sync_on(stream) is out
    accumulate(acc, x, 2.0, out.partition([128])).sync_on(stream)
    np.testing.assert_allclose(acc.numpy(stream=stream), start + 4 * xs, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out.numpy(stream=stream), acc.numpy(stream=stream))
    graph = accumulate(acc, x, 1.0, out.partition([128])).graph_on(stream)
    for _ in range(3):
        graph.replay()
    np.testing.assert_allclose(acc.numpy(stream=stream), start + 7 * xs, rtol=1e-5, atol=1e-5)


def test_an_in_out_tensor_is_checked_for_aliasing(stream, rng):
    buf, out = put(rng, 512, stream), dop.empty(256, stream=stream)
    with pytest.raises(dop.AliasingError, match="accumulate writes acc and reads x from overlapping memory.*InOut"):
        accumulate(buf[:256], buf[128:384], 1.0, out.partition([128])).sync_on(stream)
    with pytest.raises(dop.AliasingError, match="accumulate writes acc and out, which overlap"):
        accumulate(buf[:256], put(rng, 256, stream), 1.0, buf[128:384].partition([128])).sync_on(stream)
    with pytest.raises(dop.LaunchError, match=r"argument acc of accumulate \(read and written\) must be a Tensor.*"
                                              r"pass partition.tensor"):
        accumulate(buf[:256].partition([128]), buf[256:], 1.0, out.partition([128]))


def test_a_shared_in_out_tensor_must_be_held_alone_at_every_launch(stream, rng):
    """A SharedTensor in-out is checked at each launch: a launch seen before is no
    verdict on handles cloned since (such launches skip the verdict cache)."""
    acc, x, out = put(rng, 256, stream).into_shared(), put(rng, 256, stream), dop.empty(256, stream=stream)
    accumulate(acc, x, 1.0, out.partition([128])).sync_on(stream)
    accumulate(acc, x, 1.0, out.partition([128])).sync_on(stream)  # the same launch again: still accepted
    other = acc.clone()
    with pytest.raises(dop.OwnershipError, match="accumulate writes acc: .*1 other live SharedTensor handle"):
        accumulate(acc, x, 1.0, out.partition([128])).sync_on(stream)
    with pytest.raises(dop.OwnershipError):  # refused when built, too
        accumulate(acc, x, 1.0, out.partition([128]))
    other.release()
    view = acc.view([16, 16])  # a borrow through the handle reaches the buffer as well
    with pytest.raises(dop.OwnershipError, match="live borrow"):
        accumulate(acc, x, 1.0, out.partition([128]))
    del view
    gc.collect()
    accumulate(acc, x, 1.0, out.partition([128])).sync_on(stream)


def test_a_kernel_needs_an_output_to_cut_its_grid_from():
    with pytest.raises(dop.LaunchError, match="declares no Out.*the launch grid is an output partition's tiles"):
        Kernel("k", "extern \"C\" __global__ void k(float* a) {}", [InOut("a", "float32")])


def test_the_scalars_a_kernel_takes_are_the_sizes_its_shapes_name(stream, rng):
    """llm.c's N and C, CUTLASS's M, N, K: a scalar that disagrees with the tensors is
    refused naming both, with no hand-written check."""
    n, c = 64, 48
    inp, weight, bias = put(rng, (n, c), stream), put(rng, c, stream), put(rng, c, stream)
    out, mean, rstd = dop.empty((n, c), stream=stream), dop.empty(n, stream=stream), dop.empty(n, stream=stream)
    with pytest.raises(dop.ShapeError, match=r"layernorm_forward<C=40>: argument out has shape \[64, 48\], but its "
                                             r"axis 1 is C: 40 from the scalar argument C, 48 here; pass C=48"):
        layernorm(out.partition([32, c]), mean.partition([32]), rstd.partition([32]), inp, weight, bias, n,
                  40).sync_on(stream)
    a, b, cm = put(rng, (32, 16), stream), put(rng, (16, 32), stream), dop.empty((32, 32), stream=stream)
    with pytest.raises(dop.ShapeError, match=r"reference_gemm<K=8>: argument A has shape \[32, 16\], but its axis 1 "
                                             r"is K: 8 from the scalar argument K, 16 here; pass K=16"):
        reference_gemm(32, 32, 8, 1.0, a, 16, b, 32, 0.0, cm.partition([16, 16]), 32).generics([16]).sync_on(stream)


def test_parameters_can_be_passed_by_their_declared_names(stream, rng):
    # llm.c's argument order is easy to get wrong by position: by name it reads as the C signature
    n, c = 32, 48
    inp, weight, bias = put(rng, (n, c), stream), put(rng, c, stream), put(rng, c, stream)
    outs = [(dop.empty((n, c), stream=stream), dop.empty(n, stream=stream), dop.empty(n, stream=stream))
            for _ in range(2)]
    (o1, m1, r1), (o2, m2, r2) = outs
    layernorm(o1.partition([32, c]), m1.partition([32]), r1.partition([32]), inp, weight, bias, n, c).sync_on(stream)
    layernorm(o2.partition([32, c]), m2.partition([32]), r2.partition([32]),  # the rest by name, in any order
              C=c, N=n, bias=bias, weight=weight, inp=inp).sync_on(stream)
    for a, b in ((o1, o2), (m1, m2), (r1, r2)):
        np.testing.assert_array_equal(a.numpy(stream=stream), b.numpy(stream=stream))
    before = m2.numpy(stream=stream)

    def outputs():
        return o2.partition([32, c]), m2.partition([32]), r2.partition([32])
    with pytest.raises(dop.LaunchError, match="no parameter 'bogus'"):
        layernorm(*outputs(), inp, weight, bias, n, c, bogus=1)
    with pytest.raises(dop.LaunchError, match="'N' given twice"):
        layernorm(*outputs(), inp, weight, bias, n, c, N=n)
    with pytest.raises(dop.LaunchError, match="'bias' missing"):
        layernorm(*outputs(), inp=inp, weight=weight, N=n, C=c)
    np.testing.assert_array_equal(m2.numpy(stream=stream), before)  # nothing ran


def test_a_parameter_named_self_is_passed_by_name_too(stream, rng):
    # C names a parameter `self` freely; by name it was Kernel.__call__'s own self (a raw TypeError)
    src = r'extern "C" __global__ void copy_self(float* out, const float* self) { out[threadIdx.x] = self[threadIdx.x]; }'
    copy_self = Kernel("copy_self", src, [Out("out", "float32", shape=("N",), tile=(32,)),
                                          In("self", "float32", shape=("N",))],
                       block=32, reference=lambda g, out, x: out.__setitem__(..., x))
    x, y = put(rng, 32, stream), dop.empty(32, stream=stream)
    copy_self(y.partition([32]), self=x).sync_on(stream)
    np.testing.assert_array_equal(y.numpy(stream=stream), x.numpy(stream=stream))
