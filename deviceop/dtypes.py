"""Element types: one table that ties a deviceop dtype to its NumPy dtype, its
CUDA C++ spelling and how a scalar of it is packed into a kernel's arguments."""
from __future__ import annotations

import ctypes
import math
import operator
import struct
from dataclasses import dataclass

import ml_dtypes  # registers bfloat16 with NumPy (and, through NumPy, with CuPy)
import numpy as np

from .errors import DTypeError, ShapeError, StateError


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

    def __reduce__(self):  # one instance per dtype (checks compare by identity): a copy or an unpickled one is it
        return dtype, (self.name,)

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
            try:
                f = float(value)
                if self.name == "bfloat16":
                    bits = np.array(f, dtype=self.np)
                    if np.isinf(bits) and math.isfinite(f):
                        raise OverflowError
                    return int(bits.view(np.uint16))
                struct.pack("<" + self.pack, f)  # standard (not native) packing raises where f would become inf
            except OverflowError:
                wider = "" if self.name == "float64" else ", or declare the scalar float64"
                raise DTypeError(f"{_short(value)} does not fit in a {self.name} scalar (it would become inf); "
                                 f"pass a value within the type's range{wider}") from None
            return f
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
        if isinstance(value, (bool, np.bool_, int, np.integer)) and value in (0, 1):
            return bool(value)
        # bool(2) is True on the GPU while the reference computes with 2; bool("no") is True
        raise DTypeError(f"expected True or False for a bool scalar, got {value!r}")


    def from_host(self, host) -> np.ndarray:
        """``host`` (array-like) copied to a C-contiguous NumPy array of this dtype.  A value the
        conversion would change beyond rounding is refused, as ``coerce`` refuses a scalar:
        out of an integer type's range, a fraction or NaN into an integer type, a finite
        number that would become inf.  Arrays of another kind than numbers are refused."""
        host = np.asarray(host)
        if host.dtype == self.np:  # (reshape: ascontiguousarray makes a 0-d array 1-d)
            return np.ascontiguousarray(host).reshape(host.shape)
        src = _BY_NP.get(host.dtype)
        kind = src.kind if src is not None else host.dtype.kind
        if kind not in "biuf":
            raise DTypeError(f"from_numpy copies arrays of numbers (bool, int, float), not an array of {host.dtype}; "
                             f"convert it to numbers first (array.astype(...))")
        with np.errstate(over="ignore", invalid="ignore"):
            out = np.ascontiguousarray(host, dtype=self.np).reshape(host.shape)
        if host.size == 0 or self.kind == "b":
            return out
        if self.kind in "iu":
            self._check_whole(host, kind)
        elif not np.all(np.isfinite(out) | ~np.isfinite(host.astype(np.float64))):
            bad = host.reshape(-1)[np.flatnonzero(~np.isfinite(out.reshape(-1).astype(np.float64)))[0]]
            raise DTypeError(f"{_short(bad.item())} does not fit in {self.name} (it would become inf); "
                             f"{_CONVERT.format(self.np.name)}")
        return out

    def _check_whole(self, host, kind: str) -> None:
        """Refuse what an integer copy of ``host`` (of NumPy kind ``kind``) would change."""
        flat = host.reshape(-1)
        if kind == "f":
            wide = flat.astype(np.float64)
            finite = np.isfinite(wide)
            if not finite.all():
                raise DTypeError(f"{flat[np.flatnonzero(~finite)[0]].item()} has no {self.name} value; "
                                 f"{_CONVERT.format(self.np.name)}")
            whole = wide == np.floor(wide)
            if not whole.all():
                v = flat[np.flatnonzero(~whole)[0]].item()
                raise DTypeError(f"{v} is not a whole number: the copy to {self.name} would make it "
                                 f"{int(v)}; {_CONVERT.format(self.np.name)}")
        lo, hi = self.bounds
        for v in (flat.min().item(), flat.max().item()):  # Python numbers: compared exactly
            if not lo <= v <= hi:
                with np.errstate(over="ignore", invalid="ignore"):
                    became = np.array([v]).astype(self.np)[0].item()
                raise DTypeError(f"{_short(v)} does not fit in {self.name} [{lo}, {hi}]: the copy would make it "
                                 f"{became}; {_CONVERT.format(self.np.name)}")


_CONVERT = ("deviceop never changes a value silently: convert the array yourself if that is meant "
            "(array.astype(np.{})), or pick a dtype that holds it")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:8]}...{text[-4:]} ({len(text)} digits)"


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
    if spec is None:  # NumPy reads None as float64, torch as its default dtype: name one instead
        raise DTypeError(f"dtype None names no type (NumPy would read float64, torch float32); pass one, "
                         f"or leave the argument out for the default; known: {', '.join(_BY_NAME)}")
    if isinstance(spec, str):
        name = {"f32": "float32", "f16": "float16", "half": "float16", "bf16": "bfloat16",
                "f64": "float64", "i32": "int32", "i64": "int64", "bool_": "bool"}.get(spec, spec)
        if name in _BY_NAME:
            return _BY_NAME[name]
        try:  # NumPy's spellings, as CuPy takes them: "f4", "<f2", "float", "int"
            spec = np.dtype(spec)
        except TypeError:
            raise DTypeError(f"unknown dtype {spec!r}; known: {', '.join(_BY_NAME)}") from None
    try:
        npd = np.dtype(spec)
    except TypeError:
        raise DTypeError(f"cannot interpret {spec!r} as a dtype; known: {', '.join(_BY_NAME)}") from None
    if npd in _BY_NP:
        return _BY_NP[npd]
    if not npd.isnative and npd.newbyteorder("=") in _BY_NP:  # big-endian data (a file's): the same values
        return _BY_NP[npd.newbyteorder("=")]
    raise DTypeError(f"dtype {npd} is not supported by deviceop; known: {', '.join(_BY_NAME)}")


def host_array(obj, what: str) -> np.ndarray:
    """``np.asarray(obj)``, with NumPy's refusal of a ragged nested list a ShapeError."""
    try:
        return np.asarray(obj)
    except ValueError as exc:  # "setting an array element with a sequence ... inhomogeneous shape"
        raise ShapeError(f"{what}: {exc}; give a rectangular array (every row of one length)") from None


# -- DLPack -------------------------------------------------------------------------

# dlpack.h's DLDataTypeCode and bit widths -> deviceop dtypes
_DLPACK = {(0, 8): int8, (0, 16): int16, (0, 32): int32, (0, 64): int64, (1, 8): uint8, (1, 32): uint32,
           (1, 64): uint64, (2, 16): float16, (2, 32): float32, (2, 64): float64, (4, 16): bfloat16, (6, 8): bool_}
_DLPACK_CODES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat", 5: "complex", 6: "bool"}
_K_DL_UINT, _K_DL_BFLOAT = 1, 4
_DTYPE_OFFSET = 20  # of DLTensor.dtype: after void* data, DLDevice (2 x int32), int32 ndim
_VERSIONED_OFFSET = 32  # of DLManagedTensorVersioned.dl_tensor: after version, manager_ctx, deleter, flags


def from_dlpack_dtype(code: int, bits: int, lanes: int = 1) -> DType:
    """The deviceop dtype of a DLPack ``DLDataType`` (``kDLBfloat`` 16 is bfloat16)."""
    dt = _DLPACK.get((int(code), int(bits))) if lanes == 1 else None
    if dt is None:
        kind = _DLPACK_CODES.get(int(code), f"type code {code}")
        raise DTypeError(f"DLPack dtype {kind}{bits}{f' x{lanes} lanes' if lanes != 1 else ''} has no deviceop "
                         f"dtype; convert the array to one of {', '.join(_BY_NAME)} first")
    return dt


class _DLType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype, _capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


_FLAGS_OFFSET = 24  # of DLManagedTensorVersioned.flags: after version (2 x uint32), manager_ctx, deleter
_DLPACK_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY


_CAPSULES = (b"dltensor", b"dltensor_versioned")
_CONSUMED = (b"used_dltensor", b"used_dltensor_versioned")  # a consumer renames what it imported


class _CheckedExport:
    """A DLPack producer whose exports are checked before a consumer (NumPy, CuPy)
    reads them: a ``__dlpack__`` that returns no capsule, or one already consumed,
    is a deviceop error here rather than the consumer's raw ValueError.  Calls
    pass through, stream and version arguments included; ``read_only`` notes
    whether the producer flagged its export read-only (DLPack 1.0)."""

    def __init__(self, obj):
        self.obj, self.read_only = obj, False

    def __getattr__(self, name):
        return getattr(self.obj, name)

    def __dlpack_device__(self):
        device = self.obj.__dlpack_device__()
        try:
            kind, ordinal = (operator.index(v) for v in device)
        except (TypeError, ValueError):
            raise DTypeError(f"{type(self.obj).__name__}.__dlpack_device__() returned {device!r}, not DLPack's "
                             "(device type, device id) pair of ints; the producer is broken: export through "
                             "another framework, or copy host data with dop.from_numpy(array)") from None
        return kind, ordinal

    def __dlpack__(self, *args, **kwargs):
        capsule = self.obj.__dlpack__(*args, **kwargs)
        producer = f"{type(self.obj).__name__}.__dlpack__()"
        if type(capsule).__name__ != "PyCapsule":
            raise DTypeError(f"{producer} returned a {type(capsule).__name__}, not a DLPack capsule; the "
                             "producer is broken: export through another framework, or copy host data with "
                             "dop.from_numpy(array)")
        name = _capsule_name(capsule)
        if name in _CONSUMED:
            raise StateError(f"{producer} returned a DLPack capsule that was already consumed (a capsule is "
                             "imported once); the producer must make a fresh capsule on each __dlpack__() call: "
                             "pass the array itself to dop.from_dlpack, not a holder of one capsule")
        if name not in _CAPSULES:
            raise DTypeError(f"{producer} returned a capsule named {name!r}, not a DLPack tensor "
                             f"({_CAPSULES[0]!r} or {_CAPSULES[1]!r})")
        if name == b"dltensor_versioned":  # DLPack 1.0's read-only flag: only a versioned capsule carries it
            base = _capsule_pointer(capsule, name)
            self.read_only = bool(ctypes.c_uint64.from_address(base + _FLAGS_OFFSET).value & _DLPACK_READ_ONLY)
        return capsule


def producer_name(obj) -> str:
    """The type name of the array behind ``obj`` (a checked producer, or the array itself)."""
    return type(obj.obj if isinstance(obj, _CheckedExport) else obj).__name__


def dlpack_producer(obj) -> _CheckedExport:
    """``obj`` as a checked DLPack producer: it needs ``__dlpack__`` and ``__dlpack_device__``."""
    if type(obj).__name__ == "PyCapsule":
        raise DTypeError("dop.from_dlpack takes the array that exports DLPack, not a capsule it made (a capsule "
                         "carries no stream to order the import on): pass the array itself")
    if not callable(getattr(obj, "__dlpack__", None)):
        raise DTypeError(f"{type(obj).__name__!r} object has no __dlpack__, so dop.from_dlpack cannot view it as a "
                         "tensor; pass an array of a framework that exports DLPack (torch, CuPy, JAX ...), or copy "
                         "host data with dop.from_numpy(array)")
    if not callable(getattr(obj, "__dlpack_device__", None)):
        raise DTypeError(f"{type(obj).__name__} has __dlpack__ but no __dlpack_device__, which DLPack requires "
                         "(it says where the memory lives); copy host data with dop.from_numpy(array)")
    producer = _CheckedExport(obj)
    producer.__dlpack_device__()  # checked now: NumPy never asks, the GPU path does
    return producer


class _HostImport:
    """``obj``'s DLPack export as NumPy reads it: NumPy has no bfloat16, so a
    bfloat16 capsule is relabelled uint16 (same bits; the caller views the
    array as bfloat16 again).  The relabelled DLTensor is this export's own."""

    def __init__(self, obj):
        self.obj, self.dtype = obj, None

    def __dlpack_device__(self):
        return self.obj.__dlpack_device__()

    def __dlpack__(self, *args, **kwargs):
        capsule = self.obj.__dlpack__(*args, **kwargs)
        name = _capsule_name(capsule)
        if name in (b"dltensor", b"dltensor_versioned"):
            base = _capsule_pointer(capsule, name) + (_VERSIONED_OFFSET if name == b"dltensor_versioned" else 0)
            dt = _DLType.from_address(base + _DTYPE_OFFSET)
            self.dtype = (dt.code, dt.bits, dt.lanes)
            if self.dtype == (_K_DL_BFLOAT, 16, 1):
                dt.code = _K_DL_UINT
        return capsule


def host_array_from_dlpack(obj) -> np.ndarray:
    """``np.from_dlpack(obj)`` (zero-copy), bfloat16 included; an element type
    deviceop has no dtype for is a DTypeError naming it."""
    shim = _HostImport(obj)
    try:
        array = np.from_dlpack(shim)
    except (RuntimeError, BufferError, TypeError):
        if shim.dtype is not None:
            from_dlpack_dtype(*shim.dtype)  # raises for a type deviceop lacks, naming it
        raise
    return array.view(bfloat16.np) if shim.dtype == (_K_DL_BFLOAT, 16, 1) else array


def mark_read_only(capsule) -> bool:
    """Set DLPack 1.0's read-only flag on an export of read-only memory (a CuPy array, or a
    NumPy view made from a pointer, does not know the memory is); False for an unversioned
    capsule, which has no such flag."""
    name = _capsule_name(capsule)
    if name != b"dltensor_versioned":
        return False
    flags = ctypes.c_uint64.from_address(_capsule_pointer(capsule, name) + _FLAGS_OFFSET)
    flags.value |= _DLPACK_READ_ONLY
    return True


def host_dlpack(array: np.ndarray, kwargs: dict):
    """``array.__dlpack__(**kwargs)``, bfloat16 included: NumPy exports no bfloat16, so a
    bfloat16 array is exported as its uint16 bits and the capsule's DLTensor (this export's
    own) relabelled ``kDLBfloat`` 16, as a GPU array of bfloat16 is exported."""
    if array.dtype != bfloat16.np:
        return array.__dlpack__(**kwargs)
    capsule = array.view(np.uint16).__dlpack__(**kwargs)
    name = _capsule_name(capsule)
    base = _capsule_pointer(capsule, name) + (_VERSIONED_OFFSET if name == b"dltensor_versioned" else 0)
    _DLType.from_address(base + _DTYPE_OFFSET).code = _K_DL_BFLOAT
    return capsule
