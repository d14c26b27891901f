"""Device memory bookkeeping below tensors: shapes, layout ids (what launch keys
are made of), allocations and who can reach them (handles, borrows, imports),
the rule that decides whether a buffer may be claimed for writing, and
partitions (a tensor cut into the tiles of a launch's grid)."""
from __future__ import annotations

import gc
import itertools
import math
import operator
import threading
import weakref

import numpy as np

from .errors import OwnershipError, ShapeError


def _shape_tuple(shape) -> tuple[int, ...]:
    try:
        return tuple(map(operator.index, shape))  # C loops: a shape is made per launch built
    except TypeError:
        if isinstance(shape, (int, np.integer)):
            return (int(shape),)
        raise ShapeError(f"a shape is a sequence of ints, got {shape!r}") from None


def _resolve_shape(shape, size: int, what: str) -> tuple[int, ...]:
    """``shape`` with at most one ``-1`` filled in so that it holds ``size`` elements."""
    dims = _shape_tuple(shape)
    if sum(d == -1 for d in dims) > 1 or any(d < -1 for d in dims):
        raise ShapeError(f"{what}: shape {dims} may hold one -1 and otherwise non-negative sizes")
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        if known == 0 or size % known:
            raise ShapeError(f"{what}: cannot infer the -1 in {dims} for {size} elements")
        dims = tuple(size // known if d == -1 else d for d in dims)
    if math.prod(dims) != size:
        raise ShapeError(f"{what}: shape {dims} holds {math.prod(dims)} elements but the tensor has {size}")
    return dims


# Launch checks are cached by the layouts of the tensors involved (see
# KernelLaunch._run).  Hashing every tensor's (pointer, shape, strides, dtype)
# tuple at every launch was most of that lookup's cost; so each distinct
# layout gets a small int, once, when a tensor or view is made, and the cache
# keys on those.  Equal ids mean equal layouts (ids come from a counter and are
# never reused); a layout made again after the table was cleared gets a new
# id, which costs that launch one more check, never a wrong verdict.
_sig_ids: dict = {}
_next_sig_id = itertools.count(1).__next__


def _sig_id(sig: tuple) -> int:
    i = _sig_ids.get(sig)
    if i is None:
        if len(_sig_ids) >= 1 << 14:  # bounded: dead tensors' layouts are forgotten
            _sig_ids.clear()
        i = _sig_ids.setdefault(sig, _next_sig_id())  # setdefault: two threads agree on one id
    return i


class _Allocation:
    """One allocation, shared by every view of it: its extent (for overlap
    checks) and who can reach it (ownership, see SharedTensor): the number of
    live SharedTensor handles, the live *borrows* (views made through a handle,
    imports of its memory through DLPack), and whether another framework owns
    the memory (``external``: imported, its other references are invisible)."""

    __slots__ = ("lo", "hi", "handles", "lock", "borrows", "external", "__weakref__")

    def __init__(self, lo: int, hi: int, external: bool = False):
        self.lo, self.hi, self.handles = lo, hi, 0
        self.lock = threading.Lock()
        self.borrows = []  # what each live borrow is (one entry per _Borrow alive)
        self.external = external


class _Borrow:
    """A borrow of an allocation: carried by the view (or import) that made it
    and by every view made from that one, so it lives as long as any of them.
    Counted in ``alloc.borrows`` from its making to its collection (list append
    and remove are single operations under the GIL: no lock on this path)."""

    __slots__ = ("alloc", "what")

    def __init__(self, alloc: _Allocation, what: str):
        self.alloc, self.what = alloc, what
        alloc.borrows.append(what)

    def __del__(self):
        try:
            self.alloc.borrows.remove(self.what)
        except ValueError:  # pragma: no cover - every borrow added its entry
            pass


# The allocations deviceop made, while they live: an import (from_dlpack) of
# memory inside one of them is a borrow of it.
_owned: "weakref.WeakSet[_Allocation]" = weakref.WeakSet()
_owned_lock = threading.Lock()


def _owner_of(lo: int, hi: int) -> "_Allocation | None":
    """The live deviceop allocation that holds ``[lo, hi)``, if any (imports are rare: a scan)."""
    if lo >= hi:  # an empty import touches no byte of anyone's
        return None
    with _owned_lock:
        for a in list(_owned):
            if a.lo <= lo and hi <= a.hi and a.lo < a.hi:
                return a
    return None


def _why_not_exclusive(alloc: _Allocation, own: "_Borrow | None") -> str | None:
    """What else can reach the allocation besides one handle (and, ``own``, the borrow
    that handle was made from): None when nothing deviceop can see.  Call with its lock."""
    if alloc.external:
        return ("is memory imported from another framework (from_dlpack / as_tensor), which may still hold and "
                "use it: deviceop cannot count its references. Copy it into a buffer deviceop owns "
                "(api.dup(x), then .into_shared()) and claim that, or, if nothing else uses it, borrow it "
                "explicitly with handle.tensor.partition(tile)")
    others = alloc.handles - 1
    borrows = list(alloc.borrows)
    if own is not None and own.alloc is alloc and own.what in borrows:
        borrows.remove(own.what)
    if not others and not borrows:
        return None
    reach = []
    if others:
        reach.append(f"{others} other live SharedTensor handle(s)")
    if borrows:
        reach.append(f"{len(borrows)} live borrow(s): {'; '.join(sorted(set(borrows)))}")
    return (f"is still reachable from {' and '.join(reach)}; release() the other handles and drop the "
            "borrowing views or imports (del them) first, or write into a buffer you own")


def claim(alloc: _Allocation, own: "_Borrow | None", what: str, buffer: str, consume) -> None:
    """Refuse (OwnershipError naming ``what`` and the ``buffer``) unless one handle is the
    only way deviceop can see to reach ``alloc``; ``consume()``, if given, ends that
    handle with the allocation's lock still held."""
    for attempt in (0, 1):
        with alloc.lock:
            why = _why_not_exclusive(alloc, own)
            if why is None:
                if consume is not None:
                    consume()
                return
        if attempt or not alloc.borrows:
            break
        gc.collect()  # a view in an unreachable reference cycle is no borrow: the verdict must not hinge on it
    raise OwnershipError(f"{what}: the {buffer} {why}")


class Partition:
    """A tensor cut into equal tiles; the launch grid is the number of tiles per axis.

    A tile shape that does not divide the tensor is an error: a kernel that
    writes whole tiles would otherwise skip the ragged edge silently.
    """

    __slots__ = ("tensor", "tile_shape", "grid", "_sig_id")

    def __init__(self, tensor, tile_shape):
        tile, shape = _shape_tuple(tile_shape), tensor._shape
        if len(tile) != len(shape):
            raise ShapeError(f"tile shape {tile} has rank {len(tile)} but the tensor {shape} "
                             f"has rank {len(shape)}; give one tile size per axis")
        if tile and min(tile) <= 0:
            raise ShapeError(f"tile sizes must be positive, got {tile}")
        grid = tuple(map(operator.floordiv, shape, tile))  # C loops: a partition is built per launch
        if tuple(map(operator.mul, grid, tile)) != shape:
            i = next(i for i, (n, t) in enumerate(zip(shape, tile)) if n % t)
            raise ShapeError(f"tile {tile} does not divide tensor shape {shape}: axis {i} has "
                             f"{shape[i]} elements, not a multiple of {tile[i]}; pick a tile size that divides it")
        self.tensor = tensor
        self.tile_shape = tile
        self.grid = grid
        self._sig_id = _sig_id(("tiles", tensor._sig_id, tile))  # the tensor's layout and the tiles, as one id

    @property
    def num_tiles(self) -> int:
        return math.prod(self.grid)

    def unpartition(self):
        return self.tensor

    def __repr__(self) -> str:
        return f"Partition({self.tensor!r}, tile={self.tile_shape}, grid={self.grid})"
