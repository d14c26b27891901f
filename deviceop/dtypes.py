"""Element types: one table that ties a deviceop dtype to its NumPy dtype, its
CUDA C++ spelling and how a scalar of it is packed into a kernel's arguments."""
from __future__ import annotations

import struct
from dataclasses import dataclass

import ml_dtypes  # registers bfloat16 with NumPy (and, through NumPy, with CuPy)
import numpy as np

from .errors import DTypeError


@dataclass(frozen=True, eq=False)
class DType:
    name: str          # "float32"
    np: np.dtype       # the NumPy dtype of an element
    ctype: str         # the CUDA C++ type of an element: "float", "__half" ...
    pack: str          # struct format of one scalar kernel argument
    kind: str          # "f" (floating), "i" (signed), "u" (unsigned), "b" (bool)

    @property
    def itemsize(self) -> int:
        return self.np.itemsize

    @property
    def bounds(self) -> tuple[int, int] | None:
        """``(min, max)`` of an integer type, else None."""
        if self.kind not in "iu":
            return None
        info = np.iinfo(self.np)
        return int(info.min), int(info.max)

    @property
    def is_floating(self) -> bool:
        return self.kind == "f"

    def __repr__(self) -> str:
        return f"dop.{self.name}"

    def scalar_bytes(self, value) -> bytes:
        """``value`` as the bytes of one kernel argument of this type."""
        return struct.pack(self.pack, self.coerce(value))

    def coerce(self, value):
        """Check that ``value`` is a scalar of this kind and return it in the
        form ``struct`` packs (``bfloat16``/``float16`` rounded here)."""
        if isinstance(value, (bool, np.bool_)) and self.kind != "b":
            raise DTypeError(f"got a bool for a {self.name} scalar; pass a number")
        if self.kind == "f":
            if not isinstance(value, (int, float, np.integer, np.floating)):
                raise DTypeError(f"expected a number for a {self.name} scalar, got {type(value).__name__}")
            if self.name == "bfloat16":
                return int(np.array(value, dtype=self.np).view(np.uint16))
            return float(value)
        if self.kind in "iu":
            if isinstance(value, (float, np.floating)):
                raise DTypeError(
                    f"got the float {value!r} for a {self.name} scalar; pass an int "
                    "(deviceop never truncates a float silently)")
            if not isinstance(value, (int, np.integer)):
                raise DTypeError(f"expected an int for a {self.name} scalar, got {type(value).__name__}")
            lo, hi = self.bounds
            if not lo <= int(value) <= hi:
                raise DTypeError(f"{value} does not fit in {self.name} [{lo}, {hi}]")
            return int(value)
        return bool(value)


float64 = DType("float64", np.dtype(np.float64), "double", "d", "f")
float32 = DType("float32", np.dtype(np.float32), "float", "f", "f")
float16 = DType("float16", np.dtype(np.float16), "__half", "e", "f")
bfloat16 = DType("bfloat16", np.dtype(ml_dtypes.bfloat16), "__nv_bfloat16", "H", "f")
int64 = DType("int64", np.dtype(np.int64), "long long", "q", "i")
int32 = DType("int32", np.dtype(np.int32), "int", "i", "i")
int16 = DType("int16", np.dtype(np.int16), "short", "h", "i")
int8 = DType("int8", np.dtype(np.int8), "signed char", "b", "i")
uint64 = DType("uint64", np.dtype(np.uint64), "unsigned long long", "Q", "u")
uint32 = DType("uint32", np.dtype(np.uint32), "unsigned int", "I", "u")
uint8 = DType("uint8", np.dtype(np.uint8), "unsigned char", "B", "u")
bool_ = DType("bool", np.dtype(np.bool_), "bool", "?", "b")

ALL = (float64, float32, float16, bfloat16, int64, int32, int16, int8, uint64, uint32, uint8, bool_)
_BY_NAME = {d.name: d for d in ALL}
_BY_NP = {d.np: d for d in ALL}


def dtype(spec) -> DType:
    """The deviceop dtype for ``spec``: a DType, a name ("float32", "bf16"),
    a NumPy dtype or scalar type, or a torch/CuPy dtype with a NumPy twin."""
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, str):
        name = {"f32": "float32", "f16": "float16", "half": "float16", "bf16": "bfloat16",
                "f64": "float64", "i32": "int32", "i64": "int64", "bool_": "bool"}.get(spec, spec)
        if name in _BY_NAME:
            return _BY_NAME[name]
        raise DTypeError(f"unknown dtype {spec!r}; known: {', '.join(_BY_NAME)}")
    try:
        npd = np.dtype(spec)
    except TypeError:
        raise DTypeError(f"cannot interpret {spec!r} as a dtype; known: {', '.join(_BY_NAME)}") from None
    if npd in _BY_NP:
        return _BY_NP[npd]
    raise DTypeError(f"dtype {npd} is not supported by deviceop; known: {', '.join(_BY_NAME)}")
