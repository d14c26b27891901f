"""Every kernel the token model ships compiles for the H100 (sm_90) with NVRTC,
in the configurations the examples launch: CPU CI catches a CUDA error before
the GPU run does.  (The conv kernels have their own test in test_conv.py.)"""
import sys
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "examples")]
from deviceop import kernels  # noqa: E402
from token_model import Config  # noqa: E402

CFG = Config()
SHIPPED = [
    (kernels.rms_norm, CFG.rms_generics()),
    (kernels.matvec, CFG.mv_generics()),
    (kernels.add, [CFG.block]),
    (kernels.matvec_batched, [CFG.bn, CFG.bk, CFG.d, kernels.batch_tile(8)]),
    (kernels.affine, [CFG.block]),
    (kernels.rms_matvec, CFG.fused_generics()),
    (kernels.matvec_add, CFG.fused_generics()),
    (kernels.rms_matvec_bf16, CFG.fused_generics(bf16=True)),
    (kernels.matvec_add_bf16, CFG.fused_generics(bf16=True)),
    (kernels.load_row, [CFG.block]),
    (kernels.store_row, [CFG.block]),
]


@pytest.mark.parametrize("kernel,generics", SHIPPED, ids=[k.name for k, _ in SHIPPED])
def test_shipped_kernel_compiles_to_an_sm90_cubin(kernel, generics):
    program, expr = kernel.compile(kernel.check_generics(generics), arch="sm_90")
    assert program.arch == "sm_90" and program.cubin[:4] == b"\x7fELF"
    assert program.symbol(expr).startswith("_Z")  # a template instance, found by its mangled name
