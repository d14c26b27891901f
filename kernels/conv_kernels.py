"""The fused conv's kernel declarations: the CUTLASS 2.x conv and its Params
builder, the Hopper WGMMA conv (two-launch and one-launch), the GroupNorm apply,
where CUTLASS's headers come from, and compile_all (CI compiles every shipped
configuration for sm_90)."""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import deviceop as dop
from deviceop.compile import normalize_arch
from deviceop.kernel import In, InOut, Kernel, Out, Scalar
from deviceop.runtime.tma import TENSOR_MAP_BYTES

from ._checks import _need
from .conv_reference import (ACTS, _apply_inplace_ref, _apply_ref, _conv_ref, _conv_wgmma_ref,
                             _one_launch_ref)
from .conv_tiles import _CUDA_TYPE, TILES, WGMMA_MAX_SPLIT_K, WGMMA_TILES, WgmmaTile, ideal_cluster_capacity

HERE = Path(__file__).resolve().parent
BLOB_BYTES = 1024        # kConvBlobBytes in conv2d_gn.cu
APPLY_THREADS = 256
MAX_CHANNELS = 4096     # kMaxChannels in gn_act.cu
# The apply kernel's CTAs per SM (its CTAS generic) -> the dynamic shared memory a
# launch pads itself with so that no more fit: 3 is the register cap (80 a thread);
# 2 takes 32 KB static + 48 KB + 1 KB reserved = 81 KB, and 3 x 81 > the H100's 228.
APPLY_PAD_BYTES = {3: 0, 2: 48 * 1024}


# -- where the CUTLASS headers come from ------------------------------------------

def cutlass_include_dir() -> str:
    """``<site-packages>/cutlass_library/source/include`` of the nvidia-cutlass wheel
    (found without importing cutlass_library, whose import runs its generators)."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise dop.CompileError("the fused conv needs CUTLASS's headers: pip install --no-deps "
                               "'nvidia-cutlass==4.2.0.0' (headers only; or pip install -e '.[conv]' with its "
                               "dependencies)")
    inc = os.path.join(spec.submodule_search_locations[0], "source", "include")
    if not os.path.isfile(os.path.join(inc, "cutlass", "cutlass.h")):
        raise dop.CompileError(f"{inc} holds no cutlass/cutlass.h; reinstall nvidia-cutlass")
    return inc


def _cccl_version(cccl_dir: str) -> tuple[int, int] | None:
    path = os.path.join(cccl_dir, "cuda", "std", "__cccl", "version.h")
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    m = re.search(r"#\s*define\s+CCCL_VERSION\s+(\d+)", text)
    if not m:
        return None
    v = int(m.group(1))
    return v // 1000000, v // 1000 % 1000


def cutlass_include_dirs() -> list[str]:
    """Include directories for the CUTLASS kernels.

    CUTLASS 4.2's CuTe forward-declares ``std::tuple_size`` as a variadic
    template under NVRTC; CCCL 3.1 and later (CUDA 13.1+ headers) declare it
    with one parameter, and NVRTC rejects the pair.  So these kernels need
    CCCL 3.0 (CUDA 13.0) headers: the toolkit's when they are 3.0, else the
    directory named by ``DEVICEOP_CUTLASS_CCCL`` (searched first)."""
    dirs = [cutlass_include_dir()]
    override = os.environ.get("DEVICEOP_CUTLASS_CCCL")
    if override:
        dirs += [override, str(Path(override).parent)]  # .../include/cccl and .../include (nv/)
        return dirs
    from deviceop.compile import toolkit_include_dirs
    for d in toolkit_include_dirs():
        version = _cccl_version(d)
        if version is not None and version > (3, 0):
            raise dop.CompileError(
                f"CUTLASS 4.2 does not compile under NVRTC with CCCL {version[0]}.{version[1]} (from {d}); it needs "
                "the CUDA 13.0 headers: pip install 'nvidia-cuda-cccl==13.0.*', or point DEVICEOP_CUTLASS_CCCL at a "
                "CCCL 3.0 include directory (.../nvidia/cu13/include/cccl)")
    return dirs


CUTLASS_OPTIONS = ("-default-device", "-DNDEBUG", "-diag-suppress=20044")



class CutlassKernel(Kernel):
    """A kernel that includes CUTLASS: its include directories are looked up when
    it compiles, so importing ``deviceop.kernels`` never needs the nvidia-cutlass wheel."""

    def compile(self, values=(), arch=None):
        self.include_dirs = (str(HERE), *cutlass_include_dirs())
        return super().compile(values, arch)


def _tiles(n: str, h: str, w: str, k: str) -> tuple[str, str]:
    """The conv's tiles per axis as shape expressions: (MT, NT) = (ceil(N*H*W / TM), ceil(K / TN))."""
    return f"(({n}*{h}*{w}+TM-1)//TM)", f"({k}+TN-1)//TN"


def _stats(mt: str, nt: str) -> Out:
    """The GroupNorm partials [MT, NT, SK*4*gs], a [1, 1, 4*gs] tile a CTA: the grid is
    (MT, NT, SK), SK the split-K slices; gs groups an n-tile can touch."""
    return Out("stats", "float32", shape=(mt, nt, "SK*4*gs"), tile=(1, 1, "4*gs"))


def _conv_params(y_dtype: str, n: str, h: str, w: str, c: str, k: str, r: str, out: str = "y",
                 out_dtype: str | None = None) -> list:
    """stats, y [N, H, W, K] (written: InOut, a whole tensor; the grid is stats'), x [N, H, W, C],
    w [K, R, R, C], bias [K]: the conv's operands, the sizes named ``n`` ... ``r`` (sizes the
    shapes bind, or the kernel's int scalars); ``out``/``out_dtype``: the written tensor's name
    and dtype where they are not y's (the one-launch kernel writes ``out``)."""
    mt, nt = _tiles(n, h, w, k)
    return [_stats(mt, nt), InOut(out, out_dtype or y_dtype, shape=(n, h, w, k)),
            In("x", "float16", shape=(n, h, w, c)), In("w", "float16", shape=(k, r, r, c)),
            In("bias", y_dtype, shape=(k,))]


def _semaphore(name: str, n: str, h: str, w: str, k: str) -> InOut:
    """The split-K counters, one a tile, then the one-launch kernel's grid barrier (2 words):
    counted up and reset by the kernel (InOut)."""
    mt, nt = _tiles(n, h, w, k)
    return InOut(name, "int32", shape=(f"{mt}*({nt})+2",))


def _tmaps(n: str, h: str, w: str, k: str) -> InOut:
    """The WGMMA kernel's tensor maps: two templates, then two maps and two tags a CTA (the
    kernel writes each CTA's maps and tags: InOut)."""
    mt, nt = _tiles(n, h, w, k)
    ctas = f"{mt}*({nt})*SK"
    return InOut("tmaps", "uint8", shape=(f"{2 * TENSOR_MAP_BYTES}*(1+{ctas})+16*{ctas}",))


def _conv_kernel(y_dtype: str) -> Kernel:
    suffix = "f16" if y_dtype == "float16" else "f32"
    return CutlassKernel(
        f"conv2d_gn_stats_{suffix}", HERE / "conv2d_gn.cu",
        [*_conv_params(y_dtype, "N", "H", "W", "C", "K", "R"), In("blob", "uint8", shape=(BLOB_BYTES,)),
         _semaphore("semaphore", "N", "H", "W", "K"), Scalar("hw", "int32"), Scalar("cpg", "int32"),
         Scalar("gs", "int32"), Scalar("with_stats", "int32")],
        entry="conv2d_gn_stats", generics=["YT", "TM", "TN", "TK", "WM", "WN", "STAGES"],
        block=lambda g: 32 * (g["TM"] // g["WM"]) * (g["TN"] // g["WN"]),
        shared_mem=lambda g: g["STAGES"] * (g["TM"] * g["TK"] + g["TK"] * g["TN"]) * 2,
        reference=_conv_ref, options=CUTLASS_OPTIONS)


class HopperKernel(CutlassKernel):
    """A kernel with WGMMA instructions: compiled for sm_90a (the arch-specific
    target; its CUBIN runs on sm_90 only), refused for any other arch."""

    def compile(self, values=(), arch=None):
        arch = normalize_arch(arch if arch is not None else dop.Device(0).arch)
        if arch.removesuffix("a") != "sm_90":
            raise dop.ArchError(f"{self.name} uses Hopper's WGMMA instructions and runs on sm_90 only, not {arch}; "
                                "the CUTLASS 2.x conv (tile='128x128', '128x64' or '64x64') runs elsewhere")
        return super().compile(values, "sm_90a")


# the WGMMA kernels' size scalars, which their shapes name (wd: the image width, beside the weight w)
_SIZES = ("n", "h", "wd", "c", "k", "r")


def _workspace(n: str, h: str, w: str, k: str) -> InOut:
    """The split-K workspace: each slice's fp32 tile, [tiles][slices][TM * TN] (written: InOut)."""
    mt, nt = _tiles(n, h, w, k)
    return InOut("partials", "float32", shape=(f"{mt}*({nt})*SK*TM*TN",))


def _wgmma_kernel(y_dtype: str, split_in_cluster: bool = True) -> Kernel:
    """The two-launch conv as declared for split-K in a cluster per tile (the grid's z
    slices one cluster; ``partials`` unused), or, ``split_in_cluster=False``, for split-K
    through the global workspace ``partials`` (no clusters; the launch's workspace_split
    must be 1).  One CUDA kernel: the two declarations differ only in how they launch,
    and share their CUBINs."""
    suffix = "f16" if y_dtype == "float16" else "f32"
    # the kernel writes partials when its workspace_split scalar says so: InOut either way
    partials = InOut("partials", "float32", rank=1) if split_in_cluster else _workspace("n", "h", "wd", "k")
    return HopperKernel(
        f"conv2d_gn_stats_wgmma{'' if split_in_cluster else '_workspace'}_{suffix}", HERE / "conv_wgmma.cu",
        [*_conv_params(y_dtype, *_SIZES), _tmaps("n", "h", "wd", "k"), partials,
         _semaphore("counters", "n", "h", "wd", "k")]
        + [Scalar(n, "int32") for n in (*_SIZES, "pad", "cpg", "gs", "with_stats", "workspace_split")],
        entry="conv2d_gn_stats_wgmma", generics=["YT", "TM", "TN", "STAGES", "LOADS"],
        # two warpgroups of consumers, and the producer warp when A and B come by TMA
        block=lambda g: 2 * g["TM"] + (32 if g["LOADS"] == 2 else 0),
        shared_mem=lambda g: WgmmaTile(g["TM"], g["TN"], g["STAGES"]).shared_bytes(
            "float16" if g["YT"] == "__half" else "float32"),
        cluster=(lambda g, grid: (1, 1, grid[2])) if split_in_cluster else None,   # a tile's split-K slices
        reference=_conv_wgmma_ref, options=CUTLASS_OPTIONS)


def _one_launch_kernel(bias_dtype: str, out_dtype: str) -> Kernel:
    sb, so = ("f16" if d == "float16" else "f32" for d in (bias_dtype, out_dtype))
    return HopperKernel(
        f"conv2d_gn_act_wgmma_{sb}_{so}", HERE / "conv_wgmma.cu",
        [*_conv_params(bias_dtype, *_SIZES, out="out", out_dtype=out_dtype), In("gamma", "float32", shape=("k",)),
         In("beta", "float32", shape=("k",)), InOut("partials", "float32", rank=1),
         _semaphore("counters", "n", "h", "wd", "k"), _tmaps("n", "h", "wd", "k")]
        + [Scalar(n, "int32") for n in (*_SIZES, "pad", "cpg", "gs", "groups")]
        + [Scalar("eps", "float32"), Scalar("act", "int32")],
        entry="conv2d_gn_act_wgmma", generics=["OT", "BT", "TM", "TN", "STAGES", "LOADS"],
        block=lambda g: 2 * g["TM"],
        shared_mem=lambda g: WgmmaTile(g["TM"], g["TN"], g["STAGES"]).shared_bytes("float32"),
        reference=_one_launch_ref, options=CUTLASS_OPTIONS)


def _params_kernel(y_dtype: str) -> Kernel:
    suffix = "f16" if y_dtype == "float16" else "f32"
    return CutlassKernel(
        f"conv2d_params_{suffix}", HERE / "conv2d_gn.cu",
        [Out("blob", "uint8", shape=(BLOB_BYTES,), tile=(BLOB_BYTES,))]   # one thread builds the Params
        + [Scalar(n, "int32") for n in ("n", "h", "w", "c", "k", "r", "s", "pad", "split_k")],
        entry="conv2d_params", generics=["YT", "TM", "TN", "TK", "WM", "WN", "STAGES"], block=32,
        options=CUTLASS_OPTIONS)


_APPLY_SCALARS = [Scalar("eps", "float32")] + [Scalar(n, "int32") for n in (
    "hw", "c", "groups", "tm", "tn", "ntiles", "ks", "gs", "rows_per")]


def _apply_padding(generics: dict) -> int:
    """The apply launch's dynamic shared memory for its CTAS generic (APPLY_PAD_BYTES)."""
    ctas = generics["CTAS"]
    _need(ctas in APPLY_PAD_BYTES, f"the apply kernel's CTAS generic is the CTAs an SM may hold, one of "
                                   f"{sorted(APPLY_PAD_BYTES)}; got {ctas!r}", dop.LaunchError)
    return APPLY_PAD_BYTES[ctas]


def _apply_kernel(y_dtype: str, out_dtype: str | None) -> Kernel:
    # the output as [N, hw/rows_per, rows_per*c]: chunks of rows_per pixels, one a CTA
    chunks = dict(shape=("N", "hw//rows_per", "rows_per*c"), tile=(1, 1, "rows_per*c"))
    common = [In("stats", "float32", shape=("MT", "ntiles", "ks*4*gs")), In("gamma", "float32", shape=("c",)),
              In("beta", "float32", shape=("c",))]
    sy = "f16" if y_dtype == "float16" else "f32"
    pad = _apply_padding
    if out_dtype is None:   # in place
        return Kernel(f"gn_act_apply_inplace_{sy}", HERE / "gn_act.cu",
                      [Out("y", y_dtype, **chunks), *common, *_APPLY_SCALARS], entry="gn_act_apply_inplace",
                      generics=["ACT", "YT", "CTAS"], block=APPLY_THREADS, shared_mem=pad,
                      reference=_apply_inplace_ref)
    so = "f16" if out_dtype == "float16" else "f32"
    return Kernel(f"gn_act_apply_{sy}_{so}", HERE / "gn_act.cu",
                  [Out("z", out_dtype, **chunks), In("y", y_dtype, shape=("N", "H", "W", "c")), *common,
                   *_APPLY_SCALARS],
                  entry="gn_act_apply", generics=["ACT", "YT", "OT", "CTAS"], block=APPLY_THREADS,
                  shared_mem=pad, reference=_apply_ref)


DTYPES = ("float16", "float32")
conv2d_gn_stats = {d: _conv_kernel(d) for d in DTYPES}
conv2d_params = {d: _params_kernel(d) for d in DTYPES}
conv2d_gn_stats_wgmma = {d: _wgmma_kernel(d) for d in DTYPES}
conv2d_gn_stats_wgmma_workspace = {d: _wgmma_kernel(d, split_in_cluster=False) for d in DTYPES}
conv2d_gn_act_wgmma = {(b, o): _one_launch_kernel(b, o) for b in DTYPES for o in DTYPES}
gn_act_apply = {(y, o): _apply_kernel(y, o) for y in DTYPES for o in DTYPES}
gn_act_apply_inplace = {d: _apply_kernel(d, None) for d in DTYPES}


_CAPACITY: dict = {}


def cluster_capacity(device) -> dict:
    """split -> clusters of `split` conv CTAs ``device`` keeps resident at once, asked of
    the driver once per device (every WGMMA tile takes a whole SM, so one tile answers
    for all); the ideal packing on the reference device."""
    if device.is_reference:
        return ideal_cluster_capacity(device.sm_count or 132)
    caps = _CAPACITY.get(device.ordinal)
    if caps is None:
        tile, kern = WGMMA_TILES["wg128x128"], conv2d_gn_stats_wgmma["float16"]
        gen = tuple(tile.generics("float16", 2))
        fn = kern.function(device, gen)
        caps = {1: device.sm_count}
        for s in range(2, WGMMA_MAX_SPLIT_K + 1):
            caps[s] = fn.max_active_clusters(kern.config((1, 1, s), gen))
        _CAPACITY[device.ordinal] = caps
    return caps


def compile_all(arch="sm_90", y_dtypes=DTYPES) -> list[str]:
    """Compile every shipped configuration (conv + params builder per tile and
    intermediate dtype, every apply variant) for ``arch``; returns what was built."""
    built = []
    for yd in y_dtypes:
        if normalize_arch(arch).removesuffix("a") == "sm_90":
            for tile in WGMMA_TILES.values():
                for loads in (1, 2):
                    conv2d_gn_stats_wgmma[yd].compile(tile.generics(yd, loads), arch=arch)
                    built.append(conv2d_gn_stats_wgmma[yd].name_expression(tile.generics(yd, loads)))
                    for od in DTYPES:
                        kern = conv2d_gn_act_wgmma[(yd, od)]
                        gen = [_CUDA_TYPE[od], _CUDA_TYPE[yd], tile.tm, tile.tn, tile.stages, loads]
                        kern.compile(gen, arch=arch)
                        built.append(kern.name_expression(gen))
        for tile in TILES.values():
            for kern in (conv2d_gn_stats[yd], conv2d_params[yd]):
                kern.compile(tile.generics(yd), arch=arch)
                built.append(kern.name_expression(tile.generics(yd)))
        for act in ACTS.values():
            for ctas in APPLY_PAD_BYTES:
                kern = gn_act_apply_inplace[yd]
                kern.compile([act, _CUDA_TYPE[yd], ctas], arch=arch)
                built.append(kern.name_expression([act, _CUDA_TYPE[yd], ctas]))
                for od in DTYPES:
                    kern = gn_act_apply[(yd, od)]
                    gen = [act, _CUDA_TYPE[yd], _CUDA_TYPE[od], ctas]
                    kern.compile(gen, arch=arch)
                    built.append(kern.name_expression(gen))
    return built
