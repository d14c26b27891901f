"""How separate processes find each other (deviceop/distributed/launch.py and
store.py): the launchers' environments, and host-side exchanges over a file
store and our TCP store — bounded, and ended at once by a rank that aborts
or leaves.  Ranks are threads here, each with its own store client, as
processes would be."""
import socket
import threading
import time

import pytest

import deviceop as dop
import deviceop.distributed as dist
from deviceop.distributed.launch import from_environment
from deviceop.distributed.store import FileStore, StoreExchanger, TcpStore, open_store


def test_the_launchers_environments_give_rank_world_size_and_local_rank():
    assert from_environment({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0"}) == \
        ("torchrun", 3, 8, 1)
    assert from_environment({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "2"}) == ("mpirun", 5, 6, 2)
    assert from_environment({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}) == ("srun", 9, 16, 1)
    assert from_environment({"PATH": "/bin"}) is None
    with pytest.raises(dop.DistributedError, match="not ints"):
        from_environment({"RANK": "zero", "WORLD_SIZE": "2"})
    with pytest.raises(dop.DistributedError, match="pass both rank= and world_size="):
        dist.init(rank=1)
    with pytest.raises(dop.DistributedError, match="rank 2 of world size 2 is not a rank"):
        dist.init(rank=2, world_size=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _stores(kind, world, tmp_path, timeout):
    if kind == "file":
        return [FileStore(tmp_path) for _ in range(world)]
    port = _free_port()
    server = TcpStore("127.0.0.1", port, serve=True, timeout=timeout)
    return [server] + [TcpStore("127.0.0.1", port, serve=False, timeout=timeout) for _ in range(world - 1)]


def _ranks(world, fn):
    """Run fn(rank) on ``world`` threads; each rank's result or exception."""
    out = [None] * world

    def main(r):
        try:
            out[r] = fn(r)
        except Exception as exc:  # noqa: BLE001 - returned for the test to look at
            out[r] = exc
    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


@pytest.mark.parametrize("kind", ["file", "tcp"])
def test_store_exchanges_meet_every_rank_and_a_rank_that_aborts_ends_the_others_wait(kind, tmp_path, rng):
    world, timeout = 3, 20.0
    stores = _stores(kind, world, tmp_path, timeout)
    exchangers = [StoreExchanger(s, world, timeout) for s in stores]
    for ex in exchangers[1:]:
        ex.prefix = exchangers[0].prefix  # one group, as each process's first group is named alike
    tokens = rng.integers(0, 1 << 30, world).tolist()

    def rank(r):
        got = exchangers[r].exchange(r, 0, {"token": tokens[r]}, "exchange #0", timeout)
        if r == 2:
            exchangers[r].abort(r, "its checkpoint is missing")
            return got
        return got, exchangers[r].exchange(r, 1, None, "exchange #1", timeout)

    start = time.monotonic()
    out = _ranks(world, rank)
    assert time.monotonic() - start < 5  # ended by the abort, not the 20 s timeout
    assert out[2] == [{"token": t} for t in tokens]
    for r in (0, 1):
        assert isinstance(out[r], dop.DistributedError)
        assert "exchange #1" in str(out[r]) and "rank 2: its checkpoint is missing" in str(out[r])
    for r in reversed(range(world)):  # rank 0, which serves the TCP store, waits for the others to leave it
        exchangers[r].close(r)


def test_an_exchange_every_rank_posted_completes_though_a_rank_aborted_right_after(tmp_path):
    """Rank 1 posts exchange #0 and aborts between rank 0's read of its value and rank 0's look
    for news: exchange #0 is complete and returns; the abort ends exchange #1.  (Reading the
    news after the values failed exchange #0 about once in 100 runs of the test above.)"""
    store = _stores("file", 2, tmp_path, 5.0)[0]
    ex0, ex1 = StoreExchanger(store, 2, 5.0), StoreExchanger(_stores("file", 2, tmp_path, 5.0)[1], 2, 5.0)
    ex1.prefix = ex0.prefix
    get, late = store.get, {"done": False}

    def get_then_rank_1_acts(key):
        value = get(key)
        if key == f"{ex0.prefix}x0/1" and not late["done"]:  # rank 1 acts just after this read
            late["done"] = True
            ex1.post(1, 0, "one")
            ex1.abort(1, "it is done")
        return value

    store.get = get_then_rank_1_acts
    assert ex0.exchange(0, 0, "zero", "exchange #0", 5.0) == ["zero", "one"]
    with pytest.raises(dop.DistributedError, match=r"exchange #1 on rank 0: the group was aborted \(rank 1: it is done\)"):
        ex0.exchange(0, 1, "zero", "exchange #1", 5.0)


def test_a_store_exchange_is_bounded_and_names_the_missing_rank(tmp_path):
    stores = _stores("file", 2, tmp_path, 1.0)
    ex = StoreExchanger(stores[0], 2, 0.2)
    start = time.monotonic()
    with pytest.raises(dop.DistributedError, match=r"dist.init.*timed out after 0.2 s on rank 0: rank\(s\) \[1\]"):
        ex.exchange(0, 0, "hello", "dist.init", 0.2)
    assert time.monotonic() - start < 2
    other = StoreExchanger(stores[1], 2, 1.0)
    other.prefix = ex.prefix
    other.close(1)  # rank 1 left: a wait for it ends at once
    with pytest.raises(dop.DistributedError, match=r"rank\(s\) \[1\] closed their group"):
        ex.exchange(0, 1, "hello", "group.barrier()", 30)



def _run_in(path, r, world, timeout):
    """Rank r's exchanger over a file store directory, as dist.init(store=path) opens it."""
    ex = StoreExchanger(open_store(str(path), "explicit", r, world, timeout), world, timeout)
    ex.prefix = "deviceop/g0/"  # each process names its first group alike
    return ex


def _crashed_run(path, world, rng):
    """Leave in ``path`` what a run that died mid-way leaves: its NCCL unique id, heartbeats, an abort, a rank that left."""
    old = rng.integers(0, 1 << 62)

    def rank(r):
        ex = _run_in(path, r, world, 2.0)
        ex.post(r, "init", ("uid", old))
        ex.store.set(f"{ex.prefix}beat/{r}", b"7")
        if r == 1:
            ex.store.set(f"{ex.prefix}closed/{r}", b"1")
        else:
            ex.abort(r, "crashed")
    assert _ranks(world, rank) == [None] * world
    return old


@pytest.mark.parametrize("late", [0, 1])
def test_a_file_store_reused_after_a_crash_never_gives_a_new_run_the_old_run_s_keys(late, tmp_path, rng):
    world = 2
    old = _crashed_run(tmp_path, world, rng)
    new = old + 1 + rng.integers(0, 1 << 30)

    def rank(r):  # one rank starts later than the other: a stale key was readable meanwhile
        if r == late:
            time.sleep(0.1)
        ex = _run_in(tmp_path, r, world, 2.0)
        return ex.problem(), ex.store.get(f"{ex.prefix}beat/{1 - r}"), ex.exchange(r, "init", ("uid", new), "dist.init", 2.0)

    got = _ranks(world, rank)  # before: rank 0's old unique id, the old abort and heartbeats were read
    assert got == [(None, None, [("uid", new), ("uid", new)])] * world


def test_joining_a_run_in_a_file_store_is_bounded_and_names_who_is_missing(tmp_path, rng):
    _crashed_run(tmp_path, 2, rng)  # its rendezvous files must not let a lone rank through
    start = time.monotonic()
    with pytest.raises(dop.DistributedError, match=r"rank 0 did not admit rank 1 to a new run within 0.2 s"):
        open_store(str(tmp_path), "explicit", 1, 2, 0.2)
    with pytest.raises(dop.DistributedError, match=r"rank\(s\) \[1\] did not join rank 0's run within 0.2 s"):
        open_store(str(tmp_path), "explicit", 0, 2, 0.2)
    assert time.monotonic() - start < 1


def test_a_tcp_store_that_cannot_be_reached_says_where_it_looked():
    with pytest.raises(dop.DistributedError, match=r"could not reach the store at 127.0.0.1:\d+ within 0.2 s"):
        TcpStore("127.0.0.1", _free_port(), serve=False, timeout=0.2)


def test_a_file_store_path_that_is_no_directory_is_refused_naming_it(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("not a directory")  # (raised a raw FileExistsError / NotADirectoryError)
    for path in (taken, taken / "below"):
        with pytest.raises(dop.DistributedError, match="cannot be a directory every rank writes.*pass store="):
            open_store(str(path), "explicit", 0, 2, 0.2)


def test_rank_0_that_cannot_serve_the_tcp_store_says_the_port_is_taken():
    with socket.create_server(("", 0)) as held:  # another process holds the port
        port = held.getsockname()[1]
        with pytest.raises(dop.DistributedError, match=f"rank 0 cannot serve the store on port {port}.*free port"):
            open_store(f"tcp://127.0.0.1:{port}", "explicit", 0, 2, 0.2)  # (a raw OSError before)
