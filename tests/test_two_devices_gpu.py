"""One process, two GPUs: each device's work runs in its own context whatever context is
current on the thread when it is asked for.

Opening a device makes its context current, and libraries (torch.cuda.set_device, CuPy's
Device.use) switch it too.  A graph captured on GPU 1 while GPU 0's context was current
failed to instantiate (CUDA_ERROR_INVALID_VALUE: its kernels are modules of GPU 1's context):
a tensor-parallel rank that compiled with the default arch opened GPU 0 and could not replay
its decode graph.  Each check runs in a fresh process, so the order the devices are opened
in is the scenario's, not whatever the test session did before.

On 2 GPUs:  python3 -m pytest -q tests/test_two_devices_gpu.py
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import gpu_count

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.gpu

SCENARIO = r"""
import sys
import numpy as np
from cuda.bindings import driver as cu
import deviceop as dop
from deviceop.kernels import add
from deviceop.runtime import device as rt

def context_active(ordinal):
    return cu.cuDevicePrimaryCtxGetState(cu.cuDeviceGet(ordinal)[1])[2]

rng = np.random.default_rng(int(sys.argv[1]))
gpu1 = dop.Device(1)
# compiling for the default arch reads GPU 0's arch without opening a context there
dop.precompile([(add, [128])])
assert (rt.CudaDevice, 0) not in rt._instances, "precompile opened Device(0)"
gpu0 = dop.Device(0)                       # opening GPU 0 makes its context current
stream = gpu1.new_stream()
for switch in ("device 0 opened", "a library switched"):
    if switch == "a library switched":     # as torch.cuda.set_device(0) would
        assert cu.cuCtxSetCurrent(gpu0.context)[0] == 0
    x = rng.standard_normal(1024).astype(np.float32)
    xs = dop.from_numpy(x, stream=stream)
    y = dop.empty(1024, dtype=np.float32, stream=stream)
    add(y.partition([128]), xs, xs).generics([128]).sync_on(stream)           # eager, on GPU 1
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * x)
    z = dop.empty(1024, dtype=np.float32, stream=stream)
    graph = add(z.partition([128]), y, xs).generics([128]).graph_on(stream)   # captured on GPU 1
    graph.replay()
    np.testing.assert_array_equal(z.numpy(stream=stream), 3 * x)
    graph.close()
print("OK", context_active(0))
"""


ONLY_GPU_1 = r"""
import asyncio, sys, threading
import numpy as np
from cuda.bindings import driver as cu
import deviceop as dop
from deviceop import api
from deviceop.kernels import add

def context_active(ordinal):
    return cu.cuDevicePrimaryCtxGetState(cu.cuDeviceGet(ordinal)[1])[2]

rng = np.random.default_rng(int(sys.argv[1]))
gpu1 = dop.Device(1)
x = rng.standard_normal(1024).astype(np.float32)
import cupy
foreign = cupy.asarray(x)                    # on GPU 1: deviceop bound its context, CuPy follows it
failures = []

def work():                                  # a thread where no context is current (a worker's, an executor's)
    try:
        a = dop.from_numpy(x, device=1)
        b = dop.from_dlpack(foreign)         # a cuda:1 array: imported on Device(1) without device=
        assert b.device is gpu1, b.device
        out = dop.empty(1024, device=1)
        add(out.partition([128]), a, b).sync()                    # the op's device's default stream
        np.testing.assert_array_equal(out.numpy(), 2 * x)         # no stream=: its device synchronized
        api.fill(out, 0.5).sync()
        np.testing.assert_array_equal(out.numpy(), np.full(1024, 0.5, np.float32))
        asyncio.run(_await(add(out.partition([128]), a, a).first().unpartition()))
        np.testing.assert_array_equal(out.numpy(), 2 * x)
    except BaseException as exc:
        failures.append(repr(exc))

async def _await(op):
    return await op

t = threading.Thread(target=work)
t.start(); t.join()
assert not failures, failures
print("OK", context_active(0))
"""

REFUSED = r"""
import sys
import numpy as np
import cupy
import deviceop as dop
from deviceop import api
from deviceop.kernels import add

rng = np.random.default_rng(int(sys.argv[1]))
gpu0, gpu1 = dop.Device(0), dop.Device(1)
s0 = gpu0.new_stream()
x = rng.standard_normal(1024).astype(np.float32)
a0, out0 = dop.from_numpy(x, device=0), dop.empty(1024, device=0)
a1 = dop.from_numpy(x, device=1)
refused = []
try:                                         # GPU 1's pointer in a kernel on GPU 0: a fault, were it launched
    add(out0.partition([128]), a0, a1).sync_on(s0)
except dop.LaunchError as exc:
    refused.append("the stream is on cuda:0, argument b on cuda:1" in str(exc))
try:
    api.memcpy(out0, a1).sync()              # two devices: no one default stream
except dop.LaunchError as exc:
    refused.append("uses tensors of cuda:0 and of cuda:1" in str(exc))
with cupy.cuda.Device(1):
    foreign = cupy.asarray(x)
try:
    dop.from_dlpack(foreign, device=0)
except dop.LaunchError as exc:
    refused.append("lives on GPU 1" in str(exc))
assert refused == [True, True, True], refused
add(out0.partition([128]), a0, a0).sync_on(s0)             # GPU 0's context is intact
np.testing.assert_array_equal(out0.numpy(stream=s0), 2 * x)
api.memcpy(out0, a1).sync_on(s0)                          # a copy between GPUs, on a stream chosen
np.testing.assert_array_equal(out0.numpy(stream=s0), x)
print("OK refused")
"""


def _run(scenario: str):
    if gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {gpu_count()}: run on nvidia-h100-x2")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", scenario, str(int.from_bytes(os.urandom(4), "little"))],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_work_on_gpu_1_runs_in_its_own_context_after_gpu_0_became_current(tmp_path):
    assert "OK" in _run(SCENARIO)


def test_a_process_that_uses_only_gpu_1_never_opens_gpu_0_even_from_a_fresh_thread():
    # sync() took Device(0)'s default stream; CuPy (alloc, set, get) and NCCL enter the memory's device
    # and restore the thread's current one, which is GPU 0 where no context is current; a cuda:1
    # DLPack import landed on Device(0)
    assert "OK 0" in _run(ONLY_GPU_1)


def test_work_mixing_two_gpus_is_refused_before_it_reaches_either_and_both_stay_usable():
    assert "OK refused" in _run(REFUSED)
