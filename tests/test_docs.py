"""Every Python code block in README.md and docs/*.md runs, here on the reference device
and on the GPU under gpu-check."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_doc_code_runs(doc):
    """A document's Python blocks run in order in one namespace, as a reader would run them."""
    namespace = {"__name__": "__doc_test__"}
    blocks = BLOCK.findall(doc.read_text())
    assert blocks, f"{doc.name} has no Python code block"
    for i, code in enumerate(blocks):
        exec(compile(code, f"{doc.name}, Python block {i}", "exec"), namespace)


def test_readme_has_exactly_the_ci_commands():
    text = (ROOT / "README.md").read_text()
    assert len(re.findall(r"^pip install ", text, re.M)) == 1
    assert len(re.findall(r"^python -m pytest", text, re.M)) == 1
