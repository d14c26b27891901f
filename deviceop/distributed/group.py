"""A Group: this process's (or thread-rank's) place among the ranks, the
host-side exchanges between them, and the backend that runs collectives.

Two parts do the work, one per side of the host/device line:

* the *exchanger* moves small picklable objects between ranks on the host
  (the launcher's store, or the reference hub): ``exchange`` and ``barrier``,
  the unique id at init, the checks that ranks agree;
* the *backend* enqueues collectives on a stream (NCCL, or the reference
  backend's tape steps) — what ``deviceop.distributed.ops`` calls.

Every host-side wait is bounded by ``timeout``; a failure aborts the group
(the backend's communicator too, so that no rank's GPU waits forever for a
peer that will not come), and every later use raises DistributedError.
"""
from __future__ import annotations

import hashlib
import math
import pickle
import threading
import time
import weakref

import numpy as np

from ..errors import DistributedError, StateError
from ..graph.capture import ReplayCheck
from ..memory import Partition
from ..runtime.stream import sync_in_capture
from ..tensor import SharedTensor, Tensor


class GroupClosedError(DistributedError, StateError):
    """A group used after ``close()`` or after it was aborted (a rank failed, hung or
    disagreed): a StateError (the group is done for good) and a DistributedError."""


def check_timeout(timeout, what: str = "a group's timeout", longest: float = threading.TIMEOUT_MAX) -> float:
    """``timeout`` as seconds: a finite positive number (every wait for another rank is bounded),
    at most ``longest`` (the longest wait Python's locks make: a longer one failed at the first
    wait for a peer with a raw OverflowError)."""
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout) \
        and 0 < timeout <= longest
    if not ok:
        raise DistributedError(f"{what}: timeout is a finite positive number of seconds, at most {longest:.3g} (the "
                               f"longest wait Python makes), got {timeout!r}")
    return float(timeout)


class Group:
    """The ranks of one job, seen from one of them (made by ``dist.init`` or
    ``dist.run_reference``).  ``with dist.init() as group:`` closes it at the end,
    and aborts it (so that the other ranks fail at once) if the block raised."""

    def __init__(self, rank: int, world_size: int, device, stream, exchanger, backend, timeout: float,
                 launcher: str):
        self.rank, self.world_size = rank, world_size
        self.device, self.stream = device, stream
        self.timeout, self.launcher = timeout, launcher
        self._exchanger, self._backend = exchanger, backend
        self._exchanges = 0        # how many host exchanges this rank made (their sequence numbers)
        self._agreed = set()       # collective signatures every rank has been seen to issue alike
        self._state = "open"       # open, closed, or aborted: <why>
        # one thread at a time issues host exchanges and collectives (an NCCL communicator is not
        # thread-safe, and two threads' calls would pair up across ranks in no particular order)
        self._user = threading.RLock()
        self.replay_check = _GroupReplayCheck(self)  # what graphs holding its collectives check at each replay
        self._peer_bufs = weakref.WeakSet()  # its open dist.PeerBuffers, whose error words synchronize() reads

    @property
    def backend(self) -> str:
        """``"nccl"`` or ``"reference"``."""
        return self._backend.name

    def __repr__(self) -> str:
        return (f"<deviceop Group rank {self.rank}/{self.world_size} on {self.device.label} "
                f"({self.backend}, {self._state})>")

    # -- host-side exchanges ----------------------------------------------------------
    def exchange(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order: a host-side all-gather through
        the launcher's store (or the reference hub), bounded by the group's timeout.
        Each rank gets its own copies (unpickled), thread-ranks too; an object pickle
        cannot send fails the exchange on every rank, and so do ranks at different kinds of
        exchange (one in ``exchange``, another in ``barrier``, ``check_same`` or
        ``dist.PeerBuffers``): the group is then aborted."""
        return self._exchange(obj, "group.exchange()")

    def _exchange(self, obj, kind: str) -> list:
        """``exchange`` as ``kind`` (what deviceop's own exchanges call themselves): every rank
        must be at an exchange of the same kind, or each raises instead of taking another
        kind's objects for its own."""
        self._check_open(kind)
        try:
            payload = pickle.dumps((kind, obj), protocol=4)
        except Exception as exc:  # noqa: BLE001 - pickle raises many kinds; the others must learn of it too
            payload = _Unsendable(f"{type(obj).__name__}: {exc}")
        with self.using("group.exchange()"):
            seq, self._exchanges = self._exchanges, self._exchanges + 1
            try:
                found = self._exchanger.exchange(self.rank, seq, payload, f"{kind} #{seq}", self.timeout)
            except DistributedError as exc:
                self.abort(str(exc))
                raise
        bad = {r: p.why for r, p in enumerate(found) if isinstance(p, _Unsendable)}
        if bad:
            raise DistributedError(f"group.exchange() #{seq}: rank(s) {sorted(bad)} passed an object pickle cannot "
                                   f"send ({'; '.join(dict.fromkeys(bad.values()))}); exchange plain data (numbers, "
                                   "strings, lists, dicts, NumPy arrays: a tensor's .numpy())")
        found = [pickle.loads(p) for p in found]
        kinds = [k for k, _ in found]
        if any(k != kind for k in kinds):
            self.abort(f"{kind}: the ranks were at different exchanges")
            raise DistributedError(f"{kind} #{seq} on rank {self.rank}: the ranks were at different host exchanges at "
                                   f"this point: {describe_ranks(kinds)}. Every rank must make the same exchanges "
                                   "(barrier, check_same, PeerBuffers, collectives' checks, a tensor-parallel model's "
                                   "checks) in the same order; the group is aborted")
        return [o for _, o in found]

    def using(self, what):
        """Hold the group for this thread while it exchanges or issues (re-entrant); another
        thread that tries meanwhile gets DistributedError instead of mixing its calls in."""
        if not self._user.acquire(blocking=False):
            what = what if isinstance(what, str) else what.describe()
            raise DistributedError(f"{what} on rank {self.rank}: the group is being used from two threads at once "
                                   "(an NCCL communicator is not thread-safe, and the ranks would pair the two "
                                   "threads' calls in no fixed order); issue one rank's collectives from one thread "
                                   "at a time")
        return _Release(self._user)

    def barrier(self) -> None:
        """Wait until every rank reaches this point (host side; the GPU's work is not waited for)."""
        self._exchange(None, "group.barrier()")

    def check_same(self, name: str, obj) -> str:
        """Refuse (DistributedError, on every rank) unless every rank passes an equal ``obj``
        (a config, a checkpoint's tensors ...): ranks exchange a 16-byte digest, not the
        object.  Returns the digest.  Arrays and tensors are hashed by dtype, shape and bytes
        (a tensor is copied to the host for it: pass a checkpoint's file digest instead of
        gigabytes of weights when that is cheaper)."""
        try:
            digest, unhashable = fingerprint(obj), None
        except DistributedError as exc:  # said on every rank: the others must not wait or pass
            digest, unhashable = None, str(exc)
        digests = self._exchange((name, digest, unhashable), "group.check_same()")
        failed = {r: why for r, (_, _, why) in enumerate(digests) if why is not None}
        if failed:
            raise DistributedError(f"check_same({name!r}): rank(s) {sorted(failed)} cannot hash its value: "
                                   f"{next(iter(failed.values()))}")
        digests = [(n, d) for n, d, _ in digests]
        differ = [r for r, nd in enumerate(digests) if nd != digests[0]]  # named alike on every rank
        if differ:
            names = sorted({n for n, _ in digests})
            what = f"{name!r}" if names == [name] else f"{name!r} (the ranks checked {names} at this point)"
            self.abort(f"check_same({name!r}) found ranks that disagree")
            raise DistributedError(
                f"check_same: ranks disagree on {what}: rank(s) {differ} hold a different value than rank 0. "
                "Every rank must load the same config and weights (same files, same arguments); "
                "the group is aborted: fix the inputs and start again")
        return digest

    # -- the collectives' side ----------------------------------------------------------
    def agree(self, signature: tuple, what) -> None:
        """Check once per distinct collective signature that every rank issues it alike
        (dtype, count, reduction, root): the first call with a new signature costs one
        host exchange; later ones a set lookup."""
        if signature in self._agreed:
            return
        what = what if isinstance(what, str) else what.describe()  # (a Call: described when it is needed)
        seen = self._exchange(("collective", signature), "the collectives' check")
        differ = [r for r, s in enumerate(seen) if s != ("collective", signature)]
        if differ:
            self.abort(f"{what} disagreed across ranks")
            raise DistributedError(
                f"{what}: ranks issued different collectives at this point: {describe_ranks(seen)}. Every rank "
                "must issue the same collectives, in the same order, with the same dtype, count, reduction and "
                "root; the group is aborted")
        self._agreed.add(signature)

    def issue(self, stream, call) -> None:
        """Enqueue ``call`` (ops.Call) on ``stream`` through the backend."""
        if self._state != "open":
            self._check_open(call.describe())
        with self.using(call):  # (described only in an error: an eager collective's host cost counts)
            self._backend.issue(self, stream, call)

    def synchronize(self, stream=None, timeout: float | None = None) -> None:
        """Wait for ``stream``'s work (default: the group's stream), at most ``timeout`` seconds
        (the group's): a replay or collective stuck on a peer that hung or died aborts the
        group and raises DistributedError instead of waiting forever (``stream.synchronize()``
        would); so does a one-shot all-reduce (dist.PeerBuffers) that gave up waiting for a
        peer and wrote NaN."""
        self._check_open("group.synchronize()")
        stream = stream if stream is not None else self.stream
        if getattr(stream, "device", None) is not self.device:
            raise DistributedError(f"group.synchronize(stream={stream!r}) on rank {self.rank}: pass a stream of the "
                                   f"group's device ({self.device.label}), such as group.stream, or none for it")
        timeout = self.timeout if timeout is None else check_timeout(timeout, "group.synchronize()")
        if stream.is_capturing():  # (it failed in the event query, naming an event the user never made)
            raise sync_in_capture("group.synchronize()", "cuStreamSynchronize")
        event, deadline, pause = stream.record_event(timing=False), time.monotonic() + timeout, 0.00005
        while not event.query():
            if self._state != "open":
                raise DistributedError(f"rank {self.rank}: the group was {self._state} while waiting for its stream")
            if time.monotonic() > deadline:
                self.abort(f"rank {self.rank}'s stream did not finish within {timeout:g} s")
                raise DistributedError(f"rank {self.rank}: the stream's work did not finish within {timeout:g} s (a "
                                       "collective waits for a peer that hung or died); the group is aborted")
            time.sleep(pause)
            pause = min(pause * 2, 0.001)
        for bufs in list(self._peer_bufs):  # a one-shot all-reduce that gave up on a peer wrote NaN: say so
            try:
                bufs.check(stream)
            except DistributedError as exc:
                self.abort(f"rank {self.rank}'s one-shot all-reduce gave up waiting for a peer")
                raise DistributedError(f"{exc}; the group is aborted") from None

    # -- life ---------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._state != "open":
            raise GroupClosedError(f"{what} on a group that was {self._state}: make a new group "
                                   "(dist.init / dist.run_reference)")

    def abort(self, why: str = "aborted by the user") -> None:
        """Stop the group at once: the backend's communicator is aborted (kernels
        waiting for peers return), the other ranks learn of it through the exchanger
        and fail instead of waiting; every later use raises DistributedError."""
        if self._state != "open":
            return
        self._state = f"aborted ({why})"
        try:
            self._exchanger.abort(self.rank, why)
        finally:
            self._backend.abort()

    def close(self) -> None:
        """Release the communicator (idempotent).  An aborted group stays aborted."""
        if self._state != "open":
            return
        self._state = "closed"
        try:
            self._backend.close()
        finally:
            self._exchanger.close(self.rank)

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None:
            self.abort(f"rank {self.rank} raised {kind.__name__}: {exc}")
        else:
            self.close()
        return False


def fingerprint(obj) -> str:
    """A 16-byte digest (hex) of ``obj``'s value, the same in every process for equal
    values: arrays and tensors (also inside dicts, lists and tuples) by dtype, shape and
    bytes; dicts and sets whatever their order; other objects by their pickle."""
    h = hashlib.blake2b(digest_size=16)
    try:
        _feed(h, obj)
    except RecursionError:  # a list that holds itself (pickle sends it; a value walk never ends)
        raise DistributedError(f"check_same cannot hash this {type(obj).__name__}: it contains itself or nests "
                               "deeper than Python's recursion limit; pass plain data (a dict of the config, a "
                               "file digest), arrays or tensors") from None
    return h.hexdigest()


def _feed(h, obj) -> None:
    if isinstance(obj, Partition):
        obj = obj.tensor
    if isinstance(obj, (Tensor, SharedTensor, np.ndarray)):
        host = obj if isinstance(obj, np.ndarray) else obj.numpy()
        h.update(f"array {host.dtype.name} {host.dtype.str} {host.shape}|".encode())
        if host.dtype.hasobject:  # references, not bytes: their values
            for item in host.reshape(-1):
                _feed(h, item)
        else:
            h.update(np.ascontiguousarray(host).view(np.uint8).data)
    elif type(obj) in (list, tuple):
        h.update(f"{type(obj).__name__} {len(obj)}|".encode())
        for item in obj:
            _feed(h, item)
    elif type(obj) in (dict, set, frozenset):  # equal whatever the order (a set's differs between processes)
        items = obj.items() if type(obj) is dict else ((k, None) for k in obj)
        parts = sorted(fingerprint(k) + fingerprint(v) for k, v in items)
        h.update(f"{type(obj).__name__} {len(parts)}|{''.join(parts)}".encode())
    else:
        try:
            h.update(pickle.dumps(obj, protocol=4))
        except Exception as exc:  # noqa: BLE001 - pickle raises many kinds
            raise DistributedError(f"check_same cannot hash a {type(obj).__name__} ({exc}); pass plain data (a dict "
                                   "of the config, a file digest), arrays or tensors") from None


class _Unsendable:
    """What a rank contributes to an exchange when pickle cannot send its object."""

    def __init__(self, why: str):
        self.why = why


class _Release:
    __slots__ = ("lock",)

    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.lock.release()


class _GroupReplayCheck(ReplayCheck):
    """Kept by every graph that captured one of the group's collectives: a replay after
    the group closed (its communicator destroyed) or aborted is refused."""

    __slots__ = ("group",)

    def __init__(self, group):
        self.group = group

    def check_replay(self) -> None:
        group = self.group
        if group._state != "open":
            raise GroupClosedError(f"this graph holds collectives of rank {group.rank}'s group, which was "
                                   f"{group._state}: its communicator is gone, so the graph cannot replay; make a new "
                                   "group and capture the graph again")


def describe_ranks(values: list) -> str:
    """``rank 0: ..., rank 1: ...`` grouped by value (for errors about disagreeing ranks)."""
    by_value: dict = {}
    for r, v in enumerate(values):
        by_value.setdefault(repr(v), []).append(r)
    return "; ".join(f"rank(s) {ranks}: {v}" for v, ranks in by_value.items())
