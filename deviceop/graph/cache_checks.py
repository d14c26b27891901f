"""What a GraphCache refuses, and when: its options when it is made (not at its
first call), keys that could never hit (every call would capture and hold
another graph), and a pad value its inputs' dtype cannot hold (before anything
is captured or copied)."""
from __future__ import annotations

import operator
import re

import numpy as np

from ..errors import DTypeError, LaunchError, ShapeError, StateError
from ..runtime.device import placed
from ..runtime.stream import not_a_stream


def count(name: str, v) -> int:
    """``v`` as an int >= 1 (NumPy ints too); a float, even 2.0, is refused rather than truncated."""
    if not isinstance(v, bool):
        try:
            n = operator.index(v)
        except TypeError:
            n = 0
        if n >= 1:
            return n
    raise ShapeError(f"{name} must be an int >= 1, got {v!r}")


def check_options(fn, stream, key, pad_value, **flags) -> None:
    """Refuse GraphCache options of the wrong kind (sizes and bounds are ``count``'s)."""
    if not callable(fn):
        raise LaunchError(f"the GraphCache's function must be callable as fn(ws, *inputs) -> op, "
                          f"got {type(fn).__name__}")
    if key is not None and not callable(key):
        raise LaunchError(f"the GraphCache's key must be a callable (or None), called as key(*inputs); "
                          f"got {type(key).__name__}")
    if stream is None:  # placed() would take None for the default stream; a cache needs its own
        raise not_a_stream("a GraphCache (stream=...)", stream)
    placed("a GraphCache (stream=...)", None, stream)  # not a stream, or a closed one: refused now
    for flag, on in flags.items():
        if not isinstance(on, (bool, np.bool_)):
            raise LaunchError(f"GraphCache's {flag} must be True or False, got {on!r}")
    if pad_value is not None and (isinstance(pad_value, (bool, np.bool_))
                                  or not isinstance(pad_value, (int, float, np.integer, np.floating))):
        raise DTypeError(f"pad_value must be a number (or None: leave padded rows as they are), got {pad_value!r}")


def check_pad(pad_value, inputs, fits: set) -> None:
    """Refuse a pad value an input's dtype cannot hold (300 in int8, 0.5 in int32): a fill
    would wrap it on the GPU and raise NumPy's error on the reference device.  ``fits``
    holds the dtypes already found to hold it."""
    for i, t in enumerate(inputs):
        if t.dtype in fits:
            continue
        try:
            t.dtype.coerce(pad_value)
        except DTypeError as exc:
            raise DTypeError(f"pad_value {pad_value!r} does not fit GraphCache input {i} ({t.dtype.name}): {exc}; "
                             "pass a pad_value the inputs' dtype holds") from None
        fits.add(t.dtype)


_EQUAL = object()


def _unequal_part(key):
    """The part of ``key`` that does not equal itself (a NaN), else ``_EQUAL``.  Tuples and
    frozensets compare their items by identity first, so a fresh NaN inside one would still
    miss: they are searched item by item."""
    if isinstance(key, (tuple, frozenset)):
        for part in key:
            odd = _unequal_part(part)
            if odd is not _EQUAL:
                return odd
        return _EQUAL
    return _EQUAL if bool(key == key) else key


def checked_key(key_fn, inputs):
    """``key_fn(*inputs)``, refused unless it is hashable and equals itself."""
    try:
        key = key_fn(*inputs)
        steady = hash(key) == hash(key)  # a hash that changes loses the graph in the cache's dict (a raw KeyError)
        odd = _unequal_part(key)  # its == may raise too: a key that cannot be compared is refused here
    except Exception as exc:
        raise StateError(f"the GraphCache key function failed on inputs of shapes {[t.shape for t in inputs]}: "
                         f"{exc!r}; it must return a hashable key that equals itself") from exc
    if not steady:
        raise StateError(f"the GraphCache key {key!r} hashes to another value each time it is hashed: the cache "
                         "could never find its graph again; return a key whose hash is fixed (a tuple of ints "
                         "and strings, a frozen dataclass)")
    if odd is not _EQUAL:
        part = "" if odd is key else f" holds {odd!r}, which"
        raise StateError(f"the GraphCache key {key!r}{part} does not equal itself (NaN never does): it would never "
                         "hit, and every call would capture and hold another graph; return a key that equals "
                         "itself (replace the NaN, e.g. by None)")
    return key


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # what object.__repr__ adds: <K object at 0x7f...>


def check_new_key(key_fn, key, held) -> None:
    """Refuse a missed ``(size, key)`` that prints as one of the ``held`` ones, also but for
    the addresses in it: it holds something unequal to its copy (a NaN in a dataclass, an
    object compared by identity and made anew by every call), so it would miss every call."""
    if key_fn is None:
        return
    text = repr(key)
    bare = _ADDRESS.sub("", text)
    for other in held:
        if other[0] != key[0]:
            continue
        shown = repr(other)
        if shown == text:
            raise StateError(f"the GraphCache key {key[1]!r} does not equal the key {other[1]!r} of a held graph "
                             "that prints the same: it holds something unequal to its copy (NaN never equals "
                             "itself, nor an object compared by identity, made anew by each call, any other), so "
                             "every call would capture and hold another graph; return a key that equals its copy "
                             "(replace the NaN, e.g. by None; key by value: shapes, ints, strings)")
        if bare != text and _ADDRESS.sub("", shown) == bare:
            raise StateError(f"the GraphCache key {key[1]!r} prints as the key {other[1]!r} of a held graph but "
                             "for its address: it holds an object compared by identity (object(), an instance "
                             "without __eq__, a lambda) made anew by each call, so every call would capture and "
                             "hold another graph; return a key compared by value (a tuple of ints and strings, "
                             "a frozen dataclass)")
