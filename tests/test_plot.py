"""bench/plot.py draws the docs' figures from the recorded results, and says what is missing."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIGURES = {"token_loop.png", "exercise2_speedup.png", "conv_gn_act.png", "graph_cache.png"}


def plot(results: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "plot.py"), "--results", str(results), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)


def test_every_figure_the_docs_show_is_drawn_from_the_recorded_results(tmp_path):
    pytest.importorskip("matplotlib", reason="bench/plot.py needs matplotlib: pip install -e '.[plot]'")
    proc = plot(ROOT / "bench" / "results", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    drawn = {p.name for p in tmp_path.glob("*.png")}
    assert drawn == FIGURES
    shown = "".join((ROOT / f).read_text() for f in ("README.md", "docs/tutorial.md", "docs/conv.md", "docs/dynamic.md"))
    assert all(f"img/{name}" in shown for name in FIGURES)
    assert all((ROOT / "docs" / "img" / name).exists() for name in FIGURES)


def test_a_results_file_without_what_a_figure_needs_is_named_and_the_others_are_drawn(tmp_path):
    pytest.importorskip("matplotlib", reason="bench/plot.py needs matplotlib: pip install -e '.[plot]'")
    results = tmp_path / "results"
    results.mkdir()
    token = json.loads((ROOT / "bench" / "results" / "token_loop.json").read_text())
    del token["exercise2_speedup_vs_layers"]
    (results / "token_loop.json").write_text(json.dumps(token))
    shutil.copy(ROOT / "bench" / "results" / "graph_cache.json", results)
    proc = plot(results, tmp_path / "img")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "has no exercise2_speedup_vs_layers" in proc.stdout and "no " in proc.stdout and "conv_gn_act.json" in proc.stdout
    assert {p.name for p in (tmp_path / "img").glob("*.png")} == {"token_loop.png", "graph_cache.png"}
