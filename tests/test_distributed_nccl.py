"""The NCCL backend's Python paths (deviceop/distributed/nccl.py) without a GPU:
nccl4py is replaced by a recorder of the calls deviceop makes, ranks are
threads, each with a reference device of its own and a file store, as
processes would have.  What NCCL computes is tested on GPUs
(tests/test_distributed_gpu.py); this checks what deviceop hands it, and what
deviceop does when NCCL or a peer fails."""
import threading
import time

import numpy as np
import pytest

import deviceop as dop
import deviceop.distributed as dist
from deviceop.distributed import nccl as backend
from deviceop.distributed.reference import rank_device
from deviceop.distributed.store import FileStore, StoreExchanger


class FakeNcclError(Exception):
    pass


class FakeComm:
    def __init__(self, world, rank):
        self.ptr, self.aborted, self.destroyed = 0x1000 + rank, False, False

    def abort(self):
        self.aborted = True

    def destroy(self):
        self.destroyed = True


class FakeNccl:
    """nccl.core and nccl.bindings.nccl, as far as deviceop uses them; records every call."""

    NCCLError = FakeNcclError

    def __init__(self, uid_error=None):
        self.calls, self.comms, self.uid_error, self.async_code, self.fail_next = [], [], uid_error, 0, False
        self.UniqueId = type("UniqueId", (), {"from_bytes": staticmethod(lambda b: b)})
        fake = self

        class Communicator:
            @staticmethod
            def init(world, rank, uid):
                comm = FakeComm(world, rank)
                fake.comms.append(comm)
                return comm
        self.Communicator = Communicator

    def get_unique_id(self):
        if self.uid_error is not None:
            raise self.uid_error
        return b"unique-id"

    def Comm(self, ptr):
        return ptr

    def _call(self, *args):
        if self.fail_next:
            self.fail_next = False
            raise FakeNcclError("ncclInvalidUsage")
        self.calls.append(args)

    def all_reduce(self, send, recv, count, dt, op, comm, stream):
        self._call("all_reduce", count, dt, op, send == recv)

    def all_gather(self, send, recv, count, dt, comm, stream):
        self._call("all_gather", count, dt)

    def reduce_scatter(self, send, recv, count, dt, op, comm, stream):
        self._call("reduce_scatter", count, dt, op)

    def broadcast(self, send, recv, count, dt, root, comm, stream):
        self._call("broadcast", count, dt, root)

    def send(self, send, count, dt, peer, comm, stream):
        self._call("send", count, dt, peer)

    def recv(self, recv, count, dt, peer, comm, stream):
        self._call("recv", count, dt, peer)

    def comm_get_async_error(self, comm):
        return self.async_code

    def get_error_string(self, code):
        return {6: "remote process exited or there was a network error"}.get(code, "unknown")

    def get_last_error(self, comm):
        return "NET/IB: peer went away"


def _groups(world, tmp_path, fakes, fn, timeout=5.0):
    """fn(group, fake) on ``world`` thread-ranks of NCCL groups over one file store: each rank's
    result or exception.  The default timeout is one no test waits out: with 1 s, a heartbeat
    delayed by a loaded 2-core machine aborted a working group (seen once in a full run)."""
    out = [None] * world

    def main(r):
        try:
            device = rank_device(r)
            device.ordinal = r  # one GPU per rank (the bootstrap refuses ranks sharing one)
            group = backend.nccl_group(r, world, device, FileStore(tmp_path), timeout, "explicit")
            group.stream.ptr = 0xA000 + r  # what the low-level calls take: a CUDA stream's handle
            out[r] = fn(group, fakes[r])
        except Exception as exc:  # noqa: BLE001 - returned for the test to look at
            out[r] = exc
    original = backend._nccl

    def fake_nccl():
        fake = fakes[int(threading.current_thread().name.rsplit("-", 1)[1])]
        return fake, fake
    backend._nccl = fake_nccl
    try:
        threads = [threading.Thread(target=main, args=(r,), name=f"rank-{r}") for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    finally:
        backend._nccl = original
    return out


def _wait_until(done, seconds=10.0):
    """Poll ``done`` until it holds (at once, normally); the bound is generous so that a loaded
    2-core machine, where a watchdog beat can come late, does not fail a working feature."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.fixture(autouse=True)
def _one_group_name(monkeypatch):
    """Processes name their n-th group alike; thread-ranks share one counter, so name it here."""
    def exchanger(store, world, timeout):
        made = StoreExchanger(store, world, timeout)
        made.prefix = "deviceop/test/"
        return made
    monkeypatch.setattr(backend, "StoreExchanger", exchanger)


def test_each_collective_hands_nccl_its_dtype_count_reduction_root_and_peer(tmp_path, rng):
    fakes = [FakeNccl(), FakeNccl()]

    def rank(group, fake):
        s, n = group.stream, 8
        x = dop.from_numpy(rng.standard_normal(n).astype(np.float32), stream=s)
        dist.all_reduce(group, x, op="avg").sync_on(s)
        dist.all_reduce(group, dop.empty(n, "bfloat16", stream=s), dop.empty(n, "bfloat16", stream=s),
                        op="max").sync_on(s)
        dist.all_gather(group, dop.empty(n, "int64", stream=s), dop.empty(2 * n, "int64", stream=s)).sync_on(s)
        dist.reduce_scatter(group, x, dop.empty(n // 2, stream=s), op="prod").sync_on(s)
        dist.broadcast(group, dop.empty(n, "uint8", stream=s), root=np.int64(1)).sync_on(s)
        if group.rank == 0:
            dist.send(group, dop.empty(3, "float16", stream=s), peer=1).sync_on(s)
        else:
            dist.recv(group, dop.empty(3, "float16", stream=s), peer=0).sync_on(s)
        group.close()
        return fake.calls

    calls0, calls1 = _groups(2, tmp_path, fakes, rank)
    common = [("all_reduce", 8, 7, 4, True), ("all_reduce", 8, 9, 2, False), ("all_gather", 8, 4),
              ("reduce_scatter", 4, 7, 1), ("broadcast", 8, 1, 1)]
    assert calls0 == common + [("send", 3, 6, 1)] and calls1 == common + [("recv", 3, 6, 0)]
    assert all(c.destroyed and not c.aborted for f in fakes for c in f.comms)


def test_a_rank_whose_nccl_cannot_make_a_unique_id_fails_every_rank_at_once(tmp_path):
    fakes = [FakeNccl(uid_error=RuntimeError('Failure finding "libnccl.so.2"')), FakeNccl()]
    start = time.monotonic()
    out = _groups(2, tmp_path, fakes, lambda group, fake: group, timeout=5.0)
    assert time.monotonic() - start < 4  # rank 1 did not wait out the 5 s timeout (slack for a loaded machine)
    assert isinstance(out[0], dop.DistributedError) and "libnccl.so.2" in str(out[0])
    assert isinstance(out[1], dop.DistributedError) and "rank 0" in str(out[1])


def test_an_nccl_error_aborts_the_group_and_every_later_use_says_so(tmp_path):
    fakes = [FakeNccl(), FakeNccl()]

    def rank(group, fake):
        s = group.stream
        dist.all_reduce(group, dop.zeros(4, stream=s)).sync_on(s)
        if group.rank == 0:
            fake.fail_next = True
            with pytest.raises(dop.DistributedError, match=r"all_reduce.*failed in NCCL.*NET/IB: peer went away"):
                dist.all_reduce(group, dop.zeros(4, stream=s)).sync_on(s)
        else:
            _wait_until(lambda: fake.comms[0].aborted)  # rank 0's abort reaches this rank's watchdog
        with pytest.raises(dop.StateError, match="group that was aborted"):
            dist.all_reduce(group, dop.zeros(4, stream=s)).sync_on(s)
        return [c.aborted for c in fake.comms]

    assert _groups(2, tmp_path, fakes, rank) == [[True], [True]]


def test_an_asynchronous_nccl_error_aborts_the_group_within_the_watchdog_s_beat(tmp_path):
    fakes = [FakeNccl()]

    def rank(group, fake):
        fake.async_code = 6  # ncclRemoteError, as NCCL reports a peer that went away
        _wait_until(lambda: fake.comms[0].aborted)
        with pytest.raises(dop.StateError, match="NCCL reported remote process exited.*NET/IB: peer went away"):
            group.barrier()
        return fake.comms[0].aborted

    assert _groups(1, tmp_path, fakes, rank, timeout=0.5) == [True]


class _Gpu:
    """A stream and its events whose progress the test sets: work ``k`` is done once
    ``done >= k``; an event recorded after work ``k`` completes with it."""

    def __init__(self):
        self.issued = self.done = 0
        self.ptr, self.device = 0xB000, self
        self.bound_on = []  # the threads that made its context current (bind)

    def bind(self):
        self.bound_on.append(threading.current_thread().name)

    def is_capturing(self):
        return False

    def new_event(self, timing=False):
        gpu = self

        class Event:
            at = 0

            def query(self):
                return gpu.done >= self.at
        return Event()

    def record_event(self, event):
        event.at = self.issued


class _AgreedGroup:
    def agree(self, signature, what):  # (every rank issued it alike)
        pass


class _Tensor:
    def __init__(self):
        self.data_ptr, self.dtype = 0xC000, type("D", (), {"name": "float32"})()


def test_the_watchdog_aborts_a_stuck_stream_not_one_that_keeps_progressing(monkeypatch):
    from deviceop.distributed.ops import Call
    clock = [100.0]
    monkeypatch.setattr(backend, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    gpu, t = _Gpu(), _Tensor()
    nccl = backend.NcclBackend(FakeComm(2, 0), FakeNccl(), 0, timeout=10.0, device=gpu)

    def issue():
        gpu.issued += 1
        nccl.issue(_AgreedGroup(), gpu, Call("all_reduce", t, t, "sum", None, None, 4))

    for _ in range(40):  # a long eager loop: the GPU always one collective behind, but moving
        issue()
        gpu.done = gpu.issued - 1
        clock[0] += 1.0  # the watchdog looks once a second
        assert nccl.overdue() is None  # (it reported the first collective overdue after 10 s)
    gpu.done = gpu.issued
    assert nccl.overdue() is None
    issue()  # then one that never completes: a peer hung
    clock[0] += 9.0
    assert nccl.overdue() is None
    clock[0] += 2.0
    assert "dist.all_reduce(4 x float32, sum) (or a collective after it) did not complete within 10 s" in nccl.overdue()


def test_a_rank_whose_process_exits_without_closing_its_group_fails_the_others_at_once(tmp_path):
    import weakref
    fakes = [FakeNccl(), FakeNccl()]

    def rank(group, fake):
        if group.rank == 0:  # what the interpreter's exit does for a group left open (atexit)
            backend.abort_at_exit(weakref.ref(group))
            return fake.comms[0].aborted
        with pytest.raises(dop.DistributedError, match="rank 0's process exited without closing its group"):
            group.barrier()  # (it waited for rank 0's heartbeat to stop for the whole timeout)
        return True

    start = time.monotonic()
    assert _groups(2, tmp_path, fakes, rank, timeout=5.0) == [True, True]
    assert time.monotonic() - start < 2


def test_a_send_and_its_recv_must_agree_on_dtype_and_count_as_on_the_reference_backend(tmp_path):
    fakes = [FakeNccl(), FakeNccl()]

    def rank(group, fake):
        s = group.stream
        for _ in range(2):  # a pair seen alike once is trusted after (one host exchange per new signature)
            if group.rank == 0:
                dist.send(group, dop.zeros(4, stream=s), peer=1).sync_on(s)
            else:
                dist.recv(group, dop.empty(4, stream=s), peer=0).sync_on(s)
        if group.rank == 1:  # the receiver compares (NCCL was handed both: a hang or a corrupted buffer)
            with pytest.raises(dop.DistributedError, match=r"rank 0 sent 6 x float32 to rank 1, which expected 6 x "
                                                           r"float64: a send and its recv must match"):
                dist.recv(group, dop.empty(6, "float64", stream=s), peer=0).sync_on(s)
        else:  # the sender posts what it sends and goes on; the receiver's abort reaches it
            dist.send(group, dop.zeros(6, stream=s), peer=1).sync_on(s)
            _wait_until(lambda: fake.comms[0].aborted)
            with pytest.raises(dop.StateError, match="which expected 6 x float64"):
                group.barrier()
        return fake.calls

    calls0, calls1 = _groups(2, tmp_path, fakes, rank)
    assert calls0 == [("send", 4, 7, 1)] * 2 + [("send", 6, 7, 1)] and calls1 == [("recv", 4, 7, 0)] * 2


def test_the_pair_check_lets_a_ring_send_before_it_receives(tmp_path):
    fakes = [FakeNccl() for _ in range(3)]

    def rank(group, fake):  # every rank sends to the next, then receives from the previous: NCCL completes it
        s, r, n = group.stream, group.rank, group.world_size
        dist.send(group, dop.zeros(4, stream=s), peer=(r + 1) % n).sync_on(s)
        dist.recv(group, dop.empty(4, stream=s), peer=(r - 1) % n).sync_on(s)
        return fake.calls

    start = time.monotonic()
    out = _groups(3, tmp_path, fakes, rank, timeout=3.0)
    assert time.monotonic() - start < 2  # (the check made every sender wait for its receiver: a deadlock)
    assert out == [[("send", 4, 7, (r + 1) % 3), ("recv", 4, 7, (r - 1) % 3)] for r in range(3)]


def test_nccl_calls_bind_the_ranks_device_first_on_whichever_thread_makes_them():
    # NCCL switches to the communicator's GPU and back to the thread's current device, which on a
    # thread with no context current is GPU 0: a rank driving GPU 1 opened GPU 0 from its collectives,
    # its abort thread and its close
    from deviceop.distributed.ops import Call
    gpu, t, comm = _Gpu(), _Tensor(), FakeComm(2, 0)
    nccl = backend.NcclBackend(comm, FakeNccl(), 0, timeout=10.0, device=gpu)
    nccl.issue(_AgreedGroup(), gpu, Call("all_reduce", t, t, "sum", None, None, 4))
    assert gpu.bound_on == [threading.current_thread().name]
    nccl.abort()
    assert comm.aborted and gpu.bound_on[1] == "deviceop-nccl-abort-0"
    other = FakeComm(2, 0)
    closing = backend.NcclBackend(other, FakeNccl(), 0, timeout=10.0, device=gpu)
    closing.close()
    assert other.destroyed and gpu.bound_on[2] == threading.current_thread().name
