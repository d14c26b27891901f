"""Tensors: allocation, views without copies, transfers, partitions, interop.

These run on Device(0): the reference device in CI, the GPU under gpu-check.
"""
import numpy as np
import pytest

import deviceop as dop


@pytest.mark.parametrize("dt", [dop.float32, dop.float16, dop.bfloat16, dop.int32])
def test_round_trip_through_the_device(rng, dt):
    host = rng.standard_normal((3, 5)).astype(dt.np) if dt.is_floating else rng.integers(-9, 9, (3, 5), dtype=np.int32)
    t = dop.from_numpy(host)
    assert t.shape == (3, 5) and t.dtype is dt and t.strides == (5, 1)
    assert t.nbytes == 15 * dt.itemsize
    np.testing.assert_array_equal(t.numpy(), host)


def test_views_share_memory_and_refuse_bad_sizes(rng):
    host = rng.standard_normal(24).astype(np.float32)
    t = dop.from_numpy(host)
    v = t.view(2, 3, 4)
    assert v.shape == (2, 3, 4) and v.data_ptr == t.data_ptr
    assert t.reshape([4, -1]).shape == (4, 6)
    with pytest.raises(dop.ShapeError, match="holds 25 elements but the tensor has 24"):
        t.view(5, 5)
    with pytest.raises(dop.ShapeError, match="cannot infer the -1"):
        t.view(5, -1)


def test_non_contiguous_views_never_copy_silently(rng):
    t = dop.from_numpy(rng.standard_normal((4, 6)).astype(np.float32))
    col = t[:, 1:3]
    assert col.shape == (4, 2) and col.strides == (6, 1) and not col.is_contiguous
    assert col.data_ptr == t.data_ptr + 4
    with pytest.raises(dop.ShapeError, match="non-contiguous"):
        col.view(8)
    with pytest.raises(dop.ShapeError, match="only basic indexing"):
        t[[0, 1]]


def test_memory_ranges_detect_overlap(rng):
    t = dop.from_numpy(rng.standard_normal(100).astype(np.float32))
    a, b, c = t[0:50], t[40:60], t[50:100]
    assert a.overlaps(b) and b.overlaps(c) and not a.overlaps(c)


def test_partition_grid_is_tiles_per_axis(rng):
    t = dop.from_numpy(rng.standard_normal((64, 2048)).astype(np.float32))
    p = t.partition([16, 256])
    assert p.grid == (4, 8) and p.num_tiles == 32 and p.unpartition() is t


def test_partition_that_does_not_divide_is_an_error(rng):
    t = dop.from_numpy(rng.standard_normal(100).astype(np.float32))
    with pytest.raises(dop.ShapeError, match="axis 0 has 100 elements, not a multiple of 16"):
        t.partition([16])
    with pytest.raises(dop.ShapeError, match="has rank 2 but the tensor"):
        t.partition([10, 10])
    with pytest.raises(dop.ShapeError, match="positive"):
        t.partition([0])


def test_tensors_are_made_by_factories_not_the_constructor():
    with pytest.raises(TypeError, match="dop.empty"):
        dop.Tensor()


def test_host_arrays_need_an_explicit_copy(rng):
    with pytest.raises(dop.StateError, match="from_numpy"):
        dop.as_tensor(rng.standard_normal(3))


def test_impossible_allocation_is_a_clear_error():
    with pytest.raises(dop.OutOfMemoryError, match="allocating"):
        dop.empty((2**50,), dop.float32)


@pytest.mark.gpu
def test_dlpack_round_trip_with_torch_is_zero_copy(rng):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(rng.standard_normal((4, 8)).astype(np.float32)).cuda()
    t = dop.from_dlpack(x)
    assert t.data_ptr == x.data_ptr() and t.shape == (4, 8)
    back = torch.from_dlpack(t)
    back[0, 0] = 42.0  # a write through one is seen by the others
    torch.cuda.synchronize()
    assert t.numpy()[0, 0] == 42.0 and x[0, 0].item() == 42.0


@pytest.mark.gpu
def test_bfloat16_interop_with_torch(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(16, device="cuda", dtype=torch.bfloat16)
    t = dop.from_dlpack(x)
    assert t.dtype is dop.bfloat16 and t.data_ptr == x.data_ptr()
    y = torch.from_dlpack(t)
    assert y.dtype == torch.bfloat16 and torch.equal(x, y)


@pytest.mark.gpu
def test_cupy_interop_both_ways(rng):
    import cupy
    host = rng.standard_normal(32).astype(np.float32)
    t = dop.from_numpy(host)
    c = cupy.from_dlpack(t)
    assert c.data.ptr == t.data_ptr
    via_cai = cupy.asarray(t)  # __cuda_array_interface__
    assert via_cai.data.ptr == t.data_ptr
    t2 = dop.as_tensor(c)
    assert t2.data_ptr == t.data_ptr
    t3 = dop.Tensor.from_cuda_array_interface(via_cai)
    np.testing.assert_array_equal(t3.numpy(), host)


@pytest.mark.gpu
def test_cuda_array_interface_with_torch(rng):
    torch = pytest.importorskip("torch")
    t = dop.from_numpy(rng.standard_normal(8).astype(np.float32))
    x = torch.as_tensor(t, device="cuda")
    assert x.data_ptr() == t.data_ptr


@pytest.mark.gpu
def test_host_tensor_is_refused_for_zero_copy_import():
    torch = pytest.importorskip("torch")
    with pytest.raises(dop.StateError, match="host memory"):
        dop.from_dlpack(torch.zeros(3))
