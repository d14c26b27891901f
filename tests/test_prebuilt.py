"""Kernels other compilers built, declared as deviceop Kernels (kernel/prebuilt.py):
nvcc's CUBIN, fatbin and PTX (Kernel.from_binary) and Triton's compiled kernels
(Kernel.from_triton), each declared as its author wrote it and checked against the
binary: the parameter count and sizes where the binary says them, the arch where
it is loaded, and every launch check an NVRTC kernel has.

The binaries in tests/data were built by real compilers (tests/data/nvcc/build.sh:
nvcc 13.0 from its pip wheel; tests/data/triton/build.py: Triton 3.6 for sm_90,
without a GPU); others are made here by NVRTC.  These tests run on Device(0): the
references here, the binaries' code on a GPU (test_prebuilt_gpu.py runs the code
itself against float64)."""
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import deviceop as dop
from deviceop import In, InOut, Kernel, Out, Scalar
from deviceop.runtime.params import ParamLayout, null_ptr

DATA = Path(__file__).resolve().parent / "data"
NVCC = DATA / "nvcc"
TRITON_ENTRY = DATA / "triton" / "scale_shift.json"
BINARIES = ["saxpy.sm_90.cubin", "saxpy.fatbin", "saxpy.ptx"]

SAXPY = [InOut("y", "float32", shape=("n",)), In("x", "float32", shape=("n",)), Scalar("a", "float32"),
         Scalar("n", "int32")]


def saxpy_reference(g, y, x, a, n):
    y[...] = np.float32(a) * x + y


def saxpy(binary, **kw):
    kw.setdefault("reference", saxpy_reference)
    return Kernel.from_binary("saxpy", binary, SAXPY, grid=("(n+255)//256",), block=256, **kw)


def scale_sums_reference(g, out, sums, x, s):
    out[...] = np.float32(s) * x
    sums[...] = out.reshape(-1, 256).sum(axis=1, dtype=np.float64)


SCALE_SUMS = [Out("out", "float32", shape=("n",), tile=(256,)), Out("sums", "float32", shape=("n//256",)),
              In("x", "float32", shape=("n",)), Scalar("s", "float32")]

SCALE_SHIFT = [In("x", "float32", shape=("n",)), Out("y", "float32", shape=("n",), tile=(256,)),
               Scalar("n", "int32"), Scalar("a", "float32"), Scalar("b", "float32")]


def scale_shift_reference(g, x, y, n, a, b):
    y[...] = x * np.float32(a) + np.float32(b)


def nvrtc_ptx(source: str, arch: str = "sm_90") -> bytes:
    """PTX of ``source`` from NVRTC (compile.py makes CUBINs only: PTX is what this test feeds the loader)."""
    from cuda.bindings import nvrtc
    _, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"k.cu", 0, [], [])
    try:
        assert nvrtc.nvrtcCompileProgram(prog, 1, [f"-arch={arch.replace('sm_', 'compute_')}".encode()])[0] == 0
        size = nvrtc.nvrtcGetPTXSize(prog)[1]
        buf = bytearray(size)
        nvrtc.nvrtcGetPTX(prog, buf)
        return bytes(buf)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


SAXPY_SOURCE = (NVCC / "saxpy.cu").read_text()


@pytest.mark.parametrize("name", BINARIES)
def test_nvcc_binaries_compose_eagerly_and_replayed(stream, rng, name):
    """A CUBIN, a fatbin and PTX from nvcc, declared with an InOut and a declared grid: run eagerly and
    replayed (on the reference device their reference; test_prebuilt_gpu.py runs their code)."""
    kernel = saxpy(NVCC / name)
    assert kernel.entry == "saxpy" and kernel.binary.kind == {"cubin": "CUBIN", "fatbin": "fatbin", "ptx": "PTX"}[
        name.rsplit(".", 1)[1]]
    n = 1000
    y0, x0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    y, x = dop.from_numpy(y0, stream=stream), dop.from_numpy(x0, stream=stream)
    assert kernel(y, x, 1.5, n).first().unpartition().sync_on(stream) is y   # the first written: the InOut
    np.testing.assert_allclose(y.numpy(stream=stream), 1.5 * x0.astype(np.float64) + y0, rtol=1e-6, atol=1e-6)
    graph = kernel(y, x, -0.5, n).graph_on(stream)
    graph.replay()
    np.testing.assert_allclose(y.numpy(stream=stream), x0.astype(np.float64) + y0, rtol=1e-5, atol=1e-5)


def test_a_cpp_template_kernel_is_found_by_its_plain_name_with_two_outputs(stream, rng):
    """``demo::scale_sums<256>`` is one mangled symbol in the fatbin: its plain name finds it."""
    kernel = Kernel.from_binary("scale_sums", NVCC / "saxpy.fatbin", SCALE_SUMS, entry="demo::scale_sums",
                                reference=scale_sums_reference)
    assert (kernel.entry, kernel.binary_symbol) == ("demo::scale_sums", "_ZN4demo10scale_sumsILi256EEEvPfS1_PKff")
    x0 = rng.standard_normal(1024).astype(np.float32)
    out, sums = dop.empty(1024, stream=stream), dop.empty(4, stream=stream)
    kernel(out.partition([256]), sums.partition([4]), dop.from_numpy(x0, stream=stream), 2.0).sync_on(stream)
    np.testing.assert_allclose(sums.numpy(stream=stream), (2.0 * x0.astype(np.float64)).reshape(4, 256).sum(1),
                               rtol=1e-5, atol=1e-4)


def test_an_entry_the_binary_lacks_is_refused_listing_its_kernels():
    with pytest.raises(dop.LaunchError, match=r"has no kernel 'scale'; its kernels are "
                                              r"_ZN4demo10scale_sumsILi256EEEvPfS1_PKff, saxpy: pass entry="):
        Kernel.from_binary("scale", NVCC / "saxpy.sm_90.cubin", SCALE_SUMS, reference=scale_sums_reference)
    with pytest.raises(dop.LaunchError, match="no kernel 'other::scale_sums'"):
        Kernel.from_binary("x", NVCC / "saxpy.ptx", SCALE_SUMS, entry="other::scale_sums")
    two = dop.compile_cubin(SAXPY_SOURCE, arch="sm_90",
                            name_expressions=["demo::scale_sums<128>", "demo::scale_sums<256>"]).cubin
    with pytest.raises(dop.LaunchError, match=r"has 2 kernels named demo::scale_sums .*_ZN4demo10scale_sumsILi128E.*"
                                              r"_ZN4demo10scale_sumsILi256E.*pass entry= the symbol"):
        Kernel.from_binary("scale_sums", two, SCALE_SUMS, entry="demo::scale_sums")


@pytest.mark.parametrize("name", BINARIES)
def test_a_declaration_the_binary_disagrees_with_is_refused_when_declared(name):
    """One parameter short, and a float64 where the kernel takes a float32: refused at the declaration,
    naming the code read (the driver's cuFuncGetParamInfo says the same on a GPU)."""
    where = {"saxpy.sm_90.cubin": "SASS for sm_90", "saxpy.fatbin": "SASS for sm_90",
             "saxpy.ptx": r"PTX for compute_90 \(ISA 9.0\)"}[name]
    with pytest.raises(dop.LaunchError, match=rf"\({where} in .*{name}\): kernel saxpy takes 4 parameters but its "
                                              r"declared signature has 3"):
        Kernel.from_binary("saxpy", NVCC / name, SAXPY[:3], grid=(4,), reference=saxpy_reference)
    wrong = [*SAXPY[:2], Scalar("a", "float64"), SAXPY[3]]
    with pytest.raises(dop.LaunchError, match="parameter 2 of kernel saxpy is 4 bytes at offset 16, but the "
                                              r"signature declares dop.float64"):
        Kernel.from_binary("saxpy", NVCC / name, wrong, grid=("(n+255)//256",), reference=saxpy_reference)


def test_launches_of_a_binary_kernel_are_checked_as_an_nvrtc_kernels_are(stream, rng):
    """Aliasing, shapes and scalars that disagree with the tensors: refused before anything runs."""
    kernel = saxpy(NVCC / "saxpy.sm_90.cubin")
    y = dop.from_numpy(rng.standard_normal(512).astype(np.float32), stream=stream)
    with pytest.raises(dop.AliasingError, match="saxpy writes y and reads x from overlapping memory"):
        kernel(y, y, 2.0, 512).sync_on(stream)
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    with pytest.raises(dop.ShapeError, match="argument x has shape"):
        kernel(y, x, 2.0, 512).sync_on(stream)
    with pytest.raises(dop.ShapeError, match=r"pass n=512"):
        kernel(y, dop.from_numpy(rng.standard_normal(512).astype(np.float32), stream=stream), 2.0, 500).sync_on(stream)


def test_nvrtc_output_is_a_binary_too(stream, rng):
    """A CUBIN's bytes (compile_cubin) and PTX (nvrtcGetPTX) from NVRTC, declared with from_binary."""
    cubin = dop.compile_cubin(SAXPY_SOURCE, arch="sm_90").cubin
    for image in (cubin, nvrtc_ptx(SAXPY_SOURCE)):
        kernel = saxpy(image)
        assert kernel.binary.origin == "the binary"
        y0, x0 = (rng.standard_normal(300).astype(np.float32) for _ in range(2))
        y = dop.from_numpy(y0, stream=stream)
        kernel(y, dop.from_numpy(x0, stream=stream), 3.0, 300).sync_on(stream)
        np.testing.assert_allclose(y.numpy(stream=stream), 3.0 * x0.astype(np.float64) + y0, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["sm_80", "sm_100"])
def test_a_binary_for_another_arch_is_refused_naming_the_fix(stream, rng, arch):
    """SASS for sm_80 or sm_100 does not run on the sm_90 device (the H100; the reference device stands
    for one): refused when it is loaded, before anything runs, naming the nvcc line that fits."""
    kernel = saxpy(dop.compile_cubin(SAXPY_SOURCE, arch=arch).cubin)
    y = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    before = y.numpy(stream=stream)
    with pytest.raises(dop.ArchError, match=rf"\(CUBIN: SASS for {arch}\) has no code an sm_90 GPU runs .*"
                                            r"nvcc -cubin -arch=sm_90"):
        kernel(y, dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream), 2.0, 256).sync_on(stream)
    np.testing.assert_array_equal(y.numpy(stream=stream), before)
    # PTX for an older arch runs: the driver compiles it for the GPU
    older = saxpy(nvrtc_ptx(SAXPY_SOURCE, arch="sm_80"))
    older(y, dop.from_numpy(np.ones(256, np.float32), stream=stream), 1.0, 256).sync_on(stream)
    np.testing.assert_allclose(y.numpy(stream=stream), before + 1.0)


def test_ptx_newer_than_the_driver_is_refused_naming_a_cubin(stream, rng):
    """PTX of an ISA the driver does not know would fail to load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION): refused
    first, naming the CUBIN that loads.  The reference device stands for a driver of this NVRTC's version."""
    from cuda.bindings.utils import get_minimal_required_cuda_ver_from_ptx_ver as cuda_for
    major, minor = map(int, (stream.device.driver_version or dop.nvrtc_version()).split("."))
    isa = next(f"{m}.{n}" for m in (9, 10) for n in range(10)
               if _known(cuda_for, f"{m}.{n}") and cuda_for(f"{m}.{n}") > major * 1000 + minor * 10)
    _refused_ptx_isa(stream, rng, isa, dop.ArchError, rf"PTX of ISA {isa}, which needs a CUDA .* driver .* this one is CUDA "
                                       rf"{major}.{minor} .*nvcc -cubin -arch=sm_90")


def test_ptx_of_an_isa_newer_than_any_cuda_bindings_knows_is_refused_naming_a_cubin(stream, rng):
    """PTX ISA 99.0 is newer than the newest ISA in cuda-bindings' table, so newer than a driver no newer than
    that table's CUDA (the reference device's, the H100's 13.0) can JIT-compile: refused when loaded, as the
    driver would refuse it (CUDA_ERROR_UNSUPPORTED_PTX_VERSION), not left to fail there."""
    _refused_ptx_isa(stream, rng, "99.0", dop.ArchError, r"PTX of ISA 99.0, which needs a driver newer than CUDA \d+\.\d+ "
                                          r"\(whose newest PTX ISA is .*nvcc -cubin -arch=sm_90")


def _refused_ptx_isa(stream, rng, isa: str, error: type, match: str) -> None:
    """nvcc's saxpy PTX relabelled ISA ``isa`` is refused with ``error`` when launched (``match``), and
    nothing is written."""
    kernel = saxpy((NVCC / "saxpy.ptx").read_bytes().replace(b".version 9.0", f".version {isa}".encode()))
    y = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    before = y.numpy(stream=stream)
    with pytest.raises(error, match=match):
        kernel(y, dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream), 2.0, 256).sync_on(stream)
    np.testing.assert_array_equal(y.numpy(stream=stream), before)


def _known(cuda_for, isa: str) -> bool:
    try:
        cuda_for(isa)
        return True
    except ValueError:
        return False


def test_what_is_not_a_binary_is_refused_naming_what_is():
    with pytest.raises(dop.LaunchError, match="is not a CUBIN .ELF., a fatbin or PTX text"):
        saxpy(NVCC / "saxpy.cu")
    with pytest.raises(dop.LaunchError, match="cannot read the kernel binary .*missing.cubin"):
        saxpy(NVCC / "missing.cubin")
    with pytest.raises(dop.LaunchError, match="a kernel binary is a path or bytes"):
        saxpy({"cubin": b""})
    cubin = (NVCC / "saxpy.sm_90.cubin").read_bytes()
    for cut in (100, len(cubin) - 64):                        # a download cut short: accepted before, ran the reference
        with pytest.raises(dop.LaunchError, match=r"starts as an ELF file .a CUBIN. but its sections cannot be read.*"
                                                  r"truncated or corrupt"):
            saxpy(cubin[:cut])
    for text in ("not\na path", "saxpy.ptx\0"):              # text that is no path (open() refuses a NUL)
        with pytest.raises(dop.LaunchError, match="a str is a kernel binary's path, or PTX text; this one is neither"):
            saxpy(text)


@pytest.mark.parametrize("name,cut", [("saxpy.fatbin", 10), ("saxpy.fatbin", 4000), ("saxpy.ptx", 2000),
                                      ("saxpy.ptx", 4000)])
def test_a_fatbin_or_ptx_cut_short_is_refused_when_declared(name, cut):
    """A fatbin shorter than its header says (the driver, handed a pointer, would read past its end) and PTX
    ending inside a function (no driver compiles it) are refused when declared, on both devices; the whole
    files are kernels (test_nvcc_binaries_compose_eagerly_and_replayed)."""
    image = (NVCC / name).read_bytes()[:cut]
    says = "starts as a fatbin but has .* the file is truncated" if name.endswith("fatbin") else \
        "is PTX text whose braces do not pair up .*block.* never closed.*truncated"
    with pytest.raises(dop.LaunchError, match=says):
        saxpy(image)


def test_ptx_text_as_a_str_is_a_binary_as_its_bytes_are(stream, rng):
    """Triton's asm["ptx"] and a PTX file read as text are str: the PTX, not a path."""
    kernel = saxpy((NVCC / "saxpy.ptx").read_text())
    assert kernel.binary.kind == "PTX" and kernel.binary.key == saxpy(NVCC / "saxpy.ptx").binary.key
    y0, x0 = rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    y, x = dop.from_numpy(y0, stream=stream), dop.from_numpy(x0, stream=stream)
    kernel(y, x, 2.0, 300).sync_on(stream)
    np.testing.assert_allclose(y.numpy(stream=stream), 2 * x0.astype(np.float64) + y0, rtol=1e-6, atol=1e-6)
    with pytest.raises(dop.LaunchError, match="kernel saxpy takes 4 parameters"):   # checked as the file is
        Kernel.from_binary("saxpy", (NVCC / "saxpy.ptx").read_text(), SAXPY[:3], grid=(4,))


def test_without_a_reference_the_reference_device_refuses_a_binary_kernel_naming_reference(device, stream, rng):
    """On a GPU the binary's code runs; on the reference device only a NumPy reference can."""
    if not device.is_reference:
        pytest.skip("a GPU runs the binaries' code without a reference (tests/test_prebuilt_gpu.py)")
    kernel = saxpy(NVCC / "saxpy.fatbin", reference=None)
    triton_kernel = Kernel.from_triton(TRITON_ENTRY, SCALE_SHIFT, grid=("(n+255)//256",))
    y = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    with pytest.raises(dop.NoDeviceError, match=r"kernel saxpy is a binary another compiler built \(.*saxpy.fatbin\)"
                                                r": the reference device .* Give it a NumPy reference="):
        kernel(y, dop.empty(256, stream=stream), 1.0, 256).sync_on(stream)
    with pytest.raises(dop.NoDeviceError, match=r"kernel scale_shift is a binary .* Give it a NumPy reference="):
        triton_kernel(dop.empty(256, stream=stream), y.partition([256]), 256, 1.0, 0.0).sync_on(stream)


# -- Triton ----------------------------------------------------------------------------

def test_a_triton_cache_entry_is_a_kernel_with_its_geometry_and_scratch_pointers(stream, rng):
    """Triton's signature (x, y, n, a, b; BLOCK a constexpr) plus its two scratch pointers, passed NULL;
    its 4 warps are the block; eager and replayed."""
    kernel = Kernel.from_triton(TRITON_ENTRY, SCALE_SHIFT, grid=("(n+255)//256",), reference=scale_shift_reference)
    assert (kernel.name, kernel.entry, kernel.block, kernel.shared_mem) == ("scale_shift", "scale_shift", 128, 0)
    assert kernel.signature[-2:] == [null_ptr(), null_ptr()] and len(kernel.signature) == 7
    x0 = rng.standard_normal(768).astype(np.float32)
    x, y = dop.from_numpy(x0, stream=stream), dop.empty(768, stream=stream)
    graph = kernel(x, y.partition([256]), 768, 1.5, -0.25).graph_on(stream)
    graph.replay()
    np.testing.assert_allclose(y.numpy(stream=stream), 1.5 * x0.astype(np.float64) - 0.25, rtol=1e-6, atol=1e-6)


def test_a_triton_declaration_with_its_constexpr_is_refused_saying_triton_drops_it():
    with_block = [*SCALE_SHIFT, Scalar("BLOCK", "int32")]
    with pytest.raises(dop.LaunchError, match="takes 7 parameters but its declared signature has 8.*Triton's compiled "
                                              "signature drops its constexpr parameters"):
        Kernel.from_triton(TRITON_ENTRY, with_block, grid=(3,), reference=scale_shift_reference)


@pytest.mark.parametrize("field,value", [("num_ctas", 2), ("global_scratch_size", 64),
                                         ("launch_cooperative_grid", True)])
def test_what_tritons_own_launcher_would_set_up_is_refused_naming_foreign(tmp_path, field, value):
    md = json.loads(TRITON_ENTRY.read_text())
    md[field] = value
    (tmp_path / "scale_shift.json").write_text(json.dumps(md))
    shutil.copy(TRITON_ENTRY.with_suffix(".cubin"), tmp_path)
    with pytest.raises(dop.LaunchError, match=rf"needs what Triton's own launcher sets up .*{field}=.*dop.foreign"):
        Kernel.from_triton(tmp_path / "scale_shift.json", SCALE_SHIFT, grid=(3,), reference=scale_shift_reference)


@pytest.mark.parametrize("metadata,says", [([1, 2], "is a list, not the dict Triton writes"),
                                            (None, "is a NoneType, not the dict"),
                                            ({"num_warps": "4"}, "num_warps='4', where Triton writes an int"),
                                            ({"global_scratch_size": None}, "global_scratch_size=None"),
                                            ({"shared": -1}, "shared=-1"), ({"num_ctas": True}, "num_ctas=True"),
                                            ({"name": 3}, r"name=3, where Triton writes the kernel's name")])
def test_metadata_that_triton_did_not_write_is_refused_naming_the_field(tmp_path, metadata, says):
    md = json.loads(TRITON_ENTRY.read_text())
    if isinstance(metadata, dict):
        md.update(metadata)
    else:
        md = metadata
    (tmp_path / "scale_shift.json").write_text(json.dumps(md))
    shutil.copy(TRITON_ENTRY.with_suffix(".cubin"), tmp_path)
    with pytest.raises(dop.LaunchError, match=says):
        Kernel.from_triton(tmp_path / "scale_shift.json", SCALE_SHIFT, grid=(3,), reference=scale_shift_reference)


def test_what_is_not_a_compiled_triton_kernel_is_refused():
    with pytest.raises(dop.LaunchError, match="takes a Triton CompiledKernel .* got function. A @triton.jit "
                                              "function is not compiled yet"):
        Kernel.from_triton(scale_shift_reference, SCALE_SHIFT, grid=(1,))
    with pytest.raises(dop.LaunchError, match="cannot read the Triton kernel .*nothing.json"):
        Kernel.from_triton(DATA / "nothing.json", SCALE_SHIFT, grid=(1,))


def test_a_compiled_kernel_whose_metadata_is_no_dict_or_object_is_refused():
    """A CompiledKernel-shaped object whose .metadata is a list (no fields to read) is refused as metadata
    Triton did not write, like such a .json (was: TypeError from vars())."""
    from types import SimpleNamespace
    compiled = SimpleNamespace(metadata=["scale_shift"], asm={"cubin": TRITON_ENTRY.with_suffix(".cubin").read_bytes()})
    with pytest.raises(dop.LaunchError, match="the metadata of the Triton kernel .* is a list, not the dict Triton "
                                              "writes"):
        Kernel.from_triton(compiled, SCALE_SHIFT, grid=(1,), reference=scale_shift_reference)


def test_triton_compiles_for_sm90_here_and_its_compiled_kernel_is_a_kernel(stream, rng):
    """Where Triton is installed, it compiles for sm_90 without a GPU; the CompiledKernel is declared."""
    pytest.importorskip("triton", reason="Triton is not installed here (the GPU machine has it: test_prebuilt_gpu.py)")
    from triton_source import compile_scale_shift
    kernel = Kernel.from_triton(compile_scale_shift(90), SCALE_SHIFT, grid=("(n+255)//256",),
                                reference=scale_shift_reference)
    x0 = rng.standard_normal(512).astype(np.float32)
    y = dop.empty(512, stream=stream)
    kernel(dop.from_numpy(x0, stream=stream), y.partition([256]), 512, 2.0, 1.0).sync_on(stream)
    np.testing.assert_allclose(y.numpy(stream=stream), 2.0 * x0.astype(np.float64) + 1.0, rtol=1e-6)


# -- the NULL parameters after the arguments -----------------------------------------------

def test_null_pointers_after_the_arguments_are_in_the_buffer_and_not_arguments():
    layout = ParamLayout("k", [dop.ptr("float32"), "int32", null_ptr(), null_ptr()])
    assert len(layout.signature) == 2 and len(layout.full_signature) == 4
    buf, ptrs = layout.param_buffer()
    assert len(ptrs) == 4 and ptrs[3] - ptrs[0] == 24 and len(buf) == 32
    assert layout.pack(0x1000, 7) == (0x1000).to_bytes(8, "little") + (7).to_bytes(4, "little")
    assert bytes(buf[16:]) == bytes(16)
    with pytest.raises(dop.LaunchError, match="takes 2 arguments"):
        layout.pack(1, 2, 0)
    with pytest.raises(dop.LaunchError, match="a null_ptr parameter comes only after every argument"):
        ParamLayout("k", [null_ptr(), "int32"])


# -- bench/interop.py's own kernels, checked where there is no GPU --------------------------

def test_the_interop_benchs_kernels_compile_and_its_in_out_kernel_computes_its_step(monkeypatch, stream, rng):
    """Its NVRTC kernel (an InOut and two Outs) compiles for sm_90 against its declaration, and its
    reference is the float64 step's first part; its nvcc kernel is declared against the CUBIN."""
    monkeypatch.setattr(sys, "path", list(sys.path))   # the bench puts its folders first
    spec = importlib.util.spec_from_file_location("bench_interop", DATA.parent.parent / "bench" / "interop.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.add_rms_norm.check_compiled("sm_90")
    assert bench.saxpy.binary.kind == "CUBIN" and bench.saxpy.entry == "saxpy"
    d = 2048
    h0, r0, g0 = (rng.standard_normal(d).astype(np.float32) for _ in range(3))
    resid, xn, rstd = dop.from_numpy(r0, stream=stream), dop.empty((1, d), stream=stream), dop.empty(1, stream=stream)
    bench.add_rms_norm(resid, xn.partition([1, d]), rstd.partition([1]), dop.from_numpy(h0, stream=stream),
                       dop.from_numpy(g0, stream=stream), 1e-5, d).sync_on(stream)
    v = r0.astype(np.float64) + h0
    r = 1 / np.sqrt(np.mean(v * v) + 1e-5)
    np.testing.assert_allclose(resid.numpy(stream=stream), v, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(xn.numpy(stream=stream)[0], v * r * g0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rstd.numpy(stream=stream), [r], rtol=1e-5)


def test_kernels_of_one_binary_share_its_module_but_each_finds_its_own_symbol(monkeypatch):
    """The GPU loads a binary once (load_module caches by the image); a second kernel of it
    must look its symbol up with its own program's names, not the first kernel's (seen on the
    H100: demo::scale_sums was looked up as the cached saxpy program knew it, and not found)."""
    from deviceop.kernel.binary import BinaryProgram
    from deviceop.runtime import device as device_mod
    asked = []

    class Module:  # the module loaded for the first kernel of the binary
        program = BinaryProgram(b"", "sm_90", None, "one-image", {"saxpy": "saxpy"})

        def get_function(self, name, signature, *, label=None, symbol=None):
            asked.append(symbol or self.program.symbol(name))

    monkeypatch.setattr(device_mod, "load_module", lambda program, device: Module())
    symbol = "_ZN4demo10scale_sumsILi2EEEvPfS1_PKfi"
    second = BinaryProgram(b"", "sm_90", None, "one-image", {"demo::scale_sums": symbol})
    device_mod.CudaDevice.load_function(object(), second, "demo::scale_sums", [], None, {})
    assert asked == [symbol]
