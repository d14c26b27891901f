"""The reference backend: N ranks as threads of one process, on reference
devices, computing collectives with NumPy — so that their semantics (and
their refusals) are tested on a machine without a GPU.

Each thread-rank has its own reference device (a host sync on one never
touches another's capture, as separate processes' GPUs would not) and its own
stream.  A collective is a tape step: run at once eagerly, recorded while the
stream captures, and run again by each replay; when it runs it meets the
other ranks' same step in the hub (hub.py), where the last to arrive checks
that every rank issued the same collective (kind, dtype, count, reduction,
root) and computes every rank's output.  A send is posted to the hub's
mailbox (copied when it runs) and completes without its recv, as NCCL's small
sends do; the recv waits for it, checks dtype and count, and copies it out.
"""
from __future__ import annotations

import operator
import threading
import time

import numpy as np

from ..errors import DistributedError
from ..runtime import refcache
from ..runtime.reference import ReferenceDevice
from .group import Group, check_timeout, describe_ranks
from .hub import Hub

DEFAULT_TIMEOUT = 10.0  # seconds a thread-rank waits for the others at any meeting


class HubExchanger:
    """Host-side exchanges through the hub (the store's part, for thread-ranks)."""

    def __init__(self, hub: Hub):
        self.hub = hub

    def exchange(self, rank, seq, obj, what, timeout):
        return self.hub.meet(rank, ("exchange", seq), obj, what,
                             lambda entries: [entries[r] for r in range(self.hub.world_size)], timeout=timeout)

    def abort(self, rank, why):
        self.hub.abort(f"rank {rank} aborted its group: {why}")

    def close(self, rank):
        self.hub.leave(rank)


class _Step:
    """A collective on the reference device's tape (what a kernel node is on a GPU):
    ``run`` meets the other ranks; ``take`` is a recapture's update of its arguments."""

    __slots__ = ("backend", "group", "call")
    kind = "kernel"  # a GPU graph shows NCCL's work as kernel nodes too

    def __init__(self, backend, group, call):
        self.backend, self.group, self.call = backend, group, call

    @property
    def name(self) -> str:
        return f"dist.{self.call.kind}"

    def run(self) -> None:
        with self.group.using(self.call):  # (a replay from another thread is a use too)
            self.backend.run(self.group, self.call)

    def take(self, other: "_Step") -> None:
        self.group, self.call = other.group, other.call


class ReferenceBackend:
    name = "reference"

    def __init__(self, hub: Hub, rank: int):
        self.hub, self.rank = hub, rank
        self._collectives = 0   # sequence number of this rank's next collective (taken when a step runs)
        self._pairs: dict = {}  # (src, dst) -> sequence number of the next send/recv between them

    def issue(self, group, stream, call) -> None:
        stream._run(_Step(self, group, call))  # runs now, or is recorded while the stream captures

    def run(self, group, call) -> None:
        try:
            self._meet(group, call)
        except DistributedError as exc:  # this rank's group is done too: later uses say so at once
            group.abort(str(exc))
            raise

    def _meet(self, group, call) -> None:
        what = call.describe()
        if call.kind in ("send", "recv"):  # a send does not wait for its recv (NCCL buffers small ones)
            src, dst = (self.rank, call.peer) if call.kind == "send" else (call.peer, self.rank)
            n = self._pairs.get((src, dst), 0)
            self._pairs[(src, dst)] = n + 1
            if call.kind == "send":  # copied now: the sender may overwrite its buffer before the recv runs
                self.hub.post((src, dst, n), (call.dtype.name, call.count, _host(call.send).copy()), what)
            else:
                self.hub.take(self.rank, (src, dst, n), src, what,
                              lambda sent: _deliver(sent, (call.dtype.name, call.count), _host(call.recv), src, dst))
            return
        seq, self._collectives = self._collectives, self._collectives + 1
        entry = (call.signature, None if call.send is None else _host(call.send), _host(call.recv))
        self.hub.meet(self.rank, ("collective", seq), entry, f"{what} (collective #{seq})",
                      lambda entries: _compute(entries, f"collective #{seq}"))

    def abort(self) -> None:
        self.hub.abort(f"rank {self.rank} aborted its communicator")

    def close(self) -> None:
        pass


def _host(t) -> np.ndarray:
    refcache.disown(t._array)  # written by other ranks' threads: no float64 copy of it is kept
    return t._array.reshape(-1)  # the reference device's memory is this array


def _compute(entries: dict, which: str) -> None:
    """Every rank's output of one collective, from every rank's input (the last rank to arrive)."""
    ranks = sorted(entries)
    sigs = [entries[r][0] for r in ranks]
    if any(s != sigs[0] for s in sigs):
        names = [dict(zip(("kind", "dtype", "count", "op", "root"), s)) for s in sigs]
        raise DistributedError(f"{which}: ranks issued different collectives: {describe_ranks(names)}. "
                               "Every rank must issue the same collectives in the same order, with the same dtype, "
                               "count, reduction and root; the group is aborted")
    kind, _, count, reduce, root = sigs[0]
    sends = [entries[r][1] for r in ranks]
    recvs = [entries[r][2] for r in ranks]
    if kind == "broadcast":
        value = sends[root].copy()
        for r, out in zip(ranks, recvs):
            if r != root:  # the root only reads its buffer (NCCL's in-place broadcast): it may be read-only
                out[...] = value
        return
    if kind == "all_gather":
        value = np.concatenate(sends)
        for out in recvs:
            out[...] = value
        return
    total = _reduce(sends, reduce, recvs[0].dtype)  # every input read before any output is written
    if kind == "all_reduce":
        for out in recvs:
            out[...] = total
    else:  # reduce_scatter: rank r gets chunk r
        for r, out in zip(ranks, recvs):
            out[...] = total[r * count:(r + 1) * count]


def _reduce(arrays: list, how: str, dtype) -> np.ndarray:
    if dtype.kind == "f" or dtype.name == "bfloat16":  # in float64, rounded once (NCCL's rounding may differ)
        stack = np.stack([a.astype(np.float64) for a in arrays])
    else:
        stack = np.stack(arrays)
    if how in ("sum", "avg"):
        total = stack.sum(axis=0, dtype=stack.dtype)  # integers wrap, as NCCL's do
        if how == "avg":
            total = total / len(arrays)
    elif how == "prod":
        total = stack.prod(axis=0, dtype=stack.dtype)
    else:
        total = stack.max(axis=0) if how == "max" else stack.min(axis=0)
    return total.astype(dtype)


def _deliver(sent: tuple, expected: tuple, out: np.ndarray, src: int, dst: int) -> None:
    """Write a posted send's message into its recv's output, once they agree on dtype and count."""
    if sent[:2] != expected:
        raise DistributedError(f"rank {src} sent {sent[1]} x {sent[0]} to rank {dst}, which expected "
                               f"{expected[1]} x {expected[0]}: a send and its recv must match in dtype and count")
    out[...] = sent[2]


# -- run_reference ----------------------------------------------------------------------

def rank_device(rank: int) -> ReferenceDevice:
    """A reference device of one thread-rank's own (not the process's ``Device(0)``)."""
    device = object.__new__(ReferenceDevice)
    device._setup(0)
    device.label = f"reference (rank {rank})"
    return device


def reference_group(rank: int, hub: Hub, device=None) -> Group:
    device = device if device is not None else rank_device(rank)
    return Group(rank, hub.world_size, device, device.new_stream(), HubExchanger(hub), ReferenceBackend(hub, rank),
                 hub.timeout, "reference")


def run_reference(world_size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT) -> list:
    """Run ``fn(group, *args)`` on ``world_size`` thread-ranks of the reference backend
    and return each rank's result, in rank order.

    A rank that raises aborts the group: the others fail (DistributedError) at their
    next meeting instead of waiting, and ``run_reference`` raises the first rank's
    exception.  Every meeting is bounded by ``timeout`` seconds, so a rank that hangs
    or skips a collective makes the others fail, naming the collective."""
    given = world_size
    try:
        world_size = None if isinstance(world_size, bool) else operator.index(world_size)
    except TypeError:
        world_size = None
    if world_size is None or world_size < 1:
        raise DistributedError(f"run_reference needs a world size: an int >= 1, got {given!r}")
    if not callable(fn):
        raise DistributedError(f"run_reference(world_size, fn): fn must be callable as fn(group, *args), got a "
                               f"{type(fn).__name__}")
    timeout = check_timeout(timeout, "run_reference")
    hub = Hub(world_size, timeout)
    results, errors = [None] * world_size, {}

    def main(rank: int) -> None:
        group = None
        try:
            group = reference_group(rank, hub)
            results[rank] = fn(group, *args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[rank] = exc
            hub.fail(rank, exc)  # recorded as the first failure unless another rank's came first
            if group is not None:
                group.abort(f"rank {rank} raised {type(exc).__name__}")
        else:
            group.close()

    threads = [threading.Thread(target=main, args=(r,), name=f"deviceop-rank-{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    _join(threads, hub, timeout)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        raise DistributedError(f"run_reference: rank(s) {hung} did not return within {timeout:g} s of the group's "
                               f"abort ({hub.aborted}); they hang outside deviceop's collectives")
    if errors:
        rank, first = hub.first_failure
        others = {r: e for r, e in errors.items() if r != rank}
        if others and hasattr(first, "add_note"):
            first.add_note("the other ranks then failed: " + "; ".join(
                f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(others.items())))
        raise first
    lost = hub.unreceived()
    if lost:  # a message no rank took: silently dropped before, though the program's pairs do not match
        raise DistributedError(f"run_reference: {', '.join(lost)} was never received: the ranks' sends and receives "
                               "do not pair up. Every send needs the peer's matching recv, in the same order")
    return results


def _join(threads, hub: Hub, timeout: float) -> None:
    """Wait for every thread-rank; once the group is aborted, at most ``timeout`` more."""
    deadline = None
    for t in threads:
        while t.is_alive():
            if hub.aborted is not None and deadline is None:
                deadline = time.monotonic() + timeout
            if deadline is not None and time.monotonic() > deadline:
                return
            t.join(0.02)
