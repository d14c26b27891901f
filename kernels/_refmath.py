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
work stays on one thread.
"""
from __future__ import annotations

import functools
import itertools
import os
import queue
import threading

import numpy as np

from deviceop.runtime import refcache

BLOCK = 1 << 16  # float64 elements a promoted block holds (512 KiB: an L2's worth)
_local = threading.local()  # one buffer a thread: references may run on several
CHUNKS, MAX_CHUNK = 8, 16  # a kept copy's product: about 8 chunks for two threads to take, of at most 16 blocks
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
        chunks = _chunks(n, rows)
        helper = _helper() if len(chunks) > 1 else None
        if helper is None:
            _products(kept, x, out, rows, chunks, itertools.count(), len(chunks))
        else:
            helper.share(kept, x, out, rows, chunks)
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


@functools.lru_cache(maxsize=256)
def _chunks(n: int, rows: int) -> tuple:
    """The blocks of a kept copy's product, grouped: (first block, blocks) a chunk, about
    CHUNKS chunks (a thread takes one at a time), the last, partial block alone."""
    full = n // rows
    size = max(1, min(MAX_CHUNK, -(-full // CHUNKS)))
    chunks = [(b, min(size, full - b)) for b in range(0, full, size)]
    if full * rows < n:
        chunks.append((full, 0))
    return tuple(chunks)


def _products(w64, x, out, rows: int, chunks, taken, left) -> None:
    """Take chunks from the counter ``taken`` until ``left`` are taken, and multiply each one's
    blocks: np.matmul of a stack of blocks [count, rows, K] calls BLAS's gemv on each block
    exactly as np.dot of the block does, in one call that lets go of the GIL throughout."""
    k = w64.shape[1]
    for i in taken:
        if i >= left:
            return
        first, count = chunks[i]
        r = first * rows
        if count:
            e = r + count * rows
            np.matmul(w64[r:e].reshape(count, rows, k), x, out=out[r:e].reshape(count, rows))
        else:  # the last block, fewer rows
            np.dot(w64[r:], x, out=out[r:])


class _Helper:
    """One helper thread that shares a kept copy's product with the caller: both take the
    next chunk of blocks from one counter until none is left (a block is the same product
    whichever thread does it), so when the machine is busy and the helper starts late, the
    caller does the blocks instead of waiting for a fixed half.  A product costs one put on
    a queue; the caller waits only for a chunk the helper took and has not finished."""

    def __init__(self):
        self.jobs = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="deviceop-matvec64", daemon=True).start()

    def share(self, w64, x, out, rows: int, chunks) -> None:
        job = [itertools.count(), len(chunks), threading.Lock(), w64, x, out, rows, chunks, None]
        self.jobs.put(job)
        _products(w64, x, out, rows, chunks, job[0], len(chunks))
        with job[2]:  # the helper takes and finishes a chunk under this lock: none is in flight now
            job[1] = 0  # later takes find nothing left
        if job[8] is not None:  # a chunk the helper took failed: it is not in ``out``
            raise job[8]

    def _serve(self) -> None:
        while True:
            job = self.jobs.get()
            taken, lock = job[0], job[2]
            while True:
                with lock:
                    if job[1] == 0:
                        break
                    i = next(taken)
                    if i >= job[1]:
                        break
                    try:
                        _products(*job[3:8], iter((i,)), job[1])
                    except BaseException as exc:  # the caller raises it
                        job[8] = exc
            del job  # hold no activations between products


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
