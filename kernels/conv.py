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

import importlib.util  # (tests reach importlib.util through this module)
import math
import numbers

import numpy as np

import deviceop as dop
from deviceop.runtime.tma import TENSOR_MAP_BYTES, tensor_map

from . import add_f16  # the U-Net block's residual add, declared beside the other small kernels
from ._checks import _need
from .conv_kernels import (APPLY_PAD_BYTES, APPLY_THREADS, BLOB_BYTES, CUTLASS_OPTIONS, MAX_CHANNELS,
                           HopperKernel, CutlassKernel, DTYPES, cluster_capacity, compile_all, conv2d_gn_act_wgmma,
                           conv2d_gn_stats, conv2d_gn_stats_wgmma, conv2d_gn_stats_wgmma_workspace, conv2d_params,
                           cutlass_include_dir, cutlass_include_dirs, gn_act_apply, gn_act_apply_inplace)
from .conv_reference import ACTS, activation_reference, conv2d_reference, conv_gn_act_reference
from .conv_tiles import (_CUDA_TYPE, MAX_SPLIT_K, SPLIT_FIXUPS, TILES, WGMMA_MAX_SPLIT_K, WGMMA_TILES,
                         Tile, WgmmaTile, _rows_per_chunk, apply_ctas_per_sm, choose_tile, choose_wgmma_tile,
                         ideal_cluster_capacity, tile_count, wgmma_cost_us, wgmma_fits)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _plan_ints(**sizes) -> tuple[int, ...]:
    """The plan's sizes as Python ints; a float, bool, string or None is refused naming it
    (it would fail later in a comparison, or pass as True == 1)."""
    for name, v in sizes.items():
        _need(_is_int(v), f"{name}={v!r} must be an int")
    return tuple(int(v) for v in sizes.values())


def _plan_eps(eps) -> float:
    """GroupNorm's eps as a float: a real number whose float32 (the kernels' type) is finite and
    positive -- 0, one that rounds to 0, a negative eps or NaN makes var + eps 0 or negative, so a
    constant group (zero-padded channels) normalizes to inf/NaN."""
    _need(isinstance(eps, numbers.Real) and not isinstance(eps, bool), f"eps={eps!r} must be a number (1e-5: "
                                                                      "GroupNorm's usual)")
    e32 = np.float32(eps) if math.isfinite(eps) and abs(eps) < 3.4e38 else np.float32("inf")
    _need(math.isfinite(e32) and e32 > 0, f"eps={eps!r} must be positive and finite in float32 (the kernels' type): "
                                          "var + eps is divided by; pass e.g. 1e-5")
    return float(eps)


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
        n, h, w, c, k, kernel_size, groups = _plan_ints(n=n, h=h, w=w, c=c, k=k, kernel_size=kernel_size,
                                                         groups=groups)
        eps = _plan_eps(eps)
        for name, v, allowed in (("inplace", inplace, (bool,)), ("one_launch", one_launch, (bool,)),
                                 ("a_tma", a_tma, (bool, type(None))), ("tile", tile, (str, type(None))),
                                 ("split_fixup", split_fixup, (str, type(None))), ("act", act, (str,))):
            _need(isinstance(v, allowed), f"{name}={v!r} must be "
                  f"{' or '.join('None' if t is type(None) else t.__name__ for t in allowed)}", dop.LaunchError)
        _need(split_k is None or (_is_int(split_k) and split_k >= 1), f"split_k={split_k!r} must be an int >= 1, or "
                                                                      "None for the cost model's choice",
              dop.LaunchError)
        _need(stream is None or isinstance(stream, dop.Stream), f"stream={stream!r} must be a deviceop Stream "
              "(device.new_stream()) or None for Device(0)'s", dop.LaunchError)
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
        # one_launch=True: the whole op as one cooperative launch (conv2d_gn_act_wgmma),
        # possible when the grid fits on the GPU at once (one CTA per SM).  Not the
        # default: it is no faster than conv + apply, whose PDL overlap hides the same
        # merge of partials (docs/conv.md has the measurements).
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
    def _check(self, out, x, w, bias, gamma=None, beta=None, out_name="out") -> None:
        """Every operand's type, dtype, shape, layout and alignment; ``plan.conv`` passes its y
        as ``out`` (of y's dtype) and no gamma/beta."""
        n, h, wd, c, k, r = self.n, self.h, self.w, self.c, self.k, self.r
        bare = out_name == "y"
        named = [(out_name, out), ("x", x), ("w", w), ("bias", bias)] + ([] if bare else [("gamma", gamma),
                                                                                          ("beta", beta)])
        for name, t in named:
            _need(isinstance(t, dop.Tensor), f"{name} must be a deviceop Tensor, got {type(t).__name__}",
                  dop.LaunchError)
        want = {out_name: self.y_dtype if bare else self.out_dtype, "x": "float16", "w": "float16",
                "bias": self.y_dtype, "gamma": "float32", "beta": "float32"}
        for name, t in named:
            _need(t.dtype.name == want[name], f"{name} must be {want[name]}, got {t.dtype.name}", dop.DTypeError)
        if x.shape != (n, h, wd, c):
            hint = (" (it looks NCHW: pass channels-last, in torch x.permute(0, 2, 3, 1).contiguous())"
                    if x.shape == (n, c, h, wd) else "")
            raise dop.ShapeError(f"x must be NHWC {[n, h, wd, c]}, got {list(x.shape)}{hint}")
        if w.shape != (k, r, r, c):
            hint = (" (it looks KCRS: pass, in torch, w.permute(0, 2, 3, 1).contiguous())"
                    if w.shape == (k, c, r, r) else "")
            raise dop.ShapeError(f"w must be KRSC {[k, r, r, c]}, got {list(w.shape)}{hint}")
        _need(out.shape == (n, h, wd, k), f"{out_name} must be NHWC {[n, h, wd, k]}, got {list(out.shape)}")
        for name, t in named[3:]:
            _need(t.shape == (k,), f"{name} must have shape [{k}], got {list(t.shape)}")
        for name, t in named[:4]:
            _need(t.is_contiguous, f"{name} must be contiguous (a dense NHWC/KRSC buffer); copy it first")
            _need(t.data_ptr % 16 == 0, f"{name} starts at an address that is not 16-byte aligned (0x{t.data_ptr:x}); "
                                        "the kernels use 16-byte accesses: pass a tensor that starts on a 16-byte "
                                        "boundary (a fresh allocation does)")
        _need(not out.overlaps(x), f"{out_name} and x overlap; the conv reads x while the output is written: use "
                                   "another buffer", dop.AliasingError)

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
        self._check(y, x, w, bias, out_name="y")   # the Params blob was built for this plan's shape
        return self._conv_launch(y, x, w, bias, 0).map(lambda _: y)


__all__ = ["ACTS", "APPLY_PAD_BYTES", "APPLY_THREADS", "BLOB_BYTES", "CUTLASS_OPTIONS", "ConvGnAct", "CutlassKernel",
           "DTYPES", "HopperKernel", "MAX_CHANNELS", "MAX_SPLIT_K", "SPLIT_FIXUPS", "TILES", "Tile",
           "WGMMA_MAX_SPLIT_K", "WGMMA_TILES", "WgmmaTile", "activation_reference", "add_f16", "apply_ctas_per_sm",
           "choose_tile", "choose_wgmma_tile", "cluster_capacity", "compile_all", "conv2d_gn_act_wgmma",
           "conv2d_gn_stats", "conv2d_gn_stats_wgmma", "conv2d_gn_stats_wgmma_workspace", "conv2d_params",
           "conv2d_reference", "conv_gn_act_reference", "cutlass_include_dir", "cutlass_include_dirs", "gn_act_apply",
           "gn_act_apply_inplace", "ideal_cluster_capacity", "importlib", "tile_count", "wgmma_cost_us", "wgmma_fits"]
