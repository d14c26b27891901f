"""``python -m deviceop info``: what a user pastes into a bug report."""
from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import sys


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


def info_lines() -> list[str]:
    import deviceop as dop
    from deviceop import compile as comp
    from deviceop.runtime import driver

    lines = [f"deviceop        {dop.__version__}", f"python          {platform.python_version()} ({sys.executable})"]
    device = dop.Device(0)
    lines.append(f"device          {device.describe()}")
    lines.append(f"cuda driver     {driver.driver_version() or 'none'}")
    try:
        archs = comp.supported_archs()
        lines.append(f"nvrtc           {comp.nvrtc_version()} (sm_{archs[0]} .. sm_{archs[-1]})")
    except dop.CompileError as exc:
        lines.append(f"nvrtc           unavailable: {exc}")
    for dist in ("cuda-bindings", "cuda-core", "cuda-pathfinder", "cupy-cuda13x", "numpy", "ml_dtypes", "torch"):
        lines.append(f"{dist:<16}{_version(dist)}")
    lines.append(f"include dirs    {', '.join(comp.toolkit_include_dirs()) or 'none found'}")
    stats = comp.cache_stats()
    state = "" if comp.disk_cache_enabled() else " (disk cache disabled by DEVICEOP_DISK_CACHE)"
    lines.append(f"compile cache   {stats['dir']}: {stats['entries']} entries, {stats['bytes'] / 2**20:.1f} MiB{state}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deviceop")
    parser.add_argument("command", choices=["info"], help="info: versions, device and cache, for bug reports")
    parser.parse_args(argv)
    print("\n".join(info_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
