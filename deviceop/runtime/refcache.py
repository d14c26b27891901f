"""The reference device's float64 copies of the matrices its kernels' references read.

A decode step's references promote every bf16 weight to float64 at every launch
(kernels/_refmath.py); for SmolLM2-135M the promotion is most of the time.  This
module keeps the promoted copy of a matrix and hands it back while the memory
under it is unchanged, which it can know only for memory whose every write it
sees.  So a copy is kept only for an *owned* allocation: one the reference device
made (``alloc``, ``from_host``) and never handed out (a DLPack export, the arrays
a foreign op's reference or a collective is given make it foreign for good).  Every
write the reference device makes drops the copies it overlaps:

* a kernel step, after its reference ran: the arguments it declares written (Out,
  InOut), every array argument of a kernel that declares nothing, and everything
  for a launch given a raw address;
* a copy or memset step (api.memcpy, api.fill, graph nodes, updated or not): the
  destination's bytes; ``stream.fill`` and ``stream.upload``: the array;
* a host step (a host callback, foreign work's reference): everything.

Loop and branch controls write int32 cells, which are never kept (only float
matrices are).  The copies take at most ``DEVICEOP_REFERENCE_CACHE_MB`` (default
4096) MiB; past that, matrices are promoted block by block at each launch as before.
"""
from __future__ import annotations

import bisect
import os
import threading
import weakref

import numpy as np

_lock = threading.RLock()
_owned: dict[int, weakref.ref] = {}        # id(owner array) -> owner: allocations whose every write is seen
_entries: dict[int, dict] = {}             # id(owner) -> {(address, shape, strides, dtype): (lo, hi, float64 copy)}
_spans: list[tuple[int, int, int]] = []    # (lo, hi, id(owner)) of owners with copies, sorted: for address writes
_starts: list[int] = []
_bytes = 0
_writes = 0                                # bumped by every write: a copy made across one is not kept
_hits: dict[int, tuple] = {}               # id(view) -> (weakref, shape, strides, dtype, copy): float64_of's answers,
                                           # forgotten whenever any copy is dropped (a launch passes the same views)
CACHEABLE = ("bfloat16", "float16", "float32")


def budget() -> int:
    """The bytes of copies allowed (``DEVICEOP_REFERENCE_CACHE_MB``, default 4096 MiB)."""
    text = os.environ.get("DEVICEOP_REFERENCE_CACHE_MB", "4096")
    try:
        mib = float(text)
    except ValueError:
        mib = -1.0
    if not mib >= 0:
        from ..errors import ConfigError
        raise ConfigError(f"DEVICEOP_REFERENCE_CACHE_MB={text!r} is not a number of MiB: set it to the MiB of "
                          "float64 weight copies the reference device may keep (0: none), or unset it (4096)")
    return int(mib * (1 << 20))


class HostView:
    """Exposes a raw host view to NumPy while keeping its base array alive (runtime/reference.py's views)."""

    def __init__(self, base, interface):
        self.base, self.__array_interface__ = base, interface


def owner_of(array):
    """The array that owns ``array``'s memory (following views), or None for memory of another kind."""
    a = array
    while True:
        b = a.base
        if b is None:
            return a
        if isinstance(b, np.ndarray):
            a = b
        elif isinstance(b, HostView) and isinstance(b.base, np.ndarray):
            a = b.base
        else:
            return None


def own(array) -> None:
    """``array`` (a fresh allocation of the reference device): every write to it is seen."""
    key = id(array)
    with _lock:
        _owned[key] = weakref.ref(array, lambda _, key=key: _forget(key))


def disown(array) -> None:
    """``array``'s memory is handed out: drop its copies and never keep one again."""
    owner = owner_of(array) if isinstance(array, np.ndarray) else None
    if owner is not None:
        with _lock:
            _owned.pop(id(owner), None)
            _drop(id(owner))


def _forget(key: int) -> None:
    with _lock:
        _owned.pop(key, None)
        _drop(key)


def _drop(key: int, lo: int = 0, hi: int = 1 << 64) -> None:
    """Drop owner ``key``'s copies that overlap bytes [lo, hi) (call with the lock held)."""
    global _bytes
    entries = _entries.get(key)
    if not entries:
        return
    for k, (a, b, copy) in list(entries.items()):
        if a < hi and lo < b:
            del entries[k]
            _bytes -= copy.nbytes
            _hits.clear()
    if not entries:
        del _entries[key]
        _reindex()


def _reindex() -> None:
    global _starts
    spans = []
    for key in _entries:
        owner = _owned.get(key)
        owner = owner() if owner is not None else None
        if owner is not None:
            lo = int(owner.__array_interface__["data"][0])
            spans.append((lo, lo + owner.nbytes, key))
    _spans[:] = sorted(spans)
    _starts = [s[0] for s in _spans]


def _bounds(array) -> tuple[int, int]:
    lo, hi = np.lib.array_utils.byte_bounds(array)
    return int(lo), int(hi)


def wrote(array) -> None:
    """The reference device wrote ``array`` (a NumPy array): drop the copies it overlaps."""
    global _writes
    _writes += 1
    if not _entries or not isinstance(array, np.ndarray):
        return
    owner = owner_of(array)
    if owner is not None and id(owner) in _entries:
        with _lock:
            _drop(id(owner), *_bounds(array))


def wrote_bytes(address: int, nbytes: int) -> None:
    """The reference device wrote bytes [address, address + nbytes): drop the copies they overlap."""
    global _writes
    _writes += 1
    if not _entries or nbytes <= 0:
        return
    with _lock:
        end = address + nbytes
        i = bisect.bisect_left(_starts, end)
        hits = [key for lo, hi, key in _spans[:i] if hi > address]
        for key in hits:
            _drop(key, address, end)


def wrote_anything() -> None:
    """A write the reference device cannot place (a host function): drop every copy."""
    global _bytes, _writes
    _writes += 1
    if _entries:
        with _lock:
            _entries.clear()
            _hits.clear()
            _spans.clear()
            _starts.clear()
            _bytes = 0


def kernel_wrote(written, args) -> None:
    """A kernel's reference ran with ``args``; ``written``: the indices of the arguments it
    declares written, or None when it declares nothing (then every array argument)."""
    global _writes
    _writes += 1
    if not _entries:
        return
    if written is None:
        if any(isinstance(a, int) and not isinstance(a, bool) for a in args):
            wrote_anything()  # an integer may be an address the reference writes through
            return
        written = range(len(args))
    for i in written:
        wrote(args[i])


def is_kept(w) -> bool:
    """Is a float64 copy of exactly this view of memory kept now?"""
    owner = owner_of(w)
    iface = w.__array_interface__
    key = (iface["data"][0], w.shape, w.strides, w.dtype.str)
    return owner is not None and key in _entries.get(id(owner), {})


def float64_of(w):
    """A float64 copy of the matrix ``w`` kept while its memory is unchanged, or None
    (memory not owned, not a float matrix, or past the budget: promote it each time)."""
    global _bytes
    hit = _hits.get(id(w))
    if hit is not None and hit[0]() is w and hit[1] == w.shape and hit[2] == w.strides and hit[3] is w.dtype:
        return hit[4]  # the same view as a launch before, its copy still kept
    if w.ndim != 2 or w.dtype.name not in CACHEABLE:
        return None
    owner = owner_of(w)
    if owner is None:
        return None
    key = id(owner)
    ref = _owned.get(key)
    if ref is None or ref() is not owner:
        return None
    iface = w.__array_interface__
    k = (iface["data"][0], w.shape, w.strides, w.dtype.str)
    hit = _entries.get(key, {}).get(k)
    if hit is not None:
        _remember(w, hit[2])
        return hit[2]
    size = w.size * 8
    if _bytes + size > budget():
        return None
    writes = _writes
    copy = w.astype(np.float64)  # exact: every bf16/f16/f32 value is a float64 value
    with _lock:
        if _owned.get(key) is not ref or _writes != writes:  # handed out or written while we copied
            return None
        new = key not in _entries
        _entries.setdefault(key, {})[k] = (*_bounds(w), copy)
        _bytes += size
        if new:
            _reindex()
        _remember(w, copy)
    return copy


def _remember(w, copy) -> None:
    """float64_of(w) is ``copy`` until a copy is dropped (or ``w`` dies: its id may be reused)."""
    key = id(w)
    _hits[key] = (weakref.ref(w, lambda _, key=key: _hits.pop(key, None)), w.shape, w.strides, w.dtype, copy)
