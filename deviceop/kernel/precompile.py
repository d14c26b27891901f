"""Compiling many kernels ahead of time, and the progress bar long work shows.

``precompile`` is for start-up and CI (the conv configurations, a model's
kernels): nothing on the launch path calls it.  ``progress`` wraps an iterable
in a tqdm bar when stderr is a terminal and tqdm is installed, and is the
iterable itself otherwise (logs and pipes stay clean; tqdm stays optional)."""
from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed

from ..errors import LaunchError
from ..runtime.device import default_arch
from .signature import run_rule


def progress(iterable, *, total: int, desc: str):
    """``iterable`` behind a tqdm bar on a terminal; unchanged elsewhere or without tqdm."""
    isatty = getattr(sys.stderr, "isatty", None)
    if total < 2 or isatty is None or not isatty():
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:  # optional: no bar
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr)


def precompile(items, *, arch: str | None = None, threads: int | None = None) -> int:
    """Compile each ``(kernel, generics)`` of ``items`` (or a kernel without generics)
    to CUBIN for ``arch`` (default: the GPU this process uses, runtime.device.default_arch) in parallel threads, into the
    in-memory and on-disk compile caches, checking each against its declaration;
    returns how many were compiled.  A later launch loads the cached CUBIN.
    Every item's generics are checked (their kind, and the kernel's ``limits``)
    before any compiles; the first failure
    (e.g. a CompileError) is raised once the others have finished."""
    if hasattr(items, "check_compiled") or isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise LaunchError(f"precompile takes a list of (kernel, generics) pairs or kernels, got {items!r}: "
                          "write precompile([(kernel, [generics ...])])")
    work = []
    for item in items:
        kernel, generics = item if isinstance(item, tuple) and len(item) == 2 else (item, ())
        if not hasattr(kernel, "check_compiled"):
            raise LaunchError(f"precompile takes (kernel, generics) pairs or kernels, got {item!r}")
        fix = f"({kernel.name}, {{}})"
        given = kernel.generic_names or generics not in ((), [], None)  # generics for a kernel without: refused
        generics = kernel.check_generics(generics, fix) if given else ()
        limits = getattr(kernel, "limits", None)
        if limits is not None and kernel.generic_names:  # a launch refuses these generics: compile none of them
            run_rule(kernel, limits, generics, dict(zip(kernel.generic_names, generics)))
        work.append((kernel, generics))
    arch = arch if arch is not None else default_arch()
    workers = max(1, min(threads or os.cpu_count() or 1, len(work)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deviceop-precompile") as pool:
        futures = [pool.submit(kernel.check_compiled, arch, generics) for kernel, generics in work]
        for future in progress(as_completed(futures), total=len(futures), desc=f"compiling for {arch}"):
            future.result()
    return len(work)
