"""Float64 arithmetic for the kernels' NumPy references (what the reference device runs).

A reference that writes ``w.astype(np.float64) @ x`` promotes the whole bf16
matrix into a fresh array at every launch: for a decode step that is every
weight of the model, and the page faults of those fresh arrays cost more than
the products.  ``matvec64`` promotes a block of rows at a time into a buffer
that stays in cache and is reused, and computes the same float64 product (each
row's dot product as BLAS forms it; the blocks change only the order in which
rows are done).  SmolLM2-135M (134 M weights), a 16-token prompt and 12 greedy
tokens on a 2-core machine: 20 s promoting whole matrices, 2.9 s by blocks.
A float64 decoder that keeps float64 copies of the weights (examples/llama/
reference.py) takes 1.4 s there, at four times the weights' memory.  The
reference device keeps such copies only of memory whose every write it sees
(deviceop/runtime/refcache.py), and runs the very same block products on them,
so a result is bit for bit the one of promoting at each launch.  Two threads
casting blocks ran no faster than one here (the casts did not overlap), so the
promotion stays on one thread; a kept copy's product is memory bound, and the
caller and one helper thread share it, taking blocks from one counter.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading

import numpy as np

from deviceop.runtime import refcache

BLOCK = 1 << 16  # float64 elements a promoted block holds (512 KiB: an L2's worth)
_local = threading.local()  # one buffer a thread: references may run on several
SHARE = 4  # blocks from which a kept copy's product is shared with the helper thread
_pool, _pool_lock = None, threading.Lock()


def matvec64(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``w @ x`` in float64 for a matrix ``w`` [N, K] of any float dtype (bf16 ...) and ``x`` [K]."""
    x = np.asarray(x, np.float64)
    n, k = w.shape
    size = max(BLOCK, k)
    out = np.empty(n)
    rows = size // k
    kept = refcache.float64_of(w)
    if kept is not None:  # the same block products on the same values, without the promotion
        blocks = -(-n // rows)
        helper = _helper() if blocks >= SHARE else None
        if helper is None:
            _products(kept, x, out, rows, itertools.count(), blocks)
        else:
            helper.share(kept, x, out, rows, blocks)
        return out
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < size:
        buf = _local.buf = np.empty(size)
    for r in range(0, n, rows):
        block = w[r:r + rows]
        promoted = buf[:block.size].reshape(block.shape)
        np.copyto(promoted, block)
        np.matmul(promoted, x, out=out[r:r + rows])
    return out


def _products(w64, x, out, rows: int, taken, blocks: int) -> None:
    """Take block numbers from the counter ``taken`` until ``blocks`` are taken, and multiply
    each block (np.dot: BLAS's gemv, with the GIL let go; np.matmul keeps it)."""
    for i in taken:
        if i >= blocks:
            return
        r = i * rows
        np.dot(w64[r:r + rows], x, out=out[r:r + rows])


class _Helper:
    """One helper thread that shares a kept copy's product with the caller: both take the
    next block from one counter until none is left (a block is the same product whichever
    thread does it), so when the machine is busy and the helper starts late, the caller
    does the blocks instead of waiting for a fixed half.  A product costs one put on a
    queue; the caller waits only for a block the helper took and has not finished."""

    def __init__(self):
        self.jobs = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="deviceop-matvec64", daemon=True).start()

    def share(self, w64, x, out, rows: int, blocks: int) -> None:
        job = [itertools.count(), blocks, threading.Lock(), w64, x, out, rows, None]
        self.jobs.put(job)
        _products(w64, x, out, rows, job[0], blocks)
        with job[2]:  # the helper takes and finishes a block under this lock: none is in flight now
            job[1] = 0  # later takes find nothing left
        if job[7] is not None:  # a block the helper took failed: it is not in ``out``
            raise job[7]

    def _serve(self) -> None:
        while True:
            job = self.jobs.get()
            taken, lock, w64, x, out, rows = job[0], job[2], job[3], job[4], job[5], job[6]
            while True:
                with lock:
                    i = next(taken)
                    if i >= job[1]:
                        break
                    r = i * rows
                    try:
                        np.dot(w64[r:r + rows], x, out=out[r:r + rows])
                    except BaseException as exc:  # the caller raises it
                        job[7] = exc
            del job, w64, x, out  # hold no activations between products


def _helper():
    """The one helper thread of matvec64's kept-copy products (None on a one-core machine)."""
    global _pool
    if _pool is None and (os.cpu_count() or 1) > 1:
        with _pool_lock:
            if _pool is None:
                _pool = _Helper()
    return _pool


def _forget_helper() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # a forked child has no helper thread: it starts its own


os.register_at_fork(after_in_child=_forget_helper)
