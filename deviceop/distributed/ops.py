"""Collectives as DeviceOps: all_reduce, all_gather, reduce_scatter, broadcast,
send and recv.

A collective is lazy like a kernel launch: building it checks what is known
and runs nothing; executing it enqueues the group's backend work on the
execution's stream — eagerly (``sync_on``/``async_on``), or, while the stream
captures (``graph_on``, ``CudaGraph.scope``, ``recapture``, a ``dop.loop`` or
``dop.while_`` body), as nodes of the graph, which replays it.  On the GPU
that is NCCL's own work captured on the stream; on the reference device a
tape step that meets the other thread-ranks when it runs.

The written tensor is claimed as any write is: a SharedTensor must be the only
handle to its buffer (as ``api.memcpy``'s destination), a plain Tensor is a
mutable borrow its caller vouches for; an output overlapping an input is an
AliasingError (except an in-place all_reduce/broadcast, which NCCL allows);
dtypes, sizes and contiguity are checked here, and that every rank issues the
same collective by the backend (the reference hub at every call; NCCL once per
distinct signature, through one host exchange, and a send with its recv once
per new peer, dtype and count).

The op is one class, ``Collective``: what it asks of deviceop (inputs,
outputs, graph safety, the capture keeping its buffers alive) is what a
generic foreign-work op would ask, so it can later sit on top of one.
"""
from __future__ import annotations

import operator

from ..errors import AliasingError, DistributedError, DTypeError, ShapeError
from ..op import DeviceOp, resolve, warn_if_unexecuted, zip_
from ..tensor import Tensor
from .args import check_device, tensor_arg, written_arg
from .group import Group
from .peer import peer_buffers

REDUCTIONS = ("sum", "prod", "max", "min", "avg")
ALGORITHMS = ("auto", "nccl", "oneshot")  # of all_reduce: peer.py is the one-shot kernel
# what NCCL reduces and moves (ncclDataType_t); bool and the fp8s are refused
DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32", "float64")


class Call:
    """One collective as a backend sees it: the checked tensors and the parameters."""

    __slots__ = ("kind", "send", "recv", "reduce", "root", "peer", "count")

    def __init__(self, kind, send, recv, reduce, root, peer, count):
        self.kind, self.send, self.recv = kind, send, recv
        self.reduce, self.root, self.peer, self.count = reduce, root, peer, count

    @property
    def dtype(self):
        return (self.send if self.send is not None else self.recv).dtype

    @property
    def signature(self) -> tuple:
        """What every rank must agree on (send/recv: the pair, checked by the pair)."""
        return (self.kind, self.dtype.name, self.count, self.reduce, self.root)

    def describe(self) -> str:
        args = [f"{self.count} x {self.dtype.name}"]
        if self.reduce is not None:
            args.append(self.reduce)
        if self.root is not None:
            args.append(f"root={self.root}")
        if self.peer is not None:
            args.append(f"peer={self.peer}")
        return f"dist.{self.kind}({', '.join(args)})"


class Collective(DeviceOp):
    """One collective on ``group``: reads ``x``, writes ``out`` (see the module docstring)."""

    __slots__ = ("group", "kind", "x", "out", "reduce", "root", "peer", "__weakref__")
    graph_safe = True
    op_name = "dist.collective"

    def __init__(self, group, kind: str, x, out, reduce=None, root=None, peer=None):
        super().__init__()
        _check_group(group, kind)
        if kind in ("all_reduce", "reduce_scatter") and not (isinstance(reduce, str) and reduce in REDUCTIONS):
            raise DistributedError(f"dist.{kind}: unknown reduction {reduce!r}; use one of {', '.join(REDUCTIONS)}")
        root = _rank(group, kind, "root", root) if kind == "broadcast" else None
        peer = _rank(group, kind, "peer", peer) if kind in ("send", "recv") else None
        self.group, self.kind, self.x, self.out = group, kind, x, out
        self.reduce, self.root, self.peer = reduce, root, peer
        if peer is not None and peer == group.rank:
            raise DistributedError(f"dist.{kind}: peer={peer} is this rank itself; send to and receive "
                                   "from another rank (a copy within a rank is api.memcpy)")
        if not any(isinstance(a, DeviceOp) for a in (x, out)):
            self._check(x, out)  # known now: checked now, before anything runs
        for a in (x, out):
            if isinstance(a, DeviceOp):
                a._armed = False  # run by this collective
        self._armed = True

    __del__ = warn_if_unexecuted

    def children(self):
        seen = []
        for a in (self.x, self.out):
            if isinstance(a, DeviceOp) and not any(a is s for s in seen):
                seen.append(a)
        return tuple(seen)

    def describe(self) -> str:
        extra = f", {self.reduce}" if self.reduce else ""
        extra += f", root={self.root}" if self.root is not None else ""
        extra += f", peer={self.peer}" if self.peer is not None else ""
        return f"dist.{self.kind}(rank {self.group.rank}/{self.group.world_size}{extra})"

    def _execute(self, ctx):
        x = resolve(self.x, ctx)
        out = x if self.out is self.x else resolve(self.out, ctx)
        call = self._check(x, out)
        if ctx.guard is not None and call.recv is not None:  # in a loop's body: not into its index or count
            ctx.guard.check(call.recv, self.describe)
        if ctx.device is not self.group.device:  # (thread-ranks' reference devices differ only in identity)
            raise DistributedError(f"{self.describe()} executed on a stream of {ctx.device.label}, but the group's "
                                   f"device is {self.group.device.label}; run it on the group's stream "
                                   "(group.stream) or another stream of group.device")
        self.group.issue(ctx.stream, call)
        if ctx.capture is not None:
            # the graph reads and writes these; each replay checks that the group is still open
            ctx.capture.keep.extend(((call.send, call.recv, self.group), self.group.replay_check))
        return call.recv if call.recv is not None else call.send  # the tensor written (send: the one read)

    # -- checks ------------------------------------------------------------------------
    def _check(self, x, out) -> Call:
        kind, ws = self.kind, self.group.world_size
        read = None if kind == "recv" else tensor_arg(x, f"dist.{kind}'s input")
        # a broadcast's root only reads its buffer (NCCL's in-place broadcast copies nothing there)
        reads_only = kind == "send" or (kind == "broadcast" and self.root == self.group.rank)
        written = None if reads_only else _written(out, f"dist.{kind}'s output")
        for t, what in ((read, "input"), (written, "output")):
            if t is None:
                continue
            check_device(t, self.group, f"dist.{kind}'s {what}")
            if t.dtype.name not in DTYPES:
                raise DTypeError(f"dist.{kind} of a {t.dtype.name} tensor: collectives move "
                                 f"{', '.join(DTYPES)}; convert it first")
            if not t.is_contiguous:
                raise ShapeError(f"dist.{kind} needs contiguous tensors (a {list(t.shape)} view with strides "
                                 f"{list(t.strides)} is not); copy it into a contiguous buffer first")
        if read is not None and written is not None:
            if read.dtype is not written.dtype:
                raise DTypeError(f"dist.{kind} reads {read.dtype.name} and writes {written.dtype.name}; "
                                 "dtypes must match")
            want = {"all_gather": read.size * ws, "reduce_scatter": read.size // ws}.get(kind, read.size)
            if kind == "reduce_scatter" and read.size % ws:
                raise ShapeError(f"dist.reduce_scatter of {read.size} elements over {ws} ranks: the input's size "
                                 "must be a multiple of the world size")
            if written.size != want:
                rule = {"all_gather": f"world_size ({ws}) x the input's", "reduce_scatter":
                        f"the input's / world_size ({ws})"}.get(kind, "the input's")
                raise ShapeError(f"dist.{kind}: the output holds {written.size} elements ({list(written.shape)}) "
                                 f"but must hold {rule}: {want} (input {list(read.shape)})")
            if written.overlaps(read) and not (kind in ("all_reduce", "broadcast") and written.data_ptr ==
                                               read.data_ptr):  # (same pointer, same size: NCCL's in place)
                raise AliasingError(f"dist.{kind}: the output overlaps the input; "
                                    + ("pass out=None to reduce in place, or " if kind == "all_reduce" else "")
                                    + "write into a separate buffer")
        if kind == "reduce_scatter" or kind == "recv":
            count = written.size
        elif kind == "broadcast" and written is None:  # the root: its buffer is read and written in place
            count, written = read.size, read
        else:
            count = read.size
        dt = (read if read is not None else written).dtype
        if self.reduce == "avg" and not dt.is_floating:
            raise DTypeError(f"dist.{kind}(op='avg') of {dt.name}: an average needs a "
                             "floating-point dtype; use 'sum' and divide")
        return Call(kind, read, written, self.reduce, self.root, self.peer, count)


def _check_group(group, kind: str) -> None:
    if not isinstance(group, Group):
        raise DistributedError(f"dist.{kind} takes the group first: dist.{kind}(group, ...) with the group of "
                               f"dist.init() or dist.run_reference, got a {type(group).__name__} (torch.distributed "
                               "passes the group last)")
    group._check_open(f"dist.{kind}")


def _rank(group, kind: str, what: str, r) -> int:
    """``r`` as a rank of ``group`` (any integer, NumPy's too; never None or a bool)."""
    try:
        value = None if isinstance(r, (bool, type(None))) else operator.index(r)
    except TypeError:
        value = None
    if value is None or not 0 <= value < group.world_size:
        raise DistributedError(f"dist.{kind}: {what}={r!r} is not a rank of this group: pass an int in "
                               f"0..{group.world_size - 1}")
    return value


def _written(x, what: str) -> Tensor:
    """The tensor a collective writes (args.written_arg); a collective allocates nothing."""
    if x is None:
        raise DTypeError(f"{what}: the collective needs an output tensor; allocate it before (dop.empty(shape, "
                         "dtype, stream=group.stream)): a collective allocates nothing, so that graphs can replay it")
    return written_arg(x, what)


# -- the public functions ---------------------------------------------------------------

def all_reduce(group, x, out=None, op: str = "sum", algorithm: str = "auto") -> DeviceOp:
    """Reduce ``x`` over the ranks (``op``: sum, prod, max, min, avg) into ``out``, or in
    place when ``out`` is None (``x`` is then written: it must be writable).  Value: the
    written tensor.

    ``algorithm``: ``"nccl"``, NCCL's all-reduce; ``"oneshot"``, the one-shot kernel
    over the group's peer buffers (``dist.PeerBuffers(group)`` first, on every rank: a
    sum of float32 or bfloat16, a multiple of 512 bytes up to its ``max_bytes``; see
    peer.py); ``"auto"`` (the default), the one-shot kernel where the group had peer
    buffers when the all-reduce was built and they accept the tensors, NCCL otherwise.
    The tensors are asked once they exist: at once when given, when the ops producing them
    have run when ops are given, so a tensor and an op producing it choose alike."""
    _check_group(group, "all_reduce")
    if algorithm not in ALGORITHMS:
        raise DistributedError(f"dist.all_reduce: unknown algorithm {algorithm!r}; use one of "
                               f"{', '.join(map(repr, ALGORITHMS))}")
    bufs = peer_buffers(group) if algorithm != "nccl" else None
    if algorithm == "oneshot":
        if bufs is None:
            raise DistributedError("dist.all_reduce(algorithm='oneshot') needs the group's peer buffers: make them "
                                   "once on every rank with dist.PeerBuffers(group)")
        if op != "sum":
            raise DistributedError(f"dist.all_reduce(op={op!r}, algorithm='oneshot'): the one-shot kernel sums; "
                                   "use algorithm='nccl'")
        return _oneshot(bufs, x, out)
    if bufs is not None and op == "sum" and (isinstance(x, DeviceOp) or isinstance(out, DeviceOp)):
        # "auto" asks the tensors (dtype, size, alignment), which an op gives only when it runs
        out = None if out is x else out
        return zip_(x, out).then(lambda xo: _auto(group, bufs, xo[0], xo[1], op, deferred=True))
    return _auto(group, bufs, x, out, op)


def _auto(group, bufs, x, out, op, deferred=False) -> DeviceOp:
    """"auto"'s choice for tensors ``x`` and ``out`` (the one-shot kernel where ``bufs`` takes
    both), or the NCCL Collective (also for ops, where ``bufs`` is None or the op no sum)."""
    if deferred:  # as a tensor's all-reduce built on buffers closed since would be refused when it runs
        bufs._check_usable("dist.all_reduce(algorithm='auto')")
    if bufs is not None and op == "sum" and bufs.accepts(x) and (out is None or bufs.accepts(out)):
        return _oneshot(bufs, x, out)
    return Collective(group, "all_reduce", x, x if out is None else out, reduce=op)


def _oneshot(bufs, x, out) -> DeviceOp:
    """The one-shot all-reduce of ``x`` into ``out`` (tensors, or ops producing them), whose
    value is the written tensor."""
    if isinstance(x, DeviceOp) or isinstance(out, DeviceOp):  # ops producing them, as NCCL's path takes
        return zip_(x, out).then(lambda xo: bufs.all_reduce(xo[0], xo[1]).map(
            lambda _: xo[0] if out is None else xo[1]))
    written = x if out is None else out
    return bufs.all_reduce(x, out).map(lambda _: written)


def all_gather(group, x, out) -> DeviceOp:
    """Every rank's ``x``, in rank order, into ``out`` (``world_size`` times ``x``'s size,
    e.g. shape ``[world_size * n, ...]`` for ``x`` of ``[n, ...]``).  Value: ``out``."""
    return Collective(group, "all_gather", x, out)


def reduce_scatter(group, x, out, op: str = "sum") -> DeviceOp:
    """Reduce ``x`` over the ranks and give rank ``r`` the ``r``-th of ``world_size``
    equal chunks, in ``out``.  Value: ``out``."""
    return Collective(group, "reduce_scatter", x, out, reduce=op)


def broadcast(group, x, root: int = 0) -> DeviceOp:
    """Rank ``root``'s ``x`` into every rank's ``x`` (written on the others).  Value: ``x``."""
    return Collective(group, "broadcast", x, x, root=root)


def send(group, x, peer: int) -> DeviceOp:
    """Send ``x`` to rank ``peer``, which must ``recv`` a tensor of the same dtype and size
    (sends and receives between two ranks match in order).  Value: ``x``."""
    return Collective(group, "send", x, None, peer=peer)


def recv(group, out, peer: int) -> DeviceOp:
    """Receive into ``out`` what rank ``peer`` sends.  Value: ``out``."""
    return Collective(group, "recv", None, out, peer=peer)
