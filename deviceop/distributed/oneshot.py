"""The one-shot all-reduce kernels (allreduce.cu beside this file) and their NumPy
references.

Eight declarations: four forms (``out = sum``, ``out += sum``, ``out = residual +
sum``, and ``out = sum`` in place) times two dtypes (float32, bfloat16).  Every one
takes the peers' receive buffers as a table of addresses (``peers``, uint64
``[W]``), this rank's epochs and error word (``state``, uint32) and the scalars
``rank``, ``slot_lines`` (a slot's capacity in 16-byte lines) and
``timeout_ns``.  The block is 64 threads, one 16-byte line each (NCCL's "LL"
format: 8 payload bytes and the epoch twice): 512 payload bytes per block, so the
output's tile ``B`` is 512 bytes of its dtype.

The references run the kernel's protocol itself on host memory (the reference
device's "peer buffers" are NumPy arrays of the other thread-ranks, reached by
address): the same lines, epochs, parities, bounded wait, error word and
rank-ordered fp32 sums, so CPU tests exercise what the GPU does, bit for bit.
They live here, not in the kernel library, because ``peer.py`` builds on them and
deviceop's modules never import ``deviceop.kernels``.
"""
from __future__ import annotations

import ctypes
import time
import weakref
from pathlib import Path

import numpy as np

from ..errors import ShapeError
from ..kernel import In, InOut, Kernel, Out, Scalar

SOURCE = Path(__file__).resolve().parent / "allreduce.cu"
LINES = 64                 # threads (lines) per block: the kernel's oneshot::LINES
BLOCK_BYTES = LINES * 8    # payload bytes per block
MAX_WORLD = 8              # the kernel unrolls its loops over W; NVLink domains of one node
CTYPES = {"float32": "float", "bfloat16": "__nv_bfloat16"}
MODES = ("sum", "accumulate", "residual", "in_place")


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ShapeError(message)


def _check(g, out, *args):
    *tensors, peers, state, rank, slot_lines, timeout_ns = args
    t = out.tensor
    nbytes = t.size * t.dtype.itemsize
    _need(g["T"] == CTYPES[t.dtype.name], f"one-shot all_reduce: generic T={g['T']} but the tensors are "
                                          f"{t.dtype.name} ({CTYPES[t.dtype.name]})")
    _need(g["B"] * t.dtype.itemsize == BLOCK_BYTES,
          f"one-shot all_reduce: B={g['B']} must be {BLOCK_BYTES // t.dtype.itemsize} ({BLOCK_BYTES} bytes)")
    _need(1 <= g["W"] <= MAX_WORLD, f"one-shot all_reduce: {g['W']} ranks, at most {MAX_WORLD}")
    _need(0 <= rank < g["W"], f"one-shot all_reduce: rank {rank} is not in 0..{g['W'] - 1}")
    _need(nbytes <= slot_lines * 8, f"one-shot all_reduce of {nbytes} bytes: the buffers hold {slot_lines * 8}")
    _need(state.size >= 1 + nbytes // BLOCK_BYTES, "one-shot all_reduce: the state tensor is too small")
    for a in (t, *tensors):
        _need(a.data_ptr % 16 == 0, "one-shot all_reduce: tensors must start 16-byte aligned")
    check_buffers(peers, state, rank, slot_lines, g["W"], "one-shot all_reduce")
    claim_lines(state, 1, nbytes // BLOCK_BYTES, 0, LINES, "one-shot all_reduce")


# state's allocation -> a weak reference to the PeerBuffers it belongs to (check_buffers)
_owners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def own_state(state, bufs) -> None:
    """Record that ``state`` is ``bufs``'s (PeerBuffers): kernels given it check their scalars against them."""
    _owners[state._alloc] = weakref.ref(bufs)


def check_buffers(peers, state, rank: int, slot_lines: int, world: int, who: str) -> None:
    """Refuse a launch whose peer table, rank, slot size or world size are not those of the
    PeerBuffers ``state`` belongs to, or whose buffers or group are closed: the kernel
    trusts them to address the peers' memory (a larger ``slot_lines`` stores past the end
    of every peer's buffer; closed buffers are freed).  A state of no PeerBuffers is not
    checked here."""
    ref = _owners.get(state._alloc)
    bufs = ref() if ref is not None else None
    if bufs is None:
        return
    bufs._check_usable(who)
    group = bufs.group
    _need(peers.data_ptr == bufs.peers.data_ptr and peers.size == bufs.peers.size,
          f"{who}: peers is not the peer table of the PeerBuffers state belongs to; pass bufs.peers with bufs.state")
    _need(slot_lines == bufs.slot_lines, f"{who}: slot_lines={slot_lines} but the buffers' slots hold "
                                         f"{bufs.slot_lines} lines; pass bufs.slot_lines")
    _need(rank == group.rank and world == group.world_size,
          f"{who}: rank {rank} of {world} but the buffers are rank {group.rank}'s of {group.world_size}; pass "
          "group.rank and the group's world size")


# state's allocation -> the layouts its epoch counters serve: (first counter's word, counters,
# first line, lines a counter)
_layouts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def claim_lines(state, epoch0: int, groups: int, line0: int, group_lines: int, who: str) -> None:
    """Refuse a call that would use ``state``'s epoch counters [epoch0, epoch0 + groups) for
    other lines than earlier calls did (the lines from ``line0``, ``group_lines`` a counter).
    An epoch tells a line's writes apart only while its counter always serves the same
    lines: a call that moved them (another grid or row tile on the same epochs, a second
    channel over the same lines, the one-shot all-reduce on a fused kernel's buffers) could
    take a line that an earlier call of another counter wrote with the epoch it waits for,
    and sum stale data without any error."""
    c0 = state.data_ptr // 4 + epoch0  # the counter's word: views of one state agree
    new = (c0, groups, line0, group_lines)
    held = _layouts.setdefault(state._alloc, set())
    if new in held:
        return
    for c, n, line, per in held:
        overlap = (c < c0 + groups and c0 < c + n) or (line < line0 + groups * group_lines and line0 < line + n * per)
        if overlap and (per != group_lines or line - c * per != line0 - c0 * group_lines):
            raise ShapeError(
                f"{who}: epoch counters [{epoch0}, {epoch0 + groups}) for lines from {line0}, {group_lines} a counter, "
                f"but earlier calls on these buffers use counters from {epoch0 + c - c0} for lines from {line}, {per} a "
                "counter: a counter must always stand for the same lines (else a call can read a line another "
                "counter wrote with the epoch it waits for). Give each layout (grid, row tile) its own epochs and "
                "lines (epoch0=, line0=), or its own PeerBuffers")
    held.add(new)


# -- the NumPy reference: the kernel's protocol on host memory -------------------------

def _slots(address: int, world: int, slot_lines: int) -> np.ndarray:
    """A receive buffer as ``[parity, source rank, line, word]`` uint32 (word 1 and 3: the epoch)."""
    n = 2 * world * slot_lines * 4
    return np.ctypeslib.as_array((ctypes.c_uint32 * n).from_address(int(address))).reshape(2, world, slot_lines, 4)


def exchange(out, x, base, peers, state, rank, slot_lines, timeout_ns, *, group_lines: int = LINES,
             line0: int = 0, epoch0: int = 1) -> None:
    """The one-shot exchange on host memory: ``out = base + the sum over the ranks of x``
    (``base`` None: no base), every rank's ``x`` pushed as 8-byte payloads of 16-byte
    lines into the peers' slots.  Lines go in groups of ``group_lines`` (a kernel block's,
    a CTA's), group j's epoch at ``state[epoch0 + j]``, the lines from ``line0`` of each
    slot: the one-shot all-reduce's blocks (allreduce.cu) and a fused epilogue's CTAs
    (kernels/llama_tp.cu's matvec_allreduce) alike."""
    world, rank, slot_lines = peers.shape[0], int(rank), int(slot_lines)
    if state[0]:  # a call timed out before: NaN until the buffers are rebuilt
        out[...] = np.nan
        return
    mine = np.ascontiguousarray(x).reshape(-1).view(np.uint32).reshape(-1, 2).copy()
    n_lines = mine.shape[0]
    groups = n_lines // group_lines
    epochs = (state[epoch0:epoch0 + groups].astype(np.uint64) + 1) & 0xFFFFFFFF
    epochs[epochs == 0] = 2  # as the kernel: never 0, and the parity keeps alternating
    state[epoch0:epoch0 + groups] = epochs.astype(np.uint32)
    line_epoch = np.repeat(epochs.astype(np.uint32), group_lines)
    parity, line = (line_epoch & 1).astype(np.intp), line0 + np.arange(n_lines)
    for k in range(1, world):  # push: this rank's lines into slot [parity][rank] of every peer
        slot = _slots(peers[(rank + k) % world], world, slot_lines)
        slot[parity, rank, line, 0], slot[parity, rank, line, 2] = mine[:, 0], mine[:, 1]
        slot[parity, rank, line, 1] = slot[parity, rank, line, 3] = line_epoch  # data first, then the epochs
    own = _slots(peers[rank], world, slot_lines)
    deadline = time.monotonic() + int(timeout_ns) / 1e9
    total = None
    for src in range(world):  # rank order, fp32: what every rank computes, bit for bit
        words = mine
        if src != rank:
            while True:
                got = own[parity, src, line]  # a copy: the lines as they were at this instant
                if (got[:, 1] == line_epoch).all() and (got[:, 3] == line_epoch).all():
                    break
                if state[0] or time.monotonic() > deadline:
                    state[0] |= 1
                    out[...] = np.nan
                    return
                time.sleep(20e-6)
            words = np.ascontiguousarray(got[:, [0, 2]])
        values = words.reshape(-1).view(x.dtype).astype(np.float32)
        total = values if total is None else total + values
    if base is not None:
        total = base.reshape(-1).astype(np.float32) + total
    out[...] = total.astype(out.dtype).reshape(out.shape)


def _reference(mode: str):
    if mode == "in_place":
        return lambda g, out, peers, state, *s: exchange(out, out, None, peers, state, *s)
    if mode == "residual":
        return lambda g, out, x, res, peers, state, *s: exchange(out, x, res, peers, state, *s)
    if mode == "accumulate":
        return lambda g, out, x, peers, state, *s: exchange(out, x, out.copy(), peers, state, *s)
    return lambda g, out, x, peers, state, *s: exchange(out, x, None, peers, state, *s)


def _declare(mode: str, dtype: str) -> Kernel:
    tensors = {"sum": ["x"], "accumulate": ["x"], "residual": ["x", "residual"], "in_place": []}[mode]
    entry = {"in_place": "allreduce_oneshot_inplace", "residual": "allreduce_oneshot_residual"}.get(
        mode, "allreduce_oneshot")
    generics = ["T", "B", "W"] + (["ACC"] if entry == "allreduce_oneshot" else [])
    params = [Out("out", dtype, shape=("N",), tile=("B",)), *[In(n, dtype, shape=("N",)) for n in tensors],
              In("peers", "uint64", shape=("W",)), InOut("state", "uint32", shape=(-1,)),  # epochs, error word: written
              Scalar("rank", "int32"), Scalar("slot_lines", "uint32"), Scalar("timeout_ns", "uint64")]
    return Kernel(f"all_reduce_one_shot_{mode}_{dtype}", SOURCE, params, generics=generics, entry=entry,
                  block=LINES, reference=_reference(mode), validate=_check)


# KERNELS[(mode, dtype name)]: "accumulate" is allreduce_oneshot<..., ACC=true>
KERNELS = {(m, d): _declare(m, d) for m in MODES for d in CTYPES}
