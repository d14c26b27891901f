"""Tensor maps: the descriptors Hopper's TMA (tensor memory access) copies with.

A tensor map is 128 opaque bytes the driver encodes (``cuTensorMapEncodeTiled``):
a tensor's address, sizes and strides, the box one copy moves, and the layout the
box lands in shared memory (a swizzle).  Kernels read it from a kernel parameter
or from global memory; deviceop keeps them in global memory, so a kernel may patch
the address on the device (``tensormap.replace``) and no launch parameter changes.
"""
from __future__ import annotations

import struct

from cuda.bindings import driver as cu

from ..errors import LaunchError
from .driver import check

TENSOR_MAP_BYTES = 128

_SWIZZLE = {0: "CU_TENSOR_MAP_SWIZZLE_NONE", 32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B",
            128: "CU_TENSOR_MAP_SWIZZLE_128B"}
_DTYPE = {"float16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", "bfloat16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
          "float32": "CU_TENSOR_MAP_DATA_TYPE_FLOAT32"}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def tensor_map(dtype: str, address: int, shape, box, *, swizzle: int = 128) -> bytes:
    """The 128 bytes of a tensor map over a dense row-major tensor of ``shape``
    (outermost first, as NumPy) at ``address``: one copy moves a ``box`` of it (same
    order), laid out in shared memory in the given swizzle; coordinates outside the
    tensor read zeros (a convolution's padding comes for free)."""
    shape, box = [int(v) for v in shape], [int(v) for v in box]
    if dtype not in _DTYPE:
        raise LaunchError(f"tensor maps here take {', '.join(_DTYPE)}, not {dtype}")
    if swizzle not in _SWIZZLE:
        raise LaunchError(f"swizzle must be one of {sorted(_SWIZZLE)} bytes, got {swizzle}")
    if not 1 <= len(shape) <= 5 or len(box) != len(shape):
        raise LaunchError(f"a tensor map has 1-5 dimensions and a box of as many: shape {shape}, box {box}")
    item = _ITEMSIZE[dtype]
    if address % 16 or (shape[-1] * item) % 16:
        raise LaunchError(f"a tensor map needs a 16-byte aligned address and row pitch; got address 0x{address:x}, "
                          f"rows of {shape[-1] * item} bytes")
    if not all(1 <= b <= 256 for b in box) or (swizzle and box[-1] * item > swizzle):
        raise LaunchError(f"box {box} of a {dtype} tensor: each side is 1-256 elements (past the tensor's edge "
                          f"it reads zeros), and the box's rows ({box[-1] * item} bytes) fit the {swizzle}-byte "
                          "swizzle")
    dims = shape[::-1]                                   # the driver counts from the innermost dimension
    strides, pitch = [], item
    for d in dims[:-1]:
        pitch *= d
        strides.append(cu.cuuint64_t(pitch))
    rank = len(dims)
    tmap = check(cu.cuTensorMapEncodeTiled(
        getattr(cu.CUtensorMapDataType, _DTYPE[dtype]), rank, address, [cu.cuuint64_t(d) for d in dims], strides,
        [cu.cuuint32_t(b) for b in box[::-1]], [cu.cuuint32_t(1)] * rank,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, getattr(cu.CUtensorMapSwizzle, _SWIZZLE[swizzle]),
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return struct.pack("<16Q", *(int(v) for v in tmap.opaque))
