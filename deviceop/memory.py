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

from .errors import OwnershipError, ShapeError, StateError


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
    the memory (``external``: imported, its other references are invisible), and
    whether it may be written at all (``read_only``: an import its producer flagged so)."""

    __slots__ = ("lo", "hi", "handles", "lock", "borrows", "external", "read_only", "__weakref__")

    def __init__(self, lo: int, hi: int, external: bool = False, read_only: bool = False):
        self.lo, self.hi, self.handles = lo, hi, 0
        self.lock = threading.Lock()
        self.borrows = []  # what each live borrow is (one entry per _Borrow alive)
        self.external, self.read_only = external, read_only


# The last item of a read-only tensor's layout (Tensor._sig): launch keys of writes
# into it never equal those of the writable memory it may alias, so they are checked.
READ_ONLY = "read-only"


def read_only_error(what: str, tensor) -> OwnershipError:
    """The error of writing (``what``) into the read-only import ``tensor``."""
    return OwnershipError(f"{what}: the {tensor.dtype.name} tensor {tensor.shape} is read-only memory imported "
                          f"from another framework ({_READ_ONLY_WHY}")


_READ_ONLY_WHY = ("its producer exported it with DLPack's read-only flag, or __cuda_array_interface__'s readonly), "
                  "which deviceop only reads. Write into a buffer deviceop owns: copy it with api.dup(x), or have "
                  "the producer export it writable")


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
    if alloc.read_only:
        return f"is read-only memory imported from another framework ({_READ_ONLY_WHY}"
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


# -- shared handles and ownership ------------------------------------------------

def _released() -> StateError:
    return StateError("this SharedTensor handle was released or consumed by try_partition: take a fresh "
                      "handle with .clone() of a live one (before releasing it), or tensor.into_shared()")


class SharedTensor:
    """An Arc-like, read-only handle to a tensor.

    ``clone()`` makes another live handle; ``release()`` (or the handle being
    collected) ends one.  ``try_partition(tile)`` turns the *only* live handle
    into a writable Partition and fails with an OwnershipError while anything
    else deviceop can see may still reach the buffer — the runtime form of
    cutile-rs's ``Arc::try_unwrap``:

    * another live handle (counted explicitly — handles made and ended, not
      CPython reference counts — and per allocation: two handles made from two
      views of one buffer still count as two);
    * a live *borrow*: a view made through a handle (``handle.view(...)``, an
      op's ``.reshape`` of a handle) or a DLPack import of the buffer's memory,
      counted while that view, or any view made from it, is alive;
    * memory imported from another framework (``from_dlpack``, ``as_tensor``):
      its other references are invisible, so it is never claimed.

    A plain Tensor is not tracked: ``tensor.partition`` is a mutable borrow its
    caller vouches for (docs/robustness.md, "Ownership", says what is and is
    not enforced).
    """

    __slots__ = ("_tensor", "_live", "__weakref__")

    def __init__(self, tensor: Tensor, _counted: bool = False):
        if type(getattr(tensor, "_alloc", None)) is not _Allocation:  # (Tensor is the layer above)
            raise StateError(f"SharedTensor wraps a Tensor, got {type(tensor).__name__}")
        self._tensor = tensor
        if not _counted:
            alloc = tensor._alloc
            with alloc.lock:
                alloc.handles += 1
        self._live = True

    @property
    def tensor(self) -> Tensor:
        """The tensor, for reading (launch inputs).  It is a plain Tensor: views of
        it are not counted as borrows; make views with ``handle.view(...)``."""
        if not self._live:
            raise _released()
        return self._tensor

    @property
    def live_handles(self) -> int:
        """Live handles to this buffer's allocation (this one included, if live)."""
        return self._tensor._alloc.handles

    def clone(self) -> "SharedTensor":
        """Another live handle.  This one's liveness is read and the count raised under the
        allocation's lock, the lock a claim ends handles under: a clone racing
        ``try_partition`` on another thread is made before the claim (which then sees
        it), or refused after it; never a live handle to a claimed buffer."""
        alloc = self._tensor._alloc
        with alloc.lock:
            if not self._live:  # a dead handle cannot be cloned
                raise _released()
            alloc.handles += 1
        return SharedTensor(self._tensor, _counted=True)

    def __copy__(self) -> "SharedTensor":
        """``copy.copy(handle)`` is ``handle.clone()``: another counted live handle."""
        return self.clone()

    def __reduce_ex__(self, protocol):  # what copy.deepcopy and pickle call
        raise StateError("copy.deepcopy or pickling of a SharedTensor: its buffer is device memory; another "
                         "handle is handle.clone(), a copy of the data api.dup(handle) or "
                         "dop.from_numpy(handle.tensor.numpy()).into_shared()")

    def release(self) -> None:
        """End this handle (idempotent, also when threads race to release it)."""
        if self._live:
            alloc = self._tensor._alloc
            with alloc.lock:
                if self._live:
                    self._live = False
                    alloc.handles -= 1

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass

    def _exclusive(self, what: str, consume: bool) -> Tensor:
        """The tensor, if this is the only way deviceop can see to reach the buffer
        (the handle ended with the lock held when ``consume``); else OwnershipError."""
        tensor = self.tensor
        alloc = tensor._alloc

        def end():
            if not self._live:  # ended by another thread since .tensor above
                raise _released()
            alloc.handles -= 1
            self._live = False
        claim(alloc, tensor._borrow, what, f"{tensor.dtype.name} buffer {tensor.shape}", end if consume else None)
        return tensor

    def try_partition(self, tile_shape) -> Partition:
        """Claim the buffer for writing: succeeds only if nothing else deviceop can
        see reaches it (see the class docstring).

        The handle is consumed (like a Rust move); the partition's tensor is
        the buffer, writable by one launch."""
        tensor = self.tensor
        part = Partition(tensor, tile_shape)  # a bad tile fails before the handle is consumed
        alloc = tensor._alloc
        with alloc.lock:  # the common case inline (a claim is made per buffer per forward built)
            if alloc.handles == 1 and self._live and not alloc.borrows and not alloc.external:
                alloc.handles -= 1
                self._live = False
                return part
        self._exclusive("try_partition", consume=True)
        return part

    def check_writable(self, what: str) -> Tensor:
        """The tensor, for a write through this handle (``api.memcpy`` into it):
        allowed when ``try_partition`` would be, without consuming the handle
        (cutile-rs's ``Arc::get_mut``).  Raises OwnershipError otherwise."""
        return self._exclusive(what, consume=False)

    # read-only conveniences, all through .tensor
    @property
    def shape(self):
        return self.tensor.shape

    @property
    def dtype(self):
        return self.tensor.dtype

    def view(self, *shape) -> Tensor:
        """A view of the buffer, counted as a borrow while it (or a view made from
        it) is alive: ``try_partition`` on any handle to the buffer waits for it."""
        tensor = self.tensor
        like = tensor.view(*shape)  # the tensor's cached view: its shape checked once
        v = like._twin()  # an object of its own: its life is the borrow's
        v._borrow = _Borrow(tensor._alloc, "a view made through a handle (handle.view / .reshape)")
        return v

    reshape = view

    def numpy(self, **kw):
        return self.tensor.numpy(**kw)

    def __array__(self, dtype=None, copy=None):  # np.asarray(handle): the data, not a 0-d object array
        return self.tensor.__array__(dtype, copy)

    def __repr__(self) -> str:
        state = f"{self.live_handles} live handle(s)" if self._live else "released"
        return f"SharedTensor({self._tensor!r}, {state})"
