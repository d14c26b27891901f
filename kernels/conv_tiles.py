"""The fused conv's tile menus and cost models: which CUTLASS or WGMMA tile and
split-K a problem gets, and how the apply launch is cut.  Pure arithmetic (no
GPU): kernels/conv.py's plan asks these, bench/conv_gn_act.py sweeps them."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import deviceop as dop

from ._checks import _need


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


# The cost model behind choose_tile, in k-iterations of a 128x128 tile: smaller tiles
# reuse less of each load, CTAs sharing an SM slow each other, each extra split-K slice
# pays a serialized fix-up.  Its constants are the middle of the region that picks the
# H100 sweep's fastest configuration everywhere (docs/conv.md, "The cost models";
# tests/test_conv.py checks the picks against bench/results/conv_gn_act_tile_sweep.json).
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


# Two warpgroups (128 rows) share each B tile and keep more wgmma in flight, so they
# beat one wherever the image is large enough; 64x128 is for images of 64-127 pixels
# (docs/conv.md has the sweep).
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


# The WGMMA cost model, fitted to the same sweep: rounds x k-blocks per CTA x the tile's
# cost per k-block (us), plus the split-K fix-up, which comes in two kinds
# (conv_wgmma.cu): in a cluster per tile (a GPC holds whole clusters only, so rounds
# count clusters against those the GPU keeps resident, cluster_capacity) or through a
# global workspace (rounds count CTAs, but the last slice reads every slice's fp32
# tile back from L2).  docs/conv.md, "The cost models", has the measurements and the
# region of constants that picks the sweep's fastest everywhere.
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


# -- the apply launch's shape ------------------------------------------------------------

def _rows_per_chunk(hw: int, c: int, n: int, sms: int) -> int:
    """Rows of one image per apply CTA: a divisor of H*W (the output partition must
    divide), about 2 CTAs per SM in all, and at least 1024 elements of y per CTA
    (half its threads with a 16-byte vector).  docs/conv.md has the measurements."""
    want = max(1, math.ceil(n * hw / (2 * sms)))
    want = max(want, math.ceil(1024 / c))
    divisors = [d for d in range(1, hw + 1) if hw % d == 0]
    return min((d for d in divisors if d >= want), default=hw)


def apply_ctas_per_sm(apply_ctas: int, sms: int, busy_sms: int) -> int:
    """How many apply CTAs an SM may hold (gn_act.cu's CTAS), given the SMs that still
    run the conv's last CTAs when it ends (`busy_sms`; the others free up earlier).
    Under PDL the apply CTAs take the SMs the conv leaves and wait there, set up:
    3 a SM where that lets every one of them be waiting when the conv ends and 2 would
    not; else 2, which packs fewer of them on the SMs that free first.  (Measured on
    the H100, docs/conv.md: the rule is right at every U-Net shape but one.)"""
    free = max(0, sms - busy_sms)
    return 3 if 2 * free < apply_ctas <= 3 * free else 2
