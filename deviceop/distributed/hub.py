"""The rendezvous hub of the reference backend: N thread-ranks of one process
meet here, for host-side exchanges and for every collective.

A meeting is a *slot*, named by its channel and the per-rank sequence number
of the call (``("coll", 7)``: the eighth collective each rank issues).  Each
rank posts its entry and waits; the last to arrive computes the result for
all (``combine``), so nothing is read after a rank has written its output.
Every wait is bounded by the group's timeout; a timeout, a rank that failed
(``fail``) or entries that disagree abort the whole hub, and every rank then
waiting or arriving later gets a DistributedError naming the cause — a
thread-rank never waits forever, as NCCL's ranks do not once the
communicator is aborted.

Point to point is a *mailbox* instead, as NCCL buffers a small send: ``post``
leaves the sender's message (copied by the caller at send time) under its
(src, dst, n) key and returns at once, so a ring in which every rank sends
before it receives completes; ``take`` waits for it (bounded, naming the
peer; at once if the peer closed its group without sending) and checks it.
"""
from __future__ import annotations

import threading
import time

from ..errors import DistributedError


class _Slot:
    __slots__ = ("entries", "parties", "result", "error", "done", "left")

    def __init__(self, parties: tuple):
        self.entries, self.parties = {}, parties
        self.result = self.error = None
        self.done, self.left = False, 0


class Hub:
    """Where the thread-ranks of one ``run_reference`` meet (see the module docstring)."""

    def __init__(self, world_size: int, timeout: float):
        self.world_size, self.timeout = world_size, timeout
        self._cond = threading.Condition()
        self._slots: dict = {}
        self._mail: dict = {}            # (src, dst, n) -> a posted send's message, until its recv takes it
        self.aborted: str | None = None  # why the hub was aborted, once it is
        self.closed: set = set()         # ranks that closed their group (they will issue nothing more)
        self.first_failure = None        # (rank, exception) of the first rank that raised

    def abort(self, why: str) -> None:
        with self._cond:
            if self.aborted is None:
                self.aborted = why
            self._cond.notify_all()

    def leave(self, rank: int) -> None:
        """Rank ``rank`` closed its group: a meeting still waiting for it fails now."""
        with self._cond:
            self.closed.add(rank)
            self._cond.notify_all()

    def fail(self, rank: int, exc: BaseException) -> None:
        """Rank ``rank`` raised ``exc``: the others must not wait for it."""
        with self._cond:
            self._failed(rank, exc, f"rank {rank} failed: {type(exc).__name__}: {exc}")

    def _failed(self, rank: int, exc: BaseException, why: str) -> None:
        """Record the first failure (before anyone can wake to a later one) and abort (lock held)."""
        if self.first_failure is None:
            self.first_failure = (rank, exc)
        if self.aborted is None:
            self.aborted = why
        self._cond.notify_all()

    def meet(self, rank: int, key, entry, what: str, combine, parties: tuple | None = None,
             timeout: float | None = None):
        """Post ``entry`` for slot ``key`` and wait for the other ``parties`` (all ranks by
        default); the last to arrive calls ``combine({rank: entry})``, whose result every
        party gets (an exception it raises is every party's).  ``what`` names the call in errors."""
        parties = parties if parties is not None else tuple(range(self.world_size))
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            self._check(what)
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot(parties)
            slot.entries[rank] = entry
            if len(slot.entries) == len(slot.parties):
                try:
                    slot.result = combine(slot.entries)
                except BaseException as exc:  # disagreeing entries: every party gets the error, and the hub stops
                    slot.error = exc
                    self._failed(rank, exc, f"{what}: {exc}")
                slot.done = True
                self._cond.notify_all()
            while not slot.done:
                if self.aborted is not None:
                    self._leave(key, slot)
                    self._check(what)
                left = deadline - time.monotonic()
                missing = [r for r in slot.parties if r not in slot.entries]
                gone = [r for r in missing if r in self.closed]
                if left <= 0 or gone:
                    why = (f"{what} on rank {rank}: rank(s) {gone} closed their group without issuing it" if gone else
                           f"{what} timed out after {timeout:g} s on rank {rank}: rank(s) {missing} never issued it "
                           "(a rank failed or hung, or the ranks issued different sequences of collectives)")
                    error = DistributedError(f"{why}. Every rank must issue the same collectives in the same order; "
                                             "the group is aborted: make a new one")
                    self._failed(rank, error, why)
                    self._leave(key, slot)
                    raise error
                self._cond.wait(left)
            self._leave(key, slot)
            if slot.error is not None:  # each party raises its own copy (one object raised in many threads is not)
                raise type(slot.error)(*slot.error.args)
            return slot.result

    def post(self, key, message, what: str) -> None:
        """Leave a send's ``message`` under ``key`` for its recv; returns without waiting for it."""
        with self._cond:
            self._check(what)
            if key[1] in self.closed:  # nothing will ever receive it
                error = DistributedError(f"{what} on rank {key[0]}: rank {key[1]} already closed its group, so nothing "
                                         "will receive this send. Every send needs the peer's matching recv, in the "
                                         "same order; the group is aborted: make a new one")
                self._failed(key[0], error, str(error))
                raise error
            self._mail[key] = message
            self._cond.notify_all()

    def unreceived(self) -> list:
        """``"rank s's send #n to rank d (count x dtype)"`` for each posted send no recv took."""
        with self._cond:
            return [f"rank {src}'s send #{n} to rank {dst} ({m[1]} x {m[0]})"
                    for (src, dst, n), m in sorted(self._mail.items())]

    def take(self, rank: int, key, peer: int, what: str, accept, timeout: float | None = None) -> None:
        """Wait for the message posted under ``key`` by rank ``peer`` and hand it to ``accept``
        (which checks it against the recv and writes the output); an exception it raises, a
        timeout, or a peer that closed its group without sending aborts the hub."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._check(what)
                if key in self._mail:
                    message = self._mail.pop(key)
                    try:
                        return accept(message)
                    except BaseException as exc:  # a send and recv that disagree: the group is done
                        self._failed(rank, exc, f"{what}: {exc}")
                        raise
                left = deadline - time.monotonic()
                if left <= 0 or peer in self.closed:
                    why = (f"{what} on rank {rank}: rank {peer} closed its group without sending it" if left > 0 else
                           f"{what} timed out after {timeout:g} s on rank {rank}: rank {peer} never sent it "
                           "(it failed or hung, or the ranks' sends and receives do not pair up)")
                    error = DistributedError(f"{why}. Every recv needs the peer's matching send, in the same order; "
                                             "the group is aborted: make a new one")
                    self._failed(rank, error, why)
                    raise error
                self._cond.wait(left)

    def _leave(self, key, slot: _Slot) -> None:
        slot.left += 1
        if slot.left >= len(slot.parties) or slot.error is not None or self.aborted is not None:
            self._slots.pop(key, None)

    def _check(self, what: str) -> None:
        if self.aborted is not None:
            raise DistributedError(f"{what} cannot complete: the group was aborted ({self.aborted}). "
                                   "Fix the failing rank; a new group (dist.run_reference / dist.init) starts clean")
