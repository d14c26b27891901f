"""What combinators do to values on the host: ``first()``, ``last()``,
``unpartition()``, ``reshape()`` and ``unzip()`` of an op's value, each
refusing a value it cannot apply to with an error naming the fix; and the
kernels an op tree launches (what a kernel fault names)."""
from __future__ import annotations

from .errors import ShapeError, StateError
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
            names.extend(n.label for n in graph._nodes)
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


def _first(v):
    try:
        return v[0]
    except (TypeError, IndexError, KeyError):
        raise ShapeError(f"first() needs an op producing a tuple (a kernel launch's arguments), got "
                         f"{_what(v)}; call it on a launch, or use .map(...)") from None


def _last(v):
    try:
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
