"""The Triton kernel the Triton tests compile (tests/data/triton/build.py built the committed
cache entry from the same source).  Imported only where Triton is installed."""
import triton
import triton.language as tl


@triton.jit
def scale_shift(x_ptr, y_ptr, n, a, b, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = i < n
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=keep) * a + b, mask=keep)


SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "a": "fp32", "b": "fp32", "BLOCK": "constexpr"}


def compile_scale_shift(arch: int, block: int = 256, num_warps: int = 4):
    """triton.compile for sm_<arch>: needs no GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    return triton.compile(ASTSource(scale_shift, SIGNATURE, constexprs={"BLOCK": block}),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
