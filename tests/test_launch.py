"""The launch primitive: compile → load → launch with typed arguments, checked before launch."""
import numpy as np
import pytest

import deviceop as dop

SOURCE = r'''
extern "C" __global__ void saxpy(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void __launch_bounds__(128) bounded(float* y) { y[threadIdx.x] = 1.0f; }
template <int BLOCK>
__global__ void scale_rows(float* out, const float* in, float s, long long cols) {
    long long row = blockIdx.x, c = threadIdx.x;
    for (; c < cols; c += BLOCK) out[row * cols + c] = s * in[row * cols + c];
}
'''


def test_launch_config_is_checked():
    cfg = dop.LaunchConfig(grid=(4, 2), block=128)
    assert cfg.grid == (4, 2, 1) and cfg.block == (128, 1, 1)
    with pytest.raises(dop.LaunchError, match="at most 1024"):
        dop.LaunchConfig(grid=1, block=(64, 32))
    with pytest.raises(dop.LaunchError, match="positive ints"):
        dop.LaunchConfig(grid=0, block=32)
    with pytest.raises(dop.LaunchError, match="shared_mem"):
        dop.LaunchConfig(grid=1, block=32, shared_mem=-1)


def test_loading_needs_a_gpu_on_the_reference_device(monkeypatch):
    from deviceop.runtime import driver
    monkeypatch.setattr(driver, "_probe", (False, "forced by the test"))
    prog = dop.compile_cubin(SOURCE, arch="sm_90")
    with pytest.raises(dop.NoDeviceError, match="needs a CUDA device"):
        dop.load_module(prog, dop.Device(0))


@pytest.fixture
def module(device):
    return dop.load_module(dop.compile_cubin(SOURCE, name_expressions=["scale_rows<128>"]), device)


@pytest.mark.gpu
def test_saxpy_matches_numpy(module, stream, rng):
    saxpy = module.get_function("saxpy", [dop.ptr("float32"), dop.ptr("float32"), dop.float32, dop.int32])
    n = 10_000
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    tx, ty = dop.from_numpy(x, stream=stream), dop.from_numpy(y, stream=stream)
    saxpy.launch(stream, dop.LaunchConfig(grid=(n + 255) // 256, block=256), ty, tx, 1.5, n)
    out = ty.numpy(stream=stream)
    ref = 1.5 * x.astype(np.float64) + y.astype(np.float64)
    assert np.max(np.abs(out - ref) / (np.abs(ref) + 1e-6)) < 1e-5


@pytest.mark.gpu
def test_template_kernel_through_its_name_expression(module, stream, rng):
    scale = module.get_function("scale_rows<128>", [dop.ptr, dop.ptr, "float32", "int64"])
    a = rng.standard_normal((64, 300)).astype(np.float32)
    src, dst = dop.from_numpy(a, stream=stream), dop.empty((64, 300), stream=stream)
    scale.launch(stream, dop.LaunchConfig(64, 128), dst, src, -2.0, 300)
    np.testing.assert_allclose(dst.numpy(stream=stream), -2.0 * a.astype(np.float64), rtol=1e-6)
    assert scale.attributes["local_bytes"] == 0


@pytest.mark.gpu
def test_bad_arguments_raise_before_anything_runs(module, stream):
    saxpy = module.get_function("saxpy", [dop.ptr("float32"), dop.ptr("float32"), dop.float32, dop.int32])
    y, x = dop.empty(8, stream=stream), dop.empty(8, stream=stream)
    cfg = dop.LaunchConfig(1, 32)
    with pytest.raises(dop.LaunchError, match="takes 4 arguments"):
        saxpy.launch(stream, cfg, y, x, 1.0)
    with pytest.raises(dop.DTypeError, match="argument 3 of saxpy.*never truncates"):
        saxpy.launch(stream, cfg, y, x, 1.0, 8.0)
    with pytest.raises(dop.DTypeError, match="argument 1 of saxpy must be a float32 tensor, got int32"):
        saxpy.launch(stream, cfg, y, dop.empty(8, dop.int32, stream=stream), 1.0, 8)
    with pytest.raises(dop.LaunchError, match="device pointer"):
        saxpy.launch(stream, cfg, y, "x", 1.0, 8)


@pytest.mark.gpu
def test_signature_is_checked_against_the_cubin(module):
    with pytest.raises(dop.LaunchError, match="takes 4 parameters but its declared signature has 3"):
        module.get_function("saxpy", [dop.ptr, dop.ptr, dop.float32])
    with pytest.raises(dop.LaunchError, match="parameter 3 of kernel saxpy is 4 bytes"):
        module.get_function("saxpy", [dop.ptr, dop.ptr, dop.float32, dop.int64])


@pytest.mark.gpu
def test_unknown_kernel_name(module):
    with pytest.raises(dop.CudaError, match="no kernel 'sxapy' in this module"):
        module.get_function("sxapy", [dop.ptr])


@pytest.mark.gpu
def test_cubin_for_another_arch_is_refused(device):
    other = "sm_80" if device.arch != "sm_80" else "sm_90"
    prog = dop.compile_cubin(SOURCE, arch=other)
    with pytest.raises(dop.ArchError, match=f"compiled for {other}"):
        dop.load_module(prog, device)


@pytest.mark.gpu
def test_too_much_shared_memory_is_a_launch_error(module, stream):
    saxpy = module.get_function("saxpy", [dop.ptr, dop.ptr, dop.float32, dop.int32])
    y = dop.empty(8, stream=stream)
    with pytest.raises(dop.LaunchError, match="dynamic shared memory"):
        saxpy.launch(stream, dop.LaunchConfig(1, 32, shared_mem=10**7), y, y, 1.0, 8)


@pytest.mark.gpu
def test_what_the_driver_refuses_is_a_cuda_error_and_the_stream_goes_on(module, stream, rng):
    """A block larger than the kernel's __launch_bounds__ passes every check deviceop
    can make, and the driver refuses it: a CudaError naming the launch; nothing
    is left broken, and the next launch on the stream runs."""
    bounded = module.get_function("bounded", [dop.ptr("float32")])
    y = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    with pytest.raises(dop.CudaError, match=r"cuLaunchKernel\(bounded\) failed with CUDA_ERROR_INVALID_VALUE"):
        bounded.launch(stream, dop.LaunchConfig(1, 256), y)
    bounded.launch(stream, dop.LaunchConfig(1, 128), y)
    out = y.numpy(stream=stream)
    assert np.all(out[:128] == 1.0) and not np.any(out[128:] == 1.0)


@pytest.mark.gpu
def test_a_closed_stream_is_refused(module, device):
    saxpy = module.get_function("saxpy", [dop.ptr("float32"), dop.ptr("float32"), dop.float32, dop.int32])
    s = device.new_stream()
    y = dop.empty(8, stream=s)
    s.synchronize()
    s.close()
    with pytest.raises(dop.StateError, match="on a stream that was closed"):
        saxpy.launch(s, dop.LaunchConfig(1, 32), y, y, 1.0, 8)
