"""A kernel's typed signature: each parameter's role (output partition, in-out
tensor, input tensor, scalar: any number of outputs and in-outs, at any
position, as the kernel's author wrote it), dtype, layout, and shape in terms
of the kernel's generics, as cuTile writes ``out: &mut Tensor<f32, {[B]}>``,
``x: &Tensor<f32, {[-1, K]}>``::

    Out("out", "float32", tile=("B",))          # the output's tile is [B]
    In("x", "float32", shape=(-1, "K"))         # any rows, K columns
    In("w", "float32", shape=("N", "K"))        # N: a size the arguments must agree on
    In("w_qkv", "bfloat16", shape=("(HQ+2*HKV)*HD", "K"))   # arithmetic (shapes.py)
    InOut("cache", "bfloat16", shape=("HKV", "cap", "HD"))  # cap: an int Scalar parameter

A dimension is an int (exactly that), -1 (any), a name (a generic of the
kernel, a size shared by the parameters that name it, or an int Scalar
parameter: its argument's value) or arithmetic on them (shapes.py).  ``bind``
checks a launch's arguments against them, infers the generics they determine
and checks the ones given, naming the parameter, the generic and the values.
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
from .shapes import GRAMMAR, Expr, determined, dim_names, parse

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
    """The dimensions of parameter ``name``'s ``what``: ints, bare names (str) and parsed Exprs."""
    if dims is None:
        return None
    if isinstance(dims, (str, int)):
        raise LaunchError(f"parameter {name}: its {what} is a list of dimensions, one per axis, got {dims!r}: "
                          f"write [{dims!r}]")
    out = []
    for d in tuple(dims):
        if isinstance(d, str):
            d = parse(d, f"parameter {name}'s {what}")
        elif isinstance(d, np.integer):  # a size NumPy computed (np.prod, an array's len): an int, as in a geometry
            d = int(d)
        if not isinstance(d, (str, Expr)) and not (type(d) is int and d >= -1):
            raise LaunchError(f"parameter {name}: each dimension of its {what} is an int, -1 (any), the name "
                              f"of a generic or size, or arithmetic on them ({GRAMMAR}), got {d!r} in {tuple(dims)}")
        out.append(d)
    return tuple(out)


def _tensor_param(name: str, role: str, dtype, rank, layout, shape=None, tile=None) -> Param:
    if layout not in LAYOUTS:
        raise LaunchError(f"parameter {name}: layout must be one of {', '.join(map(repr, LAYOUTS))}, "
                          f"got {layout!r}")
    shape, tile = _dims(name, "shape", shape), _dims(name, "tile", tile)
    if tile is not None and 0 in tile:  # a size may be 0; a tile never is (tensor.partition refuses it)
        raise LaunchError(f"parameter {name}: its tile {_dims_text(tile)} has a 0, and a tile cannot be empty: "
                          "give each tile axis a positive size, a name or an expression (-1: any)")
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


def shape_dims(params) -> list[tuple]:
    """Every declared shape and tile of ``params``."""
    return [dims for p in params for dims in (p.shape, p.tile) if dims]


def scalar_names(params) -> set:
    """The int Scalar parameters, by name: a shape or the geometry may name them (their argument's value)."""
    return {p.name for p in params if p.role == "scalar" and p.dtype.kind in "iu"}


def inferable(params, generic_names) -> bool:
    """Do the parameters' shapes determine every generic (so a launch may omit ``.generics()``)?"""
    known = determined(shape_dims(params), scalar_names(params))
    return all(g in known for g in generic_names)


def check_names(kernel_name: str, params, generic_names) -> None:
    """Refuse a declaration whose shapes read a name nothing gives a value: neither a generic,
    an int scalar, a bare dimension, nor solvable from one (shapes.py's rule)."""
    scalars = scalar_names(params)
    clash = scalars & set(generic_names)
    if clash:
        raise LaunchError(f"kernel {kernel_name}: {', '.join(sorted(clash))} is both a generic and a scalar "
                          "parameter; rename one")
    floats = {p.name for p in params if p.role == "scalar"} - scalars
    known = determined(shape_dims(params), scalars | set(generic_names))
    for p in params:
        for what, dims in (("shape", p.shape), ("tile", p.tile)):
            for d in dims or ():
                for n in dim_names(d):
                    if n in floats:
                        raise LaunchError(f"kernel {kernel_name}: {p.name}'s {what} {_dims_text(dims)} names the "
                                          f"float scalar {n}; a dimension is an int: declare {n} an int scalar")
                    if n not in known:
                        raise LaunchError(f"kernel {kernel_name}: {p.name}'s {what} {_dims_text(dims)} reads {n}, "
                                          f"which no argument determines: name {n} alone as a dimension of some "
                                          f"parameter, or declare it a generic")


_SCALAR = "the scalar argument"  # where a value bound from an int Scalar came from


def bind(kernel, values, launch_args, gen) -> tuple[tuple, dict]:
    """Check the arguments' dimensions against the declared shapes and tiles; return
    the generics (``gen``, checked, or inferred when None) and every name's value
    (generics, sizes, the int scalars the shapes name): the geometry's expressions
    read them.  Bare names bind first, parameter by parameter; expressions are then
    checked, and their one unknown solved where shapes.py's rule allows."""
    env, source = {}, {}
    if gen is not None:
        for n, v in zip(kernel.generic_names, gen):
            env[n], source[n] = v, ".generics()"
    for i, n in kernel._named_scalars:
        env[n], source[n] = int(values[i]), _SCALAR
    deferred = []
    for p, a, t in zip(kernel.params, values, launch_args):
        for what, dims in (("shape", p.shape), ("tile", p.tile)):
            if dims is None:
                continue
            actual = t.shape if what == "shape" else a.tile_shape
            for axis, (d, n) in enumerate(zip(dims, actual)):
                if type(d) is int:
                    if d != -1 and n != d:
                        raise _mismatch(kernel, p, what, dims, actual, axis, d, env, source)
                elif type(d) is str:
                    if d not in env:
                        env[d], source[d] = n, f"{p.name}'s {what}"
                    elif n != env[d]:
                        raise _mismatch(kernel, p, what, dims, actual, axis, env[d], env, source)
                    elif source[d] == _SCALAR:  # a scalar an argument agrees with: the other is wrong
                        source[d] = f"{_SCALAR} {d} and {p.name}'s {what}"
                else:
                    deferred.append((p, what, dims, actual, axis))
    while deferred:
        left = []
        for p, what, dims, actual, axis in deferred:
            e, n = dims[axis], actual[axis]
            unknown = [x for x in e.names if x not in env]
            if not unknown:
                expected = e.eval(env)
                if n != expected:
                    raise _mismatch(kernel, p, what, dims, actual, axis, expected, env, source)
            elif len(unknown) == 1 and e.solvable_for(unknown[0]):
                v = e.solve(n, env)
                if v is None:
                    raise _unsolvable(kernel, p, what, dims, actual, axis, unknown[0], env, source)
                env[unknown[0]], source[unknown[0]] = v, f"{p.name}'s {what} ({e.text})"
            else:
                left.append((p, what, dims, actual, axis))
        if len(left) == len(deferred):  # pragma: no cover - check_names refuses such a declaration
            raise LaunchError(f"{kernel.name}: {', '.join(str(x[2][x[4]]) for x in left)} cannot be evaluated")
        deferred = left
    if gen is None:
        gen = tuple(env[g] for g in kernel.generic_names)
    return gen, env


def _fits(dims, actual, env) -> list:
    """The dimensions ``dims`` take with the values known in ``env`` (``actual`` where none)."""
    out = []
    for d, n in zip(dims, actual):
        if type(d) is int:
            out.append(n if d == -1 else d)
        elif type(d) is str:
            out.append(env.get(d, n))
        else:
            out.append(d.eval(env) if all(x in env for x in d.names) else n)
    return out


def _sources(names, source) -> str:
    """``"HQ, HD from .generics(); HKV from k's shape"``."""
    by = {}
    for n in names:
        by.setdefault("the scalar arguments" if source[n].startswith(_SCALAR) else source[n], []).append(n)
    return "; ".join(f"{', '.join(ns)} from {s}" for s, ns in by.items())


def _a(name: str) -> str:
    """``"a w"``, ``"an x"``: the article as the name is read."""
    return f"{'an' if name[0].lower() in 'aeiox' else 'a'} {name}"


def _mismatch(kernel, p, what, dims, actual, axis, expected, env, source) -> ShapeError:
    """The error of ``p``'s ``what`` disagreeing with ``expected`` on ``axis``."""
    fits = _fits(dims, actual, env)
    fits[axis] = expected
    d, n = dims[axis], actual[axis]
    fix = f"pass {_a(p.name)} of shape {_dims_text(fits)}"
    if type(d) is int:
        head, why = kernel.name, f"axis {axis} must be {d}"
    elif type(d) is str:
        head = f"{kernel.name}<{d}={expected}>"
        if source[d].startswith(_SCALAR + " "):  # confirmed by another argument: this one is wrong
            why = f"axis {axis} is {d}: {expected} from {source[d]}, {n} here"
        elif source[d] == _SCALAR:
            why = f"axis {axis} is {d}: {expected} from the scalar argument {d}, {n} here"
            fix = f"pass {d}={n} ({p.name}.shape[{axis}]), or {_a(p.name)} of shape {_dims_text(fits)}"
        else:
            why = f"axis {axis} is {d}: {expected} from {source[d]}, {n} here"
    else:
        head = f"{kernel.name}<{', '.join(f'{x}={env[x]}' for x in d.names)}>"
        why = f"axis {axis} is {d} = {d.substituted(env)} = {expected} ({_sources(d.names, source)}), {n} here"
    if what == "tile":
        return ShapeError(f"{head}: partition {p.name} with {_dims_text(fits)}, not {_dims_text(actual)} "
                          f"({p.name}'s tile {why})")
    return ShapeError(f"{head}: argument {p.name} has shape {_dims_text(actual)}, but its {why}; {fix}")


def _unsolvable(kernel, p, what, dims, actual, axis, unknown, env, source) -> ShapeError:
    """The error of an expression no value of its unknown name makes equal to the argument's dimension."""
    d, n = dims[axis], actual[axis]
    known = [x for x in d.names if x != unknown]
    head = f"{kernel.name}<{', '.join(f'{x}={env[x]}' for x in known)}>" if known else kernel.name
    sources = f" ({_sources(known, source)})" if known else ""
    generic = " (or give .generics())" if unknown in kernel.generic_names else ""
    where = f"argument {p.name} has shape" if what == "shape" else f"partition {p.name} has tile"
    return ShapeError(f"{head}: {where} {_dims_text(actual)}, but its {'tile ' if what == 'tile' else ''}axis "
                      f"{axis} is {d}{sources}, and no {unknown} >= 0 makes {d.substituted(env)} = {n}; pass "
                      f"{_a(p.name)} whose {'tile' if what == 'tile' else 'axis'} {axis} is {d.substituted(env)} for the "
                      f"{unknown} you mean{generic}")


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
        fix = ("give each generic the kind the kernel's docstring names: ints for sizes and counts, strings for C++ "
               "types" if kernel.generic_names else "a kernel without generics: the function itself fails on these "
               "arguments; fix the function, or pass arguments it can compute with")
        raise LaunchError(f"{kernel.name}'s rules failed on generics <{shown}>: {type(exc).__name__}: {exc}; "
                          f"{fix}") from exc




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
