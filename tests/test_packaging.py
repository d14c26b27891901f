"""The kernel library installs and imports as ``deviceop.kernels``, never as a
top-level ``kernels`` (Hugging Face's package of that name is on PyPI, and
transformers imports it).  The kernels/ folder stays at the repository's top:
pyproject's package-dir maps it for a wheel or an editable install, and in a
checkout on PYTHONPATH deviceop/__init__.py serves it under that name.

The install is checked through setuptools' own build of the wheel's contents
(``build_py``, well under a second; ``bdist_wheel`` adds only the dist-info)."""
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACKED_FOR_THE_BUILD = ("pyproject.toml", "README.md", "deviceop", "kernels")

# Run in a fresh interpreter without site processing: no .pth file runs, so no
# other checkout's editable install can answer for ``kernels`` or ``deviceop``;
# the dependencies come from this environment's site-packages, put on the path plainly.
PROBE = """
import importlib.util, sys
from pathlib import Path
import deviceop.kernels
from deviceop.kernels import rms_norm
import deviceop.kernels.llama_proj
from deviceop.kernels.conv import ConvGnAct
print(Path(deviceop.kernels.__file__).parent)
print(Path(rms_norm.source_path).parent)
print(importlib.util.find_spec("kernels"))
"""


def run_probe(pythonpath, cwd):
    deps = [*site.getsitepackages(), site.getusersitepackages()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*pythonpath, *deps]))}
    done = subprocess.run([sys.executable, "-S", "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")[:3]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """What a wheel of this checkout installs (its purelib), built by setuptools from a copy."""
    pytest.importorskip("setuptools", reason="building the package needs setuptools")
    tmp = tmp_path_factory.mktemp("build")
    src, lib = tmp / "src", tmp / "lib"
    src.mkdir()
    for name in TRACKED_FOR_THE_BUILD:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    done = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                           "--build-lib", str(lib)], cwd=src, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return lib


def test_the_wheel_installs_only_deviceop_with_the_kernel_library_inside(built):
    assert sorted(p.name for p in built.iterdir()) == ["deviceop"]
    expected = {f"deviceop/{p.relative_to(ROOT / 'deviceop')}" for p in (ROOT / "deviceop").rglob("*")
                if p.suffix in (".py", ".cu", ".cuh")}
    expected |= {f"deviceop/kernels/{p.relative_to(ROOT / 'kernels')}" for p in (ROOT / "kernels").rglob("*")
                 if p.suffix in (".py", ".cu", ".cuh")}
    shipped = {str(p.relative_to(built)) for p in built.rglob("*") if p.is_file()}
    assert expected <= shipped, f"missing from the wheel (pyproject's packages / package-data): {expected - shipped}"


def test_the_installed_package_imports_deviceop_kernels_and_no_top_level_kernels(built, tmp_path):
    library, sources, top_level = run_probe([built], cwd=tmp_path)
    assert library == sources == str(built / "deviceop" / "kernels")  # the .cu files beside the declarations
    assert top_level == "None"


def test_a_checkout_on_pythonpath_imports_deviceop_kernels_from_the_kernels_folder(tmp_path):
    """How scripts/gpu-check runs: nothing installed, the repository root on PYTHONPATH."""
    library, sources, _ = run_probe([ROOT], cwd=tmp_path)
    assert library == sources == str(ROOT / "kernels")


def test_the_checkout_finder_serves_deviceop_kernels_and_nothing_else():
    import importlib

    finders = [f for f in sys.meta_path if hasattr(f, "kernels_folder")]
    assert [f.kernels_folder for f in finders] == [str(ROOT / "kernels")]
    assert finders[0].find_spec("deviceop.kernels").origin == str(ROOT / "kernels" / "__init__.py")
    assert finders[0].find_spec("kernels") is None and finders[0].find_spec("deviceop.examples") is None
    tiles = importlib.import_module("deviceop.kernels.conv_tiles")
    assert tiles.__file__ == str(ROOT / "kernels" / "conv_tiles.py")


def test_cuda_core_is_a_dependency_of_the_benchmarks_only():
    """deviceop reaches the driver through cuda.bindings (and CuPy's launch wrapper); cuda.core is
    the benchmarks' baseline (the bench extra).  A module of the library that imported it would
    fail on an install without the extra: declare it in dependencies then."""
    import ast
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("cuda-core")]
    assert [d for d in project["optional-dependencies"]["bench"] if d.startswith("cuda-core")]
    importing = []
    for path in [*(ROOT / "deviceop").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n == "cuda.core" or n.startswith("cuda.core.") for n in names) or \
                    isinstance(node, ast.ImportFrom) and node.module == "cuda" and \
                    any(a.name == "core" for a in node.names):
                importing.append(str(path.relative_to(ROOT)))
    assert not importing, f"these import cuda.core, which deviceop does not depend on: {importing}"
