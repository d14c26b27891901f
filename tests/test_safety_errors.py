"""What the GPU refuses, the reference device refuses too, and wrong input is a
deviceop error that names the fix, never a raw Python exception (issue 24,
items 4, 5 and 8).  Every test runs on the reference device unless marked gpu."""
from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import deviceop as dop
from deviceop.testing import ForeignArray
from deviceop import CudaGraph, DeviceOpVec, api, zip_
from deviceop import compile as comp
from deviceop.graph import GraphCache
from deviceop.kernel import In, Kernel, Out
from deviceop.kernels import add, affine, matvec


# -- item 4: the reference device refuses what the GPU refuses --------------------------

def test_a_block_of_more_than_1024_threads_is_refused_eagerly_and_in_a_capture(stream, rng):
    n = 8192
    a, b = (dop.from_numpy(rng.standard_normal(n).astype(np.float32), stream=stream) for _ in range(2))
    out = dop.empty(n, stream=stream)
    with pytest.raises(dop.LaunchError, match="2048 threads; CUDA allows at most 1024 per block"):
        add(out.partition([8192]), a, b).generics([8192]).sync_on(stream)
    with pytest.raises(dop.LaunchError, match="at most 1024 per block"):
        add(out.partition([8192]), a, b).generics([8192]).graph_on(stream)
    assert not stream.is_capturing()
    add(out.partition([1024]), a, b).generics([1024]).sync_on(stream)  # 256 threads: fine
    np.testing.assert_allclose(out.numpy(), a.numpy() + b.numpy(), rtol=1e-6)


def _copy_ref(g, out, x):
    out[...] = x


COPY3D = r'''
extern "C" __global__ void copy3d(float* out, const float* x) {
    size_t i = ((size_t)blockIdx.x * gridDim.y + blockIdx.y) * gridDim.z + blockIdx.z;
    if (threadIdx.x == 0) out[i] = x[i];
}
'''
# One element per block, so the grid is the (contiguous) output's shape: grids of any size, cheaply.
copy3d = Kernel("copy3d", COPY3D, [Out("out", "float32", rank=3), In("x", "float32", rank=3)], block=32,
                reference=_copy_ref)


@pytest.mark.parametrize("shape, axis", [((1, 65536, 1), "y"), ((1, 1, 65536), "z")])
def test_a_grid_past_cudas_limits_is_refused(stream, rng, shape, axis):
    x = dop.from_numpy(rng.standard_normal(shape).astype(np.float32), stream=stream)
    out = dop.empty(shape, stream=stream)
    with pytest.raises(dop.LaunchError, match=r"exceeds CUDA's limits \(x < 2\^31, y and z <= 65535\)"):
        copy3d(out.partition([1, 1, 1]), x).sync_on(stream)
    small = tuple(min(d, 65535) for d in shape)
    x2, out2 = dop.from_numpy(rng.standard_normal(small).astype(np.float32)), dop.empty(small)
    copy3d(out2.partition([1, 1, 1]), x2).sync_on(stream)  # 65535 blocks on the axis: fine
    np.testing.assert_array_equal(out2.numpy(), x2.numpy())


def _host_syncs(stream, t):
    event = stream.record_event()
    return {
        "stream.synchronize()": stream.synchronize,
        "stream.query()": stream.query,
        "tensor.numpy()": t.numpy,
        "tensor.numpy(stream=)": lambda: t.numpy(stream=stream),
        "device.synchronize()": stream.device.synchronize,
        "event.synchronize()": lambda: stream.record_event().synchronize(),
        "an event recorded before the capture": event.synchronize,
    }


@pytest.mark.parametrize("how", ["scope", "graph_on"])
def test_a_host_sync_inside_a_capture_is_a_capture_error(stream, rng, how):
    t = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    y = dop.empty(256, stream=stream)
    refused = []
    for name, sync in _host_syncs(stream, t).items():
        def body(s, sync=sync):
            s.record(affine(y.partition([128]), t, 2.0, 0.0).generics([128]))
            sync()
        try:
            if how == "scope":
                CudaGraph.scope(stream, body)
            else:
                zip_(affine(y.partition([128]), t, 2.0, 0.0).generics([128]),
                     dop.value(None).inspect(lambda _, sync=sync: sync())).graph_on(stream)
        except dop.CaptureError as exc:
            assert ("Wait before the capture begins or after it ends" in str(exc)
                    or "Record it again outside the capture" in str(exc)), str(exc)
            assert "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED" in str(exc) or "CUDA_ERROR_CAPTURED_EVENT" in str(exc)
            refused.append(name)
        assert not stream.is_capturing()  # the capture was ended; the stream is usable
    assert refused == [n for n in _host_syncs(stream, t) if n != "an event recorded before the capture"]
    stream.synchronize()  # after the capture: fine
    affine(y.partition([128]), t, 2.0, 0.0).generics([128]).sync_on(stream)
    np.testing.assert_allclose(y.numpy(), 2.0 * t.numpy(), rtol=1e-6)


def test_a_refused_sync_breaks_the_capture_even_when_caught(device, rng):
    """As on a GPU: the driver invalidates the capture, so it fails when it ends."""
    capturing, other = device.new_stream(), device.new_stream()
    t = dop.from_numpy(rng.standard_normal(8).astype(np.float32), stream=other)
    y = dop.empty(8, stream=capturing)
    seen = {}

    def body(s):
        s.record(api.memcpy(y, t))
        seen["other stream"] = t.numpy(stream=other)  # stream-ordered on a stream not capturing: fine
        with pytest.raises(dop.CaptureError, match="while a stream of this device is capturing") as info:
            device.synchronize()
        assert isinstance(info.value, dop.CudaError) and info.value.code_name == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"

    with pytest.raises(dop.CaptureError, match="failed when the capture ended .CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"):
        CudaGraph.scope(capturing, body)
    np.testing.assert_array_equal(seen["other stream"], t.numpy())
    device.synchronize()
    graph = CudaGraph.scope(capturing, lambda s: s.record(api.memcpy(y, t)))  # the next capture is unharmed
    graph.launch().sync_on(capturing)
    np.testing.assert_array_equal(y.numpy(), t.numpy())


def test_a_device_ordinal_without_a_device_is_refused(device):
    if not device.is_reference:
        pytest.skip("on a GPU machine the count of GPUs decides (tests/test_runtime.py)")
    with pytest.raises(dop.NoDeviceError, match=r"no CUDA device 5: this process has no GPU .*use Device\(0\)"):
        dop.Device(5)
    with pytest.raises(dop.NoDeviceError, match="no CUDA device -1"):
        dop.Device(-1)
    with pytest.raises(dop.NoDeviceError, match="a device ordinal is an int"):
        dop.Device("cuda:0")
    assert dop.Device(0) is device and dop.Device(np.int64(0)) is device


def test_a_closed_stream_refuses_work_with_a_state_error(device, rng):
    stream = device.new_stream()
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    y = dop.empty(256)
    affine(y.partition([128]), x, 2.0, 0.0).generics([128]).sync_on(stream)
    stream.close()
    stream.close()  # idempotent
    work = {
        "sync_on": lambda: affine(y.partition([128]), x, 3.0, 0.0).generics([128]).sync_on(stream),
        "async_on": lambda: api.memcpy(y, x).async_on(stream),
        "graph_on": lambda: affine(y.partition([128]), x, 3.0, 0.0).generics([128]).graph_on(stream),
        "scope": lambda: CudaGraph.scope(stream, lambda s: None),
        "synchronize": stream.synchronize,
        "wait_stream": lambda: stream.wait_stream(device.new_stream()),
    }
    for name, call in work.items():
        with pytest.raises(dop.StateError, match=r"on a stream that was closed \(stream.close\(\)\); use a live "
                                                 r"stream \(device.new_stream\(\)\)"):
            call()
    np.testing.assert_allclose(y.numpy(), 2.0 * x.numpy(), rtol=1e-6)  # nothing ran on the closed stream
    assert "closed" in repr(stream)


# -- item 5: compile-cache I/O problems warn, and compiling goes on ----------------------

def _source() -> str:
    """A kernel no other test compiled (the in-memory cache must miss)."""
    return f'extern "C" __global__ void k(float* p) {{ p[0] = {int.from_bytes(os.urandom(3), "little")}; }}\n'


def _compile_warning(src, match) -> dop.CompiledProgram:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog = dop.compile_cubin(src, arch="sm_90")
    messages = [str(w.message) for w in caught]
    assert messages and all("DEVICEOP_CACHE_DIR" in m and "DEVICEOP_DISK_CACHE=0" in m for m in messages), messages
    assert any(match in m for m in messages), messages
    assert prog.origin == "compiled" and prog.cubin[:4] == b"\x7fELF"
    return prog


def test_a_file_where_the_cache_directory_should_be(tmp_path, monkeypatch):
    in_the_way = tmp_path / "cache"
    in_the_way.write_text("not a directory")
    monkeypatch.setenv("DEVICEOP_CACHE_DIR", str(in_the_way))
    _compile_warning(_source(), f"{in_the_way} is a file, not a directory")
    assert comp.cache_stats() == {"dir": str(in_the_way), "entries": 0, "bytes": 0}
    comp.clear_cache()  # nothing to clear: no error
    from deviceop.__main__ import info_lines
    assert any(line.startswith("compile cache") and "0 entries" in line for line in info_lines())


def test_a_cache_entry_that_is_a_directory_is_compiled_around(tmp_path, monkeypatch):
    monkeypatch.setenv("DEVICEOP_CACHE_DIR", str(tmp_path))
    src = _source()
    key = dop.compile_cubin(src, arch="sm_90", cache=False).key
    (tmp_path / f"{key}.cubin").mkdir()
    _compile_warning(src, "Is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{key}.cubin"]  # no temporary file left behind
    with pytest.warns(UserWarning, match="could not remove compile-cache entry.*DEVICEOP_CACHE_DIR"):
        comp.clear_cache()


def test_an_unreadable_cache_entry_or_directory_is_compiled_around(tmp_path, monkeypatch):
    """Tests may run as root, for whom chmod changes nothing: the refusals are simulated."""
    monkeypatch.setenv("DEVICEOP_CACHE_DIR", str(tmp_path))
    src = _source()
    dop.compile_cubin(src, arch="sm_90")  # a valid entry on disk
    comp.clear_cache(disk=False)
    read_bytes = Path.read_bytes

    def refuse(self):
        if self.parent == tmp_path:
            raise PermissionError(13, "Permission denied", str(self))
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", refuse)
    _compile_warning(src, "cannot read compile-cache entry")
    monkeypatch.setattr(tempfile, "mkstemp", lambda **kw: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    comp.clear_cache(disk=False)
    _compile_warning(src, "could not write compile-cache entry")


# -- item 8: internal Python exceptions become deviceop errors ---------------------------

def test_unzip_of_the_wrong_arity(stream):
    with pytest.raises(dop.ShapeError, match=r"unzip\(3\) of zip, which produces 2 values: call unzip\(2\)"):
        zip_(dop.value(1), dop.value(2)).unzip(3)
    third = dop.value((1, 2)).unzip(3)[2]  # the arity shows only when it runs
    with pytest.raises(dop.ShapeError, match=r"unzip\(3\) needs an op producing 3 values, got 2 values"):
        third.sync_on(stream)
    with pytest.raises(dop.ShapeError, match="an int >= 0"):
        dop.value((1, 2)).unzip(-1)


def test_first_and_last_of_a_value_that_is_not_a_tuple(stream):
    with pytest.raises(dop.ShapeError, match=r"first\(\) needs an op producing a tuple .*got 5 \(int\)"):
        dop.value(5).first().sync_on(stream)
    with pytest.raises(dop.ShapeError, match=r"last\(\) needs .*got an empty tuple"):
        dop.value(()).last().sync_on(stream)


@pytest.mark.parametrize("value", [10**400, 1e39, -3.5e38])
def test_a_float32_scalar_that_would_become_inf(stream, value):
    x, y = dop.empty(256), dop.empty(256)
    with pytest.raises(dop.DTypeError, match="argument alpha of affine: .* does not fit in a float32 scalar "
                                             r"\(it would become inf\); .*declare the scalar float64"):
        affine(y.partition([128]), x, value, 0.0).generics([128])
    assert dop.float32.coerce(float("inf")) == float("inf")  # inf itself fits
    assert dop.float64.coerce(1e39) == 1e39


def test_matvec_generics_with_bk_zero(stream, rng):
    K = 256
    x = dop.from_numpy(rng.standard_normal((1, K)).astype(np.float32))
    w = dop.from_numpy(rng.standard_normal((64, K)).astype(np.float32))
    out = dop.empty(64)
    with pytest.raises(dop.ShapeError, match="matvec: generic BK=0 must be an int >= 1"):
        matvec(out.partition([4]), x, w).generics([4, 0, K]).sync_on(stream)


def test_a_stream_argument_that_is_not_a_stream():
    for call, name in ((lambda: dop.value(1).sync_on(None), "sync_on"),
                       (lambda: dop.value(1).async_on(None), "async_on"),
                       (lambda: dop.value(1).graph_on(None), r"graph_on\(value\)"),
                       (lambda: CudaGraph.scope(None, lambda s: None), r"CudaGraph.scope")):
        with pytest.raises(dop.LaunchError, match=f"{name}.* needs a deviceop stream .*got None"):
            call()


def test_a_scope_body_that_cannot_take_the_scope_is_refused_before_the_capture(stream, rng):
    # before the fix: a raw TypeError ("'int' object is not callable", "takes 0 positional
    # arguments") raised from inside the capture
    xs = rng.standard_normal(256).astype(np.float32)
    x, y = dop.from_numpy(xs, stream=stream), dop.empty(256, stream=stream)
    with pytest.raises(dop.LaunchError, match=r"CudaGraph.scope\(stream, body\) takes a function body\(s\).*got a int"):
        CudaGraph.scope(stream, 3)
    with pytest.raises(dop.LaunchError, match=r"body <lambda>\(\) cannot be called as body\(s\).*def body\(s\)"):
        CudaGraph.scope(stream, lambda: None)
    graph = CudaGraph.scope(stream, lambda s: s.record(affine(y.partition([128]), x, 2.0, 0.0).generics([128])))
    with pytest.raises(dop.LaunchError, match=r"graph.recapture\(body\)'s body <lambda>\(a, b\) cannot be called"):
        graph.recapture(lambda a, b: None)
    graph.launch().sync_on(stream)  # the graph and its stream go on as before
    assert np.allclose(y.numpy(), 2 * xs)


def test_graph_cache_sizes_must_be_ints(stream):
    with pytest.raises(dop.ShapeError, match="max_size must be an int >= 1, got 2.5"):
        GraphCache(lambda ws, x: x, stream=stream, max_size=2.5)
    with pytest.raises(dop.ShapeError, match="capture size 2.7 in sizes must be an int >= 1"):
        GraphCache(lambda ws, x: x, stream=stream, sizes=[2.7, 4])
    assert GraphCache(lambda ws, x: x, stream=stream, sizes=[np.int64(4), 2]).sizes == (2, 4)


def test_graph_update_takes_an_op(stream, rng):
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    y = dop.empty(256)
    graph = affine(y.partition([128]), x, 2.0, 0.0).generics([128]).graph_on(stream)
    with pytest.raises(dop.LaunchError, match=r"graph.update\(\) takes an op .*api.memcpy.*got a ndarray"):
        graph.update(np.ones(256, np.float32))


def test_reshape_takes_numpy_ints(stream):
    t = dop.value(dop.empty(4)).reshape(np.int64(4)).sync_on(stream)
    assert t.shape == (4,)
    assert dop.value(dop.empty(6)).reshape([np.int32(2), 3]).sync_on(stream).shape == (2, 3)
    with pytest.raises(dop.ShapeError, match=r"reshape\(\) takes dimensions as ints"):
        dop.value(dop.empty(4)).reshape(4.0)


class Bfloat16Producer:
    """A bfloat16 DLPack producer without torch: NumPy's export of the bits as
    uint16, relabelled kDLBfloat (what torch exports for a bfloat16 tensor)."""

    def __init__(self, array):
        self.bits = array.view(np.uint16)

    def __dlpack_device__(self):
        return self.bits.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        capsule = self.bits.__dlpack__(**kwargs)
        get_name, get_pointer = ctypes.pythonapi.PyCapsule_GetName, ctypes.pythonapi.PyCapsule_GetPointer
        get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
        get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        name = get_name(capsule)
        # DLManagedTensorVersioned holds its DLTensor at byte 32; DLTensor.dtype.code is at byte 20
        tensor = get_pointer(capsule, name) + (32 if name == b"dltensor_versioned" else 0)
        ctypes.c_uint8.from_address(tensor + 20).value = 4  # kDLBfloat
        return capsule


def test_from_dlpack_of_bfloat16(device, rng):
    if not device.is_reference:
        pytest.skip("host memory: the GPU imports device memory (test_tensor.py::test_bfloat16_interop_with_torch)")
    host = rng.standard_normal(16).astype(ml_dtypes.bfloat16)
    with pytest.raises(RuntimeError, match="Unsupported dtype in DLTensor"):
        np.from_dlpack(Bfloat16Producer(host))  # what NumPy alone does
    t = dop.from_dlpack(Bfloat16Producer(host))
    assert t.dtype is dop.bfloat16 and t.data_ptr == host.ctypes.data  # zero-copy
    np.testing.assert_array_equal(t.numpy(), host)
    with pytest.raises(dop.DTypeError, match="complex64 is not supported"):
        dop.from_dlpack(Exported(np.zeros(2, np.complex64)))


Exported = ForeignArray  # another framework's memory, exported through DLPack


def test_dlpack_type_codes_map_to_deviceop_dtypes():
    from deviceop.dtypes import from_dlpack_dtype
    assert from_dlpack_dtype(4, 16) is dop.bfloat16  # kDLBfloat
    assert from_dlpack_dtype(2, 16) is dop.float16 and from_dlpack_dtype(2, 32) is dop.float32
    assert from_dlpack_dtype(0, 32) is dop.int32 and from_dlpack_dtype(1, 8) is dop.uint8
    assert from_dlpack_dtype(6, 8) is dop.bool_
    with pytest.raises(dop.DTypeError, match="DLPack dtype complex64 has no deviceop dtype"):
        from_dlpack_dtype(5, 64)
    with pytest.raises(dop.DTypeError, match="float32 x4 lanes"):
        from_dlpack_dtype(2, 32, 4)


@pytest.mark.gpu
def test_from_dlpack_of_a_bfloat16_torch_host_tensor_on_the_reference_device():
    torch = pytest.importorskip("torch")
    x = torch.randn(16, dtype=torch.bfloat16)
    t = dop.from_dlpack(x, device=dop.ReferenceDevice(0))
    assert t.dtype is dop.bfloat16 and t.data_ptr == x.data_ptr()
    np.testing.assert_array_equal(t.numpy().astype(np.float32), x.float().numpy())


def _chain(n, b, outs):
    """``n`` launches, each reading the previous one's output (shared, as models build them)."""
    op = add(outs[0].partition([128]), b, b).generics([128]).first().unpartition().shared()
    for i in range(1, n):
        op = add(outs[i].partition([128]), op.clone(), b).generics([128]).first().unpartition().shared()
    return op


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 recurses in C: deviceop keeps its limit there")
def test_a_chain_of_5000_launches_executes_and_captures(stream):
    n = 5000
    b = dop.from_numpy(np.ones(128, np.float32))
    outs = [dop.empty(128) for _ in range(n)]
    _chain(n, b, outs).sync_on(stream)
    assert outs[-1].numpy()[0] == n + 1
    graph = _chain(n, b, outs).graph_on(stream)
    api.memcpy(outs[-1], dop.from_numpy(np.zeros(128, np.float32))).sync_on(stream)
    graph.launch().sync_on(stream)
    assert outs[-1].numpy()[0] == n + 1 and len(graph.nodes()) == n


def test_a_chain_deeper_than_the_recursion_limit_is_a_clear_error(stream):
    n = 1500
    b = dop.from_numpy(np.ones(128, np.float32))
    outs = [dop.empty(128) for _ in range(n)]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # a user's lower limit is kept: the chain no longer fits
    try:
        for run in (lambda op: op.sync_on(stream), lambda op: op.graph_on(stream),
                    lambda op: CudaGraph.scope(stream, lambda s: s.record(op))):
            with pytest.raises(dop.StateError, match=r"exceeded Python's recursion limit \(1000 frames.*"
                                                     r"partly executed: build it again.*DeviceOpVec"):
                run(_chain(n, b, outs))
            assert not stream.is_capturing()
    finally:
        sys.setrecursionlimit(limit)
    # the same work composed side by side never nests deeper than a few frames
    steps = [add(outs[0].partition([128]), b, b).generics([128])]
    steps += [add(outs[i].partition([128]), outs[i - 1], b).generics([128]) for i in range(1, n)]
    DeviceOpVec(steps).sync_on(stream)
    assert outs[-1].numpy()[0] == n + 1


def test_a_failed_shared_op_run_again_does_not_grow_its_claims(stream):
    def boom(_):
        raise ValueError("boom")

    op = dop.value(1).map(boom).shared()
    with pytest.raises(ValueError, match="boom"):
        op.clone().sync_on(stream)
    for _ in range(100):
        with pytest.raises(dop.StateError, match="failed when it ran, so its clones have no result"):
            op.clone().sync_on(stream)
    assert len(op.core.claims) <= 1
