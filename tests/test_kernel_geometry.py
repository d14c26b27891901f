"""Kernels that do not follow the output-tile convention declare their launch
geometry (grid, block, dynamic shared memory, cluster) as shape expressions or a
Python function, checked against CUDA's limits; and C++ kernels are declared by
their plain name (the NVRTC name expression is generated).  Runs on Device(0):
the references here, the CUDA (and so the geometry) on the H100."""
from pathlib import Path

import numpy as np
import pytest

import deviceop as dop
from deviceop import In, InOut, Kernel, Out, Scalar

# in place, no Out: a thread an element, (n + 255) / 256 blocks, the last one partial
SCALE_INPLACE = r"""
extern "C" __global__ void scale_inplace(float* x, float a, int n) {
    int i = blockIdx.x * 256 + threadIdx.x;
    if (i < n) x[i] *= a;
}
"""


def _scale_ref(g, x, a, n):
    x *= np.float32(a)


scale_inplace = Kernel("scale_inplace", SCALE_INPLACE,
                       [InOut("x", "float32", shape=("n",)), Scalar("a", "float32"), Scalar("n", "int32")],
                       grid=("(n+255)//256",), block=256, reference=_scale_ref)

# a block a row, W warps reducing through dynamic shared memory: the output is one tile
ROW_SUMS = r"""
template <int W>
__global__ void row_sums(float* out, const float* x, int cols) {
    extern __shared__ float partial[];
    const float* row = x + (long long)blockIdx.x * cols;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < cols; i += 32 * W) acc += row[i];
    partial[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int i = 0; i < 32 * W; i++) s += partial[i];
        out[blockIdx.x] = s;
    }
}
"""


def _row_sums_ref(g, out, x, cols):
    out[...] = x.astype(np.float64).sum(axis=1)


row_sums = Kernel("row_sums", ROW_SUMS,
                  [Out("out", "float32", shape=("R",), tile=("R",)), In("x", "float32", shape=("R", "cols")),
                   Scalar("cols", "int32")],
                  generics=["W"], grid=("R",), block="32*W", shared_mem="4*32*W", reference=_row_sums_ref)


def put(rng, shape, stream):
    return dop.from_numpy(rng.standard_normal(shape).astype(np.float32), stream=stream)


def test_an_in_place_kernel_with_a_declared_grid_and_no_output_partition(stream, rng):
    x = put(rng, 1000, stream)  # 4 blocks, the last one a quarter full
    host = x.numpy(stream=stream)
    launch = scale_inplace(x, 3.0, 1000)
    assert launch.first().unpartition().sync_on(stream) is x  # first(): the in-out tensor
    np.testing.assert_allclose(x.numpy(stream=stream), 3.0 * host, rtol=1e-6)
    plan = next(iter(scale_inplace._plans.values()))
    assert plan.config.grid == (4, 1, 1) and plan.config.block == (256, 1, 1)
    graph = scale_inplace(x, 0.5, 1000).graph_on(stream)  # captured (nothing runs): every replay halves x
    for _ in range(2):
        graph.launch().sync_on(stream)
    np.testing.assert_allclose(x.numpy(stream=stream), 0.75 * host, rtol=1e-6)


def test_grid_block_and_shared_memory_from_expressions(stream, rng):
    x = put(rng, (5, 300), stream)
    out = dop.empty(5, stream=stream)
    row_sums(out.partition([5]), x, 300).generics([4]).sync_on(stream)  # 5 blocks of 128, 512 bytes
    np.testing.assert_allclose(out.numpy(stream=stream), x.numpy(stream=stream).astype(np.float64).sum(axis=1),
                               rtol=1e-5, atol=1e-5)
    (config,) = {p.config for p in row_sums._plans.values()}
    assert (config.grid, config.block, config.shared_mem) == ((5, 1, 1), (128, 1, 1), 512)


def test_a_grid_function_reads_the_arguments(stream, rng):
    k = Kernel("row_sums", ROW_SUMS, row_sums.params, generics=["W"], block=32, shared_mem=128,
               grid=lambda g, out, x, cols: (x.shape[0],), reference=_row_sums_ref)
    x, out = put(rng, (3, 64), stream), dop.empty(3, stream=stream)
    k(out.partition([3]), x, 64).generics([1]).sync_on(stream)
    np.testing.assert_allclose(out.numpy(stream=stream), x.numpy(stream=stream).astype(np.float64).sum(axis=1),
                               rtol=1e-5, atol=1e-5)
    assert {p.config.grid for p in k._plans.values()} == {(3, 1, 1)}


def test_geometry_functions_may_return_lists_as_tuples(stream, rng):
    """A grid or block function returning [x] (a list, as a tuple would be) launches as its tuple does."""
    k = Kernel("row_sums", ROW_SUMS, row_sums.params, generics=["W"], block=lambda g: [32 * g["W"]],
               shared_mem=lambda g: 128 * g["W"], grid=lambda g, out, x, cols: [x.shape[0]], reference=_row_sums_ref)
    x, out = put(rng, (3, 64), stream), dop.empty(3, stream=stream)
    k(out.partition([3]), x, 64).generics([2]).sync_on(stream)
    np.testing.assert_allclose(out.numpy(stream=stream), x.numpy(stream=stream).astype(np.float64).sum(axis=1),
                               rtol=1e-5, atol=1e-5)
    assert {(p.config.grid, p.config.block) for p in k._plans.values()} == {((3, 1, 1), (64, 1, 1))}


def test_a_geometry_past_cudas_limits_is_refused_naming_the_declaration_and_the_values(stream, rng):
    x, out = put(rng, (2, 64), stream), dop.empty(2, stream=stream)
    with pytest.raises(dop.LaunchError, match=r"row_sums's launch geometry \(grid=\[R\], block=32\*W, "
                                              r"shared_mem=4\*32\*W\) with R=2, W=64: block 2048 has 2048 "
                                              r"threads; CUDA allows at most 1024"):
        row_sums(out.partition([2]), x, 64).generics([64]).sync_on(stream)
    with pytest.raises(dop.LaunchError, match=r"scale_inplace's launch geometry \(grid=\[\(n\+255\)//256\], "
                                              r"block=256, shared_mem=0\) with n=0: grid must be 1 to 3 positive ints"):
        scale_inplace(dop.empty(0, stream=stream), 2.0, 0).sync_on(stream)
    clustered = Kernel("row_sums", ROW_SUMS, row_sums.params, generics=["W"], grid=("R",), block=32,
                       shared_mem=128, cluster=("W",), reference=_row_sums_ref)
    with pytest.raises(dop.LaunchError, match=r"with R=2, W=4: cluster \(4, 1, 1\) does not divide grid \(2, 1, 1\)"):
        clustered(out.partition([2]), x, 64).generics([4]).sync_on(stream)


def test_launch_shapes_of_the_wrong_kind_are_refused_naming_the_kernel(stream, rng):
    x, out = put(rng, (3, 64), stream), dop.empty(3, stream=stream)
    no_block = Kernel("row_sums", ROW_SUMS, row_sums.params, generics=["W"], block=lambda g: None, shared_mem=128,
                      reference=_row_sums_ref)                       # forgot its return: a raw TypeError before
    with pytest.raises(dop.LaunchError, match=r"row_sums's launch geometry \(block=<lambda>.*block must be 1 to 3 "
                                              r"positive ints, got None"):
        no_block(out.partition([3]), x, 64).generics([1]).sync_on(stream)
    with pytest.raises(dop.LaunchError, match="block must be 1 to 3 positive ints, got True"):
        Kernel("row_sums", ROW_SUMS, row_sums.params, generics=["W"], block=lambda g: True,
               reference=_row_sums_ref)(out.partition([3]), x, 64).generics([1]).sync_on(stream)
    numpy_grid = Kernel("row_sums", ROW_SUMS, row_sums.params, generics=["W"], block=32, shared_mem=np.int64(128),
                        grid=lambda g, out, x, cols: (np.int64(x.shape[0]),), reference=_row_sums_ref)
    numpy_grid(out.partition([3]), x, 64).generics([1]).sync_on(stream)          # NumPy ints are ints
    assert {p.config.grid for p in numpy_grid._plans.values()} == {(3, 1, 1)}
    by_zero = Kernel("scale_inplace", SCALE_INPLACE, scale_inplace.params, grid=lambda g, x, a, n: (n // 0,),
                     reference=_scale_ref)                           # no generics: the function is what fails
    with pytest.raises(dop.LaunchError, match=r"ZeroDivisionError.*a kernel without generics: the function itself "
                                              r"fails on these arguments"):
        by_zero(put(rng, 8, stream), 2.0, 8).sync_on(stream)


SCALE_3D = r"""
extern "C" __global__ void scale_3d(float* x, float a, int n) {   // a thread an element, of any block shape
    int t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    int i = blockIdx.x * blockDim.x * blockDim.y * blockDim.z + t;
    if (i < n) x[i] *= a;
}
"""


def test_a_block_of_more_than_64_threads_along_z_is_refused_on_both_devices(stream, rng):
    # 128 threads in all is fine, but CUDA's z axis holds 64 at most: the driver refused it and the
    # reference device ran it
    x = put(rng, 256, stream)

    def scale_3d(block):
        return Kernel("scale_3d", SCALE_3D, scale_inplace.params, grid=(1,), block=block, reference=_scale_ref)

    with pytest.raises(dop.LaunchError, match=r"block \(1, 1, 128\) has 128 threads along z; CUDA allows at most "
                                              r"64 there \(1024 along x and y\)"):
        scale_3d((1, 1, 128))(x, 2.0, 256).sync_on(stream)
    host = x.numpy(stream=stream)
    scale_3d((2, 2, 64))(x, 2.0, 256).sync_on(stream)  # 64 along z is the limit, and allowed
    np.testing.assert_allclose(x.numpy(stream=stream), 2.0 * host, rtol=1e-6)


def test_a_reference_that_cannot_take_the_kernels_arguments_is_refused_eagerly_and_captured_alike(stream, rng):
    # it raised a raw TypeError at an eager launch, and only at the first replay when captured: refused
    # when the kernel is first loaded (before a capture begins), on both devices, after the code's own checks
    x = put(rng, 256, stream)
    no_g = Kernel("scale_inplace", SCALE_INPLACE, scale_inplace.params, grid=(1,), reference=lambda x, a, n: None)
    for run in (lambda op: op.sync_on(stream), lambda op: op.graph_on(stream)):
        with pytest.raises(dop.LaunchError, match=r"kernel scale_inplace's reference <lambda>\(x, a, n\) cannot be "
                                                  r"called as reference\(g, x, a, n\).*the generics, then an array"):
            run(no_g(x, 2.0, 256))
        assert not stream.is_capturing()
    saxpy = Kernel.from_binary("saxpy", Path(__file__).parent / "data" / "nvcc" / "saxpy.sm_90.cubin",
                               [InOut("y", "float32", shape=("n",)), In("x", "float32", shape=("n",)),
                                Scalar("a", "float32"), Scalar("n", "int32")], grid=(1,), block=256,
                               reference=lambda g, y, x, a, n, b: None)
    with pytest.raises(dop.LaunchError, match=r"reference\(g, y, x, a, n\) \(missing a required argument: 'b'\)"):
        saxpy(put(rng, 256, stream), x, 2.0, 256).sync_on(stream)


def test_deviceop_work_inside_a_kernels_reference_is_refused_at_replay_as_eagerly(rng):
    # eagerly the launch's execution refused it; a replay ran the reference outside any execution,
    # and the copy inside it ran, unrecorded (a GPU replay never calls the reference)
    ref = dop.ReferenceDevice(0).new_stream()
    x, seen = put(rng, 256, ref), dop.empty(256, stream=ref)

    def scale_and_copy(g, xs, a, n):
        xs *= np.float32(a)
        dop.api.memcpy(seen, x).sync_on(ref)

    k = Kernel("scale_inplace", SCALE_INPLACE, scale_inplace.params, grid=(1,), block=256, reference=scale_and_copy)
    with pytest.raises(dop.ReentrancyError, match=r"sync_on\(api.memcpy\) was called while sync_on\(scale_inplace\)"):
        k(x, 2.0, 256).sync_on(ref)
    graph = k(x, 2.0, 256).graph_on(ref)
    with pytest.raises(dop.ReentrancyError, match=r"sync_on\(api.memcpy\) was called while scale_inplace is "
                                                  r"executing"):
        graph.replay()
    dop.api.memcpy(seen, x).sync_on(ref)  # the stream goes on


def test_dynamic_shared_memory_past_the_gpus_limit_is_refused_on_both_devices(stream, rng):
    # an H100 (and the sm_90 the reference device stands for) opts a block in to 227 KB at most
    big = Kernel("row_sums", ROW_SUMS, row_sums.params, generics=["W"], grid=("R",), block=32, shared_mem=300000,
                 reference=_row_sums_ref)
    x, out = put(rng, (2, 64), stream), dop.empty(2, stream=stream)
    with pytest.raises(dop.LaunchError, match=r"asks for 300000 bytes of dynamic shared memory.* allows at most "
                                              r"232448 per block in all"):
        big(out.partition([2]), x, 64).generics([1]).sync_on(stream)


def test_a_captured_node_cannot_change_what_the_geometry_reads(stream, rng):
    x = put(rng, 512, stream)
    with pytest.raises(dop.LaunchError, match=r"scale_inplace's launch geometry reads x, n \(its declared grid=, "
                                              r"block=, shared_mem= or cluster=\), which a captured node cannot "
                                              r"recompute: mark only the other arguments dynamic"):
        scale_inplace(x, 2.0, 512).dynamic()
    launch = scale_inplace(x, 2.0, 512).dynamic("a")  # the factor does not move the grid
    graph = launch.graph_on(stream)
    host = x.numpy(stream=stream)
    graph.node(launch).set(a=3.0)
    graph.launch().sync_on(stream)
    np.testing.assert_allclose(x.numpy(stream=stream), 3.0 * host, rtol=1e-6)  # the replay scales by the new a


def test_geometry_declarations_are_checked():
    with pytest.raises(dop.LaunchError, match=r"kernel k's grid=\[M\] reads M: an expression of the geometry names "
                                              r"generics, sizes the shapes name, or int scalar parameters"):
        Kernel("k", SCALE_INPLACE, scale_inplace.params, grid=("M",))
    with pytest.raises(dop.LaunchError, match=r"kernel k declares nothing it writes: declare each tensor the kernel "
                                              r"writes as Out \(a partition\) or InOut"):
        Kernel("k", SCALE_INPLACE, [In("x", "float32", shape=("n",)), Scalar("a", "float32"), Scalar("n", "int32")],
               grid=("n",))
    with pytest.raises(dop.LaunchError, match=r"kernel k declares no Out\(\.\.\.\).*or declare the grid \(grid=\.\.\.\)"):
        Kernel("k", SCALE_INPLACE, scale_inplace.params)
    with pytest.raises(dop.LaunchError, match=r"kernel k's grid: 1 to 3 dimensions or a function, got \(1, 1, 1, 1\)"):
        Kernel("k", SCALE_INPLACE, scale_inplace.params, grid=(1, 1, 1, 1))
    with pytest.raises(dop.LaunchError, match=r"parameter y: its tile \[4, 0\] has a 0, and a tile cannot be empty"):
        Out("y", "float32", shape=("N", "M"), tile=(4, 0))  # no partition has it: no launch could ever match
    with pytest.raises(dop.LaunchError, match=r"kernel k's block: cannot read '32\*'"):
        Kernel("k", SCALE_INPLACE, scale_inplace.params, grid=(1,), block="32*")


# -- C++ kernels by their plain name ---------------------------------------------------------------------

CPP = r"""
__global__ void axpy(float* y, const float* x, float a) {      // C++ linkage: a mangled symbol
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    y[i] = a * x[i] + y[i];
}
namespace ops {
__global__ void axpy(float* y, const float* x, float a) { int i = blockIdx.x * blockDim.x + threadIdx.x;
                                                          y[i] = a * x[i] + 2.0f * y[i]; }
}
"""


def test_a_cpp_kernel_is_declared_by_its_plain_name(stream, rng):
    params = [InOut("y", "float32", shape=("N",)), In("x", "float32", shape=("N",)), Scalar("a", "float32")]
    for entry, twice in (("axpy", 1.0), ("ops::axpy", 2.0), ("_Z4axpyPfPKff", 1.0)):  # a mangled entry works too
        k = Kernel("axpy", CPP, params, entry=entry, grid=("N//128",), block=128,
                   reference=lambda g, y, x, a, twice=twice: y.__setitem__(..., a * x + twice * y))
        prog, expr = k.compile(arch="sm_90")
        assert prog.symbol(expr).startswith("_Z") and prog.param_layout(expr) == [(0, 8), (8, 8), (16, 4)]
        y, x = put(rng, 256, stream), put(rng, 256, stream)
        before = y.numpy(stream=stream)
        k(y, x, 2.0).sync_on(stream)
        np.testing.assert_allclose(y.numpy(stream=stream), 2.0 * x.numpy(stream=stream) + twice * before, rtol=1e-5,
                                   atol=1e-6)
