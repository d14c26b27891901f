"""Rebuild the Triton cache entry beside this file (scale_shift.json + scale_shift.cubin),
which tests/test_prebuilt.py declares with Kernel.from_triton where Triton is not installed.
It was made with Triton 3.6.0, compiled for sm_90 without a GPU:

    python tests/data/triton/build.py        # needs triton; writes next to this file
"""
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ["TRITON_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="triton-cache-")

sys.path.insert(0, str(HERE.parent.parent))  # tests/: the kernel's one source
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import triton  # noqa: E402
from triton_source import SIGNATURE, scale_shift  # noqa: E402

triton.compile(ASTSource(scale_shift, SIGNATURE, constexprs={"BLOCK": 256}), target=GPUTarget("cuda", 90, 32),
               options={"num_warps": 4})
for suffix in (".json", ".cubin"):
    (found,) = Path(cache).rglob(f"scale_shift{suffix}")
    shutil.copy(found, HERE / found.name)
shutil.rmtree(cache)
