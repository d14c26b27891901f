"""Every example runs to completion (exit 0: its own checks passed).

Here they run on the reference device, forced with DEVICEOP_DEVICE=reference
(small configurations: seconds); ``scripts/gpu-check`` runs them full size on
the H100.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_on_the_reference_device(path):
    env = dict(os.environ, DEVICEOP_DEVICE="reference")
    args = {"token_model.py": ["--d", "256", "--layers", "2"],
            "token_loop.py": ["--tokens", "8", "--fused", "--device-loop"],
            "variable_batch.py": ["--steps", "12"], "dynamic_params.py": ["--iters", "50"],
            "unet_block.py": ["--c", "32", "--hw", "16", "--groups", "8", "--steps", "5"]}.get(path.name, [])
    proc = subprocess.run([sys.executable, str(path), *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_llama_example_runs_on_the_reference_device_in_seconds():
    """python -m examples.llama: a tiny config, a whole generation in one graph launch."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, DEVICEOP_DEVICE="reference")
    proc = subprocess.run([sys.executable, "-m", "examples.llama", "--max-new", "8", "--capacity", "64"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "generated 8 tokens" in proc.stdout
