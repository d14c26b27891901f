#!/usr/bin/env python3
"""A kernel that writes 4 TiB past its buffer, launched through deviceop: the planted
fault of tests/test_kernel_fault.py (run in a subprocess: it poisons the CUDA
context) and the control of ``scripts/gpu-check --sanitize`` (memcheck must
report it, or its zero counts would mean nothing).

    python scripts/planted_fault.py eager|graph|model

Prints the KernelFaultError deviceop raised as one JSON line.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import deviceop as dop  # noqa: E402
from deviceop import GraphModel  # noqa: E402
from deviceop.kernel import In, Kernel, Out, Scalar  # noqa: E402
from deviceop.kernels import add  # noqa: E402

SOURCE = 'extern "C" __global__ void poke(float* out, const float* x, long long at) { out[at] = x[0]; }'
poke = Kernel("poke", SOURCE, [Out("out", "float32"), In("x", "float32"), Scalar("at", "int64")], block=32)
FAR = 1 << 40  # elements past the buffer: never mapped


def main(how: str) -> None:
    stream = dop.Device().new_stream()
    out, x, y = (dop.empty(128, stream=stream) for _ in range(3))
    try:
        if how == "eager":
            dop.zip_(add(y.partition([128]), x, x).generics([128]), poke(out.partition([128]), x, FAR)).sync_on(stream)
        elif how == "graph":
            poke(out.partition([128]), x, FAR).graph_on(stream).launch().sync_on(stream)
        else:
            GraphModel(poke(out.partition([128]), x, FAR).graph_on(stream), x, out).forward(y)
    except dop.KernelFaultError as exc:
        print(json.dumps({"type": type(exc).__name__, "kernels": list(exc.kernels), "code": exc.code_name,
                          "message": str(exc)}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "eager")
