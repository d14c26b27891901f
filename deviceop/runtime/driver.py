"""The CUDA driver, reached through ``cuda.bindings.driver``.

Two jobs: find out once whether this process has a usable GPU (the answer
decides between the CUDA device and the reference device), and turn every
failed driver call into a :class:`~deviceop.errors.CudaError` that names the
call and the CUDA error.
"""
from __future__ import annotations

import os
import threading

from cuda.bindings import driver as cu

from ..errors import KERNEL_FAULT_ADVICE, CudaError, KernelFaultError, OutOfMemoryError

SUCCESS = cu.CUresult.CUDA_SUCCESS

# Hints for the errors users meet most often; the message says what to do.
_HINTS = {
    "CUDA_ERROR_OUT_OF_MEMORY": "Free tensors or graphs you no longer need, or allocate less",
    "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED":
        "this operation is not allowed while the stream is capturing a graph (a host sync or allocation?)",
    "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED":
        "an earlier operation broke the capture; the graph cannot be completed",
    "CUDA_ERROR_INVALID_PTX": "compile to CUBIN for the device's exact arch; PTX from a newer NVRTC does not load",
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION": "compile to CUBIN for the device's exact arch, never PTX",
    "CUDA_ERROR_NO_BINARY_FOR_GPU": "the cubin was built for another architecture; compile for this device's arch",
    "CUDA_ERROR_NOT_FOUND": "the name is not in the module: check the kernel's entry name and name expression",
}
# Errors a faulting kernel leaves behind: reported by whatever call comes next, sticky.
KERNEL_FAULTS = frozenset({
    "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ASSERT"})


def error_name(code) -> str:
    try:
        return cu.CUresult(int(code)).name
    except ValueError:
        return f"CUresult {int(code)}"


def raise_error(code, call: str) -> None:
    name = error_name(code)
    description = ""
    if driver_available():
        err, text = cu.cuGetErrorString(code)
        if err == SUCCESS and text:
            description = text.decode()
    if name in KERNEL_FAULTS:
        raise KernelFaultError(call, int(code), name, description,
                               f"A kernel launched earlier faulted; this call only reports it. {KERNEL_FAULT_ADVICE}")
    cls = OutOfMemoryError if name == "CUDA_ERROR_OUT_OF_MEMORY" else CudaError
    raise cls(call, int(code), name, description, _HINTS.get(name, ""))


def check(result, call: str):
    """Unwrap a ``cuda.bindings`` result tuple ``(CUresult, *values)``.

    Returns ``None``, the single value, or the tuple of values; raises a
    CudaError naming ``call`` when the CUresult is not CUDA_SUCCESS.
    """
    code = result[0]
    if code:  # CUresult is an int enum; CUDA_SUCCESS == 0
        raise_error(code, call)
    n = len(result)
    return None if n == 1 else result[1] if n == 2 else result[1:]


# -- is there a GPU? ----------------------------------------------------------

_probe_lock = threading.Lock()
_probe: tuple[bool, str] | None = None


def probe() -> tuple[bool, str]:
    """``(available, reason)``: whether the CUDA driver loads, initialises and
    sees at least one device.  ``DEVICEOP_DEVICE=reference`` forces the
    reference device even where a GPU exists."""
    global _probe
    if _probe is not None:
        return _probe
    with _probe_lock:
        if _probe is None:
            _probe = _do_probe()
    return _probe


def _do_probe() -> tuple[bool, str]:
    if os.environ.get("DEVICEOP_DEVICE", "").lower() == "reference":
        return False, "DEVICEOP_DEVICE=reference is set"
    try:
        code = cu.cuInit(0)[0]
    except Exception as exc:  # the driver library itself is missing
        return False, f"no NVIDIA driver: {exc}"
    if code:
        return False, f"cuInit failed with {error_name(code)}"
    code, count = cu.cuDeviceGetCount()
    if code or count == 0:
        return False, "the NVIDIA driver sees no CUDA device"
    return True, f"{count} CUDA device(s)"


def driver_available() -> bool:
    return probe()[0]


def driver_version() -> str | None:
    """The driver's CUDA version as "13.0", or None without a driver."""
    if not driver_available():
        return None
    v = check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
    return f"{v // 1000}.{(v % 1000) // 10}"


def conditional_nodes_support() -> tuple[bool, str]:
    """``(supported, why not)``: can graphs hold conditional (WHILE) nodes?
    They need a CUDA 12.4 driver and bindings that expose the calls."""
    if not driver_available():
        return False, "this process has no CUDA driver"
    if not hasattr(cu, "cuGraphConditionalHandleCreate"):
        return False, "these cuda-bindings lack cuGraphConditionalHandleCreate"
    v = check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
    if v < 12040:
        return False, f"the driver supports CUDA {v // 1000}.{(v % 1000) // 10} (conditional nodes need 12.4)"
    return True, ""


def conditional_branches_support() -> tuple[bool, str]:
    """``(supported, why not)``: can a conditional node hold several bodies (IF/ELSE,
    SWITCH)?  They need a CUDA 12.8 driver and bindings that know SWITCH; without,
    deviceop makes one IF node per branch (runtime/graphs.py's ``capture_branches``)."""
    ok, why = conditional_nodes_support()
    if not ok:
        return ok, why
    if not hasattr(cu.CUgraphConditionalNodeType, "CU_GRAPH_COND_TYPE_SWITCH"):
        return False, "these cuda-bindings lack CU_GRAPH_COND_TYPE_SWITCH"
    v = check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
    if v < 12080:
        return False, f"the driver supports CUDA {v // 1000}.{(v % 1000) // 10} (IF/ELSE and SWITCH need 12.8)"
    return True, ""
