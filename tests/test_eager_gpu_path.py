"""The GPU path of eager execution, checked without a GPU.

On the reference device a kernel launch op runs the kernel's NumPy reference;
on a GPU its first launch of an argument layout is checked and launched by the
Function's generated launcher, then prepared (packed once); a launch seen
before is one key lookup and one driver call with the prepared parameters.  Here a device that is not the reference
device, with Functions whose only stand-in is the driver (cuLaunchKernel
records its arguments), runs that path on the tutorial model's forward: every
launch reaches the driver once, in order, with the right pointers, grids and
scalars, and a rebuilt forward over the same buffers is not checked again.
(scripts/eager_tree_cpu.py times the same path.)
"""
import collections
import ctypes
import struct
import os
import subprocess
import sys
from pathlib import Path

import pytest

import deviceop as dop
from deviceop import tensor as tensor_mod
from deviceop.op import stats
from deviceop.runtime import launch as launch_mod
from deviceop.runtime.launch import ptr
from deviceop.runtime.device import device_key
from deviceop.kernels import add, matvec, rms_norm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from token_model import Config, LayerBuffers, LayerWeights, build_forward  # noqa: E402
from helpers import calls_during  # noqa: E402


class FakeGpu:
    """A GPU whose memory is the reference device's: tensors made while it is installed
    (fake_gpu) are its own, as a kernel launched on its stream requires."""
    is_reference = False
    ordinal = -7  # no real device has it: the kernels' function caches keep these apart
    name = label = "fake GPU"

    def __getattr__(self, name):  # memory, streams and transfers: the reference device's
        return getattr(dop.Device(0), name)


class FakeStream:
    ptr = 0  # a stream's address (CudaStream.ptr)

    def __init__(self, device):
        self.device = device

    def synchronize(self):
        pass


class RecordingDriver:
    """launch_kernel (the driver's cuLaunchKernel) that decodes and records each launch's parameters."""

    def __init__(self):
        self.functions, self.launches = [], []

    def launch_kernel(self, address, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        fn = self.functions[address]
        addrs = (ctypes.c_void_p * len(fn.signature)).from_address(params)
        args = [struct.unpack("@P" if isinstance(s, ptr) else "@" + s.pack,
                              ctypes.string_at(addrs[i], 8 if isinstance(s, ptr) else s.itemsize))[0]
                for i, s in enumerate(fn.signature)]
        self.launches.append((fn.name, (gx, gy, gz), (bx, by, bz), args))

    def cuLaunchKernelEx(self, config, handle, params, extra):  # PDL launches: the forward makes none
        raise AssertionError("unexpected PDL launch")


class DriverlessFunction(launch_mod.Function):
    def _verify_layout(self, offsets):  # no CUBIN to compare with
        pass

    def _default_dynamic_shared_memory(self):  # no CUBIN to ask: these kernels have no static shared memory
        return 48 * 1024


def fake_gpu(monkeypatch, kernels):
    """(device, stream, driver, checks): ``kernels`` ((kernel, generics) pairs) on a
    fake GPU whose cuLaunchKernel records each launch; ``checks`` records each run of
    a kernel's ``validate`` (by kernel name)."""
    driver, device = RecordingDriver(), FakeGpu()
    placed = tensor_mod.placed  # tensors made without device= or stream= are the fake GPU's
    monkeypatch.setattr(tensor_mod, "placed", lambda what, d, s: placed(what, d if d is not None or s is not None
                                                                        else device, s))
    monkeypatch.setattr(launch_mod, "cu", driver)  # what the generated launchers call
    monkeypatch.setattr(launch_mod, "launch_kernel", driver.launch_kernel)
    checks = []
    for kernel, gen in kernels:
        gen = kernel.check_generics(gen)
        fn = DriverlessFunction(None, len(driver.functions), kernel.name, kernel.signature)
        driver.functions.append(fn)
        monkeypatch.setitem(kernel._functions, (*device_key(device), gen), fn)
        kernel._plans.clear()  # (the generated fast path holds this dict: cleared, never replaced)
        monkeypatch.setattr(kernel, "validate", lambda *a, _v=kernel.validate, _k=kernel.name: (checks.append(_k), _v(*a)))
    return device, FakeStream(device), driver, checks


@pytest.fixture
def gpu_path(monkeypatch):
    """(cfg, device, stream, driver, checks): the three kernels of the forward on a fake GPU."""
    cfg = Config(d=256, n_layers=3, bk=2)
    return (cfg, *fake_gpu(monkeypatch, ((rms_norm, cfg.rms_generics()), (matvec, cfg.mv_generics()),
                                         (add, [cfg.block]))))


def test_the_eager_forward_reaches_the_driver_once_per_launch_with_its_arguments(gpu_path):
    cfg, device, stream, driver, checks = gpu_path
    d, n = cfg.d, cfg.n_layers
    weights = [LayerWeights(*(dop.empty(s).into_shared() for s in ([d], [d, d], [d, d]))) for _ in range(n)]
    raw = [[dop.empty(s) for s in ([1, d], [d], [d], [d])] for _ in range(n)]
    x = dop.empty([d])

    expected, hidden = [], x
    for w, (norm, q, o, res) in zip(weights, raw):
        bs = cfg.rms_generics()[1]
        expected += [("rms_norm", (1, 1, 1), (bs, 1, 1), [norm.data_ptr, hidden.data_ptr, w.norm_w.tensor.data_ptr,
                                                          pytest.approx(cfg.eps)]),
                     ("matvec", (d // cfg.bn, 1, 1), (32 * cfg.bn, 1, 1), [q.data_ptr, norm.data_ptr, w.wq.tensor.data_ptr]),
                     ("matvec", (d // cfg.bn, 1, 1), (32 * cfg.bn, 1, 1), [o.data_ptr, q.data_ptr, w.wo.tensor.data_ptr]),
                     ("add", (d // cfg.block, 1, 1), (cfg.block // 4, 1, 1), [res.data_ptr, hidden.data_ptr, o.data_ptr])]
        hidden = res

    for token in range(3):  # rebuilt per token, as eager code does: checked the first time only
        before = stats["launches"]
        forward, out = build_forward(cfg, weights, x, [LayerBuffers(*(t.into_shared() for t in r)) for r in raw])
        forward.async_on(stream)
        assert stats["launches"] - before == 4 * n
        assert driver.launches == expected
        assert out.sync_on(stream) is raw[-1][3] and stats["launches"] - before == 4 * n
        assert len(checks) == 4 * n  # every launch checked once, on the first token
        driver.launches.clear()


def test_the_host_cost_script_runs():
    """scripts/eager_tree_cpu.py (the timing of this path), briefly: it keeps working."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "eager_tree_cpu.py"), "--d", "256", "--layers", "2",
                          "--tokens", "3", "--reps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "op-tree overhead (eager - launcher)" in run.stdout


def test_the_hot_calls_host_cost_script_runs():
    """scripts/host_costs_cpu.py (eager launches, replay, forward, node set), briefly: it broke
    once unnoticed when launches began refusing tensors of another device than the stream's."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_costs_cpu.py"), "--n", "20", "--reps", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr
    for row in ("eager add", "eager lm_head", "replay", "forward", "node set"):
        assert row in run.stdout, row


# -- prepared launches: a launch seen before is one lookup and one driver call ----

def _rms(cfg, out, x, w, eps):
    return rms_norm(out.partition([1, cfg.d]), x, w, eps).generics(cfg.rms_generics())


def test_a_repeated_launch_is_not_checked_again_but_a_changed_scalar_is_checked_and_launched_with_its_value(
        gpu_path):
    cfg, device, stream, driver, checks = gpu_path
    out, x, w = dop.empty([1, cfg.d]), dop.empty([1, cfg.d]), dop.empty([cfg.d])
    for eps in (1e-5, 1e-5, 2e-5, 1e-5, 2e-5):
        _rms(cfg, out, x, w, eps).async_on(stream)
    assert [launch[3][3] for launch in driver.launches] == [pytest.approx(e) for e in (1e-5, 1e-5, 2e-5, 1e-5, 2e-5)]
    # checked once per argument set: a kernel's rules may read its scalars, so a new value is checked too
    assert checks == ["rms_norm", "rms_norm"]


def test_a_negative_zero_scalar_is_not_mistaken_for_zero(gpu_path):
    """0.0 == -0.0 in Python, but a kernel receives different bits."""
    import math
    cfg, device, stream, driver, checks = gpu_path
    out, x, w = dop.empty([1, cfg.d]), dop.empty([1, cfg.d]), dop.empty([cfg.d])
    for eps in (0.0, -0.0, 0.0, -0.0):
        _rms(cfg, out, x, w, eps).async_on(stream)
    assert [math.copysign(1.0, launch[3][3]) for launch in driver.launches] == [1.0, -1.0, 1.0, -1.0]


def test_a_prepared_launch_still_refuses_a_released_input_or_a_wrong_dtype(gpu_path):
    cfg, device, stream, driver, checks = gpu_path
    out, x = dop.empty([1, cfg.d]), dop.empty([1, cfg.d])
    w = dop.empty([cfg.d]).into_shared()
    _rms(cfg, out, x, w, 1e-5).async_on(stream)
    _rms(cfg, out, x, w, 1e-5).async_on(stream)  # prepared now
    w.release()
    with pytest.raises(dop.StateError, match="released"):
        _rms(cfg, out, x, w, 1e-5).async_on(stream)
    with pytest.raises(dop.DTypeError, match="float32"):
        _rms(cfg, out, x, dop.empty([cfg.d], "float16"), 1e-5).async_on(stream)
    with pytest.raises(dop.DTypeError):
        _rms(cfg, out, x, dop.empty([cfg.d]), "not a number").async_on(stream)
    assert len(driver.launches) == 2  # nothing refused reached the driver


def test_function_prepared_checks_its_arguments_and_attribute_once(gpu_path):
    cfg, device, stream, driver, checks = gpu_path
    fn = add._functions[(*device_key(device), (cfg.block,))]
    y, a, b = dop.empty([cfg.d]), dop.empty([cfg.d]), dop.empty([cfg.d])
    config = dop.LaunchConfig(cfg.d // cfg.block, cfg.block // 4)
    go = fn.prepared(None, config, y, a, b)
    go(stream)
    go(stream)
    assert [launch[3] for launch in driver.launches] == [[y.data_ptr, a.data_ptr, b.data_ptr]] * 2
    with pytest.raises(dop.LaunchError, match="takes 3 arguments"):
        fn.prepared(None, config, y, a)
    with pytest.raises(dop.DTypeError, match="float32 tensor, got float16"):
        fn.prepared(None, config, y, dop.empty([cfg.d], "float16"), b)
    with pytest.raises(dop.LaunchError, match="no launch attribute 'fast'"):
        fn.prepared("fast", config, y, a, b)
    with pytest.raises(dop.LaunchError, match="cluster=\\(x, y, z\\)"):
        fn.prepared("cluster", config, y, a, b)


# -- what a warm eager launch does: the hot path's cost, guarded by what it calls ----

# Checks that must never run on a warm eager launch (a plan found by its key was checked):
# the launch checks, a loop body's guard, the capture registry's lookup of a stream.
CHECKS = {"checked_launch", "_check_launch", "check_arg", "bind", "run_rule", "check", "check_op",
          "_launch", "_launch_and_prepare", "stream_key", "refuse_if_captured_elsewhere", "captured_elsewhere"}
DEVICEOP = str(ROOT / "deviceop")


def _deviceop_calls(run) -> collections.Counter:
    """The deviceop functions deviceop's code calls in ``run()``, but the op tree's own walk
    (each op's ``_run``/``_execute``, a comprehension in one) and the generated launch code
    (the recording driver's own calls are not deviceop's)."""
    def name(frame):
        code, caller = frame.f_code, frame.f_back.f_code.co_filename if frame.f_back else ""
        if (code.co_filename.startswith(DEVICEOP) and caller.startswith((DEVICEOP, "<deviceop"))
                and code.co_name not in ("_run", "_execute", "<listcomp>")):
            return f"{Path(code.co_filename).name}:{code.co_name}"
        return None
    return collections.Counter(calls_during(run, name))


def test_a_warm_eager_launch_calls_no_check_and_nothing_per_launch_beyond_its_ops(gpu_path):
    """No timing (it would flake): a forward of three layers calls the same deviceop functions,
    as often, as a forward of one (per execution: the execution lock, the context), so nothing
    runs per launch but the tree's ops and the generated launch; and none of the checks runs
    (the plan its key finds was checked; no loop body, no capture is open)."""
    cfg, device, stream, driver, checks = gpu_path
    d, n = cfg.d, cfg.n_layers
    weights = [LayerWeights(*(dop.empty(s).into_shared() for s in ([d], [d, d], [d, d]))) for _ in range(n)]
    raw = [[dop.empty(s) for s in ([1, d], [d], [d], [d])] for _ in range(n)]
    x = dop.empty([d])

    def forward(layers):
        bufs = [LayerBuffers(*(t.into_shared() for t in r)) for r in raw[:layers]]
        return build_forward(cfg, weights[:layers], x, bufs)[0]

    forward(n).async_on(stream)  # checked and prepared
    checked = len(checks)
    one, many = forward(1), forward(n)
    calls_one = _deviceop_calls(lambda: one.async_on(stream))
    before = stats["launches"]
    calls_many = _deviceop_calls(lambda: many.async_on(stream))
    assert stats["launches"] - before == 4 * n and len(checks) == checked
    assert calls_many == calls_one, "a warm eager launch now calls more than its ops: make it part of its plan"
    assert not {name.split(":")[1] for name in calls_many} & CHECKS, calls_many
