"""``python -m deviceop info``: what a user pastes into a bug report."""
from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import platform
import subprocess
import sys
from pathlib import Path

# the wheels whose versions decide what compiles: NVRTC, the CCCL headers, CUTLASS (the conv kernels)
COMPILER_WHEELS = ("nvidia-cuda-nvrtc", "nvidia-cuda-cccl", "nvidia-cutlass", "cuda-toolkit")


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        try:  # the GPU machine's packages may be importable without metadata
            mod = {"cuda-bindings": "cuda.bindings", "cuda-core": "cuda.core", "cupy-cuda13x": "cupy",
                   "cuda-pathfinder": "cuda.pathfinder"}.get(dist, dist)
            return getattr(__import__(mod, fromlist=["_"]), "__version__", "installed")
        except ImportError:
            return "not installed"


def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` with local changes) when deviceop runs from a git checkout."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():  # an installed wheel: no checkout to name
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # git missing or stuck: the line is left out
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") + f" ({root})"


def deviceop_variables() -> dict[str, str]:
    """The DEVICEOP_* environment variables in effect (docs/environment.md lists them all)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("DEVICEOP_")}


def info_lines() -> list[str]:
    import deviceop as dop
    from deviceop import compile as comp
    from deviceop.runtime import driver

    lines = [f"deviceop        {dop.__version__}", f"python          {platform.python_version()} ({sys.executable})",
             f"os              {platform.platform()}", f"cpu             {platform.machine() or 'unknown'}"]
    commit = git_commit()
    if commit:
        lines.append(f"git commit      {commit}")
    device = dop.Device(0)
    lines.append(f"device          {device.describe()}")
    lines.append(f"kernels         {device.what_runs}")
    lines.append(f"cuda driver     {driver.driver_version() or 'none'}")
    try:
        archs = comp.supported_archs()
        lines.append(f"nvrtc           {comp.nvrtc_version()} (sm_{archs[0]} .. sm_{archs[-1]})")
    except dop.CompileError as exc:
        lines.append(f"nvrtc           unavailable: {exc}")
    for dist in ("cuda-bindings", "cuda-core", "cuda-pathfinder", "cupy-cuda13x", *COMPILER_WHEELS, "numpy",
                 "ml_dtypes", "torch", "tqdm"):
        lines.append(f"{dist:<16}{_version(dist)}" if len(dist) < 16 else f"{dist} {_version(dist)}")
    lines.append(f"include dirs    {', '.join(comp.toolkit_include_dirs()) or 'none found'}")
    stats = comp.cache_stats()
    try:
        state = "" if comp.disk_cache_enabled() else " (disk cache disabled by DEVICEOP_DISK_CACHE)"
    except dop.ConfigError as exc:  # info is what a bug report pastes: say it, do not fail
        state = f" ({exc})"
    blocked = next((p for p in (Path(stats["dir"]), *Path(stats["dir"]).parents) if p.exists()), None)
    if blocked is not None and not blocked.is_dir():  # every compile warns of it; a bug report should say it too
        state += f" ({blocked} is a file, not a directory: nothing is cached on disk)"
    lines.append(f"compile cache   {stats['dir']}: {stats['entries']} entries, {stats['bytes'] / 2**20:.1f} MiB{state}")
    env = deviceop_variables()
    lines.append("environment     " + (" ".join(f"{k}={v}" for k, v in env.items()) or "no DEVICEOP_* variables set")
                 + " (docs/environment.md)")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deviceop")
    parser.add_argument("command", choices=["info"], help="info: versions, device and cache, for bug reports")
    parser.parse_args(argv)
    print("\n".join(info_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
