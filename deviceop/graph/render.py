"""A graph's DOT text rendered to a picture by Graphviz's ``dot``, when it is installed."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from ..errors import StateError

FORMATS = ("svg", "png", "pdf")


def render_dot(text: str, path, fmt: str | None = None) -> Path:
    """Write ``text`` (DOT) as a picture at ``path``; the format is ``fmt`` or the
    path's suffix.  Graphviz is not a dependency: without its ``dot`` on PATH this
    is a StateError that says how to get it (or to keep the DOT and render it elsewhere)."""
    path = Path(path)
    fmt = (fmt or path.suffix.lstrip(".")).lower()
    if fmt not in FORMATS:
        raise StateError(f"render({str(path)!r}): pick a format of {', '.join(FORMATS)} (from the file's suffix "
                         f"or format=...), got {fmt or 'none'!r}")
    dot = shutil.which("dot")
    if dot is None:
        raise StateError("rendering a graph needs Graphviz's `dot` on PATH (apt-get install graphviz, brew install "
                         "graphviz or conda install graphviz); or write the DOT with graph.to_dot('graph.dot') and "
                         "render it anywhere")
    done = subprocess.run([dot, f"-T{fmt}", "-o", str(path)], input=text, text=True, capture_output=True)
    if done.returncode:
        raise StateError(f"Graphviz's dot could not render the graph ({done.returncode}): {done.stderr.strip()[:300]}")
    return path
