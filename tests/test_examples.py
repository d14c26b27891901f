"""Every example runs to completion (exit 0: its own checks passed).

Here they run on the reference device, forced with DEVICEOP_DEVICE=reference
(small configurations: seconds); ``scripts/gpu-check`` runs them full size on
the H100.
"""
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_on_the_reference_device(path):
    """... says what ran, and prints no timing or speedup: NumPy's say nothing about a GPU."""
    env = dict(os.environ, DEVICEOP_DEVICE="reference")
    args = {"token_model.py": ["--d", "256", "--layers", "2"],
            "token_loop.py": ["--tokens", "8", "--fused", "--device-loop"],
            "variable_batch.py": ["--steps", "12"], "dynamic_params.py": ["--iters", "50"],
            "unet_block.py": []}.get(path.name, [])   # unet_block picks a small block by itself
    proc = subprocess.run([sys.executable, str(path), *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reference device" in proc.stdout.splitlines()[0]
    assert not re.search(r"\d\.\d+x |us/token|us/step|us/iteration|us per step|tokens/s", proc.stdout), proc.stdout
    if path.name == "token_loop.py":
        assert proc.stdout.startswith("22 layers, d=256, 88 launches a token (44 fused), 8 tokens")


def test_the_token_loop_says_what_ran_without_fusion():
    env = dict(os.environ, DEVICEOP_DEVICE="reference")
    proc = subprocess.run([sys.executable, str(EXAMPLES[0].parent / "token_loop.py"), "--d", "384", "--layers", "2",
                           "--tokens", "3"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("2 layers, d=384, 8 launches a token, 3 tokens") and "fused" not in proc.stdout


BAD_FLAGS = [("token_loop.py", ["--d", "100"], "multiple of 128"), ("token_loop.py", ["--d", "384", "--fused"],
                                                                    "multiple of 256"),
             ("token_model.py", ["--d", "100"], "multiple of 128"), ("variable_batch.py", ["--layers", "0"],
                                                                     "at least 1"),
             ("dynamic_params.py", ["--n", "100"], "multiple of 256"), ("unet_block.py", ["--c", "30"], "multiples of 8")]


def run_main(monkeypatch, path: Path, args: list) -> int:
    """Run an example's command line in this process (no interpreter start-up): its exit status."""
    monkeypatch.setattr(sys, "argv", [path.name, *args])
    monkeypatch.setattr(sys, "path", list(sys.path))   # the examples put their folders first
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(path), run_name="__main__")
    return exit_.value.code


@pytest.mark.parametrize("name,args,says", BAD_FLAGS, ids=[f"{n[:-3]}{' '.join(a)}" for n, a, _ in BAD_FLAGS])
def test_a_flag_the_kernels_cannot_serve_is_a_usage_error_naming_the_constraint(monkeypatch, capsys, name, args, says):
    assert run_main(monkeypatch, EXAMPLES[0].parent / name, args) == 2   # argparse's usage error, not a traceback
    err = capsys.readouterr().err
    assert f"{name}: error: " in err and says in err, err


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_option_of_an_example_has_help_and_its_default(monkeypatch, capsys, path):
    assert run_main(monkeypatch, path, ["--help"]) == 0
    options = capsys.readouterr().out.split("options:")[1]
    entries = re.split(r"\n  (?=-)", options)[1:]
    assert entries
    for entry in entries:
        if entry.startswith("-h"):
            continue
        assert "(default:" in " ".join(entry.split()), f"{path.name}: {entry.strip()}"


def test_the_llama_example_runs_on_the_reference_device_in_seconds():
    """python -m examples.llama --random: a tiny config, a whole generation in one graph launch."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, DEVICEOP_DEVICE="reference")
    proc = subprocess.run([sys.executable, "-m", "examples.llama", "--random", "--max-new", "8", "--capacity", "64"],
                          cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "generated 8 tokens" in proc.stdout
