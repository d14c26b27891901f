"""NumPy and DLPack interop on whatever Device(0) is (issue 26, item 4):
``np.asarray(tensor)`` is a host copy once the device is done with the tensor,
``dop.as_tensor`` and ``dop.from_dlpack`` agree on a NumPy array, and
bfloat16 travels both ways as ml_dtypes arrays, and DLPack exchanges keep
stream order both ways (GPU tests below).  (Zero-copy with torch and CuPy on
the GPU: tests/test_tensor.py's gpu tests.)"""
import ml_dtypes
import numpy as np
import pytest

import deviceop as dop
from deviceop import api
from deviceop.testing import ForeignArray
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


class _Versioned(ForeignArray):  # another framework's array (testing.py) that asks for DLPack 1.0
    def __dlpack__(self, **kwargs):  # DLPack 1.0: a versioned capsule
        return self.array.__dlpack__(max_version=(1, 0))


def test_a_bfloat16_tensor_exports_through_dlpack_on_the_reference_device(rng):
    # NumPy exports no bfloat16: tensor.__dlpack__() raised NumPy's raw BufferError here, where a
    # GPU array of bfloat16 exports as DLPack's kDLBfloat
    ref = dop.ReferenceDevice(0).new_stream()
    host = rng.standard_normal(64).astype(ml_dtypes.bfloat16)
    t = dop.from_numpy(host, stream=ref)
    for versioned in (False, True):
        back = dop.from_dlpack(_Versioned(t) if versioned else ForeignArray(t), stream=ref)
        assert back.dtype is dop.bfloat16 and back.shape == (64,)
        assert np.array_equal(back.numpy(stream=ref).view(np.uint16), host.view(np.uint16))


# -- stream order across frameworks (GPU): a long kernel still writing on one side
# must be waited for by the other side's stream, with no host sync in between.

SPIN_SRC = r"""
extern "C" __global__ void interop_spin_fill(float* out, float value, long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    out[blockIdx.x * blockDim.x + threadIdx.x] = value;
}
"""


def _spin_fill_ref(g, out, value, cycles):
    out[...] = value


spin_fill = dop.Kernel("interop_spin_fill", SPIN_SRC, [dop.Out("out", "float32", rank=1),
                       dop.Scalar("value", "float32"), dop.Scalar("cycles", "int64")], block=128,
                       reference=_spin_fill_ref)
SPIN = 200_000_000  # ~0.1 s at the H100's clock: far longer than torch takes to queue its copy


@pytest.mark.gpu
def test_torch_reads_a_deviceop_tensor_after_the_work_queued_on_its_stream():
    torch = pytest.importorskip("torch")
    stream = dop.Device(0).new_stream()
    t = dop.from_numpy(np.zeros(1024, np.float32), stream=stream)   # home stream: `stream`
    spin_fill(t.partition([128]), 7.0, SPIN).async_on(stream)        # still running below
    seen = torch.from_dlpack(t).clone()                              # torch's current stream
    torch.cuda.synchronize()
    assert seen.eq(7.0).all().item(), "torch read the tensor before deviceop's kernel wrote it"


@pytest.mark.gpu
def test_deviceop_reads_a_torch_tensor_after_the_work_torch_queued():
    torch = pytest.importorskip("torch")
    x = torch.zeros(1024, device="cuda")
    torch.cuda._sleep(SPIN)                                          # torch's current stream is busy ...
    x.fill_(5.0)                                                     # ... then writes
    stream = dop.Device(0).new_stream()
    t = dop.from_dlpack(x, stream=stream)
    assert t.data_ptr == x.data_ptr()
    copy = dop.empty(1024, stream=stream)
    api.memcpy(copy, t).async_on(stream)                             # ordered after torch's fill
    np.testing.assert_array_equal(copy.numpy(stream=stream), np.full(1024, 5.0, np.float32))


def test_a_cuda_stream_for_the_reference_devices_host_memory_is_refused(device, rng):
    if not device.is_reference:
        pytest.skip("the reference device's rule (on a GPU, test_torch_reads_... above)")
    t = dop.from_numpy(rng.standard_normal(4).astype(np.float32), device=device)
    with pytest.raises(dop.StateError, match="host memory.*leave stream=None"):
        t.__dlpack__(stream=5)
    np.testing.assert_array_equal(np.from_dlpack(t), t.numpy())   # stream=None: a host import


def test_a_stream_that_is_not_a_live_stream_of_the_device_is_refused_by_every_tensor_entry_point(device, rng):
    host = rng.standard_normal(4).astype(np.float32)
    t = dop.from_numpy(host, device=device)
    closed = device.new_stream()
    closed.close()
    entry_points = {
        "dop.empty": lambda s: dop.empty(4, device=device, stream=s),
        "dop.from_numpy": lambda s: dop.from_numpy(host, device=device, stream=s),
        "dop.from_dlpack": lambda s: dop.from_dlpack(t, device=device, stream=s),
        "tensor.numpy": lambda s: t.numpy(stream=s),
        "tensor.contiguous": lambda s: t.contiguous(stream=s),
    }
    for name, call in entry_points.items():
        with pytest.raises(dop.LaunchError, match=rf"{name} needs a deviceop stream .* got str"):
            call("s")
        with pytest.raises(dop.StateError, match=rf"{name} on a stream that was closed"):
            call(closed)
    other = dop.ReferenceDevice(0) if not device.is_reference else None
    if other is not None:  # a GPU run: the reference device's stream is another device's
        with pytest.raises(dop.LaunchError, match="the stream is on reference, the tensor on"):
            dop.empty(4, device=device, stream=other.new_stream())
    s = device.new_stream()
    assert dop.empty(4, stream=s).device is device  # an omitted device is the stream's


@pytest.mark.parametrize("stream", ["x", 0, -2, 1.5, True])
def test_a_dlpack_consumer_stream_that_is_not_dlpacks_int_is_refused(device, rng, stream):
    t = dop.from_numpy(rng.standard_normal(4).astype(np.float32), device=device)
    with pytest.raises(dop.LaunchError, match=r"DLPack's stream is an int"):
        t.__dlpack__(stream=stream)
