"""The NCCL backend, through nccl4py (imported here, lazily: a machine without
libnccl — CPU CI — never loads it).

Bootstrap: rank 0 asks NCCL for a unique id, the store carries it to the
others (in an exchange that also checks that every rank has the same world
size and multicast setting, and a GPU of its own where ranks share a host),
and each rank builds its communicator on its GPU.  Collectives are nccl4py's low-level
calls with raw device pointers and our stream's handle — no buffer protocol
or stream wrapping per call — so a captured stream records NCCL's own kernels
into the graph, and an eager call costs the host a few microseconds more
than NCCL itself.

Faults: a watchdog thread beats a heartbeat into the store, and aborts the
communicator (``ncclCommAbort``: kernels waiting for a peer return) when a
rank aborted the group, a peer's heartbeat stopped for the group's timeout
(the process died), NCCL reports an asynchronous error, or an eager
collective has not completed within the timeout (a peer hung).  Every rank
then gets a DistributedError at its next use of the group, and
``group.synchronize()`` waits for a stream with the same bound.
"""
from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import weakref

from ..errors import DistributedError
from .group import Group
from .store import StoreExchanger

_REDUCTIONS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}  # ncclRedOp_t
_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7,
           "float64": 8, "bfloat16": 9}  # ncclDataType_t


def _nccl():
    try:
        import nccl.bindings.nccl as low
        import nccl.core as core
    except ImportError as exc:
        raise DistributedError(f"the NCCL backend needs nccl4py ({exc}): pip install nccl4py (its wheel is in "
                               ".whl/ for the GPU machines), with libnccl (nvidia-nccl-cu13)") from None
    return core, low


class NcclBackend:
    """Collectives on one NCCL communicator (see the module docstring)."""

    name = "nccl"

    def __init__(self, comm, low, rank: int, timeout: float, device):
        self.comm, self.low, self.rank, self.timeout, self.device = comm, low, rank, timeout, device
        self.handle = low.Comm(comm.ptr)  # what the low-level calls take
        self.error = None          # why the watchdog aborted the communicator, once it has
        self._watch: dict = {}     # stream handle -> _Watch of its eager collectives
        self._pairs_agreed = set()  # (kind, peer, dtype, count) of sends/recvs checked with the peer
        self._pair_seq: dict = {}   # (src, dst) -> how many pair checks they made
        self._lock = threading.Lock()

    def issue(self, group, stream, call) -> None:
        if self.error is not None:
            raise DistributedError(f"{call.describe()}: the communicator was aborted ({self.error}); make a new group")
        if call.kind not in ("send", "recv"):
            group.agree(call.signature, call)
        elif (call.kind, call.peer, call.dtype.name, call.count) not in self._pairs_agreed:
            self._agree_pair(group, call)
        # NCCL switches to the communicator's device and back to the current one, which on a thread with
        # no context current is GPU 0: bound first, nothing opens GPU 0 (also in abort and close)
        stream.device.bind()
        dt, s, h = _DTYPES[call.dtype.name], stream.ptr, self.handle
        send = call.send.data_ptr if call.send is not None else 0
        recv = call.recv.data_ptr if call.recv is not None else 0
        kind = call.kind
        try:
            if kind == "all_reduce":
                self.low.all_reduce(send, recv, call.count, dt, _REDUCTIONS[call.reduce], h, s)
            elif kind == "all_gather":
                self.low.all_gather(send, recv, call.count, dt, h, s)
            elif kind == "reduce_scatter":
                self.low.reduce_scatter(send, recv, call.count, dt, _REDUCTIONS[call.reduce], h, s)
            elif kind == "broadcast":
                self.low.broadcast(send, recv, call.count, dt, call.root, h, s)
            elif kind == "send":
                self.low.send(send, call.count, dt, call.peer, h, s)
            else:
                self.low.recv(recv, call.count, dt, call.peer, h, s)
        except self.low.NCCLError as exc:
            detail = self._last_error()
            group.abort(f"{call.describe()} failed in NCCL: {exc}")
            raise DistributedError(f"{call.describe()} failed in NCCL: {exc}{detail}; the group is aborted") from None
        if not stream.is_capturing():  # eager: the watchdog bounds how long it may take
            with self._lock:
                watch = self._watch.get(s)
                if watch is None:
                    watch = self._watch[s] = _Watch(stream)
                watch.issued(call)

    def _agree_pair(self, group, call) -> None:
        """Check, once per new (peer, dtype, count), that a send and its recv match (NCCL
        would hang or write past the receive buffer), as the reference backend checks every
        pair: the sender posts what it sends and goes on (a ring that sends before it
        receives must not wait), the receiver waits for it and compares; a mismatch aborts
        the group, which ends the sender's wait too."""
        src, dst = (self.rank, call.peer) if call.kind == "send" else (call.peer, self.rank)
        n = self._pair_seq.get((src, dst), 0)
        self._pair_seq[(src, dst)] = n + 1
        mine, seq = (call.dtype.name, call.count), f"p{src}-{dst}.{n}"
        try:
            if call.kind == "send":
                group._exchanger.post(self.rank, seq, mine)
            else:
                sent, _ = group._exchanger.exchange(self.rank, seq, mine, call.describe(), group.timeout,
                                                    parties=(src, dst))
                if sent != mine:
                    raise DistributedError(f"rank {src} sent {sent[1]} x {sent[0]} to rank {dst}, which expected "
                                           f"{mine[1]} x {mine[0]}: a send and its recv must match in dtype and "
                                           "count; the group is aborted")
        except DistributedError as exc:
            group.abort(str(exc))
            raise
        self._pairs_agreed.add((call.kind, call.peer, call.dtype.name, call.count))

    def _last_error(self) -> str:
        try:
            text = self.low.get_last_error(self.handle)
        except Exception:  # noqa: BLE001
            return ""
        return f" ({text})" if text else ""

    def overdue(self) -> str | None:
        """The eager collective that has not completed within the timeout, if any (the watchdog asks)."""
        now = time.monotonic()
        with self._lock:
            for watch in self._watch.values():
                stuck = watch.stuck(now, self.timeout)
                if stuck is not None:
                    return f"{stuck} (or a collective after it) did not complete within {self.timeout:g} s " \
                           "(a peer hung or died)"
        return None

    def async_error(self) -> str | None:
        try:
            code = int(self.low.comm_get_async_error(self.handle))
        except Exception as exc:  # noqa: BLE001
            return f"ncclCommGetAsyncError failed: {exc}"
        if code in (0, 7):  # ncclSuccess, ncclInProgress
            return None
        return f"NCCL reported {self.low.get_error_string(code)}{self._last_error()}"

    def abort(self) -> None:
        """ncclCommAbort, bounded: it waits for the GPU, and a kernel of ours that never ends
        (a device loop spinning on a peer) would make it wait forever; then the process is
        left to exit with its error rather than hang in the abort."""
        comm, self.comm = self.comm, None
        if comm is None:
            return

        def run():
            try:
                self.device.bind()  # (see issue)
                comm.abort()
            except Exception:  # noqa: BLE001 - aborting is the last resort; it must not raise
                pass
        worker = threading.Thread(target=run, daemon=True, name=f"deviceop-nccl-abort-{self.rank}")
        worker.start()
        worker.join(min(self.timeout, 10.0))

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            self.device.bind()  # (see issue)
            comm.destroy()


class _Watch:
    """How far one stream's eager collectives got, in two events: the *marker*, recorded
    after a collective and left in place until it completes (a stream that keeps making
    progress passes its marker in time however busy it stays), and the *latest*,
    re-recorded after each collective issued meanwhile, which becomes the next marker.
    One stream is stuck when its marker has not completed within the timeout."""

    def __init__(self, stream):
        self.stream = stream
        self.marker = self.latest = None        # (event, since when it is waited for, its collective)
        self._spare = [stream.device.new_event(timing=False), stream.device.new_event(timing=False)]

    def issued(self, call) -> None:
        if self.marker is None:
            event = self._spare.pop()
            self.stream.record_event(event)
            self.marker = (event, time.monotonic(), call.describe())
        else:
            event = self.latest[0] if self.latest is not None else self._spare.pop()
            self.stream.record_event(event)
            self.latest = (event, None, call.describe())

    def stuck(self, now: float, timeout: float) -> str | None:
        """The collective the marker follows, if it has not completed within ``timeout``."""
        if self.marker is None:
            return None
        try:
            done = self.marker[0].query()
        except Exception:  # noqa: BLE001 - a faulted context: the user's next sync says so
            done = True
        if done:  # progress: the latest collective (if any) is now what is waited for, from now
            self._spare.append(self.marker[0])
            self.marker, self.latest = (None if self.latest is None else (self.latest[0], now, self.latest[2])), None
            return None
        return self.marker[2] if now - self.marker[1] > timeout else None


class Watchdog:
    """The thread that keeps a group from waiting forever (see the module docstring)."""

    def __init__(self, group: Group, exchanger: StoreExchanger, backend: NcclBackend, timeout: float):
        self.group, self.exchanger, self.backend, self.timeout = group, exchanger, backend, timeout
        self.interval = min(1.0, timeout / 10)
        self._stop = threading.Event()
        self._beats: dict = {}  # peer -> (last beat seen, when it changed, on our clock)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"deviceop-watchdog-{group.rank}")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        beat, store, prefix = 0, self.exchanger.store, self.exchanger.prefix
        self.group.device.bind()  # event queries and ncclCommAbort from this thread need the rank's context
        while not self._stop.wait(self.interval):
            try:
                beat += 1
                store.set(f"{prefix}beat/{self.group.rank}", str(beat).encode())
                why = (self.exchanger.problem() or self.backend.async_error() or self.backend.overdue()
                       or self._silent_peer(store, prefix))
            except Exception as exc:  # noqa: BLE001 - the store itself failed: rank 0 is gone
                why = f"the store failed ({exc})"
            if why is not None and not self._stop.is_set():
                self.backend.error = why
                self.group.abort(f"watchdog on rank {self.group.rank}: {why}")
                return

    def _silent_peer(self, store, prefix) -> str | None:
        now = time.monotonic()
        for r in range(self.group.world_size):
            if r == self.group.rank or store.get(f"{prefix}closed/{r}") is not None:
                continue
            value = store.get(f"{prefix}beat/{r}")
            last = self._beats.get(r)
            if last is None or last[0] != value:
                self._beats[r] = (value, now)
            elif now - last[1] > self.timeout:
                return f"rank {r} has not been heard from for {self.timeout:g} s (its process died or froze)"
        return None


class NcclGroup(Group):
    """A Group whose collectives run on NCCL, watched by a Watchdog."""

    _watchdog = None

    def abort(self, why: str = "aborted by the user") -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        super().abort(why)

    def close(self) -> None:
        """Destroy the communicator once every rank is done with it (ncclCommDestroy waits for
        the node's other ranks; the barrier before it is bounded, and aborts instead)."""
        if self._state != "open":
            return
        try:
            self.barrier()
        except DistributedError:
            return  # the barrier aborted the group (and the communicator)
        if self._watchdog is not None:
            self._watchdog.stop()
        super().close()


def nccl_group(rank: int, world_size: int, device, store, timeout: float, launcher: str) -> NcclGroup:
    """Bootstrap a communicator on ``device`` (see the module docstring)."""
    # NCCL's graph-mixing support (on by default) adds event nodes to a captured collective, which a
    # conditional node's body refuses: a collective inside dop.loop / dop.while_ failed at instantiation
    # (CUDA_ERROR_INVALID_VALUE, 2x H200).  Off, a communicator must not have an eager collective and a
    # graph's in flight at once on different streams (docs/distributed.md); set before NCCL reads it.
    os.environ.setdefault("NCCL_GRAPH_MIXING_SUPPORT", "0")
    core, low = _nccl()
    exchanger = StoreExchanger(store, world_size, timeout)
    device.bind()  # NCCL builds the communicator on the calling thread's current device
    try:
        uid = bytes(core.get_unique_id()) if rank == 0 else None
    except Exception as exc:  # noqa: BLE001 - libnccl missing or broken: the others must not wait for the id
        exchanger.abort(rank, f"rank 0 could not make NCCL's unique id ({exc})")
        raise DistributedError(f"dist.init: NCCL could not make its unique id on rank 0 ({exc}); install NCCL "
                               "(nvidia-nccl-cu13) where nccl4py finds it") from None
    me = (world_size, os.environ.get("NCCL_NVLS_ENABLE"), socket.gethostname(), device.ordinal)
    try:
        seen = exchanger.exchange(rank, "init", (me, uid), f"dist.init (rank {rank} of {world_size})", timeout)
    except DistributedError:
        exchanger.abort(rank, "init failed")
        raise
    problems = [f"rank {r} was started with world size {v[0]} and NCCL_NVLS_ENABLE={v[1]}" for r, (v, _)
                in enumerate(seen) if v[:2] != me[:2]]
    places = [(v[2], v[3]) for v, _ in seen]
    if len(set(places)) != len(places):
        problems.append(f"ranks share a GPU (host, ordinal per rank: {places}); one process per GPU: set "
                        "local_rank (LOCAL_RANK) or device=")
    if problems:
        exchanger.abort(rank, "ranks disagree at init")
        raise DistributedError("dist.init: " + "; ".join(problems))
    try:
        comm = core.Communicator.init(world_size, rank, core.UniqueId.from_bytes(seen[0][1]))
    except Exception as exc:
        exchanger.abort(rank, f"ncclCommInitRank failed: {exc}")
        raise DistributedError(f"dist.init: NCCL could not build the communicator on rank {rank} ({exc})") from None
    backend = NcclBackend(comm, low, rank, timeout, device)
    group = NcclGroup(rank, world_size, device, device.new_stream(), exchanger, backend, timeout, launcher)
    group._watchdog = Watchdog(group, exchanger, backend, timeout)
    atexit.register(abort_at_exit, weakref.ref(group))
    return group


def abort_at_exit(ref) -> None:
    """At the interpreter's exit, abort a group left open: the other ranks fail at once,
    naming this rank, instead of waiting for its heartbeat to stop for the whole timeout."""
    group = ref()
    if group is not None and group._state == "open":
        group.abort(f"rank {group.rank}'s process exited without closing its group")
