"""Peer buffers: memory every rank of a one-machine group stores into directly
(NVLink or PCIe peer access, mapped with CUDA IPC), and the one-shot all-reduce
for small messages that uses them.

Why not NCCL's own path: measured on 2 H200s (NCCL 2.28.9, bench/allreduce.py,
bench/results/allreduce.json), a 4-16 KB bfloat16 all-reduce in a CUDA graph costs
5.9-6.6 us with ncclAllReduce and 3.9-4.3 us on symmetric windows (NCCL's
symmetric kernels), against the 3 us target; this kernel takes 2.2-2.7 us (4
H200s: NCCL 9.1-10.2, symmetric 4.3-4.7, this 3.4-4.0).  NCCL 2.28's device API
(``nccl_device.h``), which would let NCCL map the memory while the kernel stays
ours, does not compile under NVRTC: its headers declare ``__host__`` functions,
which NVRTC refuses, and pull in libc and doca headers; and 2.28 has no host call
that returns a window's peer addresses (nccl4py's ``get_lsa_device_pointer``
needs a later NCCL).  So the mapping is CUDA IPC's (runtime/ipc.py) and the
protocol ours (allreduce.cu): one kernel launch, an ordinary node of any graph,
that stores its input into every peer's buffer and reduces what the peers
stored into its own.

    bufs = dist.PeerBuffers(group)                 # collective: every rank, once
    op = bufs.all_reduce(x)                        # lazy, like any kernel launch
    op = bufs.all_reduce(partial, out=hidden, residual=hidden_in)

Lifetime: ``close()`` (every rank, collective) unmaps and frees the buffers;
a graph that captured one of its all-reduces must not be replayed after that.
"""
from __future__ import annotations

import math
import socket
import weakref

import numpy as np

from .. import api
from ..errors import AliasingError, DistributedError, DTypeError, ShapeError
from ..graph.capture import ReplayCheck
from ..interop import from_numpy, zeros
from ..op import DeviceOp, value, warn_if_unexecuted
from ..tensor import SharedTensor, Tensor
from .args import check_device, plain_int, tensor_arg, written_arg
from .group import Group, check_timeout
from .oneshot import BLOCK_BYTES, CTYPES, KERNELS, MAX_WORLD, own_state

DEFAULT_MAX_BYTES = 64 << 10
TIMED_OUT, CLOSED = 1, 2  # the error word's bits: a kernel's wait timed out; close() was called
_attached: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> its open PeerBuffers


def peer_buffers(group) -> "PeerBuffers | None":
    """The group's open PeerBuffers (the last made), which dist.all_reduce's "auto" and
    "oneshot" algorithms use; None when it has none."""
    return _attached.get(group)


def unreachable(group) -> str | None:
    """Why dist.PeerBuffers cannot serve ``group`` (more than MAX_WORLD ranks, or ranks on
    several machines), or None.  Collective (one host exchange): every rank calls it, and
    every rank gets the same answer, so that "auto" picks the same all-reduce everywhere."""
    if group.world_size > MAX_WORLD:
        return f"{group.world_size} ranks, more than the {MAX_WORLD} it serves"
    hosts = sorted(set(group._exchange(socket.gethostname(), "dist.PeerBuffers' reach")))
    return f"the ranks run on several machines ({', '.join(hosts)})" if len(hosts) > 1 else None


class PeerBuffers:
    """Receive buffers mapped on every rank of ``group`` and the one-shot all-reduce over
    them (module docstring).  Building one is collective: every rank, same arguments.

    ``max_bytes``: the largest all-reduce it takes (a multiple of 512; each rank holds
    ``4 * world_size * max_bytes`` bytes of receive slots).  ``timeout``: seconds a
    kernel waits for a peer's data before it gives up, writes NaN and sets the error
    that ``check()`` raises (default: the group's timeout).

    ``epochs``: how many epoch counters ``state`` holds past its error word (default one
    a 512-byte block of ``max_bytes``, what ``all_reduce`` needs); a kernel that fuses the
    exchange into its own epilogue (lines.cuh) needs one a CTA.  ``attach=False`` keeps
    the buffers private to such kernels: dist.all_reduce's "auto" does not use them (a
    buffer's lines must serve one kind of caller, or the epochs would disagree)."""

    def __init__(self, group, max_bytes: int = DEFAULT_MAX_BYTES, timeout: float | None = None, *,
                 epochs: int | None = None, attach: bool = True):
        if not isinstance(group, Group):
            raise DistributedError(f"PeerBuffers takes the group of dist.init() or dist.run_reference, got a "
                                   f"{type(group).__name__}")
        group._check_open("dist.PeerBuffers")
        ws = group.world_size
        if ws > MAX_WORLD:
            raise DistributedError(f"one-shot all_reduce over {ws} ranks: it serves at most {MAX_WORLD} (one "
                                   "machine's NVLink domain); use algorithm='nccl'")
        given = max_bytes
        max_bytes = plain_int(max_bytes)  # NumPy's integers too (a size computed with NumPy), never a bool
        if not (max_bytes is not None and max_bytes > 0 and max_bytes % BLOCK_BYTES == 0):
            raise ShapeError(f"PeerBuffers(max_bytes={given!r}): give a positive multiple of {BLOCK_BYTES}")
        given = max_bytes // BLOCK_BYTES if epochs is None else epochs
        epochs = plain_int(given)
        if epochs is None or epochs < max_bytes // BLOCK_BYTES:
            raise ShapeError(f"PeerBuffers(epochs={given!r}): give an int of at least {max_bytes // BLOCK_BYTES} "
                             "(one a 512-byte block of max_bytes)")
        # (its kernels wait for peers, not Python's locks: their limit is checked below)
        timeout = group.timeout if timeout is None else check_timeout(timeout, "PeerBuffers", longest=math.inf)
        if timeout * 1e9 >= 2 ** 64:  # the kernels count it in nanoseconds, in 64 bits
            raise DistributedError(f"PeerBuffers: a timeout of {timeout:g} s (the group's, unless timeout= is given) "
                                   f"is past the {2 ** 64 / 1e9:.3g} s the kernels can count; give a shorter one")
        self.group, self.max_bytes = group, max_bytes
        self.slot_lines = max_bytes // 8
        self.timeout_ns = int(timeout * 1e9)
        self._nbytes = 2 * ws * self.slot_lines * 16  # [parity][source rank][line], 16-byte lines
        self._closed = False
        self.replay_check = _BuffersReplayCheck(self)  # what graphs holding its all-reduces check at each replay
        stream = group.stream
        self._memory = group.device.peer_memory(self._nbytes)  # CUDA IPC (runtime/ipc.py), or host memory
        try:
            ident = self._memory.export()
            # the arguments travel with the address: a peer that sized its slots otherwise would be
            # written past their end by this rank's stores (and this rank's by its)
            args = {"max_bytes": max_bytes, "epochs": epochs, "attach": bool(attach)}
            found = _agreed(group._exchange((args, socket.gethostname(), ident), "dist.PeerBuffers"), args)
            hosts = {h for h, _ in found}
            if len(hosts) > 1:
                raise DistributedError(f"one-shot all_reduce needs every rank on one machine (peer memory); the "
                                       f"ranks run on {sorted(hosts)}: use algorithm='nccl' across machines")
            addresses = self._memory.open([ident if r == group.rank else h for r, (_, h) in enumerate(found)],
                                          group.rank)
            self.peers = from_numpy(np.array(addresses, dtype=np.uint64), stream=stream)
            self.state = zeros(1 + epochs, dtype="uint32", stream=stream)
            own_state(self.state, self)  # kernels given this state check their scalars against these buffers
            stream.synchronize()  # zeroed everywhere before any rank's first store
            group.barrier()
            if attach:
                _attached[group] = self
            group._peer_bufs.add(self)
        except BaseException:
            self._memory.release(None)  # a peer may have mapped it: leak it
            raise

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.max_bytes} bytes"
        return f"<PeerBuffers rank {self.group.rank}/{self.group.world_size}, {state}>"

    # -- the all-reduce -------------------------------------------------------------------
    def all_reduce(self, x, out=None, residual=None):
        """The sum of every rank's ``x`` (float32 or bfloat16, contiguous, a multiple of
        512 bytes, at most ``max_bytes``), as one kernel launch op:

        * ``out=None``: into ``x`` itself (``x`` must be writable);
        * ``out`` given: into ``out``; with ``residual`` given, ``out = residual + sum``
          (``residual`` may be ``out``: ``hidden += sum of the ranks' partials``).

        The sum is taken in fp32 in rank order 0, 1, ..., then the residual added, then
        rounded once: every rank computes bit-identical results (and for bfloat16 a
        more exact one than NCCL's, which rounds after each step).  Every rank must issue
        the same all-reduces in the same order; the first of each dtype and size is checked
        across ranks through one host exchange."""
        self._check_usable("PeerBuffers.all_reduce")
        xt = tensor_arg(x, "x")
        n, dt = xt.size, xt.dtype
        if dt.name not in CTYPES:
            raise DTypeError(f"one-shot all_reduce of {dt.name}: it sums float32 and bfloat16; "
                             "use algorithm='nccl' for other dtypes")
        nbytes = n * dt.itemsize
        if nbytes % BLOCK_BYTES or nbytes > self.max_bytes or n == 0:
            raise ShapeError(f"one-shot all_reduce of {nbytes} bytes ({n} x {dt.name}): it takes a multiple of "
                             f"{BLOCK_BYTES} bytes up to max_bytes={self.max_bytes}; use algorithm='nccl' (or larger "
                             "PeerBuffers(max_bytes=...))")
        if out is None and residual is not None:
            raise ShapeError("one-shot all_reduce: a residual needs an out tensor (out=residual adds in place)")
        if out is not None and residual is None and _same_memory(tensor_arg(out, "the all_reduce's out"), xt):
            out = None  # out is x's own memory (x itself, another view of it): in place, as NCCL's path takes it
        if out is None:
            mode, target, inputs = "in_place", written_arg(x, "the in-place all_reduce's x"), ()
        else:
            target = written_arg(out, "the all_reduce's out")
            ins = [xt] if residual is None else [xt, tensor_arg(residual, "residual")]
            for t in (*ins, target):  # the classes dist.all_reduce's NCCL path raises for the same mistakes
                if t.dtype is not dt or t.size != n:
                    kind = DTypeError if t.dtype is not dt else ShapeError
                    raise kind(f"one-shot all_reduce: x is {n} x {dt.name} but out and residual must match it, "
                               f"got {t.size} x {t.dtype.name}")
            if target.overlaps(xt):
                raise AliasingError("one-shot all_reduce: out overlaps x; pass out=None to reduce in place")
            if residual is None:
                mode = "sum"
            elif ins[1].data_ptr == target.data_ptr:
                mode, ins = "accumulate", [xt]  # out = out + sum: hidden += the ranks' partials
            else:
                mode = "residual"
            inputs = tuple(t.view(n) for t in ins)
        for t in (target, *inputs, xt):
            check_device(t, self.group, "the one-shot all_reduce's tensor")
        for t in (target, *inputs):
            if not t.is_contiguous:
                raise ShapeError("one-shot all_reduce needs contiguous tensors; copy the view first (.contiguous())")
        self.group.agree(("one-shot all_reduce", dt.name, n, mode), f"one-shot all_reduce({n} x {dt.name})")
        block = BLOCK_BYTES // dt.itemsize
        generics = [CTYPES[dt.name], block, self.group.world_size]
        if mode in ("sum", "accumulate"):
            generics.append(mode == "accumulate")
        kernel = KERNELS[(mode, dt.name)]
        return _Guarded(kernel(target.view(n).partition([block]), *inputs, self.peers, self.state, self.group.rank,
                               self.slot_lines, self.timeout_ns).generics(generics), self)

    def _check_usable(self, what: str) -> None:
        """Refuse work on closed buffers (their memory is unmapped or freed) or a group that is
        no longer open (its peers may have freed theirs)."""
        if self._closed:
            raise DistributedError(f"{what} on closed buffers (rank {self.group.rank}'s PeerBuffers): their memory "
                                   "is freed; make new ones (dist.PeerBuffers(group)) and capture graphs again")
        self.group._check_open(what)

    def accepts(self, x) -> bool:
        """Would ``all_reduce(x)`` take ``x`` (dtype, size, layout, 16-byte alignment)?  What
        dist.all_reduce's "auto" asks (of ``out`` too); the same answer on every rank when they
        issue the same all-reduces on buffers laid out alike."""
        t = x.tensor if isinstance(x, SharedTensor) else x
        if self._closed or not isinstance(t, Tensor) or t.dtype.name not in CTYPES or not t.is_contiguous \
                or t.data_ptr % 16:
            return False
        nbytes = t.size * t.dtype.itemsize
        return 0 < nbytes <= self.max_bytes and nbytes % BLOCK_BYTES == 0

    def check(self, stream=None) -> None:
        """Raise DistributedError if an all-reduce on these buffers gave up waiting for a
        peer (it then wrote NaN, as every later one does).  Reads one word on ``stream``
        (default: the group's): a host sync.  ``group.synchronize()`` calls it."""
        if self._closed:
            return
        if int(self.state.numpy(stream=stream if stream is not None else self.group.stream)[0]) & TIMED_OUT:
            raise DistributedError(
                f"one-shot all_reduce on rank {self.group.rank}: a peer's data did not arrive within "
                f"{self.timeout_ns / 1e9:g} s (a rank failed, hung or issued different all-reduces); the outputs since "
                "are NaN. Find the rank that diverged; then close these PeerBuffers and make new ones")

    # -- life ---------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (collective: every rank calls it,
        after the device finished every all-reduce on them).  Idempotent.  On a group that
        is no longer open nothing is freed: a peer might still store into this memory."""
        if self._closed:
            return
        self._closed = True
        if _attached.get(self.group) is self:
            del _attached[self.group]
        try:
            self.group.device.synchronize()
            # the error word's CLOSED bit: a kernel launched on these buffers after this (a graph that
            # captured one, a repeated launch whose checks the launch cache skips) touches no peer
            # memory, which is freed, and writes NaN
            s = self.group.stream
            api.memcpy(self.state[0:1], from_numpy(np.array([CLOSED], np.uint32), stream=s)).sync_on(s)
            self.group.barrier()  # no rank's kernels touch any buffer any more
        except DistributedError:  # the group is closed or aborted: a peer might still store into ours
            self._memory.release(None)
            return
        self._memory.release(self.group.barrier)

    def __enter__(self) -> "PeerBuffers":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def _same_memory(a, b) -> bool:
    """``a`` and ``b`` are the same bytes (the same buffer, in any shape)."""
    return a.data_ptr == b.data_ptr and a.size * a.dtype.itemsize == b.size * b.dtype.itemsize and \
        a.dtype is b.dtype and a.is_contiguous and b.is_contiguous


def _agreed(found: list, args: dict) -> list:
    """The ranks' ``(host, ident)`` of a PeerBuffers exchange, once every rank is seen making
    them with the same arguments; else DistributedError on every rank."""
    differ = {k: [a[k] for a, _, _ in found] for k in args if any(a[k] != args[k] for a, _, _ in found)}
    if differ:
        raise DistributedError("PeerBuffers: ranks disagree on " + ", ".join(f"{k} (rank by rank: {v})" for k, v in
                                                                           differ.items())
                               + ": every rank must make them with the same arguments (a peer's slots sized "
                               "otherwise would be written past their end)")
    return [(h, ident) for _, h, ident in found]


class _BuffersReplayCheck(ReplayCheck):
    """Kept by every graph that captured one of the buffers' all-reduces: a replay after the
    buffers were closed (freed) or their group closed or aborted is refused."""

    __slots__ = ("bufs",)

    def __init__(self, bufs):
        self.bufs = bufs

    def check_replay(self) -> None:
        self.bufs._check_usable("a replay of a graph holding a one-shot all_reduce")


class _Guarded(DeviceOp):
    """A one-shot all-reduce launch that checks its buffers and group when it runs (it may be
    built before they close) and makes the graphs that capture it check them at each replay."""

    __slots__ = ("op", "bufs")
    graph_safe = True  # the launch's: a kernel node

    def __init__(self, op, bufs):
        super().__init__()
        self.op, self.bufs = value(op), bufs
        self._armed = True

    __del__ = warn_if_unexecuted

    def children(self):
        return (self.op,)

    def _wrapped(self):
        return "", self.op, ""

    def pdl(self, enabled: bool = True) -> "_Guarded":
        """The launch's ``pdl`` (kernel/launch.py): the one-shot kernel waits on griddepcontrol."""
        self.op.pdl(enabled)
        return self

    def _execute(self, ctx):
        bufs = self.bufs
        if bufs._closed or bufs.group._state != "open":  # the launch is described only to refuse it
            bufs._check_usable(self.op.describe())
        result = self.op._run(ctx)
        if ctx.capture is not None:
            ctx.capture.keep.append(self.bufs.replay_check)
        return result
