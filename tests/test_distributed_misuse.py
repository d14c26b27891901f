"""deviceop.distributed and tensor-parallel Llama misused as a demanding user would, on the
reference backend (thread-ranks, NumPy): peer buffers whose ranks disagree or that outlive
their group, tensors of another rank's device, arguments that are not what they claim to
be, and tensor-parallel models whose ranks load different checkpoints or options.  Each
test failed before the fix it documents (a crash, a raw error, or silently accepted)."""
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import deviceop as dop
import deviceop.distributed as dist
from deviceop.distributed.store import open_store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from llama.generate import Llama  # noqa: E402
from llama.tp import TINY_TP  # noqa: E402
from llama.weights import random_weights, weights_digest  # noqa: E402


def _up(group, array):
    return dop.from_numpy(array, stream=group.stream)


def _outcome(f):
    """The class name of what ``f()`` raised, or "ok"."""
    try:
        f()
    except Exception as exc:  # noqa: BLE001 - the test asserts which class
        return type(exc).__name__
    return "ok"


# -- peer buffers -------------------------------------------------------------------------

@pytest.mark.parametrize("differ", ["max_bytes", "epochs", "attach"])
def test_peer_buffers_whose_ranks_pass_different_arguments_are_refused_on_every_rank(differ):
    """Different max_bytes made each rank address the peers' slots with its own size: the
    first all-reduce wrote past a peer's buffer (a segfault on the reference device)."""
    args = {"max_bytes": (1024, 4096), "epochs": (None, 200), "attach": (True, False)}[differ]

    def rank(group):
        with pytest.raises(dop.DistributedError, match=f"PeerBuffers: ranks disagree on .*{differ}.*same arguments"):
            dist.PeerBuffers(group, **{differ: args[group.rank]})
        return True
    assert dist.run_reference(2, rank) == [True, True]


def test_peer_buffers_made_by_only_some_ranks_fail_naming_the_others_and_abort_the_group():
    """Rank 1 exchanged something else at that point: rank 0 unpacked it and raised a raw
    TypeError, and rank 1 went on with rank 0's buffer address as its barrier's answer."""
    def rank(group):
        if group.rank == 0:
            with pytest.raises(dop.DistributedError, match=r"different host exchanges.*rank\(s\) \[1\]: 'group.barrier"):
                dist.PeerBuffers(group)
        else:
            with pytest.raises(dop.DistributedError, match=r"different host exchanges.*\[0\]: 'dist.PeerBuffers"):
                group.barrier()
        with pytest.raises(dop.DistributedError, match="aborted"):
            group.barrier()  # aborted: neither rank goes on believing the other is with it
        return True
    assert dist.run_reference(2, rank) == [True, True]


@pytest.mark.parametrize("other", [lambda g: g.barrier(), lambda g: g.exchange(("x", "digest", None)),
                                   lambda g: dist.PeerBuffers(g)])
def test_ranks_at_different_kinds_of_host_exchange_fail_on_every_rank(other):
    """check_same met a barrier: a raw TypeError unpacking the barrier's None; met an exchange of
    a 3-tuple: "rank 1 cannot hash its value: None" (its third item read as the reason)."""
    def rank(group):
        with pytest.raises(dop.DistributedError, match="different host exchanges.*group.check_same"):
            group.check_same("config", {"layers": 2}) if group.rank == 0 else other(group)
        return True
    assert dist.run_reference(2, rank) == [True, True]


def test_peer_buffers_refuse_a_timeout_their_kernels_cannot_count():
    """A timeout of 1e12 s was taken, and the first all-reduce failed on its launch's uint64 scalar."""
    def rank(group):
        with pytest.raises(dop.DistributedError, match="PeerBuffers: a timeout of 1e.12 s.*shorter"):
            dist.PeerBuffers(group, max_bytes=512, timeout=1e12)
        return True
    assert dist.run_reference(2, rank) == [True, True]


def test_peer_buffers_take_numpy_integers_for_their_sizes_and_refuse_bools(rng):
    """max_bytes=np.int64(1024) (a size computed with NumPy) was refused as 'not a positive multiple of 512'."""
    data = rng.standard_normal((2, 256)).astype(np.float32)

    def rank(group):
        for bad in (True, 1024.0, "1024"):
            with pytest.raises(dop.ShapeError, match=f"max_bytes={bad!r}\\): give a positive multiple of 512"):
                dist.PeerBuffers(group, max_bytes=bad)
        with pytest.raises(dop.ShapeError, match=r"epochs=True\): give an int of at least 2"):
            dist.PeerBuffers(group, max_bytes=1024, epochs=True)
        bufs = dist.PeerBuffers(group, max_bytes=np.int64(1024), epochs=np.int32(4))
        assert (bufs.max_bytes, type(bufs.max_bytes), bufs.slot_lines) == (1024, int, 128)
        x = dop.from_numpy(data[group.rank], stream=group.stream)
        bufs.all_reduce(x).sync_on(group.stream)  # in place
        got = x.numpy(stream=group.stream)
        bufs.close()
        return got

    for got in dist.run_reference(2, rank):
        np.testing.assert_allclose(got, data.sum(0), rtol=1e-6, atol=1e-6)


def test_peer_buffers_take_a_group():
    with pytest.raises(dop.DistributedError, match="PeerBuffers takes the group"):
        dist.PeerBuffers(None)


def test_a_one_shot_all_reduce_is_refused_built_run_or_replayed_once_its_buffers_or_group_are_closed(rng):
    """Before: a graph holding the one-shot kernel replayed after its buffers were freed (reading
    freed memory), and after its group was closed (while a collective's graph refuses), and an
    all-reduce built before the close ran after it."""
    data = rng.standard_normal((2, 128)).astype(np.float32)

    def rank(group):
        s, x = group.stream, _up(group, data[group.rank])
        bufs = dist.PeerBuffers(group, max_bytes=512)
        graph = dist.all_reduce(group, x).graph_on(s)  # "auto": the one-shot kernel
        graph.replay()
        pending = bufs.all_reduce(x)
        bufs.close()
        with pytest.raises(dop.DistributedError, match="closed buffers.*make new ones"):
            graph.replay()
        with pytest.raises(dop.DistributedError, match="closed buffers"):
            pending.sync_on(s)
        bufs = dist.PeerBuffers(group, max_bytes=512)
        graph = bufs.all_reduce(x).graph_on(s)
        graph.replay()
        pending = bufs.all_reduce(x)
        group.barrier()
        group.close()
        for f in (graph.replay, lambda: pending.sync_on(s), lambda: bufs.all_reduce(x)):
            with pytest.raises(dist.GroupClosedError, match="closed"):
                f()
        return x.numpy()
    got = dist.run_reference(2, rank)
    assert np.array_equal(got[0], got[1])
    assert np.allclose(got[0], 2 * data.sum(0), rtol=1e-5, atol=1e-5)  # summed by each graph's one replay


def test_a_one_shot_all_reduce_that_gave_up_on_a_peer_fails_group_synchronize_as_nccl_does(rng):
    """Rank 1 skipped an all-reduce ("auto": the one-shot kernel) whose signature was agreed
    before: rank 0's wait gave up and wrote NaN, and group.synchronize() returned as if all were
    well (with NCCL it raises and aborts the group)."""
    data = rng.standard_normal((2, 128)).astype(np.float32)

    def rank(group):
        s = group.stream
        dist.PeerBuffers(group, max_bytes=512, timeout=0.2)
        x = _up(group, data[group.rank])
        dist.all_reduce(group, x).sync_on(s)
        if group.rank == 0:
            dist.all_reduce(group, x).sync_on(s)  # rank 1 never issues it
            with pytest.raises(dop.DistributedError, match="did not arrive within 0.2 s.*group is aborted"):
                group.synchronize()
            assert np.isnan(x.numpy()).all()
        else:
            group.synchronize()  # its own all-reduces all completed
        with pytest.raises(dop.DistributedError, match="aborted"):
            group.barrier()
        return True
    assert dist.run_reference(2, rank) == [True, True]


@pytest.mark.parametrize("algorithm", ["nccl", "oneshot", "auto"])
def test_all_reduce_refuses_the_same_mistakes_with_the_same_classes_whatever_the_algorithm(algorithm):
    """"auto" picks the one-shot kernel where the group has peer buffers: it raised ShapeError
    for an out of another dtype (NCCL's path: DTypeError) and for an out overlapping x
    (AliasingError), so what a user caught changed with whether PeerBuffers existed."""
    def rank(group):
        s = group.stream
        dist.PeerBuffers(group, max_bytes=4096)
        x, big = dop.zeros(256, stream=s), dop.zeros(512, stream=s)
        for kind, make in ((dop.DTypeError, lambda: dist.all_reduce(group, x, dop.empty(256, "bfloat16", stream=s),
                                                                    algorithm=algorithm)),
                           (dop.ShapeError, lambda: dist.all_reduce(group, x, dop.empty(128, stream=s),
                                                                    algorithm=algorithm)),
                           (dop.AliasingError, lambda: dist.all_reduce(group, big[:256], big[128:384],
                                                                       algorithm=algorithm))):
            with pytest.raises(kind):
                make()
        return True
    assert dist.run_reference(2, rank) == [True, True]


def test_the_one_shot_all_reduce_takes_ops_that_produce_its_tensors_as_nccl_s_path_does(rng):
    """dist.all_reduce(group, op, algorithm="oneshot") raised "x must be a deviceop Tensor or
    SharedTensor, got Memcpy", where "nccl" (and "auto", by falling back) took the op."""
    from deviceop import api
    data = rng.standard_normal((2, 256)).astype(np.float32)

    def rank(group):
        s = group.stream
        dist.PeerBuffers(group, max_bytes=1024)
        x, y, out = _up(group, data[group.rank]), dop.empty(256, stream=s), dop.empty(256, stream=s)
        dist.all_reduce(group, api.memcpy(y, x), algorithm="oneshot").sync_on(s)
        eager = y.numpy()
        graph = dist.all_reduce(group, api.memcpy(y, x), out=out, algorithm="oneshot").graph_on(s)
        graph.replay()
        return eager, out.numpy()
    got = dist.run_reference(2, rank)
    want = data[0] + data[1]  # fp32 in rank order: what the one-shot kernel computes
    for eager, captured in got:
        assert np.array_equal(eager, want) and np.array_equal(captured, want)


def test_auto_falls_back_to_nccl_for_a_view_the_one_shot_kernel_cannot_take(rng):
    """"auto" took a view one float into its buffer (not 16-byte aligned) for the one-shot
    kernel, which refused it: an all-reduce that works without PeerBuffers failed with them."""
    data = rng.standard_normal((2, 260)).astype(np.float32)

    def rank(group):
        s = group.stream
        dist.PeerBuffers(group, max_bytes=1024)
        big, out = _up(group, data[group.rank]), dop.zeros(260, stream=s)
        dist.all_reduce(group, big[1:129]).sync_on(s)        # x misaligned
        dist.all_reduce(group, big[129:257], out=out[1:129]).sync_on(s)  # out misaligned
        return big.numpy(), out.numpy()
    for big, out in dist.run_reference(2, rank):
        assert np.allclose(big[1:129], data[:, 1:129].sum(0)) and np.allclose(out[1:129], data[:, 129:257].sum(0))


@pytest.mark.parametrize("algorithm", ["oneshot", "auto"])
def test_the_one_shot_all_reduce_takes_out_as_x_s_own_memory_in_place_as_nccl_s_path_does(algorithm, rng):
    """out=x (or x in another shape) reduces in place on NCCL's path; the one-shot kernel refused
    it as an overlap (AliasingError), so "auto" failed where "nccl" worked."""
    data = rng.standard_normal((2, 256)).astype(np.float32)

    def rank(group):
        s = group.stream
        dist.PeerBuffers(group, max_bytes=1024)
        x, y = _up(group, data[group.rank]), _up(group, data[group.rank])
        dist.all_reduce(group, x, out=x, algorithm=algorithm).sync_on(s)
        dist.all_reduce(group, y, out=y.view(16, 16), algorithm=algorithm).sync_on(s)
        return x.numpy(), y.numpy()
    for x, y in dist.run_reference(2, rank):
        assert np.array_equal(x, data[0] + data[1]) and np.array_equal(y, data[0] + data[1])


# -- tensors and streams of another device --------------------------------------------------

@pytest.mark.parametrize("algorithm", ["nccl", "oneshot"])
def test_a_collective_refuses_a_tensor_of_another_device(algorithm, rng):
    """Each thread-rank has a device of its own, as each process has its GPU: a tensor of the
    process's Device(0), or of the other rank, was reduced as if it were the rank's (on GPUs,
    NCCL is handed a pointer into another GPU)."""
    data = rng.standard_normal((2, 128)).astype(np.float32)
    tensors = {}

    def rank(group):
        if algorithm == "oneshot":
            dist.PeerBuffers(group, max_bytes=512)
        mine = tensors[group.rank] = _up(group, data[group.rank])
        group.barrier()
        for foreign in (dop.from_numpy(data[group.rank]), tensors[1 - group.rank]):
            for make in (lambda: dist.all_reduce(group, foreign, algorithm=algorithm),
                         lambda: dist.all_reduce(group, mine, out=foreign, algorithm=algorithm)):
                with pytest.raises(dop.DistributedError, match="lives on .* group's device .*group.stream"):
                    make()
        for make in (lambda: dist.all_gather(group, foreign, dop.empty(256, stream=group.stream)),
                     lambda: dist.send(group, foreign, 1 - group.rank),
                     lambda: dist.broadcast(group, foreign)):
            with pytest.raises(dop.DistributedError, match="lives on"):
                make()
        group.barrier()
        return True
    assert dist.run_reference(2, rank) == [True, True]


def test_synchronize_takes_a_stream_of_the_group_s_device():
    def rank(group):
        assert _outcome(lambda: group.synchronize(5)) == "DistributedError"  # was a raw AttributeError
        assert _outcome(lambda: group.synchronize(dop.Device(0).new_stream())) == "DistributedError"
        group.synchronize(group.device.new_stream())
        return True
    assert dist.run_reference(2, rank) == [True, True]


# -- arguments of init and run_reference ----------------------------------------------------

@pytest.mark.parametrize("device", ["cuda:0", 1.5, object()])
def test_init_refuses_a_device_that_is_not_one(device):
    with pytest.raises(dop.DistributedError, match="device=.*a deviceop Device"):  # was a raw AttributeError
        dist.init(rank=0, world_size=1, device=device)


def test_init_takes_a_device_or_its_ordinal():
    for device in (dop.Device(0), 0, np.int64(0)):
        with dist.init(rank=0, world_size=1, device=device) as group:
            assert group.device is dop.Device(0)


@pytest.mark.parametrize("store", [5, object(), b"/tmp/x"])
def test_a_store_that_is_neither_a_path_an_address_nor_a_store_is_refused(store):
    with pytest.raises(dop.DistributedError, match="store=.*directory.*tcp://host:port.*set.*get"):
        open_store(store, "explicit", 0, 2, 1.0)  # was returned as the store: a raw error at the first exchange


def test_run_reference_takes_numpy_integers_and_refuses_what_it_cannot_call():
    assert dist.run_reference(np.int64(2), lambda g: g.rank) == [0, 1]  # was "needs a world size >= 1, got 2"
    with pytest.raises(dop.DistributedError, match="run_reference.*callable"):  # was a raw TypeError in a thread
        dist.run_reference(2, None)


# -- tensor-parallel Llama ------------------------------------------------------------------

CFG = TINY_TP


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=int.from_bytes(os.urandom(4), "little"), std=0.1)


@pytest.mark.parametrize("group", [2, "group", object()])
def test_llama_refuses_a_group_that_is_not_one(weights, group):
    with pytest.raises(dop.DistributedError, match="group=.*dist.init"):  # was a raw AttributeError
        Llama(CFG, weights, capacity=16, group=group)


def test_llama_tp_is_an_integer_never_a_bool(weights):
    with pytest.raises(dop.ShapeError, match="tp=True"):  # was read as tp=1
        Llama(CFG, weights, capacity=16, tp=True)
    assert Llama(CFG, weights, capacity=16, tp=np.int64(1)).group is None  # NumPy's integers are ints


def test_ranks_that_pick_different_allreduce_options_are_refused_before_any_buffer_is_made(weights):
    """Rank 0's "auto" made peer buffers while rank 1's "nccl" went on: the two exchanges met and
    PeerBuffers raised a raw ValueError unpacking rank 1's request."""
    def rank(group):
        with pytest.raises(dop.StateError, match="ranks disagree on the model.*allreduce"):
            Llama(CFG, weights, capacity=16, group=group, allreduce=("auto", "nccl")[group.rank])
        return True
    assert dist.run_reference(2, rank) == [True, True]


def test_ranks_whose_configs_are_equal_but_spelled_otherwise_agree(weights):
    """A rope_scaling dict built with its keys in another order, or a size that is a NumPy integer, made
    tensor-parallel ranks refuse each other ('the ranks disagree on the model'): configs were compared by repr."""
    from dataclasses import replace
    other = replace(CFG, hidden_size=np.int64(CFG.hidden_size),
                    rope_scaling=dict(reversed(list(CFG.rope_scaling.items()))))
    assert other.to_dict() == CFG.to_dict() and type(other.hidden_size) is int

    def rank(group):
        with Llama((CFG, other)[group.rank], weights, capacity=16, group=group, allreduce="nccl") as llama:
            return llama.decoder.shard.size
    assert dist.run_reference(2, rank) == [2, 2]

    def differ(group):  # a scaling that really differs is still refused
        scaling = dict(CFG.rope_scaling, factor=CFG.rope_scaling["factor"] * (1 + group.rank))
        with pytest.raises(dop.StateError, match="the ranks disagree on the model"):
            Llama(replace(CFG, rope_scaling=scaling), weights, capacity=16, group=group, allreduce="nccl")
        return True
    assert dist.run_reference(2, differ) == [True, True]


def test_ranks_that_load_different_checkpoints_are_refused_at_init(weights):
    """Rank 1 loading another checkpoint (same config) built and generated without a word."""
    other = random_weights(CFG, seed=int.from_bytes(os.urandom(4), "little"), std=0.1)

    def rank(group):
        with pytest.raises(dop.StateError, match="ranks disagree on the weights"):
            Llama(CFG, (weights, other)[group.rank], capacity=16, group=group, allreduce="nccl")
        return True
    assert dist.run_reference(2, rank) == [True, True]


def on_device(weights: dict, stream) -> dict:
    """The weights as deviceop tensors (device tensors, as torch's or CuPy's would be)."""
    return {k: dop.from_numpy(v, stream=stream) for k, v in weights.items()}


def test_the_weights_digest_samples_device_tensors_as_it_samples_host_arrays(weights, rng):
    """Device tensors counted by name, shape and dtype only, so ranks that loaded different
    device weights agreed; their sampled runs are now copied to the host, and digest as the
    host arrays of the same values do."""
    stream = dop.Device(0).new_stream()
    host = weights_digest(CFG, weights)
    assert weights_digest(CFG, on_device(weights, stream)) == host  # (stream=: where the runs are copied)
    name = list(weights)[rng.integers(len(weights))]
    changed = dict(weights)
    changed[name] = weights[name].copy()
    changed[name].reshape(-1)[0] = -weights[name].reshape(-1)[0] - 1  # in the first sampled run
    assert weights_digest(CFG, on_device(changed, stream), stream) != host


def test_ranks_whose_device_weights_differ_are_refused_and_a_host_and_a_device_load_agree(weights):
    torch = pytest.importorskip("torch", reason="device weights through DLPack: torch's CPU tensors here")
    other = random_weights(CFG, seed=int.from_bytes(os.urandom(4), "little"), std=0.1)

    def as_torch(ws):
        return {k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) for k, v in ws.items()}

    def refused(group):
        with pytest.raises(dop.StateError, match="ranks disagree on the weights"):
            Llama(CFG, as_torch((weights, other)[group.rank]), capacity=16, group=group, allreduce="nccl")
        return True
    assert dist.run_reference(2, refused) == [True, True]

    def mixed(group):  # rank 0 host arrays, rank 1 the same values as device tensors
        with Llama(CFG, (weights, as_torch(weights))[group.rank], capacity=16, group=group,
                   allreduce="nccl") as llama:
            w = llama.decoder.w  # imported onto the rank's device, not the process's Device(0)
            assert w.embed.device is group.device and w.layers[0]["o"].device is group.device
            return llama.decoder.shard.rank
    assert dist.run_reference(2, mixed) == [0, 1]


def test_ranks_that_load_the_same_checkpoint_from_different_copies_agree(weights):
    copy = {k: np.array(v) for k, v in weights.items()}  # equal values, other arrays

    def rank(group):
        with Llama(CFG, (weights, copy)[group.rank], capacity=16, group=group, allreduce="nccl") as llama:
            return llama.decoder.shard.rank
    assert dist.run_reference(2, rank) == [0, 1]


def test_a_group_llama_made_from_the_launcher_is_closed_by_close_and_aborted_when_refused(weights, monkeypatch):
    """``Llama(tp=N)`` makes its group with dist.init(); close() left it open (at exit its
    atexit hook then aborted it, failing the other ranks), and a refused tp leaked it."""
    groups, made = {}, []

    def init():  # the launcher's group of this thread-rank, as dist.init() gives each process its own
        made.append(groups[threading.get_ident()])
        return made[-1]
    monkeypatch.setattr(dist, "init", init)

    def rank(group):
        groups[threading.get_ident()] = group
        with Llama(CFG, weights, capacity=16, tp=2) as llama:
            assert llama.group is group
        return "closed" in repr(group)
    assert dist.run_reference(2, rank) == [True, True]

    def refused(group):
        groups[threading.get_ident()] = group
        with pytest.raises(dop.ShapeError, match="tp=4 but the group has 2 ranks"):
            Llama(CFG, weights, capacity=16, tp=4)
        return "aborted" in repr(group)
    made.clear()
    assert dist.run_reference(2, refused) == [True, True]
    assert len(made) == 2


def test_a_rank_opens_only_its_own_device_never_device_0(monkeypatch):
    """dist.init asked Device(0) whether there were GPUs: every rank's process opened a CUDA
    context on GPU 0 (its memory there, whatever GPU the rank drives)."""
    from deviceop.distributed import launch
    asked, real = [], launch.Device

    def device(ordinal=0):
        asked.append(ordinal)
        return real(0)  # (the reference device stands for GPU `ordinal`)
    monkeypatch.setattr(launch, "Device", device)
    with dist.init(rank=0, world_size=1, local_rank=1):
        pass
    assert asked == [1]


def test_a_tensor_parallel_rank_checks_its_own_device_s_memory_and_refuses_a_stream_of_another(weights, monkeypatch):
    """The decoder measured Device(0)'s free memory on every rank (opening GPU 0 in each process),
    and a stream of another device was taken, failing later inside the first generation."""
    from llama import model
    seen, real = [], model.check_memory
    monkeypatch.setattr(model, "check_memory", lambda cfg, w, cap, device: seen.append(device) or real(cfg, w, cap,
                                                                                                        device))

    def rank(group):
        with pytest.raises(dop.DistributedError, match="stream=.*not a stream of the group's device"):
            Llama(CFG, weights, capacity=16, group=group, stream=dop.Device(0).new_stream())
        with Llama(CFG, weights, capacity=16, group=group, allreduce="nccl"):
            pass
        return group.device
    devices = dist.run_reference(2, rank)
    assert sorted(map(id, seen)) == sorted(map(id, devices))


def test_a_fused_all_reduce_kernel_refuses_scalars_that_are_not_its_buffers(rng):
    """matvec_allreduce (and the one-shot kernels) address the peers' memory from the scalars they
    are given: a larger slot_lines stored past the end of every peer's buffer (a segfault on the
    reference device), buffers closed before the launch were read after being freed, and another
    rank's number made both ranks wait for a slot nobody writes."""
    import ml_dtypes
    from deviceop.kernels.llama_tp import matvec_allreduce
    w_host = rng.standard_normal((512, 256)).astype(ml_dtypes.bfloat16)

    def rank(group):
        s = group.stream
        bufs = dist.PeerBuffers(group, max_bytes=4096, epochs=300, attach=False, timeout=0.5)
        other = dist.PeerBuffers(group, max_bytes=4096, epochs=300, attach=False, timeout=0.5)
        x, w = dop.from_numpy(np.ones(256, np.float32), stream=s), dop.from_numpy(w_host, stream=s)
        out, res = dop.empty(512, stream=s), dop.zeros(512, stream=s)

        def launch(peers=bufs.peers, rank=group.rank, slot_lines=bufs.slot_lines, line0=0):
            matvec_allreduce(out.partition([8]), x, w, res, peers, bufs.state, rank, slot_lines, line0, 1,
                             bufs.timeout_ns).generics([256, 1, 1, 4, 8, 1, 2, 2]).sync_on(s)
        for kwargs, words in ((dict(slot_lines=10 ** 6, line0=10 ** 5), "slot_lines=1000000 .*pass bufs.slot_lines"),
                              (dict(rank=1 - group.rank), "rank .* pass group.rank"),
                              (dict(peers=other.peers), "peers is not the peer table")):
            with pytest.raises(dop.ShapeError, match=words):
                launch(**kwargs)
        launch()
        bufs.check()  # no wait gave up: every launch refused was refused before it ran
        got = out.numpy()
        bufs.close()
        with pytest.raises(dop.DistributedError, match="closed buffers"):
            launch(line0=64)  # a launch not seen before: its checks run, and refuse
        launch()  # one seen before (as a graph's replay) skips them: the error word's CLOSED bit
        assert np.isnan(out.numpy()).all()  # makes it touch no peer memory (freed) and write NaN
        other.close()
        return got
    got = dist.run_reference(2, rank)
    want = 2 * (w_host.astype(np.float64) @ np.ones(256))
    assert np.array_equal(got[0], got[1]) and np.allclose(got[0], want, rtol=1e-4, atol=1e-3)


def test_allreduce_auto_falls_back_to_nccl_where_peer_memory_cannot_reach_every_rank(weights, monkeypatch):
    """Llama's allreduce="auto" promises NCCL where the one-shot kernel does not apply; on ranks
    of several machines it raised PeerBuffers' "needs every rank on one machine" instead.
    allreduce="oneshot" asks for peer memory, and is still refused there."""
    import socket
    real = socket.gethostname
    monkeypatch.setattr(socket, "gethostname", lambda: threading.current_thread().name.replace("deviceop-rank-", "node")
                        if threading.current_thread().name.startswith("deviceop-rank-") else real())

    def rank(group):
        with Llama(CFG, weights, capacity=16, group=group) as llama:
            assert llama.decoder.allreduce == "nccl" and llama.decoder.fused is None
            assert dist.peer.peer_buffers(group) is None
        with pytest.raises(dop.DistributedError, match="one machine.*'node0', 'node1'"):
            Llama(CFG, weights, capacity=16, group=group, allreduce="oneshot")
        return True
    assert dist.run_reference(2, rank) == [True, True]


def test_the_cli_at_tp_closes_the_group_it_made_and_drives_the_local_rank_s_gpu(tmp_path, monkeypatch):
    """`torchrun -m examples.llama --tp 2` left its group open: the first rank to exit aborted it
    (the atexit hook) while the others still ran; and every rank opened GPU 0 (Device(0)) to
    pick its model, whatever GPU it drives."""
    import json

    import llama.__main__ as cli
    from deviceop.runtime import driver
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_dict()))
    groups = {}
    monkeypatch.setattr(dist, "init", lambda: groups[threading.get_ident()])

    def rank(group):
        groups[threading.get_ident()] = group
        code = cli.main(["--random", "--config", str(tmp_path), "--tokens", "--prompt-len", "3", "--max-new", "2",
                         "--capacity", "16", "--tp", "2"])
        return code, repr(group)
    assert [(code, "closed" in state) for code, state in dist.run_reference(2, rank)] == [(0, True), (0, True)]

    asked = []
    monkeypatch.setattr(driver, "driver_available", lambda: True)
    monkeypatch.setattr(cli.dop, "Device", lambda ordinal=0: asked.append(ordinal) or "GPU %d" % ordinal)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cli.rank_device(4) == (3, "GPU 1") and asked == [1]


def test_a_group_of_one_rank_is_tp1_and_takes_chunked_prefill(weights):
    """A script written for torchrun run as one process (dist.init(): a group of one) was refused
    chunked prefill as if it were tensor parallel."""
    def rank(group):
        with Llama(CFG, weights, capacity=16, group=group, prefill_chunk=8) as llama:
            return llama.prefill_chunk, llama.decoder.group
    assert dist.run_reference(1, rank) == [(8, None)]


def test_chunked_prefill_asked_of_a_tensor_parallel_generate_is_refused_naming_why(weights):
    """Refused at construction, but generate(prefill_chunk=8) built the chunked prefill over the
    rank's shard and failed in a kernel's shape check (k_cache [2, 16, 64] where HKV=4)."""
    def rank(group):
        with Llama(CFG, weights, capacity=16, group=group, allreduce="nccl") as llama:
            with pytest.raises(dop.ShapeError, match="chunked prefill is not tensor parallel yet"):
                llama.generate([5, 6, 7], 2, prefill_chunk=8)
        return True
    assert dist.run_reference(2, rank) == [True, True]
