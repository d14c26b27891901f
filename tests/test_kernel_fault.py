"""A kernel that faults is reported naming the kernel.

The driver reports a fault (an illegal address, say) at the next call that
waits — it cannot say which kernel.  ``sync_on`` and ``GraphModel.forward``
turn it into a KernelFaultError that names the kernels the execution launched
and says what to do: the context is gone (the error is sticky), restart, and
find the access with compute-sanitizer.

On the GPU a real fault poisons the process's CUDA context, so those tests run
in a subprocess; the CPU test fakes the driver's report on a real stream.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cuda.bindings import driver as cu

import deviceop as dop
from deviceop import zip_
from deviceop.runtime.driver import raise_error
from deviceop.kernels import add, affine

ROOT = Path(__file__).resolve().parent.parent


class FaultReportingStream:
    """A real stream whose synchronize reports CUDA_ERROR_ILLEGAL_ADDRESS afterwards,
    as the driver does after a kernel faulted (nothing faults for real)."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def synchronize(self):
        self._stream.synchronize()
        raise_error(cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, "cuStreamSynchronize")


def test_a_fault_reported_at_sync_names_the_kernels_of_the_op(stream, rng):
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    a, b = dop.empty(256, stream=stream), dop.empty(256, stream=stream)
    op = zip_(affine(a.partition([128]), x, 2.0, 0.0).generics([128]),
              dop.shared(add(b.partition([128]), a, x).generics([128])))
    with pytest.raises(dop.KernelFaultError) as info:
        op.sync_on(FaultReportingStream(stream))
    err = info.value
    assert err.kernels == ("affine<128>", "add<128>")
    assert err.code_name == "CUDA_ERROR_ILLEGAL_ADDRESS" and err.call == "cuStreamSynchronize"
    msg = str(err)
    assert "A kernel launched by zip faulted; its kernel(s): affine<128>, add<128>" in msg
    assert "restart the process" in msg and "compute-sanitizer --tool memcheck" in msg
    assert isinstance(err, dop.CudaError)  # an except CudaError still catches it


def test_any_driver_call_that_reports_a_fault_says_it_is_sticky():
    with pytest.raises(dop.KernelFaultError, match="faulted; this call only reports it.*sticky") as info:
        raise_error(cu.CUresult.CUDA_ERROR_MISALIGNED_ADDRESS, "cuLaunchKernel(add<128>)")
    assert info.value.kernels == ()


def test_a_fault_during_a_graph_replay_names_the_graphs_kernels(stream, rng):
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    y = dop.empty(256, stream=stream)
    graph = affine(y.partition([128]), x, 2.0, 0.0).generics([128]).graph_on(stream)
    with pytest.raises(dop.KernelFaultError, match=r"graph\.launch faulted; its kernel\(s\): affine<128>"):
        graph.launch().sync_on(FaultReportingStream(stream))
    graph.close()




@pytest.mark.gpu
@pytest.mark.parametrize("how, kernels", [("eager", ["add<128>", "poke"]), ("graph", ["poke"]),
                                          ("model", ["poke"])])
def test_a_real_illegal_address_is_reported_naming_the_kernel(how, kernels):
    """scripts/planted_fault.py, in a subprocess: the fault poisons that process's context, not this one's."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "planted_fault.py"), how], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no KernelFaultError reported (rc {run.returncode}):\n{run.stdout}\n{run.stderr[-2000:]}"
    report = json.loads(lines[-1])
    assert report["type"] == "KernelFaultError" and report["code"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert report["kernels"] == kernels
    assert "poke" in report["message"] and "restart the process" in report["message"]
    # this process is untouched
    t = dop.from_numpy(np.ones(128, dtype=np.float32))
    assert float(t.numpy().sum()) == 128.0
