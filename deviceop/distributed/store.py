"""How ranks in separate processes meet on the host: a key-value store (the
launcher's, or one of ours) and the exchanges built on it.

A store here is three calls: ``set(key, bytes)``, ``get(key) -> bytes | None``
(never blocks) and ``close()``.  Waiting is the exchanger's: it polls with a
deadline, and between polls it looks for the group's ``abort`` key (set by a
rank that failed) and ``closed/<rank>`` keys (a rank that left), so no wait
outlives the group's timeout and a failure elsewhere ends it at once.

Stores: ``FileStore`` (a directory every rank can reach: tests, one node, a
shared file system), ``TcpStore`` (ours: rank 0 serves, the others connect),
``TorchStore`` (torch's TCPStore, the one torchrun's agent serves).

A directory outlives its run: one reused after a crash still holds that run's
keys (NCCL's unique id, an abort, heartbeats), which a new rank must never
read.  So a FileStore opened for a rank (``dist.init(store=path)``) first
joins a *run*: rank 0 draws a random token, and every other rank writes a
random nonce (``rendezvous/hello/<rank>``), waits for rank 0's answer naming
that nonce (``rendezvous/welcome/<rank>``: nonce and token) and acknowledges
the token (``rendezvous/ack/<rank>``); rank 0 answers each new hello until
every rank has acknowledged.  A stale file can hold neither this run's nonce
nor its token, so ranks may start in any order (within the timeout), and
every key after that is named under the token (``run-<token>__...``).
"""
from __future__ import annotations

import os
import pickle
import secrets
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

from ..errors import DistributedError

_groups_made = 0  # groups this process made: every rank makes them in the same order, so it names them alike


class MemoryStore:
    """A one-rank group's store: a dict (nobody else to meet)."""

    def __init__(self):
        self._data = {}

    def set(self, key: str, value: bytes) -> None:
        self._data[key] = value

    def get(self, key: str):
        return self._data.get(key)

    def close(self) -> None:
        pass


class FileStore:
    """Keys are files of a directory (written whole: a temporary file renamed).  Given
    ``rank`` (and ``world_size``), it first joins a new run (the module docstring) and
    names its keys under that run's token; without, it is the directory as it is."""

    def __init__(self, path, rank: int | None = None, world_size: int = 1, timeout: float = 120.0):
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if not os.access(self.path, os.W_OK | os.X_OK):
                raise PermissionError(f"{self.path} is not writable")
        except OSError as exc:  # a file there, a read-only place: say so, not a raw OSError on one rank
            raise DistributedError(f"the file store {self.path} cannot be a directory every rank writes ({exc}): pass "
                                   "store= a directory path that every rank can create or write") from None
        self._prefix = ""  # the rendezvous files are outside any run's names
        if rank is not None:
            token = self._lead(world_size, timeout) if rank == 0 else self._join(rank, timeout)
            self._prefix = f"run-{token}__"

    def _lead(self, world_size: int, timeout: float) -> str:
        """Rank 0: draw the run's token, answer each rank's hello until every rank acknowledged it."""
        token = secrets.token_hex(8)
        answered, waiting = {}, set(range(1, world_size))
        deadline, pause = time.monotonic() + timeout, 0.0005
        while waiting:
            for r in sorted(waiting):
                hello = self.get(f"rendezvous/hello/{r}")
                if hello is not None and answered.get(r) != hello:  # (a stale hello's answer is never read)
                    self.set(f"rendezvous/welcome/{r}", hello + b" " + token.encode())
                    answered[r] = hello
                if self.get(f"rendezvous/ack/{r}") == token.encode():
                    waiting.discard(r)
            if waiting and time.monotonic() > deadline:
                raise DistributedError(f"the file store {self.path}: rank(s) {sorted(waiting)} did not join rank 0's "
                                       f"run within {timeout:g} s: start every rank of world size {world_size} with "
                                       "this same directory (a previous run's keys there are never read)")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return token

    def _join(self, rank: int, timeout: float) -> str:
        """Rank > 0: post a fresh nonce; the token is in rank 0's answer that names it."""
        nonce = secrets.token_hex(8).encode()
        self.set(f"rendezvous/hello/{rank}", nonce)
        deadline, pause = time.monotonic() + timeout, 0.0005
        while True:
            welcome = self.get(f"rendezvous/welcome/{rank}")
            if welcome is not None and welcome.startswith(nonce + b" "):
                token = welcome[len(nonce) + 1:]
                self.set(f"rendezvous/ack/{rank}", token)
                return token.decode()
            if time.monotonic() > deadline:
                raise DistributedError(f"the file store {self.path}: rank 0 did not admit rank {rank} to a new run "
                                       f"within {timeout:g} s: is rank 0 running, with this same directory? (a "
                                       "previous run's keys there are never read)")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def _file(self, key: str) -> Path:
        return self.path / (self._prefix + key.replace("/", "__"))

    def set(self, key: str, value: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, self._file(key))

    def get(self, key: str):
        try:
            return self._file(key).read_bytes()
        except FileNotFoundError:
            return None

    def close(self) -> None:
        pass


def _send(sock, obj) -> None:
    data = pickle.dumps(obj, protocol=4)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock):
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            raise ConnectionError("the store's connection closed")
        head += chunk
    n, data = struct.unpack("!I", head)[0], b""
    while len(data) < n:
        chunk = sock.recv(min(1 << 20, n - len(data)))
        if not chunk:
            raise ConnectionError("the store's connection closed")
        data += chunk
    return pickle.loads(data)


class TcpStore:
    """A small TCP key-value store: rank 0 serves it (a daemon thread), every rank is a client."""

    def __init__(self, host: str, port: int, serve: bool, timeout: float):
        self._lock, self._server = threading.Lock(), None
        self.serves = serve  # its closing waits for the other ranks to be done with it (StoreExchanger.close)
        if serve:
            try:
                listener = socket.create_server(("", port), reuse_port=False)
            except OSError as exc:  # (raw, the others waited out the timeout for a store never served)
                raise DistributedError(f"rank 0 cannot serve the store on port {port} ({exc}): another process holds "
                                       "it; pick a free port (MASTER_PORT, store='tcp://host:port') for every "
                                       "rank") from None
            self._data = {}
            self._server = listener
            threading.Thread(target=self._serve, args=(listener,), daemon=True, name="deviceop-store").start()
        deadline = time.monotonic() + timeout
        while True:  # the server may not be up yet
            try:
                self._sock = socket.create_connection((host, port), timeout=timeout)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise DistributedError(f"could not reach the store at {host}:{port} within {timeout:g} s "
                                           f"({exc}): is rank 0 running, and MASTER_ADDR/MASTER_PORT right?") from None
                time.sleep(0.05)

    def _serve(self, listener) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn) -> None:
        with conn:
            try:
                while True:
                    op, key, value = _recv(conn)
                    if op == "set":
                        self._data[key] = value
                    _send(conn, self._data.get(key))
            except (ConnectionError, OSError, EOFError):
                return

    def _ask(self, op, key, value=None):
        with self._lock:
            try:
                _send(self._sock, (op, key, value))
                return _recv(self._sock)
            except OSError as exc:
                raise DistributedError(f"the store (served by rank 0) stopped answering ({exc}): rank 0 died or "
                                       "closed its group") from None

    def set(self, key: str, value: bytes) -> None:
        self._ask("set", key, value)

    def get(self, key: str):
        return self._ask("get", key)

    def close(self) -> None:
        self._sock.close()
        if self._server is not None:
            self._server.close()


class TorchStore:
    """torch.distributed.TCPStore (torchrun's agent serves it at MASTER_ADDR:MASTER_PORT)."""

    def __init__(self, store):
        self._store = store

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str):
        return self._store.get(key) if self._store.check([key]) else None

    def close(self) -> None:
        pass


def open_store(store, launcher: str, rank: int, world_size: int, timeout: float):
    """The store the ranks meet in: ``store`` if given (a Store, a directory, or
    ``tcp://host:port``), else the launcher's (see launch.py)."""
    if store is not None and not isinstance(store, (str, os.PathLike)):
        if not all(callable(getattr(store, m, None)) for m in ("set", "get", "close")):
            raise DistributedError(f"store={store!r}: pass a directory every rank can reach, 'tcp://host:port', or a "
                                   "store object with set(key, bytes), get(key) -> bytes or None, and close()")
        return store
    if isinstance(store, str) and store.startswith("tcp://"):
        host, sep, port = store[len("tcp://"):].rpartition(":")
        if not (sep and host and _port(port) is not None):
            raise DistributedError(f"store={store!r} is not tcp://host:port (a host name or address, and a port "
                                   "1..65535 that rank 0 serves the store on)")
        return TcpStore(host, _port(port), serve=rank == 0, timeout=timeout)
    if store is not None:
        return FileStore(store, rank, world_size, timeout)
    if world_size == 1:
        return MemoryStore()
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr is None or port is None:
        if launcher == "mpirun":
            addr, port = _address_through_mpi(rank)
        else:
            raise DistributedError(f"dist.init under {launcher}: no store to meet in. Set MASTER_ADDR and "
                                   "MASTER_PORT (torchrun does; a SLURM script exports them), or pass "
                                   "store='tcp://host:port' or a directory every rank can reach")
    if _port(port) is None:
        raise DistributedError(f"MASTER_PORT={port!r} is not a TCP port: give a free port 1..65535 on MASTER_ADDR "
                               f"({addr}) that rank 0 serves the store on, the same in every rank's environment")
    if launcher == "torchrun":
        try:
            from torch.distributed import TCPStore
        except ImportError:
            TCPStore = None
        if TCPStore is not None:
            from datetime import timedelta
            # torchrun's agent serves the store itself when it says so; otherwise rank 0 does (as torch does)
            serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            return TorchStore(TCPStore(addr, int(port), world_size, serve, timedelta(seconds=timeout)))
    return TcpStore(addr, int(port), serve=rank == 0, timeout=timeout)


def _port(text):
    """``text`` as a TCP port (1..65535), or None."""
    try:
        port = int(text)
    except (TypeError, ValueError):
        return None
    return port if 1 <= port <= 65535 else None


def _address_through_mpi(rank: int) -> tuple[str, str]:
    """Rank 0's host and a free port, broadcast through MPI (mpirun without MASTER_ADDR)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise DistributedError("dist.init under mpirun needs MASTER_ADDR/MASTER_PORT or mpi4py (to find rank 0's "
                               "address); export the two variables, or pip install mpi4py") from None
    found = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            found = (socket.gethostname(), str(s.getsockname()[1]))
    return MPI.COMM_WORLD.bcast(found, root=0)


class StoreExchanger:
    """``exchange``/``abort``/``close`` of a Group, over a store (see the module docstring)."""

    def __init__(self, store, world_size: int, timeout: float):
        global _groups_made
        self.store, self.world_size, self.timeout = store, world_size, timeout
        self.prefix = f"deviceop/g{_groups_made}/"
        _groups_made += 1

    def problem(self) -> str | None:
        """Why the group cannot go on (a rank aborted it), or None."""
        why = self.store.get(self.prefix + "abort")
        return None if why is None else why.decode(errors="replace")

    def post(self, rank, seq, obj) -> None:
        """This rank's ``obj`` for exchange ``seq``, without waiting for the others'."""
        self.store.set(f"{self.prefix}x{seq}/{rank}", pickle.dumps(obj, protocol=4))

    def exchange(self, rank, seq, obj, what, timeout, parties=None):
        """Every party's ``obj`` (all ranks by default), in ``parties``' order."""
        parties = range(self.world_size) if parties is None else parties
        p = f"{self.prefix}x{seq}/"
        self.post(rank, seq, obj)
        found, deadline, pause, checked = {}, time.monotonic() + timeout, 0.0005, 0.0
        while True:
            now = time.monotonic()
            # the others' news (an abort, a rank that left) is read BEFORE their values: a rank that
            # posted and then aborted completed this exchange, which must not fail on its abort
            why = gone = None
            if now - checked > 0.01:
                checked = now
                why = self.problem()
                gone = [r for r in parties if r not in found and self.store.get(f"{self.prefix}closed/{r}") is not None]
            for r in parties:
                if r not in found:
                    value = self.store.get(p + str(r))
                    if value is not None:
                        found[r] = pickle.loads(value)
            if len(found) == len(parties):
                return [found[r] for r in parties]
            missing = [r for r in parties if r not in found]
            if why is not None:
                raise DistributedError(f"{what} on rank {rank}: the group was aborted ({why})")
            gone = [r for r in gone or () if r not in found]
            if gone:
                raise DistributedError(f"{what} on rank {rank}: rank(s) {gone} closed their group without "
                                       "reaching it; every rank must make the same exchanges and collectives")
            if now > deadline:
                raise DistributedError(f"{what} timed out after {timeout:g} s on rank {rank}: rank(s) {missing} never "
                                       "reached it (a rank failed, hung, or took another path); the group is aborted")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def abort(self, rank, why):
        try:
            self.store.set(self.prefix + "abort", f"rank {rank}: {why}".encode())
        except Exception:  # noqa: BLE001 - the store may be what failed; aborting must not raise
            pass

    def close(self, rank):
        try:
            self.store.set(f"{self.prefix}closed/{rank}", b"1")
            if getattr(self.store, "serves", False):  # the others may still read from it: wait for them to leave
                deadline = time.monotonic() + self.timeout
                while time.monotonic() < deadline and not all(
                        self.store.get(f"{self.prefix}closed/{r}") is not None for r in range(self.world_size)):
                    time.sleep(0.005)
        except Exception:  # noqa: BLE001 - closing must not raise; the store may be what failed
            pass
        finally:
            self.store.close()
