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

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from deviceop.runtime import refcache

BLOCK = 1 << 16  # float64 elements a promoted block holds (512 KiB: an L2's worth)
_local = threading.local()  # one buffer a thread: references may run on several
SPLIT = 4  # blocks from which a kept copy's product is shared with the helper thread
_pool, _pool_lock = None, threading.Lock()


def matvec64(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``w @ x`` in float64 for a matrix ``w`` [N, K] of any float dtype (bf16 ...) and ``x`` [K]."""
    x = np.asarray(x, np.float64)
    n, k = w.shape
    size = max(BLOCK, k)
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < size:
        buf = _local.buf = np.empty(size)
    out = np.empty(n)
    rows = size // k
    kept = refcache.float64_of(w)
    if kept is not None:  # the same block products on the same values, without the promotion
        starts = range(0, n, rows)
        if len(starts) < SPLIT or _helper() is None:
            _blocks(kept, x, out, rows, starts)
        else:  # half the blocks on a helper thread: reading the float64 copy is memory bound
            half = (len(starts) + 1) // 2
            other = _helper().submit(_blocks, kept, x, out, rows, starts[half:])
            _blocks(kept, x, out, rows, starts[:half])
            other.result()
        return out
    for r in range(0, n, rows):
        block = w[r:r + rows]
        promoted = buf[:block.size].reshape(block.shape)
        np.copyto(promoted, block)
        np.matmul(promoted, x, out=out[r:r + rows])
    return out


def _blocks(w64, x, out, rows: int, starts) -> None:
    for r in starts:  # np.dot (BLAS gemv, as np.matmul) lets go of the GIL, so two threads overlap
        np.dot(w64[r:r + rows], x, out=out[r:r + rows])


def _helper():
    """The one helper thread of matvec64's kept-copy products (None on a one-core machine)."""
    global _pool
    if _pool is None and (os.cpu_count() or 1) > 1:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(1, thread_name_prefix="deviceop-matvec64")
    return _pool
