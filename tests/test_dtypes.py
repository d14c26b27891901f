"""dtypes tie a NumPy dtype to a CUDA C++ type and to how a scalar argument is packed."""
import numpy as np
import pytest

import deviceop as dop


def test_lookup_by_name_alias_numpy_and_dtype_object():
    assert dop.dtype("float32") is dop.float32
    assert dop.dtype("bf16") is dop.bfloat16
    assert dop.dtype(np.float16) is dop.float16
    assert dop.dtype(np.dtype("int32")) is dop.int32
    assert dop.dtype(dop.int64) is dop.int64


def test_cuda_spellings():
    assert (dop.float32.ctype, dop.float16.ctype, dop.bfloat16.ctype, dop.int32.ctype) == \
        ("float", "__half", "__nv_bfloat16", "int")
    assert dop.bfloat16.itemsize == 2


@pytest.mark.parametrize("spec", ["float8", "complex64", object])
def test_unknown_dtype_is_named(spec):
    with pytest.raises(dop.DTypeError, match="known: float64, float32"):
        dop.dtype(spec)


def test_scalar_coercion_never_truncates_or_overflows():
    assert dop.int32.coerce(7) == 7
    assert dop.float32.coerce(3) == 3.0
    with pytest.raises(dop.DTypeError, match="never truncates"):
        dop.int32.coerce(1.5)
    with pytest.raises(dop.DTypeError, match="does not fit in int32"):
        dop.int32.coerce(2**31)
    with pytest.raises(dop.DTypeError, match="got a bool"):
        dop.float32.coerce(True)
    with pytest.raises(dop.DTypeError, match="expected a number"):
        dop.float32.coerce("1.0")
    # a bool scalar was bool(value): 2 and "no" became True on the GPU while the reference computed with them
    assert dop.bool_.coerce(np.bool_(True)) is True and dop.bool_.coerce(0) is False
    for wrong in (2, -1, "no", 0.5, None):
        with pytest.raises(dop.DTypeError, match="expected True or False for a bool scalar"):
            dop.bool_.coerce(wrong)


def test_bfloat16_scalar_is_packed_as_its_bits():
    # 1.0 in bfloat16 is 0x3F80: the top half of float32's 0x3F800000
    assert dop.bfloat16.scalar_bytes(1.0) == (0x3F80).to_bytes(2, "little")
