"""A kernel's parameters: role (output partition, input tensor, scalar), dtype,
rank and layout, and the check of one argument against its parameter."""
from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import DType, dtype as as_dtype
from ..errors import DTypeError, LaunchError, ShapeError
from ..tensor import Partition, SharedTensor, Tensor

LAYOUTS = ("dense", "strided")


@dataclass(frozen=True)
class Param:
    name: str
    role: str              # "out" | "in" | "scalar"
    dtype: DType
    rank: int | None = None
    # what the kernel assumes of a tensor's memory: "dense" (C-contiguous: the kernel
    # receives a bare pointer and indexes it row-major) or "strided" (any strides: a
    # kernel that takes the strides some other way, and reads them)
    layout: str = "dense"

    def describe(self) -> str:
        if self.role == "scalar":
            return f"{self.name}: {self.dtype.name}"
        rank = f", rank {self.rank}" if self.rank is not None else ""
        layout = f", {self.layout}" if self.layout != "dense" else ""
        return f"{self.name}: {'out ' if self.role == 'out' else ''}{self.dtype.name}{rank}{layout}"


def _tensor_param(name: str, role: str, dtype, rank, layout) -> Param:
    if layout not in LAYOUTS:
        raise LaunchError(f"parameter {name}: layout must be one of {', '.join(map(repr, LAYOUTS))}, "
                          f"got {layout!r}")
    return Param(name, role, as_dtype(dtype), rank, layout)


def Out(name: str, dtype, rank: int | None = None, layout: str = "dense") -> Param:
    """The output partition (always the first parameter).  ``layout="dense"`` (the
    default) refuses a tensor that is not C-contiguous; ``"strided"`` accepts any."""
    return _tensor_param(name, "out", dtype, rank, layout)


def In(name: str, dtype, rank: int | None = None, layout: str = "dense") -> Param:
    """An input tensor the kernel reads (``layout`` as for ``Out``)."""
    return _tensor_param(name, "in", dtype, rank, layout)


def Scalar(name: str, dtype) -> Param:
    return Param(name, "scalar", as_dtype(dtype))


def _generic_text(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str) and v:
        return v
    raise LaunchError(f"a generic is an int, a bool or a C++ type name, got {v!r}")




def _as_tensor_arg(v):
    return v.tensor if isinstance(v, SharedTensor) else v



def check_arg(kernel, p: Param, a) -> None:
    """Is ``a`` a valid value for parameter ``p`` (role, dtype, rank, layout)?"""
    k = kernel.name
    if p.role == "out":
        if not isinstance(a, Partition):
            hint = " (a plain tensor: pass tensor.partition(tile), or shared.try_partition(tile))" \
                if isinstance(a, (Tensor, SharedTensor)) else ""
            raise LaunchError(f"argument 0 ({p.name}) of {k} must be a Partition{hint}, got {type(a).__name__}")
        t = a.tensor
    elif p.role == "in":
        t = _as_tensor_arg(a)
        if not isinstance(t, Tensor):
            raise LaunchError(f"argument {p.name} of {k} must be a Tensor, got {type(a).__name__}")
    else:
        try:
            p.dtype.coerce(a)
        except DTypeError as exc:
            raise DTypeError(f"argument {p.name} of {k}: {exc}") from None
        return
    if t.dtype is not p.dtype:
        raise DTypeError(f"argument {p.name} of {k} must be {p.dtype.name}, got a {t.dtype.name} tensor")
    if p.rank is not None and t.ndim != p.rank:
        raise ShapeError(f"argument {p.name} of {k} must have rank {p.rank}, got shape {t.shape}; "
                         f"reshape it (e.g. .reshape(...)) first")
    if p.layout == "dense" and not t._contig:
        # the kernel gets a bare pointer and indexes it row-major: a reversed, broadcast (stride 0),
        # every-other-element or row-strided view would have it read the wrong elements, or past the end
        raise ShapeError(f"argument {p.name} of {k} must be dense (C-contiguous), got shape {t.shape} with "
                         f"strides {t.strides} (in elements); pass a contiguous copy: t.contiguous()")
