"""The test suite's own contract (tests/conftest.py): a plain run skips the full
compile sweep with a reason that says how to run it, and leaves no compile cache behind."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWEEP_TEST = "tests/test_conv.py::test_every_shipped_configuration_compiles_for_sm90"


def test_a_plain_run_skips_the_full_sweep_with_the_reason_and_removes_its_cache(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICEOP_CACHE_DIR", "DEVICEOP_FULL_SWEEP")}
    env["TMPDIR"] = str(tmp_path)   # where the session makes its cache directory
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", SWEEP_TEST],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout and "DEVICEOP_FULL_SWEEP=1 python -m pytest" in proc.stdout, proc.stdout
    assert not list(tmp_path.glob("deviceop-test-cache-*")), "the session left its compile cache behind"
