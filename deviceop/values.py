"""What combinators do to values on the host: ``first()``, ``last()``,
``unpartition()``, ``reshape()`` and ``unzip()`` of an op's value, each
refusing a value it cannot apply to with an error naming the fix; and the
kernels an op tree launches (what a kernel fault names)."""
from __future__ import annotations

import operator

from .errors import LaunchError, ShapeError, StateError
from .tensor import Partition, SharedTensor, Tensor


def launched_kernels(op) -> list:
    """The kernels an op tree launches, in order (a graph launch: its graph's kernel nodes).
    Kernels that a ``then`` callback returned are not in the tree and are not listed."""
    names, stack, seen = [], [op], set()
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        graph = getattr(o, "graph", None)
        if getattr(o, "kernel", None) is not None:
            names.append(o.describe())
        elif graph is not None and hasattr(graph, "_nodes"):
            names.extend(n.label for n in graph._nodes if hasattr(n, "kernel"))  # its kernel nodes
        core = getattr(o, "core", None)  # a shared op: what it runs, also once it has run
        stack.extend(reversed((core.op,) if core is not None else o.children()))
    return names


def _selector(i: int, n: int):
    """``v[i]`` of a value unzipped into ``n`` parts."""
    def select(v):
        if not isinstance(v, (tuple, list)) or len(v) != n:
            got = f"{len(v)} values" if isinstance(v, (tuple, list)) else f"a {type(v).__name__}"
            raise ShapeError(f"unzip({n}) needs an op producing {n} values, got {got}; pass the op's arity")
        return v[i]
    return select


def checked_fn(f, combinator: str):
    """``f``, if it can be called: refused when the op is built, not when it runs."""
    if not callable(f):
        raise LaunchError(f"op.{combinator}(f) takes a function of the op's value, got {f!r:.60} "
                          f"({type(f).__name__}); pass a callable, e.g. lambda v: ...")
    return f


def _first(v):
    try:
        if isinstance(v, (Tensor, SharedTensor, Partition)):  # indexable, but not a tuple of values
            raise TypeError
        return v[0]
    except (TypeError, IndexError, KeyError):
        raise ShapeError(f"first() needs an op producing a tuple (a kernel launch's arguments), got "
                         f"{_what(v)}; call it on a launch, or use .map(...)") from None


def _last(v):
    try:
        if isinstance(v, (Tensor, SharedTensor, Partition)):
            raise TypeError
        return v[-1]
    except (TypeError, IndexError, KeyError):
        raise ShapeError(f"last() needs an op producing a tuple (a kernel launch's arguments), got "
                         f"{_what(v)}; call it on a launch, or use .map(...)") from None


def _what(v) -> str:
    return f"an empty {type(v).__name__}" if isinstance(v, (tuple, list)) else f"{v!r:.60} ({type(v).__name__})"


def _unpartition(v):
    if isinstance(v, Partition):
        return v.tensor
    raise StateError(f"unpartition() needs a Partition, got {type(v).__name__}; use it after .first() on a launch")


def _reshape(v, shape):
    if isinstance(v, SharedTensor):
        return v.view(shape)  # a view made through a handle: a borrow while it lives
    if isinstance(v, Tensor):
        return v.view(shape)
    raise ShapeError(f"reshape() needs an op producing a tensor, got {type(v).__name__}")


def reshape_dims(shape: tuple) -> tuple:
    """``op.reshape``'s arguments as a tuple of ints: ``reshape([2, 3])`` as well as ``reshape(2, 3)``."""
    if len(shape) == 1 and not hasattr(shape[0], "__index__"):
        shape = shape[0]
    try:
        return tuple(operator.index(d) for d in shape)
    except TypeError:
        raise ShapeError(f"reshape() takes dimensions as ints, e.g. .reshape(2, 3) or .reshape([2, 3]); "
                         f"got {shape!r}") from None


def unzip_count(op, n) -> int:
    """How many ops ``op.unzip(n)`` makes: ``n``, checked against the op's arity where it has one."""
    arity = getattr(op, "arity", None)
    if n is None:
        if arity is None:
            raise StateError(f"unzip() cannot tell how many values {op.describe()} produces; pass n")
        return arity
    try:
        count = operator.index(n)
    except TypeError:
        count = -1
    if count < 0:
        raise ShapeError(f"unzip(n) takes the number of values as an int >= 0, got {n!r}")
    if arity is not None and count != arity:
        raise ShapeError(f"unzip({count}) of {op.describe()}, which produces {arity} values: "
                         f"call unzip({arity}) (or unzip())")
    return count
