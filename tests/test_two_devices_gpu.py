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


def test_work_on_gpu_1_runs_in_its_own_context_after_gpu_0_became_current(tmp_path):
    if gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {gpu_count()}: run on nvidia-h100-x2")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", SCENARIO, str(int.from_bytes(os.urandom(4), "little"))],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and "OK" in run.stdout, run.stdout + run.stderr
