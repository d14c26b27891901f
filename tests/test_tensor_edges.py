"""A demanding NumPy/torch user's edge cases on tensors and the value ops:
strided copies, odd dtype and scalar arguments, odd slices, NumPy on a handle.
Each works as those libraries do or is refused with a deviceop error."""
import numpy as np
import pytest

import deviceop as dop
from deviceop import api
from deviceop.testing import ForeignArray


@pytest.mark.parametrize("view", [lambda t: t[:, ::2], lambda t: t[::-1], lambda t: t[1:, ::-3], lambda t: t[:, 1]])
def test_dup_of_a_strided_view_copies_its_elements(rng, view):
    host = rng.standard_normal((4, 6)).astype(np.float32)
    copy = api.dup(view(dop.from_numpy(host))).sync()  # (was a byte copy from the first element: other memory)
    assert copy.is_contiguous
    np.testing.assert_array_equal(copy.numpy(), view(host))


def test_dtype_none_is_refused_not_read_as_float64():
    for make in (lambda: dop.empty(3, None), lambda: dop.zeros(3, dtype=None), lambda: api.zeros(3, None),
                 lambda: dop.dtype(None), lambda: dop.In("x", None)):
        with pytest.raises(dop.DTypeError, match="dtype None names no type"):
            make()  # (NumPy's reading: a float64 tensor where torch's user meant its default float32)
    assert dop.empty(3).dtype is dop.float32


def test_a_bool_scalar_is_true_or_false(rng):
    mask = dop.from_numpy(rng.standard_normal(5) > 0)
    for value in (None, "no", "", [1], 2, 0.5):
        with pytest.raises(dop.DTypeError, match="expected True or False for a bool scalar"):
            api.fill(mask, value)  # (None filled False, "no" filled True)
    np.testing.assert_array_equal(api.fill(mask, 1).sync().numpy(), np.ones(5, bool))
    np.testing.assert_array_equal(api.fill(mask, np.False_).sync().numpy(), np.zeros(5, bool))


def test_a_slice_numpy_refuses_is_a_shape_error(rng):
    t = dop.from_numpy(rng.standard_normal((3, 4)).astype(np.float32))
    with pytest.raises(dop.ShapeError, match=r"index slice\(None, None, 0\) into tensor \(3, 4\)"):
        t[::0]  # (was NumPy's raw ValueError)
    with pytest.raises(dop.ShapeError, match=r"index slice\(0\.5, 2, None\) into tensor \(3, 4\)"):
        t[0.5:2]  # (was a raw TypeError)


def test_a_refused_fill_into_a_shared_handle_names_fill(rng):
    handle = dop.from_numpy(rng.standard_normal(4).astype(np.float32)).into_shared()
    other = handle.clone()
    with pytest.raises(dop.OwnershipError, match=r"^api\.fill into a SharedTensor"):
        api.fill(handle, 1.0)  # (said api.memcpy)
    other.release()


def test_numpy_reads_a_shared_handle_as_its_data(rng):
    host = rng.standard_normal((2, 3)).astype(np.float32)
    handle = dop.from_numpy(host).into_shared()
    np.testing.assert_array_equal(np.asarray(handle), host)  # (was a 0-d object array holding the handle)
    assert np.asarray(handle, dtype=np.float64).dtype == np.float64


def test_shapes_no_array_can_hold_are_shape_errors():
    for dims in [(1 << 70, 0), (1,) * 65]:
        with pytest.raises(dop.ShapeError, match="at most 64 dims, each below 2\\*\\*63"):
            dop.empty(dims)  # (was an OutOfMemoryError for a 0-byte tensor, "allocate less")
    view = dop.zeros(0).view(1 << 70, 0)  # a view costs no array...
    with pytest.raises(dop.ShapeError, match="at most 64 dims"):
        view.numpy()  # ... until one is asked for (was a raw OverflowError)
    with pytest.raises(dop.ShapeError, match="at most 64 dims"):
        dop.zeros(1).view((1,) * 70).numpy()  # (was a raw ValueError)
    assert dop.empty((1,) * 64).shape == (1,) * 64  # (the limit itself is fine)


def test_host_data_numpy_reads_differently_is_refused_or_read_by_value(rng):
    for make in (dop.from_numpy, lambda a: api.from_numpy(a).sync()):
        with pytest.raises(dop.ShapeError, match="rectangular"):
            make([[1.0], [1.0, 2.0]])  # (was NumPy's raw ValueError)
        host = rng.standard_normal(5).astype(">f4")  # big-endian, as a file may store it
        t = make(host)  # (was "dtype >f4 is not supported")
        assert t.dtype is dop.float32
        np.testing.assert_array_equal(t.numpy(), host)
    for n in ("3", None, 2.5):
        with pytest.raises(dop.ShapeError, match="n is the length, an int"):
            api.arange(n)  # (was a raw TypeError; 2.5: "the float 1.5 for a int32 scalar")


def test_a_tensor_outlives_the_stream_it_was_made_on(rng):
    device = dop.Device()
    host = rng.standard_normal((3, 4)).astype(np.float32)
    stream = device.new_stream()
    t = dop.from_numpy(host, stream=stream)
    stream.close()  # its home stream: numpy(), contiguous() and DLPack ordered work on it, and failed
    np.testing.assert_array_equal(t.numpy(), host)
    np.testing.assert_array_equal(t[:, ::2].contiguous().numpy(), host[:, ::2])
    np.testing.assert_array_equal(dop.from_dlpack(ForeignArray(t)).numpy(), host)  # (a DLPack export of t)
    with pytest.raises(dop.StateError, match="closed"):
        t.numpy(stream=stream)  # a closed stream named is still refused


def test_numpys_in_place_reshape_is_refused_and_names_view(rng):
    t = dop.from_numpy(rng.standard_normal(6).astype(np.float32))
    with pytest.raises(dop.ShapeError, match=r"tensor = tensor\.view\(\(2, 3\)\)"):
        t.shape = (2, 3)  # (was a raw AttributeError)
    assert t.shape == (6,) and t.view((2, 3)).shape == (2, 3)


def test_a_read_only_import_is_exported_read_only_through_every_view(rng):
    host = rng.standard_normal(8).astype(np.float32)
    host.setflags(write=False)  # DLPack's read-only flag: host memory, so the reference device's
    t = dop.from_dlpack(ForeignArray(host), device=dop.ReferenceDevice(0))
    for view in (t, t.view(2, 4), t.reshape(-1), t[1:5], next(iter(t.view(2, 4))), t.into_shared().view(8)):
        out = np.from_dlpack(view)
        assert not out.flags.writeable  # (views made without NumPy's indexing were exported writable)
        with pytest.raises(ValueError, match="read-only"):
            out[0] = 1.0
    with pytest.raises(dop.OwnershipError, match="read-only memory.*DLPack 1.0"):
        t.view(2, 4).__dlpack__()  # an unversioned capsule cannot say read-only
    np.testing.assert_array_equal(np.from_dlpack(t.view(2, 4)), host.reshape(2, 4))


def test_int_float_and_format_of_a_tensor_name_the_host_read(rng):
    value = float(rng.standard_normal())
    t = dop.from_numpy(np.array([value], np.float32))
    for read, fix in ((int, r"int\(tensor\.numpy\(\)\.item\(\)\)"), (float, r"float\(tensor\.numpy\(\)\.item\(\)\)"),
                      (lambda x: f"{x:.3f}", r"tensor\.numpy\(\)\.item\(\):\.3f")):
        with pytest.raises(dop.StateError, match=fix):
            read(t)  # (raw TypeErrors)
    assert f"{t}" == repr(t) and f"{t.numpy().item():.3f}" == f"{np.float32(value):.3f}"


@pytest.mark.parametrize("seed", [-1, 1.5, "a"])
def test_a_seed_numpy_refuses_is_refused_as_the_op_is_built(seed):
    for make in (api.rand, api.randn):
        with pytest.raises(dop.DTypeError, match=r"a seed is None, an int >= 0"):
            make(4, seed=seed)  # (a raw ValueError/TypeError when the op ran)
    a, b = api.rand(4, seed=7).sync(), api.rand(4, seed=np.random.default_rng(7)).sync()
    np.testing.assert_array_equal(a.numpy(), b.numpy())
