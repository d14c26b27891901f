"""The soak script (scripts/soak.py) runs end to end, briefly, and reports flat memory.

The real soak — minutes of token-loop replays and 10,000 graphs and caches on
the H100 — is ``scripts/gpu-check --soak``; this keeps the script working."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_soak_script_runs_and_passes(tmp_path):
    env = dict(os.environ, DEVICEOP_BENCH_OUT=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--seconds", "1", "--graphs", "300",
                          "--caches", "100", "--d", "256", "--layers", "2"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "soak: PASS" in run.stdout
    result = json.loads((tmp_path / "soak.json").read_text())
    loop, churn = result["rows"]
    assert loop["replays"] >= 1000 and loop["outputs_wrong"] == 0
    assert churn["graphs"] == 300 and churn["leaked_handles"] == {} and result["failures"] == []
