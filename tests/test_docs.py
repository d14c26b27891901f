"""Every Python code block in README.md and docs/*.md runs, here on the reference device
and on the GPU under gpu-check."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def blocks():
    for doc in DOCS:
        for i, code in enumerate(BLOCK.findall(doc.read_text())):
            yield pytest.param(code, id=f"{doc.relative_to(ROOT)}#{i}")


@pytest.mark.parametrize("code", list(blocks()))
def test_doc_block_runs(code):
    exec(compile(code, "<doc>", "exec"), {"__name__": "__doc_test__"})


def test_readme_has_exactly_the_ci_commands():
    text = (ROOT / "README.md").read_text()
    assert len(re.findall(r"^pip install ", text, re.M)) == 1
    assert len(re.findall(r"^python -m pytest", text, re.M)) == 1
