"""The kernels' references multiply bf16 weights in float64 a block of rows at a time
(kernels/_refmath.py): the same product as promoting the whole matrix, whatever the
shape against the block (rows that do not fill the last block, a row wider than a block)."""
import ml_dtypes
import numpy as np
import pytest

from deviceop.kernels import _refmath


@pytest.mark.parametrize("shape", [(1, 8), (300, 576), (2, _refmath.BLOCK + 64), (1000, 96)])
def test_blocked_float64_matvec_is_the_whole_promoted_product(rng, shape):
    w = (rng.standard_normal(shape) * 0.05).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal(shape[1]).astype(np.float32)
    got = _refmath.matvec64(w, x)
    want = w.astype(np.float64) @ x.astype(np.float64)
    assert got.dtype == np.float64 and got.shape == (shape[0],)
    assert np.allclose(got, want, rtol=1e-13, atol=1e-13 * np.abs(want).max())
