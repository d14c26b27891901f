"""NumPy and DLPack interop on whatever Device(0) is (issue 26, item 4):
``np.asarray(tensor)`` is a host copy once the device is done with the tensor,
``dop.as_tensor`` and ``dop.from_dlpack`` agree on a NumPy array, and
bfloat16 travels both ways as ml_dtypes arrays.  (Zero-copy with torch and
CuPy on the GPU: tests/test_tensor.py's gpu tests.)"""
import ml_dtypes
import numpy as np
import pytest

import deviceop as dop
from deviceop.kernels import add


def test_np_asarray_is_a_host_copy_after_the_stream_is_done(stream, rng):
    xs = rng.standard_normal(256).astype(np.float32)
    a = dop.from_numpy(xs, stream=stream)
    out = add(dop.empty(256, stream=stream).partition([128]), a, a).first().unpartition().async_on(stream)
    host = np.asarray(out)                       # no explicit sync: __array__ waits for the device
    assert type(host) is np.ndarray and host.dtype == np.float32 and host.shape == (256,)
    np.testing.assert_array_equal(host, 2 * xs)
    host[0] = 1e6                                # a copy: the tensor is not changed
    assert out.numpy(stream=stream)[0] == 2 * xs[0]
    np.testing.assert_array_equal(np.array(out), 2 * xs)


def test_np_asarray_keywords_follow_numpy_2s_protocol(stream, rng):
    xs = rng.standard_normal((4, 8)).astype(np.float32)
    t = dop.from_numpy(xs, stream=stream)
    as64 = np.asarray(t, dtype=np.float64)
    assert as64.dtype == np.float64 and np.array_equal(as64, xs.astype(np.float64))
    assert np.array_equal(np.asarray(t, copy=True), xs)
    with pytest.raises(dop.DeviceOpError, match="always a copy.*copy=None"):
        np.asarray(t, copy=False)


def test_as_tensor_and_from_dlpack_agree_on_a_numpy_array(device, rng):
    host = rng.standard_normal(8).astype(np.float32)
    messages = []
    for import_ in (dop.as_tensor, dop.from_dlpack):
        with pytest.raises(dop.StateError, match=r"host memory.*dop\.from_numpy\(array\)") as info:
            import_(host, device=device)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    np.testing.assert_array_equal(dop.from_numpy(host, device=device).numpy(), host)  # the named fix works


def test_bfloat16_both_ways_with_ml_dtypes(stream, rng):
    host = rng.standard_normal(64).astype(ml_dtypes.bfloat16)
    t = dop.from_numpy(host, stream=stream)
    assert t.dtype is dop.bfloat16
    back = np.asarray(t)
    assert back.dtype == ml_dtypes.bfloat16 and np.array_equal(back.view(np.uint16), host.view(np.uint16))
    assert np.asarray(t, dtype=np.float32).dtype == np.float32
