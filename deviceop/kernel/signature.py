"""A kernel's typed signature: each parameter's role (output partition, in-out
tensor, input tensor, scalar: any number of outputs and in-outs, at any
position, as the kernel's author wrote it), dtype, layout, and shape in terms
of the kernel's generics, as cuTile writes ``out: &mut Tensor<f32, {[B]}>``,
``x: &Tensor<f32, {[-1, K]}>``::

    Out("out", "float32", tile=("B",))          # the output's tile is [B]
    In("x", "float32", shape=(-1, "K"))         # any rows, K columns
    In("w", "float32", shape=("N", "K"))        # N: a size the arguments must agree on

A dimension is an int (exactly that), -1 (any) or a name: a generic of the
kernel, or a size shared by the parameters that name it.  ``bind`` checks a
launch's arguments against them, infers the generics they determine and checks
the ones given, naming the parameter, the generic and the two values.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..dtypes import DType, dtype as as_dtype
from ..errors import DeviceOpError, DTypeError, LaunchError, ShapeError
from ..memory import read_only_error
from ..tensor import Partition, SharedTensor, Tensor

LAYOUTS = ("dense", "strided")
WRITTEN = ("out", "inout")  # the roles of the parameters a kernel writes


@dataclass(frozen=True)
class Param:
    name: str
    role: str              # "out" | "inout" | "in" | "scalar"
    dtype: DType
    rank: int | None = None
    # what the kernel assumes of a tensor's memory: "dense" (C-contiguous: the kernel
    # receives a bare pointer and indexes it row-major) or "strided" (any strides: a
    # kernel that takes the strides some other way, and reads them)
    layout: str = "dense"
    shape: tuple | None = None  # the tensor's dimensions (see the module docstring)
    tile: tuple | None = None   # an output's tile, likewise

    def describe(self) -> str:
        if self.role == "scalar":
            return f"{self.name}: {self.dtype.name}"
        dims = f" {_dims_text(self.shape)}" if self.shape is not None else ""
        dims += f" tile {_dims_text(self.tile)}" if self.tile is not None else ""
        rank = f", rank {self.rank}" if self.rank is not None and not dims else ""
        layout = f", {self.layout}" if self.layout != "dense" else ""
        role = f"{self.role} " if self.role in WRITTEN else ""
        return f"{self.name}: {role}{self.dtype.name}{dims}{rank}{layout}"

    @property
    def writes(self) -> bool:
        """Does the kernel write this parameter (an Out or an InOut)?"""
        return self.role in WRITTEN


def _dims_text(dims) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"


def _dims(name: str, what: str, dims) -> tuple | None:
    if dims is None:
        return None
    dims = tuple(dims)
    for d in dims:
        if not (isinstance(d, str) and d.isidentifier()) and not (type(d) is int and d >= -1):
            raise LaunchError(f"parameter {name}: each dimension of its {what} is an int, -1 (any) or the name "
                              f"of a generic or size, got {d!r} in {dims}")
    return dims


def _tensor_param(name: str, role: str, dtype, rank, layout, shape=None, tile=None) -> Param:
    if layout not in LAYOUTS:
        raise LaunchError(f"parameter {name}: layout must be one of {', '.join(map(repr, LAYOUTS))}, "
                          f"got {layout!r}")
    shape, tile = _dims(name, "shape", shape), _dims(name, "tile", tile)
    for dims in (shape, tile):
        if dims is not None:
            if rank is not None and rank != len(dims):
                raise LaunchError(f"parameter {name}: rank={rank} but {_dims_text(dims)} has {len(dims)} "
                                  "dimensions; give one of them")
            rank = len(dims)
    return Param(name, role, as_dtype(dtype), rank, layout, shape, tile)


def Out(name: str, dtype, rank: int | None = None, layout: str = "dense", *, shape=None, tile=None) -> Param:
    """An output partition: a buffer the kernel writes, cut into tiles; the first
    Out of a signature (at any position) gives the launch grid, its tiles per axis.
    ``layout="dense"`` (the default) refuses a tensor that is not C-contiguous;
    ``"strided"`` accepts any.  ``shape`` and ``tile`` declare its dimensions and
    its tile's (module docstring)."""
    return _tensor_param(name, "out", dtype, rank, layout, shape, tile)


def InOut(name: str, dtype, rank: int | None = None, layout: str = "dense", *, shape=None) -> Param:
    """A tensor the kernel reads and writes (a KV cache it appends to, an error word it
    ORs into): a Tensor (a mutable borrow its caller vouches for, as ``tensor.partition``
    is) or a SharedTensor held alone (else OwnershipError); no other argument may
    overlap it.  ``layout`` and ``shape`` as for ``In``."""
    return _tensor_param(name, "inout", dtype, rank, layout, shape)


def In(name: str, dtype, rank: int | None = None, layout: str = "dense", *, shape=None) -> Param:
    """An input tensor the kernel reads (``layout`` and ``shape`` as for ``Out``)."""
    return _tensor_param(name, "in", dtype, rank, layout, shape)


def Scalar(name: str, dtype) -> Param:
    return Param(name, "scalar", as_dtype(dtype))


def inferable(params, generic_names) -> bool:
    """Do the parameters' shapes name every generic (so a launch may omit ``.generics()``)?"""
    named = {d for p in params for dims in (p.shape, p.tile) if dims for d in dims if isinstance(d, str)}
    return all(g in named for g in generic_names)


def bind(kernel, values, launch_args, gen) -> tuple:
    """Check the arguments' dimensions against the declared shapes and tiles; return
    the generics (``gen``, checked, or inferred when None)."""
    given = dict(zip(kernel.generic_names, gen)) if gen is not None else {}
    bound = {}  # name -> (value, where it came from)

    def check(p, what, dims, actual):
        for axis, (d, n) in enumerate(zip(dims, actual)):
            if d == -1:
                continue
            if type(d) is int:
                expected, source = d, "the declaration"
            elif d in given:
                expected, source = given[d], ".generics()"
            elif d in bound:
                expected, source = bound[d]
            else:
                bound[d] = (n, f"{p.name}'s {what}")
                continue
            if n != expected:
                raise _mismatch(kernel, p, what, dims, actual, axis, expected, source, given, bound)

    for p, a, t in zip(kernel.params, values, launch_args):
        if p.shape is not None:
            check(p, "shape", p.shape, t.shape)
        if p.tile is not None:
            check(p, "tile", p.tile, a.tile_shape)
    if gen is not None:
        return gen
    missing = [g for g in kernel.generic_names if g not in bound]
    if missing:  # pragma: no cover - refused before any check when the shapes cannot name them all
        raise LaunchError(f"{kernel.name} needs generics <{', '.join(kernel.generic_names)}>: call .generics([...])")
    return tuple(bound[g][0] for g in kernel.generic_names)


def _mismatch(kernel, p, what, dims, actual, axis, expected, source, given, bound) -> ShapeError:
    """The error of ``p``'s ``what`` disagreeing with ``expected`` on ``axis``."""
    fits = [n if d == -1 or (isinstance(d, str) and d not in given and d not in bound) else
            d if type(d) is int else given[d] if d in given else bound[d][0] for d, n in zip(dims, actual)]
    fits[axis] = expected
    d = dims[axis]
    head = f"{kernel.name}<{d}={expected}>" if isinstance(d, str) else kernel.name
    why = (f"axis {axis} is {d}: {expected} from {source}, {actual[axis]} here" if isinstance(d, str)
           else f"axis {axis} must be {d}")
    if what == "tile":
        return ShapeError(f"{head}: partition {p.name} with {_dims_text(fits)}, not {_dims_text(actual)} "
                          f"({p.name}'s tile {why})")
    return ShapeError(f"{head}: argument {p.name} has shape {_dims_text(actual)}, but its {why}; "
                      f"pass a {p.name} of shape {_dims_text(fits)}")


def _generic_text(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str) and v:
        return v
    raise LaunchError(f"a generic is an int, a bool or a C++ type name, got {v!r}")


# a C++ numeric literal (no identifier starts with a digit): "128", " -4 ", "1.5", "0x80"
_NUMERIC = re.compile(r"\s*[-+]?\.?\d[\w.']*\s*")


def _as_int(v):
    """``v`` as the int it spells (a NumPy int, a numeric string), else ``v``: for the fix an error shows."""
    try:
        return int(v.strip(), 0) if isinstance(v, str) else int(v) if isinstance(v, np.integer) else v
    except ValueError:
        return v


def check_generics(kernel, values, fix: str) -> tuple:
    """``values`` as ``kernel``'s generics: a list with an int (NumPy ints too), a bool
    or a C++ type name for each.  A number spelled as a string is refused: the
    kernel's rules would compute with the string.  ``fix`` spells, with a ``{}``
    for the list, how the caller passes generics (``.generics({})``)."""
    names = ", ".join(kernel.generic_names)
    try:  # a dict would pass its keys, a string its characters
        given = None if isinstance(values, (str, bytes, Mapping)) else tuple(values)
    except TypeError:
        given = None
    if given is None:
        one = _as_int(values)
        shown = [one] if len(kernel.generic_names) == 1 and type(one) is int else f"[{names}]"
        raise LaunchError(f"{kernel.name} takes its generics <{names}> as a list, in that order, got {values!r}: "
                          "write " + fix.format(shown))
    if len(given) != len(kernel.generic_names):
        raise LaunchError(f"{kernel.name} takes {len(kernel.generic_names)} generics <{names}>, got "
                          f"{len(given)}: {list(given)}")
    if all(type(v) is int for v in given):  # the common case, on every .generics() call
        return given
    checked = []
    for name, v in zip(kernel.generic_names, given):
        if isinstance(v, (np.integer, np.bool_)):
            v = v.item()
        if isinstance(v, str) and _NUMERIC.fullmatch(v):
            raise LaunchError(f"generic {name} of {kernel.name} is the string {v!r}: a number is given as an int, "
                              f"{fix.format([_as_int(g) for g in given])} (a string is a C++ type name, e.g. 'float')")
        _generic_text(v)
        checked.append(v)
    return tuple(checked)


def run_rule(kernel, rule, generics: tuple, *args):
    """``rule(*args)``: a kernel's own check or launch-shape function, whose Python
    errors (a string where it computes with a number: ``"float" % 32``) become a
    LaunchError naming the generics; its deviceop errors pass through."""
    try:
        return rule(*args)
    except DeviceOpError:
        raise
    except (TypeError, ValueError, ArithmeticError, AttributeError, LookupError) as exc:
        shown = ", ".join(f"{n}={v!r}" for n, v in zip(kernel.generic_names, generics))
        raise LaunchError(f"{kernel.name}'s rules failed on generics <{shown}>: {type(exc).__name__}: {exc}; give "
                          "each generic the kind the kernel's docstring names: ints for sizes and counts, strings "
                          "for C++ types") from exc




def _as_tensor_arg(v):
    return v.tensor if isinstance(v, SharedTensor) else v


def _not_a_tensor_hint(a) -> str:
    """What to pass instead of ``a``, where a tensor was expected."""
    if isinstance(a, tuple):
        return (" (a kernel launch's value is the tuple of all its arguments: pass its output tensor, "
                "launch.first().unpartition())")
    if hasattr(a, "__array_interface__"):
        return " (a host array: copy it to the device with dop.from_numpy(array))"
    return ""

def writable_arg(kernel, p: Param, a) -> Tensor:
    """The tensor an InOut argument ``a`` gives the kernel to read and write: a Tensor,
    or a SharedTensor only while nothing else can reach its buffer (checked at every
    launch: such a launch has no launch key, see plan.py)."""
    if isinstance(a, SharedTensor):
        return a.check_writable(f"{kernel.name} writes {p.name}")
    if isinstance(a, Tensor):
        return a
    hint = (" (an in-out argument is the whole tensor the kernel reads and writes: pass partition.tensor)"
            if isinstance(a, Partition) else _not_a_tensor_hint(a))
    raise LaunchError(f"argument {p.name} of {kernel.name} (read and written) must be a Tensor, or a SharedTensor "
                      f"held alone, got {type(a).__name__}{hint}")


def check_arg(kernel, p: Param, a) -> None:
    """Is ``a`` a valid value for parameter ``p`` (role, dtype, rank, layout)?"""
    k = kernel.name
    if p.role == "out":
        if not isinstance(a, Partition):
            hint = " (a plain tensor: pass tensor.partition(tile), or shared.try_partition(tile))" \
                if isinstance(a, (Tensor, SharedTensor)) else ""
            raise LaunchError(f"argument {p.name} of {k} must be a Partition{hint}, got {type(a).__name__}")
        t = a.tensor
        if t._alloc.read_only:  # checked as the launch is built (and whenever a new key is checked)
            raise read_only_error(f"{k} writes {p.name}", t)
    elif p.role == "inout":
        t = writable_arg(kernel, p, a)
        if t._alloc.read_only:
            raise read_only_error(f"{k} writes {p.name}", t)
    elif p.role == "in":
        t = _as_tensor_arg(a)
        if not isinstance(t, Tensor):
            raise LaunchError(f"argument {p.name} of {k} must be a Tensor, got {type(a).__name__}"
                              f"{_not_a_tensor_hint(a)}")
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
