"""Kernels other compilers built, on a GPU: nvcc's CUBIN, fatbin and PTX (JIT-compiled by
the driver) and Triton's compiled kernels, loaded and launched as deviceop Kernels, eager
and replayed: each replay bit-equal to the eager launch (and Triton's kernel to Triton's
own launch), all close to float64.  Then what the driver would refuse, refused first:
SASS for another arch, PTX newer than the driver.  And the step of bench/interop.py,
which mixes deviceop kernels, torch's and CuPy's cuBLAS, Triton, nvcc and a kernel with
an in-out and two outputs in one graph.

CPU tests of the same declarations: tests/test_prebuilt.py."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import deviceop as dop
from deviceop import Kernel, api
from test_prebuilt import NVCC, SAXPY_SOURCE, SCALE_SHIFT, SCALE_SUMS, TRITON_ENTRY, _known, saxpy

ROOT = Path(__file__).resolve().parent.parent
BINARIES = ["saxpy.sm_90.cubin", "saxpy.fatbin", "saxpy.ptx"]


def eager_and_replayed(stream, launch, outputs):
    """``launch()`` (a fresh op each call) run eagerly, then as a graph replayed once from the same
    starting data (``outputs`` reset to their values before): the results of both."""
    start = [o.numpy(stream=stream) for o in outputs]
    launch().sync_on(stream)
    eager = [o.numpy(stream=stream) for o in outputs]
    for o, a in zip(outputs, start):
        api.memcpy(o, dop.from_numpy(a, stream=stream)).sync_on(stream)
    graph = launch().graph_on(stream)
    graph.launch().sync_on(stream)
    replayed = [o.numpy(stream=stream) for o in outputs]
    graph.close()
    return eager, replayed


def bit_equal(a, b):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("name", BINARIES)
def test_nvcc_binaries_run_eager_and_replayed_as_kernels(device, stream, rng, name):
    """No reference= needed on a GPU; the PTX is JIT-compiled by the driver (ISA 9.0 on a 13.0 driver)."""
    kernel = saxpy(NVCC / name, reference=None)
    n = 5000
    x0, y0 = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    x, y = dop.from_numpy(x0, stream=stream), dop.from_numpy(y0, stream=stream)
    (eager,), (replayed,) = eager_and_replayed(stream, lambda: kernel(y, x, 1.5, n), [y])
    bit_equal(eager, replayed)
    np.testing.assert_allclose(eager, 1.5 * x0.astype(np.float64) + y0, rtol=1e-6, atol=1e-6)
    code = kernel.function(device).module.program.code
    assert code.kind == ("ptx" if name.endswith(".ptx") else "sass") and code.arch == 90


@pytest.mark.gpu
def test_a_cpp_template_kernel_from_nvcc_writes_both_of_its_outputs(stream, rng):
    kernel = Kernel.from_binary("scale_sums", NVCC / "saxpy.fatbin", SCALE_SUMS, entry="demo::scale_sums")
    x0 = rng.standard_normal(4096).astype(np.float32)
    x, out, sums = dop.from_numpy(x0, stream=stream), dop.empty(4096, stream=stream), dop.empty(16, stream=stream)
    (o1, s1), (o2, s2) = eager_and_replayed(
        stream, lambda: kernel(out.partition([256]), sums.partition([16]), x, 2.0), [out, sums])
    bit_equal(o1, o2)
    bit_equal(s1, s2)
    np.testing.assert_array_equal(o1, 2.0 * x0)   # exact: a product by 2
    np.testing.assert_allclose(s1, (2.0 * x0.astype(np.float64)).reshape(16, 256).sum(1), rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_nvrtc_cubin_bytes_are_a_binary_too(stream, rng):
    kernel = saxpy(dop.compile_cubin(SAXPY_SOURCE, arch=dop.Device(0).arch).cubin, reference=None)
    x0, y0 = (rng.standard_normal(777).astype(np.float32) for _ in range(2))
    y = dop.from_numpy(y0, stream=stream)
    kernel(y, dop.from_numpy(x0, stream=stream), -2.0, 777).sync_on(stream)
    np.testing.assert_allclose(y.numpy(stream=stream), -2.0 * x0.astype(np.float64) + y0, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_what_the_driver_would_refuse_is_refused_first_naming_the_fix(device, stream, rng):
    """SASS of another architecture, and PTX of an ISA newer than this driver: ArchError before loading."""
    other = "sm_80" if device.arch != "sm_80" else "sm_90"
    y = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    with pytest.raises(dop.ArchError, match=rf"SASS for {other}\) has no code an {device.arch} GPU runs .*nvcc -cubin"):
        saxpy(dop.compile_cubin(SAXPY_SOURCE, arch=other).cubin)(y, x, 1.0, 256).sync_on(stream)
    from cuda.bindings.utils import get_minimal_required_cuda_ver_from_ptx_ver as cuda_for
    major, minor = map(int, device.driver_version.split("."))
    isa = next(f"{m}.{n}" for m in (9, 10) for n in range(10)
               if _known(cuda_for, f"{m}.{n}") and cuda_for(f"{m}.{n}") > major * 1000 + minor * 10)
    newer = (NVCC / "saxpy.ptx").read_bytes().replace(b".version 9.0", f".version {isa}".encode())
    with pytest.raises(dop.ArchError, match=rf"PTX of ISA {isa}, which needs a CUDA .* this one is CUDA "
                                            rf"{major}.{minor} .*nvcc -cubin"):
        saxpy(newer)(y, x, 1.0, 256).sync_on(stream)


@pytest.mark.gpu
def test_a_triton_kernel_is_a_deviceop_kernel_bit_equal_to_tritons_own_launch(stream, rng):
    """Compiled by Triton for this GPU (its warm-up: no launch), declared with from_triton, launched by
    deviceop (eager and replayed) and by Triton itself: the same bits, close to float64."""
    triton = pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    from triton_source import scale_shift
    n = 5120
    x0 = rng.standard_normal(n).astype(np.float32)
    x, y, mine = (dop.from_numpy(x0, stream=stream), dop.empty(n, stream=stream), dop.empty(n, stream=stream))
    compiled = scale_shift.warmup(torch.from_dlpack(x), torch.from_dlpack(y), n, 1.5, -0.25, BLOCK=256, grid=(1,))
    kernel = Kernel.from_triton(compiled, SCALE_SHIFT, grid=("(n+255)//256",))
    assert kernel.block == 32 * compiled.metadata.num_warps

    def tritons_launch(s, x, y):
        with torch.cuda.stream(s.torch):
            scale_shift[(triton.cdiv(n, 256),)](torch.from_dlpack(x), torch.from_dlpack(y), n, 1.5, -0.25, BLOCK=256)

    dop.foreign(tritons_launch, reads=[x], writes=[y]).sync_on(stream)
    (eager,), (replayed,) = eager_and_replayed(stream, lambda: kernel(x, mine.partition([256]), n, 1.5, -0.25), [mine])
    bit_equal(eager, y.numpy(stream=stream))
    bit_equal(replayed, eager)
    np.testing.assert_allclose(eager, 1.5 * x0.astype(np.float64) - 0.25, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_the_committed_triton_cache_entry_runs_on_the_gpu(stream, rng):
    """Triton 3.6's CUBIN for sm_90 (built without a GPU, tests/data/triton/build.py) loads and runs."""
    kernel = Kernel.from_triton(TRITON_ENTRY, SCALE_SHIFT, grid=("(n+255)//256",))
    x0 = rng.standard_normal(2048).astype(np.float32)
    y = dop.empty(2048, stream=stream)
    kernel(dop.from_numpy(x0, stream=stream), y.partition([256]), 2048, 0.5, 2.0).sync_on(stream)
    np.testing.assert_allclose(y.numpy(stream=stream), 0.5 * x0.astype(np.float64) + 2.0, rtol=1e-6, atol=1e-6)


def _bench_interop(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))   # the bench puts its folders first
    spec = importlib.util.spec_from_file_location("bench_interop", ROOT / "bench" / "interop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
def test_a_step_mixing_everyones_gpu_work_replays_bit_equal_to_eager(device, stream, rng, monkeypatch):
    """bench/interop.py's step: a memcpy, an NVRTC kernel with an in-out and two outputs, torch's and
    CuPy's cuBLAS (dop.foreign), a Triton kernel and an nvcc kernel (kernel nodes), deviceop's matvec
    and add — one graph.  Each replay, with new inputs, is bit-equal to the eager step and close to float64."""
    for module in ("torch", "cupy", "triton"):
        pytest.importorskip(module)
    bench = _bench_interop(monkeypatch)
    step = bench.Step(device, stream, rng)
    graph = step.op().graph_on(stream)
    kinds = [node["type"] for node in graph.nodes()]
    assert (kinds.count("KERNEL"), kinds.count("GRAPH"), kinds.count("MEMCPY")) == (5, 2, 1), kinds
    for _ in range(3):
        step.set_input("h", rng.standard_normal(bench.D))
        step.set_input("res0", rng.standard_normal(bench.D))
        same, err = bench.check(step, graph)
        assert same and err < 1e-3, (same, err)
    graph.close()
