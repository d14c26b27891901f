"""deviceop's kernel library: one ``.cu`` file and one declaration per kernel.

Built on deviceop's public API only.  Each kernel's NumPy reference is what
the reference device runs and what the tests hold the GPU to.  Every tensor
parameter is dense (the declaration's default layout): deviceop refuses a
strided view before any of these kernels sees it.  Shapes are declared in
terms of the generics (deviceop/kernel/signature.py), which deviceop checks
and, where they name every generic (``add``, ``affine``, ``load_row``,
``store_row``), infers: such a launch needs no ``.generics()``.  A scalar
that must agree with a shape is named by it (``rows``).  The ``_check``
functions say only what shapes cannot: divisibility, ranges, alignment.

* ``rms_norm<D, BS>(out [R, D] tile [1, D], x [R, D], w [D], eps)``
* ``matvec<BN, BK, K>(out [N] tile [BN], x [1, K], w [N, K])``: one warp per output row
* ``add<B>(out [N] tile [B], a [N], b [N])``
* ``matvec_batched<BN, BK, K, MB>(out [B, N] tile [MB, BN], x [B, K], w [N, K])``: rows = batch
* ``affine<B>(out [N] tile [B], x [N], alpha, beta)``: out = alpha * x + beta
* ``rms_matvec<BN, BK, K>(out [N] tile [BN], x [1, K], g [K], w [N, K], eps)``: RMSNorm folded into a matvec
* ``matvec_add<BN, BK, K>(out [N] tile [BN], x [1, K], w [N, K], residual [N])``: matvec + residual
  (both also ``_bf16``: bfloat16 weights, fp32 everything else; both PDL-ready: ``.pdl()``)
* ``add_f16(out [N] tile [2048], a [N], b [N])``: fp16 out = a + b (kernels/gn_act.cu)
* ``load_row<B>(out [D] tile [B], table [rows, D], index int32 [1], rows)``: out = table[index]
* ``store_row<B>(table [rows, D] tile [rows, B], x [D], index int32 [1], rows)``: table[index] = x
  (the row number is read on the device: a device loop's index, see ``dop.loop``; PDL-ready)
"""
from pathlib import Path

import numpy as np

from deviceop.kernel import In, Kernel, Out, Scalar

from ._checks import _aligned, _counts, _need

HERE = Path(__file__).resolve().parent


# -- rms_norm ------------------------------------------------------------------

def _rms_norm_ref(g, out, x, w, eps):
    x64 = x.astype(np.float64)
    out[...] = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps) * w.astype(np.float64)


def _rms_norm_check(g, out, x, w, eps):
    D, BS = g["D"], g["BS"]
    _need(BS % 32 == 0 and 32 <= BS <= 1024, f"rms_norm: BS={BS} must be a multiple of 32 in [32, 1024]")
    _need(D % (4 * BS) == 0, f"rms_norm: D={D} must be a multiple of 4*BS={4 * BS}")
    _aligned(out.tensor, x, w)


rms_norm = Kernel(  # one row per block
    "rms_norm", HERE / "rms_norm.cu",
    [Out("out", "float32", shape=("R", "D"), tile=(1, "D")), In("x", "float32", shape=("R", "D")),
     In("w", "float32", shape=("D",)), Scalar("eps", "float32")],
    generics=["D", "BS"], block=lambda g: g["BS"], reference=_rms_norm_ref, validate=_rms_norm_check)


# -- matvec --------------------------------------------------------------------

def _matvec_ref(g, out, x, w):
    out[...] = w[: out.shape[0]].astype(np.float64) @ x[0].astype(np.float64)


def _matvec_check(g, out, x, w):
    _counts("matvec", g, "BN", "BK", "K")
    BN, BK, K = g["BN"], g["BK"], g["K"]
    _need(K % (128 * BK) == 0, f"matvec: K={K} must be a multiple of 128*BK={128 * BK}")
    _need(1 <= BN <= 32, f"matvec: BN={BN} must be in [1, 32] (one warp per output row)")
    _aligned(out.tensor, x, w)


matvec = Kernel(
    "matvec", HERE / "matvec.cu",
    [Out("out", "float32", shape=("N",), tile=("BN",)), In("x", "float32", shape=(-1, "K")),
     In("w", "float32", shape=("N", "K"))],
    generics=["BN", "BK", "K"], block=lambda g: 32 * g["BN"], reference=_matvec_ref, validate=_matvec_check)


# -- add -------------------------------------------------------------------------

def _add_ref(g, out, a, b):
    out[...] = a.astype(np.float64) + b.astype(np.float64)


def _add_check(g, out, a, b):
    B = g["B"]
    _need(B % 128 == 0, f"add: B={B} must be a multiple of 128")
    _aligned(out.tensor, a, b)


add = Kernel(  # B is the output's tile: add(...) needs no .generics(), as in seed 001
    "add", HERE / "add.cu",
    [Out("out", "float32", shape=("N",), tile=("B",)), In("a", "float32", shape=("N",)),
     In("b", "float32", shape=("N",))],
    generics=["B"], block=lambda g: g["B"] // 4, reference=_add_ref, validate=_add_check)


# -- matvec_batched ----------------------------------------------------------------

def _matvec_batched_ref(g, out, x, w):
    out[...] = x.astype(np.float64) @ w.astype(np.float64).T


def _matvec_batched_check(g, out, x, w):
    _counts("matvec_batched", g, "BN", "BK", "K", "MB")
    BN, BK, K, MB = g["BN"], g["BK"], g["K"], g["MB"]
    _need(K % (128 * BK) == 0, f"matvec_batched: K={K} must be a multiple of 128*BK={128 * BK}")
    _need(1 <= BN <= 32 and 1 <= MB <= 16, f"matvec_batched: BN={BN} must be in [1, 32] and MB={MB} in [1, 16]")
    _aligned(out.tensor, x, w)


matvec_batched = Kernel(  # rows = batch
    "matvec_batched", HERE / "matvec_batched.cu",
    [Out("out", "float32", shape=("B", "N"), tile=("MB", "BN")), In("x", "float32", shape=("B", "K")),
     In("w", "float32", shape=("N", "K"))],
    generics=["BN", "BK", "K", "MB"], block=lambda g: 32 * g["BN"], reference=_matvec_batched_ref,
    validate=_matvec_batched_check)


def batch_tile(batch: int) -> int:
    """The MB (batch rows per tile) for a batch: the largest of 8, 4, 2, 1 dividing it."""
    return next(mb for mb in (8, 4, 2, 1) if batch % mb == 0)


# -- affine ----------------------------------------------------------------------

def _affine_ref(g, out, x, alpha, beta):
    out[...] = np.float64(alpha) * x.astype(np.float64) + np.float64(beta)


def _affine_check(g, out, x, alpha, beta):
    B = g["B"]
    _need(B % 128 == 0, f"affine: B={B} must be a multiple of 128")
    _aligned(out.tensor, x)


affine = Kernel(
    "affine", HERE / "affine.cu",
    [Out("out", "float32", shape=("N",), tile=("B",)), In("x", "float32", shape=("N",)),
     Scalar("alpha", "float32"), Scalar("beta", "float32")],
    generics=["B"], block=lambda g: g["B"] // 4, reference=_affine_ref, validate=_affine_check)


# -- fused layer kernels (kernels/fused.cu) ---------------------------------------

def _rms_matvec_ref(g, out, x, gamma, w, eps):
    x64 = x[0].astype(np.float64)
    out[...] = (w.astype(np.float64) @ (x64 * gamma.astype(np.float64))) / np.sqrt(np.mean(x64 * x64) + eps)


def _matvec_add_ref(g, out, x, w, residual):
    out[...] = residual.astype(np.float64) + w.astype(np.float64) @ x[0].astype(np.float64)


def _fused_check(name, per_load):
    def check(g, out, x, *rest):
        _counts(name, g, "BN", "BK", "K")
        BN, BK, K = g["BN"], g["BK"], g["K"]
        _need(K % (32 * BK * per_load) == 0, f"{name}: K={K} must be a multiple of 32*BK*{per_load}="
                                             f"{32 * BK * per_load}")
        _need(1 <= BN <= 32, f"{name}: BN={BN} must be in [1, 32] (one warp per output row)")
        _need(4 * (K + BN) <= 48 * 1024, f"{name}: K={K} does not fit the 48 KB shared-memory copy of x")
        _aligned(out.tensor, x, *[r for r in rest if hasattr(r, "shape")])
    return check


def _fused(name, entry, wdtype, per_load, norm):
    params = [Out("out", "float32", shape=("N",), tile=("BN",)), In("x", "float32", shape=(1, "K"))]
    params += [In("g", "float32", shape=("K",)), In("w", wdtype, shape=("N", "K")), Scalar("eps", "float32")] if norm \
        else [In("w", wdtype, shape=("N", "K")), In("residual", "float32", shape=("N",))]
    return Kernel(name, HERE / "fused.cu", params, entry=entry, generics=["BN", "BK", "K"],
                  block=lambda g: 32 * g["BN"], reference=_rms_matvec_ref if norm else _matvec_add_ref,
                  validate=_fused_check(name, per_load))


rms_matvec = _fused("rms_matvec", "rms_matvec_f32", "float32", 4, True)
rms_matvec_bf16 = _fused("rms_matvec_bf16", "rms_matvec_bf16", "bfloat16", 8, True)
matvec_add = _fused("matvec_add", "matvec_add_f32", "float32", 4, False)
matvec_add_bf16 = _fused("matvec_add_bf16", "matvec_add_bf16", "bfloat16", 8, False)



# -- rows addressed by a device-side index (kernels/rows.cu) -------------------------

def _row(index) -> int:
    return int(index[0])


def _load_row_ref(g, out, table, index, rows):
    r = _row(index)
    if 0 <= r < rows:
        out[...] = table[r]


def _store_row_ref(g, table, x, index, rows):
    r = _row(index)
    if 0 <= r < rows:
        table[r] = x


def _rows_check(name, load):
    def check(g, out, a, index, rows):
        B = g["B"]
        table, vec = (a, out.tensor) if load else (out.tensor, a)
        _need(B % 128 == 0 and B <= 4096, f"{name}: B={B} must be a multiple of 128, at most 4096")
        _aligned(table, vec)
    return check


load_row = Kernel(
    "load_row", HERE / "rows.cu",
    [Out("out", "float32", shape=("D",), tile=("B",)), In("table", "float32", shape=("rows", "D")),
     In("index", "int32", rank=1), Scalar("rows", "int32")],
    generics=["B"], block=lambda g: g["B"] // 4, reference=_load_row_ref, validate=_rows_check("load_row", True))

store_row = Kernel(
    "store_row", HERE / "rows.cu",
    [Out("table", "float32", shape=("rows", "D"), tile=("rows", "B")), In("x", "float32", shape=("D",)),
     In("index", "int32", rank=1), Scalar("rows", "int32")],
    generics=["B"], block=lambda g: g["B"] // 4, reference=_store_row_ref, validate=_rows_check("store_row", False))


# -- add_f16 (kernels/gn_act.cu) ------------------------------------------------------

def _add_f16_ref(g, out, a, b):
    out[...] = a.astype(np.float64) + b.astype(np.float64)


# out = a + b in fp16 (the U-Net block's residual): 256 threads of 8 halves, 2048 elements a block
add_f16 = Kernel(
    "add_f16", HERE / "gn_act.cu",
    [Out("out", "float16", shape=("N",), tile=(2048,)), In("a", "float16", shape=("N",)),
     In("b", "float16", shape=("N",))],
    block=256, reference=_add_f16_ref, validate=lambda g, out, a, b: _aligned(out.tensor, a, b, who="add_f16 uses"))

__all__ = ["rms_norm", "matvec", "add", "matvec_batched", "batch_tile", "affine", "add_f16",
           "rms_matvec", "rms_matvec_bf16", "matvec_add", "matvec_add_bf16", "load_row", "store_row"]
