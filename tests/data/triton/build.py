"""Rebuild the Triton cache entry beside this file (scale_shift.json + scale_shift.cubin),
which tests/test_prebuilt.py declares with Kernel.from_triton where Triton is not installed.
It was made with Triton 3.6.0, compiled for sm_90 without a GPU:

    python tests/data/triton/build.py        # needs triton; writes next to this file
"""
import os
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ["TRITON_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="triton-cache-")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@triton.jit
def scale_shift(x_ptr, y_ptr, n, a, b, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = i < n
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=keep) * a + b, mask=keep)


signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "a": "fp32", "b": "fp32", "BLOCK": "constexpr"}
triton.compile(ASTSource(scale_shift, signature, constexprs={"BLOCK": 256}), target=GPUTarget("cuda", 90, 32),
               options={"num_warps": 4})
for suffix in (".json", ".cubin"):
    (found,) = Path(cache).rglob(f"scale_shift{suffix}")
    shutil.copy(found, HERE / found.name)
shutil.rmtree(cache)
