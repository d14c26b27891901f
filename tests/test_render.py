"""A captured graph drawn as a picture: Graphviz's dot when it is on PATH, a
StateError that says how to get it when it is not."""
import os
import stat

import numpy as np
import pytest

import deviceop as dop
from deviceop.kernels import affine


def small_graph(stream):
    x = dop.from_numpy(np.arange(256, dtype=np.float32), stream=stream)
    y, z = dop.empty(256, stream=stream), dop.empty(256, stream=stream)
    return dop.zip_(affine(y.partition([128]), x, 2.0, 1.0).generics([128]),
                    affine(z.partition([128]), y, 3.0, 0.0).generics([128])).graph_on(stream)


def fake_dot(tmp_path):
    """A `dot` that records its arguments and writes its input (the DOT) to -o."""
    script = tmp_path / "bin" / "dot"
    script.parent.mkdir()
    script.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\nwhile [ "$1" != "-o" ]; do shift; done\n'
                      'cat > "$2"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script.parent


def test_render_hands_the_dot_text_to_graphviz(stream, tmp_path, monkeypatch):
    bindir = fake_dot(tmp_path)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    graph = small_graph(stream)
    out = graph.render(tmp_path / "g.svg")
    assert out.read_text() == graph.to_dot()
    assert (bindir / "args").read_text().split()[:1] == ["-Tsvg"]
    graph.render(tmp_path / "g.pic", format="png")
    assert (bindir / "args").read_text().split()[:1] == ["-Tpng"]


def test_render_without_graphviz_says_how_to_get_it(stream, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot here
    with pytest.raises(dop.StateError, match="needs Graphviz's `dot` on PATH.*to_dot"):
        small_graph(stream).render(tmp_path / "g.svg")


def test_render_refuses_a_format_it_cannot_write(stream, tmp_path):
    with pytest.raises(dop.StateError, match="pick a format of svg, png, pdf"):
        small_graph(stream).render(tmp_path / "g.txt")
