"""``python -m deviceop info`` says what a bug report needs (issue 26, item 6),
and docs/environment.md names every DEVICEOP_* variable the code reads."""
import re
from pathlib import Path

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
