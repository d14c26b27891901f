"""The runtime layer: devices, streams, events, and CUDA errors as deviceop exceptions."""
import pytest
from cuda.bindings import driver as cu

import deviceop as dop
from deviceop.runtime.driver import check


def test_device_is_a_singleton_per_ordinal(device):
    assert dop.Device(0) is device
    assert isinstance(device, dop.Device)
    assert device.arch.startswith("sm_")


def test_failed_driver_calls_name_the_call_and_the_error():
    with pytest.raises(dop.CudaError) as info:
        check((cu.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuStreamCreate")
    assert info.value.call == "cuStreamCreate"
    assert info.value.code_name == "CUDA_ERROR_INVALID_VALUE"
    assert "cuStreamCreate failed with CUDA_ERROR_INVALID_VALUE" in str(info.value)


def test_out_of_memory_is_its_own_exception_with_advice():
    with pytest.raises(dop.OutOfMemoryError, match="Free tensors or graphs"):
        check((cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemAlloc")


def test_check_unwraps_values():
    assert check((cu.CUresult.CUDA_SUCCESS,), "f") is None
    assert check((cu.CUresult.CUDA_SUCCESS, 5), "f") == 5
    assert check((cu.CUresult.CUDA_SUCCESS, 5, 6), "f") == (5, 6)


def test_streams_and_events_time_work(device, stream):
    start = stream.record_event()
    end = stream.record_event()
    end.synchronize()
    assert start.elapsed_ms(end) >= 0.0
    stream.synchronize()
    assert stream.query()


def test_reference_device_when_forced(monkeypatch):
    """Without a GPU (or with DEVICEOP_DEVICE=reference) Device() is the reference device."""
    from deviceop.runtime import driver
    monkeypatch.setattr(driver, "_probe", (False, "forced by the test"))
    ref = dop.Device(0)
    assert ref.is_reference and isinstance(ref, dop.ReferenceDevice)
    assert ref.arch == "sm_90"  # what NVRTC targets by default without a GPU
    s = ref.new_stream()
    assert isinstance(s, dop.ReferenceStream) and not s.is_capturing()


@pytest.mark.gpu
def test_cuda_device_facts(device):
    assert device.compute_capability[0] >= 7
    assert device.sm_count > 0 and device.total_memory > 2**30
    free, total = device.memory_info()
    assert 0 < free <= total == device.total_memory
    assert "SMs" in repr(device)


@pytest.mark.gpu
def test_stream_waits_for_another_stream(device):
    a, b = device.new_stream(), device.new_stream()
    ev = a.record_event(timing=False)
    b.wait_event(ev)
    b.wait_stream(a)
    b.synchronize()
    assert a.query() and b.query()


@pytest.mark.gpu
def test_legacy_default_stream_is_refused_for_capture(device):
    legacy = dop.CudaStream.legacy(device)
    with pytest.raises(dop.CaptureError, match="legacy default stream cannot be captured"):
        legacy.begin_capture()
    assert not legacy.is_capturing()


@pytest.mark.gpu
def test_capture_begin_end_on_a_stream(device, stream):
    stream.begin_capture()
    assert stream.is_capturing()
    with pytest.raises(dop.CaptureError, match="already capturing"):
        stream.begin_capture()
    graph = stream.end_capture()
    assert not stream.is_capturing()
    check(cu.cuGraphDestroy(graph), "cuGraphDestroy")
    stream.synchronize()  # the stream is usable again


class _Contexts:
    """A stand-in for the driver's context calls: which context is current on the thread."""

    def __init__(self, current):
        self.current, self.set_calls = current, []

    def cuCtxGetCurrent(self):
        return (cu.CUresult.CUDA_SUCCESS, self.current)

    def cuCtxSetCurrent(self, ctx):
        self.set_calls.append(ctx)
        self.current = ctx
        return (cu.CUresult.CUDA_SUCCESS,)


def test_bind_makes_the_devices_context_current_whenever_another_is(monkeypatch):
    # opening GPU 0 after GPU 1 (or a library's set_device) made GPU 0's context current, and a
    # bind remembered per thread stayed a no-op: GPU 1's graphs then failed to instantiate
    from deviceop.runtime import device as rt
    gpu0_ctx, gpu1_ctx = cu.CUcontext(0x1000), cu.CUcontext(0x2000)
    fake = _Contexts(gpu0_ctx)
    monkeypatch.setattr(rt, "cu", fake)
    gpu1 = object.__new__(rt.CudaDevice)
    gpu1.context, gpu1._context_id = gpu1_ctx, int(gpu1_ctx)
    gpu1.bind()
    assert fake.set_calls == [gpu1_ctx]
    gpu1.bind()                                    # already current: no driver call
    assert fake.set_calls == [gpu1_ctx]
    fake.current = gpu0_ctx                        # another device or library took the thread
    gpu1.bind()
    assert fake.set_calls == [gpu1_ctx, gpu1_ctx] and fake.current is gpu1_ctx


def test_a_graph_launched_on_a_closed_cuda_stream_is_refused_before_the_driver(monkeypatch):
    # a closed CudaStream's handle is None, which cuGraphLaunch reads as the legacy stream:
    # the replay ran there instead of being refused
    from types import SimpleNamespace

    from deviceop.runtime import graphs
    monkeypatch.setattr(graphs.cu, "cuGraphLaunch", lambda *a: pytest.fail("reached the driver"))
    with pytest.raises(dop.StateError, match=r"graph.replay\(\) on a stream that was closed"):
        graphs.launch(object(), SimpleNamespace(handle=None))


def test_the_default_arch_is_device_0s(device):
    from deviceop.runtime.device import default_arch
    assert default_arch() == device.arch


def test_the_default_arch_is_that_of_the_gpu_the_process_opened(monkeypatch):
    # a tensor-parallel rank opens GPU 1 only: its kernels compile for GPU 1's arch, read without
    # opening GPU 0 (on a machine of mixed GPUs, GPU 0's arch would not load on GPU 1)
    from types import SimpleNamespace

    from deviceop.runtime import device as rt
    monkeypatch.setattr(rt.driver, "driver_available", lambda: True)
    monkeypatch.setattr(rt, "cu", SimpleNamespace())  # any driver call would fail: nothing is asked of GPU 0
    monkeypatch.setattr(rt, "_instances", {(rt.CudaDevice, 3): SimpleNamespace(arch="sm_100"),
                                           (rt.CudaDevice, 1): SimpleNamespace(arch="sm_89")})
    assert rt.default_arch() == "sm_89"
