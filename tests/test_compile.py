"""NVRTC compiles CUDA C++ to CUBIN for an exact arch — no GPU needed — and caches it."""
import warnings

import pytest

import deviceop as dop
from deviceop import compile as comp

SAXPY = r'''
extern "C" __global__ void saxpy(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
template <typename T, int N>
__global__ void fill(T* out, T value) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = value;
}
'''


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEVICEOP_CACHE_DIR", str(tmp_path))
    comp.clear_cache(disk=False)
    return tmp_path


def test_compiles_to_a_cubin_for_the_exact_arch(cache):
    prog = dop.compile_cubin(SAXPY, arch="sm_90")
    assert prog.arch == "sm_90"
    assert prog.cubin[:4] == b"\x7fELF"  # a CUBIN is an ELF image; PTX would be text
    assert prog.origin == "compiled"


def test_name_expressions_give_mangled_template_symbols(cache):
    prog = dop.compile_cubin(SAXPY, arch="sm_90", name_expressions=["fill<float, 128>", "fill<int, 4>"])
    assert prog.symbol("fill<float, 128>").startswith("_Z")
    assert prog.symbol("fill<float, 128>") != prog.symbol("fill<int, 4>")
    assert prog.symbol("saxpy") == "saxpy"  # extern "C" names are their own symbol


def test_cache_hits_memory_then_disk(cache):
    first = dop.compile_cubin(SAXPY, arch="sm_90")
    assert dop.compile_cubin(SAXPY, arch="sm_90").origin == "memory"
    comp.clear_cache(disk=False)
    again = dop.compile_cubin(SAXPY, arch="sm_90")
    assert again.origin == "disk" and again.cubin == first.cubin
    assert comp.cache_stats()["entries"] == 1


def test_key_covers_options_arch_and_source(cache):
    a = dop.compile_cubin(SAXPY, arch="sm_90")
    assert dop.compile_cubin(SAXPY, arch="sm_80").key != a.key
    assert dop.compile_cubin(SAXPY, arch="sm_90", options=["-DFOO=1"]).key != a.key
    assert dop.compile_cubin(SAXPY + "\n// edit", arch="sm_90").key != a.key


def test_key_covers_headers_in_user_include_dirs(cache, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "scale.cuh").write_text("#define SCALE 2.0f\n")
    src = '#include "scale.cuh"\nextern "C" __global__ void k(float* p) { p[0] *= SCALE; }\n'
    a = dop.compile_cubin(src, arch="sm_90", include_dirs=[inc])
    (inc / "scale.cuh").write_text("#define SCALE 3.0f\n")
    b = dop.compile_cubin(src, arch="sm_90", include_dirs=[inc])
    assert a.key != b.key and b.origin == "compiled"


def test_key_covers_every_file_the_source_includes_wherever_nvrtc_finds_it(cache, tmp_path, monkeypatch):
    # an .inc table, a header beside the script (NVRTC finds a quoted name in the working
    # directory) and one outside the include dir (../): each edit was served the stale CUBIN
    inc, here = tmp_path / "inc", tmp_path / "here"
    inc.mkdir(), here.mkdir()
    monkeypatch.chdir(here)
    files = {inc / "table.inc": "1.0f", here / "local.cuh": "2.0f", tmp_path / "up.cuh": "3.0f"}
    for i, (path, value) in enumerate(files.items()):
        path.write_text(f"#define V{i} {value}\n")
    src = ('#include "table.inc"\n#include "local.cuh"\n#include "../up.cuh"\n'
           'extern "C" __global__ void k(float* p) { p[0] = V0 + V1 + V2; }\n')
    first = dop.compile_cubin(src, arch="sm_90", include_dirs=[inc])
    for i, path in enumerate(files):
        path.write_text(f"#define V{i} 5.0f\n")
        again = dop.compile_cubin(src, arch="sm_90", include_dirs=[inc])
        assert again.origin == "compiled" and again.key != first.key, path.name
        first = again
    assert dop.compile_cubin(src, arch="sm_90", include_dirs=[inc]).origin == "memory"


@pytest.mark.parametrize("spell", [lambda d: ["-I" + str(d), "-include=pre.cuh"],
                                   lambda d: ["--include-path=" + str(d), "--pre-include", str(d / "pre.cuh")],
                                   lambda d: ["-I", str(d), "-include", "pre.cuh"]])
def test_key_covers_the_include_paths_and_pre_includes_the_options_name(cache, tmp_path, spell):
    # include_dirs passed as options: an edit to a header there was served the stale CUBIN
    (tmp_path / "h.cuh").write_text("#define V 1.0f\n")
    (tmp_path / "pre.cuh").write_text("#define W 1.0f\n")
    src = '#include "h.cuh"\nextern "C" __global__ void k(float* p) { p[0] = V + W; }\n'
    first = dop.compile_cubin(src, arch="sm_90", options=spell(tmp_path))
    for name, text in (("h.cuh", "#define V 2.0f\n"), ("pre.cuh", "#define W 3.0f\n")):
        (tmp_path / name).write_text(text)
        again = dop.compile_cubin(src, arch="sm_90", options=spell(tmp_path))
        assert again.origin == "compiled" and again.key != first.key, name
        first = again


def test_a_cache_dir_under_home_spelled_with_a_tilde_is_home(monkeypatch, tmp_path):
    # quoted where no shell expands it (a .env file, a Dockerfile ENV), "~/x" made a folder named ~
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DEVICEOP_CACHE_DIR", "~/deviceop-cache")
    assert comp.cache_dir() == tmp_path / "deviceop-cache"


def test_corrupt_cache_entry_is_recompiled_never_loaded(cache):
    good = dop.compile_cubin(SAXPY, arch="sm_90")
    entry = cache / f"{good.key}.cubin"
    data = bytearray(entry.read_bytes())
    data[-10] ^= 0xFF  # flip bits inside the CUBIN payload
    entry.write_bytes(bytes(data))
    comp.clear_cache(disk=False)
    with pytest.warns(UserWarning, match="corrupt compile-cache entry"):
        again = dop.compile_cubin(SAXPY, arch="sm_90")
    assert again.origin == "compiled" and again.cubin == good.cubin
    comp.clear_cache(disk=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewritten entry is whole again
        assert dop.compile_cubin(SAXPY, arch="sm_90").origin == "disk"


def test_edited_cache_metadata_is_recompiled_never_loaded(cache):
    """The checksum covers the metadata too: an entry whose lowered name was edited
    would otherwise load as a hit and launch a symbol the CUBIN does not have."""
    good = dop.compile_cubin(SAXPY, arch="sm_90", name_expressions=["fill<float, 128>"])
    symbol = good.symbol("fill<float, 128>")
    entry = cache / f"{good.key}.cubin"
    edited = symbol[:-1] + ("x" if symbol[-1] != "x" else "y")  # same length: the header still parses
    entry.write_bytes(entry.read_bytes().replace(symbol.encode(), edited.encode(), 1))
    comp.clear_cache(disk=False)
    with pytest.warns(UserWarning, match="corrupt compile-cache entry"):
        again = dop.compile_cubin(SAXPY, arch="sm_90", name_expressions=["fill<float, 128>"])
    assert again.origin == "compiled" and again.symbol("fill<float, 128>") == symbol
    comp.clear_cache(disk=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewritten entry is whole again
        assert dop.compile_cubin(SAXPY, arch="sm_90", name_expressions=["fill<float, 128>"]).origin == "disk"


def test_an_entry_of_an_older_format_is_a_quiet_miss(cache):
    good = dop.compile_cubin(SAXPY, arch="sm_90")
    entry = cache / f"{good.key}.cubin"
    entry.write_bytes(entry.read_bytes().replace(comp._MAGIC, b"DEVICEOP-CUBIN-1\n", 1))
    comp.clear_cache(disk=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not corruption: no warning, recompiled and rewritten
        assert dop.compile_cubin(SAXPY, arch="sm_90").origin == "compiled"
    assert entry.read_bytes().startswith(comp._MAGIC)


def test_truncated_cache_entry_is_recompiled(cache):
    good = dop.compile_cubin(SAXPY, arch="sm_90")
    entry = cache / f"{good.key}.cubin"
    entry.write_bytes(entry.read_bytes()[:40])
    comp.clear_cache(disk=False)
    with pytest.warns(UserWarning, match="corrupt"):
        assert dop.compile_cubin(SAXPY, arch="sm_90").origin == "compiled"


@pytest.mark.parametrize("value, on", [("0", False), ("false", False), ("False", False), ("OFF", False),
                                       ("No", False), (" no ", False), ("1", True), ("TRUE", True), ("Yes", True),
                                       ("on", True), ("", True)])
def test_disk_cache_switch_accepts_the_usual_spellings(cache, monkeypatch, value, on):
    monkeypatch.setenv("DEVICEOP_DISK_CACHE", value)
    assert comp.disk_cache_enabled() is on
    dop.compile_cubin(SAXPY, arch="sm_90")
    assert comp.cache_stats()["entries"] == (1 if on else 0)


@pytest.mark.parametrize("value", ["2", "disable", "nope", "of"])
def test_an_unknown_disk_cache_switch_is_refused_naming_the_spellings(cache, monkeypatch, value):
    monkeypatch.setenv("DEVICEOP_DISK_CACHE", value)
    with pytest.raises(dop.ConfigError, match=f"DEVICEOP_DISK_CACHE={value!r} .*0, false, no or off.*1, true, "
                                              "yes or on"):
        dop.compile_cubin(SAXPY, arch="sm_90")
    assert comp.cache_stats()["entries"] == 0
    from deviceop.__main__ import info_lines
    cache_line = next(line for line in info_lines() if line.startswith("compile cache"))
    assert f"DEVICEOP_DISK_CACHE={value!r} is not understood" in cache_line  # info still prints


def test_compile_error_shows_the_log_and_the_failing_line(cache):
    bad = 'extern "C" __global__ void k(float* p) {\n    float x = 1.0f;\n    p[0] = undefined_thing + x;\n}\n'
    with pytest.raises(dop.CompileError) as info:
        dop.compile_cubin(bad, arch="sm_90", filename="bad.cu")
    msg = str(info.value)
    assert 'identifier "undefined_thing" is undefined' in msg
    assert ">>    3 |     p[0] = undefined_thing + x;" in msg
    assert "bad.cu" in msg and info.value.log


def test_unknown_or_unsupported_arch(cache):
    with pytest.raises(dop.ArchError, match="cannot read"):
        dop.compile_cubin(SAXPY, arch="hopper")
    with pytest.raises(dop.ArchError, match="cannot compile for sm_42"):
        dop.compile_cubin(SAXPY, arch="sm_42")
    with pytest.raises(dop.CompileError, match="arch=..."):
        dop.compile_cubin(SAXPY, arch="sm_90", options=["-arch=sm_80"])
    # a tuple of another length was an IndexError or read as sm_90; an 'a'/'f' variant NVRTC lacks was a
    # CompileError quoting NVRTC's command line ("invalid or no value specified with --nv_arch flag")
    for arch in [(10,), (9, 0, 1)]:
        with pytest.raises(dop.ArchError, match=r"a tuple is \(major, minor\)"):
            dop.compile_cubin(SAXPY, arch=arch)
    with pytest.raises(dop.ArchError, match="sm_89 has no 'f' variant.*compile for sm_89"):
        dop.compile_cubin(SAXPY, arch="sm_89f")


def test_arch_spellings():
    assert comp.normalize_arch(90) == comp.normalize_arch("90") == comp.normalize_arch((9, 0)) == "sm_90"
    assert comp.normalize_arch("sm_90a") == "sm_90a"


def test_toolkit_headers_are_found():
    """cuda_fp16.h / cuda_bf16.h come from the NVIDIA wheels (or CUDA_HOME)."""
    src = '#include <cuda_fp16.h>\n#include <cuda_bf16.h>\nextern "C" __global__ void k(__half* a, __nv_bfloat16* b) { a[0] = __float2half(1.0f); b[0] = __float2bfloat16(2.0f); }\n'
    assert dop.compile_cubin(src, arch="sm_90", cache=False).cubin


def test_compiling_leaves_python_strings_intact(cache):
    """Regression: NVRTC once wrote its one-byte empty log into CPython's shared
    b" " object, turning every later space into NUL (and breaking `import torch`)."""
    dop.compile_cubin(SAXPY, arch="sm_90", cache=False)
    assert b" "[0] == 32  # the shared one-byte object still holds a space
    assert "a b".encode() == bytes([97, 32, 98])
