"""Inputs of the wrong kind are deviceop errors naming the fix, never raw Python
errors, on the reference device as on the GPU path (issue 32: generics given as
a bare int or a numeric string; DLPack producers that misbehave; a device
ordinal without a device; ``from_numpy`` values its dtype cannot hold).

Unmarked tests run on Device(0): the reference device here, the H100 under
scripts/gpu-check.  Tests through ``fake_gpu`` take the GPU launch path with a
driver that records cuLaunchKernel (tests/test_eager_gpu_path.py).
"""
import numpy as np
import pytest

import deviceop as dop
from deviceop.kernel import Kernel, Out
from deviceop.kernels import add, rms_norm
from test_eager_gpu_path import fake_gpu

D = 512


def _rms_args(rng):
    x = dop.from_numpy(rng.standard_normal((1, D)).astype(np.float32))
    w = dop.from_numpy(rng.standard_normal(D).astype(np.float32))
    return dop.zeros([1, D]), x, w


# -- generics ----------------------------------------------------------------------

@pytest.mark.parametrize("bad, says", [
    (128, r"takes its generics <B> as a list, in that order, got 128: write \.generics\(\[128\]\)"),
    ("128", r"takes its generics <B> as a list, in that order, got '128': write \.generics\(\[128\]\)"),
    (b"128", r"takes its generics <B> as a list, in that order, got b'128'"),
    ({"B": 128}, r"takes its generics <B> as a list, in that order, got \{'B': 128\}: write \.generics\(\[B\]\)"),
    (None, r"as a list, in that order, got None: write \.generics\(\[B\]\)"),
    (["128"], r"generic B of add is the string '128': a number is given as an int, \.generics\(\[128\]\)"),
    ([" -4 "], r"generic B of add is the string ' -4 '"),
    (["1.5"], r"generic B of add is the string '1.5'"),
])
def test_generics_are_a_list_and_numbers_are_ints(stream, rng, bad, says):
    a = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    with pytest.raises(dop.LaunchError, match=says):
        add(dop.empty(256).partition([128]), a, a).generics(bad)


def test_numpy_ints_are_generics_like_ints(stream, rng):
    out, x, w = _rms_args(rng)
    rms_norm(out.partition([1, D]), x, w, 1e-5).generics([np.int64(D), np.int32(128)]).sync_on(stream)
    x64 = x.numpy().astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 * x64) + 1e-5) * w.numpy()
    np.testing.assert_allclose(out.numpy(stream=stream), ref, rtol=1e-4, atol=1e-5)


def test_a_generic_of_the_wrong_kind_for_a_kernels_rules_is_a_launch_error(stream, rng):
    """rms_norm's BS sizes no shape; its rules compute BS % 32: a type name there was a raw TypeError."""
    out, x, w = _rms_args(rng)
    before = out.numpy(stream=stream)
    with pytest.raises(dop.LaunchError, match=r"rms_norm's rules failed on generics <D=512, BS='float'>: TypeError"
                                              r".*ints for sizes and counts, strings for C\+\+ types") as info:
        rms_norm(out.partition([1, D]), x, w, 1e-5).generics([D, "float"]).sync_on(stream)
    assert isinstance(info.value.__cause__, TypeError)
    np.testing.assert_array_equal(out.numpy(stream=stream), before)  # nothing ran


def test_on_the_gpu_path_a_generic_of_the_wrong_kind_is_refused_before_the_driver(monkeypatch, rng):
    device, stream, driver, checks = fake_gpu(monkeypatch, [(rms_norm, [D, 128])])
    out, x, w = dop.empty([1, D]), dop.empty([1, D]), dop.empty([D])
    with pytest.raises(dop.LaunchError, match="rms_norm's rules failed on generics <D=512, BS='float'>"):
        rms_norm(out.partition([1, D]), x, w, 1e-5).generics([D, "float"]).async_on(stream)
    with pytest.raises(dop.LaunchError, match="generic BS of rms_norm is the string '128'"):
        rms_norm(out.partition([1, D]), x, w, 1e-5).generics([D, "128"])
    assert driver.launches == []


def test_precompile_takes_pairs_of_a_kernel_and_a_list_of_generics():
    with pytest.raises(dop.LaunchError, match=r"as a list, in that order, got 128: write \(add, \[128\]\)"):
        dop.precompile([(add, 128)], arch="sm_90")
    with pytest.raises(dop.LaunchError, match=r"takes \(kernel, generics\) pairs or kernels, got \(Kernel add"):
        dop.precompile([(add,)], arch="sm_90")
    with pytest.raises(dop.LaunchError, match=r"precompile takes a list of \(kernel, generics\) pairs"):
        dop.precompile(add, arch="sm_90")
    with pytest.raises(dop.LaunchError, match="generic B of add is the string '128'"):
        dop.precompile([(add, ["128"])], arch="sm_90")
    plain = Kernel("plain", 'extern "C" __global__ void plain(float* out) {}', [Out("out", "float32", rank=1)])
    with pytest.raises(dop.LaunchError, match=r"plain takes 0 generics <>, got 1: \[128\]"):
        dop.precompile([(plain, [128])], arch="sm_90")


# -- device= on the tensor entry points ------------------------------------------------

ENTRY_POINTS = {
    "dop.empty": lambda device, host, t: dop.empty(4, device=device),
    "dop.zeros": lambda device, host, t: dop.zeros(4, device=device),
    "dop.from_numpy": lambda device, host, t: dop.from_numpy(host, device=device),
    "dop.from_dlpack": lambda device, host, t: dop.from_dlpack(t, device=device),
    "dop.as_tensor": lambda device, host, t: dop.as_tensor(_Producer(t), device=device),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_device_is_a_device_or_its_ordinal_on_every_tensor_entry_point(device, rng, entry):
    make = ENTRY_POINTS[entry]
    host = rng.standard_normal(4).astype(np.float32)
    t = dop.from_numpy(host)
    with pytest.raises(dop.NoDeviceError, match=r"no CUDA device 99"):
        make(99, host, t)
    with pytest.raises(dop.NoDeviceError, match=r"a device ordinal is an int .0 for the first GPU., got 'cuda:0'"):
        make("cuda:0", host, t)
    with pytest.raises(dop.NoDeviceError, match=r"a device ordinal is an int .0 for the first GPU., got True"):
        make(True, host, t)
    assert make(0, host, t).device is device and make(np.int64(0), host, t).device is device


# -- DLPack producers that misbehave -------------------------------------------------

class _Producer:
    """Another framework's array: exports ``t``'s memory, or ``capsule`` (whatever it is)."""

    def __init__(self, t, capsule=None):
        self.t, self.capsule = t, capsule

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self.t.__dlpack__(**kwargs) if self.capsule is None else self.capsule


@pytest.mark.parametrize("obj", [None, 5, "array", object()], ids=["None", "int", "str", "object"])
def test_from_dlpack_of_something_without_dlpack_names_from_numpy(obj):
    with pytest.raises(dop.DTypeError, match=r"object has no __dlpack__.*dop.from_numpy"):
        dop.from_dlpack(obj)


def test_from_dlpack_of_a_bare_capsule_names_the_array(rng):
    t = dop.from_numpy(rng.standard_normal(4).astype(np.float32))
    with pytest.raises(dop.DTypeError, match="takes the array that exports DLPack, not a capsule"):
        dop.from_dlpack(t.__dlpack__())


def test_a_producer_without_dlpack_device_or_with_a_bad_one_is_refused(rng):
    t = dop.from_numpy(rng.standard_normal(4).astype(np.float32))

    class NoDevice:
        def __dlpack__(self, **kwargs):
            return t.__dlpack__(**kwargs)

    with pytest.raises(dop.DTypeError, match=r"NoDevice has __dlpack__ but no __dlpack_device__"):
        dop.from_dlpack(NoDevice())

    class BadDevice(_Producer):
        def __dlpack_device__(self):
            return "cuda"

    with pytest.raises(dop.DTypeError, match=r"BadDevice.__dlpack_device__\(\) returned 'cuda'"):
        dop.from_dlpack(BadDevice(t))


@pytest.mark.parametrize("capsule", [42, None, b"bytes"], ids=["int", "None", "bytes"])
def test_a_dlpack_export_that_is_not_a_capsule_is_refused(rng, capsule):
    t = dop.from_numpy(rng.standard_normal(4).astype(np.float32))
    producer = _Producer(t, capsule)
    if capsule is None:  # None means "export t" to _Producer: a producer returning None is its own class
        producer = type("NoneExport", (_Producer,), {"__dlpack__": lambda self, **kw: None})(t)
    with pytest.raises(dop.DTypeError, match=r"__dlpack__\(\) returned a .*, not a DLPack capsule"):
        dop.from_dlpack(producer)


def test_a_capsule_that_was_already_consumed_is_refused(rng):
    host = rng.standard_normal(4).astype(np.float32)
    t = dop.from_numpy(host)
    once = _Producer(t, t.__dlpack__())  # a producer that hands out the same capsule every time
    np.testing.assert_array_equal(dop.from_dlpack(once).numpy(), host)  # the first import consumes it
    with pytest.raises(dop.StateError, match=r"returned a DLPack capsule that was already consumed.*a fresh capsule"):
        dop.from_dlpack(once)


# -- from_numpy(..., dtype=) never changes a value silently ----------------------------

@pytest.mark.parametrize("value, dtype, says", [
    (300, "int8", r"300 does not fit in int8 \[-128, 127\]: the copy would make it 44"),
    (-1, "uint8", r"-1 does not fit in uint8 \[0, 255\]: the copy would make it 255"),
    (2.0 ** 63, "int64", r"9.223372036854776e\+18 does not fit in int64"),
    (0.5, "int32", r"0.5 is not a whole number: the copy to int32 would make it 0"),
    (float("nan"), "int32", r"nan has no int32 value"),
    (1e40, "float32", r"1e\+40 does not fit in float32 .it would become inf."),
    (70000, "float16", r"70000 does not fit in float16 .it would become inf."),
    (1e39, "bfloat16", r"1e\+39 does not fit in bfloat16 .it would become inf."),
])
def test_from_numpy_with_a_dtype_refuses_a_value_the_copy_would_change(stream, rng, value, dtype, says):
    host = rng.integers(0, 100, 6).astype(np.float64 if isinstance(value, float) else np.int64)
    host[rng.integers(0, 6)] = value
    with pytest.raises(dop.DTypeError, match=says + r".*array.astype"):
        dop.from_numpy(host, dtype=dtype)
    with pytest.raises(dop.DTypeError, match=says):
        dop.api.from_numpy(host, dtype=dtype)  # refused when built, as api.full refuses its value
    with pytest.raises(dop.DTypeError):
        dop.api.full([2], value, dtype)


def test_from_numpy_with_a_dtype_converts_what_it_can_keep(stream, rng):
    ints = rng.integers(-128, 128, 16)
    floats = rng.standard_normal(16)
    np.testing.assert_array_equal(dop.from_numpy(ints, dtype="int8").numpy(), ints)
    np.testing.assert_array_equal(dop.from_numpy(ints.astype(np.float64), dtype="int16").numpy(), ints)  # whole
    np.testing.assert_array_equal(dop.from_numpy(floats, dtype="float32").numpy(), floats.astype(np.float32))  # rounds
    np.testing.assert_array_equal(dop.from_numpy(floats, dtype="bfloat16").numpy().astype(np.float32),
                                  floats.astype(dop.bfloat16.np).astype(np.float32))
    np.testing.assert_array_equal(dop.api.from_numpy(ints, dtype="int8").sync_on(stream).numpy(stream=stream), ints)
    np.testing.assert_array_equal(dop.from_numpy(ints != 0, dtype="uint8").numpy(), ints != 0)
    assert dop.from_numpy(np.empty((0, 3)), dtype="int8").shape == (0, 3)


@pytest.mark.parametrize("host", [np.array(["1", "2"]), np.array([1 + 2j]), np.array([1, None], dtype=object)],
                         ids=["str", "complex", "object"])
def test_from_numpy_with_a_dtype_copies_numbers_only(host):
    with pytest.raises(dop.DTypeError, match=r"copies arrays of numbers .bool, int, float."):
        dop.from_numpy(host, dtype="float32")


def test_api_arange_refuses_a_length_its_dtype_cannot_count_to():
    with pytest.raises(dop.DTypeError, match=r"299 does not fit in int8"):
        dop.api.arange(300, "int8")


# -- a fill of -0.0 keeps its sign on both devices ---------------------------------------

class _CupyLikeArray(np.ndarray):
    """A NumPy array whose fill behaves as CuPy's: a value that == 0 is a memset of zero bytes."""

    def fill(self, value):
        if value == 0:
            self.view(np.uint8)[...] = 0
        else:
            np.ndarray.fill(self, value)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_a_negative_zero_fill_keeps_its_sign_on_the_gpu_path(dtype):
    from contextlib import nullcontext
    from types import SimpleNamespace
    from deviceop.runtime.stream import CudaStream
    gpu_stream = SimpleNamespace(_live=lambda what: 0, cupy=nullcontext(),  # all CudaStream.fill uses of a stream
                                 device=SimpleNamespace(bind=lambda: None))
    array = np.ones(16, dtype=dop.dtype(dtype).np).view(_CupyLikeArray)
    CudaStream.fill(gpu_stream, array, -0.0)
    assert np.all(array.astype(np.float64) == 0) and np.all(np.signbit(array.astype(np.float64)))
    CudaStream.fill(gpu_stream, array, 0.0)
    assert not np.any(np.signbit(array.astype(np.float64)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_api_full_of_negative_zero_keeps_its_sign(stream, dtype):
    t = dop.api.full([64], -0.0, dtype).sync_on(stream)
    host = t.numpy(stream=stream).astype(np.float64)
    assert np.all(host == 0) and np.all(np.signbit(host))
