"""What a CUDA source reads besides itself, for the compile cache's key (compile.py): the
headers in the user's include directories, and every file the source ``#include``s wherever
NVRTC finds it.  Contents are digested once per file version (memoized on mtime and size)."""
from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

_HEADER_SUFFIXES = (".h", ".hpp", ".cuh", ".hh", ".inl", ".cu")
_dir_digests: dict[tuple, str] = {}


def dir_digest(path: str) -> str:
    """Digest of every header under a user include directory (memoized on mtimes)."""
    files = sorted(p for p in Path(path).rglob("*") if p.suffix in _HEADER_SUFFIXES and p.is_file())
    stamp = (path, tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files))
    digest = _dir_digests.get(stamp)
    if digest is None:
        h = hashlib.sha256()
        for p in files:
            h.update(str(p.relative_to(path)).encode() + b"\0" + p.read_bytes() + b"\0")
        digest = _dir_digests[stamp] = h.hexdigest()
    return digest


_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\r\n]+)[>"]', re.M)
_file_facts: dict[tuple, tuple] = {}


def _facts(path: str) -> tuple | None:
    """``(digest, includes)`` of a regular file (memoized on its mtime and size): its
    SHA-256 and its ``#include`` directives as ``(quoted, name)``; None if it is no file."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    stamp = (path, st.st_mtime_ns, st.st_size)
    facts = _file_facts.get(stamp)
    if facts is None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        facts = _file_facts[stamp] = (hashlib.sha256(data).hexdigest(), _directives(data))
    return facts


def _directives(text: bytes) -> tuple:
    return tuple((q == b'"', n.decode(errors="replace").strip()) for q, n in _INCLUDE.findall(text))


_OPTION_PATHS = {"-I": "dir", "--include-path": "dir", "-include": "file", "--pre-include": "file"}


def _option_paths(options) -> tuple[list[str], list[str]]:
    """The include directories and pre-included files ``options`` name (``-I<dir>``, ``-I <dir>``,
    ``--include-path=<dir>``, ``-include=<file>``, ``--pre-include <file>``): NVRTC searches them as it
    does include_dirs, so the key covers what they hold."""
    dirs, files = [], []
    options = list(options)
    for i, o in enumerate(options):
        for flag, kind in _OPTION_PATHS.items():
            if o == flag and i + 1 < len(options):
                value = options[i + 1]
            elif o.startswith(flag + "=") or (flag == "-I" and o.startswith("-I") and len(o) > 2):
                value = o[len(flag) + (o[len(flag)] == "="):]
            else:
                continue
            (dirs if kind == "dir" else files).append(value)
            break
    return dirs, files


def includes_digest(source: str, filename: str, user_dirs: list[str], toolkit_dirs: list[str],
                     options=()) -> str:
    """Digest of every file ``source`` includes, transitively, found where NVRTC looks: a quoted
    name beside the including file (the top source's: the working directory, for its file name
    is relative), then the include directories in order; any suffix (``.inc``, none), any path
    (``../common.cuh``).  The directory digests miss these.  A file found first in a toolkit
    directory is the toolkit's (keyed by its path and the NVRTC version).  Every directive is
    followed, taken or not by the preprocessor: a superset, never a stale key; a name built by
    a macro (``#include HEADER``) is not, as the directory digests cover only headers there."""
    h = hashlib.sha256()
    toolkit = set(toolkit_dirs)
    option_dirs, pre_includes = _option_paths(options)
    searched = [*map(os.path.abspath, option_dirs), *user_dirs, *toolkit_dirs]  # NVRTC's order: the options first
    top = os.path.dirname(os.path.abspath(filename))
    todo = [(top, _directives(source.encode(errors="replace"))), (top, tuple((True, f) for f in pre_includes))]
    seen: set = set()
    resolved_names: dict = {}  # (directory or None, name) -> the file NVRTC would open, or None
    while todo:
        here, includes = todo.pop()
        for quoted, name in includes:
            key = (here if quoted else None, name)
            if key in resolved_names:
                continue
            found = resolved_names[key] = None
            for d in ([""] if os.path.isabs(name) else [here, *searched] if quoted else searched):
                path = os.path.join(d, name)
                facts = _facts(path)
                if facts is None:
                    continue
                if d not in toolkit:
                    found = resolved_names[key] = os.path.normpath(path)
                break
            if found is not None and found not in seen:
                seen.add(found)
                h.update(found.encode() + b"\0" + facts[0].encode() + b"\0")
                todo.append((os.path.dirname(found), facts[1]))
    return h.hexdigest()
