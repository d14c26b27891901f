"""A kernel's parameters as the driver sees them: pointer and scalar specs, the
byte layout of the parameter buffer, the launch shape (``LaunchConfig``), and
``ParamLayout``, which packs arguments into that buffer: the one place
parameters are packed, whether by an eager launch (its generated launcher uses
the layout's struct), a prepared launch, a captured node or a node update."""
from __future__ import annotations

import ctypes
import operator
import struct

import numpy as np

from cuda.bindings import driver as cu

from ..dtypes import dtype as as_dtype
from ..errors import DTypeError, LaunchError


class ptr:
    """A device-pointer kernel parameter; ``ptr("float32")`` also checks the tensor's dtype."""

    __slots__ = ("dtype",)

    def __init__(self, dtype=None):
        self.dtype = None if dtype is None else as_dtype(dtype)

    def __repr__(self) -> str:
        return "ptr" if self.dtype is None else f"ptr({self.dtype.name})"

    def __eq__(self, other):
        return isinstance(other, ptr) and other.dtype == self.dtype

    def __hash__(self):
        return hash(("ptr", self.dtype))


class null_ptr(ptr):
    """A pointer parameter every launch passes as NULL, which is not an argument: the
    trailing scratch pointers a Triton kernel takes (its launcher passes NULL when the
    kernel needs no scratch).  Only at the end of a signature."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "null_ptr"

    def __eq__(self, other):
        return isinstance(other, null_ptr)

    def __hash__(self):
        return hash("null_ptr")


def _normalize_param(spec):
    if spec is ptr:
        return ptr()
    if isinstance(spec, ptr):
        return spec
    if isinstance(spec, str) and spec in ("ptr", "pointer", "void*"):
        return ptr()
    try:
        return as_dtype(spec)
    except DTypeError:
        raise LaunchError(f"cannot read kernel parameter spec {spec!r}: use ptr, ptr(dtype) or a dtype") from None


def _dims(value, what: str) -> tuple[int, int, int]:
    """``value`` (an int or 1 to 3 of them; NumPy ints too, never a bool or a float) as 3 ints >= 1."""
    dims = []
    for d in value if isinstance(value, (tuple, list)) else (value,):
        try:
            n = -1 if isinstance(d, (bool, np.bool_)) else operator.index(d)
        except TypeError:
            n = -1
        dims.append(n)
    if not 1 <= len(dims) <= 3 or min(dims) < 1:
        raise LaunchError(f"{what} must be 1 to 3 positive ints, got {value!r}")
    return tuple(dims) + (1,) * (3 - len(dims))


_MISSING = object()  # an argument the caller did not pass


def _as_config(config) -> "LaunchConfig":
    if isinstance(config, tuple) and len(config) in (2, 3):
        return LaunchConfig(*config)
    raise LaunchError(f"expected a LaunchConfig or a (grid, block[, shared_mem]) tuple, got {config!r}")


class LaunchConfig:
    """Grid, block, dynamic shared memory and thread-block cluster of a launch, validated once.

    ``cluster`` (1 to 3 ints dividing the grid, at most 8 CTAs) groups the grid's
    CTAs into clusters the hardware schedules together on one GPC, so they may
    read each other's shared memory and wait at a cluster barrier (sm_90+); None
    (the default) launches without clusters."""

    __slots__ = ("grid", "block", "shared_mem", "cluster")

    def __init__(self, grid, block, shared_mem: int = 0, cluster=None):
        self.grid = _dims(grid, "grid")
        self.block = _dims(block, "block")
        threads = self.block[0] * self.block[1] * self.block[2]
        if threads > 1024:
            raise LaunchError(f"block {block} has {threads} threads; CUDA allows at most 1024 per block")
        if self.block[2] > 64:  # the driver refuses it (CUDA_ERROR_INVALID_VALUE): refused here on every device
            raise LaunchError(f"block {block} has {self.block[2]} threads along z; CUDA allows at most 64 there "
                              "(1024 along x and y): make x or y the long axis")
        if self.grid[1] > 65535 or self.grid[2] > 65535 or self.grid[0] > 2**31 - 1:
            raise LaunchError(f"grid {grid} exceeds CUDA's limits (x < 2^31, y and z <= 65535)")
        try:
            smem = -1 if isinstance(shared_mem, (bool, np.bool_)) else operator.index(shared_mem)
        except TypeError:
            smem = -1
        if smem < 0:
            raise LaunchError(f"shared_mem must be a non-negative int, got {shared_mem!r}")
        self.shared_mem = smem
        self.cluster = None
        if cluster is not None:
            dims = _dims(cluster, "cluster")
            if any(g % c for g, c in zip(self.grid, dims)):
                raise LaunchError(f"cluster {dims} does not divide grid {self.grid}: every cluster must be whole")
            if dims[0] * dims[1] * dims[2] > 8:
                raise LaunchError(f"cluster {dims} has {dims[0] * dims[1] * dims[2]} CTAs; at most 8 are portable "
                                  "across GPUs: use a smaller cluster")
            self.cluster = None if dims == (1, 1, 1) else dims

    def __repr__(self) -> str:
        tail = f", cluster={self.cluster}" if self.cluster else ""
        return f"LaunchConfig(grid={self.grid}, block={self.block}, shared_mem={self.shared_mem}{tail})"


def param_offsets(signature) -> list[int]:
    """The byte offset of each parameter of ``signature`` (normalized: ptr or DType)
    in the kernel's parameter buffer, under C alignment rules."""
    offsets = []
    for i, spec in enumerate(signature):
        prefix = "@" + "".join("P" if isinstance(s, ptr) else s.pack for s in signature[:i])
        align = "P" if isinstance(spec, ptr) else spec.pack
        offsets.append(struct.calcsize(prefix + "0" + align))
    return offsets


def check_param_layout(name: str, signature, actual, offsets=None) -> None:
    """Refuse a declared ``signature`` that disagrees with the kernel's own parameter
    layout ``actual`` (``(offset, size)`` per parameter: cuFuncGetParamInfo of the
    loaded kernel on a GPU, the CUBIN's records on the reference device): the one
    rule for both, so a declaration that would corrupt a launch fails everywhere."""
    signature = tuple(_normalize_param(s) for s in signature)
    offsets = param_offsets(signature) if offsets is None else offsets
    declared = [(o, 8 if isinstance(s, ptr) else s.itemsize) for o, s in zip(offsets, signature)]
    actual = [tuple(a) for a in actual]
    if len(actual) != len(declared):
        raise LaunchError(f"kernel {name} takes {len(actual)} parameters but its declared "
                          f"signature has {len(declared)}: {list(signature)}")
    for i, (a, d) in enumerate(zip(actual, declared)):
        if a != d:
            raise LaunchError(f"parameter {i} of kernel {name} is {a[1]} bytes at offset {a[0]}, "
                              f"but the signature declares {signature[i]!r} ({d[1]} bytes at {d[0]})")


def pointer_of(value, spec: ptr, index: int, name: str) -> int:
    """The device address a pointer parameter receives for ``value``."""
    addr = getattr(value, "_ptr", None)  # deviceop Tensor: cached at construction
    if addr is not None:
        if spec.dtype is not None and value.dtype is not spec.dtype:
            raise DTypeError(f"argument {index} of {name} must be a {spec.dtype.name} tensor, "
                             f"got {value.dtype.name}")
        return addr
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if value is None:
        return 0
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is not None:
        return cai["data"][0]
    raise LaunchError(f"argument {index} of {name} is a device pointer: pass a deviceop Tensor, an "
                      f"object with __cuda_array_interface__, or an int address; got {type(value).__name__}")


class ParamLayout:
    """A kernel's parameter list and the bytes a launch passes for it: each
    parameter's offset, ``pack(*args)`` (checked like a launch) and fresh
    parameter buffers.  What a CUDA :class:`Function` and the reference
    device's function have in common."""

    def __init__(self, name: str, signature):
        self.name = name
        # the kernel's whole parameter list; the arguments are all but its trailing null_ptrs,
        # which stay zero (NULL): every buffer is made zeroed and packs only the arguments
        self.full_signature = tuple(_normalize_param(s) for s in signature)
        hidden = 0
        while hidden < len(self.full_signature) and type(self.full_signature[-1 - hidden]) is null_ptr:
            hidden += 1
        self.signature = self.full_signature[:len(self.full_signature) - hidden]
        if any(type(s) is null_ptr for s in self.signature):
            raise LaunchError(f"{name}: a null_ptr parameter comes only after every argument, at the end of the "
                              f"signature: {list(self.full_signature)}")
        fmt = "@" + "".join("P" if isinstance(s, ptr) else s.pack for s in self.signature)
        self._all_offsets = tuple(param_offsets(self.full_signature))
        self.offsets = self._all_offsets[:len(self.signature)]  # byte offset of each argument in the buffer
        self._struct = struct.Struct(fmt)
        # the buffer's size: the arguments' struct, and the NULL pointers after them
        self._size = struct.calcsize("@" + "".join("P" if isinstance(s, ptr) else s.pack
                                                   for s in self.full_signature))
        # each scalar's own packer, pack_into(buffer, offset, value): what a node update packs
        self.scalar_packers = tuple(None if isinstance(s, ptr) else struct.Struct("@" + s.pack).pack_into
                                    for s in self.signature)

    def param_buffer(self):
        """A fresh parameter buffer for this signature: ``(buffer, void** address)``
        (what a graph kernel node's ``kernelParams`` points at)."""
        buf = ctypes.create_string_buffer(max(self._size, 1))
        base = ctypes.addressof(buf)
        ptrs = (ctypes.c_void_p * max(len(self._all_offsets), 1))(*[base + o for o in self._all_offsets])
        return buf, ptrs

    def pack(self, *args) -> bytes:
        """The parameter bytes a launch with ``args`` would pass (checked like a launch)."""
        if len(args) != len(self.signature):
            self._arity_error(len(args))
        values = [self._slow_pointer(a, i) if isinstance(s, ptr) else self._slow_scalar(a, i)
                  for i, (a, s) in enumerate(zip(args, self.signature))]
        return self._struct.pack(*values)

    def pack_scalar(self, buffer, index: int, value) -> None:
        """Pack scalar argument ``index`` (already coerced to its type) into ``buffer``;
        raises struct.error or OverflowError for a value the C type cannot hold."""
        self.scalar_packers[index](buffer, self.offsets[index], value)

    def _slow_pointer(self, value, index: int) -> int:
        return pointer_of(value, self.signature[index], index, self.name)

    def _slow_scalar(self, value, index: int):
        try:
            return self.signature[index].coerce(value)
        except DTypeError as exc:
            raise DTypeError(f"argument {index} of {self.name}: {exc}") from None

    def _arity_error_of(self, args):
        self._arity_error(sum(a is not _MISSING for a in args))

    def _arity_error(self, got: int):
        raise LaunchError(f"{self.name} takes {len(self.signature)} arguments "
                          f"({', '.join(map(repr, self.signature))}), got {got}")

    def node_params(self, config: "LaunchConfig", ptrs):
        """The kernel-node parameters of a captured launch of this function with
        ``config`` whose parameter pointers are ``ptrs`` (cuGraphExecKernelNodeSetParams)."""
        p = cu.CUDA_KERNEL_NODE_PARAMS()
        p.func = self.handle
        p.gridDimX, p.gridDimY, p.gridDimZ = config.grid
        p.blockDimX, p.blockDimY, p.blockDimZ = config.block
        p.sharedMemBytes = config.shared_mem
        p.kernelParams = ctypes.addressof(ptrs)
        return p
