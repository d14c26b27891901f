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
from deviceop.kernels import add, rms_norm
from test_eager_gpu_path import fake_gpu

D = 512


def _rms_args(rng):
    x = dop.from_numpy(rng.standard_normal((1, D)).astype(np.float32))
    w = dop.from_numpy(rng.standard_normal(D).astype(np.float32))
    return dop.empty([1, D]), x, w


# -- generics ----------------------------------------------------------------------

@pytest.mark.parametrize("bad, says", [
    (128, r"takes its generics <B> as a list, got 128: write \.generics\(\[128\]\)"),
    ("128", r"takes its generics <B> as a list, got '128': write \.generics\(\[128\]\)"),
    (b"128", r"takes its generics <B> as a list, got b'128'"),
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
    np.testing.assert_allclose(out.numpy(stream=stream), ref, rtol=1e-5, atol=1e-6)


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
    with pytest.raises(dop.LaunchError, match=r"takes its generics <B> as a list, got 128: write \(add, \[128\]\)"):
        dop.precompile([(add, 128)], arch="sm_90")
    with pytest.raises(dop.LaunchError, match=r"precompile takes \(kernel, generics\) pairs or kernels, got \(Kernel add"):
        dop.precompile([(add,)], arch="sm_90")
    with pytest.raises(dop.LaunchError, match=r"precompile takes a list of \(kernel, generics\) pairs"):
        dop.precompile(add, arch="sm_90")
    with pytest.raises(dop.LaunchError, match="generic B of add is the string '128'"):
        dop.precompile([(add, ["128"])], arch="sm_90")
