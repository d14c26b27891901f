"""``python -m deviceop info`` says what a bug report needs (issue 26, item 6),
docs/environment.md names every DEVICEOP_* variable the code reads, and the
reference device says plainly that it runs NumPy references, not the CUDA."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import deviceop as dop
from deviceop.__main__ import info_lines

ROOT = Path(__file__).resolve().parent.parent


def test_info_names_os_cpu_commit_compiler_wheels_and_the_variables_in_effect(monkeypatch):
    monkeypatch.setenv("DEVICEOP_ARCH", "sm_90")
    monkeypatch.setenv("DEVICEOP_HYPOTHESIS_PROFILE", "ci")
    text = "\n".join(info_lines())
    for label in ("os ", "cpu ", "nvidia-cuda-nvrtc ", "nvidia-cuda-cccl ", "nvidia-cutlass "):
        assert re.search(rf"^{label}", text, re.M), (label, text)
    if (ROOT / ".git").exists():  # run from a checkout, as here
        assert re.search(r"^git commit +[0-9a-f]{12}", text, re.M), text
    env_line = text.splitlines()[-1]
    assert env_line.startswith("environment") and "DEVICEOP_ARCH=sm_90" in env_line \
        and "DEVICEOP_HYPOTHESIS_PROFILE=ci" in env_line


def test_every_deviceop_variable_the_code_reads_is_documented():
    sources = [p for d in ("deviceop", "kernels", "scripts", "bench", "tests", "examples")
               for p in (ROOT / d).rglob("*") if p.is_file() and (p.suffix == ".py" or p.name == "gpu-check")]
    read = set()
    for path in sources:
        read |= set(re.findall(r"""["'](DEVICEOP_[A-Z_]+)["'=]""", path.read_text(errors="replace")))
    documented = set(re.findall(r"^\| `(DEVICEOP_[A-Z_]+)`", (ROOT / "docs/environment.md").read_text(), re.M))
    assert read and read <= documented, f"document these in docs/environment.md: {sorted(read - documented)}"


# -- what the reference device checks, said where a new user looks (issue 32, item 26) ----------

# Each place says: the CUDA is compiled by NVRTC and its signature checked against the
# CUBIN, but the NumPy reference runs, not the CUDA; scripts/gpu-check runs the CUDA.
SAYS = [r"NVRTC", r"CUBIN", r"NumPy reference[^.]{0,40}, not (its|the) CUDA", r"scripts/gpu-check"]


def _says_it(text: str, where: str) -> None:
    text = " ".join(text.split())  # wrapped lines read as one
    for pattern in SAYS:
        assert re.search(pattern, text), f"{where} does not say {pattern!r}:\n{text}"


def test_the_reference_devices_start_message_and_info_say_the_cuda_does_not_run_there():
    code = ("import deviceop as dop; dop.Device(); from deviceop.__main__ import info_lines; "
            "print('\\n'.join(info_lines()))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DEVICEOP_DEVICE": "reference"})
    assert run.returncode == 0, run.stderr
    _says_it(run.stderr, "the start message")
    kernels = [line for line in run.stdout.splitlines() if line.startswith("kernels ")]
    assert kernels, run.stdout
    _says_it(kernels[0], "python -m deviceop info")


def _paragraph(text: str, starts: str) -> str:
    at = text.index(starts)
    return text[at:text.find("\n\n", at)]


def test_the_readme_and_the_tutorial_say_the_cuda_does_not_run_on_the_reference_device():
    readme = (ROOT / "README.md").read_text()
    _says_it(_paragraph(readme, "On a machine without a GPU, `dop.Device()` is a *reference device*"),
             "README's paragraph on the reference device")
    tutorial = (ROOT / "docs/tutorial.md").read_text()
    declared = tutorial[tutorial.index("## Kernels: CUDA C++ plus a declaration"):tutorial.index("## The model\n")]
    _says_it(_paragraph(declared, "- **`reference`**"), "the tutorial where a kernel is declared")


def test_deviceop_arch_is_read_as_nvrtc_spells_an_arch(monkeypatch):
    # "90" was kept as "90": compiling read it as sm_90, but the reference device's per-arch facts
    # (the shared memory a block may have) were unknown, so a launch over the limit went unrefused
    device = dop.ReferenceDevice(0)
    for spelling in ("90", "SM_90", "compute_90"):
        monkeypatch.setenv("DEVICEOP_ARCH", spelling)
        assert device.arch == "sm_90" and device.max_shared_memory_per_block == 232448
    monkeypatch.setenv("DEVICEOP_ARCH", "hopper")
    with pytest.raises(dop.ConfigError, match="DEVICEOP_ARCH='hopper' is not a GPU architecture: write it like sm_90"):
        device.arch


def test_info_says_when_the_cache_dir_is_a_file(monkeypatch, tmp_path):
    # it said "0 entries", as for an empty cache; each compile warns, info is what a bug report pastes
    (tmp_path / "cache").write_text("not a directory")
    for d in (tmp_path / "cache", tmp_path / "cache" / "sub"):
        monkeypatch.setenv("DEVICEOP_CACHE_DIR", str(d))
        line = next(l for l in info_lines() if l.startswith("compile cache"))
        assert f"({tmp_path / 'cache'} is a file, not a directory: nothing is cached on disk)" in line
