"""The test suite's own contract (tests/conftest.py), seen from a plain run of three
small modules under it: the full sweep is skipped with a reason that says how to
run it, a module with a PRECOMPILE list runs last and finds its kernels compiled
(by the background process), and the run leaves no compile cache behind."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MODULES = {
    "test_a_precompiled.py": '''
import deviceop as dop
from deviceop.kernels import add

PRECOMPILE = [(add, [128])]


def test_its_kernels_are_compiled_already():
    prog, _ = add.compile([128], arch=dop.Device(0).arch)
    assert prog.origin == "disk"   # written by the background process, read by this one
''',
    "test_b_plain.py": "def test_plain():\n    pass\n",
    "test_c_sweep.py": '''
import pytest


@pytest.mark.full_sweep
def test_every_configuration():
    raise AssertionError("a plain run skips the full sweep")
''',
}


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """(stdout, the temporary directory the session made its cache in)."""
    here, tmp = tmp_path_factory.mktemp("plain_run"), tmp_path_factory.mktemp("tmpdir")
    for name, source in MODULES.items():
        (here / name).write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICEOP_CACHE_DIR", "DEVICEOP_FULL_SWEEP")}
    env["TMPDIR"] = str(tmp)   # where the session makes its cache directory
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])   # -p conftest: this suite's
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", "-p", "conftest",
                           "-c", str(ROOT / "pyproject.toml"), *MODULES], cwd=here, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, tmp


def test_a_plain_run_skips_the_full_sweep_with_the_reason(plain_run):
    out, _ = plain_run
    assert "2 passed, 1 skipped" in out and "DEVICEOP_FULL_SWEEP=1 python -m pytest" in out, out


def test_a_precompile_module_runs_last_and_finds_its_kernels_compiled(plain_run):
    out, _ = plain_run
    assert re.findall(r"::(\w+) PASSED", out) == ["test_plain", "test_its_kernels_are_compiled_already"], out


def test_a_plain_run_removes_its_compile_cache(plain_run):
    _, tmp = plain_run
    assert not list(tmp.glob("deviceop-test-cache-*")), "the session left its compile cache behind"
