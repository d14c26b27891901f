"""Fused Conv2D -> GroupNorm -> SiLU/Mish (issue 6): two launches, one op.

    plan = ConvGnAct(n=1, h=64, w=64, c=320, k=320, groups=32, act="silu", stream=stream)
    op = plan(out, x, w, bias, gamma, beta)      # lazy: eager, graph_on and scope all take it

* ``x`` [N, H, W, C] fp16 (NHWC), ``w`` [K, R, S, C] fp16 (KRSC: torch's
  ``weight.permute(0, 2, 3, 1)``), 3x3 with padding 1 or 1x1, stride 1;
  ``bias`` [K] in the intermediate's dtype; ``gamma``, ``beta`` [K] fp32;
  ``out`` [N, H, W, K] fp16 or fp32.
* Launch 1: an implicit-GEMM conv plus deterministic GroupNorm partial
  statistics of each tile it wrote.  On Hopper (sm_90) with C % 64 == 0 it is
  kernels/conv_wgmma.cu (WGMMA tensor-core instructions, CuTe's GMMA atoms, the
  statistics taken from the tile staged in shared memory); otherwise
  kernels/conv2d_gn.cu, a CUTLASS 2.x conv (mma.sync), compiled by NVRTC from
  the ``nvidia-cutlass`` wheel's headers like the Hopper one.  Launch 2
  (kernels/gn_act.cu): Chan's merge of the partials, then normalize, affine
  and activation in one pass over y.
* Building a plan is eager, like allocating a buffer: it picks a tile
  configuration (for split-K WGMMA tiles, against the clusters the GPU holds at
  once), allocates a small workspace (CUTLASS's Params blob, split-K semaphores,
  the one-launch kernel's partials, the tensor maps, and y unless the op runs in
  place) and runs CUTLASS's Params constructor once on the GPU.  Calling the
  plan builds a lazy op and runs nothing.

The intermediate y is fp16 by default.  When a group's |mean| is more than
~20x its standard deviation, fp16 cannot hold y finely enough for 1e-2
absolute accuracy after normalization; ``y_dtype="float32"`` keeps it in fp32
(at the cost of twice the bytes).
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import deviceop as dop
from deviceop.compile import normalize_arch
from deviceop.runtime.tma import TENSOR_MAP_BYTES, tensor_map
from deviceop.kernel import In, Kernel, Out, Scalar

HERE = Path(__file__).resolve().parent
BLOB_BYTES = 1024        # kConvBlobBytes in conv2d_gn.cu
ACTS = {"identity": 0, "silu": 1, "mish": 2}
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
        raise dop.CompileError("the fused conv needs CUTLASS's headers: pip install 'nvidia-cutlass==4.2.0.0' "
                               "(or pip install -e '.[test]')")
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


# -- tile menu -----------------------------------------------------------------------

@dataclass(frozen=True)
class Tile:
    """One shipped CUTLASS configuration: threadblock TMxTNxTK, warp WMxWNxTK, pipeline stages."""
    tm: int
    tn: int
    tk: int
    wm: int
    wn: int
    stages: int

    @property
    def name(self) -> str:
        return f"{self.tm}x{self.tn}"

    @property
    def threads(self) -> int:
        return 32 * (self.tm // self.wm) * (self.tn // self.wn)

    def generics(self, y_dtype: str) -> list:
        return [_CPP[y_dtype], self.tm, self.tn, self.tk, self.wm, self.wn, self.stages]

    def shared_bytes(self) -> int:
        # CUTLASS's SharedStorage is a union of the mainloop's stages (A and B
        # tiles, fp16) and the (smaller) epilogue staging; checked on the GPU
        # against the sizeof the params builder reports (tests/test_conv.py).
        return self.stages * (self.tm * self.tk + self.tk * self.tn) * 2


TILES = {t.name: t for t in (Tile(128, 128, 64, 64, 64, 3), Tile(128, 64, 64, 64, 32, 4), Tile(64, 64, 64, 32, 32, 4))}
_CPP = {"float16": "cutlass::half_t", "float32": "float"}
MAX_SPLIT_K = 4


def tile_count(m: int, k: int, tile: Tile, split: int) -> int:
    return math.ceil(m / tile.tm) * math.ceil(k / tile.tn) * split


# The cost model behind choose_tile, fitted to the H100 tile sweep
# (bench/results/conv_gn_act_tile_sweep.json: 3 tiles x split-K 1-4 for C=320/640/1280
# at H=W=64/32/16, N=1 and 2, bare conv timed as graph replays).  Time is counted in
# k-iterations (one TK=64 step of the mainloop) of a 128x128 tile:
#   * a k-iteration of 128x64 costs 0.6 of one of 128x128, of 64x64 0.5 (smaller tiles
#     reuse less of each load, so they are less than proportionally cheaper);
#   * CTAs sharing an SM (up to its shared-memory capacity) run side by side, each
#     slowed by 40 % per neighbour; more CTAs than fit run in rounds;
#   * each extra split-K slice costs 10 (its serialized fix-up of the output tile).
# Every parameter set in the region t128 0.55-0.7, t64 0.4-1.0, split 6-14, sharing
# 0.3-0.6 picks the sweep's fastest configuration for all six problems; these are
# its middle (tests/test_conv.py checks the picks against the recorded sweep).
_K_ITER_COST = {"128x128": 1.0, "128x64": 0.6, "64x64": 0.5}
_SHARING_SLOWDOWN = 0.4
_SPLIT_COST = 10.0
_SHARED_PER_SM = 228 * 1024  # H100: usable shared memory per SM


def _estimated_cost(n: int, h: int, w: int, c: int, k: int, tile: Tile, split: int, r: int = 3,
                   sms: int = 132) -> float:
    """The model's time for one configuration, in 128x128 k-iterations (see above)."""
    k_iters = r * r * c / split / tile.tk
    per_sm_capacity = max(1, _SHARED_PER_SM // tile.shared_bytes())
    busiest = math.ceil(tile_count(n * h * w, k, tile, split) / sms)  # CTAs on the busiest SM
    side_by_side = min(busiest, per_sm_capacity)
    rounds = math.ceil(busiest / per_sm_capacity)
    per_cta = k_iters * _K_ITER_COST[tile.name] * (1 + (side_by_side - 1) * _SHARING_SLOWDOWN)
    return rounds * per_cta + _SPLIT_COST * (split - 1)


def choose_tile(n: int, h: int, w: int, c: int, k: int, r: int = 3, sms: int = 132) -> tuple[str, int]:
    """The (tile, split-K) the cost model above ranks fastest, among those that fit:
    H*W at least the tile's M (a tile never spans images) and, when split, at least 4 k-iterations
    per split-K slice."""
    hw, gemm_k = h * w, r * r * c
    best = None
    for name, tile in TILES.items():
        if hw < tile.tm:
            continue
        for split in range(1, MAX_SPLIT_K + 1):
            if split > 1 and gemm_k // split < 4 * tile.tk:
                break
            cost = _estimated_cost(n, h, w, c, k, tile, split, r, sms)
            if best is None or cost < best[0]:
                best = (cost, name, split)
    if best is None:
        raise dop.ShapeError(f"no tile configuration fits H*W={hw} output pixels per image: every shipped tile "
                             f"({', '.join(TILES)}) needs H*W >= its M size (64 at least)")
    return best[1], best[2]


# -- the Hopper (WGMMA) path -------------------------------------------------------------

@dataclass(frozen=True)
class WgmmaTile:
    """One shipped configuration of conv_wgmma.cu: TM rows (output pixels, TM/64
    warpgroups) x TN channels, a ring of ``stages`` k-blocks of 64 in shared memory."""
    tm: int
    tn: int
    stages: int

    @property
    def name(self) -> str:
        return f"wg{self.tm}x{self.tn}"

    @property
    def threads(self) -> int:
        return 2 * self.tm

    def generics(self, y_dtype: str, loads: int = 2) -> list:
        """The conv kernel's template arguments; ``loads``: 2 = A and B by TMA, 1 = B
        by TMA and A gathered by cp.async (conv_wgmma.cu, mainloop)."""
        return [_CUDA_TYPE[y_dtype], self.tm, self.tn, self.stages, loads]

    def a_box(self, h: int, w: int) -> tuple[int, int] | None:
        """(image rows, pixels per row) of the box in which TMA loads this tile's A
        from x -- whole rows, or a run of one row, so that the box is the tile's rows
        in order -- or None when the image width does not fit the tile that way."""
        if w <= self.tm:
            return (self.tm // w, w) if self.tm % w == 0 and (h * w) % self.tm == 0 else None
        return (1, self.tm) if w % self.tm == 0 else None

    def shared_bytes(self, staged_dtype: str) -> int:
        """convwg::Shape::kSmem: the largest of the mainloop's ring, the epilogue's
        staged tile (in y's dtype, or fp32 in the one-launch kernel) + statistics
        scratch, and the split-K cluster's epilogue (this slice's fp32 tile, half a
        tile of staged rows, the scratch and the last slice's inbox of partials),
        plus 1 KB to align the ring to 1024 bytes (the kernel traps if it gets
        less; tests/test_conv.py runs every tile)."""
        ring = self.stages * (self.tm + self.tn) * 128
        row = self.tn * np.dtype(staged_dtype).itemsize + 16
        slices = 2 * self.tm // (self.tn // 2)
        scratch = (slices * 2 + 4) * self.tn * 2 * 4
        epilogue = self.tm * row + scratch
        cluster = self.tm * (self.tn * 4 + 16) + self.tm // 2 * row + scratch + 8 * 2 * (self.tn + 1) * 8
        return max(ring, epilogue, cluster) + 1024


# Measured on the H100 (bench/results/conv_gn_act_wgmma_sweep.json): two warpgroups
# (128 rows) beat one (64 rows) at every U-Net shape, by 1.2-2x: they share each B
# tile and keep more wgmma in flight; 64x128 stays for images of 64-127 pixels.
# 4 stages were as fast as 5 or 6 (30.5 / 31.0 / 31.2 us at C=320 64x64 N=1).
WGMMA_TILES = {t.name: t for t in (WgmmaTile(64, 128, 6), WgmmaTile(128, 128, 4), WgmmaTile(128, 160, 4))}
_CUDA_TYPE = {"float16": "__half", "float32": "float"}   # the C++ type of a dtype in the non-CUTLASS kernels
WGMMA_MAX_SPLIT_K = 8


def wgmma_fits(arch: str, n: int, h: int, w: int, c: int, k: int) -> str | None:
    """None when conv_wgmma.cu can run this problem, else why not."""
    if arch.removesuffix("a") != "sm_90":
        return f"WGMMA needs sm_90 (Hopper), this device is {arch}"
    if c % 64:
        return f"C={c} is not a multiple of 64 (a k-block is 64 channels of one filter tap)"
    if h * w < 64:
        return f"H*W={h * w} is below the smallest tile's 64 rows"
    if n * h * w * max(c, k) >= 2 ** 31:
        return "the tensors exceed 2^31 elements (the kernel indexes x with 32-bit offsets)"
    return None


# The WGMMA cost model, fitted to the same sweep (A and B by TMA, the producer warp):
# time = rounds x k-blocks per CTA x the tile's cost per k-block (us), + the split-K
# fix-up.  Two fix-ups (conv_wgmma.cu):
#  * cluster: a split-K tile is a cluster of `split` CTAs and a GPC holds whole
#    clusters only, so the rounds count clusters against how many the GPU keeps
#    resident (measured on the H100, one 128-row CTA per SM: 66 / 39 / 30 / 22 / 17 /
#    15 / 15 clusters of 2-8), + ~3 us (the cross-slice sum 2.6-3.0, the barriers
#    ~1.4, less the single-slice epilogue it replaces);
#  * workspace: no clusters, so the rounds count CTAs against the SMs, but the last
#    slice of a tile reads every slice's fp32 tile back from L2 alone, at ~40 GB/s
#    (C=1280 16x16 N=1, 128x160: 12.8 / 19.0 us over the mainloop at 4 / 8 slices).
# C=1280 16x16 N=2 is 32 tiles of 128x160: 4 slices in clusters would need 32
# clusters of 4, two rounds (60.2 us); in the workspace they take one (36.8 us, 3
# slices in clusters 37.9).  Per k-block the mainloop measured 0.41-0.45 us for
# 128x160 (C=320-1280); any 128x160 cost in 0.38-0.49 with 128x128 at 0.9-1.0x of it,
# a cluster fix-up of 0-6 us and a workspace read of 40-50 GB/s picks the sweep's
# fastest for all six N <= 2 U-Net problems.  64-row tiles keep their measured ratio
# (1.3x a 128x160 k-block).
_WG_K_BLOCK_US = {"wg64x128": 0.57, "wg128x128": 0.42, "wg128x160": 0.44}
_WG_SPLIT_US = 3.0
_WG_WORKSPACE_BYTES_PER_US = 40e3
SPLIT_FIXUPS = ("cluster", "workspace")


def ideal_cluster_capacity(sms: int = 132) -> dict:
    """Clusters of 1-8 CTAs (one per SM) resident at once if any SMs could form one;
    the cost model's default where no GPU is at hand."""
    return {s: sms // s for s in range(1, WGMMA_MAX_SPLIT_K + 1)}


def wgmma_cost_us(n: int, h: int, w: int, c: int, k: int, tile: str, split: int, fixup: str | None, r: int = 3,
                  sms: int = 132, clusters: dict | None = None) -> float:
    """The model's time for one configuration (see above); ``fixup`` is None when split == 1."""
    _need(tile in WGMMA_TILES, f"tile={tile!r} is not a WGMMA tile ({', '.join(WGMMA_TILES)})", dop.LaunchError)
    _need((fixup is None) if split == 1 else fixup in SPLIT_FIXUPS,
          f"split={split} with fixup={fixup!r}: a split tile adds up in a 'cluster' or the 'workspace', "
          "an unsplit one needs neither (None)", dop.LaunchError)
    t = WGMMA_TILES[tile]
    clusters = clusters or ideal_cluster_capacity(sms)
    tiles = math.ceil(n * h * w / t.tm) * math.ceil(k / t.tn)
    k_blocks = r * r * c // 64 / split   # per CTA
    if split == 1:
        return math.ceil(tiles / sms) * k_blocks * _WG_K_BLOCK_US[tile]
    if fixup == "cluster":
        return math.ceil(tiles / max(1, clusters[split])) * k_blocks * _WG_K_BLOCK_US[tile] + _WG_SPLIT_US
    return (math.ceil(tiles * split / sms) * k_blocks * _WG_K_BLOCK_US[tile]
            + split * t.tm * t.tn * 4 / _WG_WORKSPACE_BYTES_PER_US)


def choose_wgmma_tile(n: int, h: int, w: int, c: int, k: int, r: int = 3, sms: int = 132,
                      clusters: dict | None = None) -> tuple[str, int, str | None]:
    """The (WGMMA tile, split-K, split fix-up) the model above ranks fastest, among
    tiles whose M fits H*W and splits that leave each slice 4 k-blocks at least; the
    fix-up is None without a split.  ``clusters``: split -> clusters of that many CTAs
    the GPU holds at once (cluster_capacity)."""
    best = None
    k_blocks = r * r * c // 64
    for name, t in WGMMA_TILES.items():
        if h * w < t.tm:
            continue
        for split in range(1, WGMMA_MAX_SPLIT_K + 1):
            if split > 1 and k_blocks // split < 4:
                break
            for fixup in (SPLIT_FIXUPS if split > 1 else (None,)):
                cost = wgmma_cost_us(n, h, w, c, k, name, split, fixup, r, sms, clusters)
                if best is None or cost < best[0] - 1e-6:   # a tie keeps the earlier tile, split, fix-up
                    best = (cost, name, split, fixup)
    if best is None:
        raise dop.ShapeError(f"no WGMMA tile fits H*W={h * w}")
    return best[1], best[2], best[3]


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


# -- references (float64) -------------------------------------------------------------

def conv2d_reference(x, w, bias, pad):
    """y [N, P, Q, K] = conv(x [N, H, W, C], w [K, R, S, C]) + bias, in float64."""
    x64 = np.pad(x.astype(np.float64), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    kk, r, s, _ = w.shape
    p, q = x64.shape[1] - r + 1, x64.shape[2] - s + 1
    w64 = w.astype(np.float64)
    y = np.zeros((x.shape[0], p, q, kk)) + bias.astype(np.float64)
    for i in range(r):
        for j in range(s):
            y += x64[:, i:i + p, j:j + q, :] @ w64[:, i, j, :].T
    return y


def activation_reference(v, act: str):
    if act == "silu":
        return v / (1.0 + np.exp(-v))
    if act == "mish":
        return v * np.tanh(np.logaddexp(0.0, v))
    return v


def conv_gn_act_reference(x, w, bias, gamma, beta, groups: int, eps: float, act: str):
    """conv2d -> GroupNorm(groups) -> act, all in float64 (what the GPU is held to)."""
    return _gn_act(conv2d_reference(x, w, bias, (w.shape[1] - 1) // 2), gamma, beta, groups, eps, act)


def _tile_partials(y2, hw, tm, tn, cpg, gs, m0, n0):
    """The conv kernel's (mean, M2) per (segment, group-in-tile) of one tile, float64."""
    mm, kk = y2.shape
    m_end = min(m0 + tm, mm)
    boundary = min((m0 // hw + 1) * hw, m_end)
    out = np.zeros((2, gs, 2))
    for sg, (a, b) in enumerate(((m0, boundary), (boundary, m_end))):
        if b <= a:
            continue
        for lg in range(gs):
            g = n0 // cpg + lg
            ca, cb = max(g * cpg, n0), min((g + 1) * cpg, n0 + tn, kk)
            if cb <= ca:
                continue
            block = y2[a:b, ca:cb]
            out[sg, lg] = block.mean(), ((block - block.mean()) ** 2).sum()
    return out


def _conv_ref(g, stats, y, x, w, bias, blob, semaphore, hw, cpg, gs, with_stats):
    """Reference of conv2d_gn_stats: y = conv + bias (rounded to y's dtype), and the partials."""
    _conv_and_partials(g, stats, y, x, w, bias, hw, cpg, gs, with_stats)


def _conv_wgmma_ref(g, stats, y, x, w, bias, tmaps, partials, counters, n, h, wd, c, k, r, pad, cpg, gs, with_stats,
                    workspace_split):
    """Reference of conv2d_gn_stats_wgmma: the same results (split-K leaves no trace)."""
    _conv_and_partials(g, stats, y, x, w, bias, h * wd, cpg, gs, with_stats)


def _one_launch_ref(g, stats, out, x, w, bias, gamma, beta, partials, counters, tmaps, n, h, wd, c, k, r, pad, cpg,
                    gs, groups, eps, act):
    """Reference of conv2d_gn_act_wgmma: the partials of the unrounded conv (the
    kernel stages its tile in fp32), then GroupNorm and the activation into out."""
    y = conv2d_reference(x, w, bias, pad)
    _tile_stats_into(g, stats, y.reshape(-1, k), h * wd, cpg, gs)
    out[...] = _gn_act(y, gamma, beta, groups, eps, {v: name for name, v in ACTS.items()}[act])


def _gn_act(y, gamma, beta, groups: int, eps: float, act: str):
    n, p, q, k = y.shape
    grouped = y.reshape(n, p * q, groups, k // groups)
    mean = grouped.mean(axis=(1, 3), keepdims=True)
    var = grouped.var(axis=(1, 3), keepdims=True)
    z = ((grouped - mean) / np.sqrt(var + eps)).reshape(n, p, q, k) * gamma.astype(np.float64) + beta.astype(np.float64)
    return activation_reference(z, act)


def _conv_and_partials(g, stats, y, x, w, bias, hw, cpg, gs, with_stats):
    pad = (w.shape[1] - 1) // 2
    y[...] = conv2d_reference(x, w, bias, pad).reshape(y.shape)
    if with_stats:
        _tile_stats_into(g, stats, y.reshape(-1, y.shape[-1]).astype(np.float64), hw, cpg, gs)


def _tile_stats_into(g, stats, y2, hw, cpg, gs):
    """Every tile's partials into stats [MT, NT, KS * 4 * GS] (the last slice's slot)."""
    tm, tn = g["TM"], g["TN"]
    mt, nt, _ = stats.shape
    ks = stats.shape[2] // (4 * gs)
    for i in range(mt):
        for j in range(nt):
            part = _tile_partials(y2, hw, tm, tn, cpg, gs, i * tm, j * tn)  # [2, GS, (mean, M2)]
            stats[i, j, (ks - 1) * 4 * gs:] = part.reshape(-1)


def _merge_partials(stats, n_img, hw, c, groups, tm, tn, gs):
    """Chan's merge of image n's partials per group, as gn_act.cu does it: (mean, var) per group."""
    cpg = c // groups
    ks = stats.shape[2] // (4 * gs)
    st = stats[:, :, (ks - 1) * 4 * gs:].reshape(stats.shape[0], stats.shape[1], 2, gs, 2)
    means, vars_ = np.zeros(groups), np.zeros(groups)
    t_first, t_last = n_img * hw // tm, (n_img * hw + hw - 1) // tm
    for g in range(groups):
        cnt = mean = m2 = 0.0
        for t in range(t_first, t_last + 1):
            for j in range(g * cpg // tn, ((g + 1) * cpg - 1) // tn + 1):
                rows = min((t + 1) * tm, (n_img + 1) * hw) - max(t * tm, n_img * hw)
                chans = min((g + 1) * cpg, (j + 1) * tn) - max(g * cpg, j * tn)
                sg = 1 if n_img * hw > t * tm else 0
                mb, m2b = st[t, j, sg, g - (j * tn) // cpg]
                nb = float(rows * chans)
                nn = cnt + nb
                d = mb - mean
                mean += d * nb / nn
                m2 += m2b + d * d * cnt * nb / nn
                cnt = nn
        means[g], vars_[g] = mean, max(m2 / cnt, 0.0)
    return means, vars_


def _apply_ref_common(g, z, y, stats, gamma, beta, eps, hw, c, groups, tm, tn, ntiles, ks, gs, rows_per):
    act = {v: k for k, v in ACTS.items()}[g["ACT"]]
    n = z.shape[0]
    yv = y.reshape(n, hw, c).astype(np.float64)
    out = np.empty((n, hw, c))
    for i in range(n):
        mean, var = _merge_partials(stats, i, hw, c, groups, tm, tn, gs)
        rstd = 1.0 / np.sqrt(var + eps)
        scale = gamma.astype(np.float64) * np.repeat(rstd, c // groups)
        shift = beta.astype(np.float64) - np.repeat(mean, c // groups) * scale
        out[i] = activation_reference(yv[i] * scale + shift, act)
    z[...] = out.reshape(z.shape)


def _apply_ref(g, z, y, stats, gamma, beta, eps, *rest):
    _apply_ref_common(g, z, y, stats, gamma, beta, eps, *rest)


def _apply_inplace_ref(g, y, stats, gamma, beta, eps, *rest):
    _apply_ref_common(g, y, y.copy(), stats, gamma, beta, eps, *rest)


# -- declarations ------------------------------------------------------------------------

class CutlassKernel(Kernel):
    """A kernel that includes CUTLASS: its include directories are looked up when
    it compiles, so importing ``kernels`` never needs the nvidia-cutlass wheel."""

    def compile(self, values=(), arch=None):
        self.include_dirs = (str(HERE), *cutlass_include_dirs())
        return super().compile(values, arch)


def _conv_kernel(y_dtype: str) -> Kernel:
    suffix = "f16" if y_dtype == "float16" else "f32"
    return CutlassKernel(
        f"conv2d_gn_stats_{suffix}", HERE / "conv2d_gn.cu",
        [Out("stats", "float32", rank=3), In("y", y_dtype, rank=4), In("x", "float16", rank=4),
         In("w", "float16", rank=4), In("bias", y_dtype, rank=1), In("blob", "uint8", rank=1),
         In("semaphore", "int32", rank=1), Scalar("hw", "int32"), Scalar("cpg", "int32"), Scalar("gs", "int32"),
         Scalar("with_stats", "int32")],
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


def _wgmma_kernel(y_dtype: str, split_in_cluster: bool = True) -> Kernel:
    """The two-launch conv as declared for split-K in a cluster per tile (the grid's z
    slices one cluster), or, ``split_in_cluster=False``, for split-K through the global
    workspace (no clusters; the launch's workspace_split must be 1).  One CUDA kernel:
    the two declarations differ only in how they launch, and share their CUBINs."""
    suffix = "f16" if y_dtype == "float16" else "f32"
    return HopperKernel(
        f"conv2d_gn_stats_wgmma{'' if split_in_cluster else '_workspace'}_{suffix}", HERE / "conv_wgmma.cu",
        [Out("stats", "float32", rank=3), In("y", y_dtype, rank=4), In("x", "float16", rank=4),
         In("w", "float16", rank=4), In("bias", y_dtype, rank=1), In("tmaps", "uint8", rank=1),
         In("partials", "float32", rank=1), In("counters", "int32", rank=1)]
        + [Scalar(n, "int32") for n in ("n", "h", "w", "c", "k", "r", "pad", "cpg", "gs", "with_stats",
                                        "workspace_split")],
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
        [Out("stats", "float32", rank=3), In("out", out_dtype, rank=4), In("x", "float16", rank=4),
         In("w", "float16", rank=4), In("bias", bias_dtype, rank=1), In("gamma", "float32", rank=1),
         In("beta", "float32", rank=1), In("partials", "float32", rank=1), In("counters", "int32", rank=1),
         In("tmaps", "uint8", rank=1)]
        + [Scalar(n, "int32") for n in ("n", "h", "w", "c", "k", "r", "pad", "cpg", "gs", "groups")]
        + [Scalar("eps", "float32"), Scalar("act", "int32")],
        entry="conv2d_gn_act_wgmma", generics=["OT", "BT", "TM", "TN", "STAGES", "LOADS"],
        block=lambda g: 2 * g["TM"],
        shared_mem=lambda g: WgmmaTile(g["TM"], g["TN"], g["STAGES"]).shared_bytes("float32"),
        reference=_one_launch_ref, options=CUTLASS_OPTIONS)


def _params_kernel(y_dtype: str) -> Kernel:
    suffix = "f16" if y_dtype == "float16" else "f32"
    return CutlassKernel(
        f"conv2d_params_{suffix}", HERE / "conv2d_gn.cu",
        [Out("blob", "uint8", rank=1)] + [Scalar(n, "int32") for n in ("n", "h", "w", "c", "k", "r", "s", "pad",
                                                                       "split_k")],
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
    common = [In("stats", "float32", rank=3), In("gamma", "float32", rank=1), In("beta", "float32", rank=1)]
    sy = "f16" if y_dtype == "float16" else "f32"
    pad = _apply_padding
    if out_dtype is None:   # in place
        return Kernel(f"gn_act_apply_inplace_{sy}", HERE / "gn_act.cu",
                      [Out("y", y_dtype, rank=3), *common, *_APPLY_SCALARS], entry="gn_act_apply_inplace",
                      generics=["ACT", "YT", "CTAS"], block=APPLY_THREADS, shared_mem=pad,
                      reference=_apply_inplace_ref)
    so = "f16" if out_dtype == "float16" else "f32"
    return Kernel(f"gn_act_apply_{sy}_{so}", HERE / "gn_act.cu",
                  [Out("z", out_dtype, rank=3), In("y", y_dtype, rank=4), *common, *_APPLY_SCALARS],
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


# -- the plan: one problem shape, its workspace, the lazy op ------------------------------

def _rows_per_chunk(hw: int, c: int, n: int, sms: int) -> int:
    """Rows of one image per apply CTA: a divisor of H*W (the output partition must
    divide), about 2 CTAs per SM in all, and at least 1024 elements of y per CTA
    (half its threads with a 16-byte vector).  Measured on the H100 (fused graph
    replays, us, rows per CTA, 2 / 3 apply CTAs a SM): C=1280 16x16 N=1 1 row 30.6 /
    30.7, 2 rows 31.4 / 31.7, 4 32.2 / 32.1, 8 32.7 / 32.4; N=2 1 46.6 / 46.3, 2 44.7 /
    44.2, 4 44.7 / 45.4, 8 46.3 / 47.3; C=640 32x32 N=1 1 34.8 / 33.2, 2 30.8 / 31.3,
    4 29.4 / 29.3, 8 29.4 / 29.9.  (With the apply kernel before GroupPartials, at
    C=640 N=2 and C=320 N=1/2 -- 8/16/32 rows, 256 CTAs -- half or twice the rows was
    0.8-4 us slower.)"""
    want = max(1, math.ceil(n * hw / (2 * sms)))
    want = max(want, math.ceil(1024 / c))
    divisors = [d for d in range(1, hw + 1) if hw % d == 0]
    return min((d for d in divisors if d >= want), default=hw)


def apply_ctas_per_sm(apply_ctas: int, sms: int, busy_sms: int) -> int:
    """How many apply CTAs an SM may hold (gn_act.cu's CTAS), given the SMs that still
    run the conv's last CTAs when it ends (`busy_sms`; the others free up earlier).
    Under PDL the apply CTAs take the SMs the conv leaves and wait there, set up:
    3 a SM where that lets every one of them be waiting when the conv ends and 2 would
    not; else 2, which packs fewer of them on the SMs that free first.  Measured on
    the H100 (fused, graph replays, us, 2 vs 3 a SM): C=1280 16x16 N=2 (4 slices
    through the workspace: 32 SMs busy, 256 apply CTAs) 45.2 vs 44.4; N=1 (6 slices
    in clusters: 96 busy, 128 CTAs) 31.5 vs 31.7; C=320 64x64 N=2 (128 busy, 256
    CTAs) 37.2 vs 38.7; C=640 32x32 N=2 38.8 vs 39.2; C=320 N=1 28.9 vs 29.5; N=8
    C=1280 112.7 vs 114.2, C=320 149.5 vs 151.8.  C=640 32x32 N=1 (96 busy, 256
    CTAs) is the one shape the rule gets wrong: 29.3 vs 29.0."""
    free = max(0, sms - busy_sms)
    return 3 if 2 * free < apply_ctas <= 3 * free else 2


def _need(cond: bool, message: str, kind=dop.ShapeError) -> None:
    if not cond:
        raise kind(message)


class ConvGnAct:
    """conv2d (3x3 pad 1, or 1x1) + bias -> GroupNorm(groups) -> act, planned for one shape.

    ``plan(out, x, w, bias, gamma, beta)`` is the lazy op (two launches); its
    value is ``out``.  ``plan.conv(y, x, w, bias)`` is the bare convolution
    (launch 1 without statistics), for comparisons.  ``inplace=True``: the conv
    writes straight into ``out`` and the normalization overwrites it (no y
    buffer; ``out`` must then have the intermediate's dtype).  ``one_launch=True``
    (WGMMA tiles, a grid that fits the GPU at once): the whole op in one cooperative
    launch, y kept in shared memory in fp32 (see the measurements in __init__).
    ``a_tma``: the WGMMA conv loads x by TMA, a box of whole image rows per k-block,
    where the image width fits the tile (None: wherever it does; False: gathered
    by every thread with cp.async, for comparisons).  ``split_fixup`` (WGMMA, split_k
    > 1): where the split-K slices of a tile add up -- "cluster" (a thread-block
    cluster per tile, distributed shared memory) or "workspace" (a global workspace,
    the last slice to arrive); None: the cost model's choice with the tile and split.
    """

    def __init__(self, n: int, h: int, w: int, c: int, k: int, *, kernel_size: int = 3, groups: int = 32,
                 act: str = "silu", eps: float = 1e-5, y_dtype: str = "float16", out_dtype: str = "float16",
                 inplace: bool = False, tile: str | None = None, split_k: int | None = None,
                 a_tma: bool | None = None, split_fixup: str | None = None, one_launch: bool = False,
                 stream=None):
        _need(act in ACTS, f"act={act!r} is not one of {', '.join(ACTS)}", dop.LaunchError)
        _need(kernel_size in (1, 3), f"kernel_size={kernel_size}: only 3x3 (padding 1) and 1x1 (padding 0) "
                                     "convolutions are supported")
        _need(y_dtype in DTYPES and out_dtype in DTYPES, f"y_dtype={y_dtype!r} and out_dtype={out_dtype!r} must be "
                                                         "'float16' or 'float32'", dop.DTypeError)
        _need(not inplace or y_dtype == out_dtype, f"in place, out is y: out_dtype ({out_dtype}) must equal y_dtype "
                                                   f"({y_dtype})", dop.DTypeError)
        _need(min(n, h, w, c, k) >= 1, f"every size must be positive, got n={n}, h={h}, w={w}, c={c}, k={k}")
        _need(c % 8 == 0 and k % 8 == 0, f"C={c} and K={k} must be multiples of 8: the kernels move 16 bytes "
                                         "(8 fp16 channels) per access; pad the channels with zeros")
        _need(groups >= 1 and k % groups == 0, f"K={k} output channels do not divide into groups={groups}; "
                                               "pick a group count that divides K")
        _need(k <= MAX_CHANNELS, f"K={k} exceeds the apply kernel's {MAX_CHANNELS} channels")
        self.n, self.h, self.w, self.c, self.k = n, h, w, c, k
        self.r, self.pad, self.groups, self.act, self.eps = kernel_size, (kernel_size - 1) // 2, groups, act, eps
        self.y_dtype, self.out_dtype, self.inplace = y_dtype, out_dtype, inplace
        self.stream = stream
        device = stream.device if stream is not None else dop.Device(0)
        sms = device.sm_count or 132
        hw = h * w
        _need(split_fixup in (None, *SPLIT_FIXUPS), f"split_fixup={split_fixup!r} is not one of "
              f"{', '.join(map(repr, SPLIT_FIXUPS))} or None", dop.LaunchError)
        if tile is None:   # the Hopper kernel where it applies, else CUTLASS 2.x
            why_not = wgmma_fits(device.arch, n, h, w, c, k)
            if why_not is None:
                tile, auto_split, _ = choose_wgmma_tile(n, h, w, c, k, kernel_size, sms, cluster_capacity(device))
            else:
                tile, auto_split = choose_tile(n, h, w, c, k, kernel_size, sms)
            split_k = auto_split if split_k is None else split_k
        _need(tile in TILES or tile in WGMMA_TILES,
              f"tile={tile!r} is not one of {', '.join([*TILES, *WGMMA_TILES])}", dop.LaunchError)
        self.wgmma = tile in WGMMA_TILES
        self.tile = WGMMA_TILES[tile] if self.wgmma else TILES[tile]
        if self.wgmma:
            why_not = wgmma_fits(device.arch, n, h, w, c, k)
            _need(why_not is None, f"tile {tile} runs the WGMMA kernel, which cannot take this problem: {why_not}; "
                                   f"use a CUTLASS tile ({', '.join(TILES)})")
        _need(hw >= self.tile.tm, f"tile {tile} needs H*W >= {self.tile.tm} (a tile holds rows of at most two "
                                  f"images); H*W = {hw}: use a smaller tile")
        self.split_k = split_k or 1
        max_split = WGMMA_MAX_SPLIT_K if self.wgmma else MAX_SPLIT_K
        _need(1 <= self.split_k <= max_split, f"split_k={split_k} must be in [1, {max_split}]", dop.LaunchError)
        if self.wgmma:
            _need(self.split_k <= kernel_size ** 2 * c // 64, f"split_k={split_k} exceeds the "
                  f"{kernel_size ** 2 * c // 64} k-blocks of 64 channels", dop.LaunchError)
        t = self.tile
        _need(split_fixup is None or (self.wgmma and self.split_k > 1 and not one_launch),
              f"split_fixup={split_fixup!r} applies to the WGMMA two-launch conv with split_k > 1 (this plan: tile "
              f"{t.name}, split_k={self.split_k}, one_launch={bool(one_launch)}): leave it None", dop.LaunchError)
        # where the slices of a split tile add up (conv_wgmma.cu): the model's choice for
        # this tile and split unless given; the one-launch kernel is cooperative, so it
        # always uses the workspace
        self.split_fixup = None
        if self.wgmma and self.split_k > 1:
            self.split_fixup = ("workspace" if one_launch else split_fixup or min(
                SPLIT_FIXUPS, key=lambda f: wgmma_cost_us(n, h, w, c, k, t.name, self.split_k, f, kernel_size, sms,
                                                          cluster_capacity(device))))
        # one_launch=True: the whole op as one cooperative launch (kernels/conv_wgmma.cu,
        # conv2d_gn_act_wgmma), possible when the grid fits on the GPU at once (one CTA
        # per SM: each takes >= 128 KB of shared memory).  Not the default: measured on
        # the H100 it is no faster than conv + apply (graph replays, N=1 C=320/640/1280:
        # 36.6/36.2/39.6 us vs 36.1/34.7/39.4; N=2: 44.9/50.6/53.0 vs 45.3/49.4/52.5).
        # The merge of every tile's partials after its grid barrier is the same chain
        # of L2 round trips the apply kernel pays, which PDL overlaps with the conv.
        ctas = math.ceil(n * hw / t.tm) * math.ceil(k / t.tn) * self.split_k
        fits = self.wgmma and ctas <= sms
        one_launch = bool(one_launch)
        _need(not one_launch or fits, f"one_launch=True needs the WGMMA kernel and a grid the GPU holds at once; "
                                      f"this plan's is {ctas} CTAs of tile {t.name} on {sms} SMs: use one_launch=False "
                                      "(two launches), or pick a larger tile or a smaller split_k", dop.LaunchError)
        self.one_launch = bool(one_launch)
        self.hw, self.cpg = hw, k // groups
        self.mt, self.nt = math.ceil(n * hw / t.tm), math.ceil(k / t.tn)
        self.gs = min(groups, math.ceil(t.tn / self.cpg) + 1)   # groups one n-tile can touch
        self.rows_per = _rows_per_chunk(hw, k, n, sms)
        self.chunks = hw // self.rows_per
        # the SMs still running the conv when it ends: a tile's last slice through the
        # workspace; every CTA of the last round otherwise (cluster slices all finish their rows)
        conv_ctas = self.mt * self.nt * self.split_k
        busy = self.mt * self.nt if self.split_fixup == "workspace" else min(conv_ctas, sms)
        # the padding that holds it to 2 is sized for the H100's shared memory: elsewhere 3
        self.apply_ctas = apply_ctas_per_sm(n * self.chunks, sms, busy) if self.wgmma else 3
        # workspace (eager, like any buffer)
        mk = lambda shape, dt: dop.empty(shape, dt, stream=stream)  # noqa: E731
        self.blob = dop.from_numpy(np.zeros(BLOB_BYTES, np.uint8), stream=stream)
        # split-K counters per tile, then the one-launch kernel's grid barrier (2 words)
        self.semaphore = dop.from_numpy(np.zeros(self.mt * self.nt + 2, np.int32), stream=stream)
        self.stats = mk([self.mt, self.nt, self.split_k * 4 * self.gs], "float32")
        self.y = None if inplace or self.one_launch else mk([n, h, w, k], y_dtype)
        # split-K slices meeting in the workspace leave their fp32 tiles here (the
        # semaphore counts them); in a cluster they add up in shared memory
        split_tiles = self.split_fixup == "workspace"
        self.partials = mk([self.mt * self.nt * self.split_k * t.tm * t.tn if split_tiles else 4], "float32")
        # The WGMMA conv launch reads w, and x where the tile is whole image rows, by TMA
        self.loads, self.tmaps = 0, None
        _need(not a_tma or self.wgmma, "a_tma=True needs the WGMMA kernel (sm_90, C % 64 == 0)", dop.LaunchError)
        if self.wgmma:
            rows_fit = t.a_box(h, w) is not None
            _need(not a_tma or rows_fit, f"a_tma=True: TMA loads a tile's rows of x as one box of whole image rows "
                                         f"(W={w} must divide the tile's {t.tm} rows and they H*W={hw}, or be a "
                                         "multiple of them); use a_tma=None", dop.ShapeError)
            self.loads = 2 if rows_fit and a_tma is not False else 1
            self.tmaps = self._tensor_maps(device)
        if not device.is_reference and not self.wgmma:   # CUTLASS's Params constructor, once, on one GPU thread
            (conv2d_params[y_dtype](self.blob.partition([BLOB_BYTES]), n, h, w, c, k, self.r, self.r, self.pad,
                                    self.split_k).generics(t.generics(y_dtype)).sync_on(stream or device.new_stream()))

    def _tensor_maps(self, device):
        """The WGMMA kernel's tensor-map workspace (conv_wgmma.cu, tensor_map): two
        templates -- x as [N, H, W, C] with a box of the tile's image rows x 64
        channels, w as [K, R*S*C] with a box of TN rows x 64 -- in the 128-byte
        swizzle, then two maps and two tags per CTA, filled in on the device.  The
        templates' address is a placeholder (any aligned device address): the
        kernel patches in x's and w's."""
        ctas = self.mt * self.nt * self.split_k
        raw = np.zeros(2 * TENSOR_MAP_BYTES * (1 + ctas) + 16 * ctas, np.uint8)
        if not device.is_reference:
            at = self.partials.data_ptr
            if self.loads == 2:
                rows, cols = self.tile.a_box(self.h, self.w)
                a = tensor_map("float16", at, [self.n, self.h, self.w, self.c], [1, rows, cols, 64])
                raw[:TENSOR_MAP_BYTES] = np.frombuffer(a, np.uint8)
            b = tensor_map("float16", at, [self.k, self.r * self.r * self.c], [self.tile.tn, 64])
            raw[TENSOR_MAP_BYTES:2 * TENSOR_MAP_BYTES] = np.frombuffer(b, np.uint8)
        return dop.from_numpy(raw, stream=self.stream)

    def __repr__(self) -> str:
        loads = {0: "", 1: ", B by TMA", 2: ", A and B by TMA"}[self.loads]
        return (f"ConvGnAct(N={self.n}, H={self.h}, W={self.w}, C={self.c}, K={self.k}, {self.r}x{self.r}, "
                f"groups={self.groups}, act={self.act}, tile={self.tile.name}, split_k={self.split_k}"
                f"{f' in a {self.split_fixup}' if self.split_fixup else ''}{loads}, "
                f"grid={self.mt}x{self.nt}x{self.split_k}, {'one launch' if self.one_launch else 'two launches'})")

    @property
    def blob_sizes(self) -> tuple[int, int]:
        """(sizeof(Params), sizeof(SharedStorage)) as CUTLASS reports them (GPU, CUTLASS tiles only)."""
        tail = self.blob.numpy()[-8:].view(np.int32)
        return int(tail[0]), int(tail[1])

    # -- checks before anything runs ------------------------------------------------
    def _check(self, out, x, w, bias, gamma, beta) -> None:
        n, h, wd, c, k, r = self.n, self.h, self.w, self.c, self.k, self.r
        for name, t in (("out", out), ("x", x), ("w", w), ("bias", bias), ("gamma", gamma), ("beta", beta)):
            _need(isinstance(t, dop.Tensor), f"{name} must be a deviceop Tensor, got {type(t).__name__}",
                  dop.LaunchError)
        want = {"out": self.out_dtype, "x": "float16", "w": "float16", "bias": self.y_dtype, "gamma": "float32",
                "beta": "float32"}
        for name, t in (("out", out), ("x", x), ("w", w), ("bias", bias), ("gamma", gamma), ("beta", beta)):
            _need(t.dtype.name == want[name], f"{name} must be {want[name]}, got {t.dtype.name}", dop.DTypeError)
        if x.shape != (n, h, wd, c):
            hint = " (it looks NCHW: pass channels-last, x.permute(0, 2, 3, 1))" if x.shape == (n, c, h, wd) else ""
            raise dop.ShapeError(f"x must be NHWC {[n, h, wd, c]}, got {list(x.shape)}{hint}")
        if w.shape != (k, r, r, c):
            hint = " (it looks KCRS: pass w.permute(0, 2, 3, 1))" if w.shape == (k, c, r, r) else ""
            raise dop.ShapeError(f"w must be KRSC {[k, r, r, c]}, got {list(w.shape)}{hint}")
        _need(out.shape == (n, h, wd, k), f"out must be NHWC {[n, h, wd, k]}, got {list(out.shape)}")
        for name, t in (("bias", bias), ("gamma", gamma), ("beta", beta)):
            _need(t.shape == (k,), f"{name} must have shape [{k}], got {list(t.shape)}")
        for name, t in (("out", out), ("x", x), ("w", w), ("bias", bias)):
            _need(t.is_contiguous, f"{name} must be contiguous (a dense NHWC/KRSC buffer); copy it first")
            _need(t.data_ptr % 16 == 0, f"{name} starts at an address that is not 16-byte aligned (0x{t.data_ptr:x}); "
                                        "the kernels use 16-byte accesses: pass a tensor that starts on a 16-byte "
                                        "boundary (a fresh allocation does)")
        _need(not out.overlaps(x), "out and x overlap; the conv reads x while the output is written: use another "
                                   "buffer", dop.AliasingError)

    # -- the ops ----------------------------------------------------------------------------
    def _conv_launch(self, y, x, w, bias, with_stats: int):
        t = self.tile
        if self.wgmma:
            workspace = self.split_fixup == "workspace"
            kernels = conv2d_gn_stats_wgmma_workspace if workspace else conv2d_gn_stats_wgmma
            return (kernels[self.y_dtype](
                self.stats.partition([1, 1, 4 * self.gs]), y, x, w, bias, self.tmaps, self.partials, self.semaphore,
                self.n, self.h, self.w, self.c, self.k, self.r, self.pad, self.cpg, self.gs, with_stats, int(workspace))
                .generics(t.generics(self.y_dtype, self.loads)))
        return (conv2d_gn_stats[self.y_dtype](self.stats.partition([1, 1, 4 * self.gs]), y, x, w, bias, self.blob,
                                              self.semaphore, self.hw, self.cpg, self.gs, with_stats)
                .generics(t.generics(self.y_dtype)))

    def __call__(self, out, x, w, bias, gamma, beta):
        """The lazy fused op (one or two launches); its value is ``out``."""
        self._check(out, x, w, bias, gamma, beta)
        t, n = self.tile, self.n
        if self.one_launch:   # cooperative: its CTAs wait for each other at a grid barrier
            return (conv2d_gn_act_wgmma[(self.y_dtype, self.out_dtype)](
                self.stats.partition([1, 1, 4 * self.gs]), out, x, w, bias, gamma, beta, self.partials,
                self.semaphore, self.tmaps, n, self.h, self.w, self.c, self.k, self.r, self.pad, self.cpg, self.gs,
                self.groups, self.eps, ACTS[self.act])
                .generics([_CUDA_TYPE[self.out_dtype], _CUDA_TYPE[self.y_dtype], t.tm, t.tn, t.stages, self.loads])
                .cooperative().map(lambda _: out))
        y = out if self.inplace else self.y
        scalars = (self.eps, self.hw, self.k, self.groups, t.tm, t.tn, self.nt, self.split_k, self.gs, self.rows_per)
        tiles = [1, 1, self.rows_per * self.k]
        conv = self._conv_launch(y, x, w, bias, 1)
        if self.inplace:
            apply = gn_act_apply_inplace[self.y_dtype](y.view([n, self.chunks, self.rows_per * self.k]).partition(tiles),
                                                       self.stats, gamma, beta, *scalars)
            apply = apply.generics([ACTS[self.act], _CUDA_TYPE[self.y_dtype], self.apply_ctas])
        else:
            z = out.view([n, self.chunks, self.rows_per * self.k])
            apply = gn_act_apply[(self.y_dtype, self.out_dtype)](z.partition(tiles), y, self.stats, gamma, beta,
                                                                  *scalars)
            apply = apply.generics([ACTS[self.act], _CUDA_TYPE[self.y_dtype], _CUDA_TYPE[self.out_dtype],
                                    self.apply_ctas])
        # PDL: the apply kernel's launch and its gamma/beta loads overlap the conv (which
        # triggers its dependents when it starts); it waits for the conv before reading y
        return dop.zip_(conv, apply.pdl()).map(lambda _: out)

    def conv(self, y, x, w, bias):
        """The bare convolution y = conv(x, w) + bias (launch 1 without statistics); value: ``y``."""
        _need(y.dtype.name == self.y_dtype and y.shape == (self.n, self.h, self.w, self.k),
              f"y must be {self.y_dtype} {[self.n, self.h, self.w, self.k]}, got {y.dtype.name} {list(y.shape)}")
        return self._conv_launch(y, x, w, bias, 0).map(lambda _: y)




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


def _add_f16_ref(g, out, a, b):
    out[...] = a.astype(np.float64) + b.astype(np.float64)


def _add_f16_check(g, out, a, b):
    t = out.tensor
    _need(out.tile_shape == (APPLY_THREADS * 8,), f"add_f16: partition out with [{APPLY_THREADS * 8}]")
    _need(a.shape == t.shape and b.shape == t.shape, f"add_f16: a {a.shape} and b {b.shape} must match out {t.shape}")
    for x in (t, a, b):
        _need(x.data_ptr % 16 == 0, "add_f16 uses 16-byte accesses: tensors must start 16-byte aligned")


# out = a + b in fp16 (the U-Net block's residual), 2048 elements per block
add_f16 = Kernel("add_f16", HERE / "gn_act.cu",
                 [Out("out", "float16", rank=1), In("a", "float16", rank=1), In("b", "float16", rank=1)],
                 block=APPLY_THREADS, reference=_add_f16_ref, validate=_add_f16_check)
