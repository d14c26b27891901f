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
reference.py) takes 1.4 s there, at four times the weights' memory; the
reference device cannot keep such copies, as it does not see every write to a
weight (a DLPack consumer may write it).  Two threads casting blocks ran no
faster than one here (the casts did not overlap), so the work stays on one thread.
"""
from __future__ import annotations

import threading

import numpy as np

BLOCK = 1 << 16  # float64 elements a promoted block holds (512 KiB: an L2's worth)
_local = threading.local()  # one buffer a thread: references may run on several


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
    for r in range(0, n, rows):
        block = w[r:r + rows]
        promoted = buf[:block.size].reshape(block.shape)
        np.copyto(promoted, block)
        np.matmul(promoted, x, out=out[r:r + rows])
    return out
