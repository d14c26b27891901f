"""Test set-up shared by every test file.

* ``@pytest.mark.gpu`` tests need a CUDA device; without one they are skipped
  with the reason, and ``scripts/gpu-check`` runs them on the H100.
* Tests without the mark run on whatever ``dop.Device(0)`` is: the reference
  device here and in CI, the real GPU under gpu-check.
* The compile cache goes to a fresh directory per test session, so a test
  never depends on what an earlier run left behind; the session removes it
  when it ends.
* ``@pytest.mark.full_sweep`` tests are the whole sweep: every shipped kernel
  configuration compiled (minutes of NVRTC on two cores), the seed's full-size
  model and the longer stress runs (seconds of NumPy on the reference device).
  A plain run covers a representative subset (one configuration of each
  kernel, small sizes, in unmarked tests) and skips them, with the reason;
  ``DEVICEOP_FULL_SWEEP=1`` runs them (``scripts/gpu-check`` sets it).
* A test module whose kernels take seconds to compile (CUTLASS/CuTe headers)
  names them in a module-level ``PRECOMPILE`` list of (kernel, generics).
  Such modules run last, and a background process compiles their kernels into
  the session's cache meanwhile, on another core; each waits for it before its
  first test.  Not in the full sweep, which compiles everything anyway.
* Hypothesis runs under a profile named by ``DEVICEOP_HYPOTHESIS_PROFILE``:
  ``ci`` (the default, 30 examples: CI stays fast), ``gpu`` (100, what
  ``scripts/gpu-check`` asks for) or ``long`` (1000).  Examples are never timed
  out: the first example of a shape compiles its kernels.
"""
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

_own_cache_dir = None
if "DEVICEOP_CACHE_DIR" not in os.environ:
    _own_cache_dir = os.environ["DEVICEOP_CACHE_DIR"] = tempfile.mkdtemp(prefix="deviceop-test-cache-")

FULL_SWEEP = os.environ.get("DEVICEOP_FULL_SWEEP", "") not in ("", "0")

import deviceop as dop  # noqa: E402
from deviceop.runtime import driver  # noqa: E402

_slow_ok = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=30, deadline=None, suppress_health_check=_slow_ok)
settings.register_profile("gpu", max_examples=100, deadline=None, suppress_health_check=_slow_ok)
settings.register_profile("long", max_examples=1000, deadline=None, suppress_health_check=_slow_ok)
settings.load_profile(os.environ.get("DEVICEOP_HYPOTHESIS_PROFILE", "ci"))


def _precompiles(item) -> bool:
    return bool(getattr(getattr(item, "module", None), "PRECOMPILE", None))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_precompiles)  # stable: the PRECOMPILE modules last, each in its own order
    if not FULL_SWEEP:
        sweep = pytest.mark.skip(reason="part of the full sweep (every shipped configuration, full sizes): "
                                        "DEVICEOP_FULL_SWEEP=1 python -m pytest runs it (scripts/gpu-check does); "
                                        "this run covers a representative subset")
        for item in items:
            if "full_sweep" in item.keywords:
                item.add_marker(sweep)
    available, reason = driver.probe()
    if available:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU ({reason.split(':')[0]}); runs on the H100 under scripts/gpu-check")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """What collection built (modules, test items, Hypothesis strategies) lives all session:
    freeze it out of the collector, so that each test's gc.collect() (leak checks) walks
    only what the tests made since -- tens of milliseconds a call otherwise."""
    gc.collect()
    gc.freeze()
    if not session.config.option.collectonly:
        _start_precompiling(session.items)


WARM = """
import runpy, sys
import deviceop as dop
for path in sys.argv[2:]:
    dop.precompile(runpy.run_path(path)["PRECOMPILE"], arch=sys.argv[1], threads=1)
"""
_warming = None


def _start_precompiling(items) -> None:
    """Compile the PRECOMPILE lists of the modules that will run, in a background process."""
    global _warming
    from deviceop.compile import disk_cache_enabled
    paths = sorted({str(item.module.__file__) for item in items
                    if _precompiles(item) and item.get_closest_marker("skip") is None})
    if FULL_SWEEP or not paths or not disk_cache_enabled():
        return
    _warming = subprocess.Popen([sys.executable, "-c", WARM, dop.Device(0).arch, *paths], stdin=subprocess.DEVNULL,
                                cwd=Path(__file__).resolve().parent.parent,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_precompiling() -> None:
    if _warming is not None and _warming.poll() is None:
        _warming.kill()
        _warming.wait()


@pytest.fixture(scope="module", autouse=True)
def _precompiled(request):
    """A PRECOMPILE module starts once the background compile is done (it would compile
    the same kernels a second time otherwise).  A failed one changes nothing: the
    tests compile what is missing and report what fails."""
    if _warming is not None and getattr(request.module, "PRECOMPILE", None):
        try:
            _warming.wait(timeout=600)
        except subprocess.TimeoutExpired:
            _stop_precompiling()


def pytest_sessionfinish(session, exitstatus):
    """The session's own compile cache goes with it (tens of MB a run otherwise pile up in /tmp),
    after the background compile, which would write into it."""
    _stop_precompiling()
    if _own_cache_dir is not None:
        shutil.rmtree(_own_cache_dir, ignore_errors=True)


@pytest.fixture
def device():
    return dop.Device(0)


@pytest.fixture
def stream(device):
    return device.new_stream()


@pytest.fixture
def rng():
    """Fresh random data every run (never zeros); the seed is printed on failure, and
    ``DEVICEOP_TEST_SEED=<seed>`` runs a test again with the seed that failed it."""
    fixed = os.environ.get("DEVICEOP_TEST_SEED", "")
    seed = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    print(f"rng seed {seed} (DEVICEOP_TEST_SEED={seed} repeats it)")
    return np.random.default_rng(seed)
