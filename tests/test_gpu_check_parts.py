"""scripts/gpu-check's sanitizer parts: memcheck runs the subset ~15x slower than without a
sanitizer, past one device call, so ``--sanitize-part K/N`` splits the subset's files over N calls."""
import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check"


@pytest.fixture(scope="module")
def gpu_check():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_check", loader))
    loader.exec_module(module)
    return module


@pytest.mark.parametrize("n", [2, 3])
def test_the_parts_cover_the_subset_once(gpu_check, n):
    parts = [gpu_check.sanitize_files(f"{k}/{n}") for k in range(1, n + 1)]
    assert sorted(f for p in parts for f in p) == sorted(gpu_check.SANITIZE_TESTS)
    assert all(parts) and max(map(len, parts)) - min(map(len, parts)) <= 1
    assert gpu_check.sanitize_files(None) == gpu_check.SANITIZE_TESTS


@pytest.mark.parametrize("bad", ["0/2", "3/2", "1", "a/b", "1/0", "1/99", "-1/2"])
def test_a_malformed_part_is_refused_naming_the_form(gpu_check, bad):
    with pytest.raises(ValueError, match="give K/N with 1 <= K <= N"):
        gpu_check.sanitize_files(bad)


def test_the_command_line_refuses_a_bad_part_before_running_anything():
    done = subprocess.run([sys.executable, str(SCRIPT), "--sanitize", "--sanitize-part", "2/1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--sanitize-part '2/1': give K/N" in done.stderr
